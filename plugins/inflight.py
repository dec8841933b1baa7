"""The step between ``perturb()`` and ``descend()``: a typed record, and the lists a step
works on.

:class:`StepInFlight` is what ``perturb()`` leaves for ``second_pass()``, ``restore()`` and
``descend()``; its :class:`Kind` says which of three ways the first half ended.
:class:`StepLists` is what a step needs about the parameters that have a gradient, built
once per set of such parameters.  Torch only.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import distributed as D
from . import ondevice
from . import perturbation as P
from .diagnostics import Deferred, Diagnostics
from .reductions import FLAT_BELOW, chunk_plan

__all__ = ["Knobs", "Kind", "StepInFlight", "StepLists"]

_EXACT_DTYPES = (torch.float32, torch.float64)

# per-parameter buffers by name: the optimizer's persistent state, or its per-step scratch
Store = Dict[torch.Tensor, Dict[str, torch.Tensor]]


def copy_(destinations: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """``torch._foreach_copy_`` for lists that may be empty: under ``partition_group`` a
    rank whose parameters have no gradient yet (frozen, or not in the forward) takes part
    in the step's collectives with nothing of its own."""
    if destinations:
        torch._foreach_copy_(destinations, sources)


@dataclass(frozen=True)
class Knobs:
    """The family's choices as one step sees them (``docs/design.md``, "One step, equation by
    equation"): the kernels take these, never the optimizer."""

    theta: Optional[float]      # None: SAM's raw gradient; else VASSO's EMA weight
    adaptive: bool              # ASAM geometry, T = |x| + eta on weights
    eta: float
    gsam_alpha: float           # GSAM's correction (0: off)
    p: float                    # the second pass's probability (< 1: eSAM, eVASSO)
    track_stability: bool
    exact_restore: bool

    @property
    def scalar_stability(self) -> bool:
        """The stability from scalars alone: the previous ascent is recoverable from what the
        slope buffer holds before this step writes it."""
        return self.track_stability and not self.adaptive and (self.theta is None or self.p >= 1.0)

    @property
    def buffered_stability(self) -> bool:
        """eVASSO's and ASAM's stability: the coin's one-pass steps move ``d_t`` too, and ASAM's
        ascent depends on ``x_t``, so the previous ascent is kept in a buffer of its own
        (``previous_ascent``, one model's size)."""
        return self.track_stability and not self.scalar_stability

    def persistent_buffers(self) -> List[str]:
        """The per-parameter buffers kept from step to step."""
        return ["slope"] + (["previous_ascent"] if self.buffered_stability else [])


class Kind(enum.Enum):
    """How the first half of the step ended."""
    NONFINITE = "nonfinite"            # g_t not finite: nothing moved, descend() skips the base step
    FIRST_GRADIENT = "first_gradient"  # the coin skipped the second pass: the base steps with g_t
    PERTURBED = "perturbed"            # at x_t + eps_t: the second pass, then the base steps with h_t


