"""Cost of SAM, VASSO and eVASSO over their base optimizer (AdamW), measured side by side.

One command::

    python scripts/benchmark/benchmark.py            # full run (~10 min on 2 CPU cores)
    python scripts/benchmark/benchmark.py --quick    # under ~2 min, fewer repeats
    python scripts/benchmark/benchmark.py --quick --no-fairseq --markdown out.md --json out.json
    python scripts/benchmark/benchmark.py --device cuda --quick --reference-vasso ~/VaSSO --reference-sam ~/sam
    python scripts/benchmark/benchmark.py --profile --device cuda     # where one VASSO step's time goes
    python scripts/benchmark/benchmark.py --host-cost                 # the optimizer's own host time and ops

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
6. **The two-pass floor**: on 30 x [Linear(32, 32), LayerNorm(32)] (120 small
   tensors), SAM and VASSO with their defaults (diagnostics on, read after every
   step) over AdamW running the same two forward/backward passes, the median of
   ratios paired within 30+ interleaved repeats: what the wrapper's own per-step
   work costs where per-tensor Python work would show (``--no-floor`` skips it).
7. **Loss scaling**: on the same 120 small tensors, SAM and VASSO whose closure scales
   the loss with a CPU ``torch.amp.GradScaler`` (``opt.step(closure, scaler=scaler)``,
   then ``scaler.update()``) over the same methods unscaled, interleaved in one run,
   ratios paired within a repeat: what the scaler adds to a two-pass step
   (``--no-scaler`` skips it; torch < 2.3 has no CPU scaler and skips it too).

The parts are :mod:`plugins.lab.bench` (models, timing, memory, report) and
:mod:`vasso_bench.fairseq_runs` (the fairseq-train runs); this module chooses what to run in
each mode (``scripts/benchmark/benchmark.py`` runs it).

8. **On a device** (``--device cuda``; ``--device cpu`` runs the same at small sizes): every
   member of the family, AdamW with one and with two passes, and the anchors where
   ``--reference-vasso DIR`` (a checkout of BingcongLi/VaSSO) and ``--reference-sam DIR``
   (davda54/sam) point at them, on ResNet-50 (batch 64 at 224, channels_last) and an
   IWSLT-sized transformer (6+6 layers, 512 wide, 10k vocabulary, 64x64 tokens), bf16 autocast,
   AdamW base: CUDA-event times over ``--rounds`` (>= 30) interleaved rounds after a warm-up
   (with ``--seconds S``, more while S seconds per model last), medians and IQRs, ratios to
   AdamW with two passes, peak memory of each method alone on the device, and the verdicts
   of the step-cost goal where the 95 % interval of the median ratio allows one
   (:mod:`vasso_bench.device`).  ``--device cuda --quick`` keeps the rows the verdicts
   need; either fits 2 minutes of one H100.  Interrupted (Ctrl-C, SIGTERM), it writes the
   report of the rounds finished and exits 130.  ResNet-50 needs torchvision: where it cannot
   be imported the default models are the transformer alone, and the report says so.
9. **Where the time goes** (``--profile``): a ``torch.profiler`` trace of one VASSO step on
   ``--device``, by phase (:mod:`vasso_bench.profile`).
10. **Host cost** (``--host-cost``): the optimizer's own host time per step on 200 small
   tensors against torch's foreach AdamW step, and the ops and host syncs per step of every
   member on 120 (:mod:`vasso_bench.host`).

Threads: ``torch.set_num_threads(--threads)`` (default 1) in every process and
``OMP_NUM_THREADS`` for the children: on a shared 2-core machine one thread per
process keeps the timings from fighting over cores.  Nothing here asserts a time;
the targets are reported as PASS/MISS.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from vasso_bench import anchors, device
from vasso_bench.memory import run_memory, state_table
from plugins.lab.bench.models import FLOOR_MODEL, METHODS, MODELS, STATE_ONLY, TINY_FLOOR_MODEL, TINY_MODELS, model_info
from vasso_bench.report import machine_info, render
from plugins.lab.bench.timing import CLOCKS, floor_ratios, interleaved_timing, scaler_ratios, summarize_timing
from plugins.lab.tables import refuse_existing

# mode -> timing repeats, updates per block, warm-up updates, memory repeats, memory updates,
#         fairseq repeats, fairseq max-update, fairseq optimizers, two-pass floor repeats and block
MODES = {
    "full": dict(reps=15, block=4, warmup=3, mem_reps=2, mem_steps=6, mem_models=None, fs_reps=3, fs_updates=40,
                 fs_optimizers=("adam", "sam", "vasso"), floor_reps=40, floor_block=4),
    "quick": dict(reps=5, block=2, warmup=2, mem_reps=1, mem_steps=3, mem_models=("transformer",), fs_reps=1,
                  fs_updates=24, fs_optimizers=("adam", "vasso"), floor_reps=30, floor_block=2),
}
DEVICE_MODELS = tuple(device.SIZES["full"])
MODEL_BLOCK_SCALE = {"transformer": 1, "many-small": 3}  # many-small updates are short: longer blocks


def run_all(mode: str = "quick", *, models: Optional[Dict[str, Dict[str, Any]]] = None,
            methods: Sequence[str] = tuple(METHODS), threads: int = 1, fairseq: bool = True,
            memory: bool = True, floor: bool = True, scaler: bool = True, tiny: bool = False, workdir: Optional[str] = None,
            clock: str = "cpu",
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
    if floor and not fairseq_only:
        fcfg = TINY_FLOOR_MODEL if tiny else FLOOR_MODEL
        info = model_info({"many-small-120": fcfg})["many-small-120"]
        log(f"two-pass floor, many-small-120 ({info}): {cfg['floor_reps']} repeats x {cfg['floor_block']} updates")
        results["floor"] = floor_ratios(fcfg, cfg["floor_reps"], cfg["floor_block"], cfg["warmup"], log=log,
                                        clock=clock)
        results["floor"].update(model="many-small-120", model_info=f"many-small-120 ({info})")
    if scaler and not fairseq_only:
        fcfg = TINY_FLOOR_MODEL if tiny else FLOOR_MODEL
        info = model_info({"many-small-120": fcfg})["many-small-120"]
        if hasattr(torch.amp, "GradScaler"):
            log(f"loss scaling, many-small-120 ({info}): {cfg['floor_reps']} repeats x {cfg['floor_block']} updates")
            results["scaler"] = scaler_ratios(fcfg, cfg["floor_reps"], cfg["floor_block"], cfg["warmup"], log=log,
                                              clock=clock)
            results["scaler"].update(model_info=f"many-small-120 ({info})")
        else:
            results["scaler_skipped"] = f"torch {torch.__version__} has no CPU GradScaler (torch >= 2.3)"
    state_methods = [m for m in methods] + [m for m in STATE_ONLY]
    results["state"] = {} if fairseq_only else state_table(models, state_methods)
    if memory and not fairseq_only:
        log(f"peak memory: {cfg['mem_reps']} repeat(s), one process per method and model")
        mem_models = [md for md in models if cfg["mem_models"] is None or md in cfg["mem_models"]]
        results["memory"] = run_memory(mem_models, list(methods), cfg["mem_reps"], cfg["mem_steps"], threads, tiny,
                                       log=log)
    if fairseq:
        from vasso_bench.fairseq_runs import run_fairseq  # the fairseq half, imported only when it runs
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
    """The command line of ``scripts/benchmark/benchmark.py``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (under ~2 minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: process CPU time (default; robust on a shared machine), wall: perf_counter")
    ap.add_argument("--no-fairseq", action="store_true", help="skip the fairseq-train comparison")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-process peak-memory runs")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip SAM and VASSO over AdamW with two passes on 120 small tensors")
    ap.add_argument("--no-scaler", action="store_true",
                    help="skip SAM and VASSO with a GradScaler over the same methods unscaled")
    ap.add_argument("--fairseq-only", action="store_true", help="only the fairseq-train comparison")
    ap.add_argument("--fairseq-reps", type=int, help="override the number of fairseq repeats")
    ap.add_argument("--models", nargs="+", choices=sorted(set(MODELS) | set(DEVICE_MODELS)),
                    help=f"the models (default: {' '.join(MODELS)}; with --device: {' '.join(DEVICE_MODELS)})")
    ap.add_argument("--reps", type=int, help="override the number of interleaved repeats")
    ap.add_argument("--tiny", action="store_true", help="tiny models (a smoke test of the script, not a benchmark)")
    ap.add_argument("--workdir", help="where the fairseq toy corpus and runs go (default: $TMPDIR/vasso_benchmark)")
    ap.add_argument("--markdown", help="also write the report to this file")
    ap.add_argument("--json", help="also write the raw results (every block) to this file")
    ap.add_argument("--render", metavar="JSON", help="print the report of a saved --json file again (no run)")
    ap.add_argument("--force", action="store_true", help="let --markdown and --json overwrite existing files")
    dev = ap.add_argument_group("on a device (part 8), --profile (part 9), --host-cost (part 10)")
    dev.add_argument("--device", choices=("cpu", "cuda"),
                     help="run the device benchmark there (cuda: full sizes, >= 30 rounds; cpu: small sizes)")
    dev.add_argument("--size", choices=sorted(device.SIZES), help="model sizes (default: full on cuda, small on cpu)")
    dev.add_argument("--rounds", type=int, help=f"interleaved rounds (default {device.MIN_ROUNDS}; at least "
                     f"{device.MIN_ROUNDS} on cuda, fewer give no verdict)")
    dev.add_argument("--seconds", type=float, metavar="S",
                     help="time each model's rounds for about S seconds: --rounds at least, more while S lasts "
                     "(more rounds narrow the verdicts' intervals; the count is set by the clock, not the ratios)")
    dev.add_argument("--steps-per-round", type=int, default=1, help="steps of each method per round (default 1)")
    dev.add_argument("--warmup", type=int, default=3, help="warm-up steps per method (default 3)")
    dev.add_argument("--rows", nargs="+", choices=list(device.ROWS), help="the methods (default: all; --quick: "
                     + " ".join(device.QUICK_ROWS) + ")")
    dev.add_argument("--reference-vasso", metavar="DIR", help="a checkout of BingcongLi/VaSSO: its solver/vasso.py "
                     "runs as a row (imported from DIR at run time)")
    dev.add_argument("--reference-sam", metavar="DIR", help="a checkout of davda54/sam: its sam.py runs as a row")
    dev.add_argument("--adamw", choices=list(device.ADAMW_IMPLS), default="default",
                     help="torch's AdamW implementation for every row, bases included (default: torch's choice)")
    dev.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a verdict of the device benchmark "
                     "is MISS (too noisy and no verdict do not fail)")
    dev.add_argument("--profile", action="store_true", help="profile one VASSO step on --device (default cpu) by "
                     "phase instead (vasso_bench.profile)")
    dev.add_argument("--host-cost", action="store_true", help="the optimizer's own host time and ops per step, "
                     "on the CPU, instead (vasso_bench.host)")
    args = ap.parse_args(argv)
    refuse_existing(ap, {"--markdown": args.markdown, "--json": None if args.render else args.json}, args.force)
    if args.device or args.profile or args.host_cost:
        return device_main(ap, args, argv)
    for flag, value in (("--size", args.size), ("--rounds", args.rounds), ("--seconds", args.seconds),
                        ("--rows", args.rows),
                        ("--reference-vasso", args.reference_vasso), ("--reference-sam", args.reference_sam),
                        ("--fail-on-miss", args.fail_on_miss or None),
                        ("--adamw", None if args.adamw == "default" else args.adamw)):
        if value is not None:
            ap.error(f"{flag} is an option of the device benchmark: give --device cpu or --device cuda with it")
    if args.models and set(args.models) - set(MODELS):
        ap.error(f"--models: {' '.join(sorted(set(args.models) - set(MODELS)))} only with --device "
                 f"(without it: {', '.join(MODELS)})")

    if args.render:
        with open(args.render, encoding="utf-8") as f:
            results = json.load(f)
        for md, t in results.get("timing", {}).items():  # recompute: the summary logic may be newer
            blocks = t.get("blocks")
            if blocks:
                results["timing"][md] = dict(summarize_timing(blocks), blocks=blocks)
        if "min_rounds" in results:  # a --device run's results
            for t in results["models"].values():
                t["summary"] = device.summarize(t["rounds"])
            text = device.render(results) + "\n"
        else:
            text = render(results) + f"\nWall time of the benchmark: {results.get('seconds')} s.\n"
        print(text)
        if args.markdown:
            with open(args.markdown, "w", encoding="utf-8") as f:
                f.write(text)
        return 0
    torch.set_num_threads(args.threads)

    pool = TINY_MODELS if args.tiny else MODELS
    overrides = {}
    if args.reps:
        overrides["reps"] = args.reps
    if args.fairseq_reps:
        overrides["fs_reps"] = args.fairseq_reps
    t0 = time.time()
    results = run_all("quick" if args.quick else "full", models={k: pool[k] for k in args.models or MODELS},
                      threads=args.threads, fairseq=not args.no_fairseq, memory=not args.no_memory,
                      floor=not args.no_floor, scaler=not args.no_scaler, tiny=args.tiny,
                      workdir=args.workdir, overrides=overrides, clock=args.clock,
                      fairseq_only=args.fairseq_only,
                      log=lambda s: print(s, file=sys.stderr, flush=True),
                      command="python scripts/benchmark/benchmark.py " + shlex.join(sys.argv[1:] if argv is None else argv))
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


