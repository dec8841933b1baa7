#!/usr/bin/env python
"""Counts ranks that abort at exit under load: the 4-rank flat-shards case
(``flat_cases:every_member``) and the 2-rank FSDP2 case (``state_cases:at_any_point``)
run RUNS times each through ``spawn_helpers.run_ranks`` while BUSY busy-loop processes
keep the machine loaded; each run's ranks' exit statuses are tallied.  With ``--fairseq``,
stock ``fairseq-train`` instead (which destroys no process group): the self-test's toy run
(``fairseq_vasso.nmt.selftest``: 12 updates of ``--optimizer vasso``, ``--cpu`` with CUDA
hidden), as one process and as 2 gloo ranks.

    PYTHONPATH=$PWD:$PWD/tests/helpers .venv/bin/python tests/distributed/count_exit_aborts.py --runs 30 --busy 4
    PYTHONPATH=$PWD:$PWD/tests/helpers .venv/bin/python tests/distributed/count_exit_aborts.py --fairseq --runs 20 --busy 2

``PYTHONPATH`` names the checkout (``fairseq_vasso``) and the test helpers (``ports``, which
``spawn_helpers`` imports), as pytest's ``pythonpath`` does for the tests; the folder of this
script, which holds ``spawn_helpers``, is on the path as any script's is.  The ranks run this
checkout's ``tests/distributed`` (to measure another checkout, run its copy of this script).

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

CASES = {"flat shards, 4 ranks": (4, "flat_cases:every_member", False),
         "FSDP2, 2 ranks": (2, "state_cases:at_any_point", True)}  # True: takes a folder
FAIRSEQ_CASES = {"fairseq-train, 1 process": (1, None, False), "fairseq-train, 2 gloo ranks": (2, None, False)}


def fairseq_run(world, workdir):
    """The exit statuses of one fairseq-train on ``world`` processes (the self-test's toy run,
    binarized into ``workdir`` once) and whether rank 0 logged "done training"."""
    from fairseq_vasso.nmt import selftest
    from ports import free_port

    data = os.path.join(workdir, "data-bin")
    if not os.path.exists(os.path.join(data, "dict.en.txt")):
        subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess",
                        *selftest.preprocess_args(selftest.write_raw_corpus(workdir), data)],
                       check=True, capture_output=True, env=selftest._env("cpu"))
    port = free_port()
    procs = []
    for rank in range(world):
        ranks = [] if world == 1 else [
            "--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo", "--distributed-world-size", str(world),
            "--distributed-rank", str(rank), "--distributed-init-method", f"tcp://127.0.0.1:{port}",
            "--distributed-no-spawn"]
        args = selftest.train_args(data, os.path.join(workdir, "ckpt"), "cpu", "fp32", ranks)
        procs.append(subprocess.Popen([sys.executable, "-m", "fairseq_cli.train", *args], env=selftest._env("cpu"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return [proc.returncode for proc in procs], "done training" in outs[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs of each case (default 30)")
    parser.add_argument("--busy", type=int, default=4, help="busy-loop processes beside the ranks (default 4)")
    parser.add_argument("--fairseq", action="store_true", help="count stock fairseq-train's exits instead")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be in [1, inf) and --busy in [0, inf)")
    try:
        import ports  # noqa: F401  (spawn_helpers imports it)
        if args.fairseq:
            import fairseq_vasso  # noqa: F401
    except ImportError as exc:
        parser.error(f"{exc.name} is not importable: run with PYTHONPATH=$PWD:$PWD/tests/helpers from the "
                     "repository root (see the usage at the top of this script)")
    from spawn_helpers import run_ranks

    if args.fairseq:
        corpus = tempfile.TemporaryDirectory(prefix="vasso-aborts-")  # binarized once, for every run
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(5 if busy else 0)
        print(f"{args.busy} busy loops, load average {os.getloadavg()[0]:.1f}", flush=True)
        for name, (world, target, folder) in (FAIRSEQ_CASES if args.fairseq else CASES).items():
            aborts = other = 0
            loads = []
            for i in range(args.runs):
                loads.append(os.getloadavg()[0])
                if args.fairseq:
                    codes, done = fairseq_run(world, corpus.name)
                    # a rank that ends by SIGABRT: -6 here, 134 from a shell
                    aborts += codes.count(-6)
                    other += sum(c not in (0, -6) for c in codes) + (not done)
                    if codes != [0] * world or not done:
                        print(f"  {name} run {i + 1}: exit statuses {codes}, done training: {done}", flush=True)
                    continue
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
        if args.fairseq:
            corpus.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
