#!/usr/bin/env python
"""Cost of SAM, VASSO and eVASSO over their base optimizer (AdamW), measured side by side.

One command::

    python scripts/benchmark.py            # full run (~10 min on 2 CPU cores)
    python scripts/benchmark.py --quick    # under ~2 min, fewer repeats
    python scripts/benchmark.py --quick --no-fairseq --markdown out.md --json out.json

What it measures (every figure is printed with the machine it was taken on):

1. **Time per update** of SAM, VASSO and eVASSO (p = 0.5) over AdamW, on two
   models: ``transformer`` (a small transformer language model: forward/backward
   dominates an update) and ``many-small`` (a deep stack of tiny Linear+LayerNorm
   blocks: hundreds of parameter tensors of <= 1K elements, where per-tensor Python
   work shows).  All methods live in one process, each with its own copy of the
   model (same initialization) and the same batch; they run in *blocks* of a few
   updates, interleaved (the order rotates every repeat), and every ratio is taken
   between blocks of the same repeat, then the median over repeats is reported.
   Slow drift of the machine (other jobs) thus cancels.  SA methods run through
   the user API ``opt.step(closure)``; AdamW through ``closure(); opt.step()``.
2. **Where the time goes**: the closure (forward+backward), the base optimizer's
   ``step`` and the wrapper's ``perturb`` / ``descend`` are timed inside every
   update.  "SA work" = update - forward/backward - base step: the perturbation,
   the EMA, the restore, the RNG replay and the Python glue, i.e. everything an
   update costs beyond what AdamW would do with the same gradients.
3. **State**: optimizer state bytes over parameter bytes, the base optimizer's
   (AdamW: exp_avg, exp_avg_sq, step) and the wrapper's (``state_nbytes()``).
4. **Peak memory**: one fresh process per method and model; the growth, from just
   after the model and batch are built to the end of the updates, of the peak bytes
   in use in glibc's malloc (``mallinfo2``, sampled every 0.2 ms by a thread: torch
   keeps CPU tensors there and has no CPU allocator statistics of its own, and
   ``tracemalloc`` does not see them), and of the peak RSS (``VmHWM``; coarse).
5. **fairseq-train** with ``--optimizer vasso`` (and ``sam`` in the full run) over
   ``--optimizer adam`` on a small generated de-en translation task: the CPU time of
   every ``Trainer.train_step`` (one process per run, runs interleaved, the same seed
   so update i sees the same batch in every run: ratios are paired per update), and
   fairseq's own ``ups`` (wall clock) from its ``train_inner`` log lines.
   Time is the process's CPU time (``time.process_time``) unless ``--clock wall``:
   other processes' time slices do not inflate it.

Threads: ``torch.set_num_threads(--threads)`` (default 1) in every process and
``OMP_NUM_THREADS`` for the children: on a shared 2-core machine one thread per
process keeps the timings from fighting over cores.  Nothing here asserts a time;
the targets are reported as PASS/MISS.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

# --------------------------------------------------------------------------- configuration

RHO = 0.1
THETA = 0.4
P_EFFICIENT = 0.5
BASE_KW = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=1e-4)

# name -> (label, wrapper class name or None for the base, keyword arguments)
METHODS: Dict[str, tuple] = {
    "adamw": ("AdamW", None, {}),
    "sam": ("SAM", "SAM", {"rho": RHO}),
    "vasso": ("VASSO", "VASSO", {"rho": RHO, "theta": THETA}),
    "evasso": (f"eVASSO(p={P_EFFICIENT:g})", "VASSO", {"rho": RHO, "theta": THETA, "p": P_EFFICIENT}),
}
# state only (no timing): eVASSO without the stability diagnostic's buffer
STATE_ONLY = {
    "evasso-nostab": (f"eVASSO(p={P_EFFICIENT:g}, track_stability=False)", "VASSO",
                      {"rho": RHO, "theta": THETA, "p": P_EFFICIENT, "track_stability": False}),
}

MODELS: Dict[str, Dict[str, Any]] = {
    "transformer": dict(kind="transformer", vocab=2000, d=256, layers=2, heads=4, ff=1024, batch=16, seq=32,
                        dropout=0.1),
    "many-small": dict(kind="many-small", blocks=150, width=32, batch=64),
}
# for the tests: seconds, not minutes
TINY_MODELS: Dict[str, Dict[str, Any]] = {
    "transformer": dict(kind="transformer", vocab=50, d=16, layers=1, heads=2, ff=32, batch=2, seq=5, dropout=0.1),
    "many-small": dict(kind="many-small", blocks=4, width=4, batch=3),
}

# mode -> timing repeats, updates per block, warm-up updates, memory repeats, memory updates,
#         fairseq repeats, fairseq max-update, fairseq optimizers
MODES = {
    "full": dict(reps=15, block=4, warmup=3, mem_reps=2, mem_steps=6, mem_models=None, fs_reps=3, fs_updates=40,
                 fs_optimizers=("adam", "sam", "vasso")),
    "quick": dict(reps=5, block=2, warmup=2, mem_reps=1, mem_steps=3, mem_models=("transformer",), fs_reps=1,
                  fs_updates=24, fs_optimizers=("adam", "vasso")),
}
MODEL_BLOCK_SCALE = {"transformer": 1, "many-small": 3}  # many-small updates are short: longer blocks

TARGETS_TEXT = {
    "vasso_over_sam": "VASSO / SAM <= 1.03",
    "sam_over_base": "SAM / AdamW <= 2.1 (fwd/bwd dominates)",
    "evasso_over_base": "eVASSO / AdamW <= 1 + p + 0.1",
    "sa_share": "SA work outside fwd/bwd <= 5% of an update (transformer)",
    "vasso_state": "VASSO extra state == 1 parameter-sized buffer",
}


# --------------------------------------------------------------------------- models


class TinyTransformerLM(torch.nn.Module):
    """Token embedding + positional embedding + pre-norm transformer encoder layers
    (causal mask) + tied output projection; cross-entropy on the next token."""

    def __init__(self, vocab, d, layers, heads, ff, seq, dropout, **_):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.norm(h) @ self.embed.weight.t()


class ManySmall(torch.nn.Module):
    """A deep residual stack of tiny Linear + LayerNorm blocks: 4 tensors per block."""

    def __init__(self, blocks, width, **_):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width)) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def build(model_cfg: Dict[str, Any], seed: int = 0):
    """(model, loss_fn) with a fixed batch; the same seed gives the same weights and batch."""
    torch.manual_seed(seed)
    if model_cfg["kind"] == "transformer":
        model = TinyTransformerLM(**model_cfg)
        g = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(0, model_cfg["vocab"], (model_cfg["batch"], model_cfg["seq"] + 1), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        def loss_fn():
            logits = model(inputs)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    elif model_cfg["kind"] == "many-small":
        model = ManySmall(**model_cfg)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(model_cfg["batch"], model_cfg["width"], generator=g)
        y = torch.randint(0, 10, (model_cfg["batch"],), generator=g)

        def loss_fn():
            return torch.nn.functional.cross_entropy(model(x), y)
    else:
        raise ValueError(f"unknown model kind {model_cfg['kind']!r}")
    model.train()
    return model, loss_fn


def make_optimizer(method: str, model: torch.nn.Module):
    label, cls_name, kw = {**METHODS, **STATE_ONLY}[method]
    if cls_name is None:
        return torch.optim.AdamW(model.parameters(), **BASE_KW)
    import plugins

    return getattr(plugins, cls_name)(model.parameters(), torch.optim.AdamW, **kw, **BASE_KW)


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts/lists/tuples."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def state_bytes(opt, model) -> Dict[str, int]:
    """Parameter bytes, the base optimizer's state bytes and the wrapper's own."""
    param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    base = getattr(opt, "base_optimizer", opt)
    base_bytes = sum(tensor_bytes(s) for s in base.state.values())
    extra = opt.state_nbytes(include_scratch=True) if hasattr(opt, "state_nbytes") else 0
    return {"param_bytes": param_bytes, "base_state_bytes": base_bytes, "extra_state_bytes": extra}


# --------------------------------------------------------------------------- timing


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


class Runner:
    """One method on its own copy of the model; times blocks of updates.

    ``clock="cpu"`` (``time.process_time``: CPU seconds of this process, all its
    threads) is immune to the time slices other processes take on a shared machine;
    ``"wall"`` is ``time.perf_counter``.
    """

    def __init__(self, method: str, model_cfg: Dict[str, Any], seed: int = 0, clock: str = "cpu"):
        self.method = method
        self.clock = CLOCKS[clock]
        self.model, self.loss_fn = build(model_cfg, seed)
        self.opt = make_optimizer(method, self.model)
        self.is_base = not hasattr(self.opt, "base_optimizer")
        self.t = self._zero()
        base = self.opt if self.is_base else self.opt.base_optimizer
        base.step = self._timed(base.step, "base_step")
        if not self.is_base:
            self.opt.perturb = self._timed(self.opt.perturb, "perturb")
            self.opt.descend = self._timed(self.opt.descend, "descend")

    @staticmethod
    def _zero():
        return {"fwdbwd": 0.0, "base_step": 0.0, "perturb": 0.0, "descend": 0.0, "passes": 0, "two_pass": 0}

    def _timed(self, fn: Callable, key: str) -> Callable:
        def wrapper(*a, **k):
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += self.clock() - t0

        return wrapper

    def _closure(self):
        t0 = self.clock()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn()
        loss.backward()
        self.t["fwdbwd"] += self.clock() - t0
        self.t["passes"] += 1
        return loss

    def update(self):
        if self.is_base:
            self._closure()
            self.opt.step()
        else:
            self.opt.step(self._closure)
            self.t["two_pass"] += int(self.opt.diagnostics["two_pass"])

    def block(self, n: int) -> Dict[str, float]:
        """Run n updates; per-update seconds of the whole and of its parts."""
        self.t = self._zero()
        each = []
        for _ in range(n):
            t0 = self.clock()
            self.update()
            each.append(self.clock() - t0)
        t = self.t
        out = {k: t[k] / n for k in ("fwdbwd", "base_step", "perturb", "descend")}
        out["total"] = sum(each) / n
        # robust to a time slice lost to another process inside the block; used for the ratios of
        # the methods whose every update does the same work (not eVASSO: its coin varies the work)
        out["update_median"] = statistics.median(each)
        out["restore"] = max(out["descend"] - out["base_step"], 0.0) if not self.is_base else 0.0
        # everything an update does beyond forward/backward and the base optimizer's step
        out["sa_work"] = out["total"] - out["fwdbwd"] - out["base_step"]
        out["passes"] = t["passes"] / n
        out["two_pass"] = t["two_pass"]
        out["updates"] = n
        return out


def interleaved_timing(model_cfg: Dict[str, Any], methods: Sequence[str], reps: int, block: int, warmup: int,
                       log: Callable[[str], None] = lambda s: None, clock: str = "cpu"
                       ) -> Dict[str, List[Dict[str, float]]]:
    """blocks[method][rep]: every method runs one block per repeat, the order rotating."""
    runners = {m: Runner(m, model_cfg, clock=clock) for m in methods}
    for r in runners.values():
        for _ in range(warmup):
            r.update()
    blocks: Dict[str, List[Dict[str, float]]] = {m: [] for m in methods}
    order = list(methods)
    for rep in range(reps):
        k = rep % len(order)
        for m in order[k:] + order[:k]:
            blocks[m].append(runners[m].block(block))
        log(f"  repeat {rep + 1}/{reps}: " + ", ".join(
            f"{m} {1e3 * blocks[m][-1]['total']:.1f} ms" for m in methods))
    return blocks


def paired_ratios(blocks: Dict[str, List[Dict[str, float]]], num: str, den: str,
                  key: str = "update_median") -> List[float]:
    """Per-repeat ratios num/den of the same repeat (adjacent in time), of the blocks'
    median update time (their mean where a block has no median)."""
    def get(b):
        return b.get(key, b["total"])

    return [get(a) / get(b) for a, b in zip(blocks[num], blocks[den]) if get(b) > 0]


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def summarize_timing(blocks: Dict[str, List[Dict[str, float]]], base: str = "adamw") -> Dict[str, Any]:
    """Medians over repeats: ms per update and its parts, ratios over the base and
    VASSO over SAM, the share of SA work, the realized two-pass fraction."""
    out: Dict[str, Any] = {"methods": {}}
    for m, bl in blocks.items():
        updates = sum(b["updates"] for b in bl)
        row = {k: 1e3 * median([b[k] for b in bl])
               for k in ("total", "fwdbwd", "base_step", "perturb", "restore", "sa_work")}
        row["sa_share"] = median([b["sa_work"] / b["total"] for b in bl if b["total"] > 0])
        row["outside_fwdbwd_share"] = median([(b["total"] - b["fwdbwd"]) / b["total"] for b in bl if b["total"] > 0])
        row["passes_per_update"] = sum(b["passes"] * b["updates"] for b in bl) / max(updates, 1)
        row["two_pass_fraction"] = (sum(b["two_pass"] for b in bl) / updates) if updates and m != base else None
        row["repeats"] = len(bl)
        if m != base and base in blocks:
            rs = paired_ratios(blocks, m, base)
            row["over_base_all"] = rs
            if row["two_pass_fraction"] is not None and 0.0 < row["two_pass_fraction"] < 1.0:
                # a coin decides each update: one block may hold 0 or all two-pass updates, so the
                # per-repeat ratios scatter; the ratio of the summed times over all (interleaved,
                # equally long) blocks is the fair figure for the realized fraction
                row["over_base"] = (sum(b["total"] for b in bl)
                                    / sum(b["total"] for b in blocks[base][:len(bl)]))
                row["ratio_kind"] = "sum over repeats"
            else:
                row["over_base"] = median(rs)
                row["ratio_kind"] = "median of paired repeats"
        out["methods"][m] = row
    if "vasso" in blocks and "sam" in blocks:
        rs = paired_ratios(blocks, "vasso", "sam")
        out["vasso_over_sam"] = median(rs)
        out["vasso_over_sam_all"] = rs
        out["vasso_over_sam_iqr"] = quartiles(rs)
        # The same ratio from the parts: both run the same model on the same batch, so their forward/
        # backward and base step cost the same and only the SA work differs; the SA work is small and
        # timed directly, hence far less noisy on a shared machine than the whole update.
        sam, vasso = out["methods"]["sam"], out["methods"]["vasso"]
        common = median([b["update_median"] if "update_median" in b else b["total"] for b in blocks["sam"]])
        extra = (vasso["sa_work"] - sam["sa_work"]) / 1e3
        out["vasso_over_sam_from_parts"] = (common + extra) / common if common > 0 else float("nan")
    for m, row in out["methods"].items():
        if "over_base_all" in row:
            row["over_base_iqr"] = quartiles(row["over_base_all"])
    return out


def quartiles(xs: Sequence[float]) -> List[float]:
    """[first quartile, third quartile] (the spread of per-repeat ratios)."""
    xs = sorted(x for x in xs if math.isfinite(x))
    if len(xs) < 2:
        return [xs[0], xs[0]] if xs else [float("nan"), float("nan")]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


# --------------------------------------------------------------------------- memory (one process per method)


def _maxrss_bytes() -> int:
    """Peak RSS of this process image: Linux's VmHWM (per address space, so it starts
    afresh at exec) where there is /proc, else ru_maxrss.  (ru_maxrss alone would not
    do for a child process: Linux carries it over fork and exec from the parent, so a
    child of a large benchmark process starts at the parent's peak.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class HeapSampler:
    """Bytes in use in glibc's malloc (``mallinfo2``: arena + mmapped chunks), which is
    where torch's CPU tensors live (no caching allocator on CPU).  A thread samples it
    every ``interval`` seconds and keeps the maximum: the peak of live tensor memory
    (plus Python's own small allocations), unlike RSS, which keeps pages that malloc
    freed but did not return.  ``available`` is False off glibc >= 2.33."""

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    def __init__(self, interval: float = 2e-4):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:
            fn = ctypes.CDLL(None).mallinfo2
            fn.restype = self._Info
            self._fn = fn
            self.available = True
        except (AttributeError, OSError):
            self._fn = None
            self.available = False

    def current(self) -> int:
        if not self._fn:
            return 0
        info = self._fn()
        return int(info.uordblks + info.hblkhd)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = self.current()
        if self.available:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.current())


