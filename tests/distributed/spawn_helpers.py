"""Run one function on N gloo ranks (CPU processes) and collect what each returns.

``run_ranks(world, "module:function", *args)`` starts ``world`` processes, each in its
own session (so a timeout kills its whole process group, by id), on a free port of its
own; every rank calls ``module.function(*args)`` after ``init_process_group("gloo")``
and its return value (anything ``torch.save`` takes) comes back in a list by rank.
A rank that raises makes the call raise with every rank's output.  One spawn that
checks many cases is much cheaper than many spawns: batch the cases in the function.
"""

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

import torch
from ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def run_ranks(world: int, target: str, *args, timeout: float = 240.0):
    with tempfile.TemporaryDirectory(prefix="vasso-ranks-") as tmp:
        with open(os.path.join(tmp, "args.pkl"), "wb") as f:
            pickle.dump(args, f)
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([REPO, HERE, os.path.join(REPO, "tests", "core"),
                                              os.path.join(REPO, "tests", "helpers"),
                                              os.environ.get("PYTHONPATH", "")])}
        procs, logs = [], []
        for rank in range(world):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), target, str(rank), str(world), str(port), tmp],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp))
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:  # each rank leads its own session: kill that group, by id
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            shown = "\n".join(f"--- rank {r} (exit {procs[r].returncode})\n{outputs[r][-4000:]}" for r in range(world))
            raise AssertionError(f"ranks {failed} of {world} failed running {target}:\n{shown}")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _main(target, rank, world, port, tmp):
    import importlib

    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(os.path.join(tmp, "args.pkl"), "rb") as f:
        args = pickle.load(f)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(*args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        # no collective in flight at exit: gloo's barrier waits for this rank's earlier work
        # (an optimizer's async loss-gap all_reduce nobody read), whose completion on a gloo
        # thread after the interpreter began to finalize aborts the process
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
