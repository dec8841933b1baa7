"""The benchmark's report: the machine, the targets' PASS/MISS verdicts and the tables."""

from __future__ import annotations

import math
import os
import platform
from typing import Any, Dict, List, Optional

import torch

from plugins.lab.tables import markdown_table
from plugins.lab.bench.models import METHODS, P_EFFICIENT, STATE_ONLY

TARGETS_TEXT = {
    "vasso_over_sam": "VASSO / SAM <= 1.03",
    "sam_over_base": "SAM / AdamW <= 2.1 (fwd/bwd dominates)",
    "evasso_over_base": "eVASSO / AdamW <= 1 + p + 0.1",
    "sa_share": "SA work outside fwd/bwd <= 5% of an update (transformer)",
    "vasso_state": "VASSO extra state == 1 parameter-sized buffer",
    "sam_over_floor": "SAM / AdamW with the same two passes <= 1.20",
    "vasso_over_floor": "VASSO / AdamW with the same two passes <= 1.25",
}
FLOOR_LIMITS = {"sam": 1.20, "vasso": 1.25}


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


def _spread(iqr) -> str:
    return f" (IQR {_fmt(iqr[0], '.2f')}-{_fmt(iqr[1], '.2f')})" if iqr else ""


def _verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def target_rows(results: Dict[str, Any]) -> List[List[str]]:
    """[target, where, measured, PASS/MISS] rows; the verdict logic lives here (tested)."""
    rows: List[List[str]] = []
    timing = results.get("timing", {})
    spread = _spread
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
    floor = results.get("floor") or {}
    for m in ("sam", "vasso"):
        v = floor.get(f"{m}_over_floor")
        if v is not None:
            rows.append([TARGETS_TEXT[f"{m}_over_floor"], f"{floor.get('model', 'many-small-120')}",
                         _fmt(v) + spread(floor.get(f"{m}_over_floor_iqr")),
                         _verdict(v <= FLOOR_LIMITS[m] if math.isfinite(v) else None)])
    state = results.get("state", {})
    for md, per in state.items():
        v = per.get("vasso")
        if v:
            ratio = v["extra_state_bytes"] / v["param_bytes"]
            rows.append([TARGETS_TEXT["vasso_state"], md, f"{ratio:.3f} x param bytes",
                         _verdict(v["extra_state_bytes"] == v["param_bytes"])])
    return rows


def _header(results: Dict[str, Any]) -> List[str]:
    """The run's machine, command and the targets' verdicts."""
    m = results["machine"]
    return [f"## Benchmark ({results['mode']} mode), {results['date']}", "",
            f"Machine: {m['cpu']}, {m['usable_cpus']} usable of {m['logical_cpus']} logical CPUs, "
            f"torch {m['torch']}, Python {m['python']}, torch.set_num_threads({m['threads']}) in every process; "
            f"load average at start {m['loadavg_1_5_15']}, at end {results.get('loadavg_end')}.",
            f"Command: `{results['command']}`", "",
            "### Targets", "", markdown_table(["target", "where", "measured", "verdict"], target_rows(results)), ""]


def _timing_section(results: Dict[str, Any]) -> List[str]:
    """Time per update of each model and method, and the paired ratios."""
    out: List[str] = []
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
        out += [markdown_table(["model", "method", "ms/update", "over AdamW", "fwd+bwd ms", "base step ms",
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
    return out


def _paired_section(title: str, data: Dict[str, Any], what: str, ratios: List[tuple]) -> List[str]:
    """A section of ratios paired within interleaved repeats: what ran, the medians in ms,
    then one line per ``(label, key)`` ratio with its spread and every repeat's value."""
    out = [f"### {title}", "",
           f"{data.get('model_info', '')}: {what}, {data['repeats']} interleaved repeats of {data['block']} "
           "updates, ratios paired within a repeat, medians: "
           + ", ".join(f"{k} {_fmt(v, '.2f')} ms" for k, v in data["ms"].items()) + ".", ""]
    for label, key in ratios:
        out.append(f"- {label} = {_fmt(data[key])}{_spread(data.get(key + '_iqr'))} "
                   f"(per repeat: {', '.join(_fmt(x, '.3f') for x in data[key + '_all'])})")
    return out + [""]


def _floor_section(results: Dict[str, Any]) -> List[str]:
    """The per-step overhead over AdamW running the same two passes."""
    floor = results.get("floor")
    if not floor:
        return []
    return _paired_section(
        "Per-step overhead over the two-pass floor", floor,
        "SAM and VASSO (defaults, diagnostics on, `opt.diagnostics` read after every step) against AdamW "
        "running the same two forward/backward passes",
        [(f"{METHODS[m][0]} / AdamW with two passes", f"{m}_over_floor") for m in ("sam", "vasso")])


def _scaler_section(results: Dict[str, Any]) -> List[str]:
    """What a GradScaler adds to a two-pass step."""
    scaled = results.get("scaler")
    if not scaled:
        skipped = results.get("scaler_skipped")
        return [f"Loss scaling: skipped ({skipped}).", ""] if skipped else []
    return _paired_section(
        "Loss scaling: a scaled step over an unscaled one", scaled,
        "SAM and VASSO whose closure scales the loss with a CPU `torch.amp.GradScaler` "
        "(`opt.step(closure, scaler=scaler)`, then `scaler.update()`; fp32 model, so only the scaler's work "
        "differs) against the same methods unscaled",
        [(f"{METHODS[m][0]} scaled / unscaled", f"{m}_scaled_over_unscaled") for m in ("sam", "vasso")])


def _state_section(results: Dict[str, Any]) -> List[str]:
    """Optimizer state and peak memory per model and method."""
    out: List[str] = []
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
        out += [markdown_table(["model", "method", "param bytes", "base state / params", "extra state / params",
                           "peak heap growth", "extra peak / params", "peak RSS growth"], rows), ""]
    return out


def _fairseq_section(results: Dict[str, Any]) -> List[str]:
    """fairseq-train's CPU time per update and updates/sec per optimizer."""
    out: List[str] = []
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
        out += [markdown_table(["--optimizer", "CPU ms/update", "per run", "time per update over adam",
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
    return out


def render(results: Dict[str, Any]) -> str:
    """The benchmark's markdown report: one section per part that ran."""
    out = _header(results)
    for section in (_timing_section, _floor_section, _scaler_section, _state_section, _fairseq_section):
        out += section(results)
    return "\n".join(out)
