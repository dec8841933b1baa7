"""Test BLEU of fairseq checkpoints, per seed and mean ± std per method, beside the paper.

For every checkpoint this runs fairseq's own generator::

    fairseq-generate DATA --path CKPT --gen-subset test --beam 5 --remove-bpe \\
        --required-batch-size-multiple 1 --batch-size 128 --user-dir fairseq_vasso \\
        --results-path CKPT_DIR/generate-test --log-format simple --log-interval 1 --num-workers 0

(``--required-batch-size-multiple 1``: otherwise fairseq-generate can silently drop
sentences; this script checks that every sentence of the subset was translated.
``--user-dir``: importing fairseq_vasso allow-lists ``argparse.Namespace`` so the
checkpoint loads with torch's ``weights_only`` protection on. ``--log-interval 1``: one
progress line per batch, which this command turns into progress with the elapsed time.
``--num-workers 0``: fairseq's loader process would leave a ``pymp-*`` folder in the temp dir.)
fairseq's default length limits stay (``--max-len-a 0 --max-len-b 200``), so the scores
are comparable with the paper's; when most hypotheses run into that limit (an
undertrained model: generation is then slow), one line says so and how to bound it
with ``--generate-args``. It then reports

* **fairseq BLEU**: the ``BLEU4`` that fairseq-generate prints, i.e. tokenized BLEU
  on the (Moses-tokenized, lowercased, BPE-removed) text: the number the paper's
  table and fairseq's README report;
* **sacreBLEU**: ``sacrebleu.corpus_bleu`` (13a tokenization, its defaults) on
  detokenized text: the hypotheses (``H-`` lines) and the references (``T-`` lines,
  or ``--ref-file``, a tokenized reference such as
  ``data/iwslt14.tokenized.de-en/tmp/test.en``, which avoids the ``<unk>`` that
  binarized references can contain) are detokenized with sacremoses'
  ``MosesDetokenizer`` first. IWSLT-14 as prepared by fairseq is lowercased, so
  this is lowercase sacreBLEU; it is not comparable with published cased scores.

Checkpoints: ``--runs RUNS`` finds ``RUNS/<method>/seed<k>/CHECKPOINT`` (the recipe's
layout); ``--checkpoint METHOD=PATH`` (repeatable) names them one by one. Methods
with a row in the paper's table (adamw, sam, asam, vasso0.9, vasso0.4) show the
paper's BLEU beside them. The table is markdown; ``--json`` also writes every number.

Nothing of an earlier run is overwritten: each checkpoint's fairseq-generate output goes
to a new folder beside it (``generate-test``, else ``generate-test-2``, ``-3``, ...), and
``--out`` / ``--json`` refuse an existing file unless ``--force``. The demo
(``scripts/translation/demo.py``) scores with this module's :func:`score` and prints the
``vasso-bleu`` command that reproduces its BLEU columns.

Usage::

    vasso-bleu data-bin/iwslt14.tokenized.de-en --runs runs/iwslt14
    python -m fairseq_vasso.nmt.bleu ...     # the same without the console script
"""

import argparse
import json
import math
import os
import re
import shlex
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from plugins.lab import tables
from plugins.lab.tables import fmt_mean_std, refuse_existing

from . import recipe as nmt
from .recipe import METHODS

BLEU_LINE = re.compile(r"^Generate (\S+) with beam=(\d+): BLEU4 = ([0-9.]+)")
# fairseq's simple progress bar, one line per batch with --log-interval 1: ":      3 / 12 wps=..."
BATCH_LINE = re.compile(r":\s+(\d+) / (\d+)\b")
# fairseq-generate's defaults (fairseq.dataclass.configs.GenerationConfig)
DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B = 0.0, 200
# what the warning suggests: the length limits of fairseq README's validation BLEU
SUGGESTED_BOUND = "--max-len-a 1.2 --max-len-b 10"


# ---------------------------------------------------------------- generate
def generate_command(data, checkpoint, results_dir, *, subset="test", beam=5, batch_size=128,
                     user_dir=None, cpu=None, extra=()):
    cmd = [nmt.fairseq_bin("fairseq-generate"), data, "--path", checkpoint,
           "--gen-subset", subset, "--beam", str(beam), "--remove-bpe",
           "--required-batch-size-multiple", "1", "--batch-size", str(batch_size),
           "--user-dir", user_dir or nmt.default_user_dir(), "--results-path", results_dir,
           "--log-format", "simple", "--log-interval", "1",
           # no loader process (fairseq's default is one): torch terminates it at exit, which leaves
           # its multiprocessing folder (pymp-*) in the temp dir; a test set loads in a moment without it
           "--num-workers", "0"]
    if cpu is None:
        cpu = not _cuda_available()
    if cpu:
        cmd.append("--cpu")
    return cmd + list(extra)