@dataclass
class StepInFlight:
    """One step from ``perturb()`` to ``descend()`` (or ``abandon()``)."""

    kind: Kind
    scaled: bool                                      # g_t (and h_t) went through a GradScaler
    knobs: Optional[Knobs] = None
    lists: Optional["StepLists"] = None
    rho: float = 0.0
    # perturb()'s own: what its phases hand each other
    two_pass: bool = False                            # the coin R_t (and something to move)
    grads: Optional[List[torch.Tensor]] = None        # g_t, this rank's parts (until a second pass)
    loss_scale: Optional[torch.Tensor] = None         # the scaler's scale g_t carries (None: unscaled)
    previous_slopes: Optional[List[torch.Tensor]] = None  # d_{t-1} (d_0 = g_0 where none is kept yet)
    computed: Optional[List[torch.Tensor]] = None     # d_t computed before the sums (fp16/bf16, partition_group)
    # fp16/bf16 VASSO whose d_t is written before its norm is read: d_{t-1}, for <d_t, d_{t-1}>
    inner_against: Optional[List[torch.Tensor]] = None
    slope_norm: float = float("nan")                  # ||v_t||
    eps: Optional[List[torch.Tensor]] = None          # eps_t, materialized in adaptive geometry only
    diagnostics: Optional[Diagnostics] = None
    # the ascent, for restore(): x_t + s v_t (plain geometry) or x_t + eps_t, undone from the anchors
    params: Optional[List[torch.Tensor]] = None       # this rank's parts of the parameters that moved
    slopes: Optional[List[torch.Tensor]] = None       # v_t (SAM: g_t, VASSO: d_t)
    scale: Optional[float] = None                     # s = rho / ||v_t|| of plain geometry
    anchors: Optional[List[torch.Tensor]] = None      # x_t, kept for an exact restore
    first_grads: Optional[List[torch.Tensor]] = None  # g_t for GSAM's correction
    at_ascent: bool = False                           # the parameters are at x_t + eps_t now
    exchange: Optional[D.AscentExchange] = None       # partition_group: the other owners' parameters moved too
    second_pass: bool = False                         # second_pass(model) ran (partition_group needs it)
    first_loss: Any = None                            # for the loss gap of the explicit API
    deferred: Optional[Tuple[Deferred, Diagnostics, Dict[str, float]]] = None  # sums reduced by descend()
    kept_grads: Optional[Tuple[list, list]] = None    # first_step(): g_t of a step the coin skipped
    finite: Optional[torch.Tensor] = None             # decided on the device: g_t is finite (0-dim bool)
    found_inf: Optional[torch.Tensor] = None          # decided on the device: the base's verdict (0-dim float)
    new_slopes: Tuple[int, ...] = ()                  # decided on the device: the parameters whose slope starts now

    @property
    def fresh(self) -> bool:
        """The step makes slope buffers (``d_0 = g_0``): it reads its verdict, so that a
        non-finite ``g_0`` leaves none behind."""
        return bool(self.new_slopes)

    def restore(self) -> None:
        """Put the parameters back at ``x_t``; a no-op unless they sit at ``x_t + eps_t``."""
        if self.kind is not Kind.PERTURBED or not self.at_ascent:
            return
        flat = self.lists.flat_slope
        if self.finite is not None and self.anchors is None and ondevice.flat_scratch_is_cheap(flat.flats[0]):
            # decided on the device: the ascent's product again as perturb() made it, one kernel per
            # flat slope, taken back through the parameters' storage-order views by the same
            # subtraction as per tensor (bit for bit that restore)
            with flat.scratch() as (products, pieces):
                for slope, product in zip(flat.flats, products):
                    torch.mul(slope, self.scale, out=product)
                P.descend_from_ascent_(self.lists.storage_params, pieces, self.rho)
        else:  # per tensor (on the CPU one flat product would be a block glibc maps anew every step)
            P.descend_from_ascent_(self.params, self.slopes, self.scale, self.anchors,
                                   rho=self.rho if torch.is_tensor(self.scale) else 1.0)
        if self.exchange is not None:  # partition_group: the other owners' parameters too
            self.exchange.restore()
        self.at_ascent = False
        P.moved_parameters()

    def join(self, exchange: D.AscentExchange) -> None:
        """``partition_group``: the second pass runs with ``exchange``, the model's, which holds
        the other owners' parameters at ``x + eps`` (shared now where perturb() did not move
        them for this model)."""
        if self.exchange is not exchange:
            if self.exchange is not None:
                self.exchange.restore()
            self.exchange = exchange
            exchange.share()
        self.second_pass = True

    def keep_for_descent(self, slopes: List[torch.Tensor], scratch: Store) -> None:
        """What the second half needs of ``x_t``: ``g_t`` for GSAM's correction (SAM's slope
        buffer holds it; V+G copies it, d_t does not keep it), and ``x_t`` itself where the
        restore copies it back (exact restore, adaptive geometry, fp16/bf16)."""
        knobs, lists = self.knobs, self.lists
        if knobs.gsam_alpha > 0.0:
            if knobs.theta is not None:
                self.first_grads = lists.buffer(scratch, "first_grad", self.grads)
                copy_(self.first_grads, self.grads)
            else:
                self.first_grads = slopes
        if knobs.exact_restore or knobs.adaptive or lists.low_precision:
            self.anchors = lists.buffer(scratch, "anchor", self.params)
            copy_(self.anchors, self.params)

    def second_grads(self):
        """``h_t`` (this rank's parts), GSAM's ``g_t`` beside it and the reduction plan: a
        parameter that got no gradient in the second pass counts for nothing."""
        layout = self.lists.layout
        second, firsts, plan = self.lists.local_grads(missing_ok=True), self.first_grads, self.lists.plan
        if any(h is None for h in second):
            if layout.counted is not None:  # keep the indices: zeros count for nothing
                second = [torch.zeros_like(q) if h is None else h for q, h in zip(self.params, second)]
            else:
                keep = [i for i, h in enumerate(second) if h is not None]
                second = [second[i] for i in keep]
                firsts = None if firsts is None else [firsts[i] for i in keep]
                plan = None
        return second, firsts, plan

    def gsam_correct(self, second, firsts, h_norm, g_dot_h) -> None:
        """GSAM's ``h_t - alpha g_t^perp`` on the gradients the second pass made, from the
        reduced ``||h_t||`` and ``<g_t, h_t>`` (floats, or device tensors on the device path)."""
        present = [i for i, h in enumerate(self.lists.local_grads(missing_ok=True)) if h is not None]
        if len(present) < len(second):  # zeros stood in for the missing h: correct the others
            second, firsts = [second[i] for i in present], [firsts[i] for i in present]
        P.gsam_correct(second, firsts, self.knobs.gsam_alpha, h_norm=h_norm, g_dot_h=g_dot_h)