def memory_child(model_name: str, method: str, steps: int, tiny: bool) -> Dict[str, Any]:
    """Runs in a fresh process: the growth, over `steps` updates from just after the model
    and batch were built, of (a) the peak heap in use (glibc mallinfo2, sampled), (b) the
    heap in use after the last update (gradients + optimizer state + SA buffers), (c) the
    peak RSS (VmHWM); and the state bytes."""
    cfg = (TINY_MODELS if tiny else MODELS)[model_name]
    runner = Runner(method, cfg)
    sampler = HeapSampler()
    before_rss, before_heap = _maxrss_bytes(), sampler.current()
    with sampler:
        for _ in range(steps):
            runner.update()
    after_rss, after_heap = _maxrss_bytes(), sampler.current()
    res = state_bytes(runner.opt, runner.model)
    res.update(model=model_name, method=method, maxrss_before=before_rss, maxrss_after=after_rss,
               peak_growth=max(after_rss - before_rss, 0), heap_available=sampler.available,
               heap_peak_growth=sampler.peak - before_heap if sampler.available else None,
               heap_kept_growth=after_heap - before_heap if sampler.available else None)
    return res


def run_memory(models: Sequence[str], methods: Sequence[str], reps: int, steps: int, threads: int, tiny: bool,
               log: Callable[[str], None] = lambda s: None) -> Dict[str, Dict[str, Any]]:
    """peak growth medians per (model, method), each measurement a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    samples: Dict[str, Dict[str, List[Dict[str, Any]]]] = {md: {m: [] for m in methods} for md in models}
    for rep in range(reps):
        for md in models:
            order = list(methods)
            k = rep % len(order)
            for m in order[k:] + order[:k]:
                cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", md, m, "--mem-steps", str(steps),
                       "--threads", str(threads)] + (["--tiny"] if tiny else [])
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
                if proc.returncode != 0:
                    raise RuntimeError(f"memory child {md}/{m} failed:\n{proc.stderr[-2000:]}")
                samples[md][m].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        log(f"  memory repeat {rep + 1}/{reps} done")
    out: Dict[str, Dict[str, Any]] = {}
    for md, per in samples.items():
        out[md] = {}
        for m, ss in per.items():
            row = {k: ss[0][k] for k in ("param_bytes", "base_state_bytes", "extra_state_bytes")}
            for key in ("peak_growth", "heap_peak_growth", "heap_kept_growth"):
                vals = [s.get(key) for s in ss if s.get(key) is not None]
                row[key] = median(vals) if vals else None
            out[md][m] = row
    return out


def state_table(models: Dict[str, Dict[str, Any]], methods: Sequence[str], steps: int = 3) -> Dict[str, Dict[str, Any]]:
    """State bytes after a few updates, in this process (deterministic)."""
    out: Dict[str, Dict[str, Any]] = {}
    for md, cfg in models.items():
        out[md] = {}
        for m in methods:
            r = Runner(m, cfg)
            for _ in range(steps):
                r.update()
            out[md][m] = state_bytes(r.opt, r.model)
    return out


# --------------------------------------------------------------------------- fairseq-train


def _toy_pairs(n: int, seed: int):
    """The demo's generated corpus when scripts/toy_corpus.py is there, else a tiny grammar of our own."""
    try:
        sys.path.insert(0, os.path.join(REPO, "scripts"))
        import toy_corpus  # type: ignore

        return toy_corpus.generate(n, seed)
    except Exception:  # pragma: no cover - fallback only when the demo's generator is absent
        import random

        rng = random.Random(seed)
        de_en = {"der": "the", "hund": "dog", "die": "the", "katze": "cat", "sieht": "sees", "mag": "likes",
                 "ein": "a", "haus": "house", "kind": "child", "buch": "book", "liest": "reads", "alte": "old"}
        words = list(de_en)
        pairs = []
        for _ in range(n):
            de = [rng.choice(words) for _ in range(rng.randint(4, 12))]
            pairs.append((" ".join(de), " ".join(de_en[w] for w in de)))
        return pairs


