"""Where a step's tensors live across processes, and the few collectives of a step.

A sharpness-aware step is pointwise except for a few global scalars (the ascent's norm,
GSAM's inner product, the diagnostics): each rank computes the pointwise math on the part
of every tensor it holds, and one ``all_reduce`` of the partial sums (sums of squares and
inner products, never norms) makes those scalars global.  :class:`Layout` says over which
ranks that sum runs, from what the parameters are:

* plain tensors, no ``partition_group``: replicas (one process, or DDP): no collective;
* DTensors (FSDP2's ``fully_shard``, any device mesh): the sum runs over the mesh
  dimensions on which some parameter is ``Shard``-ed; on a dimension where a tensor is
  ``Replicate``-d only the ranks at coordinate 0 count it, so no replica counts twice
  (torch's ``get_total_norm`` gets the same from DTensor's ``Partial`` norms);
* plain tensors with ``partition_group``: each rank's optimizer holds a part of the
  parameters (``ZeroRedundancyOptimizer``, fairscale's ``OSS``, a hand-split model):
  the sum runs over the group, and :class:`AscentExchange` brings every owner's
  parameters to ``x + eps`` on the other ranks before the second forward (their ascent
  directions ride along with the step's partial sums in one ``all_gather``).
* plain tensors with ``PartitionGroup(group, model_gathers=True)``: each rank's optimizer
  holds its equal-length slice of flat parameter vectors, which the model all-gathers
  itself in every forward (fairscale's FSDP, torch's FSDP1 without ``use_orig_params``):
  the sum runs over the group as above, and nothing is exchanged.

This module imports no DTensor module: it takes the classes from the one already
loaded (``torch.distributed.tensor``, torch 2.1's ``torch.distributed._tensor``), so the
core imports and runs unsharded on any torch, and a run without DTensors never loads it.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .validation import check

__all__ = ["dtensor_classes", "is_dtensor", "like", "local", "PartitionGroup", "Layout", "AscentExchange", "exchange_for",
           "exchange_sums", "move_others"]

_DTENSOR: Optional[tuple] = None

#: The refusal of ``partition_group`` with DTensor parameters (at construction and per step).
DTENSOR_PARTITION = ("partition_group must be None for DTensor parameters (FSDP2, fully_shard): they carry "
                     "their device mesh, over which the step reduces; partition_group names the ranks of plain "
                     "tensors split by hand or by ZeroRedundancyOptimizer / OSS")
#: The refusal of a second pass without the model under ``partition_group``.
PARTITION_MODEL = ("partition_group: the second pass needs every parameter at x + eps on every rank, and each "
                   "rank's optimizer holds only its own: pass the model, step(closure, model=model) or "
                   "second_pass(model, rng), so that the owners can send theirs (docs/design.md, 'Distributed steps')")
_NONE = (None, None, None)


def dtensor_classes() -> tuple:
    """``(DTensor, Shard, Replicate)`` of this torch, or ``(None, None, None)`` while no
    DTensor module is loaded: a DTensor cannot exist before its module is imported, so
    a run without one never pays for importing it (nor does torch 2.1, where it lives
    in ``torch.distributed._tensor``)."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor") or sys.modules.get("torch.distributed._tensor")
        if module is None:
            return _NONE
        try:
            _DTENSOR = (module.DTensor, module.Shard, module.Replicate)
        except AttributeError:  # a partly initialized module: try again next time
            return _NONE
    return _DTENSOR


def _shards(placement: Any, Shard: type) -> bool:
    """``placement`` splits the tensor's elements over its mesh dimension: a ``Shard``, or the
    ``_StridedShard`` that FSDP2 puts on its dimension over tensor parallelism's ``Shard`` of
    the same tensor dimension (not a ``Shard`` subclass in every torch)."""
    return isinstance(placement, Shard) or getattr(placement, "split_factor", None) is not None


def is_dtensor(t: Any) -> bool:
    cls = dtensor_classes()[0]
    return cls is not None and isinstance(t, cls)


