"""What the ranks run for test_flat_shards.py: the optimizer over slices of flat parameter
vectors that the model all-gathers itself, as under fairscale's FullyShardedDataParallel
(``flatten_parameters=True``, fairseq's ``--ddp-backend fully_sharded``) and torch's FSDP1
without ``use_orig_params``, with ``PartitionGroup(group, model_gathers=True)``.

torch's FSDP1 runs on the CPU (torch >= 2.6) and is run as it is; fairscale's FSDP needs
CUDA, so a hand-written loop does what it does, on gloo: each
wrapped unit's parameters are flattened into one vector, split with ``torch.chunk`` into
one slice per rank, and the slices padded with zeros to the length of the first
(``FullyShardedDataParallel._get_shard``); every forward all-gathers the slices into the
full vector, every backward reduces the full gradient and keeps this rank's slice of the
average (FSDP's reduce-scatter, here an ``all_reduce``, then the slice).  Each case trains
dist_cases' model beside its one-process reference on the whole batch, in one of three
APIs: the closure (no model passed), the explicit API (``second_pass`` without a model)
and ``first_step`` / ``second_step``."""

import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call

from plugins import PartitionGroup
from plugins.perturbation import rng_state

from core_helpers import VARIANTS
from dist_cases import DIAGNOSTICS, batches, build, compare, make_model, my_slice, reference

REFUSED = ("ASAM", "adaptive eVASSO")  # adaptive geometry: a flat slice hides which entries are biases
APIS = ("closure", "explicit", "first_step")


class FlatShards:
    """``model``'s parameters as FSDP holds them: one flat vector per unit (here each
    ``Linear``, as nested FSDP instances), this rank's zero-padded slice of each."""

    def __init__(self, model, units):
        self.model = model
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        names = {id(p): n for n, p in model.named_parameters()}
        self.units = []  # (names, shapes, numel)
        self.shards, self.padding = [], []
        for unit in units:
            params = list(unit.parameters())
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            chunks = list(flat.chunk(self.world))
            while len(chunks) < self.world:
                chunks.append(flat.new_empty(0))
            pad = chunks[0].numel() - chunks[self.rank].numel()
            self.shards.append(torch.nn.Parameter(F.pad(chunks[self.rank].clone(), [0, pad])))
            self.padding.append(pad)
            self.units.append(([names[id(p)] for p in params], [p.shape for p in params], flat.numel()))

    def parameters(self):
        return list(self.shards)

    def loss(self, x, y):
        """Forward on the gathered parameters, backward, and this rank's slice of the
        averaged gradient accumulated into the shards' ``.grad`` (FSDP's hooks)."""
        fulls, values = [], {}
        for shard, (names, shapes, numel) in zip(self.shards, self.units):
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard.detach())
            full = torch.cat(parts)[:numel].requires_grad_()
            fulls.append(full)
            for name, shape, view in zip(names, shapes, full.split([s.numel() for s in shapes])):
                values[name] = view.view(shape)
        loss = F.cross_entropy(functional_call(self.model, values, (x,)), y)
        loss.backward()
        for shard, full in zip(self.shards, fulls):
            grad = F.pad(full.grad, [0, shard.numel() * self.world - full.numel()])
            dist.all_reduce(grad)
            mine = grad[self.rank * shard.numel():(self.rank + 1) * shard.numel()] / self.world
            shard.grad = mine.clone() if shard.grad is None else shard.grad.add_(mine)
        return loss.detach()

    def full(self):
        """The whole model's parameters, gathered, in the model's order."""
        out = {}
        for shard, (names, shapes, numel) in zip(self.shards, self.units):
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard.detach())
            full = torch.cat(parts)[:numel]
            out.update(zip(names, (v.view(s) for v, s in zip(full.split([s.numel() for s in shapes]), shapes))))
        return [out[n] for n, _ in self.model.named_parameters()]

    def padding_values(self, opt):
        """The largest magnitude in the padding of the shards and of every per-shard
        buffer the optimizer keeps (d_t, Adam's moments, ...)."""
        worst = 0.0
        for shard, pad in zip(self.shards, self.padding):
            if not pad:
                continue
            tensors = [shard] + [v for v in opt.state[shard].values() if torch.is_tensor(v) and v.numel() > 1]
            worst = max([worst] + [float(t.detach()[-pad:].abs().max()) for t in tensors])
        return worst


