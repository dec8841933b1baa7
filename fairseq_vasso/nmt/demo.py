#!/usr/bin/env python
"""AdamW vs SAM vs VASSO on a small translation task with noisy training targets, 3 seeds each.

    .venv/bin/python scripts/demo.py        # writes everything under runs/demo/

The setting is chosen for a reason (docs/translation.md, "Why this setting"): the
paper's evidence for VASSO is strongest under label noise (its tab.lbnoise), and a
flatness method only has something to do where the model can fit what does not
generalize. So half of 400 training pairs are misaligned (their English side is the
English side of another training pair: a fluent, wrong translation), valid and test
keep clean references, and every run trains well past AdamW's best valid loss. The
test BLEU is that of the last checkpoint, the model the training budget ends with.

1. generates a deterministic toy German->English parallel corpus
   (``fairseq_vasso.nmt.toy_corpus``: articles and case, verb agreement, verb-second and
   verb-final word order, perfect tense, negation) and misaligns a fraction of the
   training pairs (``toy_corpus.corrupt_targets``);
2. prepares it with the IWSLT-14 pipeline's own steps (``fairseq_vasso.nmt.iwslt14``:
   Moses tokenization with sacremoses, lowercasing, joint BPE with subword-nmt,
   ``fairseq-preprocess --joined-dictionary``);
3. trains a tiny transformer with stock ``fairseq-train --user-dir fairseq_vasso``,
   once per method and seed: ``--optimizer adam`` (AdamW), ``--optimizer sam --rho R``
   and ``--optimizer vasso --rho R --theta 0.4``: same number of updates, otherwise
   identical commands (the recipe's settings, scaled down); the corpus and its noise
   are the same for every run, the seed is fairseq's ``--seed``;
4. scores each run's ``checkpoint_last.pt`` with ``vasso-bleu``'s own loop (``fairseq_vasso.nmt.bleu.score``)
   (``fairseq-generate --beam 5 --remove-bpe``, with the length limits of fairseq
   README's validation BLEU, ``--max-len-a 1.2 --max-len-b 10``: fairseq's tokenized
   BLEU and sacreBLEU) and prints the table: mean ± std per method beside the per-seed
   values, the last and best valid loss, fairseq_vasso's loss gap and stability, and
   whether the differences between methods exceed the spread over seeds; then a
   per-run table of the training diagnostics, and the ``vasso-bleu`` command that gives
   the same BLEU columns when run by hand;
5. plots the diagnostics (``vasso-plot``, ``plugins.lab.plot.diagnostics``: ||eps_t - eps_{t-1}|| and
   the perturbed-loss gap over updates, SAM and VASSO on the same axes, the paper's
   Fig. 4) into ``runs/demo/diagnostics.png``, and draws the paper's Fig. 3
   (``plugins.lab.plot.sphere``) into ``runs/demo/adversaries.png``.

Each run is scored as soon as it is trained; its result goes to its folder
(``runs/METHOD/seedN/result.json``) and the table (``results.md``) and plot are rewritten,
marked partial until every run is done. Interrupted (Ctrl-C or SIGTERM: every fairseq
process stops with it), the same command finishes what is left: the corpus and the
finished runs are kept, an unfinished run starts again from its beginning, so the table
is the one an uninterrupted demo gives. ``--out`` records the settings (``demo.json``);
other settings there are refused, and ``--restart`` removes the folder and starts over.

Every few seconds it prints where each running job is, the elapsed time and an
estimate of what remains; at the end, the CPU time used, which on a shared machine
says more than the wall time (on 2 idle cores the demo takes about CPU time / 2).
Runs go two at a time (``--jobs``, one thread each), the two-pass runs first, so both
cores stay busy to the end. Runs are judged by their logs: a fairseq-train that logged
"done training" is a success even where the process aborts at exit.
"""

import argparse
import contextlib
import io
import json
import os
import re
import resource
import shlex
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from plugins.lab.tables import fmt_mean_std, mean_std

