"""What the ranks run (through spawn_helpers.run_ranks): each function checks many cases
in one spawn and returns plain numbers for the test to assert on.

Every case trains the same small MLP for a few steps on the same data two ways, in the
same process: one process with the whole batch (the reference), and the distributed
setup under test with this rank's slice of it; the ranks' final weights, gathered, and
their diagnostics are returned beside the reference's."""

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plugins import SAM, VASSO
from plugins.perturbation import rng_state

VARIANTS = {
    "SAM": (SAM, {}),
    "ASAM": (SAM, {"adaptive": True}),
    "GSAM": (SAM, {"gsam_alpha": 0.3}),
    "eSAM": (SAM, {"p": 0.5}),
    "VASSO": (VASSO, {}),
    "eVASSO": (VASSO, {"p": 0.5}),
    "V+G": (VASSO, {"gsam_alpha": 0.3}),
    "adaptive eVASSO": (VASSO, {"adaptive": True, "p": 0.5}),
}
DIAGNOSTICS = ("two_pass", "ascent_norm", "sharpness", "stability", "loss_gap")
STEPS = 4
PER_RANK = 4  # samples per rank and step


def make_model(seed=0):
    # 5 rows over 4 ranks: shards of 2, 2, 1, 0 rows (uneven, and one rank empty);
    # over 2 ranks: 3 and 2
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batches(world, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = PER_RANK * world
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(STEPS)]


def build(kind, params, **extra):
    cls, knobs = VARIANTS[kind]
    return cls(params, torch.optim.AdamW, rho=0.2, lr=1e-2, **knobs, **extra)


def run(opt, model, data, api, *, step_model=None, finish=None, explicit_opt=None):
    """STEPS steps with either API; ``opt`` is what the loop calls step() on (our
    optimizer, or a ZeRO/OSS wrapper), ``explicit_opt`` ours (for perturb/second_pass)."""
    ours = explicit_opt or opt
    diags = []
    for x, y in data:
        if api == "closure":
            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss
            opt.step(closure, model=step_model) if step_model is not None else opt.step(closure)
        else:
            rng = rng_state()
            opt.zero_grad()
            first = F.cross_entropy(model(x), y)
            first.backward()
            if ours.perturb():
                opt.zero_grad()
                with ours.second_pass(model, rng):
                    F.cross_entropy(model(x), y).backward()
            (finish or ours.descend)()
        diags.append({k: float(ours.diagnostics[k]) for k in DIAGNOSTICS})
    return diags


def reference(kind, world, api="closure"):
    model = make_model()
    opt = build(kind, model.parameters())
    diags = run(opt, model, batches(world), api)
    return [p.detach().clone() for p in model.parameters()], diags


def full(tensors):
    return [t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone() for t in tensors]


def compare(weights, ref):
    """The largest relative error over the weights: max |w - ref| / max |ref|."""
    return max(float((w - r).abs().max()) / max(float(r.abs().max()), 1e-30) for w, r in zip(weights, ref))


def my_slice(data):
    rank, world = dist.get_rank(), dist.get_world_size()
    return [(x[rank::world], y[rank::world]) for x, y in data]


def _fsdp():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    return fully_shard, init_device_mesh


def shard(model, mesh, reshard):
    fully_shard, _ = _fsdp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def every_setting():
    """Each member under DDP, FSDP2 (reshard after forward or not, a 2-D mesh where
    the world is even), ZeroRedundancyOptimizer and fairscale's OSS, against one process.
    Returns {(setting, kind): (relative error, distributed diagnostics, reference's)}."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    fully_shard, init_device_mesh = _fsdp()
    world = dist.get_world_size()
    data = batches(world)
    mine = my_slice(data)
    out = {}
    for i, kind in enumerate(VARIANTS):
        api = "closure" if i % 2 == 0 else "explicit"
        ref, ref_diags = reference(kind, world, api)

        model = DDP(make_model())
        opt = build(kind, model.parameters())
        diags = run(opt, model, mine, api)
        out[("DDP", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)

        for reshard in (True, False):
            mesh = init_device_mesh("cpu", (world,))
            model = shard(make_model(), mesh, reshard)
            opt = build(kind, model.parameters())
            diags = run(opt, model, mine, api)
            out[(f"FSDP2 reshard={reshard}", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)

        if world % 2 == 0:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            model = shard(make_model(), mesh, True)
            opt = build(kind, model.parameters())
            diags = run(opt, model, mine, api)
            out[("HSDP 2-D", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)

        cls, knobs = VARIANTS[kind]
        model = DDP(make_model())
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, base_optimizer=torch.optim.AdamW,
                                       partition_group=dist.group.WORLD, rho=0.2, lr=1e-2, **knobs)
        diags = run(zero, model, mine, api, step_model=model, finish=zero.step, explicit_opt=zero.optim)
        out[("ZeRO", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)

        from fairscale.optim import OSS
        model = DDP(make_model())
        oss = OSS(model.parameters(), optim=cls, base_optimizer=torch.optim.AdamW,
                  partition_group=dist.group.WORLD, rho=0.2, lr=1e-2, **knobs)
        diags = run(oss, model, mine, api, step_model=model, finish=oss.step, explicit_opt=oss.optim)
        out[("OSS", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)
    return out