def _cuda_available():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def dataset_size(data, subset, src=None, tgt=None):
    """Number of sentences in a binarized fairseq subset (read from its .idx header), or None."""
    names = sorted(n for n in os.listdir(data) if n.startswith(subset + ".") and n.endswith(".idx"))
    if src and tgt:
        names = [n for n in names if n == "%s.%s-%s.%s.idx" % (subset, src, tgt, src)] or names
    for name in names:
        with open(os.path.join(data, name), "rb") as f:
            head = f.read(9 + 8 + 1 + 8)
        if head[:9] == b"MMIDIDX\x00\x00":
            return struct.unpack("<Q", head[18:26])[0]
    return None


def parse_generate(path):
    """Parses a fairseq-generate output file.

    Returns dict(hyps, refs, srcs: lists ordered by sentence id; bleu: fairseq's BLEU4
    (None if absent); bleu_line; subset; beam).
    """
    hyps, refs, srcs = {}, {}, {}
    bleu = bleu_line = subset = beam = None
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("H-"):
                sid, _score, text = (line.split("\t", 2) + ["", ""])[:3]
                hyps[int(sid[2:])] = text
            elif line.startswith("T-"):
                sid, text = (line.split("\t", 1) + [""])[:2]
                refs[int(sid[2:])] = text
            elif line.startswith("S-"):
                sid, text = (line.split("\t", 1) + [""])[:2]
                srcs[int(sid[2:])] = text
            else:
                m = BLEU_LINE.match(line)
                if m:
                    subset, beam, bleu = m.group(1), int(m.group(2)), float(m.group(3))
                    bleu_line = line
    ids = sorted(hyps)
    return {"ids": ids, "hyps": [hyps[i] for i in ids], "refs": [refs.get(i, "") for i in ids],
            "srcs": [srcs.get(i, "") for i in ids], "bleu": bleu, "bleu_line": bleu_line,
            "subset": subset, "beam": beam}


def detokenize(lines, lang="en"):
    from sacremoses import MosesDetokenizer

    md = MosesDetokenizer(lang=lang)
    return [md.detokenize(line.split()) for line in lines]


def sacrebleu_score(hyps, refs, lang="en"):
    """sacreBLEU (13a) on detokenized hypotheses and references; returns (score, signature)."""
    import sacrebleu

    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(detokenize(hyps, lang), [detokenize(refs, lang)])
    return result.score, str(metric.get_signature())


