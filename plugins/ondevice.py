"""The step decided on the device: no host sync from the first backward to the base step.

A GPU runs ahead of the Python that feeds it; every read of a device value on the host
(``.item()``, ``float()``, ``if tensor:``) makes the host wait until the GPU has drained
its queue.  The step's decisions are therefore taken on the device where the
configuration allows it (:meth:`plugins.SharpnessAware._decides_on_device`,
``docs/design.md``, "Where a step is decided"): the finiteness of ``g_t`` and ``h_t`` is a 0-dim device
bool, a non-finite ``g_t`` is replaced by ``d_{t-1}`` (SAM: the kept slope) before it is
used, the ascent's scale is 0 then, and the base optimizer is handed the verdict as
torch's ``found_inf`` (fused Adam/AdamW/SGD skip on the device; any other base costs one
host read, in :func:`base_step`).  Under a ``GradScaler`` the scaler's own verdict on
``.grad`` joins it, and a first pass's overflow is carried into ``.grad`` for the scaler to
see (:func:`overflow_into_`).  Which of the two passes runs stays a host decision: the
coin is a pure function of ``(seed, step)``.

Here: the flat buffers such a step works on (:class:`Flat`), the base step given a
device verdict (:func:`base_step`), and the verdicts on their way to the host, so that
a skipped step is counted and warned about a step or so late instead of making the step
wait (:class:`Verdicts`).
The step's phases, the rule among them, are :mod:`plugins.device_step`.  Torch only.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from .reductions import LOW_PRECISION

__all__ = ["Flat", "storage_views", "dense", "flat_scratch_is_cheap", "norms", "total_norm", "check_finite_",
           "takes_found_inf", "base_step", "overflow_into_", "HostCopy", "Verdicts"]


def dense(t: torch.Tensor) -> bool:
    """``t``'s elements fill its storage span exactly (contiguous, channels_last, ...): a
    view of a flat buffer can then have ``t``'s shape and strides."""
    if t.is_contiguous():
        return True
    formats = [torch.channels_last] if t.dim() == 4 else [torch.channels_last_3d] if t.dim() == 5 else []
    return any(t.is_contiguous(memory_format=f) for f in formats)


