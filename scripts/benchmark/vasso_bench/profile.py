"""Where one VASSO step's time goes: a ``torch.profiler`` trace of one step (after a
warm-up), read by phase (:mod:`vasso_bench.phases`: the ranges are this tool's, the
core has none).

    python -m vasso_bench.profile [--device cuda] [--model transformer] [--trace out.json]
    python scripts/benchmark/benchmark.py --profile --device cuda        # the same

Per phase: the host time (median of ``--steps`` unprofiled steps), the ops the profiler saw
(top-level, and all), the kernel launches and kernels with their GPU time, the host syncs
(GPU: ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize`` calls
and blocking device-to-host copies; CPU: the counters the tests use,
:mod:`plugins.lab.selftest.syncs`), the ``item()`` calls (``aten::_local_scalar_dense``),
and the GPU's idle time (the gaps between its kernels and copies, each charged to the phase
that launched the work after it).  The optimizer's own Python is the host time of its own
phases less the time inside the ops it dispatched.  On a CPU the GPU columns read n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from plugins.lab.tables import markdown_table, refuse_existing
from vasso_bench import device as bench_device
from vasso_bench.phases import OWN, PHASES, RANGES, StepPhases, median_per_phase, per_phase, run_marked

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: a GPU gap shorter than this is a launch's ordinary latency, not counted as a gap
GAP_US = 5.0


def _steps(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name") == RANGES["step"]),
                   key=lambda e: e["ts"])
    if not steps:
        raise RuntimeError("the trace has no bench::step range")
    return steps


def _phase_marks(events: List[Dict[str, Any]], step: Optional[Dict[str, Any]] = None) -> List[tuple]:
    """One step's boundary marks (as :class:`StepPhases` records them) from the trace's
    user annotations, in trace time (us); the last step's by default."""
    ann = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") in RANGES.values()]
    step = step or _steps(events)[-1]
    ann = [e for e in ann if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    marks = [("step>", step["ts"]), ("<step", step["ts"] + step["dur"])]
    passes = sorted((e for e in ann if e["name"] == RANGES["pass"]), key=lambda e: e["ts"])
    for i, e in enumerate(passes[:2], 1):
        marks += [(f"pass{i}>", e["ts"]), (f"<pass{i}", e["ts"] + e["dur"])]
    for e in ann:
        if e["name"] == RANGES["base"]:
            marks += [("base>", e["ts"]), ("<base", e["ts"] + e["dur"])]
    marks.sort(key=lambda m: (m[1], m[0] != "step>", m[0] == "<step"))
    return marks


def _phase_of(t: float, marks: List[tuple]) -> Optional[str]:
    from vasso_bench.phases import AFTER

    for (name, a), (_, b) in zip(marks, marks[1:]):
        if a <= t < b and name in AFTER:
            return AFTER[name]
    return None


def _top_level(ops: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ops not nested in another op of the same thread."""
    out = []
    by_tid: Dict[Any, List[Dict[str, Any]]] = {}
    for e in ops:
        by_tid.setdefault(e.get("tid"), []).append(e)
    for evs in by_tid.values():
        end = -1.0
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


#: the per-phase figures that are times (medians over the profiled steps); the rest are counts
TIMES = ("top_op_us_main", "gpu_us", "idle_us", "host_us_profiled", "python_us")


def analyze(trace: Dict[str, Any]) -> Dict[str, Any]:
    """Per phase, from a chrome trace of marked steps (``prof.export_chrome_trace``): the
    counts of the last step with the most ops (once, on a loaded CPU, the last step of a
    trace came back without the events after its perturbation), the times' medians over
    every step but the first (which carries the profiler's start-up)."""
    from plugins.lab.bench.timing import median

    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    for e in events:
        e["ts"], e["dur"] = float(e["ts"]), float(e.get("dur", 0.0))
    steps = _steps(events)
    each = [_analyze_step(events, step) for step in (steps[1:] or steps)]
    most = max(sum(r["ops"] for r in e["phases"].values()) for e in each)
    out = [e for e in each if sum(r["ops"] for r in e["phases"].values()) == most][-1]
    for p, row in out["phases"].items():
        for key in TIMES:
            if row[key] is not None:
                row[key] = median([e["phases"][p][key] for e in each])
    out["profiled_steps"] = len(each)
    return out


def _analyze_step(events: List[Dict[str, Any]], step: Dict[str, Any]) -> Dict[str, Any]:
    marks = _phase_marks(events, step)
    events = [e for e in events if marks[0][1] <= e["ts"] < marks[-1][1] or e.get("cat") in GPU_CATEGORIES]
    main_tid = step.get("tid")
    rows = {p: {"ops": 0, "top_ops": 0, "top_op_us_main": 0.0, "item_calls": 0, "launches": 0, "kernels": 0,
                "gpu_us": 0.0, "syncs": 0, "dtoh": 0, "idle_us": 0.0, "gaps": 0} for p in PHASES}
    ops = [e for e in events if e.get("cat") == "cpu_op" and _phase_of(e["ts"], marks)]
    for e in ops:
        rows[_phase_of(e["ts"], marks)]["ops"] += 1
        if e["name"] == "aten::_local_scalar_dense":
            rows[_phase_of(e["ts"], marks)]["item_calls"] += 1
    for e in _top_level(ops):
        row = rows[_phase_of(e["ts"], marks)]
        row["top_ops"] += 1
        if e.get("tid") == main_tid:
            row["top_op_us_main"] += e["dur"]
    runtime = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            phase = _phase_of(e["ts"], marks)
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                runtime[corr] = (phase, e["name"])
            if phase is None:
                continue
            if "Launch" in e["name"]:
                rows[phase]["launches"] += 1
            if e["name"] in SYNC_CALLS or e["name"] in ("cudaMemcpy", "cuMemcpyDtoH_v2"):
                rows[phase]["syncs"] += 1
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES
                  and (e.get("args") or {}).get("correlation") in runtime
                  and runtime[e["args"]["correlation"]][0] is not None), key=lambda e: e["ts"])
    gaps = []
    prev_end = None
    for e in gpu:
        phase = runtime[e["args"]["correlation"]][0]
        row = rows[phase]
        row["kernels"] += e.get("cat") == "kernel"
        row["gpu_us"] += e["dur"]
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", ""):
            row["dtoh"] += 1
        if prev_end is not None and e["ts"] - prev_end > GAP_US:
            gap = e["ts"] - prev_end
            row["idle_us"] += gap
            row["gaps"] += 1
            gaps.append({"us": gap, "phase": phase, "before": e.get("name", "")[:80]})
        prev_end = e["ts"] + e["dur"] if prev_end is None else max(prev_end, e["ts"] + e["dur"])
    step_us = marks[-1][1] - marks[0][1]
    host_us = {p: 0.0 for p in PHASES}
    for phase, a, b in _segments(marks):
        host_us[phase] += b - a
    for p in PHASES:
        rows[p]["host_us_profiled"] = host_us[p]
        rows[p]["python_us"] = max(host_us[p] - rows[p]["top_op_us_main"], 0.0) if p in OWN else None
    return {"phases": rows, "step_us_profiled": step_us, "gpu_events": len(gpu),
            "gpu_span_us": (gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]) if gpu else None,
            "gaps_top": sorted(gaps, key=lambda g: -g["us"])[:8], "has_gpu": bool(gpu) or bool(runtime)}


