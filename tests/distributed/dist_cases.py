"""What the ranks run (through spawn_helpers.run_ranks): each function checks many cases
in one spawn and returns plain numbers for the test to assert on.

Every case trains the same small MLP for a few steps on the same data two ways, in the
same process: one process with the whole batch (the reference), and the distributed
setup under test with this rank's slice of it; the ranks' final weights, gathered, and
their diagnostics are returned beside the reference's."""

import importlib.util
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plugins import SAM, VASSO, PartitionGroup
from plugins.lab.selftest.checks import protocol_step
from plugins.perturbation import rng_state

from core_helpers import VARIANTS  # the family's members as tests/core builds them (tests/core: on the ranks' path)

DIAGNOSTICS = ("two_pass", "ascent_norm", "sharpness", "stability", "loss_gap")
STEPS = 4
PER_RANK = 4  # samples per rank and step


def make_model(seed=0):
    # 5 rows over 4 ranks: shards of 2, 2, 1, 0 rows (uneven, and one rank empty);
    # over 2 ranks: 3 and 2
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def tensor_parallel_model(seed=0):
    # tensor parallelism over 2 ranks splits the hidden layer's 8 units evenly (FSDP2 shards
    # them again, strided); the last layer's bias stays whole on both: replicated
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(world, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = PER_RANK * world
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(STEPS)]


def build(kind, params, base=torch.optim.AdamW, **extra):
    cls, knobs = VARIANTS[kind]
    return cls(params, base, rho=0.2, lr=1e-2, **knobs, **extra)


def run(opt, model, data, api, *, step_model=None, finish=None, explicit_opt=None, read=True):
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
        if read:
            diags.append({k: float(ours.diagnostics[k]) for k in DIAGNOSTICS})
    return diags


def reference(kind, world, api="closure", model_maker=make_model):
    model = model_maker()
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


