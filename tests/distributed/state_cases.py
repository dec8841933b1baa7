"""What the ranks run for the checkpoint tests (test_state_checkpoints.py), through
spawn_helpers.run_ranks: torch.distributed.checkpoint under FSDP2, saved on 2 ranks and
loaded on 2 and on 4, tensor parallelism x FSDP2 on 4, a checkpoint taken at any point (before any step, after steps the
coin skipped, ...) resumed on 2, and ZeroRedundancyOptimizer's consolidate_state_dict
round trip (mid-run and before any step).

Every run uses the same global batches (GLOBAL samples, rank r takes rows r::world), so
the trajectory does not depend on the world size; the functions return full weights and
counters for the test to compare."""

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from core_helpers import coin_seed
from dist_cases import VARIANTS, _fsdp, build, full, make_model, run, shard, tensor_parallel

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


# fresh; after steps the coin skipped (p < 1; for p = 1 the same as the next); after the first
# two-pass step (mid-run for p = 1; state_cases' KINDS resume mid-run too)
POINTS = {"SAM": (0, 3), "VASSO": (0, 3), "eSAM": (0, 2, 3), "eVASSO": (0, 2, 3)}
ANY_POINT = tuple(POINTS)


def at_any_point(root):
    """Under FSDP2, a DCP checkpoint taken at each of POINTS loads into a freshly built
    optimizer (whose template must have the checkpoint's keys: dcp.load refuses a missing
    one) and resumes bit for bit.  Returns {kind: {point: (template keys == saved keys,
    resumed == uninterrupted)}}."""
    data = my_rows(global_batches())
    out = {}
    for kind in ANY_POINT:
        seed = coin_seed(VARIANTS[kind][1].get("p", 1.0))
        out[kind] = {}
        for point in POINTS[kind]:
            path = os.path.join(root, f"{kind}-{point}")
            model = fsdp2_model()
            opt = build(kind, model.parameters(), seed=seed)
            run(opt, model, data[:point], "closure", read=False)
            saved = get_optimizer_state_dict(model, opt)
            dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=path)
            saved_keys = {fqn: sorted(entry) for fqn, entry in saved["state"].items()}
            run(opt, model, data[point:], "closure", read=False)

            resumed = fsdp2_model()
            fresh = build(kind, resumed.parameters(), seed=seed + 1)
            state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, fresh)}
            same_keys = {fqn: sorted(entry) for fqn, entry in state["optim"]["state"].items()} == saved_keys
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(resumed, state["model"])
            set_optimizer_state_dict(resumed, fresh, state["optim"])
            run(fresh, resumed, data[point:], "closure", read=False)
            out[kind][point] = (same_keys, fresh.num_steps == opt.num_steps and all(
                torch.equal(a, b) for a, b in zip(full(resumed.parameters()), full(model.parameters()))))
    return out


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
    out["any point"] = at_any_point(root)
    out["zero"] = zero_round_trip(root)
    out["zero at step 0"] = zero_round_trip(root, before=0)
    try:
        import fairscale  # noqa: F401  (not a dependency of the project)
    except ImportError:
        out["oss"] = None
    else:
        out["oss"] = zero_round_trip(root, "oss")
    return out


def tensor_parallel_resume(root):
    """Tensor parallelism x FSDP2 on a 2 x 2 mesh, each kind: BEFORE steps, a DCP checkpoint,
    AFTER more; a fresh model and optimizer loaded from it run the AFTER steps again.
    Returns {kind: (steps counted alike, resumed == uninterrupted)}."""
    _, init_device_mesh = _fsdp()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]  # a tensor-parallel pair takes the same rows
    data = [(x[dp::2], y[dp::2]) for x, y in global_batches()]
    out = {}
    for kind in KINDS:
        path = os.path.join(root, "tp-" + kind.replace(" ", "_"))
        model = tensor_parallel(mesh)
        opt = build(kind, model.parameters(), seed=5)
        run(opt, model, data[:BEFORE], "closure", read=False)
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        run(opt, model, data[BEFORE:], "closure", read=False)
        resumed = tensor_parallel(mesh)
        fresh = build(kind, resumed.parameters(), seed=11)
        state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, fresh)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(resumed, state["model"])
        set_optimizer_state_dict(resumed, fresh, state["optim"])
        run(fresh, resumed, data[BEFORE:], "closure", read=False)
        out[kind] = (fresh.num_steps == opt.num_steps,
                     all(torch.equal(a, b) for a, b in zip(full(resumed.parameters()), full(model.parameters()))))
    return out


def load_on_four(root):
    data = global_batches()
    out = {kind: dict(zip(("resumed", "loaded"), resume_from(os.path.join(root, kind.replace(" ", "_")), kind,
                                                             data)))
           for kind in KINDS}
    out["tensor parallel"] = tensor_parallel_resume(root)
    return out


def zero_round_trip(root, wrapper="zero", before=BEFORE):
    """ZeroRedundancyOptimizer (or fairscale's OSS) with eVASSO as its class: the state
    consolidated on rank 0 after ``before`` steps (0: before any step, every buffer a
    placeholder), its state_dict() saved there, loaded (weights_only) by a fresh wrapper on
    every rank, the run continued.  The wrappers copy every keyword of the class into their
    param groups, where a process group cannot be saved: the class comes with them bound
    (docs/distributed.md)."""
    import functools

    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    cls, knobs = VARIANTS["eVASSO"]
    data = my_rows(global_batches())
    bound = functools.partial(cls, base_optimizer=torch.optim.AdamW, partition_group=dist.group.WORLD)

    def make(seed):
        model = DDP(make_model())
        if wrapper == "zero":
            return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=bound, rho=0.2, lr=1e-2,
                                                  seed=seed, **knobs)
        from fairscale.optim import OSS
        return model, OSS(model.parameters(), optim=bound, rho=0.2, lr=1e-2, seed=seed, **knobs)

    def train(model, opt, part):
        run(opt, model, part, "closure", step_model=model, explicit_opt=opt.optim)

    model, opt = make(seed=5)
    try:  # a process group cannot be copied: refused, with the way out
        copy.deepcopy(opt.optim)
        refused = None
    except TypeError as e:
        refused = str(e)
    train(model, opt, data[:before])
    if wrapper == "zero":
        opt.consolidate_state_dict(to=0)
    else:
        opt.consolidate_state_dict(recipient_rank=0)
    path = os.path.join(root, f"{wrapper}-{before}.pt")
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, path)
    dist.barrier()
    saved_entries = sorted(torch.load(path, weights_only=True)["optim"]["state"][0])
    train(model, opt, data[before:])
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, opt = make(seed=11)
    train(model, opt, data[:1])  # a state of its own, which the load must replace
    checkpoint = torch.load(path, weights_only=True)
    model.module.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optim"])
    loaded = counters(opt.optim)
    train(model, opt, data[before:])
    return {"entries": saved_entries, "loaded": loaded, "copy refused": refused, "uninterrupted": uninterrupted,
            "resumed": [p.detach().clone() for p in model.parameters()]}