def _segments(marks):
    from vasso_bench.phases import segments

    return segments(marks)


def count_syncs(phases: StepPhases) -> Dict[str, int]:
    """Host syncs per phase of one step, as the tests count them (CountSyncs: every
    ``aten._local_scalar_dense`` plus ``Tensor.tolist``)."""
    from plugins.lab.selftest.syncs import CountSyncs

    with CountSyncs() as mode:
        phases.on_mark = lambda: mode.count
        phases.step()
    return {p: int(v) for p, v in per_phase(phases.marks).items()}


def run(device: str = "cpu", size: Optional[str] = None, model: str = "transformer", warmup: int = 3,
        steps: int = 10, method: str = "VASSO", trace_path: Optional[str] = None, profiled: int = 4,
        log: Callable[[str], None] = lambda s: None, adamw: str = "default") -> Dict[str, Any]:
    dev = torch.device(device)
    size = size or ("full" if dev.type == "cuda" else "small")
    cfg = bench_device.SIZES[size][model]
    template = bench_device.build_template(cfg)
    batch = bench_device.make_batch(cfg, dev)
    row = bench_device.Row(method, template, cfg, batch, dev, adamw=adamw)
    phases = StepPhases(row.opt, row.closure)
    settle = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        phases.step()
    settle()
    log(f"profiling one {method} step on {device}: {model} ({bench_device.describe(cfg, template)})")
    per, total = run_marked(phases, steps, time.perf_counter)
    settle()
    syncs = count_syncs(phases)
    settle()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    phases.on_mark, phases.ranges = (lambda: None), True
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(profiled):  # the first carries the profiler's start-up (analyze leaves it out)
            phases.step()
            settle()
    phases.ranges = False
    tmp = None
    if trace_path is None:
        fd, tmp = tempfile.mkstemp(suffix=".json", prefix="vasso-profile-")
        os.close(fd)
    try:
        prof.export_chrome_trace(trace_path or tmp)
        with open(trace_path or tmp, encoding="utf-8") as f:
            trace = json.load(f)
    finally:
        if tmp:
            os.remove(tmp)
    res = analyze(trace)
    host = median_per_phase(per)
    for p in PHASES:
        res["phases"][p]["host_ms"] = 1e3 * host[p]
        res["phases"][p]["syncs_counted"] = syncs[p]
    res.update(device=str(dev), gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
               model=model, model_info=bench_device.describe(cfg, template), size=size, method=method,
               steps=steps, step_host_ms=1e3 * sorted(total)[len(total) // 2], trace=trace_path,
               torch=torch.__version__, adamw=adamw)
    return res


def render(res: Dict[str, Any], command: str = "") -> str:
    gpu = res["device"].startswith("cuda")

    def na(x, spec):
        return "n/a" if x is None else format(x, spec)

    rows = []
    for p in PHASES:
        r = res["phases"][p]
        rows.append([p, f"{r['host_ms']:.3f}", na(r["python_us"] / 1e3 if r["python_us"] is not None else None,
                                                  ".3f"),
                     r["top_ops"], r["ops"], r["item_calls"], r["syncs_counted"],
                     r["launches"] if gpu else "n/a", r["kernels"] if gpu else "n/a",
                     na(r["gpu_us"] / 1e3, ".3f") if gpu else "n/a", r["syncs"] if gpu else "n/a",
                     r["dtoh"] if gpu else "n/a",
                     f"{r['idle_us'] / 1e3:.3f} ({r['gaps']})" if gpu else "n/a"])
    out = [f"## Where one {res['method']} step's time goes: {res['device']}"
           + (f" ({res['gpu']})" if res.get("gpu") else "") + f", {res['model']} ({res['model_info']})", "",
           f"Command: `{command}`" if command else "",
           f"torch {res['torch']}, AdamW base ({res.get('adamw', 'default')}). Host ms: median of {res['steps']} "
           f"unprofiled steps (the whole step {res['step_host_ms']:.2f} ms on the host). Counts (ops, launches, kernels, syncs): one "
           f"profiled step; profiled times: medians over {res['profiled_steps']} profiled steps. Own Python: host "
           f"time of the optimizer's own phases less the time inside the top-level ops it dispatched (profiled). "
           f"Syncs (tests' count): CountSyncs (aten._local_scalar_dense + Tensor.tolist).", "",
           markdown_table(["phase", "host ms", "own Python ms", "ops (top-level)", "ops (all)", "item() calls",
                           "syncs (tests' count)", "launches", "kernels", "GPU ms", "sync calls (GPU)",
                           "DtoH copies", f"GPU idle ms (gaps > {GAP_US:g} us)"], rows), ""]
    own = sum(res["phases"][p]["host_ms"] for p in OWN)
    out.append(f"- the optimizer's own phases ({', '.join(OWN)}): {own:.3f} ms of host time per step, "
               f"{sum(res['phases'][p]['top_ops'] for p in OWN)} top-level ops")
    if gpu:
        idle = sum(r["idle_us"] for r in res["phases"].values()) / 1e3
        out.append(f"- GPU: {res['gpu_events']} kernels and copies over {na((res['gpu_span_us'] or 0) / 1e3, '.2f')} "
                   f"ms, idle {idle:.3f} ms in gaps > {GAP_US:g} us; the longest gaps (charged to the phase that "
                   "launched the work after them):")
        for g in res["gaps_top"]:
            out.append(f"  - {g['us'] / 1e3:.3f} ms in {g['phase']}, before {g['before']}")
    else:
        out.append("- not measured on a CPU: kernel launches, kernels, GPU time, CUDA sync calls, device-to-host "
                   "copies and GPU idle gaps (they need --device cuda)")
    if res.get("trace"):
        out.append(f"- the trace: {res['trace']} (chrome://tracing, Perfetto)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vasso_bench.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", choices=list(bench_device.SIZES["full"]), default="transformer")
    ap.add_argument("--size", choices=sorted(bench_device.SIZES), help="default: full on cuda, small on cpu")
    ap.add_argument("--method", choices=[r for r, v in bench_device.ROWS.items() if v[1] in ("SAM", "VASSO")],
                    default="VASSO")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the measured ones (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="unprofiled steps timed by phase (default 10)")
    ap.add_argument("--trace", help="also keep the chrome trace in this file (a new file, unless --force)")
    ap.add_argument("--force", action="store_true", help="let --trace overwrite an existing file")
    ap.add_argument("--adamw", choices=sorted(bench_device.ADAMW_IMPLS), default="default",
                    help="torch's AdamW implementation under the method (fused: the base that takes found_inf, "
                         "the step without a host sync; default: torch's choice)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.warmup < 0 or args.steps < 1:
        ap.error(f"--warmup {args.warmup} / --steps {args.steps}: --warmup at least 0, --steps at least 1")
    refuse_existing(ap, {"--trace": args.trace}, args.force)
    res = run(args.device, args.size, args.model, args.warmup, args.steps, args.method, args.trace,
              log=lambda s: print(s, file=sys.stderr, flush=True), adamw=args.adamw)
    print(render(res, "python -m vasso_bench.profile " + " ".join(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
