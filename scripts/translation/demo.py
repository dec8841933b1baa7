#!/usr/bin/env python
"""AdamW vs SAM vs VASSO on a small translation task with noisy training targets, 3 seeds each.

    .venv/bin/python scripts/translation/demo.py        # writes everything under runs/demo/

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
2. prepares it with the IWSLT-14 pipeline's own steps (``iwslt14``:
   Moses tokenization with sacremoses, lowercasing, joint BPE with subword-nmt,
   ``fairseq-preprocess --joined-dictionary``);
3. trains a tiny transformer with stock ``fairseq-train --user-dir fairseq_vasso``,
   once per method and seed: ``--optimizer adam`` (AdamW), ``--optimizer sam --rho R``
   and ``--optimizer vasso --rho R --theta 0.4``: same number of updates, otherwise
   identical commands (the recipe's settings, scaled down); the corpus and its noise
   are the same for every run, the seed is fairseq's ``--seed``; and the rounding control
   (``--control``): one more run of SAM seed 1 with every initial weight one float up
   (``nudged_train.py`` beside this file). Every fairseq process runs on ``--threads``
   torch threads (1), whatever the number of cores; on an AMD x86-64 CPU with AVX2 with
   the CPU kernels pinned (``plugins.lab.pinned_kernels``), so that the same command gives
   the same numbers on any such machine with the same torch build (elsewhere the pin would
   not reproduce them, and the CPU's own kernels are 1.5-2.5x faster);
4. scores each run's ``checkpoint_last.pt`` with ``vasso-bleu``'s own loop (``fairseq_vasso.nmt.bleu.score``)
   (``fairseq-generate --beam 5 --remove-bpe``, with the length limits of fairseq
   README's validation BLEU, ``--max-len-a 1.2 --max-len-b 10``: fairseq's tokenized
   BLEU and sacreBLEU) and prints, led by what 3 seeds can show (the stability
   result), the table: mean ± std per method beside the per-seed values, the last and
   best valid loss, fairseq_vasso's loss gap and stability; the rounding control's band
   beside the seed spread; for each pair of methods the difference on BLEU and on
   stability with the p-value of an exact permutation test over seeds
   (``plugins.lab.stats``), and what 3 seeds cannot show; then a per-run table of the
   training diagnostics, and the ``vasso-bleu`` command that gives the same BLEU
   columns when run by hand. The same numbers go to ``results.json``;
5. plots the diagnostics (``vasso-plot``, ``plugins.lab.plot.diagnostics``: ||eps_t - eps_{t-1}|| and
   the perturbed-loss gap over updates, SAM and VASSO on the same axes, the paper's
   Fig. 4) into ``runs/demo/diagnostics.png``, and draws the paper's Fig. 3
   (``plugins.lab.plot.sphere``) into ``runs/demo/adversaries.png``.

Each run is scored as soon as it is trained; its result goes to its folder
(``runs/METHOD/seedN/result.json``) and the table (``results.md``) and plot are rewritten,
marked partial until every run is done. Interrupted (Ctrl-C or SIGTERM: every fairseq
process stops with it), the same command finishes what is left: the corpus and the
finished runs are kept, a run cut short in training resumes from its checkpoint_last.pt
as fairseq-train resumes (its logs kept; the table marks it, since fairseq-train does not
continue bit for bit across a resume), one cut short before its first checkpoint starts
again. ``--out`` records the settings (``demo.json``);
other settings there are refused, and ``--restart`` removes the folder and starts over.

Every few seconds it prints where each running job is, the elapsed time and an
estimate of what remains; at the end, the CPU time used, which on a shared machine
says more than the wall time (on 2 idle cores the demo takes about CPU time / 2).
Runs go two at a time (``--jobs``), the two-pass runs first, so both
cores stay busy to the end. Runs are judged by their logs: a fairseq-train that logged
"done training" is a success even where the process aborts at exit.
"""

import argparse
import collections
import contextlib
import io
import json
import math
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from fairseq_vasso._foreign_warnings import pythonwarnings
from plugins.lab.stats import permutation_test, smallest_p
from plugins.lab.tables import fmt_mean_std, mean_std

DEMO_METHODS = ["adamw", "sam", "vasso0.4"]


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
    """env (default os.environ) with the FutureWarnings of fairseq's own import filtered in
    child Pythons (they import fairseq before any user-dir: fairseq_vasso._foreign_warnings),
    and tqdm's progress bars off (TQDM_DISABLE) in whatever library they call."""
    env = dict(os.environ if env is None else env)
    env["PYTHONWARNINGS"] = pythonwarnings(env.get("PYTHONWARNINGS"))
    env["TQDM_DISABLE"] = "1"
    return env


def child_env(threads, env=None, cpu=False):
    """The environment of every process the demo starts (fairseq-train, fairseq-generate):
    ``threads`` torch threads, whatever the number of cores (torch splits its sums by
    thread, so the count decides the rounding), the CPU kernels pinned on the CPUs the
    report's numbers were measured on (plugins.lab.pinned_kernels: the same numbers on every
    AMD x86-64 CPU with AVX2; elsewhere the CPU's own, faster kernels), and
    quiet_children_env's filters; with ``cpu`` (``--cpu``), no GPU visible
    (recipe.cpu_only_env: stock fairseq's ``--cpu`` still takes its gradient norm through a
    visible GPU)."""
    from fairseq_vasso.nmt.recipe import cpu_only_env
    from plugins.lab import pinned_kernels

    env = quiet_children_env(dict(os.environ if env is None else env, OMP_NUM_THREADS=str(threads),
                                  MKL_NUM_THREADS=str(threads)))
    if pinned_kernels.unmeasured() is None:  # elsewhere the pin costs 1.5-2.5x and reproduces nothing
        env = pinned_kernels.pinned_env(env, threads)
    return cpu_only_env(env) if cpu else env


