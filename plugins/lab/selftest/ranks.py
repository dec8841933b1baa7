"""The ranks checks of ``vasso-selftest``: a group of ranks, each on its shard of every
batch, takes the step one process takes on the whole batch, under DistributedDataParallel
(replicated parameters, gradients averaged by DDP) and under FSDP2 (``fully_shard``: each
rank holds a shard of every parameter, and the core sums the step's partial sums over the
ranks, ``plugins.distributed``).

NCCL across two or more GPUs, gloo on the CPU (``--ranks 2``).  One group of ranks runs both
settings; every rank is a process of its own (``spawn``), on its own free port; all of them
are ended, by process id, when the check finishes or times out.
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
SETTINGS = ("DDP", "FSDP2")


def fsdp2_missing() -> "str | None":
    """Why FSDP2 cannot run with this torch, or None."""
    try:
        _fully_shard()
    except ImportError:
        return f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard)"
    return None


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    return fully_shard, init_device_mesh


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
    return torch.cat([(q.full_tensor() if hasattr(q, "full_tensor") else q).detach().reshape(-1).double().cpu()
                      for q in model.parameters()])


def _wrap(setting: str, model: torch.nn.Module, device: str):
    if setting == "DDP":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[torch.device(device).index] if device.startswith("cuda") else None)
    fully_shard, init_device_mesh = _fully_shard()
    mesh = init_device_mesh(device.split(":")[0], (torch.distributed.get_world_size(),))
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank_main(rank: int, world: int, backend: str, devices: Sequence[str], port: int, outdir: str,
               settings: Sequence[str], synced_first_pass: bool, rank_setup) -> None:
    """One rank: every setting, member and API on its shard; writes ``rank{r}.pt`` (or ``.err``)."""
    try:
        torch.set_num_threads(1)
        if rank_setup is not None:
            rank_setup()
        device = devices[rank]
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world)
        per = 16 // world
        shard = slice(rank * per, (rank + 1) * per)
        out = {}
        for setting in settings:
            for member in RANK_MEMBERS:
                for api in ("explicit", "closure"):
                    model = _wrap(setting, TinyMLP(initial_parameters(), device), device)
                    out[f"{setting} {member} {api}"] = run_member(
                        member, model, device, shard, api, synced_first_pass or api == "closure" or setting != "DDP")
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(backend: str, devices: Sequence[str], settings: Sequence[str] = SETTINGS, *,
              synced_first_pass: bool = True, rank_setup=None, timeout: float = 240.0) -> Dict:
    """Spawn ``len(devices)`` ranks (``backend``: ``"gloo"`` or ``"nccl"``) that run ``STEPS``
    steps of every member of :data:`RANK_MEMBERS`, in both APIs, in each setting; returns
    ``{"backend", "devices", "ranks": [each rank's {key: flat parameters}]}``, or raises
    :class:`CheckFailed` when a rank fails or hangs.  For the check's tests:
    ``synced_first_pass=False`` runs DDP's explicit first backward under ``no_sync()`` (each
    rank ascends along its own shard's gradient), and ``rank_setup`` (picklable, no
    arguments) runs first in every rank (a mutant core)."""
    world = len(devices)
    if 16 % world:
        raise ValueError(f"the ranks check splits a batch of 16: {world} ranks do not divide it")
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="vasso-selftest-ranks-") as outdir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, backend, list(devices), port, outdir, list(settings),
                                                       synced_first_pass, rank_setup), daemon=True)
                 for r in range(world)]
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
    return {"backend": backend, "devices": list(devices), "ranks": results}


def judge_ranks(run: Dict, setting: str) -> tuple:
    """(figure, details) of one setting of :func:`run_ranks`: every rank's parameters after
    the steps equal one process's on ``devices[0]`` with the whole batch to ``TOLERANCE``, and
    the ranks agree bit for bit; else :class:`CheckFailed`."""
    results, devices, backend = run["ranks"], run["devices"], run["backend"]
    world = len(devices)
    worst: Dict[str, float] = {}
    failures: List[str] = []
    for key in [k for k in results[0] if k.startswith(setting + " ")]:
        _, member, api = key.split(" ")
        alone = run_member(member, TinyMLP(initial_parameters(), devices[0]), devices[0], slice(None), api)
        err = max(float(((res[key] - alone).abs() / (1 + alone.abs())).max()) for res in results)
        agree = all(torch.equal(res[key], results[0][key]) for res in results)
        worst[f"{member} {api}"] = err
        if not (err <= TOLERANCE and agree):
            failures.append(f"{member} {api}: off the one-process step by {err:.1e}"
                            + ("" if agree else ", and the ranks disagree"))
    details = {"backend": backend, "devices": list(devices), "setting": setting, "max_error": worst,
               "tolerance": TOLERANCE, "steps": STEPS}
    if not worst:
        raise CheckFailed(f"the ranks ran no {setting} steps", details)
    if failures:
        raise CheckFailed(f"{world} {backend} ranks under {setting}: " + "; ".join(failures), details)
    figure = (f"{world} {backend} ranks under {setting} = one process, {len(RANK_MEMBERS)} members x 2 APIs: "
              f"max error {max(worst.values()):.1e} (tol {TOLERANCE:.0e}), ranks equal bit for bit")
    return figure, details


def check_ranks(backend: str, devices: Sequence[str], setting: str = "DDP", **kw) -> tuple:
    """One setting, in a group of ranks of its own (:func:`run_ranks`, :func:`judge_ranks`)."""
    return judge_ranks(run_ranks(backend, devices, [setting], **kw), setting)
