"""``vasso-selftest`` (``python -m plugins.lab.selftest``): checks this package on the
machine it runs on, on every device found (the CPU always, each CUDA device when
present), and prints a table: check, device, result (pass, FAIL, or skipped with the
reason), time, and the figure measured.

* environment: torch, CUDA, cuDNN and NCCL versions, each GPU's name and compute
  capability, fairseq's version and DomainBed's commit when found, this package's version;
* math: a few steps of every member of the family (SAM, VASSO, eSAM, eVASSO, ASAM, GSAM,
  V+G) on the device, against a float64 reference of the paper's equations on the CPU;
* mixed precision: a stock GradScaler with fp16 autocast, bf16 autocast where supported,
  both APIs; an overflow in either pass is skipped with one back-off, x_t exact;
* host syncs: at most 2 per step (the dispatcher's count; on a GPU, torch's own
  ``torch.cuda.set_sync_debug_mode``);
* ranks: ranks under DDP and under FSDP2 (``fully_shard``) take the one-process step:
  NCCL across two or more GPUs, gloo on the CPU with ``--ranks 2``;
* fairseq (when installed): a short ``fairseq-train --user-dir fairseq_vasso --optimizer
  vasso`` in every precision mode the device has (fp32 everywhere, the CPU's with CUDA
  hidden; --fp16, --amp, --memory-efficient-fp16 on a GPU), side by side; the loss falls,
  the diagnostics are finite, the base optimizer sees the gradient unscaled once;
* DomainBed (when found, as the tests find it: domainbed_vasso's locator): one update of
  DomainBed's VASSO, ``rho = 0`` equal to ERM;
* cost: VASSO's update over AdamW running the same two passes, on a small transformer,
  judged only where the spread of its paired repeats allows ("too noisy to judge here"; so is
  a median below 1, which VASSO cannot cost: noise, not a pass).

Exit status: 0 when nothing failed (skipped checks say why), 1 when a check failed (each
failing row says in one line what to do), 2 for bad arguments.  ``--json PATH`` writes every figure, the environment and each failure's
details: the file to attach to a bug report.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional

from plugins.lab.tables import refuse_existing

#: Where the project's issues are; no public address is recorded in setup.cfg or the README
#: yet.  Set it here (one place) when there is one.
ISSUE_TRACKER: Optional[str] = None

CHECK_NAMES = ("environment", "math", "mixed-precision", "host-syncs", "ranks", "fairseq", "domainbed", "cost")
RANKS_ALLOWED = (1, 2, 4, 8)  # the ranks check splits a batch of 16


def package_version() -> str:
    import plugins

    return plugins.__version__


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment() -> Dict:
    """The facts of this machine that a bug report needs (nothing here runs a kernel)."""
    import torch

    env = {"vasso-plugins": package_version(), "python": platform.python_version(),
           "platform": platform.platform(), "torch": torch.__version__,
           "torch_cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "cpu_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    try:
        env["load_average"] = list(os.getloadavg())
    except OSError:
        env["load_average"] = None
    if torch.cuda.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            nccl = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as exc:  # a build without NCCL
            env["nccl"] = f"unavailable ({exc})"
        env["gpus"] = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"device": f"cuda:{i}", "name": p.name, "capability": f"{p.major}.{p.minor}",
                                "memory_gib": round(p.total_memory / 2 ** 30, 1)})
    fairseq_check, domainbed_check = host_check("fairseq"), host_check("domainbed")
    env["fairseq"] = _dist_version("fairseq-fixed", "fairseq") if fairseq_check.fairseq_missing() is None else None
    why = domainbed_check.domainbed_missing()
    if why is None:
        root = domainbed_check.domainbed_root()
        env["domainbed"] = {"root": root, "commit": domainbed_check.domainbed_commit(root)}
    else:
        env["domainbed"] = None
        env["domainbed_missing"] = why
    return env


#: The hosts' self-checks, found by name (as ``plugins.lab.runs.READERS`` finds their log
#: readers): the lab imports no host, and each host module imports fairseq or DomainBed
#: only inside its check, when they are there.
HOST_CHECKS = {"fairseq": "fairseq_vasso.nmt.selftest", "domainbed": "domainbed_vasso.selftest"}


def host_check(host: str):
    """The module of ``host``'s self-check (:data:`HOST_CHECKS`)."""
    return importlib.import_module(HOST_CHECKS[host])