def check_dependencies():
    import importlib.util

    missing = [pip_name for mod, pip_name in [("fairseq", "fairseq-fixed"), ("sacremoses", "sacremoses"),
                                              ("subword_nmt", "subword-nmt"), ("sacrebleu", "sacrebleu")]
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise SystemExit("missing Python packages: %s (pip install %s)" % (", ".join(missing), " ".join(missing)))


def prepare(out, args, log):
    """Stage 1; kept once complete (``prepared`` marker), redone from scratch otherwise."""
    import iwslt14 as prep
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


def run_dir(out, method, seed, nudged=False):
    """A run's folder: runs/METHOD/seedN; the rounding control's (``nudged``) apart, under
    control/, where vasso-bleu's --runs does not look."""
    if nudged:
        return os.path.join(out, "control", method, "seed%d-%dulp" % (seed, CONTROL_ULPS))
    return os.path.join(out, "runs", method, "seed%d" % seed)


def result_path(out, method, seed, nudged=False):
    """A run's scored result: written once the run is trained and scored, never before."""
    return os.path.join(run_dir(out, method, seed, nudged), "result.json")


# One training run of the demo; ``nudged``: the rounding control, whose initial weights are
# each moved CONTROL_ULPS floats up (nudged_train.py beside this file)
Job = collections.namedtuple("Job", "method seed log nudged")
CONTROL_ULPS = 1


def key_of(job):
    """The key of a job's result: (method, seed), the control's (method, seed, "control")."""
    return (job.method, job.seed, "control") if job.nudged else (job.method, job.seed)


def job_name(job):
    return "%s s%d%s" % (job.method, job.seed, " (+%d ulp)" % CONTROL_ULPS if job.nudged else "")


# the arguments that decide the results (the others say how to run: --out, --jobs, ...): the
# thread count too, since it changes how torch splits its sums, and so the rounding
SETTINGS = ("methods", "seeds", "rho", "max_update", "train", "train_noise", "valid", "test", "corpus_seed",
            "bpe_merges", "embed_dim", "layers", "lr", "warmup_updates", "dropout", "checkpoint",
            "generate_args", "cpu", "threads", "control")


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
        todo = jobs_of(out, args)
        done = [j for j in todo if os.path.exists(result_path(out, j.method, j.seed, j.nudged))]
        log("resuming %s: %d of %d runs finished before, kept" % (out, len(done), len(todo)))
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


def train_one(data, job, out, args, user_dir, env, append=False):
    """Runs one job's fairseq-train into its folder (``append``: after what its train.log holds;
    fairseq-train itself resumes from the folder's checkpoint_last.pt where there is one).
    Returns (ok, note)."""
    from fairseq_vasso.nmt import recipe as nmt_common
    from iwslt14_recipe import judge_train, train_command

    save_dir = run_dir(out, job.method, job.seed, job.nudged)
    extra = ["--max-update", str(args.max_update)]
    if args.cpu:
        extra.append("--cpu")
    settings = tiny_model(args.embed_dim, args.layers, args.lr, args.warmup_updates, args.dropout)
    cmd = train_command(data, job.method, job.seed, save_dir, rho=args.rho, max_epoch=0, user_dir=user_dir,
                        extra=extra, settings=settings)
    if job.nudged:  # the same fairseq-train, in a Python that nudges the initial weights first
        cmd = nudged_train_command(CONTROL_ULPS) + cmd[1:]
    rc = nmt_common.run_logged(cmd, job.log, env=env, append=append)
    return judge_train(rc, job.log)


def nudged_train_command(ulps):
    """The command that stands for ``fairseq-train`` in the rounding control: nudged_train.py
    beside this file (it imports nothing of fairseq_vasso before fairseq imports ``user_dir``,
    which fairseq requires of a user-dir's module)."""
    return [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "nudged_train.py"), str(ulps), "--"]


# fairseq-train's line for each save: "Saved checkpoint DIR/checkpoint_best.pt (epoch 5 @ 40 updates, ..."
# (it names the first file written; checkpoint_last.pt is written in the same save)
_SAVED_RE = re.compile(r"[Ss]aved checkpoint \S+ \(epoch \d+ @ (\d+) updates[^\n]*\n")
# what fairseq-train logs after the save at an epoch's end, before the next epoch's first update:
# the epoch's averages ("end of epoch N (average epoch stats below)", "| train | epoch N | ...")
_EPOCH_END_RE = re.compile(r"(?:[^\n]*(?:end of epoch \d+|\| train \| epoch \d+ )[^\n]*\n)*")