DEMO_METHODS = ["adamw", "sam", "vasso0.4"]
# torch's, printed by every process that imports fairseq (fairseq decorates functions with
# torch.jit.script): not ours and nothing a demo user can act on. Importing fairseq_vasso
# (before fairseq) silences it in this process; the fairseq processes the demo starts get
# the same filter through PYTHONWARNINGS, since they import fairseq before the user-dir.
TORCH_JIT_WARNING = "`torch.jit.script` is deprecated"


def tiny_model(embed_dim=128, layers=2, lr=2e-3, warmup=200, dropout=0.1):
    """A tiny transformer (heads: 4) with the recipe's training settings, scaled down."""
    settings = list(TRAIN_SETTINGS)
    for flag, value in (("--lr", lr), ("--warmup-updates", warmup), ("--dropout", dropout)):
        settings[settings.index(flag) + 1] = str(value)
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
    "--max-tokens", "2048", "--num-workers", "0",
    # train_inner lines (the progress and the diagnostics plot read them) every 10 updates
    "--log-interval", "10",
]


def passes(method):
    """Forward/backward passes per update: the unit the demo budgets and estimates time in."""
    return 1 if method == "adamw" else 2


def quiet_children_env(env=None):
    """env (default os.environ) with the torch.jit.script FutureWarning filtered in child
    Pythons, and tqdm's progress bars off (TQDM_DISABLE) in whatever library they call."""
    env = dict(os.environ if env is None else env)
    rule = "ignore:%s:FutureWarning" % TORCH_JIT_WARNING
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), rule]))
    env["TQDM_DISABLE"] = "1"
    return env