def check_environment(device: str, env: Dict):
    if device == "cpu":
        db = env["domainbed"]
        figure = (f"vasso-plugins {env['vasso-plugins']}, torch {env['torch']} "
                  f"({'CUDA ' + env['torch_cuda_build'] if env['torch_cuda_build'] else 'CPU-only build'}), "
                  f"Python {env['python']}, fairseq {env['fairseq'] or 'not installed'}, "
                  f"DomainBed {db['commit'] if db else 'not found'}")
        return figure, {k: env[k] for k in ("vasso-plugins", "torch", "torch_cuda_build", "python", "platform",
                                            "fairseq", "domainbed", "cpus", "load_average")}
    gpu = next(g for g in env["gpus"] if g["device"] == device)
    figure = (f"{gpu['name']}, compute capability {gpu['capability']}, {gpu['memory_gib']} GiB; "
              f"CUDA {env['torch_cuda_build']}, cuDNN {env['cudnn']}, NCCL {env['nccl']}")
    return figure, dict(gpu, cuda=env["torch_cuda_build"], cudnn=env["cudnn"], nccl=env["nccl"])


# ------------------------------------------------------------------ running

class Row(dict):
    """check, device, result ("pass", "FAIL", "skipped"), reason, seconds, figure, details."""


#: A failing row's one line of what to do, by check (the first word of its name), where the
#: check itself gives none (``CheckFailed.hint``).
HINTS = {
    "math": "the core's step is off the paper's equations on this device: attach the JSON report to an issue",
    "mixed": "loss scaling through the two passes is off on this device: attach the JSON report to an issue",
    "host": "a step reads the device more than twice (details: the count of each member and API): attach the "
            "JSON report to an issue",
    "ranks": "the ranks' step differs from one process's: check the backend (NCCL_DEBUG=INFO for NCCL) and attach "
             "the JSON report",
    "fairseq": "run the command in the JSON report's details (fairseq-train ...) to see fairseq's whole output",
    "DomainBed": "is DomainBed at the tested commit (docs/domainbed.md)? The details hold the root and commit found",
    "cost": "on an idle machine, `python scripts/benchmark/benchmark.py` (docs/benchmarks.md) breaks the update's time down",
}
CRASH_HINT = "the check crashed: its traceback is in the JSON report (--json) under this row's details"


def run_check(check: str, device: str, fn: Callable[[], tuple], log: Callable[[str], None]) -> Row:
    from .checks import CheckFailed, Skipped

    t0 = time.perf_counter()
    row = Row(check=check, device=device, result="pass", reason="", figure="", details={}, hint="")
    try:
        row["figure"], row["details"] = fn()
    except Skipped as exc:
        row.update(result="skipped", reason=str(exc), figure=exc.figure, details=exc.details)
    except CheckFailed as exc:
        row.update(result="FAIL", figure=exc.figure, details=exc.details,
                   hint=exc.hint or HINTS.get(check.split()[0], CRASH_HINT))
    except Exception as exc:  # a crash is a failure, with its traceback in the report
        row.update(result="FAIL", figure=f"{type(exc).__name__}: {exc}",
                   details={"traceback": traceback.format_exc()}, hint=CRASH_HINT)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    log(f"[{row['seconds']:6.1f} s] {check:<16} {device:<12} {result_text(row)}"
        + (f": {row['figure']}" if row["figure"] else ""))
    return row


def result_text(row: Row) -> str:
    return f"skipped: {row['reason']}" if row["result"] == "skipped" else row["result"]


def plan(args, env: Dict, workdir: str) -> List[tuple]:
    """(check, device, function) in the order they run."""
    import torch

    from . import checks, ranks

    check_domainbed = host_check("domainbed").check_domainbed
    fairseq_host = host_check("fairseq")

    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    devices = ["cpu"] + gpus
    wanted = set(args.checks or CHECK_NAMES)
    todo: List[tuple] = []

    def add(name, check, device, fn):
        if name in wanted:
            todo.append((check, device, fn))

    def skip(reason):
        def fn():
            raise checks.Skipped(reason)
        return fn

    for d in devices:
        add("environment", "environment", d, lambda d=d: check_environment(d, env))
    for slug, (name, fn) in (("math", ("math", checks.check_math)),
                             ("mixed-precision", ("mixed precision", checks.check_mixed_precision)),
                             ("host-syncs", ("host syncs", checks.check_host_syncs))):
        for d in devices:
            add(slug, name, d, lambda fn=fn, d=d: fn(d))
        if not gpus:
            add(slug, name, "cuda", skip("no CUDA device"))
    # ranks: one group of ranks per backend runs both settings; the DDP row times it
    def group_rows(backend, devs, where):
        memo = {}
        fsdp2 = ranks.fsdp2_missing()

        def judged(setting):
            if "run" not in memo:
                try:
                    memo["run"] = ranks.run_ranks(backend, devs, ["DDP"] + ([] if fsdp2 else ["FSDP2"]))
                except checks.CheckFailed as exc:
                    memo["run"] = exc
            if isinstance(memo["run"], checks.CheckFailed):
                raise memo["run"]
            figure, details = ranks.judge_ranks(memo["run"], setting)
            return figure + ("" if setting == "DDP" else " (the DDP row's ranks; its time includes these)"), details

        add("ranks", "ranks (DDP)", where, lambda: judged("DDP"))
        add("ranks", "ranks (FSDP2)", where, skip(fsdp2) if fsdp2 else lambda: judged("FSDP2"))

    if args.ranks >= 2:
        group_rows("gloo", ["cpu"] * args.ranks, f"cpu x{args.ranks}")
    else:
        for setting in ranks.SETTINGS:
            add("ranks", f"ranks ({setting})", "cpu", skip("--ranks 1: the CPU ranks checks (gloo) run with --ranks 2"))
    if len(gpus) >= 2 and torch.distributed.is_nccl_available():
        n = max(k for k in RANKS_ALLOWED if k <= len(gpus))
        group_rows("nccl", gpus[:n], f"cuda x{n}")
    else:
        why = ("no CUDA device" if not gpus else "one GPU: the multi-rank checks need two" if len(gpus) < 2
               else "this torch build has no NCCL")
        for setting in ranks.SETTINGS:
            add("ranks", f"ranks ({setting})", "cuda", skip(why))
    # the hosts: fairseq's children (one per device and mode) start side by side at the first row
    cases = [("cpu", "fp32")] + [(d, mode) for d in gpus for mode in fairseq_host.CUDA_MODES]
    runs = fairseq_host.Runs(cases, workdir)
    for d, mode in cases:
        add("fairseq", "fairseq fp32" if mode == "fp32" else f"fairseq --{mode}", d,
            lambda d=d, mode=mode: runs.check(d, mode))
    if not gpus:
        add("fairseq", "fairseq fp32/--fp16/--amp/--memory-efficient-fp16", "cuda", skip("no CUDA device"))
    for d in devices:
        add("domainbed", "DomainBed", d, lambda d=d: check_domainbed(d))
    for d in devices:
        add("cost", "cost", d, lambda d=d: checks.check_cost(d))
    if not gpus:
        add("cost", "cost", "cuda", skip("no CUDA device"))
    return todo