def resume_point(save_dir, log_path):
    """(updates, log text up to that save and its epoch's averages) of an interrupted run that fairseq-train can resume:
    its checkpoint_last.pt loads and its log records the save; None otherwise (no
    checkpoint yet, or one cut short while it was written)."""
    ckpt = os.path.join(save_dir, "checkpoint_last.pt")
    if not os.path.exists(ckpt) or not os.path.exists(log_path):
        return None
    try:
        import torch

        # the demo's own file (it holds fairseq's config objects, which weights_only refuses)
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        updates = int(state["optimizer_history"][-1]["num_updates"])
    except Exception:  # noqa: BLE001 (truncated, or not a fairseq checkpoint: train from the start)
        return None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    saves = [m for m in _SAVED_RE.finditer(text) if int(m.group(1)) == updates]
    if not updates or not saves:
        return None
    return updates, text[:_EPOCH_END_RE.match(text, saves[-1].end()).end()]


def keep_interrupted_log(log_path):
    """Renames an interrupted run's log to train.interrupted-K.log (K: the first free) and returns that path."""
    base = os.path.join(os.path.dirname(log_path), "train.interrupted-%d.log")
    k = 1
    while os.path.exists(base % k):
        k += 1
    os.replace(log_path, base % k)
    return base % k


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
        for job, state in items:  # Job, or (method, seed, log_path)
            method, seed, log_path = job[:3]
            n = self.max_update if state == "done" else (updates_done(log_path) if state == "running" else 0)
            done += passes(method) * min(n, self.max_update)
            if state == "running":
                parts.append("%s %d/%d" % (job_name(job) if isinstance(job, Job) else "%s s%d" % (method, seed),
                                           n, self.max_update))
        n_done = sum(s == "done" for _, s in items)
        return done, parts, n_done

    def remaining(self):
        """(seconds of training left or None while nothing is measured, fraction done)."""
        total = sum(passes(job[0]) for job in self.jobs) * self.max_update
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


# beside a per-seed value: the run was resumed from a checkpoint (stock fairseq-train does not continue a run bit
# for bit across a resume at an epoch's end, even with its own --optimizer adam)
RESUMED_MARK = " (resumed)"


def summary_table(methods, seeds, results, stats):
    """One row per method: BLEU mean ± std beside the per-seed values (a resumed run's marked),
    then the log's diagnostics (mean ± std)."""
    head = ["Method", "test BLEU (mean ± std)", "per seed (%s)" % ", ".join("s%d" % s for s in seeds),
            "sacreBLEU (mean ± std)"] + [c[1] for c in SUMMARY_DIAG]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for method in methods:
        done = [s for s in seeds if (method, s) in results]  # all of them, once the demo is finished
        bleu = [results[method, s]["fairseq_bleu"] for s in done]
        sacre = [results[method, s]["sacrebleu"] for s in done]
        cells = [label_of(method), fmt_mean_std(bleu),
                 ", ".join("%.2f%s" % (results[method, s]["fairseq_bleu"], RESUMED_MARK if results[method, s].get(
                     "resumed_at") else "") if s in done else "-" for s in seeds),
                 fmt_mean_std(sacre)]
        for key, _, digits in SUMMARY_DIAG:
            cells.append(fmt_mean_std([_float(stats[method, s].get(key)) for s in done], digits))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def runs_table(methods, seeds, stats, control=None):
    """One row per run: what fairseq_vasso logged over the last epoch; ``control`` (method,
    seed): the rounding control's row after that run's."""
    lines = ["| Method | seed | " + " | ".join(c[1] for c in RUN_DIAG) + " |",
             "|" + "|".join(["---"] * (len(RUN_DIAG) + 2)) + "|"]
    for method in methods:
        for seed in seeds:
            for key, shown in (((method, seed), "%d" % seed), ((method, seed, "control"),
                                                              "%d, +%d ulp (control)" % (seed, CONTROL_ULPS))):
                if key not in stats or (len(key) > 2 and control != (method, seed)):
                    continue
                st = stats[key]
                lines.append("| %s | %s | %s |" % (label_of(method), shown,
                                                   " | ".join(st.get(c[0], "-") for c in RUN_DIAG)))
    return "\n".join(lines) + "\n"


def run_values(results, stats, methods, seeds, quantity):
    """{method: [value per seed]} of ``quantity``: "bleu" (fairseq BLEU of results) or a
    log key of ``stats`` (e.g. "train_stability"); a method with a seed missing, or with no
    value (AdamW's stability), is left out."""
    values = {}
    for m in methods:
        if quantity == "bleu":
            vals = [results[m, s]["fairseq_bleu"] if (m, s) in results else None for s in seeds]
        else:
            vals = [_float(stats.get((m, s), {}).get(quantity)) for s in seeds]
        if all(v is not None for v in vals):
            values[m] = vals
    return values


def verdict(a, b, va, vb, unit, digits, band=None):
    """One sentence on ``mean(vb) - mean(va)`` (methods ``a`` and ``b``) from the exact
    two-sided permutation test over seeds (plugins.lab.stats), beside the rounding band."""
    p, floor = permutation_test(va, vb), smallest_p(len(va), len(vb))
    (ma, _), (mb, _) = mean_std(va), mean_std(vb)
    if min(vb) > max(va) or min(va) > max(vb):
        hi, lo = (b, a) if mb > ma else (a, b)
        sep = "every seed of %s above every seed of %s" % (label_of(hi), label_of(lo))
    else:
        sep = "the seeds of the two overlap"
    if p <= 0.05:
        said = "significant at 0.05 (p = %.3f)" % p
    elif p <= floor * (1 + 1e-9):
        said = ("p = %.2f, the smallest p that %d against %d seeds can give: complete separation, not "
                "significance at 0.05" % (p, len(va), len(vb)))
    else:
        said = "not significant (p = %.2f)" % p
    text = "%s − %s: %+.*f %s; %s; %s" % (label_of(b), label_of(a), digits, mb - ma, unit, sep, said)
    if band is not None:
        text += "; the rounding control alone moved one run by %.*f" % (digits, band)
    return text + "."