def check_dependencies():
    import importlib.util

    missing = [pip_name for mod, pip_name in [("fairseq", "fairseq-fixed"), ("sacremoses", "sacremoses"),
                                              ("subword_nmt", "subword-nmt"), ("sacrebleu", "sacrebleu")]
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise SystemExit("missing Python packages: %s (pip install %s)" % (", ".join(missing), " ".join(missing)))


def prepare(out, args, log):
    """Stage 1; kept once complete (``prepared`` marker), redone from scratch otherwise."""
    from fairseq_vasso.nmt import iwslt14 as prep
    from fairseq_vasso.nmt import toy_corpus

    raw = os.path.join(out, "raw")
    marker = os.path.join(out, "prepared")
    if os.path.exists(marker):
        log("corpus and preprocessing: done before, kept (%s)" % os.path.join(out, "data-bin"))
        return os.path.join(out, "data-bin"), os.path.join(out, "tok", "test.en")
    for d in ("raw", "tok", "bpe", "data-bin"):  # an interrupted stage 1: from its start
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    toy_corpus.write_corpus(raw, args.train, args.valid, args.test, seed=args.corpus_seed,
                            train_noise=args.train_noise)
    tok, bpe_dir, bin_dir = (os.path.join(out, d) for d in ("tok", "bpe", "data-bin"))
    for d in (tok, bpe_dir):
        os.makedirs(d, exist_ok=True)
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            lines = prep.read_lines(os.path.join(raw, "%s.%s" % (split, lang)))
            prep.write_lines(os.path.join(tok, "%s.%s" % (split, lang)),
                             prep.lowercase(prep.tokenize(lines, lang)))
    code = os.path.join(bpe_dir, "code")
    prep.learn_bpe([os.path.join(tok, "train.de"), os.path.join(tok, "train.en")], code, args.bpe_merges)
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            prep.apply_bpe(code, os.path.join(tok, "%s.%s" % (split, lang)), os.path.join(bpe_dir, "%s.%s" % (split, lang)))
    with open(os.path.join(out, "preprocess.log"), "w") as f:
        prep.binarize(bpe_dir, bin_dir, workers=1, joined=True, log=f)
    write_json(marker, {"data-bin": bin_dir})
    log("corpus: %d/%d/%d sentence pairs, %.0f %% of the training targets misaligned, BPE %d merges, binarized in %s"
        % (args.train, args.valid, args.test, 100 * args.train_noise, args.bpe_merges, bin_dir))
    return bin_dir, os.path.join(tok, "test.en")


def write_json(path, obj):
    """Writes ``obj`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def run_dir(out, method, seed):
    return os.path.join(out, "runs", method, "seed%d" % seed)


def result_path(out, method, seed):
    """A run's scored result: written once the run is trained and scored, never before."""
    return os.path.join(run_dir(out, method, seed), "result.json")


# the arguments that decide the results (the others say how to run: --out, --jobs, ...)
SETTINGS = ("methods", "seeds", "rho", "max_update", "train", "train_noise", "valid", "test", "corpus_seed",
            "bpe_merges", "embed_dim", "layers", "lr", "warmup_updates", "dropout", "checkpoint",
            "generate_args", "cpu")


def settings_of(args):
    return {key: getattr(args, key) for key in SETTINGS}


def open_out(out, args, log):
    """Makes ``out`` ready: new (settings recorded in demo.json), resumed (the same settings),
    or emptied first with --restart. Refuses, before any work, a folder of other settings or
    one that is not a demo's. Returns the number of finished runs kept."""
    flag = lambda key: "--" + key.replace("_", "-")  # noqa: E731
    settings = settings_of(args)
    manifest = os.path.join(out, "demo.json")
    if os.path.exists(out) and os.listdir(out) and read_json(manifest) is None:
        _refuse("--out %s exists and holds no demo (no demo.json; a demo of an older version, or other files): "
                "give another --out, or remove it yourself (--restart removes only a demo's folder)" % out)
    if args.restart and os.path.exists(out):
        log("--restart: removing %s" % out)
        shutil.rmtree(out)
    if os.path.exists(out) and os.listdir(out):
        recorded = read_json(manifest)
        recorded = recorded.get("settings", {})
        differ = [key for key in SETTINGS if recorded.get(key) != settings[key]]
        if differ:
            _refuse("%s holds the runs of a demo with other settings (%s): run the same command as before to "
                    "finish it, give another --out, or add --restart to remove it and start over"
                    % (out, "; ".join("%s %s there, %s here" % (flag(k), _shown(recorded.get(k)), _shown(settings[k]))
                                      for k in differ)))
        done = [(m, s) for m in args.methods for s in args.seeds if os.path.exists(result_path(out, m, s))]
        log("resuming %s: %d of %d runs finished before, kept" % (out, len(done), len(args.methods) * len(args.seeds)))
        return len(done)
    os.makedirs(out, exist_ok=True)
    write_json(manifest, {"settings": settings})
    return 0


def _refuse(message):
    print("demo: error: " + message, file=sys.stderr)
    raise SystemExit(2)


def _shown(value):
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def train_one(data, method, seed, out, args, user_dir, env):
    from fairseq_vasso.nmt import recipe as nmt_common
    from fairseq_vasso.nmt.recipe import train_command

    save_dir = run_dir(out, method, seed)
    extra = ["--max-update", str(args.max_update)]
    if args.cpu:
        extra.append("--cpu")
    settings = tiny_model(args.embed_dim, args.layers, args.lr, args.warmup_updates, args.dropout)
    cmd = train_command(data, method, seed, save_dir, rho=args.rho, max_epoch=0, user_dir=user_dir,
                        extra=extra, settings=settings)
    log = os.path.join(save_dir, "train.log")
    start = time.time()
    rc = nmt_common.run_logged(cmd, log, env=env)
    ok, note = nmt_common.judge_train(rc, log)
    return save_dir, ok, note, time.time() - start


_UPDATES_RE = re.compile(r"num_updates[=\s]+(\d+)")


def updates_done(log_path):
    """The last num_updates a fairseq-train log reports (0 before the first)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return 0
    found = _UPDATES_RE.findall(tail)
    return int(found[-1]) if found else 0


def fmt_duration(seconds):
    seconds = max(0, int(round(seconds)))
    return "%d min %02d s" % divmod(seconds, 60) if seconds >= 60 else "%d s" % seconds


class Progress:
    """Prints, every `every` seconds, each running job's updates, the elapsed time and an estimate of what remains.

    The estimate divides the remaining work (updates x passes per update) by the work done
    per second by all jobs together, so it holds for any number of jobs and cores. The rate
    is measured from the first update seen on, so that the first fairseq start-up (imports,
    data loading) does not inflate it; the later runs' start-ups are part of the rate.
    """

    def __init__(self, jobs, max_update, log, every, eval_estimate):
        self.jobs, self.max_update, self.log, self.every = jobs, max_update, log, every
        self.eval_estimate = eval_estimate  # callable: seconds the evaluation will take
        self.state = {job: "queued" for job in jobs}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.start = time.time()
        self.first = None  # (time, work done) when the first update was seen
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def set(self, job, state):
        with self.lock:
            self.state[job] = state

    def _done_work(self):
        done, parts = 0, []
        with self.lock:
            items = list(self.state.items())
        for (method, seed, log_path), state in items:
            n = self.max_update if state == "done" else (updates_done(log_path) if state == "running" else 0)
            done += passes(method) * min(n, self.max_update)
            if state == "running":
                parts.append("%s s%d %d/%d" % (method, seed, n, self.max_update))
        n_done = sum(s == "done" for _, s in items)
        return done, parts, n_done

    def remaining(self):
        """(seconds of training left or None while nothing is measured, fraction done)."""
        total = sum(passes(m) for m, _, _ in self.jobs) * self.max_update
        done, _, _ = self._done_work()
        now = time.time()
        if done and self.first is None:
            self.first = (now, done)
        if self.first is None or done == self.first[1]:
            return None, done / total
        return (total - done) * (now - self.first[0]) / (done - self.first[1]), done / total

    def report(self):
        _, parts, n_done = self._done_work()
        left, frac = self.remaining()
        if left is None:
            est = "estimate after the first updates"
        else:
            est = "about %s left for training, %s in all" % (fmt_duration(left),
                                                           fmt_duration(left + self.eval_estimate()))
        self.log("training: %s (%d of %d runs done, %.0f %% of the work); %s"
                 % (", ".join(parts) or "starting", n_done, len(self.jobs), 100 * frac, est))

    def _loop(self):
        while not self.stop.wait(self.every):
            self.report()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


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


def _float(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


# summary columns from the training logs: (log key, heading, digits)
SUMMARY_DIAG = [("valid_loss", "last valid loss", 3), ("valid_best_loss", "best valid loss", 3),
                ("train_loss_gap", "loss gap", 4), ("train_stability", "stability ‖ε_t − ε_{t−1}‖", 4)]
RUN_DIAG = [("train_loss", "train loss"), ("valid_loss", "valid loss"), ("valid_best_loss", "best valid loss"),
            ("train_ascent_norm", "ascent norm"), ("train_loss_gap", "loss gap"),
            ("train_sharpness", "sharpness ρ‖v_t‖"), ("train_stability", "stability ‖ε_t − ε_{t−1}‖"),
            ("train_two_pass", "two-pass fraction"), ("train_wall", "train wall s")]


def label_of(method):
    from fairseq_vasso.nmt import recipe as nmt_common

    return nmt_common.METHODS[method].label


def summary_table(methods, seeds, results, stats):
    """One row per method: BLEU mean ± std beside the per-seed values, then the log's diagnostics (mean ± std)."""
    head = ["Method", "test BLEU (mean ± std)", "per seed (%s)" % ", ".join("s%d" % s for s in seeds),
            "sacreBLEU (mean ± std)"] + [c[1] for c in SUMMARY_DIAG]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for method in methods:
        done = [s for s in seeds if (method, s) in results]  # all of them, once the demo is finished
        bleu = [results[method, s]["fairseq_bleu"] for s in done]
        sacre = [results[method, s]["sacrebleu"] for s in done]
        cells = [label_of(method), fmt_mean_std(bleu),
                 ", ".join("%.2f" % results[method, s]["fairseq_bleu"] if s in done else "-" for s in seeds),
                 fmt_mean_std(sacre)]
        for key, _, digits in SUMMARY_DIAG:
            cells.append(fmt_mean_std([_float(stats[method, s].get(key)) for s in done], digits))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def runs_table(methods, seeds, stats):
    """One row per run: what fairseq_vasso logged over the last epoch."""
    lines = ["| Method | seed | " + " | ".join(c[1] for c in RUN_DIAG) + " |",
             "|" + "|".join(["---"] * (len(RUN_DIAG) + 2)) + "|"]
    for method in methods:
        for seed in seeds:
            if (method, seed) not in stats:
                continue
            st = stats[method, seed]
            lines.append("| %s | %d | %s |" % (label_of(method), seed, " | ".join(st.get(c[0], "-") for c in RUN_DIAG)))
    return "\n".join(lines) + "\n"


def compare(methods, seeds, results):
    """Plain sentences: for each pair of methods, the difference of mean BLEU and whether it exceeds the seed spread.

    "Exceeds the seed spread" means every seed of one method scored above every seed of
    the other (the per-seed ranges do not overlap); with 3 seeds that is the most a
    reader can claim without a test that 3 seeds cannot power.
    """
    if len(seeds) < 2:
        return ["One seed per method: no seed spread to compare the differences with."]
    out = []
    for i, a in enumerate(methods):
        for b in methods[i + 1:]:
            va = [results[a, s]["fairseq_bleu"] for s in seeds]
            vb = [results[b, s]["fairseq_bleu"] for s in seeds]
            (ma, sa), (mb, sb) = mean_std(va), mean_std(vb)
            if min(vb) > max(va) or min(va) > max(vb):
                verdict = "exceeds the seed spread: every seed of %s above every seed of %s" % (
                    (label_of(b), label_of(a)) if mb > ma else (label_of(a), label_of(b)))
            else:
                verdict = "within the seed spread: the per-seed ranges overlap"
            out.append("%s − %s: %+.2f BLEU (std %.2f and %.2f over seeds), %s."
                       % (label_of(b), label_of(a), mb - ma, sb, sa, verdict))
    return out


def cpu_seconds():
    """(user+sys CPU seconds of this process, of its finished children)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be an integer >= 1, got %s" % text)
    return value


def fraction(text):
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("must be in [0, 1], got %s" % text)
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/demo",
                   help="everything goes here; a rerun with the same settings finishes what an interrupted one left")
    p.add_argument("--restart", action="store_true",
                   help="remove --out first and start over (without it, finished runs are never rewritten)")
    p.add_argument("--methods", nargs="+", default=DEMO_METHODS)
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="fairseq-train --seed of each run")
    p.add_argument("--rho", type=float, default=0.1)
    p.add_argument("--max-update", type=positive_int, default=320, help="updates per run")
    p.add_argument("--train", type=positive_int, default=400, help="training sentence pairs")
    p.add_argument("--train-noise", type=fraction, default=0.5,
                   help="fraction of training pairs with a misaligned target, in [0, 1]; valid and test stay clean")
    p.add_argument("--valid", type=positive_int, default=200)
    p.add_argument("--test", type=positive_int, default=300)
    p.add_argument("--corpus-seed", type=int, default=1, help="seed of the corpus and its noise (the same for every run)")
    p.add_argument("--bpe-merges", type=positive_int, default=300)
    p.add_argument("--embed-dim", type=positive_int, default=128, help="model width (ffn: twice that)")
    p.add_argument("--layers", type=positive_int, default=2, help="encoder and decoder layers")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-updates", type=int, default=100)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--checkpoint", choices=["last", "best"], default="last",
                   help="which checkpoint to score: the one the budget ends with, or the lowest valid loss")
    p.add_argument("--generate-args", default="--max-len-a 1.2 --max-len-b 10",
                   help="extra fairseq-generate arguments (default: the length limits of fairseq README's "
                        "validation BLEU, which keep a badly trained model from generating 200 tokens)")
    p.add_argument("--jobs", type=positive_int, default=2, help="runs at once")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: cores / jobs, at least 1)")
    p.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--cpu", action="store_true", help="train on CPU even where CUDA is available")
    p.add_argument("--user-dir", default=None, help="fairseq_vasso folder (default: the repository's or installed one)")
    args = p.parse_args(argv)
    from fairseq_vasso.nmt import recipe as nmt_common

    unknown = [m for m in args.methods if m not in nmt_common.METHODS]
    if unknown:
        p.error("argument --methods: unknown %s (choose from %s)" % (", ".join(unknown), ", ".join(nmt_common.METHODS)))
    if len(set(args.seeds)) != len(args.seeds):
        p.error("argument --seeds: each seed once, got %s" % " ".join(map(str, args.seeds)))
    if args.rho < 0:
        p.error("argument --rho: must be >= 0, got %g" % args.rho)
    if args.progress_every <= 0:
        p.error("argument --progress-every: must be > 0 seconds, got %g" % args.progress_every)
    return args


class _Clock:
    """The demo's log lines, stamped with the seconds since it started."""

    def __init__(self):
        self.t0 = time.time()

    def __call__(self, msg):
        print("[%5.0f s] %s" % (time.time() - self.t0, msg), flush=True)


def run_all(data, ref_file, out, args, user_dir, bleu_command, log):
    """Stages 2 and 3: every (method, seed) run, the two-pass ones first (they take about twice
    as long, so the cheap AdamW runs fill the end), each scored as soon as it is trained, its
    result saved in its folder and the table and plot rewritten (partial until the last);
    runs finished before are kept. Exits naming the runs that failed. Returns the results."""
    from fairseq_vasso.nmt import bleu as eval_bleu
    from fairseq_vasso.nmt import recipe as nmt_common

    methods, seeds = args.methods, args.seeds
    n_runs = len(methods) * len(seeds)
    jobs = min(args.jobs, n_runs)
    threads = args.threads or max(1, (os.cpu_count() or 1) // jobs)
    env = quiet_children_env(dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)))
    order = sorted(((m, s) for s in seeds for m in methods), key=lambda ms: -passes(ms[0]))
    results = {(m, s): read_json(result_path(out, m, s)) for m, s in order}
    results = {key: r for key, r in results.items() if r is not None}
    todo = [(m, s, os.path.join(run_dir(out, m, s), "train.log")) for m, s in order]
    ckpt_name = "checkpoint_%s.pt" % args.checkpoint
    cpu = True if args.cpu else None
    log("stage 2/3: training %d runs (%s x seeds %s), %d updates each, %d at once, %d thread(s) each; each "
        "run's %s scored when it is trained (fairseq-generate --beam 5 --remove-bpe %s)%s"
        % (n_runs, ", ".join(methods), " ".join(map(str, seeds)), args.max_update, jobs, threads, ckpt_name,
           args.generate_args, "; %d finished before, kept" % len(results) if results else ""))

    def eval_estimate():
        # a checkpoint costs about what 45 AdamW updates do (measured here with the default sizes)
        left, frac = progress.remaining()
        if left is None:
            return 0.0
        per = 45 * left / max(1e-9, (1 - frac) * sum(passes(m) for m, _, _ in todo) * args.max_update)
        return per * (n_runs - len(results)) / jobs

    lock = threading.Lock()
    failed = []

    def run_job(job):
        method, seed, log_path = job
        save_dir = run_dir(out, method, seed)
        start = time.time()
        if nmt_common.train_finished(log_path) and os.path.exists(os.path.join(save_dir, ckpt_name)):
            ok, note = True, "trained before, kept"  # its scoring was interrupted
        else:
            shutil.rmtree(save_dir, ignore_errors=True)  # an interrupted training starts again
            progress.set(job, "running")
            try:
                _, ok, note, _ = train_one(data, method, seed, out, args, user_dir, env)
            finally:
                progress.set(job, "done")
        if not ok:
            return ok, note, time.time() - start, None
        [r] = eval_bleu.score(data, [(method, seed, os.path.join(save_dir, ckpt_name))], user_dir=user_dir,
                              cpu=cpu, ref_file=ref_file, extra=shlex.split(args.generate_args), jobs=1, env=env,
                              say=log, batch_progress=False)
        write_json(result_path(out, method, seed), r)
        return ok, note, time.time() - start, r

    with Progress(todo, args.max_update, log, args.progress_every, eval_estimate) as progress:
        for job in todo:
            if job[:2] in results:
                progress.set(job, "done")
        pending = [job for job in todo if job[:2] not in results]
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(run_job, job): job for job in pending}
            for fut in as_completed(futures):
                method, seed, log_path = futures[fut]
                ok, note, secs, r = fut.result()
                if not ok:
                    log("%s seed %d: %s (%s) -> %s" % (method, seed, note, fmt_duration(secs),
                                                       run_dir(out, method, seed)))
                    print(nmt_common.tail(log_path), file=sys.stderr)
                    failed.append("%s seed %d" % (method, seed))
                    continue
                with lock:
                    results[method, seed] = r
                    report(out, args, results, bleu_command)
                    plot(out, args, results, log, quiet=True)
                log("%s seed %d: %s, scored (%s) -> %s; %d of %d runs scored, table%s in %s"
                    % (method, seed, note, fmt_duration(secs), run_dir(out, method, seed), len(results), n_runs,
                       "" if len(results) == n_runs else " (partial)", os.path.join(out, "results.md")))
    if failed:
        raise SystemExit("training failed: %s (rerun the same command to try them again; the others are kept)"
                         % ", ".join(failed))
    return results


