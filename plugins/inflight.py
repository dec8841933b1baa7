"""The step between ``perturb()`` and ``descend()``: a typed record, and the lists a step
works on.

:class:`StepInFlight` is what ``perturb()`` leaves for ``second_pass()``, ``restore()`` and
``descend()``; its :class:`Kind` says which of three ways the first half ended.
:class:`StepLists` is what a step needs about the parameters that have a gradient, built
once per set of such parameters.  Torch only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import distributed as D
from .diagnostics import Deferred, Diagnostics
from .ondevice import dense
from .perturbation import weight_mask
from .reductions import FLAT_BELOW, chunk_plan

__all__ = ["Kind", "StepInFlight", "StepLists"]

_EXACT_DTYPES = (torch.float32, torch.float64)


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
    lists: Optional["StepLists"] = None
    rho: float = 0.0
    # perturb()'s own: what its phases hand each other
    two_pass: bool = False                            # the coin R_t (and something to move)
    grads: Optional[List[torch.Tensor]] = None        # g_t, this rank's parts (until a second pass)
    loss_scale: Optional[torch.Tensor] = None         # the scaler's scale g_t carries (None: unscaled)
    previous_slopes: Optional[List[torch.Tensor]] = None  # d_{t-1} (d_0 = g_0 where none is kept yet)
    computed: Optional[List[torch.Tensor]] = None     # d_t computed before the sums (fp16/bf16, partition_group)
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
        self.mask = weight_mask(params, None if any(n is None for n in names) else names) if adaptive else None
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
        self.flat_slope = None  # the slope buffers as views of one flat tensor (plugins.ondevice.Flat)
        self.flat_previous_ascent = None  # likewise eVASSO's previous-ascent buffers, where its stability is tracked
        self.storage_params = None  # with it, the parameters as 1-D views in storage order (ondevice.storage_views)
        self._constants = None
        # the base optimizer has stepped over this set: a fused base's state exists (plugins.ondevice.base_step)
        self.base_stepped = False
        # a step may be decided on the device: one device and dtype, dense local parts, one process,
        # replicas, DTensors that every rank counts whole (FSDP2) or flat shards the model gathers
        # (the sums all-reduced on the device); SharpnessAware._decides_on_device adds what the
        # step's options allow
        split = ((layout.sharded and layout.every_rank_counts) or (layout.partitioned and layout.model_gathers)
                 if layout.collective else not layout.sharded)
        self.on_device = (bool(params) and split and len({(q.device, q.dtype) for q in locals_}) == 1
                          and all(map(dense, locals_)))
        # where the parameters' data lie: the flat buffer mirrors their strides and storage_params alias
        # their storage, so a parameter whose .data is replaced (module.to(memory_format=...)) must
        # not find these lists again (checked by the optimizer's cache)
        self.pointers = self.data_pointers() if self.on_device else None

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

    def local_grads(self, missing_ok: bool = False) -> List[Optional[torch.Tensor]]:
        if not self.layout.sharded:
            return [q.grad for q in self.params]
        return [None if q.grad is None and missing_ok else D.local(q.grad) for q in self.params]
