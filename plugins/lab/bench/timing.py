"""Time per update, in parts: every method runs blocks of a few updates, interleaved (the
order rotating every repeat), and every ratio is taken between blocks of the same repeat,
then the median over repeats: slow drift of a shared machine cancels."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence

import torch

from .models import SCALED_METHODS, build, make_optimizer, make_scaler

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


class Runner:
    """One method on its own copy of the model; times blocks of updates.

    ``clock="cpu"`` (``time.process_time``: CPU seconds of this process, all its
    threads) is immune to the time slices other processes take on a shared machine;
    ``"wall"`` is ``time.perf_counter``.  On a CUDA ``device`` the clock waits for the
    device first (``torch.cuda.synchronize``): use ``"wall"`` there.
    """

    def __init__(self, method: str, model_cfg: Dict[str, Any], seed: int = 0, clock: str = "cpu",
                 device: str = "cpu"):
        self.method = method
        self.clock = CLOCKS[clock]
        if str(device).startswith("cuda"):
            read = self.clock

            def synchronized():
                torch.cuda.synchronize(device)
                return read()

            self.clock = synchronized
        self.model, self.loss_fn = build(model_cfg, seed, device)
        self.opt = make_optimizer(method, self.model)
        self.scaler = make_scaler(method)
        self.is_base = not hasattr(self.opt, "base_optimizer")
        self.base_passes = 2 if method == "adamw-2pass" else 1
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
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self.t["fwdbwd"] += self.clock() - t0
        self.t["passes"] += 1
        return loss

    def update(self):
        if self.is_base:
            for _ in range(self.base_passes):
                self._closure()
            self.opt.step()
            return
        if self.scaler is not None:
            self.opt.step(self._closure, scaler=self.scaler)
            self.scaler.update()
        else:
            self.opt.step(self._closure)
        diagnostics = self.opt.diagnostics  # read after every step, as the fairseq and DomainBed hosts do
        self.t["two_pass"] += int(diagnostics["two_pass"])

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
                       log: Callable[[str], None] = lambda s: None, clock: str = "cpu", device: str = "cpu"
                       ) -> Dict[str, List[Dict[str, float]]]:
    """blocks[method][rep]: every method runs one block per repeat, the order rotating."""
    runners = {m: Runner(m, model_cfg, clock=clock, device=device) for m in methods}
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


def floor_ratios(model_cfg: Dict[str, Any], reps: int, block: int, warmup: int,
                 log: Callable[[str], None] = lambda s: None, clock: str = "cpu") -> Dict[str, Any]:
    """SAM and VASSO (defaults, diagnostics on and read every step) over AdamW running the
    same two forward/backward passes: what the wrapper's own per-step work costs. Medians
    of the ratios paired within each of ``reps`` interleaved repeats of ``block`` updates."""
    blocks = interleaved_timing(model_cfg, ["adamw-2pass", "sam", "vasso"], reps, block, warmup, log=log,
                                clock=clock)
    out: Dict[str, Any] = {"repeats": reps, "block": block,
                           "ms": {m: 1e3 * median([b["update_median"] for b in bl]) for m, bl in blocks.items()}}
    for m in ("sam", "vasso"):
        rs = paired_ratios(blocks, m, "adamw-2pass")
        out[f"{m}_over_floor"] = median(rs)
        out[f"{m}_over_floor_all"] = rs
        out[f"{m}_over_floor_iqr"] = quartiles(rs)
    return out


def scaler_ratios(model_cfg: Dict[str, Any], reps: int, block: int, warmup: int,
                  log: Callable[[str], None] = lambda s: None, clock: str = "cpu") -> Dict[str, Any]:
    """SAM and VASSO with a CPU ``torch.amp.GradScaler`` (the closure scales the loss,
    ``scaler.update()`` after every step) over the same methods unscaled, interleaved in one
    run: what loss scaling adds to a step (the scale, the unscale and overflow check of both
    passes' gradients, the update of the scale).  Medians of ratios paired within each repeat."""
    methods = ["sam", "sam-scaled", "vasso", "vasso-scaled"]
    blocks = interleaved_timing(model_cfg, methods, reps, block, warmup, log=log, clock=clock)
    out: Dict[str, Any] = {"repeats": reps, "block": block,
                           "ms": {m: 1e3 * median([b["update_median"] for b in bl]) for m, bl in blocks.items()}}
    for scaled in SCALED_METHODS:
        plain = scaled[:-len("-scaled")]
        rs = paired_ratios(blocks, scaled, plain)
        out[f"{plain}_scaled_over_unscaled"] = median(rs)
        out[f"{plain}_scaled_over_unscaled_all"] = rs
        out[f"{plain}_scaled_over_unscaled_iqr"] = quartiles(rs)
    return out