def bleu_command_of(data, ref_file, out, args):
    """The vasso-bleu command that gives the table's BLEU columns, paths relative to where the
    demo was started when below it."""
    from fairseq_vasso.nmt import bleu as eval_bleu

    def shown(path):
        rel = os.path.relpath(path)
        return path if rel.startswith("..") else rel

    return eval_bleu.command(shown(data), runs=shown(os.path.join(out, "runs")),
                             checkpoint_name="checkpoint_%s.pt" % args.checkpoint, user_dir=args.user_dir,
                             cpu=True if args.cpu else None, ref_file=shown(ref_file),
                             generate_args=args.generate_args, jobs=args.jobs, no_paper=True)


def report(out, args, results, bleu_command):
    """The seeded comparison and the per-run diagnostics, as markdown (also written to
    ``results.md``), with the vasso-bleu command that gives the same BLEU columns. Before
    every run is scored: the finished ones, under a line that says the table is partial."""
    from fairseq_vasso.nmt import recipe as nmt_common

    seeds = args.seeds
    total = len(args.methods) * len(seeds)
    methods = [m for m in args.methods if any((m, s) in results for s in seeds)]
    stats = {(m, s): last_epoch_stats(os.path.join(run_dir(out, m, s), "train.log"))
             for m in methods for s in seeds if (m, s) in results}
    first = next(iter(results.values()))
    paper = ", ".join("%s %.2f" % (label_of(m), nmt_common.METHODS[m].paper_bleu) for m in args.methods)
    partial = len(results) < total
    head = []
    if partial:
        head = ["", "**Partial: %d of %d runs scored.** The rest are still running, or were interrupted: the same "
                "command finishes them." % (len(results), total)]
    text = "\n".join(head + [
        "",
        "## Toy de-en demo: test BLEU with %.0f %% of the training targets misaligned" % (100 * args.train_noise),
        "",
        "%d training pairs (%.0f %% with the English side of another pair), clean valid (%d) and test (%d) "
        "references; %d updates per run, %s scored; seeds %s; rho %g."
        % (args.train, 100 * args.train_noise, args.valid, first["n"], args.max_update,
           "checkpoint_%s.pt" % args.checkpoint, ", ".join(map(str, seeds)), args.rho),
        "",
        summary_table(methods, seeds, results, stats),
        "Differences of mean test BLEU:",
        "",
    ] + ["- " + line for line in (compare(methods, seeds, results) if not partial else
                                  ["when every run is scored."])] + [
        "",
        "fairseq BLEU: tokenized BLEU4 of fairseq-generate --beam 5 --remove-bpe %s; sacreBLEU: %s on detokenized "
        "text. Loss gap and stability: fairseq_vasso's log, mean over the last epoch ('-': AdamW has none). For "
        "reference only, the paper's IWSLT-14 BLEU (a far larger task): %s."
        % (args.generate_args, first["sacrebleu_signature"], paper),
        "",
        "The BLEU columns again, by hand (vasso-bleu writes new generate-test-N folders beside these runs' "
        "and never overwrites them):",
        "",
        "    " + bleu_command,
        "",
        "## Per run: training diagnostics of the last epoch",
        "",
        runs_table(methods, seeds, stats),
    ])
    write_text(os.path.join(out, "results.md"), text)
    return text