def compare(methods, seeds, results, stats=None, bands=None):
    """Plain sentences, from the exact two-sided permutation test of the per-seed values
    (plugins.lab.stats.permutation_test): for each pair of methods, the difference of mean
    test BLEU, then (where both have it) of the stability ||eps_t - eps_{t-1}||; each beside
    the rounding band (``bands``: {"bleu": .., "train_stability": ..}) where there is one.

    Nothing is called a difference on a heuristic: a p-value is given with the smallest
    one the number of seeds allows (0.1 for 3 against 3, so none of them can be
    significant at 0.05).
    """
    stats, bands = stats or {}, bands or {}
    if len(seeds) < 2:
        return ["One seed per method: no test over seeds is possible."]
    out = []
    for quantity, unit, digits in (("bleu", "BLEU", 2), ("train_stability", "in stability", 4)):
        values = run_values(results, stats, methods, seeds, quantity)
        ms = [m for m in methods if m in values]
        for i, a in enumerate(ms):
            for b in ms[i + 1:]:
                out.append(verdict(a, b, values[a], values[b], unit, digits, bands.get(quantity)))
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


def build_parser():
    """The demo's parser; ArgumentDefaultsHelpFormatter prints each default, so no help text
    says "(default: ...)" itself."""
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
                   help="extra fairseq-generate arguments; the default is the length limits of fairseq README's "
                        "validation BLEU, which keep a badly trained model from generating 200 tokens")
    p.add_argument("--control", default="sam",
                   help="the rounding control: one more run of this method (one of --methods) with the first "
                        "seed and every initial weight %d float up, to show how far rounding alone moves the "
                        "numbers; 'none': no control run" % CONTROL_ULPS)
    p.add_argument("--jobs", type=positive_int, default=2, help="runs at once")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads of each fairseq process, whatever the number of cores: the thread count "
                        "changes how torch splits its sums, so the same --threads gives the same table on 2 "
                        "cores or 64")
    p.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--cpu", action="store_true", help="train on CPU even where CUDA is available")
    p.add_argument("--user-dir", default=None,
                   help="fairseq_vasso folder; None: the one of the fairseq_vasso package this demo runs from")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    from fairseq_vasso.nmt import recipe as nmt_common

    unknown = [m for m in args.methods if m not in nmt_common.METHODS]
    if unknown:
        p.error("argument --methods: unknown %s (choose from %s)" % (", ".join(unknown), ", ".join(nmt_common.METHODS)))
    if len(set(args.seeds)) != len(args.seeds):
        p.error("argument --seeds: each seed once, got %s" % " ".join(map(str, args.seeds)))
    if args.rho < 0:
        p.error("argument --rho: must be >= 0, got %g" % args.rho)
    if args.control != "none" and args.control not in args.methods:
        p.error("argument --control: must be one of --methods (%s) or 'none', got %s"
                % (", ".join(args.methods), args.control))
    if args.progress_every <= 0:
        p.error("argument --progress-every: must be > 0 seconds, got %g" % args.progress_every)
    return args


class _Clock:
    """The demo's log lines, stamped with the seconds since it started."""

    def __init__(self):
        self.t0 = time.time()

    def __call__(self, msg):
        print("[%5.0f s] %s" % (time.time() - self.t0, msg), flush=True)


def jobs_of(out, args):
    """Every job of the demo, in the order they start: the two-pass runs first (they take about
    twice as long, so the cheap AdamW runs fill the end), the rounding control last of them."""
    order = sorted(((m, s) for s in args.seeds for m in args.methods), key=lambda ms: -passes(ms[0]))
    jobs = [Job(m, s, os.path.join(run_dir(out, m, s), "train.log"), False) for m, s in order]
    if args.control != "none":
        control = Job(args.control, args.seeds[0],
                      os.path.join(run_dir(out, args.control, args.seeds[0], True), "train.log"), True)
        jobs.insert(sum(passes(j.method) >= passes(control.method) for j in jobs), control)
    return jobs