def length_limits(extra):
    """(max_len_a, max_len_b) that fairseq-generate uses given the extra arguments."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-len-a", type=float, default=DEFAULT_MAX_LEN_A)
    p.add_argument("--max-len-b", type=int, default=DEFAULT_MAX_LEN_B)
    known, _ = p.parse_known_args(list(extra))
    return known.max_len_a, known.max_len_b


class LengthLimitWatch:
    """Counts the hypotheses of a fairseq-generate output file (read as it grows) that
    stopped at the length limit ``max_len_a * source length + max_len_b``.

    The source length is that of the ``S-`` line (BPE removed, plus the end of sentence),
    a lower bound of what the generator saw; with fairseq's default ``max_len_a = 0``
    the count is exact. A hypothesis's length is its ``P-`` scores less the end of
    sentence."""

    def __init__(self, path, max_len_a=DEFAULT_MAX_LEN_A, max_len_b=DEFAULT_MAX_LEN_B):
        self.path, self.max_len_a, self.max_len_b = path, max_len_a, max_len_b
        self.hypotheses = self.at_limit = 0
        self._offset, self._partial, self._src_len = 0, "", {}

    def update(self):
        try:
            with open(self.path, encoding="utf-8", newline="\n") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith("S-"):
                sid, _, src = line.partition("\t")
                self._src_len[sid[2:]] = len(src.split()) + 1
            elif line.startswith("P-"):
                sid, _, scores = line.partition("\t")
                limit = int(self.max_len_a * self._src_len.get(sid[2:], 1) + self.max_len_b)
                self.hypotheses += 1
                self.at_limit += int(len(scores.split()) - 1 >= limit)

    @property
    def mostly_at_limit(self):
        return self.hypotheses > 0 and self.at_limit > self.hypotheses / 2

    def message(self, name):
        head = ("%s: %d of %d hypotheses stop at the length limit (--max-len-a %g --max-len-b %d)"
                % (name, self.at_limit, self.hypotheses, self.max_len_a, self.max_len_b))
        if (self.max_len_a, self.max_len_b) != (DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B):
            return head + ", set by --generate-args: the model looks undertrained"
        return (head + ", fairseq-generate's default: the model looks undertrained and generation is slow; to "
                "bound it, pass --generate-args \"%s\" (fairseq README's validation limits; the scores are then "
                "not comparable with the paper's)" % SUGGESTED_BOUND)


def evaluate_checkpoint(data, checkpoint, *, subset="test", beam=5, batch_size=128, user_dir=None,
                        cpu=None, lang="en", ref_file=None, results_dir=None, extra=(), env=None,
                        name=None, progress=None):
    """Runs fairseq-generate on one checkpoint and scores it; returns a dict of results.

    ``progress(message)``, when given, gets a line per batch (at most one every 2 s, and
    the last) with the elapsed time and an estimate of what remains, and one line when
    most hypotheses run into the length limit; ``name`` labels them (default: the path)."""
    if results_dir is None:
        results_dir = fresh_dir(os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "generate-" + subset))
    else:
        os.makedirs(results_dir)  # a new folder: an earlier run's output is never overwritten
    cmd = generate_command(data, checkpoint, results_dir, subset=subset, beam=beam, batch_size=batch_size,
                           user_dir=user_dir, cpu=cpu, extra=extra)
    log = os.path.join(results_dir, "generate.log")
    out_file = os.path.join(results_dir, "generate-%s.txt" % subset)
    name = name or checkpoint
    watch = LengthLimitWatch(out_file, *length_limits(extra))
    state = {"start": time.time(), "shown": 0.0, "warned": False}

    def warn_once():
        if progress and not state["warned"] and watch.mostly_at_limit:
            state["warned"] = True
            progress(watch.message(name))

    def on_line(line):
        m = BATCH_LINE.search(line)
        if not m or progress is None:
            return
        done, total = int(m.group(1)), int(m.group(2))
        elapsed = time.time() - state["start"]
        if done < total and elapsed - state["shown"] < 2.0:
            return
        state["shown"] = elapsed
        left = elapsed / done * (total - done)
        progress("%s: batch %d/%d, %.0f s elapsed, about %.0f s left" % (name, done, total, elapsed, left))
        watch.update()
        warn_once()

    if progress:
        progress("%s: fairseq-generate --beam %d on %s/%s (log: %s)" % (name, beam, data, subset, log))
    rc = nmt.run_logged(cmd, log, env=env, on_line=on_line)
    if rc != 0 or not os.path.exists(out_file):
        raise RuntimeError("fairseq-generate failed (exit status %d) on %s:\n%s" % (rc, checkpoint, nmt.tail(log)))
    watch.update()
    warn_once()
    parsed = parse_generate(out_file)
    if parsed["bleu"] is None:
        raise RuntimeError("no 'Generate %s with beam=...: BLEU4 = ...' line in %s" % (subset, out_file))
    expected = dataset_size(data, subset)
    if expected is not None and len(parsed["hyps"]) != expected:
        raise RuntimeError("%s: %d hypotheses for %d sentences in %s/%s" % (out_file, len(parsed["hyps"]),
                                                                              expected, data, subset))
    refs = parsed["refs"]
    if ref_file:
        with open(ref_file, encoding="utf-8", newline="\n") as f:
            all_refs = f.read().split("\n")
        refs = [all_refs[i] for i in parsed["ids"]]
    sacre, signature = sacrebleu_score(parsed["hyps"], refs, lang)
    return {"checkpoint": checkpoint, "output": out_file, "n": len(parsed["hyps"]), "fairseq_bleu": parsed["bleu"],
            "fairseq_bleu_line": parsed["bleu_line"], "sacrebleu": sacre, "sacrebleu_signature": signature,
            "at_length_limit": watch.at_limit, "seconds": round(time.time() - state["start"], 1)}


def fresh_dir(base):
    """Makes and returns ``base``, or ``base-2``, ``base-3``, ... when it exists: a folder of
    its own for this run's output."""
    for k in range(1, 10000):
        path = base if k == 1 else "%s-%d" % (base, k)
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise RuntimeError("no free folder name %s-N" % base)