def train(opt, loss, api, data):
    """``loss(x, y)``: forward and backward of this rank's slice, the gradients left in the
    shards' ``.grad`` as FSDP leaves them."""
    diags = []
    for x, y in data:
        if api == "closure":
            def closure():
                opt.zero_grad()
                return loss(x, y)
            opt.step(closure)  # no model: nothing to exchange
        elif api == "explicit":
            rng = rng_state()
            opt.zero_grad()
            loss(x, y)
            if opt.perturb():
                opt.zero_grad()
                with opt.second_pass(rng=rng):
                    loss(x, y)
            opt.descend()
        else:  # the davda54/sam loop: the second pass runs whatever first_step returns
            loss(x, y)
            opt.first_step(zero_grad=True)
            loss(x, y)
            opt.second_step(zero_grad=True)
        diags.append({k: float(opt.diagnostics[k]) for k in DIAGNOSTICS})
    return diags


def torch_fsdp1(kind, api, data, group):
    """The same over torch's own FSDP1 (``use_orig_params=False``: the optimizer gets its flat
    shards) on the CPU; None where this torch's FSDP1 does not run on CPUs (before 2.6)."""
    fsdp = __import__("torch.distributed.fsdp", fromlist=["FullyShardedDataParallel"])
    if not hasattr(fsdp, "fully_shard"):
        return None
    model = fsdp.FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"), use_orig_params=False)
    opt = build(kind, model.parameters(), partition_group=group)

    def loss(x, y):
        value = F.cross_entropy(model(x), y)
        value.backward()
        return value.detach()

    diags = train(opt, loss, api, data)
    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        weights = [p.detach().clone() for p in model.module.parameters()]
    return weights, diags, [p.numel() for p in model.parameters()]


def every_member():
    """Each member that plain geometry allows, in each API in turn, against one process:
    {kind: (api, relative error, diagnostics, the reference's, largest padding value)} over
    the hand-made shards; {("torch FSDP1", kind): (api, relative error, diagnostics, the
    reference's)} over torch's FSDP1; under "padding", this rank's padding per flat vector."""
    world = dist.get_world_size()
    group = PartitionGroup(dist.group.WORLD, model_gathers=True)
    data = batches(world)
    mine = my_slice(data)
    out = {}
    for i, kind in enumerate(k for k in VARIANTS if k not in REFUSED):
        api = APIS[i % len(APIS)]
        ref, ref_diags = reference(kind, world, "closure" if api == "closure" else "explicit")
        model = make_model()
        flat = FlatShards(model, [model[0], model[2]])
        opt = build(kind, flat.parameters(), partition_group=group)
        diags = train(opt, flat.loss, api, mine)
        out[kind] = (api, compare(flat.full(), ref), diags, ref_diags, flat.padding_values(opt))
        fsdp1 = torch_fsdp1(kind, api, mine, group)
        if fsdp1 is not None:
            out[("torch FSDP1", kind)] = (api, compare(fsdp1[0], ref), fsdp1[1], ref_diags)
            out["torch FSDP1 shards"] = fsdp1[2]
    out["padding"] = list(flat.padding)
    out["wrong use"] = wrong_use(group)
    return out


def _error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def wrong_use(group):
    """The messages of what the mode refuses (None where nothing was refused)."""
    out = {}
    model = make_model()
    flat = FlatShards(model, [model[0], model[2]])
    for kind in REFUSED:
        out[kind] = _error(lambda: build(kind, flat.parameters(), partition_group=group))
    out["model_gathers='yes'"] = _error(lambda: PartitionGroup(dist.group.WORLD, model_gathers="yes"))
    loaded = pickle.loads(pickle.dumps(group))
    out["pickled"] = (loaded.model_gathers, loaded.ranks, loaded.group is None)
    x, y = my_slice(batches(dist.get_world_size()))[0]

    def first_step(params, loss):
        opt = build("SAM", params, partition_group=group)
        loss().backward()
        return _error(lambda: opt.perturb())

    # replicas (a DDP-like model, whole on every rank) passed as shards
    replica = make_model()
    out["replicas"] = first_step(list(replica.parameters()), lambda: F.cross_entropy(replica(x), y))
    # whole parameters split among the ranks' optimizers, as ZeRO splits them: not equal-length shards
    split = make_model()
    params = list(split.parameters())[dist.get_rank()::dist.get_world_size()]
    out["ZeRO-like split"] = first_step(params, lambda: F.cross_entropy(split(x), y))
    return out