def run_all(data, ref_file, out, args, user_dir, bleu_command, log):
    """Stage 2: every job (jobs_of), each scored as soon as it is trained, its result saved in
    its folder and the table and diagnostics plot rewritten (partial until the last); runs
    finished before are kept, runs interrupted in training resume from their checkpoint.
    Exits naming the runs that failed. Returns the results ({key_of(job): result})."""
    from fairseq_vasso.nmt import bleu as eval_bleu
    from fairseq_vasso.nmt import recipe as nmt_common
    from iwslt14_recipe import train_finished

    todo = jobs_of(out, args)
    n_runs = len(todo)
    jobs = min(args.jobs, n_runs)
    threads = args.threads
    env = child_env(threads, cpu=args.cpu)
    results = {key_of(job): read_json(result_path(out, job.method, job.seed, job.nudged)) for job in todo}
    results = {key: r for key, r in results.items() if r is not None}
    ckpt_name = "checkpoint_%s.pt" % args.checkpoint
    cpu = True if args.cpu else None
    code = provenance(env)  # of the code these runs start with (each fairseq process imports it as it starts)
    control = ("; and the rounding control: %s seed %d again, every initial weight %d float up"
               % (args.control, args.seeds[0], CONTROL_ULPS)) if args.control != "none" else ""
    log("stage 2/3: training %d runs (%s x seeds %s%s), %d updates each, %d at once, %d thread(s) each; each "
        "run's %s scored when it is trained (fairseq-generate --beam 5 --remove-bpe %s)%s"
        % (n_runs, ", ".join(args.methods), " ".join(map(str, args.seeds)), control, args.max_update, jobs,
           threads, ckpt_name, args.generate_args, "; %d finished before, kept" % len(results) if results else ""))

    def eval_estimate():
        # a checkpoint costs about what 45 AdamW updates do (measured here with the default sizes)
        left, frac = progress.remaining()
        if left is None:
            return 0.0
        per = 45 * left / max(1e-9, (1 - frac) * sum(passes(job.method) for job in todo) * args.max_update)
        return per * (n_runs - len(results)) / jobs

    lock = threading.Lock()
    failed = []

    def run_job(job):
        save_dir = run_dir(out, job.method, job.seed, job.nudged)
        start = time.time()
        if train_finished(job.log) and os.path.exists(os.path.join(save_dir, ckpt_name)):
            ok, note = True, "trained before, kept"  # its scoring was interrupted
        else:
            # interrupted in training: fairseq-train resumes from checkpoint_last.pt as it does by
            # itself; train.log keeps the history up to that checkpoint, the whole interrupted
            # log stays beside it. Without a checkpoint, the run starts again (its log kept too).
            point = resume_point(save_dir, job.log)
            if os.path.exists(job.log):
                kept = keep_interrupted_log(job.log)
            if point is None:
                for name in os.listdir(save_dir) if os.path.isdir(save_dir) else ():
                    if not name.startswith("train.interrupted-"):
                        path = os.path.join(save_dir, name)
                        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            else:
                resumed = read_json(os.path.join(save_dir, "resumed.json")) or []  # updates it resumed at
                resumed.append(point[0])
                write_json(os.path.join(save_dir, "resumed.json"), resumed)
                with open(job.log, "w", encoding="utf-8") as f:
                    f.write(point[1])
                    f.write("[demo] interrupted after this save; resumed from checkpoint_last.pt at update %d "
                            "(the interrupted log: %s)\n" % (point[0], os.path.basename(kept)))
                log("%s: resuming from checkpoint_last.pt at update %d" % (job_name(job), point[0]))
            progress.set(job, "running")
            try:
                ok, note = train_one(data, job, out, args, user_dir, env, append=point is not None)
            finally:
                progress.set(job, "done")
        if not ok:
            return ok, note, time.time() - start, None
        [r] = eval_bleu.score(data, [(job.method, job.seed, os.path.join(save_dir, ckpt_name))], user_dir=user_dir,
                              cpu=cpu, ref_file=ref_file, extra=shlex.split(args.generate_args), jobs=1, env=env,
                              threads=threads, say=log, batch_progress=False)
        r.update(nudged_ulps=CONTROL_ULPS if job.nudged else 0,
                 resumed_at=read_json(os.path.join(save_dir, "resumed.json")) or [], **code)
        write_json(result_path(out, job.method, job.seed, job.nudged), r)
        return ok, note, time.time() - start, r

    with Progress(todo, args.max_update, log, args.progress_every, eval_estimate) as progress:
        for job in todo:
            if key_of(job) in results:
                progress.set(job, "done")
        pending = [job for job in todo if key_of(job) not in results]
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(run_job, job): job for job in pending}
            for fut in as_completed(futures):
                job = futures[fut]
                ok, note, secs, r = fut.result()
                save_dir = run_dir(out, job.method, job.seed, job.nudged)
                if not ok:
                    log("%s: %s (%s) -> %s" % (job_name(job), note, fmt_duration(secs), save_dir))
                    print(nmt_common.tail(job.log), file=sys.stderr)
                    failed.append(job_name(job))
                    continue
                with lock:
                    results[key_of(job)] = r
                    report(out, args, results, bleu_command)
                    plot(out, args, results, log, quiet=True)
                log("%s: %s, scored (%s) -> %s; %d of %d runs scored, table%s in %s"
                    % (job_name(job), note, fmt_duration(secs), save_dir, len(results), n_runs,
                       "" if len(results) == n_runs else " (partial)", os.path.join(out, "results.md")))
    if failed:
        raise SystemExit("training failed: %s (rerun the same command to try them again; the others are kept)"
                         % ", ".join(failed))
    return results


def provenance(env):
    """What a run's numbers depend on besides the demo's settings: the code (commit, when the
    demo runs from a git checkout), the torch build and the CPU kernels of the processes
    started with ``env`` (torch's CPU capability there, and whether child_env pinned them)."""
    import torch

    from plugins.lab import pinned_kernels

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=30).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                    capture_output=True, text=True, timeout=30).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit = dirty = None
    return {"commit": commit, "commit_dirty": dirty, "torch": torch.__version__,
            "cpu_capability": pinned_kernels.capability(env),
            "cpu_kernels_pinned": all(env.get(k) == v for k, v in pinned_kernels.PINNED.items())}


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
                             generate_args=args.generate_args, jobs=args.jobs, threads=args.threads,
                             no_paper=True)