def device_main(ap: argparse.ArgumentParser, args, argv) -> int:
    """Parts 8-10: every input is checked (a clear error naming the flag) before any work."""
    if args.profile and args.host_cost:
        ap.error("--profile and --host-cost: give one of them")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False; "
                 f"torch {torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu")
    if args.host_cost and args.device not in (None, "cpu"):
        ap.error("--host-cost measures on the CPU: leave out --device cuda")
    models = args.models or list(DEVICE_MODELS)
    if set(models) - set(DEVICE_MODELS):
        ap.error(f"--models: {' '.join(sorted(set(models) - set(DEVICE_MODELS)))} is not a model of --device "
                 f"(choose from {', '.join(DEVICE_MODELS)})")
    models_left_out = {}
    if "resnet50" in models and not args.host_cost and not args.profile:
        lacking = torchvision_missing()
        if lacking and args.models:
            ap.error(f"--models resnet50 needs torchvision ({lacking}; pip install torchvision, the build for "
                     f"torch {torch.__version__}); --models transformer runs without it")
        if lacking:  # the default models: those that need no torchvision, saying so
            models = [m for m in models if m != "resnet50"]
            models_left_out["resnet50"] = (f"needs torchvision ({lacking}; pip install torchvision, the build for "
                                           f"torch {torch.__version__})")
            print(f"benchmark.py: resnet50 left out: it {models_left_out['resnet50']}; running "
                  f"{', '.join(models)}", file=sys.stderr, flush=True)
    rounds = device.MIN_ROUNDS if args.rounds is None else args.rounds
    if rounds < 1:
        ap.error(f"--rounds {rounds}: at least 1")
    if args.device == "cuda" and not args.profile and rounds < device.MIN_ROUNDS:
        ap.error(f"--rounds {rounds}: at least {device.MIN_ROUNDS} on --device cuda (a verdict needs "
                 f"{device.MIN_ROUNDS} interleaved rounds)")
    for flag, value in (("--steps-per-round", args.steps_per_round), ("--warmup", args.warmup)):
        if value < (1 if flag == "--steps-per-round" else 0):
            ap.error(f"{flag} {value}: at least {1 if flag == '--steps-per-round' else 0}")
    if args.seconds is not None:
        if args.profile or args.host_cost:
            ap.error("--seconds is for the device benchmark, not for --profile or --host-cost")
        if not 0 < args.seconds < math.inf:
            ap.error(f"--seconds {args.seconds}: a number of seconds above 0")
    classes = {}
    for flag, path in (("--reference-vasso", args.reference_vasso), ("--reference-sam", args.reference_sam)):
        if path is not None:
            if args.host_cost or args.profile:
                ap.error(f"{flag} is for the device benchmark, not for --profile or --host-cost")
            try:
                classes[flag] = anchors.load(flag, os.path.expanduser(path))
            except anchors.AnchorError as e:
                ap.error(str(e))
    rows = args.rows or [r for r in (device.QUICK_ROWS if args.quick else device.ROWS)]
    for r in rows:
        flag = device.ROWS[r][1]
        if args.rows and flag in anchors.ANCHORS and flag not in classes:
            ap.error(f"--rows {r}: needs {flag} DIR")
    torch.set_num_threads(args.threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    command = "python scripts/benchmark/benchmark.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.host_cost:
        from vasso_bench import host

        results = host.run(log=log)
        text = host.render(results, command)
    elif args.profile:
        from vasso_bench import profile

        results = profile.run(args.device or "cpu", size=args.size, model=(args.models or ["transformer"])[0],
                              warmup=args.warmup, log=log, adamw=args.adamw)
        text = profile.render(results, command)
    else:
        # SIGTERM (a scheduler's or `timeout`'s) ends the run as Ctrl-C does: the rounds finished are reported
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            results = device.run(args.device, size=args.size, models=models, rows=rows, rounds=rounds,
                                 steps=args.steps_per_round, warmup=args.warmup, anchor_classes=classes,
                                 seconds=args.seconds, log=log, command=command, adamw=args.adamw, anchor_sources={
                                     flag: anchors.provenance(os.path.expanduser(path)) for flag, path in
                                     (("--reference-vasso", args.reference_vasso),
                                      ("--reference-sam", args.reference_sam)) if path})
        finally:
            signal.signal(signal.SIGTERM, previous)
        results["models_left_out"] = models_left_out
        text = device.render(results)
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    if results.get("interrupted"):
        print(f"benchmark.py: interrupted {results['interrupted']}", file=sys.stderr)
        return 130
    if args.fail_on_miss and not (args.profile or args.host_cost):
        missed = [f"{r[0]}: {r[1]}" for r in device.goal_rows(results) if r[3] == "MISS"]
        if missed:
            print("benchmark.py: MISS: " + "; ".join(missed), file=sys.stderr)
            return 1
    return 0


def torchvision_missing() -> Optional[str]:
    """Why torchvision cannot be imported here (not installed, or a build for another torch),
    or None."""
    if importlib.util.find_spec("torchvision") is None:
        return "not installed"
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # e.g. built for another torch: its operators fail to register
        return f"its import fails: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")

