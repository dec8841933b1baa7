"""The ranks check of ``vasso-selftest``: a group of ranks under DistributedDataParallel,
each on its shard of every batch, takes the step one process takes on the whole batch.

NCCL across two or more GPUs, gloo on the CPU (``--ranks 2``).  Every rank is a process of
its own (``spawn``), on its own free port; all of them are ended, by process id, when the
check finishes or times out.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F

from plugins.perturbation import rng_state

from .checks import CheckFailed, TinyMLP, _core, batches, initial_parameters

#: The members the ranks run (each choice of the family once, eVASSO for the coin on every rank).
RANK_MEMBERS = ("SAM", "VASSO", "ASAM", "GSAM", "eVASSO")
STEPS = 4
TOLERANCE = 1e-5
#: What the sharded (FSDP2) check says until the core takes sharded parameters.
SHARDED_UNSUPPORTED = "sharded parameters not supported by this version"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_member(member: str, model: torch.nn.Module, device: str, shard: slice, api: str,
               synced_first_pass: bool = True) -> torch.Tensor:
    """``STEPS`` steps of ``member`` over SGD on ``model`` (a DDP module or a plain one), each
    on ``shard`` of the step's batch; the parameters after them, flat, on the CPU."""
    opt = _core(member, model.parameters(), lr=0.2, rho=0.3)
    for x, y in batches(STEPS, batch=16):
        x, y = x[shard].to(device, torch.float32), y[shard].to(device)

        def backward():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        if api == "closure":
            opt.step(backward, model=model)
        else:
            rng = rng_state()
            opt.zero_grad()
            if synced_first_pass:
                backward()
            else:  # each rank's own g_t: what the check exists to catch
                with model.no_sync():
                    backward()
            if opt.perturb():
                opt.zero_grad()
                with opt.second_pass(model, rng):
                    backward()
            opt.descend()
    return torch.cat([q.detach().reshape(-1).double().cpu() for q in model.parameters()])


def _rank_main(rank: int, world: int, backend: str, devices: Sequence[str], port: int, outdir: str,
               synced_first_pass: bool) -> None:
    """One rank: every member, both APIs, on its shard; writes ``rank{r}.pt`` (or ``.err``)."""
    try:
        torch.set_num_threads(1)
        device = devices[rank]
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world)
        per = 16 // world
        shard = slice(rank * per, (rank + 1) * per)
        out = {}
        for member in RANK_MEMBERS:
            for api in ("explicit", "closure"):
                model = TinyMLP(initial_parameters(), device)
                ddp = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None)
                out[f"{member} {api}"] = run_member(member, ddp, device, shard, api,
                                                    synced_first_pass or api == "closure")
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        raise


def check_ranks(backend: str, devices: Sequence[str], *, synced_first_pass: bool = True,
                timeout: float = 180.0) -> tuple:
    """``len(devices)`` ranks (``backend``: ``"gloo"`` or ``"nccl"``) against one process on
    ``devices[0]`` with the whole batch: every rank's parameters after ``STEPS`` steps of every
    member of :data:`RANK_MEMBERS`, in both APIs, equal the one-process run to ``TOLERANCE``,
    and the ranks agree with each other bit for bit.  ``synced_first_pass=False`` runs the
    explicit API's first backward under ``no_sync()`` (each rank ascends along its own
    shard's gradient): the failure this check exists to catch, for its tests."""
    world = len(devices)
    if 16 % world:
        raise ValueError(f"the ranks check splits a batch of 16: {world} ranks do not divide it")
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="vasso-selftest-ranks-") as outdir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, backend, list(devices), port, outdir,
                                                       synced_first_pass), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(deadline - time.monotonic(), 0.1))
        finally:
            late = [p for p in procs if p.is_alive()]
            for p in late:
                p.kill()
                p.join(5)
        errors = []
        for r in range(world):
            err = os.path.join(outdir, f"rank{r}.err")
            if os.path.exists(err):
                with open(err, encoding="utf-8") as f:
                    errors.append(f"rank {r}: " + f.read().strip().splitlines()[-1])
        if late:
            errors.append(f"{len(late)} of {world} ranks still running after {timeout:.0f} s: ended")
        if errors:
            raise CheckFailed(f"{backend} ranks failed: " + "; ".join(errors), {"errors": errors})
        results = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
    worst: Dict[str, float] = {}
    failures: List[str] = []
    for key in results[0]:
        member, api = key.split(" ")
        model = TinyMLP(initial_parameters(), devices[0])
        alone = run_member(member, model, devices[0], slice(None), api)
        err = max(float(((res[key] - alone).abs() / (1 + alone.abs())).max()) for res in results)
        agree = all(torch.equal(res[key], results[0][key]) for res in results)
        worst[key] = err
        if not (err <= TOLERANCE and agree):
            failures.append(f"{key}: off the one-process step by {err:.1e}"
                            + ("" if agree else ", and the ranks disagree"))
    details = {"backend": backend, "devices": list(devices), "max_error": worst, "tolerance": TOLERANCE,
               "steps": STEPS}
    if failures:
        raise CheckFailed(f"{world} {backend} ranks under DDP: " + "; ".join(failures), details)
    figure = (f"{world} {backend} ranks under DDP = one process, {len(RANK_MEMBERS)} members x 2 APIs: "
              f"max error {max(worst.values()):.1e} (tol {TOLERANCE:.0e}), ranks equal bit for bit")
    return figure, details