# the rounding control's columns: (result or log key, heading, digits)
CONTROL_COLUMNS = [("fairseq_bleu", "test BLEU", 2), ("sacrebleu", "sacreBLEU", 2), ("valid_loss", "last valid loss", 3),
                   ("train_loss_gap", "loss gap", 4), ("train_stability", "stability ‖ε_t − ε_{t−1}‖", 4)]


def _value(results, stats, key, column):
    if key not in results:
        return None
    return results[key][column] if column in ("fairseq_bleu", "sacrebleu") else _float(stats[key].get(column))


def rounding_control(args, results, stats):
    """(markdown table, bands) of the rounding control: the control run beside the same
    method and seed unperturbed, their difference (the band rounding alone opens) and the
    method's spread over seeds; ("", {}) until both runs are scored. ``bands``: {"bleu":
    |difference of test BLEU|, log key: |difference|}."""
    if args.control == "none":
        return "", {}
    m, s = args.control, args.seeds[0]
    base, nudged = (m, s), (m, s, "control")
    if base not in results or nudged not in results:
        return "", {}
    head = ["run"] + [c[1] for c in CONTROL_COLUMNS]
    rows = {"base": [], "nudged": [], "band": [], "spread": []}
    bands = {}
    for column, _, digits in CONTROL_COLUMNS:
        a, b = _value(results, stats, base, column), _value(results, stats, nudged, column)
        spread = mean_std(_value(results, stats, (m, t), column) for t in args.seeds)[1]
        for row, v in (("base", a), ("nudged", b)):
            rows[row].append("-" if v is None else "%.*f" % (digits, v))
        band = None if a is None or b is None else abs(b - a)
        rows["band"].append("-" if band is None else "%.*f" % (digits, band))
        rows["spread"].append("-" if spread is None else "%.*f" % (digits, spread))
        if band is not None:
            bands["bleu" if column == "fairseq_bleu" else column] = band
    label = "%s s%d" % (label_of(m), s)
    lines = [
        "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|",
        "| %s | %s |" % (label, " | ".join(rows["base"])),
        "| %s, every initial weight %d float up | %s |" % (label, CONTROL_ULPS, " | ".join(rows["nudged"])),
        "| **rounding band** (difference) | %s |" % " | ".join(rows["band"]),
        "| seed spread (std of %s over seeds %s) | %s |" % (label_of(m), ", ".join(map(str, args.seeds)),
                                                         " | ".join(rows["spread"])),
    ]
    return "\n".join(lines) + "\n", bands


def headline(methods, seeds, results, stats, bands):
    """The demo's first lines: the stability result (what it can show), then BLEU (what it cannot)."""
    if len(seeds) < 2:
        return ["One seed per method: the demo's verdicts need at least 2 seeds (it runs 3)."]
    lines = []
    stab = run_values(results, stats, methods, seeds, "train_stability")
    if len(stab) >= 2:
        ms = sorted(stab, key=lambda m: mean_std(stab[m])[0])
        lo, hi = ms[0], ms[-1]
        (ml, _), (mh, _) = mean_std(stab[lo]), mean_std(stab[hi])
        separate = max(stab[lo]) < min(stab[hi])
        band = bands.get("train_stability")
        lines.append(
            "**Stability** ‖ε_t − ε_{t−1}‖ (the paper's Fig. 4): %s %s against %s %s, %.2f times as much; %s%s."
            % (label_of(lo), fmt_mean_std(stab[lo], 4), label_of(hi), fmt_mean_std(stab[hi], 4), ml / mh,
               ("every seed of %s below every seed of %s (exact permutation test p = %.2f, the smallest %d "
                "against %d seeds allow)" % (label_of(lo), label_of(hi), permutation_test(stab[lo], stab[hi]),
                                             len(seeds), len(seeds))) if separate else
               "the seeds overlap (p = %.2f)" % permutation_test(stab[lo], stab[hi]),
               "; the rounding control moves it by %.4f, %.0f times less than the difference" % (band, (mh - ml) / band)
               if band else ""))
    bleu = run_values(results, stats, methods, seeds, "bleu")
    ms = list(bleu)
    if len(ms) >= 2:
        ps = [permutation_test(bleu[a], bleu[b]) for i, a in enumerate(ms) for b in ms[i + 1:]]
        diffs = [abs(mean_std(bleu[b])[0] - mean_std(bleu[a])[0]) for i, a in enumerate(ms) for b in ms[i + 1:]]
        spreads = [mean_std(bleu[m])[1] for m in ms]
        floor = smallest_p(len(seeds), len(seeds))
        band = bands.get("bleu")
        if min(ps) > 0.05:
            said = ("no difference of mean test BLEU between methods (%.2f to %.2f) is significant (exact "
                    "two-sided permutation test over seeds, smallest p %.2f%s)"
                    % (min(diffs), max(diffs), min(ps),
                       "; with %d seeds against %d no p below %.2f is possible" % (len(seeds), len(seeds), floor)
                       if floor > 0.05 else ""))
        else:
            said = "some differences of mean test BLEU are significant at 0.05 (below)"
        lines.append("**Test BLEU**: %s; the seed spread (std) is %.2f to %.2f BLEU%s. %s"
                     % (said, min(spreads), max(spreads),
                        ", and rounding alone (the control) moved one run by %.2f" % band if band is not None else "",
                        "On this toy corpus, BLEU differences between the methods are within noise."
                        if min(ps) > 0.05 else ""))
    return lines