def score(data, todo, *, subset="test", beam=5, batch_size=128, user_dir=None, cpu=None, lang="en",
          ref_file=None, extra=(), jobs=1, env=None, threads=None, say=print, batch_progress=True):
    """Scores the checkpoints ``todo`` ([(method, seed, path)]), ``jobs`` fairseq-generate
    processes at once with ``threads`` threads each (default: cores / jobs); returns their
    results (dicts, with method and seed) in ``todo``'s order. The one scoring loop of
    vasso-bleu and the demo (which fixes ``threads``: its numbers must not depend on the cores).

    ``say(line)`` gets a line per scored checkpoint (with what is left), and with
    ``batch_progress`` the per-batch progress of :func:`evaluate_checkpoint`."""
    jobs = max(1, min(jobs, len(todo)))
    threads = str(threads or max(1, (os.cpu_count() or 1) // jobs))
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    start, lock, done = time.time(), threading.Lock(), []

    def one(numbered):
        k, (method, seed, path) = numbered
        name = "%s seed %d (checkpoint %d/%d)" % (method, seed, k, len(todo))
        r = evaluate_checkpoint(data, path, subset=subset, beam=beam, batch_size=batch_size, user_dir=user_dir,
                                cpu=cpu, lang=lang, ref_file=ref_file, extra=extra, env=env, name=name,
                                progress=say if batch_progress else None)
        r.update(method=method, seed=seed)
        with lock:
            done.append(r)
            left = (time.time() - start) / len(done) * (len(todo) - len(done)) / jobs
            say("%s seed %d: fairseq BLEU %.2f, sacreBLEU %.2f (%d sentences, %.0f s; %d of %d scored, about %.0f s "
                "left) -> %s" % (method, seed, r["fairseq_bleu"], r["sacrebleu"], r["n"], r["seconds"], len(done),
                                 len(todo), left, r["output"]))
        return r

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, enumerate(todo, 1)))


def command(data, *, runs=None, checkpoints=(), checkpoint_name=None, subset="test", beam=5, batch_size=128,
            user_dir=None, cpu=None, lang="en", ref_file=None, generate_args="", jobs=1, threads=None,
            no_paper=False):
    """The ``vasso-bleu`` command line (a shell string) that scores with these settings; the
    paths as given (the demo gives them relative to where it was started)."""
    prog = os.path.join(os.path.dirname(sys.executable), "vasso-bleu")
    if os.path.exists(prog):
        rel = os.path.relpath(prog)
        prog = rel if not rel.startswith("..") else prog
    else:
        prog = "vasso-bleu"
    words = [prog, data]
    if runs:
        words += ["--runs", runs]
    for method, path in checkpoints:
        words += ["--checkpoint", "%s=%s" % (method, path)]
    defaults = build_parser().parse_args(["data"])
    for flag, value in (("--checkpoint-name", checkpoint_name), ("--subset", subset), ("--beam", beam),
                        ("--batch-size", batch_size), ("--user-dir", user_dir), ("--lang", lang),
                        ("--ref-file", ref_file), ("--generate-args", generate_args), ("--jobs", jobs),
                        ("--threads", threads)):
        if value is not None and value != getattr(defaults, flag[2:].replace("-", "_")):
            words += [flag, str(value)]
    if cpu:
        words.append("--cpu")
    if no_paper:
        words.append("--no-paper")
    return " ".join(shlex.quote(w) for w in words)


# ---------------------------------------------------------------- runs and the table
def find_runs(runs, checkpoint_name="checkpoint_best.pt"):
    """[(method, seed, path)] for RUNS/<method>/seed<k>/CHECKPOINT, methods in the paper's order."""
    found = []
    if not os.path.isdir(runs):
        return found
    for method in os.listdir(runs):
        mdir = os.path.join(runs, method)
        if not os.path.isdir(mdir):
            continue
        for sdir in os.listdir(mdir):
            m = re.fullmatch(r"seed(\d+)", sdir)
            path = os.path.join(mdir, sdir, checkpoint_name)
            if m and os.path.exists(path):
                found.append((method, int(m.group(1)), path))
    return sorted(found, key=lambda r: (method_order(r[0]), r[0], r[1]))