def write_text(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def plot(out, args, results, log, quiet=False):
    """The paper's Fig. 4 (stability) and the loss gap for the scored runs; once all are,
    its Fig. 3 as well (stage 3)."""
    from plugins.lab.plot import diagnostics as plot_diagnostics
    from plugins.lab.plot import sphere as adversary_sphere

    # label=path specs (no '=' in a label); labels starting with SAM / VASSO give the first
    # seed of each the paper's colours (vasso-plot: SAM orange, VASSO blue)
    runs = ["%s s%d=%s" % (label_of(m).replace(" (theta=", " θ").rstrip(")"), s,
                           os.path.join(run_dir(out, m, s), "train.log"))
            for m in args.methods if passes(m) > 1 for s in args.seeds if (m, s) in results]
    if runs:
        png = os.path.join(out, "diagnostics.png")
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            plot_diagnostics.main(runs + ["-o", png, "--smooth", "5", "--title",
                                          "demo: toy de-en, %.0f %% misaligned targets" % (100 * args.train_noise)])
        if not quiet:
            log("diagnostics plot (stability and loss gap over updates): %s" % png)
    if len(results) == len(args.methods) * len(args.seeds):
        adversary_sphere.main(["-o", os.path.join(out, "adversaries.png")])


def main(argv=None):
    args = parse_args(argv)
    check_dependencies()
    from fairseq_vasso.nmt import recipe as nmt_common

    log = _Clock()
    user_dir = args.user_dir or nmt_common.default_user_dir()
    out = os.path.abspath(args.out)
    open_out(out, args, log)
    try:
        with nmt_common.interruptible():
            log("stage 1/3: corpus and preprocessing")
            data, ref_file = prepare(out, args, log)
            bleu_command = bleu_command_of(data, ref_file, out, args)
            results = run_all(data, ref_file, out, args, user_dir, bleu_command, log)
            print(report(out, args, results, bleu_command))
            log("stage 3/3: plots")
            plot(out, args, results, log)
    except KeyboardInterrupt as exc:
        done = sum(os.path.exists(result_path(out, m, s)) for m in args.methods for s in args.seeds)
        print("\ndemo: stopped (%s); every fairseq process it started was stopped too. %d of %d runs are finished "
              "and kept in %s. Run the same command again to finish the rest (add --restart to start over)."
              % (exc or "interrupted", done, len(args.methods) * len(args.seeds), args.out), file=sys.stderr,
              flush=True)
        return 130
    me, kids = cpu_seconds()
    log("done; table in %s, plots in %s. CPU time: %.0f s (%.0f s in fairseq processes, %.0f s in this one); "
        "on 2 idle cores about %s" % (os.path.join(out, "results.md"), out, me + kids, kids, me,
                                      fmt_duration((me + kids) / 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