class Flat:
    """Flat tensors, one per dtype of ``like``'s tensors (all on one device), and views of
    them with those tensors' shapes and strides (channels_last stays channels_last, so that
    ``torch._foreach_*`` over the views and the parameters keeps its fast path).  A reduction
    or a ``torch.where`` over the whole list is then one kernel per dtype, on :attr:`flats`,
    and so is a product of the list with a scalar: :meth:`scratch` hands out tensors of
    :attr:`flats`' sizes for such products, with 1-D views in storage order that line up
    with :func:`storage_views` of ``like``'s tensors taken in :attr:`order`.

    ``counted``: the indices of the tensors this rank adds to the step's sums (None: all;
    :attr:`plugins.distributed.Layout.counted`); the others get flats of their own, which
    :meth:`counting` leaves out."""

    __slots__ = ("flats", "views", "order", "sizes", "_counting", "_flat_of", "_scratch", "_pieces", "_shaped")

    def __init__(self, like: Sequence[torch.Tensor], counted: Optional[Sequence[int]] = None):
        counts = set(range(len(like)) if counted is None else counted)
        by_key: dict = {}
        for i, t in enumerate(like):
            by_key.setdefault((t.dtype, i in counts), []).append(i)
        self.order = [i for indices in by_key.values() for i in indices]  # the tensors, flat by flat
        self.sizes = [[like[i].numel() for i in indices] for indices in by_key.values()]  # per flat
        self.flats = [torch.empty(sum(sizes), dtype=dtype, device=like[0].device)
                      for (dtype, _), sizes in zip(by_key, self.sizes)]
        self._counting = [k for k, (_, summed) in enumerate(by_key) if summed]
        self._scratch: List[torch.Tensor] = []
        self._pieces: List[torch.Tensor] = []
        self._shaped: List[torch.Tensor] = []
        self._flat_of = [0] * len(like)
        self.views: List[torch.Tensor] = [like[0]] * len(like)
        for k, (flat, indices) in enumerate(zip(self.flats, by_key.values())):
            at = 0
            for i in indices:
                self._flat_of[i] = k
                t = like[i]
                self.views[i] = (flat.as_strided(t.shape, t.stride(), at) if not t.is_contiguous()
                                 else flat[at:at + t.numel()].view(t.shape))
                at += t.numel()

    def counting(self, parts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Those of ``parts`` (one per flat, in :attr:`flats`' order) that this rank sums."""
        return list(parts) if len(self._counting) == len(self.flats) else [parts[k] for k in self._counting]

    def shaped_scratch(self) -> List[torch.Tensor]:
        """Inside :meth:`scratch`: its tensors as views with ``like``'s shapes and strides, in
        ``like``'s order (as :attr:`views` are of :attr:`flats`), made once."""
        if not self._shaped:
            self._shaped = [self._scratch[k].as_strided(v.shape, v.stride(), v.storage_offset())
                            for k, v in zip(self._flat_of, self.views)]
        return self._shaped

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Tuple[List[torch.Tensor], List[torch.Tensor]]]:
        """Tensors of :attr:`flats`' sizes and their 1-D views in storage order (one per tensor
        of ``like``, in :attr:`order`), for the ``with`` block only: the views are made once (a
        view per tensor costs host time at every step, 66 us for 188 on this project's CPU, two
        sets per GPU step); each use allocates just the storage behind them (one block per
        dtype, which a GPU's caching allocator hands back) and frees it on leaving, as a tensor
        that goes out of scope would be."""
        device = self.flats[0].device
        if not self._scratch:
            self._scratch = [torch.empty_like(flat) for flat in self.flats]
            self._pieces = [piece for tensor, sizes in zip(self._scratch, self.sizes)
                            for piece in torch.split(tensor, sizes)]
        elif self._scratch[0].untyped_storage().nbytes():  # a nested use would free the outer's storage on leaving
            raise RuntimeError("Flat.scratch() is already in use")
        else:
            for tensor, flat in zip(self._scratch, self.flats):
                _resize(tensor.untyped_storage(), flat.numel() * flat.element_size(), device)
        storages = [tensor.untyped_storage() for tensor in self._scratch]
        try:
            yield self._scratch, self._pieces
        finally:
            for storage in storages:
                _resize(storage, 0, device)


def _resize(storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> None:
    """``storage.resize_(nbytes)`` on ``device``: some torch versions allocate (and, at 0,
    re-label the storage) on the current CUDA device, which need not be the storage's."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            storage.resize_(nbytes)
    else:
        storage.resize_(nbytes)


def storage_views(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each of ``tensors`` (dense: :func:`dense`) as a 1-D view of its elements in storage
    order, an alias that in-place ops write through; paired with :meth:`Flat.scratch`'s pieces, whose
    views follow the same order, a foreach op needs no views of ``tensors``' shapes."""
    return [t.as_strided((t.numel(),), (1,), t.storage_offset()) for t in tensors]


def flat_scratch_is_cheap(t: torch.Tensor) -> bool:
    """A scratch tensor of ``t``'s (a model's) size costs one allocation on ``t``'s device,
    where one per tensor costs as many: a GPU's caching allocator hands back a block of that
    size (the step freed one in perturb), and the host time of a foreach op's per-tensor
    outputs shows on a host-bound model (H100 trace: 0.7-1.0 ms for 161-188 products, an
    in-place foreach op over the same tensors 0.1 ms).  Not on the CPU, whose glibc maps a
    block above 32 MiB anew at every allocation (resnet18's restore: 20 ms against 8 ms)."""
    return t.device.type != "cpu"


def norms(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor's 2-norm (0-dim, on the device): in its dtype, fp16/bf16 in float32 (an fp16
    norm overflows at 65504 where every element is finite)."""
    tensors = list(tensors)
    if not any(t.dtype in LOW_PRECISION for t in tensors):
        return list(torch._foreach_norm(tensors))
    if all(t.dtype in LOW_PRECISION or t.dtype == torch.float32 for t in tensors):
        try:
            return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        except (TypeError, RuntimeError):  # torch < 2.4: no dtype
            pass
    return [torch.linalg.vector_norm(t, dtype=torch.float32 if t.dtype in LOW_PRECISION else None) for t in tensors]


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of a list of tensors as one 0-dim device tensor (no host read): not finite
    iff some element is not (or the sum of squares overflows, as the host path's norm)."""
    return torch.linalg.vector_norm(torch.stack(norms(tensors)))


def check_finite_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor, one: torch.Tensor) -> None:
    """``found_inf`` (0-dim float32) becomes 1 if any of ``tensors`` has a non-finite element
    (or a norm that overflows, as the host path's check of ``||h_t||``), and is left as it is
    otherwise.  Read-only: torch's one-kernel check (GradScaler's) runs on the tensors' norms,
    not on the tensors, whose every element it would rewrite (an unscale by 1) to learn one bit."""
    if not tensors:
        return
    each = norms(tensors)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(each, found_inf, one)
    except (NotImplementedError, RuntimeError):  # a torch without it for the device (the CPU's before 2.3)
        found_inf.copy_(torch.where(torch.stack(each).sum() < math.inf, found_inf, one))


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer skips its step on the device when handed ``found_inf`` (torch's
    protocol for ``GradScaler``: ``_step_supports_amp_scaling``, set by the fused Adam,
    AdamW, SGD and Adagrad)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def base_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, verdict: torch.Tensor, *,
              stepped_before: bool) -> Optional[int]:
    """The base optimizer's step, skipped where ``found_inf`` (a 0-dim float32 device tensor,
    1.0 or 0.0) is 1: on the device for an optimizer that takes torch's ``found_inf``
    (returns None: the host does not know), else after one host read of ``verdict`` (the
    step's code, :class:`Verdicts`), whose value it returns (0: it stepped).  A fused base
    makes its state on its first step before it looks at ``found_inf`` (fused SGD's momentum
    is an ``empty_like``): until it has ``stepped_before`` over these parameters, the host
    reads the verdict, so that a skipped first step leaves no uninitialised state behind."""
    if takes_found_inf(optimizer) and stepped_before:
        optimizer.found_inf = found_inf
        optimizer.grad_scale = None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
        return None
    code = int(verdict.item())  # the one host read of the step
    if code == 0:
        optimizer.step()
    return code