def prepare_fairseq_data(workdir: str, n_train: int = 2000, log: Callable[[str], None] = lambda s: None) -> str:
    """Generate and binarize the toy de-en corpus once (cached under workdir)."""
    dest = os.path.join(workdir, f"toy-bin-{n_train}")
    if os.path.exists(os.path.join(dest, "train.de-en.de.bin")):
        return dest
    raw = os.path.join(workdir, f"toy-raw-{n_train}")
    os.makedirs(raw, exist_ok=True)
    for split, n, seed in (("train", n_train, 1), ("valid", 100, 2)):
        pairs = _toy_pairs(n, seed)
        with open(os.path.join(raw, f"{split}.de"), "w", encoding="utf-8") as fde, \
                open(os.path.join(raw, f"{split}.en"), "w", encoding="utf-8") as fen:
            for de, en in pairs:
                fde.write(de.strip() + "\n")
                fen.write(en.strip() + "\n")
    log(f"  binarizing the toy corpus into {dest}")
    cmd = [_fairseq_bin("fairseq-preprocess"), "--source-lang", "de", "--target-lang", "en",
           "--trainpref", os.path.join(raw, "train"), "--validpref", os.path.join(raw, "valid"),
           "--destdir", dest, "--workers", "1", "--joined-dictionary"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed:\n{proc.stderr[-2000:]}")
    return dest


def _fairseq_bin(name: str) -> str:
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else name


FAIRSEQ_MODEL = ["--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
                 "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
                 "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
                 "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
                 "--share-all-embeddings", "--dropout", "0.1"]


def fairseq_command(data: str, optimizer: str, max_update: int, save_dir: str, log_interval: int) -> List[str]:
    cmd = [_fairseq_bin("fairseq-train"), data, "--user-dir", os.path.join(REPO, "fairseq_vasso"),
           "--task", "translation", "--source-lang", "de", "--target-lang", "en", *FAIRSEQ_MODEL,
           "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
           "--optimizer", optimizer, "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.0001",
           "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
           "--max-tokens", "2048", "--max-update", str(max_update), "--seed", "1",
           "--cpu", "--num-workers", "0", "--save-dir", save_dir, "--no-save", "--disable-validation",
           "--log-format", "json", "--log-interval", str(log_interval)]
    if optimizer == "sam":
        cmd += ["--rho", str(RHO)]
    elif optimizer == "vasso":
        cmd += ["--rho", str(RHO), "--theta", str(THETA)]
    return cmd


def fairseq_ups(log_text: str) -> List[float]:
    """fairseq's ``ups`` of every ``train_inner`` line but the first (warm-up), json or simple format."""
    import importlib.util

    mod = sys.modules.get("_vasso_plot_diagnostics")
    if mod is None:
        spec = importlib.util.spec_from_file_location("_vasso_plot_diagnostics",
                                                      os.path.join(REPO, "scripts", "plot_diagnostics.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    records = [r for r in mod.parse_fairseq_log_text(log_text) if r.get("_tag") == "train_inner"]
    return [float(r["ups"]) for r in records[1:] if "ups" in r]


def fairseq_child(step_log: str, argv: Sequence[str]) -> int:
    """Run fairseq-train in this process with ``Trainer.train_step`` timed (CPU and wall
    seconds per update, one line per update in ``step_log``).  fairseq_vasso is imported
    first so that the timer wraps its two-pass step from the outside."""
    import fairseq_vasso  # noqa: F401  (registers sam/vasso, patches Trainer.train_step)
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.trainer import Trainer
    from fairseq_cli import train as train_cli

    inner = Trainer.train_step
    task_inner = FairseqTask.train_step
    out = open(step_log, "w", encoding="utf-8")
    passes = {"n": 0, "cpu": 0.0}

    def timed_task_step(self, *a, **k):  # one forward/backward of one micro-batch
        c0 = time.process_time()
        try:
            return task_inner(self, *a, **k)
        finally:
            passes["n"] += 1
            passes["cpu"] += time.process_time() - c0

    def timed_train_step(self, *a, **k):
        passes["n"], passes["cpu"] = 0, 0.0
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return inner(self, *a, **k)
        finally:
            # columns: CPU s of the update, wall s, forward/backward passes, their CPU s
            out.write(f"{time.process_time() - c0:.6f} {time.perf_counter() - w0:.6f} {passes['n']} "
                      f"{passes['cpu']:.6f}\n")
            out.flush()

    FairseqTask.train_step = timed_task_step
    Trainer.train_step = timed_train_step
    sys.argv = ["fairseq-train", *argv]
    try:
        train_cli.cli_main()
    finally:
        out.close()
    return 0


def run_fairseq(workdir: str, optimizers: Sequence[str], reps: int, max_update: int, threads: int,
                log: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    data = prepare_fairseq_data(workdir, log=log)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    log_interval = max(max_update // 8, 2)
    skip = min(3, max_update // 4)  # warm-up updates left out of the per-update medians
    runs: Dict[str, List[float]] = {o: [] for o in optimizers}  # fairseq's ups (wall clock)
    cpu: Dict[str, List[float]] = {o: [] for o in optimizers}  # CPU seconds per train_step
    paired: Dict[str, List[float]] = {o: [] for o in optimizers}  # per repeat: median over steps of o/adam
    step_parts: Dict[str, List[List[tuple]]] = {}  # per run: (update CPU s, passes, fwd/bwd CPU s) per update
    for rep in range(reps):
        k = rep % len(optimizers)
        step_times: Dict[str, List[float]] = {}
        for o in list(optimizers)[k:] + list(optimizers)[:k]:
            cmd = fairseq_command(data, o, max_update, os.path.join(workdir, f"ckpt-{o}"), log_interval)
            step_log = os.path.join(workdir, f"steps-{o}.txt")
            child = [sys.executable, os.path.abspath(__file__), "--fairseq-child", step_log, "--", *cmd[1:]]
            proc = subprocess.run(child, capture_output=True, text=True, env=env, timeout=900)
            text = proc.stdout + "\n" + proc.stderr
            ups = fairseq_ups(text)
            try:
                with open(step_log, encoding="utf-8") as f:
                    rows = [line.split() for line in f if line.strip()]
            except FileNotFoundError:
                rows = []
            steps = [float(r[0]) for r in rows]
            if all(len(r) >= 4 for r in rows):
                step_parts.setdefault(o, []).append([(float(r[0]), int(r[2]), float(r[3])) for r in rows])
            if not ups or len(steps) <= skip:
                raise RuntimeError(f"fairseq-train --optimizer {o} did not train "
                                   f"(rc {proc.returncode}):\n{text[-3000:]}")
            runs[o].append(median(ups))
            cpu[o].append(median(steps[skip:]))
            step_times[o] = steps
        if "adam" in step_times:
            # same --seed, same data order: update i sees the same batch in every run, so the
            # per-update ratios pair like with like (batch sizes vary a lot under --max-tokens)
            for o in optimizers:
                paired[o].append(median([a / b for a, b in zip(step_times[o][skip:], step_times["adam"][skip:])
                                         if b > 0]))
        log(f"  fairseq repeat {rep + 1}/{reps}: " + ", ".join(
            f"{o} {1e3 * cpu[o][-1]:.0f} ms CPU/update, {runs[o][-1]:.2f} ups" for o in optimizers))
    out: Dict[str, Any] = {"ups": {o: median(v) for o, v in runs.items()}, "ups_all": runs,
                           "cpu_ms": {o: 1e3 * median(v) for o, v in cpu.items()},
                           "cpu_ms_all": {o: [1e3 * x for x in v] for o, v in cpu.items()},
                           "command": shlex.join(fairseq_command("DATA", "vasso", max_update, "SAVE", log_interval))}
    for o in optimizers:
        if o != "adam":
            out[f"{o}_time_over_adam"] = median(paired[o])
            out[f"{o}_time_over_adam_all"] = paired[o]
            out[f"{o}_ups_time_over_adam"] = median([a / b for a, b in zip(runs["adam"], runs[o]) if b > 0])
    if "sam" in runs and "vasso" in runs:
        out["vasso_time_over_sam"] = median([v / s for s, v in zip(paired["sam"], paired["vasso"]) if s > 0])
    out.update(fairseq_from_parts(step_parts, skip))
    return out


def fairseq_from_parts(step_parts: Dict[str, List[List[tuple]]], skip: int) -> Dict[str, Any]:
    """The fairseq ratios from the timed parts, as for the micro-benchmark: forward/backward of
    update i costs the same in every run (same batch), so take it once for all runs (the median
    CPU time per pass of update i over every run and pass) and add each run's own remainder
    (update - its forward/backward: fairseq's bookkeeping, the optimizer step, and for sam/vasso
    the perturbation, restore, RNG replay and diagnostics).  The processes' CPU speeds, which a
    loaded machine changes from run to run, then no longer enter the ratio."""
    if "adam" not in step_parts:
        return {}
    n = min(len(run) for runs in step_parts.values() for run in runs)
    per_pass = []
    for i in range(n):
        costs = [run[i][2] / run[i][1] for runs in step_parts.values() for run in runs if run[i][1] > 0]
        per_pass.append(median(costs))
    rest = {o: [median([run[i][0] - run[i][2] for run in runs]) for i in range(n)] for o, runs in step_parts.items()}
    npass = {o: [median([run[i][1] for run in runs]) for i in range(n)] for o, runs in step_parts.items()}

    def cost(o, i):
        return npass[o][i] * per_pass[i] + rest[o][i]

    out: Dict[str, Any] = {"fwdbwd_ms_per_pass": 1e3 * median(per_pass[skip:]),
                           "rest_ms": {o: 1e3 * median(r[skip:]) for o, r in rest.items()}}
    for o in step_parts:
        if o != "adam":
            out[f"{o}_over_adam_from_parts"] = median([cost(o, i) / cost("adam", i) for i in range(skip, n)])
    if "sam" in step_parts and "vasso" in step_parts:
        out["vasso_over_sam_from_parts"] = median([cost("vasso", i) / cost("sam", i) for i in range(skip, n)])
    return out


# --------------------------------------------------------------------------- report


def machine_info(threads: int) -> Dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        usable = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = (float("nan"),) * 3
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "usable_cpus": usable, "torch": torch.__version__,
            "python": platform.python_version(), "threads": threads, "platform": platform.platform(),
            "loadavg_1_5_15": [round(x, 2) for x in load]}


def _fmt(x, spec=".3f"):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def target_rows(results: Dict[str, Any]) -> List[List[str]]:
    """[target, where, measured, PASS/MISS] rows; the verdict logic lives here (tested)."""
    rows: List[List[str]] = []
    timing = results.get("timing", {})
    def spread(iqr):
        return f" (IQR {_fmt(iqr[0], '.2f')}-{_fmt(iqr[1], '.2f')})" if iqr else ""

    for md in timing:
        t = timing[md]
        v = t.get("vasso_over_sam")
        if v is not None:
            rows.append([TARGETS_TEXT["vasso_over_sam"], md, _fmt(v) + spread(t.get("vasso_over_sam_iqr")),
                         _verdict(v <= 1.03 if math.isfinite(v) else None)])
        d = t.get("vasso_over_sam_from_parts")
        if d is not None:
            rows.append([TARGETS_TEXT["vasso_over_sam"] + " (from the timed parts)", md, _fmt(d),
                         _verdict(d <= 1.03 if math.isfinite(d) else None)])
    tr = timing.get("transformer")
    if tr:
        sam = tr["methods"].get("sam", {}).get("over_base")
        if sam is not None:
            rows.append([TARGETS_TEXT["sam_over_base"], "transformer",
                         _fmt(sam) + spread(tr["methods"]["sam"].get("over_base_iqr")), _verdict(sam <= 2.1)])
        ev = tr["methods"].get("evasso")
        if ev and ev.get("over_base") is not None:
            p_hat = ev.get("two_pass_fraction")
            limit = 1 + (p_hat if p_hat is not None else P_EFFICIENT) + 0.1
            rows.append([TARGETS_TEXT["evasso_over_base"], f"transformer (realized p = {_fmt(p_hat, '.2f')}, "
                         f"limit {limit:.2f})", _fmt(ev["over_base"]), _verdict(ev["over_base"] <= limit)])
        for m in ("sam", "vasso"):
            row = tr["methods"].get(m)
            if row:
                share = row["sa_share"]
                rows.append([TARGETS_TEXT["sa_share"], f"transformer, {METHODS[m][0]}", f"{100 * share:.2f}%",
                             _verdict(share <= 0.05)])
    fs = results.get("fairseq") or {}
    if fs.get("vasso_time_over_sam") is not None:
        v = fs["vasso_time_over_sam"]
        rows.append([TARGETS_TEXT["vasso_over_sam"], "fairseq-train (CPU time per update)", _fmt(v),
                     _verdict(v <= 1.03 if math.isfinite(v) else None)])
    if fs.get("vasso_over_sam_from_parts") is not None:
        v = fs["vasso_over_sam_from_parts"]
        rows.append([TARGETS_TEXT["vasso_over_sam"] + " (from the timed parts)", "fairseq-train", _fmt(v),
                     _verdict(v <= 1.03 if math.isfinite(v) else None)])
    for o, label in (("sam", "SAM / adam"), ("vasso", "VASSO / adam")):
        for key, where in ((f"{o}_time_over_adam", "fairseq-train (CPU time per update)"),
                           (f"{o}_over_adam_from_parts", "fairseq-train (from the timed parts)")):
            v = fs.get(key)
            if v is not None:
                rows.append([TARGETS_TEXT["sam_over_base"].replace("SAM / AdamW", label), where, _fmt(v),
                             _verdict(v <= 2.1 if math.isfinite(v) else None)])
    state = results.get("state", {})
    for md, per in state.items():
        v = per.get("vasso")
        if v:
            ratio = v["extra_state_bytes"] / v["param_bytes"]
            rows.append([TARGETS_TEXT["vasso_state"], md, f"{ratio:.3f} x param bytes",
                         _verdict(v["extra_state_bytes"] == v["param_bytes"])])
    return rows


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def render(results: Dict[str, Any]) -> str:
    m = results["machine"]
    out = [f"## Benchmark ({results['mode']} mode), {results['date']}", "",
           f"Machine: {m['cpu']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs, "
           f"torch {m['torch']}, Python {m['python']}, torch.set_num_threads({m['threads']}) in every process; "
           f"load average at start {m['loadavg_1_5_15']}, at end {results.get('loadavg_end')}.",
           f"Command: `{results['command']}`", "",
           "### Targets", "", _md_table(["target", "where", "measured", "verdict"], target_rows(results)), ""]

    timing = results.get("timing", {})
    if timing:
        clock = {"cpu": "CPU time of the process (time.process_time)",
                 "wall": "wall-clock time (time.perf_counter)"}[results.get("clock", "cpu")]
        out += ["### Time per update (median over interleaved repeats; ratios paired within a repeat)", "",
                f"Clock: {clock}. Each repeat runs one block of updates per method, the order rotating.", ""]
        rows = []
        for md, t in timing.items():
            for meth, row in t["methods"].items():
                rows.append([md, METHODS[meth][0], _fmt(row["total"], ".2f"), _fmt(row.get("over_base"), ".3f"),
                             _fmt(row["fwdbwd"], ".2f"), _fmt(row["base_step"], ".2f"), _fmt(row["perturb"], ".2f"),
                             _fmt(row["restore"], ".2f"), f"{100 * row['sa_share']:.2f}%",
                             f"{100 * row['outside_fwdbwd_share']:.1f}%", _fmt(row["passes_per_update"], ".2f"),
                             str(row["repeats"])])
        out += [_md_table(["model", "method", "ms/update", "over AdamW", "fwd+bwd ms", "base step ms",
                           "perturb ms", "restore ms", "SA work %", "outside fwd/bwd %", "passes/update",
                           "repeats"], rows), ""]
        for md, t in timing.items():
            if "vasso_over_sam" in t:
                out.append(f"- {md}: VASSO / SAM = {_fmt(t['vasso_over_sam'])} "
                           f"(per repeat: {', '.join(_fmt(x, '.3f') for x in t['vasso_over_sam_all'])}); "
                           f"from the timed parts: {_fmt(t.get('vasso_over_sam_from_parts'))} "
                           f"(SAM's update + VASSO's extra SA work)")
            for meth, row in t["methods"].items():
                if row.get("over_base_all"):
                    out.append(f"- {md}: {METHODS[meth][0]} / AdamW per repeat ({row.get('ratio_kind')} "
                               f"reported): " + ", ".join(_fmt(x, ".2f") for x in row["over_base_all"]))
        out += ["", "SA work = update - fwd+bwd - base step (perturbation, EMA, restore, RNG replay, glue); "
                    "outside fwd/bwd also counts the base step. Model sizes: "
                + "; ".join(f"{md}: {results['model_info'][md]}" for md in timing), ""]

    state = results.get("state", {})
    mem = results.get("memory", {})
    if state:
        out += ["### Optimizer state and peak memory", "",
                "State in units of the parameters' bytes (base: AdamW's exp_avg, exp_avg_sq, step; extra: "
                "`state_nbytes()`). Memory: one fresh process per method, median of the repeats, growth over "
                "the updates from just after the model and batch were built. *Peak heap*: the most bytes in use "
                "in glibc malloc (mallinfo2, where torch keeps CPU tensors), sampled every 0.2 ms by a thread "
                "(a sampled peak: it can miss a short spike). *Extra peak* = peak heap growth - AdamW's, in "
                "parameter bytes. *Peak RSS* (VmHWM) is given too but is coarse: it keeps pages malloc "
                "freed earlier (model building), so its growth understates. Small tensors cost more than their "
                "data (each also holds a TensorImpl and a storage in the heap), which shows on many-small.", ""]
        rows = []
        for md, per in state.items():
            base_heap = mem.get(md, {}).get("adamw", {}).get("heap_peak_growth")
            for meth, s in per.items():
                pb = s["param_bytes"]
                mrow = mem.get(md, {}).get(meth, {})
                g, h = mrow.get("peak_growth"), mrow.get("heap_peak_growth")
                extra = (h - base_heap) / pb if h is not None and base_heap is not None else None
                label = {**METHODS, **STATE_ONLY}[meth][0]
                rows.append([md, label, f"{pb / 2**20:.2f} MiB", _fmt(s["base_state_bytes"] / pb, ".3f"),
                             _fmt(s["extra_state_bytes"] / pb, ".3f"),
                             "n/a" if h is None else f"{h / 2**20:.1f} MiB", _fmt(extra, "+.2f"),
                             "n/a" if g is None else f"{g / 2**20:.1f} MiB"])
        out += [_md_table(["model", "method", "param bytes", "base state / params", "extra state / params",
                           "peak heap growth", "extra peak / params", "peak RSS growth"], rows), ""]

    fs = results.get("fairseq")
    if fs:
        out += ["### fairseq-train (toy de-en corpus, transformer 2+2 layers, d=128, --max-tokens 2048)", "",
                "CPU ms per update: the process CPU time of each `Trainer.train_step` (timed from outside "
                "fairseq_vasso's two-pass step), median over a run's updates after the first 3, then over runs. "
                "Time ratio: every run has the same seed and so the same batches in the same order; the ratio "
                "is the median over updates of (this run's update i) / (adam's update i), then the median over "
                "the interleaved repeats. updates/sec: fairseq's own `ups` (wall clock, so it carries the "
                "machine's other load), median over a run's log lines after the first.", ""]
        rows = [[o, _fmt(fs["cpu_ms"][o], ".1f"), ", ".join(_fmt(x, ".1f") for x in fs["cpu_ms_all"][o]),
                 _fmt(fs.get(f"{o}_time_over_adam"), ".3f") if o != "adam" else "1",
                 _fmt(u, ".2f"), _fmt(1.0 / fs[f"{o}_ups_time_over_adam"], ".3f") if o != "adam" else "1"]
                for o, u in fs["ups"].items()]
        out += [_md_table(["--optimizer", "CPU ms/update", "per run", "time per update over adam",
                           "updates/sec (fairseq ups)", "ups over adam's"], rows), ""]
        if "vasso_time_over_sam" in fs:
            out.append(f"- VASSO / SAM (CPU time per update, fairseq): {_fmt(fs['vasso_time_over_sam'])}")
        if "fwdbwd_ms_per_pass" in fs:
            out.append(f"- from the timed parts: forward/backward {_fmt(fs['fwdbwd_ms_per_pass'], '.1f')} ms CPU "
                       "per pass (median over runs, same batch); the rest of an update (fairseq's bookkeeping, "
                       "optimizer step, and the perturbation/restore/RNG replay/diagnostics): "
                       + ", ".join(f"{o} {_fmt(v, '.1f')} ms" for o, v in fs["rest_ms"].items())
                       + "; ratios: " + ", ".join(f"{o} / adam {_fmt(fs[f'{o}_over_adam_from_parts'])}"
                                                   for o in fs["rest_ms"] if o != "adam")
                       + (f", vasso / sam {_fmt(fs['vasso_over_sam_from_parts'])}"
                          if "vasso_over_sam_from_parts" in fs else ""))
        for o in fs["ups"]:
            if f"{o}_time_over_adam_all" in fs:
                out.append(f"- {o} / adam per repeat: "
                           + ", ".join(_fmt(x, ".3f") for x in fs[f"{o}_time_over_adam_all"]))
        out += [f"- command (one run): `{fs['command']}`", ""]
    elif results.get("fairseq_skipped"):
        out += [f"fairseq-train: skipped ({results['fairseq_skipped']}).", ""]
    return "\n".join(out)


def model_info(cfgs: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    info = {}
    for md, cfg in cfgs.items():
        model, _ = build(cfg)
        ps = list(model.parameters())
        info[md] = f"{sum(q.numel() for q in ps) / 1e6:.2f} M parameters in {len(ps)} tensors"
    return info


def run_all(mode: str = "quick", *, models: Optional[Dict[str, Dict[str, Any]]] = None,
            methods: Sequence[str] = tuple(METHODS), threads: int = 1, fairseq: bool = True,
            memory: bool = True, tiny: bool = False, workdir: Optional[str] = None, clock: str = "cpu",
            overrides: Optional[Dict[str, Any]] = None, log: Callable[[str], None] = print,
            command: str = "", fairseq_only: bool = False) -> Dict[str, Any]:
    """Every measurement of the chosen mode; returns the results dict that render() prints."""
    torch.set_num_threads(threads)
    cfg = dict(MODES[mode])
    cfg.update(overrides or {})
    models = models or (TINY_MODELS if tiny else MODELS)
    results: Dict[str, Any] = {"mode": mode, "date": datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), "machine": machine_info(threads), "command": command, "settings": cfg,
        "model_info": model_info(models), "timing": {}, "clock": clock}
    for md, mcfg in ({} if fairseq_only else models).items():
        scale = MODEL_BLOCK_SCALE.get(md, 1)
        log(f"timing {md} ({results['model_info'][md]}): {cfg['reps']} repeats x {cfg['block'] * scale} updates")
        blocks = interleaved_timing(mcfg, methods, cfg["reps"], cfg["block"] * scale, cfg["warmup"], log=log,
                                    clock=clock)
        results["timing"][md] = summarize_timing(blocks)
        results["timing"][md]["blocks"] = blocks
    state_methods = [m for m in methods] + [m for m in STATE_ONLY]
    results["state"] = {} if fairseq_only else state_table(models, state_methods)
    if memory and not fairseq_only:
        log(f"peak memory: {cfg['mem_reps']} repeat(s), one process per method and model")
        mem_models = [md for md in models if cfg["mem_models"] is None or md in cfg["mem_models"]]
        results["memory"] = run_memory(mem_models, list(methods), cfg["mem_reps"], cfg["mem_steps"], threads, tiny,
                                       log=log)
    if fairseq:
        try:
            import fairseq as _  # noqa: F401
        except Exception as e:  # pragma: no cover
            results["fairseq_skipped"] = f"fairseq not importable: {e}"
        else:
            workdir = workdir or os.path.join(tempfile.gettempdir(), "vasso_benchmark")
            os.makedirs(workdir, exist_ok=True)
            log(f"fairseq-train: {cfg['fs_reps']} repeat(s) x {list(cfg['fs_optimizers'])}, "
                f"{cfg['fs_updates']} updates each (data and checkpoints under {workdir})")
            results["fairseq"] = run_fairseq(workdir, cfg["fs_optimizers"], cfg["fs_reps"], cfg["fs_updates"],
                                             threads, log=log)
    else:
        results["fairseq_skipped"] = "--no-fairseq"
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (under ~2 minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: process CPU time (default; robust on a shared machine), wall: perf_counter")
    ap.add_argument("--no-fairseq", action="store_true", help="skip the fairseq-train comparison")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-process peak-memory runs")
    ap.add_argument("--fairseq-only", action="store_true", help="only the fairseq-train comparison")
    ap.add_argument("--fairseq-reps", type=int, help="override the number of fairseq repeats")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    ap.add_argument("--reps", type=int, help="override the number of interleaved repeats")
    ap.add_argument("--tiny", action="store_true", help="tiny models (a smoke test of the script, not a benchmark)")
    ap.add_argument("--workdir", help="where the fairseq toy corpus and runs go (default: $TMPDIR/vasso_benchmark)")
    ap.add_argument("--markdown", help="also write the report to this file")
    ap.add_argument("--json", help="also write the raw results (every block) to this file")
    ap.add_argument("--render", metavar="JSON", help="print the report of a saved --json file again (no run)")
    ap.add_argument("--memory-child", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    ap.add_argument("--fairseq-child", metavar="STEP_LOG", help=argparse.SUPPRESS)
    ap.add_argument("fairseq_args", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--mem-steps", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.fairseq_child:
        return fairseq_child(args.fairseq_child, args.fairseq_args)
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            results = json.load(f)
        for md, t in results.get("timing", {}).items():  # recompute: the summary logic may be newer
            blocks = t.get("blocks")
            if blocks:
                results["timing"][md] = dict(summarize_timing(blocks), blocks=blocks)
        text = render(results) + f"\nWall time of the benchmark: {results.get('seconds')} s.\n"
        print(text)
        if args.markdown:
            with open(args.markdown, "w", encoding="utf-8") as f:
                f.write(text)
        return 0
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child[0], args.memory_child[1], args.mem_steps, args.tiny)))
        return 0

    pool = TINY_MODELS if args.tiny else MODELS
    overrides = {}
    if args.reps:
        overrides["reps"] = args.reps
    if args.fairseq_reps:
        overrides["fs_reps"] = args.fairseq_reps
    t0 = time.time()
    results = run_all("quick" if args.quick else "full", models={k: pool[k] for k in args.models},
                      threads=args.threads, fairseq=not args.no_fairseq, memory=not args.no_memory, tiny=args.tiny,
                      workdir=args.workdir, overrides=overrides, clock=args.clock,
                      fairseq_only=args.fairseq_only,
                      log=lambda s: print(s, file=sys.stderr, flush=True),
                      command="python scripts/benchmark.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    results["seconds"] = round(time.time() - t0, 1)
    text = render(results) + f"\nWall time of the benchmark: {results['seconds']} s.\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