def limits(seeds):
    n = len(seeds)
    if n < 2:
        return ""
    more = next(k for k in range(n, 20) if smallest_p(k, k) <= 0.05)
    return ("What %d seeds can show: the test splits the 2 x %d per-seed values of two methods in all %d ways; "
            "the smallest two-sided p it can give is %.3f. %s A difference smaller than the rounding band can "
            "come from rounding alone, however the seeds fall."
            % (n, n, math.comb(2 * n, n), smallest_p(n, n),
               ("So no difference between two methods can be significant at 0.05, however large: p = %.2f says "
                "only that the seeds separate completely. A significant difference needs at least %d seeds per "
                "method (smallest p %.3f)." % (smallest_p(n, n), more, smallest_p(more, more)))
               if smallest_p(n, n) > 0.05 else ""))


def summary(args, results, stats, bands, tests):
    """The machine-readable summary (results.json): the settings, every run's numbers and
    provenance, per method mean and std, the tests and the rounding band."""
    runs = []
    for key, r in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1], len(kv[0]))):
        st = stats.get(key, {})
        runs.append({"method": key[0], "seed": key[1], "control": len(key) > 2,
                     "nudged_ulps": r.get("nudged_ulps", 0), "fairseq_bleu": r["fairseq_bleu"],
                     "sacrebleu": r["sacrebleu"], "sentences": r["n"],
                     **{k: _float(st.get(k)) for k, _, _ in SUMMARY_DIAG},
                     "resumed_at": r.get("resumed_at", []),
                     **{k: r.get(k) for k in ("commit", "commit_dirty", "torch", "cpu_capability",
                                              "cpu_kernels_pinned")}})
    methods = {}
    for m in args.methods:
        done = [s for s in args.seeds if (m, s) in results]
        entry = {"seeds": done}
        for name, values in (("fairseq_bleu", [results[m, s]["fairseq_bleu"] for s in done]),
                             ("sacrebleu", [results[m, s]["sacrebleu"] for s in done])) + tuple(
                (k, [_float(stats[m, s].get(k)) for s in done]) for k, _, _ in SUMMARY_DIAG):
            entry[name + "_mean"], entry[name + "_std"] = mean_std(values)
        methods[m] = entry
    return {"settings": settings_of(args), "complete": len(results) == len(jobs_of("", args)),
            "runs": runs, "methods": methods, "rounding_band": bands, "tests": tests,
            "test": "exact two-sided permutation test of the difference of means over seeds "
                    "(plugins.lab.stats.permutation_test)"}


def report(out, args, results, bleu_command):
    """The seeded comparison, led by what it can show, with the rounding control and the
    per-run diagnostics, as markdown (also written to ``results.md``, beside the
    machine-readable ``results.json``), with the vasso-bleu command that gives the same
    BLEU columns. Before every run is scored: the finished ones, under a line that says the
    table is partial."""
    from fairseq_vasso.nmt import recipe as nmt_common

    seeds = args.seeds
    total = len(jobs_of("", args))
    methods = [m for m in args.methods if any((m, s) in results for s in seeds)]
    stats = {key: last_epoch_stats(os.path.join(run_dir(out, key[0], key[1], len(key) > 2), "train.log"))
             for key in results}
    first = next(iter(results.values()))
    paper = ", ".join("%s %.2f" % (label_of(m), nmt_common.METHODS[m].paper_bleu) for m in args.methods)
    partial = len(results) < total
    control_table, bands = rounding_control(args, results, stats)
    lines = compare(methods, seeds, results, stats, bands) if not partial else ["when every run is scored."]
    tests = [] if partial else [
        {"quantity": q, "a": a, "b": b, "difference": mean_std(vb)[0] - mean_std(va)[0],
         "p": permutation_test(va, vb), "smallest_p": smallest_p(len(va), len(vb))}
        for q in ("bleu", "train_stability")
        for vals in [run_values(results, stats, methods, seeds, q)]
        for i, a in enumerate(list(vals)) for b in list(vals)[i + 1:]
        for va, vb in [(vals[a], vals[b])]]
    resumed = ["%s s%d%s at update %s" % (label_of(k[0]), k[1], " (control)" if len(k) > 2 else "",
                                          ", ".join(map(str, r["resumed_at"])))
               for k, r in sorted(results.items()) if r.get("resumed_at")]
    head = []
    if partial:
        head = ["", "**Partial: %d of %d runs scored.** The rest are still running, or were interrupted: the same "
                "command finishes them." % (len(results), total)]
    prov = provenance_line(results)
    text = "\n".join(head + [
        "",
        "## Toy de-en demo: test BLEU with %.0f %% of the training targets misaligned" % (100 * args.train_noise),
        "",
        "%d training pairs (%.0f %% with the English side of another pair), clean valid (%d) and test (%d) "
        "references; %d updates per run, %s scored; seeds %s; rho %g; %d torch thread(s) per process; %s."
        % (args.train, 100 * args.train_noise, args.valid, first["n"], args.max_update,
           "checkpoint_%s.pt" % args.checkpoint, ", ".join(map(str, seeds)), args.rho, args.threads, prov),
        "",
    ] + ([line + "\n" for line in headline(methods, seeds, results, stats, bands)] if not partial else []) + [
        summary_table(methods, seeds, results, stats),
    ] + (["Rounding control (`--control %s`): the same run with every initial weight moved %d float up "
          "(`torch.nextafter`), beside the seed spread:" % (args.control, CONTROL_ULPS), "", control_table]
         if control_table else []) + [
        "Differences between methods, from an exact two-sided permutation test of the per-seed values "
        "(`plugins.lab.stats.permutation_test`):",
        "",
    ] + ["- " + line for line in lines] + [
        "",
        limits(seeds),
        "",
        "fairseq BLEU: tokenized BLEU4 of fairseq-generate --beam 5 --remove-bpe %s; sacreBLEU: %s on detokenized "
        "text. Loss gap and stability: fairseq_vasso's log, mean over the last epoch ('-': AdamW has none). For "
        "reference only, the paper's IWSLT-14 BLEU (a far larger task): %s."
        % (args.generate_args, first["sacrebleu_signature"], paper),
    ] + (["", "Marked%s: resumed from its checkpoint_last.pt after an interruption, as fairseq-train resumes "
          "(%s). Stock fairseq-train does not continue a run bit for bit across such a resume (its own --optimizer "
          "adam neither), so a resumed run's numbers can differ from an uninterrupted one's by more than "
          "rounding; `--restart` gives the uninterrupted table." % (RESUMED_MARK, "; ".join(resumed))]
         if resumed else []) + [
        "",
        "The BLEU columns again, by hand (vasso-bleu writes new generate-test-N folders beside these runs' "
        "and never overwrites them):",
        "",
        "    " + bleu_command,
        "",
        "## Per run: training diagnostics of the last epoch",
        "",
        runs_table(methods, seeds, stats, control=(args.control, seeds[0]) if control_table else None),
    ])
    write_text(os.path.join(out, "results.md"), text)
    write_json(os.path.join(out, "results.json"), summary(args, results, stats, bands, tests))
    return text