def table(rows: List[Row]) -> str:
    from plugins.lab.tables import markdown_table

    return markdown_table(["check", "device", "result", "time", "figure"],
                          [[_cell(r["check"]), r["device"], _cell(result_text(r)), f"{r['seconds']:.1f} s",
                            _cell(r["figure"] or "-")] for r in rows], align="lllrl")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a figure's own bars would end the cell


def bug_report_note(json_path: Optional[str], failed: int) -> str:
    where = ISSUE_TRACKER or "the project's issue tracker"
    attach = (f"the JSON report {json_path}" if json_path
              else "the JSON report (run again with --json selftest.json to write it)")
    return (f"{failed} check(s) FAILED. Please open an issue at {where} and attach {attach}; "
            "it holds the environment, every figure and each failure's details.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="vasso-selftest", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON here (a new file, unless --force)")
    p.add_argument("--force", action="store_true", help="let --json overwrite an existing file")
    p.add_argument("--ranks", type=int, default=1,
                   help=f"gloo ranks for the CPU ranks check, one of {', '.join(map(str, RANKS_ALLOWED))} "
                        "(default 1: that check skips; NCCL uses the GPUs found)")
    p.add_argument("--checks", nargs="+", choices=CHECK_NAMES, metavar="CHECK",
                   help=f"run only these checks (default: all): {', '.join(CHECK_NAMES)}")
    args = p.parse_args(argv)
    if args.ranks not in RANKS_ALLOWED:
        p.error(f"--ranks must be one of {', '.join(map(str, RANKS_ALLOWED))} (the ranks check splits a batch "
                f"of 16), got {args.ranks}")
    if args.json:
        refuse_existing(p, {"--json": args.json}, args.force)
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            p.error(f"--json {args.json}: the folder {parent} does not exist")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(line):
        print(line, flush=True)

    started = datetime.datetime.now(datetime.timezone.utc)
    log(f"vasso-selftest: started {started:%Y-%m-%d %H:%M:%S} UTC")
    env = environment()
    rows: List[Row] = []
    with tempfile.TemporaryDirectory(prefix="vasso-selftest-") as workdir:
        for check, device, fn in plan(args, env, workdir):
            rows.append(run_check(check, device, fn, log))
    failed = sum(r["result"] == "FAIL" for r in rows)
    total = round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
    counts = {k: sum(r["result"] == k for r in rows) for k in ("pass", "FAIL", "skipped")}
    log("")
    log(table(rows))
    log("")
    for r in rows:
        if r["result"] == "FAIL":
            log(f"What to do, {r['check']} on {r['device']}: {r['hint']}")
    log(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped in {total:.0f} s")
    if args.json:
        report = {"vasso_selftest": package_version(), "started": started.isoformat(), "seconds": total,
                  "command": ["vasso-selftest", *(sys.argv[1:] if argv is None else argv)],
                  "environment": env, "summary": counts, "results": rows}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)
            f.write("\n")
        log(f"wrote {args.json}")
    if failed:
        log(bug_report_note(args.json, failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
