"""Optimizer state bytes, and the peak memory of one fresh process per method and model.

    python -m vasso_bench.memory MODEL METHOD [--steps 3 --threads 1 --tiny]

runs one measurement in this process and prints it as one JSON line (what
:func:`run_memory` starts for each method)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from vasso_bench import child_env
from plugins.lab.bench.models import MODELS, TINY_MODELS, state_bytes
from plugins.lab.bench.timing import Runner, median

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
    env = child_env(dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)))
    samples: Dict[str, Dict[str, List[Dict[str, Any]]]] = {md: {m: [] for m in methods} for md in models}
    for rep in range(reps):
        for md in models:
            order = list(methods)
            k = rep % len(order)
            for m in order[k:] + order[:k]:
                cmd = [sys.executable, "-m", "vasso_bench.memory", md, m, "--steps", str(steps),
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(MODELS), help="the model to build")
    ap.add_argument("method", help="a method of plugins.lab.bench.models (METHODS or STATE_ONLY)")
    ap.add_argument("--steps", type=int, default=3, help="updates to measure (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny models")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(memory_child(args.model, args.method, args.steps, args.tiny)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