class StepLists:
    """What a step needs about the parameters that have a gradient, built once per
    set of such parameters: the reduction plan, the adaptive mask, whether any is
    fp16/bf16, and the per-parameter buffer lists (filled on first use)."""

    __slots__ = ("params", "names", "layout", "plan", "mask", "low_precision", "fuse_average_norm",
                 "buffers", "flat_slope", "flat_previous_ascent", "storage_params", "on_device", "pointers",
                 "base_stepped", "_constants")

    def __init__(self, params: List[torch.Tensor], names: List[Optional[str]], adaptive: bool, layout: D.Layout):
        self.params = params
        self.names = names
        self.layout = layout
        locals_ = self.local_params()
        counted = locals_ if layout.counted is None else [locals_[i] for i in layout.counted]
        self.plan = chunk_plan(counted)  # over this rank's local parts (uneven shards too)
        self.mask = P.weight_mask(params, None if any(n is None for n in names) else names) if adaptive else None
        self.low_precision = any(q.dtype not in _EXACT_DTYPES for q in params)
        # VASSO's ||d_t|| from the first reduction saves a host sync but costs a pass that
        # writes d_t's size: worth it on accelerators, and on the CPU (where a "sync"
        # costs nothing) only when every tensor is copied into a flat chunk anyway.
        # (fp16/bf16, whose d_t is rounded to their precision by the update: the norm of
        # d_t computed before the reduction.)  Where the sums cross ranks, a separate norm
        # would cost a collective too: always fuse there (decided from the global sizes,
        # so every rank reduces the same terms).
        all_flat = all(q.numel() < FLAT_BELOW for q in params)
        on_cpu = all(q.device.type == "cpu" for q in params)
        self.fuse_average_norm = all_flat or not on_cpu or layout.collective
        self.buffers: Dict[str, List[torch.Tensor]] = {}
        self.flat_slope = None  # the slope buffers as views of one flat tensor per dtype (plugins.ondevice.Flat)
        self.flat_previous_ascent = None  # likewise eVASSO's previous-ascent buffers, where its stability is tracked
        self.storage_params = None  # with it, the parameters as 1-D views in storage order (ondevice.storage_views)
        self._constants = None
        # the base optimizer has stepped over this set: a fused base's state exists (plugins.ondevice.base_step)
        self.base_stepped = False
        # a step may be decided on the device: one device, dense local parts, one process,
        # replicas, DTensors on one mesh (FSDP2, HSDP, tensor parallelism beside them) or flat
        # shards the model gathers (the sums all-reduced on the device);
        # SharpnessAware._decides_on_device adds what the step's options allow
        split = (layout.sharded or (layout.partitioned and layout.model_gathers)
                 if layout.collective else not layout.sharded)
        self.on_device = (bool(params) and split and len({q.device for q in locals_}) == 1
                          and all(map(ondevice.dense, locals_)))
        # where the parameters' data lie: the flat buffer mirrors their strides and storage_params alias
        # their storage, so a parameter whose .data is replaced (module.to(memory_format=...)) must
        # not find these lists again (checked by the optimizer's cache)
        self.pointers = self.data_pointers() if self.on_device else None

    @classmethod
    def of(cls, groups, cached: Optional["StepLists"], partition_group, model_gathers: bool,
           adaptive: bool) -> "StepLists":
        """The lists of the parameters in ``groups`` that have a gradient: ``cached`` while that
        set is unchanged (one list comprehension per step on a hit) and, for the device path,
        while their data stay where they were (:attr:`pointers`)."""
        params = [q for group in groups for q in group["params"] if q.grad is not None]
        if cached is not None and len(cached.params) == len(params) and all(
                map(operator.is_, cached.params, params)) and (
                cached.pointers is None or cached.pointers == cached.data_pointers()):
            return cached
        names: List[Optional[str]] = []
        for group in groups:
            group_names = group.get("param_names")
            for i, q in enumerate(group["params"]):
                if q.grad is not None:
                    if q.grad.is_sparse:
                        raise RuntimeError("sharpness-aware optimizers do not support sparse gradients")
                    names.append(group_names[i] if group_names is not None else None)
        return cls(params, names, adaptive, D.Layout(params, partition_group, model_gathers=model_gathers))

    def data_pointers(self) -> List[int]:
        """Where the parameters' local parts lie now (compared with :attr:`pointers`)."""
        return [t.data_ptr() for t in self.local_params()] if self.layout.sharded else list(
            map(torch.Tensor.data_ptr, self.params))

    def constants(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """0.0, 1.0 and 2.0 as 0-dim float32 tensors on the parameters' device, made once:
        the verdicts of a step decided on the device select among them."""
        if self._constants is None:
            self._constants = tuple(torch.full((), v, dtype=torch.float32, device=self.layout.device)
                                    for v in (0.0, 1.0, 2.0))
        return self._constants

    def local_params(self) -> List[torch.Tensor]:
        """This rank's parts of the parameters (the parameters themselves unless DTensors)."""
        return [D.local(q) for q in self.params] if self.layout.sharded else self.params

    def buffer(self, store: Store, key: str, like: List[torch.Tensor], *, zeros: bool = False) -> List[torch.Tensor]:
        """Per-parameter buffers named ``key`` in ``store``, allocated on first use as copies
        of ``like`` (or zeros of its shape): DTensors for DTensor parameters, so that the
        state is sharded as they are.  Returns this rank's local parts, cached for the step's
        set of parameters."""
        out = self.buffers.get(key)
        if out is not None:
            return out
        out = []
        for q, src in zip(self.params, like):
            buf = store[q].get(key)
            if buf is None:
                src = src.detach()
                if D.is_dtensor(q):  # a DTensor sharded as q, its local part from src
                    buf = torch.empty_like(q.detach(), dtype=src.dtype)
                    D.local(buf).zero_() if zeros else D.local(buf).copy_(src)
                else:
                    buf = torch.zeros_like(src) if zeros else src.clone(memory_format=torch.preserve_format)
                store[q][key] = buf
            out.append(D.local(buf))
        self.buffers[key] = out
        return out

    def kept_slopes(self, own: Store) -> List[Optional[torch.Tensor]]:
        """Each parameter's slope buffer (its local part), None where it has none yet: for a
        step whose set of parameters with a gradient changed."""
        return [D.local(own[q]["slope"]) if "slope" in own.get(q, ()) else None for q in self.params]

    def local_grads(self, missing_ok: bool = False) -> List[Optional[torch.Tensor]]:
        if not self.layout.sharded:
            return [q.grad for q in self.params]
        return [None if q.grad is None and missing_ok else D.local(q.grad) for q in self.params]
