#!/usr/bin/env python
"""Train the rows of the paper's IWSLT-14 de-en table (tab.nmt) for several seeds.

Rows: AdamW, SAM, ASAM, VASSO (theta=0.9), VASSO (theta=0.4), rho = 0.1 for the
sharpness-aware ones. Every run uses the paper's settings (Sec. 5, "Neural machine
translation") on top of fairseq's IWSLT-14 transformer example:

    --task translation --arch transformer_iwslt_de_en --share-decoder-input-output-embed
    --adam-betas '(0.9, 0.98)' --clip-norm 0.0 --lr 5e-4 --lr-scheduler inverse_sqrt
    --warmup-updates 4000 --weight-decay 0.0001 --dropout 0.3
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096

and differs between rows only in ``--optimizer`` and its flags (``--optimizer adam`` is
fairseq's AdamW, i.e. decoupled weight decay). Each run gets its own save dir,
``RUNS/<method>/seed<k>/``, with ``train.log`` (the full fairseq-train output) and
``checkpoint_best.pt`` (lowest validation loss; the paper reports validation
perplexity) and ``checkpoint_last.pt``.

The paper does not say how long it trains; ``--max-epoch 50`` (default here) is our
choice, as is selecting ``checkpoint_best.pt`` by validation loss (fairseq's
default). ``--eval-bleu`` switches to fairseq README's variant (checkpoint chosen by
validation BLEU, beam 5, moses detokenization). Anything after ``--`` is passed to
every fairseq-train command unchanged.

Usage::

    python scripts/translation/iwslt14_recipe.py --dry-run          # print the commands
    python scripts/translation/iwslt14_recipe.py --seeds 1 2 3      # run them one after another
    python scripts/translation/iwslt14_recipe.py --methods adamw vasso0.4 --seeds 1 -- --fp16
    vasso-bleu data-bin/iwslt14.tokenized.de-en --runs runs/iwslt14
"""

import argparse
import os
import shlex
import sys
import time

from fairseq_vasso.nmt import recipe as nmt
from fairseq_vasso.nmt.recipe import METHODS, PAPER_RHO, default_user_dir, fairseq_bin, method_flags, run_dir

# The paper's settings (Sec. 5, "Neural machine translation") on top of fairseq's
# IWSLT-14 transformer example; rows differ only in their METHODS flags.
PAPER_SETTINGS = [
    "--task", "translation",
    "--arch", "transformer_iwslt_de_en", "--share-decoder-input-output-embed",
    "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
    "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
    "--weight-decay", "0.0001", "--dropout", "0.3",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "4096",
]
# fairseq README's variant: checkpoint chosen by validation BLEU (beam 5, moses detokenization)
EVAL_BLEU = [
    "--eval-bleu", "--eval-bleu-args", '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}',
    "--eval-bleu-detok", "moses", "--eval-bleu-remove-bpe",
    "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
]


def train_command(data, method, seed, save_dir, *, rho=PAPER_RHO, max_epoch=50,
                  max_update=None, user_dir=None, eval_bleu=False, extra=(), settings=PAPER_SETTINGS):
    """The fairseq-train command line (a list) for one run."""
    cmd = [fairseq_bin("fairseq-train"), data, "--user-dir", user_dir or default_user_dir()]
    cmd += list(settings)
    cmd += method_flags(method, rho)
    cmd += ["--seed", str(seed), "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "simple"]
    if max_epoch:
        cmd += ["--max-epoch", str(max_epoch)]
    if max_update:
        cmd += ["--max-update", str(max_update)]
    if eval_bleu:
        cmd += EVAL_BLEU
    cmd += list(extra)
    return cmd


def train_finished(log_path):
    """True when a fairseq-train log says it finished ("done training")."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return any("done training in" in line for line in f)
    except FileNotFoundError:
        return False


def judge_train(rc, log_path):
    """(ok, note) for a finished fairseq-train process, judged by its log: stock fairseq-train
    may abort at exit (rc 134, "terminate called without an active exception";
    docs/fairseq.md, "Troubleshooting") after it logged "done training" and saved its
    checkpoints; such a run is a success."""
    if rc == 0:
        return True, "ok"
    if train_finished(log_path):
        return True, "ok (exit status %d after 'done training'; judged by the log)" % rc
    return False, "failed with exit status %d, see %s" % (rc, log_path)


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Arguments after -- go to every fairseq-train command.")
    p.add_argument("--data", default="data-bin/iwslt14.tokenized.de-en", help="binarized data (scripts/translation/iwslt14_prepare.py)")
    p.add_argument("--runs", default="runs/iwslt14", help="save dirs are RUNS/<method>/seed<k>/")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--rho", type=float, default=PAPER_RHO, help="rho of every sharpness-aware row")
    p.add_argument("--max-epoch", type=int, default=50, help="fairseq-train --max-epoch (0: no limit)")
    p.add_argument("--max-update", type=int, default=None, help="fairseq-train --max-update")
    p.add_argument("--user-dir", default=None, help="fairseq_vasso folder (default: the repository's or installed one)")
    p.add_argument("--eval-bleu", action="store_true", help="choose checkpoint_best.pt by validation BLEU (fairseq README)")
    p.add_argument("--skip-existing", action="store_true",
                   help="kept for old command lines: runs whose train.log says 'done training' are always skipped")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = p.parse_args(argv)
    a.extra = extra
    return a


def main(argv=None):
    a = parse_args(argv)
    jobs = []
    for seed in a.seeds:
        for method in a.methods:
            save_dir = run_dir(a.runs, method, seed)
            cmd = train_command(a.data, method, seed, save_dir, rho=a.rho, max_epoch=a.max_epoch,
                                max_update=a.max_update, user_dir=a.user_dir, eval_bleu=a.eval_bleu, extra=a.extra)
            jobs.append((method, seed, save_dir, cmd))
    if a.dry_run:
        for method, seed, save_dir, cmd in jobs:
            print("# %s, seed %d -> %s" % (METHODS[method].label, seed, save_dir))
            print(shlex.join(cmd) + " > " + os.path.join(save_dir, "train.log") + " 2>&1")
        return 0
    failed = []
    for method, seed, save_dir, cmd in jobs:
        log = os.path.join(save_dir, "train.log")
        if train_finished(log):  # a finished run's log and checkpoints are never rewritten
            print("skip %s seed %d: %s says done training (remove %s to train it again)"
                  % (method, seed, log, save_dir), flush=True)
            continue
        start = time.time()
        print("train %s seed %d -> %s" % (method, seed, save_dir), flush=True)
        rc = nmt.run_logged(cmd, log, append=True)  # an interrupted run resumes: its log goes on
        ok, note = judge_train(rc, log)
        print("  %s (%.0f s)" % (note, time.time() - start), flush=True)
        if not ok:
            print(nmt.tail(log), file=sys.stderr)
            failed.append((method, seed))
    if failed:
        print("failed runs: %s" % ", ".join("%s/seed%d" % f for f in failed), file=sys.stderr)
        return 1
    print("next: vasso-bleu %s --runs %s" % (a.data, a.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
