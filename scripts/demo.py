#!/usr/bin/env python
"""AdamW vs SAM vs VASSO on a small translation task, end to end, in a few CPU minutes.

    python scripts/demo.py                  # writes everything under runs/demo/

1. generates a deterministic toy German->English parallel corpus
   (``fairseq_vasso.toy_corpus``: articles and case, verb agreement, verb-second and
   verb-final word order, perfect tense, negation; 3,000 training pairs);
2. prepares it with the IWSLT-14 pipeline's own steps (``fairseq_vasso.iwslt14``:
   Moses tokenization with sacremoses, lowercasing, joint BPE with subword-nmt,
   ``fairseq-preprocess --joined-dictionary``);
3. trains a tiny transformer with stock ``fairseq-train --user-dir fairseq_vasso``,
   once per method: ``--optimizer adam`` (AdamW), ``--optimizer sam --rho R`` and
   ``--optimizer vasso --rho R --theta 0.4``: same seed, same number of updates,
   otherwise identical commands (the recipe's settings, scaled down: lr 2e-3,
   warmup 200, dropout 0.1);
4. scores ``checkpoint_best.pt`` of each with ``vasso-bleu``'s code (``fairseq_vasso.bleu``)
   (``fairseq-generate --beam 5 --remove-bpe``, with the length limits of fairseq
   README's validation BLEU, ``--max-len-a 1.2 --max-len-b 10``: fairseq's tokenized
   BLEU and sacreBLEU) and prints the comparison table, with the paper's IWSLT-14 numbers
   beside it for reference (a different, much larger task), and the sharpness
   diagnostics fairseq_vasso logs;
5. plots them (``vasso-plot``, ``plugins.plot.diagnostics``: ||eps_t - eps_{t-1}|| and the
   perturbed-loss gap over updates, SAM and VASSO on the same axes, the paper's
   Fig. 4) into ``runs/demo/diagnostics.png``, and draws the paper's Fig. 3
   (``plugins.plot.sphere``) into ``runs/demo/adversaries.png``.

The three training runs go at once (``--jobs 3``, one thread each): on 2 CPU cores
AdamW (one pass per update) finishes first and the two-pass runs then have a core
each, so both cores stay busy to the end (with two at once, AdamW would run alone
on one core at the end). Runs are judged by their logs: a fairseq-train that logged
"done training" is a success even where the process aborts at exit.
"""

import argparse
import os
import re
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor

DEMO_METHODS = ["adamw", "sam", "vasso0.4"]