def like(q: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``part`` (this rank's local tensor) as ``q`` holds it: a DTensor on ``q``'s mesh with its
    placements, shape and strides that aliases ``part``, where ``q`` is a DTensor; else ``part``."""
    if not is_dtensor(q):
        return part
    with torch.no_grad():
        return dtensor_classes()[0].from_local(part, q.device_mesh, q.placements, run_check=False,
                                               shape=q.shape, stride=q.stride())


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard, aliased: in-place
    operations on it write the DTensor); ``t`` itself for a plain tensor."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():  # outside autograd, to_local() returns the shard itself
        return t.to_local()


class PartitionGroup:
    """``partition_group`` in a form a checkpoint can hold.

    ``ZeroRedundancyOptimizer`` and fairscale's ``OSS`` copy every keyword of their
    optimizer class into their own ``param_groups``, hence into their ``state_dict()``,
    and a ``ProcessGroup`` cannot be pickled: ``torch.save`` of their state would fail.
    This handle pickles as its ranks alone (a loaded one holds no group; the optimizer
    built by the resumed run is given the live one)::

        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=VASSO,
                                       base_optimizer=torch.optim.AdamW,
                                       partition_group=PartitionGroup(group), lr=1e-3)

    ``model_gathers=True``: the parameters are shards of flat parameter vectors that the
    model all-gathers itself before every forward (fairscale's ``FullyShardedDataParallel``,
    torch's FSDP1 without ``use_orig_params``: each rank holds a slice of equal length,
    zero-padded on the last ranks).  The step's sums still run over the group, but the
    second pass sends nothing (the model gathers the shards at ``x + eps`` itself), so
    it needs no model and ``first_step()`` / ``second_step()`` work.  Adaptive geometry
    is refused there: a flat slice no longer tells weight tensors from biases.
    """

    def __init__(self, group=None, *, model_gathers: bool = False):
        dist = torch.distributed
        self.model_gathers = check("model_gathers", model_gathers)
        self.group = dist.group.WORLD if group is None else group
        self.ranks = list(dist.get_process_group_ranks(self.group))

    def __getstate__(self):
        return {"group": None, "ranks": self.ranks, "model_gathers": self.model_gathers}

    def __repr__(self) -> str:
        return (f"PartitionGroup(ranks={self.ranks}{', model_gathers=True' if self.model_gathers else ''}"
                f"{'' if self.group is not None else ', not live: loaded'})")


def ranks(group=None) -> int:
    """The number of ranks in ``group`` (None: the default group); 1 without a process group."""
    dist = torch.distributed
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _describe(t: torch.Tensor) -> str:
    return f"{type(t).__module__}.{type(t).__qualname__}"


class Layout:
    """How the parameters that have a gradient are split across ranks, and the one
    collective that makes a step's partial sums global (see the module docstring).

    ``counted``: the indices of the tensors whose local part this rank adds to the
    partial sums (None: all); ``groups``: the process groups the partial sums are
    summed over, in order (empty: none; one per sharded mesh dimension for DTensors,
    so one for FSDP2 and HSDP); ``replica_check``: plain tensors on several ranks
    without ``partition_group``, which must be replicas (checked once)."""

    def __init__(self, params: Sequence[torch.Tensor], partition_group=None, *, model_gathers: bool = False):
        self.partition_group = partition_group
        self.model_gathers = model_gathers  # equal-length flat shards (see PartitionGroup)
        self.device = params[0].device if params else torch.device("cpu")
        self.counted: Optional[List[int]] = None
        self.groups: List[Any] = []
        DTensor, Shard, Replicate = dtensor_classes()
        kinds = []
        for i, q in enumerate(params):
            value = q.detach()
            if DTensor is not None and isinstance(value, DTensor):
                kinds.append(True)
            elif type(value) is torch.Tensor:
                kinds.append(False)
            else:
                raise TypeError(f"parameter {i} is a {_describe(value)}: the sharpness-aware optimizers reduce "
                                "plain tensors and DTensors (FSDP2) only; for another tensor type, hand the "
                                "optimizer its plain local tensors and name the ranks that share them with "
                                "partition_group=")
            if q.grad is not None and type(q.grad) is not type(value) and not (kinds[-1] and is_dtensor(q.grad)):
                raise TypeError(f"parameter {i} is a {_describe(value)} but its gradient is a "
                                f"{_describe(q.grad)}: the optimizer cannot tell which ranks hold which part")
        self.sharded = any(kinds)
        if self.sharded and partition_group is not None:
            raise ValueError(DTENSOR_PARTITION)
        self.replica_check = not self.sharded and partition_group is None and ranks() > 1
        # a group of this rank alone: its parameters are its own (ranks training models of their own)
        self.partitioned = partition_group is not None and torch.distributed.get_world_size(partition_group) > 1
        if self.partitioned:
            self.groups = [partition_group]
        elif self.sharded:
            self._mesh_groups(params, kinds, Shard, Replicate)

    def _mesh_groups(self, params, kinds, Shard, Replicate) -> None:
        mesh = None
        shard_dims: List[set] = []
        for i, (q, is_d) in enumerate(zip(params, kinds)):
            if not is_d:
                shard_dims.append(set())
                continue
            if mesh is None:
                mesh = q.device_mesh
            elif q.device_mesh != mesh:
                raise ValueError(f"parameter {i} lives on another device mesh than parameter {kinds.index(True)}: "
                                 "the optimizer reduces over one mesh; build one optimizer per mesh")
            dims = set()
            for d, placement in enumerate(q.placements):
                if _shards(placement, Shard):
                    dims.add(d)
                elif not isinstance(placement, Replicate):
                    raise ValueError(f"parameter {i} has placement {placement} on mesh dimension {d}: the "
                                     "optimizer reduces Shard and Replicate placements only; redistribute "
                                     "Partial values (and their gradients) to Shard or Replicate first")
            shard_dims.append(dims)
            grad = q.grad
            if grad is not None and tuple(grad.placements) != tuple(q.placements):
                raise ValueError(f"parameter {i}'s gradient has placements {tuple(grad.placements)}, the parameter "
                                 f"{tuple(q.placements)}: the optimizer needs them alike (Partial gradients must "
                                 "be reduced first)")
        union = sorted(set().union(*shard_dims))
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("this rank is not in the parameters' device mesh")
        self.counted = [i for i, dims in enumerate(shard_dims)
                        if all(coordinate[d] == 0 for d in union if d not in dims)]
        if len(self.counted) == len(params):
            self.counted = None
        self.groups = [mesh.get_group(mesh_dim=d) for d in union]

    def unfiltered(self) -> "Layout":
        """This layout for lists that hold only the counted tensors already."""
        other = object.__new__(Layout)
        other.__dict__.update(self.__dict__)
        other.counted = None
        return other

    @property
    def collective(self) -> bool:
        """True when the partial sums cross ranks (every rank must then reduce alike)."""
        return bool(self.groups)

    def all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        """Sum ``values`` (float64, on the tensors' device) over the layout's groups, in place."""
        for group in self.groups:
            torch.distributed.all_reduce(values, group=group)
        return values

    def check_split(self, params: Sequence[torch.Tensor]) -> None:
        """Once per set of parameters: plain tensors on several ranks without
        ``partition_group`` must be replicas (DDP), and with it they must not be.  One
        ``all_gather`` of a fingerprint (count, elements, the sum of the values)."""
        if not (self.replica_check or self.partitioned):
            return
        dist = torch.distributed
        group = self.partition_group
        device = params[0].device if params else torch.device("cpu")
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.stack([torch.tensor(float(len(params)), dtype=torch.float64, device=device),
                            torch.tensor(float(sum(q.numel() for q in params)), dtype=torch.float64, device=device),
                            sum((q.detach().double().sum() for q in params),
                                torch.zeros((), dtype=torch.float64, device=device))])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        rows = torch.stack(everyone).tolist()
        alike = all(r == rows[0] or all(a == b or (a != a and b != b) for a, b in zip(r, rows[0])) for r in rows)
        if self.partition_group is None and not alike:
            raise ValueError("the ranks' optimizers hold different parameters (counts, sizes or values differ "
                             f"across the {len(rows)} ranks), so they are not DDP replicas: pass "
                             "partition_group=<the process group the parameters are split over> (ZeRO / OSS, a "
                             "hand-split model) so that the step's norms are summed over it; wrap replicas in "
                             "DistributedDataParallel (its initial broadcast makes them equal); ranks that train "
                             "models of their own pass a group of one rank, "
                             "partition_group=torch.distributed.new_subgroups(1)[0]")
        if self.partitioned and alike and len(rows) > 1 and rows[0][0] > 0:
            raise ValueError("partition_group is given, but every rank's optimizer holds the same parameters "
                             "(replicas, as under DDP): their norms would be counted once per rank; drop "
                             "partition_group for replicas")
        if self.partitioned and self.model_gathers and any(r[:2] != rows[0][:2] for r in rows):
            raise ValueError("PartitionGroup(model_gathers=True): the ranks' optimizers hold "
                             f"{[int(r[0]) for r in rows]} tensors of {[int(r[1]) for r in rows]} elements, so "
                             "they are not the equal-length shards of flat parameters that FSDP gives every "
                             "rank; for parameters split among the ranks' optimizers (ZeRO / OSS, a hand-split "
                             "model) drop model_gathers: the second pass must then send them to the other ranks")


#: Each parameter's bytes in an exchange's packed buffer start at a multiple of this, so
#: that a ``uint8`` slice views as any dtype (``Tensor.view(dtype)`` needs the alignment).
_ALIGN = 16
#: float64 slots at the end of the packed buffer for a step's partial sums (perturb()
#: sends at most 4: ||g||^2, <g, v_{t-1}>, ||d_t||^2, ||T v||^2).
_HEADER = 8


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class AscentExchange:
    """Under ``partition_group`` each rank's optimizer moves only its own parameters to
    ``x + eps``; the second forward needs every parameter there on every rank.

    Built once per model and set of owned parameters: the owners are found with one
    ``all_gather`` of who holds which of ``model.parameters()`` (the same list, in the
    same order, on every rank).  Every rank's parameters then have a place in one packed
    ``uint8`` buffer (their bytes, in model order, whatever their dtypes), so that one
    ``all_gather`` of it carries every rank's part:

    * :meth:`share`: the owners' parameters, already at ``x + eps`` (the first two-pass
      step, before this exchange was known to ``perturb()``, and a second pass given
      another model);
    * :meth:`gather`: from then on, ``perturb()``'s one collective: each rank's partial
      sums (float64, at the end of the buffer) and the ascent direction of its
      parameters (:meth:`directions`: ``v_t``, or ``T^2 v_t`` in adaptive geometry),
      from which every rank moves the other owners' parameters itself
      (:meth:`arrived`), so the step's sums and the ascent cost one wait.

    Either way the receivers keep their values at ``x`` to put back (:meth:`restore`),
    so that a dropped step leaves every rank at ``x``."""

    def __init__(self, model_params: List[torch.Tensor], owned: set, group):
        dist = torch.distributed
        self.group = group
        self.params = model_params
        # the model (the same on every rank) on one device: a decision every rank takes alike
        self.one_device = len({p.device for p in model_params}) <= 1
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        device = model_params[0].device if model_params else torch.device("cpu")
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        count = torch.tensor([len(model_params)], dtype=torch.int64, device=device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts, count, group=group)
        if len({int(c) for c in counts}) != 1:
            raise ValueError("partition_group: the model passed to second_pass()/step() has "
                             f"{[int(c) for c in counts]} parameters on the ranks: every rank must pass its "
                             "replica of the same model")
        mask = torch.tensor([id(p) in owned for p in model_params], dtype=torch.int64, device=device)
        masks = [torch.empty_like(mask) for _ in range(self.size)]
        dist.all_gather(masks, mask, group=group)
        table = torch.stack(masks).cpu()  # (ranks, parameters): once per model
        if bool((table.sum(0) > 1).any()):
            shared = int((table.sum(0) > 1).sum())
            raise ValueError(f"partition_group: {shared} parameters are held by the optimizers of several ranks; "
                             "under partition_group each parameter belongs to one rank's optimizer (drop "
                             "partition_group for replicas)")
        mine = set(int(i) for i in table[self.rank].nonzero().flatten())
        if len(mine) != len(owned):
            raise ValueError("partition_group: the optimizer holds parameters that are not in the model passed "
                             "to second_pass()/step()")
        holders = (table[:, j].nonzero().flatten() for j in range(len(model_params)))
        owners = [int(r[0]) if len(r) else -1 for r in holders]  # -1: optimized by no rank
        # each rank's parameters in model order: (model index, byte offset in its packed buffer)
        self.slots: List[List[Tuple[int, int]]] = [[] for _ in range(self.size)]
        ends = [0] * self.size
        for j, r in enumerate(owners):
            if r >= 0:
                self.slots[r].append((j, ends[r]))
                ends[r] = _aligned(ends[r] + model_params[j].numel() * model_params[j].element_size())
        self.header = max(ends)  # where the partial sums go
        self.saved: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
        self._index: Optional[tuple] = None  # (the step's parameter list, their byte offsets)
        self._received: Optional[List[torch.Tensor]] = None

    def _view(self, buffer: torch.Tensor, j: int, offset: int) -> torch.Tensor:
        p = self.params[j]
        return buffer[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)

    def _buffer(self) -> torch.Tensor:
        return torch.zeros(self.header + 8 * _HEADER, dtype=torch.uint8, device=self.device)

    def _all_gather(self, send: torch.Tensor) -> List[torch.Tensor]:
        received = [torch.empty_like(send) for _ in range(self.size)]
        torch.distributed.all_gather(received, send, group=self.group)
        return received

    def _save_others(self) -> List[Tuple[torch.Tensor, List[Tuple[int, int]]]]:
        """Keep the other owners' parameters at ``x`` (for :meth:`restore`) before they move."""
        others = [(r, s) for r, s in enumerate(self.slots) if r != self.rank and s]
        self.saved = [(self.params[j], self.params[j].detach().clone()) for _, s in others for j, _ in s]
        return others

    @torch.no_grad()
    def share(self) -> None:
        """Every rank receives the other owners' parameters (now at ``x + eps``)."""
        send = self._buffer()
        for j, offset in self.slots[self.rank]:
            self._view(send, j, offset).copy_(self.params[j].detach())
        received = self._all_gather(send)
        for r, slots in self._save_others():
            for j, offset in slots:
                self.params[j].detach().copy_(self._view(received[r], j, offset))

    def directions(self, params: List[torch.Tensor]) -> Tuple[torch.Tensor, Optional[List[torch.Tensor]]]:
        """A packed buffer for :meth:`gather` (zeros) and, in it, the place of each of this
        step's parameters ``params`` (this rank's, with a gradient), shaped as the
        parameter, for the caller to write its ascent direction into; the owned
        parameters without a gradient keep a zero direction (they do not move).  No
        places (None) when some parameter of ``params`` has none in this exchange (it
        joined the optimizer after the exchange was built): :meth:`gather` then tells
        every rank, and the step shares the parameters instead."""
        if self._index is None or self._index[0] is not params:
            where = {id(self.params[j]): (j, offset) for j, offset in self.slots[self.rank]}
            places = [where.get(id(q)) for q in params]
            self._index = (params, None if any(w is None for w in places) else places)
        places = self._index[1]
        send = self._buffer()
        return send, None if places is None else [self._view(send, j, offset) for j, offset in places]

    def gather(self, send: torch.Tensor, partial: torch.Tensor, complete: bool = True) -> torch.Tensor:
        """The one ``all_gather`` of a step: ``partial`` (this rank's partial sums) goes
        with the directions already in ``send``; returns the partial sums summed over the
        ranks in rank order (the same float64 values on every rank), and after them the
        number of ranks whose directions are not complete (``complete`` False: then no
        rank may move the others' parameters from them, :meth:`arrived`)."""
        k = partial.numel() + 1
        if k > _HEADER:
            raise RuntimeError(f"AscentExchange carries at most {_HEADER - 1} partial sums, got {k - 1}")
        header = send[self.header:self.header + 8 * k].view(torch.float64)
        header[:-1].copy_(partial.to(self.device, torch.float64))
        header[-1] = 0.0 if complete else 1.0
        self._received = received = self._all_gather(send)
        sums = torch.stack([r[self.header:self.header + 8 * k].view(torch.float64) for r in received]).sum(0)
        return sums.to(partial.device)

    def arrived(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """After :meth:`gather`: the other owners' parameters (their values at ``x``
        kept for :meth:`restore`) and the directions they sent, for the caller to move
        them as the owners moved theirs."""
        received, self._received = self._received, None
        params, directions = [], []
        for r, slots in self._save_others():
            for j, offset in slots:
                params.append(self.params[j].detach())
                directions.append(self._view(received[r], j, offset))
        return params, directions

    def release(self) -> None:
        """Drop what :meth:`gather` received when nothing moves from it (a non-finite
        ``g_t``, or directions some rank could not place)."""
        self._received = None

    @torch.no_grad()
    def restore(self) -> None:
        """Put the received parameters back at ``x`` (a no-op after it ran once)."""
        if self.saved:
            torch._foreach_copy_([p.detach() for p, _ in self.saved], [v for _, v in self.saved])
        self.saved = None


def exchange_for(cache: Dict[str, Any], model: torch.nn.Module, owned: List[torch.Tensor], group) -> AscentExchange:
    """The :class:`AscentExchange` for ``model`` and the owned parameters, rebuilt only
    when either changed (``cache`` is the optimizer's)."""
    model_params = list(model.parameters())
    key = (tuple(map(id, model_params)), frozenset(map(id, owned)))
    if cache.get("key") != key:
        cache["exchange"] = AscentExchange(model_params, set(map(id, owned)), group)
        cache["key"] = key
    return cache["exchange"]


def partition_roles(given, partition_group, adaptive: bool) -> Tuple[bool, bool, bool]:
    """What ``partition_group`` (``given``: as the user gave it) asks of a step, as
    ``(model_gathers, partitioned, exchanges)``: flat shards the model all-gathers itself (:class:`PartitionGroup`'s ``model_gathers``); split over
    several ranks (a group of one rank: this rank's parameters are its own); and the second pass
    sends each owner's parameters at ``x + eps`` to the other ranks."""
    gathers = isinstance(given, PartitionGroup) and given.model_gathers
    if gathers and adaptive:
        raise ValueError("adaptive=True with PartitionGroup(model_gathers=True): adaptive geometry scales "
                         "weight tensors and leaves biases alone, and a slice of a flat parameter vector no "
                         "longer tells them apart; use plain geometry (adaptive=False) there")
    partitioned = partition_group is not None and torch.distributed.get_world_size(partition_group) > 1
    return gathers, partitioned, partitioned and not gathers


# ---------------------------------------------------------------------- the exchange leg of a step


def exchange_sums(cache: Dict[str, Any], exchange: AscentExchange, params: List[torch.Tensor], sums, plan,
                  layout, fill) -> Tuple[Dict[str, float], Optional[AscentExchange]]:
    """``perturb()``'s one collective under ``partition_group``, once the model's exchange
    is known (built by an earlier second pass): the step's sums and every rank's ascent
    directions travel in one ``all_gather`` (``docs/design.md``, "Distributed steps").

    ``fill(directions)`` writes this rank's ascent directions into the places the
    exchange gives its parameters ``params`` (``v_t``, or ``T^2 v_t`` in adaptive
    geometry).  Returns the sums by name (floats: the one host read) and the exchange,
    or None where nothing may move from the directions: a non-finite ``g_t``, or a rank
    that could not place its own (its optimizer holds a parameter the exchange does
    not), in which case ``cache`` is cleared and every rank builds the exchange anew in
    ``second_pass()`` (collectively), which then shares the parameters."""
    send, directions = exchange.directions(params)
    if directions:
        fill(directions)
    gathered = exchange.gather(send, sums.local(plan, layout), directions is not None)
    floats = sums.finish(gathered).tolist()
    incomplete = floats.pop() > 0
    values = dict(zip(sums.names, floats))
    if incomplete or not math.isfinite(floats[0]):
        exchange.release()
        exchange = None
        if incomplete:
            cache.clear()
    return values, exchange


def move_others(exchange: AscentExchange, ascend_along) -> None:
    """Move the other owners' parameters to ``x + eps`` as they moved theirs, from the
    directions they sent (``ascend_along(params, directions)``); their ``x`` is kept for
    :meth:`AscentExchange.restore`."""
    others, directions = exchange.arrived()
    ascend_along(others, directions)
