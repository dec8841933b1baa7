"""What the ranks run for the checkpoint tests (test_state_checkpoints.py), through
spawn_helpers.run_ranks: torch.distributed.checkpoint under FSDP2, saved on 2 ranks and
loaded on 2 and on 4, and ZeroRedundancyOptimizer's consolidate_state_dict round trip.

Every run uses the same global batches (GLOBAL samples, rank r takes rows r::world), so
the trajectory does not depend on the world size; the functions return full weights and
counters for the test to compare."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from dist_cases import VARIANTS, build, full, make_model, run, shard

KINDS = ("eVASSO", "GSAM", "adaptive eVASSO")  # d_t, the diagnostic's buffer and the coin; g and GSAM; ASAM
BEFORE, AFTER = 3, 3  # steps before the checkpoint, and after it
GLOBAL = 8  # samples per step, divisible by 2 and 4


def global_batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL, 6, generator=g), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(BEFORE + AFTER)]


def my_rows(data):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [(x[rank::world], y[rank::world]) for x, y in data]


def fsdp2_model():
    from torch.distributed.device_mesh import init_device_mesh
    return shard(make_model(), init_device_mesh("cpu", (dist.get_world_size(),)), True)


def counters(opt):
    return {"step": opt.num_steps, "seed": opt.seed, "nonfinite": opt.nonfinite_steps}


def resume_from(path, kind, data):
    """A fresh FSDP2 model and optimizer on this world size, loaded from the checkpoint at
    ``path`` as torch's tutorial does it, then trained for the remaining steps."""
    model = fsdp2_model()
    opt = build(kind, model.parameters(), seed=11)  # the checkpoint's seed (5) must win
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = counters(opt)
    run(opt, model, my_rows(data)[BEFORE:], "closure")
    return full(model.parameters()), loaded


def save_on_two(root):
    """On 2 ranks, each kind under FSDP2: BEFORE steps, a DCP checkpoint in root/kind, AFTER
    more steps (the uninterrupted run), then a resume from the checkpoint on the same ranks."""
    data = global_batches()
    out = {}
    for kind in KINDS:
        path = os.path.join(root, kind.replace(" ", "_"))
        model = fsdp2_model()
        opt = build(kind, model.parameters(), seed=5)
        run(opt, model, my_rows(data)[:BEFORE], "closure")
        saved = counters(opt)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        run(opt, model, my_rows(data)[BEFORE:], "closure")
        uninterrupted = full(model.parameters())
        resumed, loaded = resume_from(path, kind, data)
        out[kind] = {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": resumed,
                     "final": counters(opt)}
    out["zero"] = zero_round_trip(root)
    return out


def load_on_four(root):
    data = global_batches()
    return {kind: dict(zip(("resumed", "loaded"), resume_from(os.path.join(root, kind.replace(" ", "_")), kind,
                                                              data)))
            for kind in KINDS}


def zero_round_trip(root):
    """ZeroRedundancyOptimizer with eVASSO as its class: consolidate_state_dict on rank 0,
    state_dict() saved there, loaded (weights_only) by a fresh ZeRO on every rank, the run
    continued.  ZeRO copies every keyword of the class into its param groups, where a
    process group cannot be saved: the class comes with them bound (docs/distributed.md)."""
    import functools

    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    cls, knobs = VARIANTS["eVASSO"]
    data = my_rows(global_batches())

    def make(seed):
        model = DDP(make_model())
        bound = functools.partial(cls, base_optimizer=torch.optim.AdamW, partition_group=dist.group.WORLD)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=bound, rho=0.2, lr=1e-2, seed=seed,
                                       **knobs)
        return model, zero

    model, zero = make(seed=5)
    run(zero, model, data[:BEFORE], "closure", step_model=model, explicit_opt=zero.optim)
    zero.consolidate_state_dict(to=0)
    path = os.path.join(root, "zero.pt")
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optim": zero.state_dict()}, path)
    dist.barrier()
    saved_entries = sorted(torch.load(path, weights_only=True)["optim"]["state"][0])
    run(zero, model, data[BEFORE:], "closure", step_model=model, explicit_opt=zero.optim)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, zero = make(seed=11)
    # a state of its own, which the load must replace
    run(zero, model, data[:1], "closure", step_model=model, explicit_opt=zero.optim)
    checkpoint = torch.load(path, weights_only=True)
    model.module.load_state_dict(checkpoint["model"])
    zero.load_state_dict(checkpoint["optim"])
    loaded = counters(zero.optim)
    run(zero, model, data[BEFORE:], "closure", step_model=model, explicit_opt=zero.optim)
    return {"entries": saved_entries, "loaded": loaded, "uninterrupted": uninterrupted,
            "resumed": [p.detach().clone() for p in model.parameters()]}