def provenance_line(results):
    """Where the runs were measured: commit(s), torch, CPU kernels (from each result's provenance)."""
    def values(key):
        suffix = {"commit": lambda r: "+changes" if r.get("commit_dirty") else "",
                  "cpu_capability": lambda r: " (pinned)" if r.get("cpu_kernels_pinned") else ""}.get(key)
        return sorted({str(r.get(key)) + (suffix(r) if suffix else "")
                       for r in results.values() if r.get(key) is not None})
    commits, torches, cpus = values("commit"), values("torch"), values("cpu_capability")
    return "measured at commit %s, torch %s, CPU kernels %s" % (
        ", ".join(commits) or "unknown", ", ".join(torches) or "unknown", ", ".join(cpus) or "unknown")


def write_text(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def plot(out, args, results, log, quiet=False, final=False):
    """The paper's Fig. 4 (stability) and the loss gap for the scored runs; with ``final``
    (stage 3, once every run is scored), its Fig. 3 as well."""
    from plugins.lab.plot import diagnostics as plot_diagnostics
    from plugins.lab.plot import sphere as adversary_sphere

    # label=path specs (no '=' in a label); labels starting with SAM / VASSO give the first
    # seed of each the paper's colours (vasso-plot: SAM orange, VASSO blue)
    runs = ["%s s%d=%s" % (label_of(m).replace(" (theta=", " θ").rstrip(")"), s,
                           os.path.join(run_dir(out, m, s), "train.log"))
            for m in args.methods if passes(m) > 1 for s in args.seeds if (m, s) in results]
    if runs:  # (--force: the demo's own figures in its own folder, redrawn as its runs are scored)
        png = os.path.join(out, "diagnostics.png")
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            plot_diagnostics.main(runs + ["-o", png, "--force", "--smooth", "5", "--title",
                                          "demo: toy de-en, %.0f %% misaligned targets" % (100 * args.train_noise)])
        if not quiet:
            log("diagnostics plot (stability and loss gap over updates): %s" % png)
    if final:
        adversary_sphere.main(["-o", os.path.join(out, "adversaries.png"), "--force"])


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
            plot(out, args, results, log, final=True)
    except KeyboardInterrupt as exc:
        todo = jobs_of(out, args)
        done = sum(os.path.exists(result_path(out, j.method, j.seed, j.nudged)) for j in todo)
        print("\ndemo: stopped (%s); every fairseq process it started was stopped too. %d of %d runs are finished "
              "and kept in %s. Run the same command again to finish the rest: a run cut short in training resumes "
              "from its last checkpoint (add --restart to start over)."
              % (exc or "interrupted", done, len(todo), args.out), file=sys.stderr, flush=True)
        return 130
    me, kids = cpu_seconds()
    log("done; table in %s, plots in %s. CPU time: %.0f s (%.0f s in fairseq processes, %.0f s in this one); "
        "on 2 idle cores about %s" % (os.path.join(out, "results.md"), out, me + kids, kids, me,
                                      fmt_duration((me + kids) / 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
