#!/usr/bin/env python
"""Counts ranks that abort at exit under load (issue 34): the 4-rank flat-shards case
(``flat_cases:every_member``) and the 2-rank FSDP2 case (``state_cases:at_any_point``)
run RUNS times each through ``spawn_helpers.run_ranks`` while BUSY busy-loop processes
keep the machine loaded; each run's ranks' exit statuses are tallied.

    PYTHONPATH=$PWD .venv/bin/python tests/distributed/count_exit_aborts.py --runs 30 --busy 4

An abort is a rank that exits by SIGABRT (-6, "terminate called without an active
exception"); any other failure is counted apart.  The busy loops are this script's own
children, stopped by their ids when it ends.  A recipe for a measurement, not a test: it
takes about 25 minutes on 2 cores."""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"flat shards, 4 ranks": (4, "flat_cases:every_member", False),
         "FSDP2, 2 ranks": (2, "state_cases:at_any_point", True)}  # True: takes a folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs of each case (default 30)")
    parser.add_argument("--busy", type=int, default=4, help="busy-loop processes beside the ranks (default 4)")
    parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(HERE)),
                        help="the checkout whose tests/distributed runs (default: this script's)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be in [1, inf) and --busy in [0, inf)")
    repo = os.path.abspath(args.repo)
    for path in (os.path.join(repo, "tests", "helpers"), os.path.join(repo, "tests", "core"),
                 os.path.join(repo, "tests", "distributed")):
        sys.path.insert(0, path)
    from spawn_helpers import run_ranks

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(5 if busy else 0)
        print(f"{args.busy} busy loops, load average {os.getloadavg()[0]:.1f}", flush=True)
        for name, (world, target, folder) in CASES.items():
            aborts = other = 0
            loads = []
            for i in range(args.runs):
                loads.append(os.getloadavg()[0])
                with tempfile.TemporaryDirectory(prefix="vasso-aborts-") as tmp:
                    try:
                        run_ranks(world, target, *((tmp,) if folder else ()), timeout=600)
                    except AssertionError as exc:  # run_ranks: "--- rank R (exit CODE)" per rank
                        codes = [int(c) for c in re.findall(r"^--- rank \d+ \(exit (-?\d+)\)", str(exc), re.M)]
                        aborts += codes.count(-6)
                        other += sum(c not in (0, -6) for c in codes)
                        print(f"  {name} run {i + 1}: exit statuses {codes}", flush=True)
            print(f"{name}: {args.runs} runs, {aborts} ranks aborted (SIGABRT), {other} other failures; "
                  f"load average {min(loads):.1f} to {max(loads):.1f}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