def method_order(name):
    names = list(METHODS)
    return names.index(name) if name in names else len(names)


def markdown_table(results, paper_column=True, title=None):
    """results: [{method, seed, fairseq_bleu, sacrebleu, ...}] -> markdown table (str)."""
    by_method = {}
    for r in results:
        by_method.setdefault(r["method"], []).append(r)
    head = ["Method"]
    if paper_column:
        head.append("paper BLEU (IWSLT-14)")
    head += ["fairseq BLEU", "sacreBLEU", "seeds", "per seed: fairseq / sacreBLEU"]
    rows = []
    for method in sorted(by_method, key=lambda m: (method_order(m), m)):
        runs = sorted(by_method[method], key=lambda r: r["seed"])
        cells = [METHODS[method].label if method in METHODS else method]
        if paper_column:
            cells.append("%.2f" % METHODS[method].paper_bleu if method in METHODS else "-")
        cells.append(fmt_mean_std([r["fairseq_bleu"] for r in runs]))
        cells.append(fmt_mean_std([r["sacrebleu"] for r in runs]))
        cells.append(str(len(runs)))
        cells.append(", ".join("s%d: %.2f / %.2f" % (r["seed"], r["fairseq_bleu"], r["sacrebleu"]) for r in runs))
        rows.append(cells)
    return tables.markdown_table(head, rows, align="-" * len(head), title=title) + "\n"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one and the help text does not name it already."""

    def _get_help_string(self, action):
        if action.default in (None, False, "", [], argparse.SUPPRESS) or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser():
    p = argparse.ArgumentParser(prog="vasso-bleu", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter,
                                epilog="Example: vasso-bleu data-bin/iwslt14.tokenized.de-en --runs runs/iwslt14")
    p.add_argument("data", help="binarized data directory (fairseq-preprocess --destdir)")
    p.add_argument("--runs", help="score every RUNS/<method>/seed<k>/CHECKPOINT (the recipe's layout)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="METHOD=PATH",
                   help="a checkpoint to score as METHOD (repeatable; seed from a seed<k> folder, else 1, 2, ...)")
    p.add_argument("--checkpoint-name", default="checkpoint_best.pt",
                   help="the checkpoint file that --runs looks for in every run folder")
    p.add_argument("--subset", default="test", help="the binarized subset to translate (fairseq-generate --gen-subset)")
    p.add_argument("--beam", type=int, default=5, help="beam size (fairseq-generate --beam)")
    p.add_argument("--batch-size", type=int, default=128, help="sentences per batch (fairseq-generate --batch-size)")
    p.add_argument("--user-dir", default=None,
                   help="fairseq_vasso folder for fairseq-generate --user-dir (default: this installed package)")
    p.add_argument("--lang", default="en", help="target language, for Moses detokenization before sacreBLEU")
    p.add_argument("--ref-file",
                   help="tokenized plain-text reference for sacreBLEU, one line per sentence id "
                        "(default: the T- lines of fairseq-generate's output)")
    p.add_argument("--cpu", action="store_true", default=None,
                   help="pass --cpu to fairseq-generate (default: only when CUDA is absent)")
    p.add_argument("--jobs", type=int, default=1, help="fairseq-generate processes at once")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of each fairseq-generate (default: the cores / --jobs); the thread count "
                        "changes how torch splits its sums, so a BLEU is reproduced with the --threads it was "
                        "scored with (the demo prints its own)")
    p.add_argument("--generate-args", default="",
                   help="more fairseq-generate arguments, one string; e.g. \"%s\" bounds the length of the "
                        "hypotheses (fairseq's defaults, which the paper's scores assume, are --max-len-a 0 "
                        "--max-len-b 200)" % SUGGESTED_BOUND)
    p.add_argument("--no-paper", action="store_true", help="leave out the paper's column")
    p.add_argument("--title", default=None, help="a heading (### TITLE) above the table")
    p.add_argument("--out", help="also write the markdown table here (a new file, unless --force)")
    p.add_argument("--json", help="also write every number here (a new file, unless --force)")
    p.add_argument("--force", action="store_true", help="let --out and --json overwrite existing files")
    return p


def no_checkpoint_message(runs, checkpoint_name):
    """What --runs looked for and what it found instead."""
    pattern = os.path.join(runs, "<method>", "seed<k>", checkpoint_name)
    if not os.path.isdir(runs):
        return "--runs %s: no such directory (looked for %s)" % (runs, pattern)
    seen = sorted({os.path.basename(f) for f in _glob_run_files(runs) if f.endswith(".pt")})
    folders = len(_glob_run_dirs(runs))
    found = ("%d run folder(s) there hold %s" % (folders, ", ".join(seen)) if seen
             else "%d run folder(s) <method>/seed<k> there, with no .pt file" % folders)
    hint = "; --checkpoint-name picks another file" if seen else ""
    return "--runs given but no checkpoint matched %s under %s (%s%s)" % (checkpoint_name, runs, found, hint)


def _glob_run_dirs(runs):
    return [os.path.join(runs, m, d) for m in sorted(os.listdir(runs)) if os.path.isdir(os.path.join(runs, m))
            for d in sorted(os.listdir(os.path.join(runs, m))) if re.fullmatch(r"seed\d+", d)
            and os.path.isdir(os.path.join(runs, m, d))]


def _glob_run_files(runs):
    return [os.path.join(d, f) for d in _glob_run_dirs(runs) for f in os.listdir(d)]


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)

    todo = []
    if a.runs:
        found = find_runs(a.runs, a.checkpoint_name)
        if not found:
            p.error(no_checkpoint_message(a.runs, a.checkpoint_name))
        todo += found
    counters = {}
    for spec in a.checkpoint:
        if "=" not in spec:
            p.error("--checkpoint takes METHOD=PATH, got %r" % spec)
        method, path = spec.split("=", 1)
        m = re.search(r"seed(\d+)", path)
        counters[method] = counters.get(method, 0) + 1
        todo.append((method, int(m.group(1)) if m else counters[method], path))
    if not todo:
        p.error("no checkpoints to score: give --runs RUNS (scores RUNS/<method>/seed<k>/%s) or "
                "--checkpoint METHOD=PATH" % a.checkpoint_name)

    if not os.path.isdir(a.data):
        p.error("data: no such directory: %s (give fairseq-preprocess's --destdir)" % a.data)
    if a.ref_file and not os.path.isfile(a.ref_file):
        p.error("--ref-file: no such file: %s" % a.ref_file)
    try:
        extra = shlex.split(a.generate_args)
    except ValueError as e:
        p.error("--generate-args: %s" % e)
    for flag, value in (("--beam", a.beam), ("--batch-size", a.batch_size), ("--jobs", a.jobs),
                        ("--threads", a.threads)):
        if value is not None and value < 1:
            p.error("%s must be >= 1, got %d" % (flag, value))
    for method, seed, path in todo:
        if not os.path.exists(path):
            p.error("--checkpoint %s=%s: no such file (the checkpoint of %s seed %d)" % (method, path, method, seed))
    refuse_existing(p, {"--out": a.out, "--json": a.json}, a.force)
    start = time.time()
    lock = threading.Lock()

    def say(msg):
        with lock:
            print("[%5.0f s] %s" % (time.time() - start, msg), flush=True)

    try:
        with nmt.interruptible():  # Ctrl-C: every fairseq-generate stops with vasso-bleu
            results = score(a.data, todo, subset=a.subset, beam=a.beam, batch_size=a.batch_size,
                            user_dir=a.user_dir, cpu=a.cpu, lang=a.lang, ref_file=a.ref_file, extra=extra,
                            jobs=a.jobs, threads=a.threads, say=say)
    except KeyboardInterrupt as exc:
        print("vasso-bleu: stopped (%s), with every fairseq-generate it started; nothing was written but the "
              "new generate-test folders" % (exc or "interrupted"), file=sys.stderr)
        return 130
    table = markdown_table(results, paper_column=not a.no_paper, title=a.title)
    note = ("\nfairseq BLEU: tokenized BLEU4 from fairseq-generate --beam %d --remove-bpe%s; sacreBLEU: %s on "
            "Moses-detokenized text.\n" % (a.beam, " " + a.generate_args if a.generate_args else "",
                                            results[0]["sacrebleu_signature"]))
    print()
    print(table + note)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(table + note)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    bad = [r for r in results if not math.isfinite(r["fairseq_bleu"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