def tiny_model(embed_dim=128, layers=2, lr=2e-3, warmup=200):
    """A tiny transformer (heads: 4) with the recipe's training settings, scaled down."""
    settings = list(TRAIN_SETTINGS)
    settings[settings.index("--lr") + 1] = str(lr)
    settings[settings.index("--warmup-updates") + 1] = str(warmup)
    return [
        "--task", "translation", "--arch", "transformer", "--share-decoder-input-output-embed",
        "--encoder-layers", str(layers), "--decoder-layers", str(layers),
        "--encoder-embed-dim", str(embed_dim), "--decoder-embed-dim", str(embed_dim),
        "--encoder-ffn-embed-dim", str(2 * embed_dim), "--decoder-ffn-embed-dim", str(2 * embed_dim),
        "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    ] + settings


TRAIN_SETTINGS = [
    "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
    "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "200",
    "--weight-decay", "0.0001", "--dropout", "0.1",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "2048", "--num-workers", "0", "--log-interval", "50",
]


def check_dependencies():
    missing = []
    for mod, pip_name in [("fairseq", "fairseq-fixed"), ("sacremoses", "sacremoses"),
                          ("subword_nmt", "subword-nmt"), ("sacrebleu", "sacrebleu")]:
        try:
            __import__(mod)
        except ImportError:
            missing.append(pip_name)
    if missing:
        raise SystemExit("missing Python packages: %s (pip install %s)" % (", ".join(missing), " ".join(missing)))


def prepare(out, n_train, n_valid, n_test, bpe_merges, seed, log):
    from fairseq_vasso import iwslt14 as prep
    from fairseq_vasso import toy_corpus

    raw = os.path.join(out, "raw")
    toy_corpus.write_corpus(raw, n_train, n_valid, n_test, seed=seed)
    tok, bpe_dir, bin_dir = (os.path.join(out, d) for d in ("tok", "bpe", "data-bin"))
    for d in (tok, bpe_dir):
        os.makedirs(d, exist_ok=True)
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            lines = prep.read_lines(os.path.join(raw, "%s.%s" % (split, lang)))
            prep.write_lines(os.path.join(tok, "%s.%s" % (split, lang)),
                             prep.lowercase(prep.tokenize(lines, lang)))
    code = os.path.join(bpe_dir, "code")
    prep.learn_bpe([os.path.join(tok, "train.de"), os.path.join(tok, "train.en")], code, bpe_merges)
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            prep.apply_bpe(code, os.path.join(tok, "%s.%s" % (split, lang)), os.path.join(bpe_dir, "%s.%s" % (split, lang)))
    with open(os.path.join(out, "preprocess.log"), "w") as f:
        prep.binarize(bpe_dir, bin_dir, workers=1, joined=True, log=f)
    log("corpus: %d/%d/%d sentence pairs, BPE %d merges, binarized in %s" % (n_train, n_valid, n_test, bpe_merges, bin_dir))
    return bin_dir, os.path.join(tok, "test.en")


def train_one(data, method, out, args, user_dir, threads):
    from fairseq_vasso import nmt as nmt_common
    from fairseq_vasso.nmt import train_command

    save_dir = os.path.join(out, "runs", method, "seed%d" % args.seed)
    extra = ["--max-update", str(args.max_update)]
    if args.cpu:
        extra.append("--cpu")
    cmd = train_command(data, method, args.seed, save_dir, rho=args.rho, max_epoch=0, user_dir=user_dir,
                        extra=extra, settings=tiny_model(args.embed_dim, args.layers, args.lr, args.warmup_updates))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log = os.path.join(save_dir, "train.log")
    start = time.time()
    rc = nmt_common.run_logged(cmd, log, env=env)
    ok, note = nmt_common.judge_train(rc, log)
    return method, save_dir, ok, note, time.time() - start


def last_epoch_stats(log_path):
    """The key/value pairs of the last 'train | epoch' and 'valid | epoch' lines of a fairseq log."""
    stats = {}
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.search(r"\| (train|valid) \| epoch \d+ (.*)$", line)
            if m:
                kind = m.group(1)
                for part in m.group(2).split("|"):
                    kv = part.strip().split(" ", 1)
                    if len(kv) == 2:
                        stats["%s_%s" % (kind, kv[0])] = kv[1]
    return stats


def diagnostics_table(methods, out, seed):
    from fairseq_vasso import nmt as nmt_common

    cols = [("train_loss", "train loss"), ("valid_loss", "valid loss"), ("valid_best_loss", "best valid loss"),
            ("train_ascent_norm", "ascent norm"), ("train_loss_gap", "loss gap"),
            ("train_sharpness", "sharpness ρ‖v_t‖"), ("train_stability", "stability ‖ε_t − ε_{t−1}‖"),
            ("train_two_pass", "two-pass fraction"), ("train_wall", "train wall s")]
    lines = ["| Method | " + " | ".join(c[1] for c in cols) + " |", "|" + "|".join(["---"] * (len(cols) + 1)) + "|"]
    for method in methods:
        stats = last_epoch_stats(os.path.join(out, "runs", method, "seed%d" % seed, "train.log"))
        label = nmt_common.METHODS[method].label
        lines.append("| %s | %s |" % (label, " | ".join(stats.get(c[0], "-") for c in cols)))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="everything goes here (removed and rewritten)")
    p.add_argument("--methods", nargs="+", default=DEMO_METHODS)
    p.add_argument("--rho", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-update", type=int, default=400, help="updates per method")
    p.add_argument("--train", type=int, default=3000, help="training sentence pairs")
    p.add_argument("--valid", type=int, default=200)
    p.add_argument("--test", type=int, default=300)
    p.add_argument("--bpe-merges", type=int, default=300)
    p.add_argument("--embed-dim", type=int, default=128, help="model width (ffn: twice that)")
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-updates", type=int, default=200)
    p.add_argument("--generate-args", default="--max-len-a 1.2 --max-len-b 10",
                   help="extra fairseq-generate arguments (default: the length limits of fairseq README's "
                        "validation BLEU, which keep a badly trained model from generating 200 tokens)")
    p.add_argument("--jobs", type=int, default=3,
                   help="training runs at once (3 on 2 cores: AdamW, the cheapest, shares them with the two-pass "
                        "runs, which then have a core each)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: cores / jobs)")
    p.add_argument("--cpu", action="store_true", help="train on CPU even where CUDA is available")
    p.add_argument("--user-dir", default=None, help="fairseq_vasso folder (default: the repository's or installed one)")
    args = p.parse_args(argv)

    check_dependencies()
    import shutil

    from fairseq_vasso import bleu as eval_bleu
    from fairseq_vasso import nmt as nmt_common

    t0 = time.time()

    def log(msg):
        print("[%5.0f s] %s" % (time.time() - t0, msg), flush=True)

    unknown = [m for m in args.methods if m not in nmt_common.METHODS]
    if unknown:
        p.error("unknown methods %s (choose from %s)" % (unknown, ", ".join(nmt_common.METHODS)))
    user_dir = args.user_dir or nmt_common.default_user_dir()
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)

    data, ref_file = prepare(out, args.train, args.valid, args.test, args.bpe_merges, args.seed, log)

    jobs = max(1, min(args.jobs, len(args.methods)))
    threads = args.threads or max(1, (os.cpu_count() or 1) // jobs)  # 2 cores, 3 jobs -> 1 thread each
    # the two-pass methods first: they take about twice as long as AdamW
    order = sorted(args.methods, key=lambda m: m == "adamw")
    log("training %s, %d updates each, %d at once, %d thread(s) each" % (", ".join(order), args.max_update, jobs, threads))
    failed = []
    with ThreadPoolExecutor(jobs) as pool:
        for method, save_dir, ok, note, secs in pool.map(
                lambda m: train_one(data, m, out, args, user_dir, threads), order):
            log("%s: %s (%.0f s) -> %s" % (method, note, secs, save_dir))
            if not ok:
                print(nmt_common.tail(os.path.join(save_dir, "train.log")), file=sys.stderr)
                failed.append(method)
    if failed:
        raise SystemExit("training failed: %s" % ", ".join(failed))

    log("evaluating with fairseq-generate --beam 5 --remove-bpe %s" % args.generate_args)
    cpu = True if args.cpu else None
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))

    def score(method):
        ckpt = os.path.join(out, "runs", method, "seed%d" % args.seed, "checkpoint_best.pt")
        r = eval_bleu.evaluate_checkpoint(data, ckpt, user_dir=user_dir, cpu=cpu, ref_file=ref_file,
                                          extra=shlex.split(args.generate_args), env=env)
        r.update(method=method, seed=args.seed)
        return r

    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(score, args.methods))
    table = eval_bleu.markdown_table(results, paper_column=True)
    diag = diagnostics_table(args.methods, out, args.seed)
    text = ("\nToy de-en demo: test BLEU after %d updates (seed %d, rho %g; %d test sentences)\n\n%s\n"
            "The paper's column is IWSLT-14 de-en (a far larger task), for reference only.\n"
            "fairseq BLEU: tokenized BLEU4 of fairseq-generate --beam 5 --remove-bpe %s; "
            "sacreBLEU: %s on detokenized text.\n\n"
            "Last epoch's training diagnostics (fairseq_vasso's log keys; '-' where a method has none):\n\n%s"
            % (args.max_update, args.seed, args.rho, results[0]["n"], table, args.generate_args,
               results[0]["sacrebleu_signature"], diag))
    print(text)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(text)
    # the paper's Fig. 4 (stability) and the loss gap for these runs, and its Fig. 3
    from plugins.plot import diagnostics as plot_diagnostics
    from plugins.plot import sphere as adversary_sphere

    runs = [os.path.join(out, "runs", m, "seed%d" % args.seed) for m in args.methods if m != "adamw"]
    if runs:
        png = os.path.join(out, "diagnostics.png")
        plot_diagnostics.main(runs + ["-o", png, "--title", "demo: toy de-en, seed %d" % args.seed])
        log("diagnostics plot (stability and loss gap over updates): %s" % png)
    adversary_sphere.main(["-o", os.path.join(out, "adversaries.png")])
    log("done; table in %s, plots in %s" % (os.path.join(out, "results.md"), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