def tensor_parallel(mesh):
    """``tensor_parallel_model()`` as torchtitan builds it: tensor parallelism (column-wise,
    then row-wise) over ``mesh["tp"]``, FSDP2 over ``mesh["dp"]``.  Its parameters are
    sharded on different mesh dimensions: the last bias on ``dp`` alone."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    fully_shard, _ = _fsdp()
    model = parallelize_module(tensor_parallel_model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def every_setting():
    """Each member under DDP, FSDP2 (reshard after forward or not, a 2-D mesh where
    the world is even, tensor parallelism beside it on 4 ranks), ZeroRedundancyOptimizer
    and fairscale's OSS, against one process.  Returns {(setting, kind): (relative error,
    distributed diagnostics, reference's)} and, under "local sizes", the sizes of this
    rank's FSDP2 shards."""
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
            out["local sizes"] = [p.to_local().shape[0] for p in model.parameters()]

        if world % 2 == 0:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            model = shard(make_model(), mesh, True)
            opt = build(kind, model.parameters())
            diags = run(opt, model, mine, api)
            out[("HSDP 2-D", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)
            out.setdefault("HSDP on the device", {})[kind] = opt._lists.flat_slope is not None

        if world == 4:  # 2 data-parallel ranks, each a pair of tensor-parallel ones fed the same slice
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model = tensor_parallel(mesh)
            opt = build(kind, model.parameters())
            dp = mesh.get_coordinate()[0]
            diags = run(opt, model, [(x[dp::2], y[dp::2]) for x, y in data], api)
            tp_ref, tp_ref_diags = reference(kind, world, api, tensor_parallel_model)
            out[("TP x FSDP2", kind)] = (compare(full(model.parameters()), tp_ref), diags, tp_ref_diags)
            out.setdefault("TP x FSDP2 on the device", {})[kind] = opt._lists.flat_slope is not None
            model = tensor_parallel(mesh)  # over SGD, whose step reads nothing: the step's own host reads
            opt = build(kind, model.parameters(), torch.optim.SGD)
            out.setdefault("TP x FSDP2 reads", {})[kind] = [
                step[2].count("read") for step in counted_steps(opt, model, [(x[dp::2], y[dp::2]) for x, y in data],
                                                               api)[1:]]

        model = DDP(make_model())
        zero = _zero(kind, model.parameters(), torch.optim.AdamW)
        diags = run(zero, model, mine, api, step_model=model, finish=zero.step, explicit_opt=zero.optim)
        out[("ZeRO", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)

        model = DDP(make_model())
        oss = _oss(kind, model.parameters(), torch.optim.AdamW)
        diags = run(oss, model, mine, api, step_model=model, finish=oss.step, explicit_opt=oss.optim)
        out[("OSS", kind)] = (compare(full(model.parameters()), ref), diags, ref_diags)
    return out


# ------------------------------------------------------------------ host waits


class CountWaits:
    """The host waits of a block, as tests/core counts syncs (``aten._local_scalar_dense``
    plus ``Tensor.tolist``: a read) plus the blocking collectives the core issues (a
    ``torch.distributed`` call from a ``plugins`` module without ``async_op``: on gloo
    the host waits for it).  A collective whose result the next event reads is the same
    wait as that read, so ``waits`` counts reads and the collectives no read follows."""

    COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __init__(self):
        import sys

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.events = []
        self._sys = sys

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and not counter._in_tolist:
                    counter.events.append("read")
                return func(*args, **(kwargs or {}))

        self._mode = Reads()
        self._in_tolist = False

    def __enter__(self):
        counter = self
        self._saved = {name: getattr(dist, name) for name in self.COLLECTIVES}
        tolist = self._tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            if counter._in_tolist:
                return tolist(tensor)
            counter.events.append("read")
            counter._in_tolist = True
            try:
                return tolist(tensor)
            finally:
                counter._in_tolist = False

        def wrap(name, original):
            def collective(*args, **kwargs):
                caller = counter._sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith("plugins") and not kwargs.get("async_op", False):
                    counter.events.append("collective")
                return original(*args, **kwargs)
            return collective

        for name, original in self._saved.items():
            setattr(dist, name, wrap(name, original))
        torch.Tensor.tolist = counted_tolist
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist
        for name, original in self._saved.items():
            setattr(dist, name, original)

    @property
    def waits(self):
        ev = self.events
        return sum(1 for i, e in enumerate(ev) if e == "read" or (e == "collective" and (i + 1 >= len(ev)
                                                                                            or ev[i + 1] != "read")))


def counted_steps(opt, model, data, api, *, before_step=None, **kw):
    """``run`` step by step under CountWaits: each step's (waits, two_pass, events, sharpness,
    how many of the model's parameters have a gradient); ``before_step(t)`` runs before step t."""
    ours = kw.get("explicit_opt") or opt
    counts = []
    for t, batch in enumerate(data):
        if before_step is not None:
            before_step(t)
        with CountWaits() as waits:
            run(opt, model, [batch], api, read=False, **kw)
        counts.append((waits.waits, ours.diagnostics["two_pass"], waits.events, ours.diagnostics["sharpness"],
                       sum(q.grad is not None for q in model.parameters())))
    return counts


def _zero(kind, params, base=torch.optim.SGD, **extra):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    cls, knobs = VARIANTS[kind]
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, base_optimizer=base,
                                   partition_group=dist.group.WORLD, rho=0.2, lr=1e-2, **knobs, **extra)


def _oss(kind, params, base=torch.optim.SGD):
    """fairscale's OSS over ``kind``, as :func:`_zero` builds ZeRO (fairscale: not a
    dependency of the project; the callers check that it is installed)."""
    from fairscale.optim import OSS
    cls, knobs = VARIANTS[kind]
    return OSS(params, optim=cls, base_optimizer=base, partition_group=PartitionGroup(dist.group.WORLD), rho=0.2,
               lr=1e-2, **knobs)


def host_waits():
    """Each member, both APIs, under DDP, FSDP2, ZeRO and flat shards the model gathers
    (torch's FSDP1, ``PartitionGroup(model_gathers=True)``), over SGD (whose step reads
    nothing): the host waits of every step after the first (whose one-time checks and
    set-ups wait more), the diagnostics unread."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, init_device_mesh = _fsdp()
    world = dist.get_world_size()
    data = (my_slice(batches(world)) * 2)[:6]
    # torch's FSDP1 without use_orig_params: flat shards the model gathers (on CPUs from torch 2.6)
    fsdp1 = __import__("torch.distributed.fsdp", fromlist=["FullyShardedDataParallel"])
    fsdp1 = fsdp1 if hasattr(fsdp1, "fully_shard") else None
    flat = PartitionGroup(dist.group.WORLD, model_gathers=True)
    out = {}
    for kind in VARIANTS:
        for api in ("closure", "explicit"):
            model = DDP(make_model())
            opt = build(kind, model.parameters(), torch.optim.SGD)
            out[("DDP", kind, api)] = counted_steps(opt, model, data, api)[1:]
            model = shard(make_model(), init_device_mesh("cpu", (world,)), True)
            opt = build(kind, model.parameters(), torch.optim.SGD)
            out[("FSDP2", kind, api)] = counted_steps(opt, model, data, api)[1:]
            model = DDP(make_model())
            zero = _zero(kind, model.parameters())
            out[("ZeRO", kind, api)] = counted_steps(zero, model, data, api, step_model=model, finish=zero.step,
                                                   explicit_opt=zero.optim)[1:]
            if fsdp1 is not None and not VARIANTS[kind][1].get("adaptive"):  # flat shards refuse adaptive geometry
                model = fsdp1.FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"),
                                                       use_orig_params=False)
                opt = build(kind, model.parameters(), torch.optim.SGD, partition_group=flat)
                out[("flat shards", kind, api)] = counted_steps(opt, model, data, api)[1:]
    return out


def low_precision_vasso():
    """VASSO with bf16 parameters (its d_t rounded to bf16: the norm is d_t's as rounded)
    under DDP, FSDP2 and ZeroRedundancyOptimizer, against one process in bf16 on the path
    the setting takes (DDP and FSDP2: the device path; ZeRO: the host path):
    {(setting, kind): (relative error of the weights, the reference's sharpness per
    step, each step's counted_steps)}.  ZeRO without DDP: every rank computes the whole
    batch's gradient, as one process does."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, init_device_mesh = _fsdp()
    world = dist.get_world_size()
    data = [(x.bfloat16(), y) for x, y in (batches(world) * 2)[:6]]
    out = {}
    for kind in ("VASSO", "adaptive eVASSO"):
        refs = {}
        for on_device in (True, False):
            ref_model = make_model().bfloat16()
            ref_opt = build(kind, ref_model.parameters(), torch.optim.SGD)
            ref_opt._decide_on_device = on_device
            ref_diags = run(ref_opt, ref_model, data, "explicit")
            refs[on_device] = ([w.detach().float() for w in ref_model.parameters()], ref_diags)
        for setting in ("DDP", "FSDP2", "ZeRO"):
            ref, ref_diags = refs[setting != "ZeRO"]
            if setting == "DDP":
                model = DDP(make_model().bfloat16())
                opt = build(kind, model.parameters(), torch.optim.SGD)
                counts = counted_steps(opt, model, my_slice(data), "explicit")
            elif setting == "FSDP2":
                model = shard(make_model().bfloat16(), init_device_mesh("cpu", (world,)), True)
                opt = build(kind, model.parameters(), torch.optim.SGD)
                counts = counted_steps(opt, model, my_slice(data), "explicit")
            else:
                model = make_model().bfloat16()
                opt = _zero(kind, model.parameters())
                counts = counted_steps(opt, model, data, "explicit", finish=opt.step, explicit_opt=opt.optim)
                opt = opt.optim
            out[(setting, kind)] = (compare([w.float() for w in full(model.parameters())], ref),
                                    [d["sharpness"] for d in ref_diags], counts)
    return out


LATE = 3  # the step at which LateBranch's branch joins the forward


class LateBranch(torch.nn.Module):
    """make_model() and a branch that joins the forward at step LATE: its parameters get
    their first gradient there, beside parameters whose slopes are kept (a layer
    unfrozen mid-run)."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        torch.manual_seed(5)
        self.extra = torch.nn.Linear(6, 3)
        self.on = False

    def forward(self, x):
        out = self.body(x)
        return out + self.extra(x) if self.on else out


def late_branch_reference(kind, data, base=torch.optim.SGD, **extra):
    """One process's weights after ``data`` on a LateBranch whose branch joins at step LATE."""
    ref_model = LateBranch()
    ref_opt = build(kind, ref_model.parameters(), base, **extra)
    for t, batch in enumerate(data):
        ref_model.on = t >= LATE
        run(ref_opt, ref_model, [batch], "explicit")
    return [p.detach().clone() for p in ref_model.parameters()]


def owners_send(opt, model, owner):
    """``finish`` of a hand split's step: ``opt.descend()``, then each owner sends its
    parameters (``owner``: rank by ``id``), as ZeRO's step does after ours."""
    def descend_and_send():
        opt.descend()
        for p in model.parameters():
            dist.broadcast(p.data, src=owner[id(p)])
    return descend_and_send


def late_branch_split_by_hand(kind, data, base=torch.optim.SGD, **extra):
    """A LateBranch split by hand over partition_group: rank 0 optimizes the body, rank 1
    the branch, so rank 1 holds no gradient before step LATE and its set alone changes
    there.  Returns the model after ``data`` and each step's counted_steps."""
    model = LateBranch()
    owner = {id(p): 0 for p in model.body.parameters()} | {id(p): 1 for p in model.extra.parameters()}
    opt = build(kind, [p for p in model.parameters() if owner[id(p)] == dist.get_rank() % 2], base,
                partition_group=dist.group.WORLD, **extra)
    counts = counted_steps(opt, model, data, "explicit", finish=owners_send(opt, model, owner),
                           before_step=lambda t: setattr(model, "on", t >= LATE))
    return model, counts


def gradient_set_change():
    """A parameter's first gradient at step LATE, under FSDP2 and ZeroRedundancyOptimizer,
    against one process: {(setting, kind): (relative error, each step's (waits,
    two_pass, events))}.  ZeRO without DDP (whose buckets would not take an unused
    branch): every rank computes the whole batch's gradient."""
    fully_shard, init_device_mesh = _fsdp()
    world = dist.get_world_size()
    data = (batches(world) * 2)[:6]
    out = {}
    for kind in ("SAM", "VASSO", "ASAM", "V+G"):
        ref = late_branch_reference(kind, data)

        model = LateBranch()
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.body[0], model.body[2], model.extra):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = build(kind, model.parameters(), torch.optim.SGD)
        counts = counted_steps(opt, model, my_slice(data), "explicit",
                               before_step=lambda t: setattr(model, "on", t >= LATE))
        out[("FSDP2", kind)] = (compare(full(model.parameters()), ref), counts)

        model = LateBranch()
        zero = _zero(kind, model.parameters())
        counts = counted_steps(zero, model, data, "explicit", finish=zero.step, explicit_opt=zero.optim,
                               before_step=lambda t: setattr(model, "on", t >= LATE))
        out[("ZeRO", kind)] = (compare(full(model.parameters()), ref), counts)

        model, counts = late_branch_split_by_hand(kind, data)
        out[("hand-split", kind)] = (compare(full(model.parameters()), ref), counts)
    return out


def exchange_fallbacks():
    """ZeroRedundancyOptimizer (SAM and ASAM, explicit API) once perturb() moves the other
    owners' parameters itself: a second pass given another model than the exchange's
    (the model inside a container holding one more parameter) shares the parameters
    instead, and a second pass that raises leaves every rank at x_t.  {kind: (relative
    error against one process, how far the parameters are from x_t after the exception,
    no step in flight)}."""
    world = dist.get_world_size()
    data = (batches(world) * 2)[:5]
    out = {}
    for kind in ("SAM", "ASAM"):
        ref_model = make_model()
        run(build(kind, ref_model.parameters(), torch.optim.SGD), ref_model, data[:4], "explicit")
        model = make_model()
        zero = _zero(kind, model.parameters())
        outer = torch.nn.ModuleList([model, torch.nn.Linear(1, 1)])  # its extra parameter: no rank's
        for t, (x, y) in enumerate(data):
            rng = rng_state()
            before = [p.detach().clone() for p in model.parameters()]
            zero.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert zero.optim.perturb()
            zero.zero_grad()
            if t < 4:
                with zero.optim.second_pass(outer if t in (2, 3) else model, rng):
                    F.cross_entropy(model(x), y).backward()
                zero.step()
            else:
                try:
                    with zero.optim.second_pass(model, rng):
                        raise KeyError("a failing second pass")
                except KeyError:
                    pass
                # plain geometry puts its own back by subtracting the ascent (to rounding)
                back = max(float((a - b).abs().max()) for a, b in zip(before, model.parameters()))
        out[kind] = (compare(before, [p.detach() for p in ref_model.parameters()]), back, not zero.optim.in_flight)
    return out


def late_owner():
    """A parameter joins one rank's optimizer after the exchange was built: split by hand,
    rank 0 optimizes the body's first layer, rank 1 its second and, from step LATE on
    (``add_param_group`` on rank 1 alone), the branch that joins the forward there.  At
    that step rank 1 cannot place the branch's direction in the exchange's buffer: it
    says so in perturb()'s all_gather, every rank shares the parameters instead (and
    builds the exchange anew for the next step).  Against one process: {kind: (relative
    error, each step's counted_steps)}."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    data = (batches(world) * 2)[:6]
    out = {}
    for kind in ("SAM", "VASSO", "ASAM"):
        ref = late_branch_reference(kind, data)

        model = LateBranch()
        owner = ({id(p): 0 for p in model.body[0].parameters()} | {id(p): 1 for p in model.body[2].parameters()}
                 | {id(p): 1 for p in model.extra.parameters()})
        opt = build(kind, [p for p in model.body.parameters() if owner[id(p)] == rank], torch.optim.SGD,
                    partition_group=dist.group.WORLD)

        def before_step(t):
            model.on = t >= LATE
            if t == LATE and rank == 1:
                opt.add_param_group({"params": list(model.extra.parameters())})

        counts = counted_steps(opt, model, data, "explicit", finish=owners_send(opt, model, owner),
                               before_step=before_step)
        out[kind] = (compare(full(model.parameters()), ref), counts)
    return out


# ------------------------------------------------------------------ mixed precision


class CastForward(torch.nn.Module):
    """One process computing as FSDP2's MixedPrecisionPolicy(param_dtype=bf16) does: the
    parameters and the input cast to bf16 for the forward, the gradients back in fp32."""

    def __init__(self, inner, dtype):
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, x):
        cast = {n: p.to(self.dtype) for n, p in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, cast, (x.to(self.dtype),))


def bf16_policy():
    """FSDP2 with MixedPrecisionPolicy(bf16 parameters, fp32 reduction) against one
    process computing in bf16: {kind: (relative error of the updates, sharpness per step
    distributed, reference's)}."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    fully_shard, init_device_mesh = _fsdp()
    world = dist.get_world_size()
    data = batches(world)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for i, kind in enumerate(("SAM", "VASSO", "ASAM", "GSAM")):
        api = ("closure", "explicit")[i % 2]
        start = [p.detach().clone() for p in make_model().parameters()]
        ref_model = make_model()
        ref_opt = build(kind, ref_model.parameters(), torch.optim.SGD)
        ref_diags = run(ref_opt, CastForward(ref_model, torch.bfloat16), data, api)
        model = make_model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = build(kind, model.parameters(), torch.optim.SGD)
        diags = run(opt, model, my_slice(data), api)
        updates = [w - s for w, s in zip(full(model.parameters()), start)]
        ref_updates = [w.detach() - s for w, s in zip(ref_model.parameters(), start)]
        out[kind] = (compare(updates, ref_updates), [d["sharpness"] for d in diags],
                     [d["sharpness"] for d in ref_diags])
    return out


def fp16_scaler(faults):
    """FSDP2 under fp16 autocast with a stock torch.amp.GradScaler("cpu"), an overflow
    injected on rank 0 only at (step, pass) of ``faults``, against one process with the
    same overflow: {(kind, api): (relative error of the updates, steps taken, scales)},
    and the reference's under ("reference", kind, api)."""
    fully_shard, init_device_mesh = _fsdp()
    world = dist.get_world_size()
    data = batches(world, seed=3) * 2
    out = {}

    def train(model, opt, data, api, fault_here):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        taken, scales = [], []
        for t, (x, y) in enumerate(data):
            passes = []

            def backward():
                passes.append(1)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                if fault_here and (t, len(passes)) in faults:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                return loss
            before = opt.nonfinite_steps
            protocol_step(opt, model, backward, api, scaler)
            taken.append(opt.nonfinite_steps == before)
            scales.append(scaler.get_scale())
        return taken, scales

    for kind in ("SAM", "VASSO", "GSAM"):
        for api in ("closure", "explicit"):
            start = [p.detach().clone() for p in make_model().parameters()]
            ref_model = make_model()
            ref_opt = build(kind, ref_model.parameters(), torch.optim.SGD)
            ref = train(ref_model, ref_opt, data, api, True)
            model = shard(make_model(), init_device_mesh("cpu", (world,)), True)
            opt = build(kind, model.parameters(), torch.optim.SGD)
            got = train(model, opt, my_slice(data), api, dist.get_rank() == 0)
            updates = [w - s for w, s in zip(full(model.parameters()), start)]
            ref_updates = [w.detach() - s for w, s in zip(ref_model.parameters(), start)]
            out[(kind, api)] = (compare(updates, ref_updates),) + got
            out[("reference", kind, api)] = ref
    return out


SCALED_KINDS = ("SAM", "VASSO", "GSAM", "ASAM")  # zero_scaler's: each member's own sums and restore


def zero_scaler(faults):
    """torch's ZeroRedundancyOptimizer and fairscale's OSS (where installed), each with
    ``partition_group`` over DDP, under a stock torch.amp.GradScaler("cpu"), in both APIs:
    ``wrapper.step(closure, model=, scaler=)``, or ``perturb(scaler=)`` finished by
    ``plugins.scaling.step_wrapper``; an overflow injected on rank 0 only at (step, pass) of
    ``faults`` (DDP's average carries it to both ranks), against one process under
    ``scaler.step(opt)`` with the same overflow: {(wrapper, kind, api): (relative error of
    the weights, steps taken, scales, a step left in flight, steps counted as skipped)},
    and the reference's under ("reference", kind, api)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    data = batches(dist.get_world_size(), seed=4) * 2
    out = {}

    def train(model, opt, data, api, fault_here, wrapper=None):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        taken, scales, in_flight = [], [], False
        for t, (x, y) in enumerate(data):
            passes = []

            def backward():
                passes.append(1)
                loss = F.cross_entropy(model(x), y)
                scaler.scale(loss * float("inf") if fault_here and (t, len(passes)) in faults else loss).backward()
                return loss
            before = opt.nonfinite_steps
            protocol_step(opt, model, backward, api, scaler, wrapper)
            in_flight = in_flight or opt.in_flight
            taken.append(opt.nonfinite_steps == before)
            scales.append(scaler.get_scale())
        return taken, scales, in_flight, opt.nonfinite_steps

    wrappers = {"ZeRO": _zero, "OSS": _oss} if importlib.util.find_spec("fairscale") else {"ZeRO": _zero}
    for kind in SCALED_KINDS:
        for api in ("closure", "explicit"):
            ref_model = make_model()
            ref_opt = build(kind, ref_model.parameters(), torch.optim.SGD)
            out[("reference", kind, api)] = train(ref_model, ref_opt, data, api, True)
            for name, build_wrapper in wrappers.items():
                model = DDP(make_model())
                wrapper = build_wrapper(kind, model.parameters())
                got = train(model, wrapper.optim, my_slice(data), api, dist.get_rank() == 0, wrapper)
                weights = compare([w.detach() for w in model.parameters()],
                                  [w.detach() for w in ref_model.parameters()])
                out[(name, kind, api)] = (weights,) + got
    return out


# ------------------------------------------------------------------ wrong use


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def refusals():
    """Each wrong use on 2+ ranks, by name: the error's type and message (None: no error)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        from torch.distributed.tensor import DTensor, Partial
    except ImportError:
        from torch.distributed._tensor import DTensor
        from torch.distributed._tensor.placement_types import _Partial as Partial
    _, init_device_mesh = _fsdp()
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = my_slice(batches(world))[0]
    out = {}

    def one_step(opt, net, **kw):
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            return loss
        return opt.step(closure, **kw)

    # a hand-split model: each rank's optimizer holds another part, no partition_group
    model = make_model()
    part = [model[0]] if rank % 2 == 0 else [model[2]]
    opt = VASSO([p for m in part for p in m.parameters()], torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    out["hand-split"] = _error(lambda: one_step(opt, model))
    out["hand-split unmoved"] = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))

    # ranks training models of their own name a group of one rank: each rank's step is
    # then its own one-process step, on its own data
    alone, _ = dist.new_subgroups(1)
    torch.manual_seed(10 + rank)
    own = torch.nn.Linear(6, 3)
    start = [p.detach().clone() for p in own.parameters()]
    opt = VASSO(own.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, partition_group=alone)
    one_step(opt, own)
    # by hand: VASSO's first step is SAM's (d_0 = g_0) over SGD, on this rank's data alone
    w = [p.clone().requires_grad_() for p in start]
    g = torch.autograd.grad(F.cross_entropy(F.linear(x, *w), y), w)
    norm = torch.sqrt(sum((t * t).sum() for t in g))
    lifted = [(p + 0.05 * t / norm).detach().requires_grad_() for p, t in zip(start, g)]
    h = torch.autograd.grad(F.cross_entropy(F.linear(x, *lifted), y), lifted)
    expected = [p - 0.1 * t for p, t in zip(start, h)]
    out["own models"] = max(float((a - b).abs().max()) for a, b in zip(own.parameters(), expected)) <= 1e-6

    # ZeroRedundancyOptimizer without partition_group
    model = DDP(make_model())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=VASSO, base_optimizer=torch.optim.SGD,
                                   lr=0.1)
    out["zero without partition_group"] = _error(lambda: one_step(zero, model, model=model))

    # partition_group over DDP replicas (every rank holds every parameter)
    model = DDP(make_model())
    opt = VASSO(model.parameters(), torch.optim.SGD, lr=0.1, partition_group=dist.group.WORLD)
    out["replicas with partition_group"] = _error(lambda: one_step(opt, model, model=model))

    # partition_group without the model for the second pass
    out["partition_group, no model"] = _error(lambda: one_step(opt, model))

    # partition_group with a second pass outside second_pass(model, rng), and the
    # ecosystem's first_step/second_step (whose loops do that)
    model = DDP(make_model())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=SAM, base_optimizer=torch.optim.SGD,
                                   partition_group=dist.group.WORLD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def outside():
        zero.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert zero.optim.perturb()
        zero.zero_grad()
        F.cross_entropy(model(x), y).backward()
        zero.step()
    out["second pass outside second_pass"] = _error(outside)
    out["outside: unmoved"] = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    out["first_step"] = _error(lambda: zero.optim.first_step())

    # partition_group with DTensors
    mesh = init_device_mesh("cpu", (world,))
    sharded = shard(make_model(), mesh, True)
    out["partition_group with DTensors"] = _error(
        lambda: SAM(sharded.parameters(), torch.optim.SGD, lr=0.1, partition_group=dist.group.WORLD))

    # a DTensor with a Partial placement
    weight = torch.nn.Parameter(DTensor.from_local(torch.randn(3, 2), mesh, [Partial()]))
    weight.grad = DTensor.from_local(torch.randn(3, 2), mesh, [Partial()])
    opt = SAM([weight], torch.optim.SGD, lr=0.1)
    out["Partial placement"] = _error(lambda: opt.perturb())

    # ZeRO keeps the keyword in its param_groups (so in its state_dict): a PartitionGroup
    # pickles there, a loaded one (no live group) is refused when building
    import pickle
    model = DDP(make_model())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=VASSO, base_optimizer=torch.optim.SGD,
                                   partition_group=PartitionGroup(), lr=0.1)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups]
    loaded = pickle.loads(pickle.dumps(hyper))[0]["partition_group"]
    out["PartitionGroup pickles"] = (loaded.ranks == list(range(world)), loaded.group is None)
    out["loaded PartitionGroup"] = _error(lambda: VASSO(make_model().parameters(), torch.optim.SGD, lr=0.1,
                                                        partition_group=loaded))

    # not a process group
    out["partition_group=3"] = _error(lambda: SAM(make_model().parameters(), torch.optim.SGD, lr=0.1,
                                                  partition_group=3))
    return out


def one_rank_nonfinite():
    """FSDP2, no scaler, a NaN in rank 0's part of g_t at step 1 and of h_t at step 2 only:
    {kind: (steps skipped, the weights finite)}."""
    _, init_device_mesh = _fsdp()

    def poison(model):  # a NaN in the first non-empty shard of this rank's gradient
        grad = next(q.grad.to_local() for q in model.parameters() if q.grad.to_local().numel())
        grad.view(-1)[0] = float("nan")

    out = {}
    for kind in ("SAM", "VASSO", "GSAM", "ASAM", "adaptive eVASSO"):
        model = shard(make_model(), init_device_mesh("cpu", (dist.get_world_size(),)), True)
        opt = build(kind, model.parameters(), torch.optim.SGD)
        for t, (x, y) in enumerate(my_slice(batches(dist.get_world_size()))):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if t == 1 and dist.get_rank() == 0:
                poison(model)  # g_t
            if opt.perturb():
                opt.zero_grad()
                with opt.second_pass(model):
                    F.cross_entropy(model(x), y).backward()
                if t == 2 and dist.get_rank() == 0:
                    poison(model)  # h_t
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.descend()
                opt._count_arrived(wait=True)
        weights = torch.cat([w.reshape(-1) for w in full(model.parameters())])
        out[kind] = (opt.nonfinite_steps, bool(torch.isfinite(weights).all()))
    return out


def zero_over_a_fused_base():
    """ZeroRedundancyOptimizer over fused AdamW, which takes torch's ``found_inf``: perturb()
    decides by its one host read (the exchange's), and h_t's verdict reaches the base on the
    device, with ASAM's deferred diagnostics' sums.  {kind: (relative error against one
    process over fused AdamW, each step's counted_steps, the diagnostics of a run whose rank
    0 alone has a NaN in h_t at step 3 (steps 0-2) beside one process's, that step's
    ``nonfinite``, nonfinite_steps, whether its weights are finite, and the relative error of
    a hand split whose rank 1 holds no gradient before step LATE)}."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
    except (RuntimeError, TypeError, ValueError) as exc:  # no CPU fused AdamW in this torch
        return str(exc)
    data = (batches(dist.get_world_size()) * 2)[:5]
    keys = ("ascent_norm", "sharpness", "stability")
    out = {}
    for kind in ("SAM", "VASSO", "GSAM", "V+G", "ASAM"):
        ref_model = make_model()
        ref_diags = run(build(kind, ref_model.parameters(), fused=True), ref_model, data, "explicit")
        model = DDP(make_model())
        zero = _zero(kind, model.parameters(), torch.optim.AdamW, fused=True)
        counts = counted_steps(zero, model, my_slice(data), "explicit", finish=zero.step, explicit_opt=zero.optim)
        error = compare([p.detach() for p in model.parameters()], [p.detach() for p in ref_model.parameters()])

        model = DDP(make_model())
        zero = _zero(kind, model.parameters(), torch.optim.AdamW, fused=True)
        diags = []
        for t, (x, y) in enumerate(my_slice(data)):
            rng = rng_state()
            zero.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if zero.optim.perturb():
                zero.zero_grad()
                with zero.optim.second_pass(model, rng):
                    F.cross_entropy(model(x), y).backward()
                if t == 3 and dist.get_rank() == 0:
                    next(model.parameters()).grad.view(-1)[0] = float("nan")  # this rank's h_t only
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                zero.step()
            if t == 3:
                flagged = zero.optim.diagnostics["nonfinite"]
            else:
                diags.append([float(zero.optim.diagnostics[k]) for k in keys])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            skipped = zero.optim.nonfinite_steps
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        diags = (diags[:3], [[d[k] for k in keys] for d in ref_diags[:3]])

        # split by hand, rank 1 (the branch's owner) holding no gradient before step LATE: the
        # ranks still decide alike whether the base takes the verdict (one all_reduce each)
        model, _ = late_branch_split_by_hand(kind, data, torch.optim.AdamW, fused=True)
        hand_error = compare(full(model.parameters()), late_branch_reference(kind, data, torch.optim.AdamW, fused=True))
        out[kind] = (error, counts, diags, flagged, skipped, bool(torch.isfinite(weights).all()), hand_error)
    return out


def two_rank_checks():
    """The checks one spawn of 2 ranks runs together: host waits, mixed precision,
    wrong use."""
    return {"host_waits": host_waits(), "bf16": bf16_policy(), "fp16": fp16_scaler([(2, 1), (5, 2)]),
            "ZeRO and OSS scaled": zero_scaler([(2, 1), (5, 2)]),
            "refusals": refusals(), "bf16 VASSO": low_precision_vasso(), "late gradient": gradient_set_change(),
            "exchange fallbacks": exchange_fallbacks(), "late owner": late_owner(),
            "one rank non-finite": one_rank_nonfinite(), "ZeRO over a fused base": zero_over_a_fused_base()}