def overflow_into_(grads: Sequence[Optional[torch.Tensor]], finite: torch.Tensor) -> None:
    """Where ``finite`` (0-dim device bool: ``g_t`` was finite) is False, one element of the
    second pass's gradients becomes inf, so that a ``GradScaler``, whose own check sees only
    ``.grad``, sees the first pass's overflow too: it skips the step and backs its scale off,
    as on the host path, where ``.grad`` keeps the non-finite ``g_t``.  Where ``finite``, the
    element is selected back bit for bit: nothing changes."""
    first = next((h for h in grads if h is not None and h.numel()), None)
    if first is not None:
        element = first.as_strided((), (), first.storage_offset())  # an element of first, in any layout
        element.copy_(torch.where(finite, element, math.inf))


class HostCopy:
    """A verdict's slot in pinned host memory and the CUDA event that tells when the copy
    into it has landed; a slot is reused once its verdict has been read."""

    __slots__ = ("host", "event")

    def __init__(self, like: torch.Tensor):
        self.host = torch.empty((), dtype=like.dtype, pin_memory=True)
        self.event = torch.cuda.Event()

    def start(self, verdict: torch.Tensor) -> None:
        self.host.copy_(verdict, non_blocking=True)
        self.event.record(torch.cuda.current_stream(verdict.device))  # the copy's stream, whichever device is current

    def arrived(self) -> bool:
        return self.event.query()  # (a query does not wait)

    def wait(self) -> None:
        self.event.synchronize()


class Verdicts:
    """The device's verdicts on steps, on their way to the host without a wait: each is
    copied to pinned host memory without blocking (CUDA; :class:`HostCopy`, whose slots are
    reused) and looked at once it has arrived, at a later step or when someone asks
    (:meth:`arrived` with ``wait``).  On the CPU a verdict is there at once: its value is
    read directly, nothing waits.

    A verdict is a 0-dim float tensor: 0 the step was taken, 1 it was skipped for a
    non-finite second-pass gradient (or what a loss scaler found), 2 for a non-finite
    first-pass gradient.  A step under a loss scaler is counted but not warned about: an
    overflow is the scaler's routine signal to back its scale off."""

    __slots__ = ("_queue", "_free")

    WHICH = {1: "second-pass", 2: "first-pass"}

    def __init__(self):
        self._queue: List[tuple] = []  # (step, HostCopy or a CPU tensor, scaled)
        self._free: List[HostCopy] = []  # slots whose verdict has been read

    @staticmethod
    def travels(verdict: torch.Tensor) -> bool:
        """The verdict must be copied to the host (it lives on an accelerator)."""
        return verdict.device.type != "cpu"

    def send(self, step: int, verdict: torch.Tensor, scaled: bool = False) -> None:
        if self.travels(verdict):
            slot = self._free.pop() if self._free else HostCopy(verdict)
            slot.start(verdict)
        else:
            slot = verdict
        self._queue.append((step, slot, scaled))

    def arrived(self, *, wait: bool) -> List[tuple]:
        """``(step, which pass, scaled)`` of the skipped steps among the verdicts that have
        arrived, in order (all of them with ``wait``)."""
        skipped = []
        while self._queue:
            step, slot, scaled = self._queue[0]
            if isinstance(slot, HostCopy):
                if not slot.arrived():
                    if not wait:
                        break
                    slot.wait()
                code = int(slot.host.numpy())  # a host tensor: no device to wait for
                self._free.append(slot)
            else:
                code = int(slot.numpy())
            self._queue.pop(0)
            if code:
                skipped.append((step, self.WHICH[code], scaled))
        return skipped

    def __len__(self) -> int:
        return len(self._queue)

    def __reduce__(self):  # a copy starts empty: events and pinned slots do not copy (the owner waits first)
        return type(self), ()
