"""The step's diagnostics (``docs/diagnostics.md``): what they are, and their lazy reading.

A step records its values as floats or as 0-dim device tensors; :class:`Diagnostics`
turns the tensors into floats with one host sync when someone first reads one, so a
step whose diagnostics nobody reads pays nothing for them.  Where the sums cross ranks,
the diagnostics' own partial sums ride along with the next reduction of the step
(:class:`Deferred`), and the loss gap's mean over the ranks is an ``all_reduce`` the
mapping waits for when first read.  The formulas (stability, sharpness) are in
:mod:`plugins.perturbation`.  Torch only.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import distributed as D
from . import perturbation as P
from . import reductions

__all__ = ["Diagnostics", "empty", "Deferred", "loss_gap", "as_float", "of_ascent", "stability"]

_NAN = float("nan")
_LATER = object()  # a value Diagnostics.later() computes when read


def as_float(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


class Diagnostics(MutableMapping):
    """The last step's diagnostics (``docs/diagnostics.md``), read as floats.

    Values the step computed on the device stay 0-dim tensors until someone reads
    one; the first read turns them all into floats with one host sync (per device),
    so a step whose diagnostics nobody reads pays none for them.  ``dict(diag)``
    gives plain floats.  A new mapping is made for every step: keeping a reference
    keeps that step's values.
    """

    __slots__ = ("_values", "_works", "_later")

    def __init__(self, values: Optional[Dict[str, Any]] = None):
        self._values: Dict[str, Any] = dict(values or {})
        self._works: List[Any] = []
        self._later: List[tuple] = []  # (keys, function): values computed only when read

    def later(self, keys: Sequence[str], compute: Callable[[], torch.Tensor]) -> None:
        """``keys`` get the entries of the 1-D device tensor ``compute()`` returns, computed
        only when someone reads the diagnostics: a step decided on the device launches no
        kernel for diagnostics nobody reads (:mod:`plugins.ondevice`).  A key given again
        takes the later function's value; a value set directly after either wins."""
        for key in keys:
            self._values[key] = _LATER
        self._later.append((tuple(keys), compute))

    def _compute_later(self) -> None:
        later, self._later = self._later, []
        for keys, compute in reversed(later):  # a key given again later takes its later value
            self._values.update((k, v) for k, v in zip(keys, compute().unbind(0)) if self._values.get(k) is _LATER)

    def __getstate__(self):  # a copy or pickle holds values, not the functions that compute them
        self.wait()
        self._compute_later()
        return self._values

    def __setstate__(self, values) -> None:
        self._values, self._works, self._later = values, [], []

    def wait_for(self, work) -> None:
        """A collective (``async_op=True``) writing into one of the values: waited for
        before any value is read, so issuing it costs the step no wait of its own."""
        self._works.append(work)

    def wait(self) -> None:
        """Wait for the collectives still writing the values (no read of the values)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def __getitem__(self, key: str) -> float:
        value = self._values[key]
        if torch.is_tensor(value) or value is _LATER:
            self._read_all()
            value = self._values[key]
        return value

    def __setitem__(self, key: str, value) -> None:
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"

    def unread(self) -> Dict[str, Any]:
        """The values as they are, without a host sync: floats, and 0-dim device tensors
        nobody has read yet (for a host that logs them and reads them at its own log
        point, as fairseq's meters do).  Collectives still writing them are waited for."""
        self.wait()
        self._compute_later()
        return dict(self._values)

    def _read_all(self) -> None:
        self.wait()
        self._compute_later()
        lazy = [k for k, v in self._values.items() if torch.is_tensor(v)]
        for device in {self._values[k].device for k in lazy}:
            keys = [k for k in lazy if self._values[k].device == device]
            floats = torch.stack([self._values[k].detach().reshape(()).double() for k in keys]).tolist()
            self._values.update(zip(keys, floats))


def empty() -> Diagnostics:
    """A step's diagnostics before it computes any (NaN: not computed this step)."""
    return Diagnostics({"two_pass": 0.0, "ascent_norm": _NAN, "sharpness": _NAN, "stability": _NAN,
                        "loss_gap": _NAN, "nonfinite": 0.0, "rho": _NAN})


class Deferred:
    """Diagnostics whose partial sums cross ranks: each is reduced with the step's last
    reduction (``descend()``'s) instead of a collective of its own, then finished by its
    function from the summed value (a float after a host read, else a 0-dim device tensor,
    read with the other diagnostics).  Empty where the sums do not cross ranks."""

    __slots__ = ("parts", "finishers")

    def __init__(self):
        self.parts: List[torch.Tensor] = []
        self.finishers: List[Callable[[float, Diagnostics, Dict[str, Any]], None]] = []

    def add(self, partial: torch.Tensor, finish: Callable[[float, Diagnostics, Dict[str, Any]], None]) -> None:
        self.parts.append(partial)
        self.finishers.append(finish)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def sums(self) -> torch.Tensor:
        return torch.cat(self.parts)

    def finish(self, values: List[float], diag: Diagnostics, previous: Dict[str, Any]) -> None:
        for value, finish in zip(values, self.finishers):
            finish(value, diag, previous)


def loss_gap(first, second):
    """``f(x + eps) - f(x)``: a 0-dim float64 device tensor for tensor losses (the
    diagnostics read it lazily, so it costs no host sync of its own), else a float."""
    if torch.is_tensor(first) and torch.is_tensor(second) and first.numel() == 1 and second.numel() == 1:
        return second.detach().reshape(()).to(first.device, torch.float64) - first.detach().reshape(()).double()
    return as_float(second) - as_float(first)


def mean_over_ranks(diag: Diagnostics, key: str, value, group, device) -> None:
    """``diag[key] = value``, averaged over the ranks of ``group`` where there are several
    (each rank's loss is its batch slice's mean, as DDP's is, so the mean is the
    one-process value for equal slices), by an ``all_reduce`` the diagnostics wait for
    when first read."""
    size = D.ranks(group)
    if size == 1:
        diag[key] = value
        return
    value = (value.detach().clone() if torch.is_tensor(value)
             else torch.tensor(value, dtype=torch.float64)).to(device, torch.float64).reshape(())
    value.div_(size)
    diag[key] = value
    diag.wait_for(torch.distributed.all_reduce(value, group=group, async_op=True))


def root(value):
    """A norm from its globally summed square (clamped at 0 for rounding); a tensor for a
    tensor (no host read)."""
    return value.clamp(min=0.0).sqrt() if torch.is_tensor(value) else math.sqrt(max(value, 0.0))


# ---------------------------------------------------------------------- a step's diagnostics


def of_ascent(step, rho: float, adaptive: bool, scaled_slope_norm, deferred: Optional[Deferred]):
    """``(||eps_t||, estimated sharpness)`` of the ascent ``step`` (a
    :class:`plugins.inflight.StepInFlight`) just made: plain geometry's from scalars;
    adaptive geometry's ``||eps_t||`` a device tensor, or NaN until ``descend()``'s
    reduction where the sums cross ranks (``deferred``)."""
    if not adaptive:
        return P.plain_ascent_norm(rho, step.slope_norm), P.estimated_sharpness(rho, step.slope_norm)
    lists = step.lists
    sharpness = P.estimated_sharpness(rho, scaled_slope_norm)
    if deferred is None:
        return reductions.global_norm(step.eps, lists.plan, lists.layout), sharpness

    def finish(value, diag, last):
        diag["ascent_norm"] = norm = root(value)
        if last is not None:  # the step's record of its ascent (plugins.perturbation.last_ascent_norm)
            last[2:].fill_(norm)
    deferred.add(reductions.Sums().norm("eps", step.eps).local(lists.plan, lists.layout), finish)
    return _NAN, sharpness


def stability(step, last: Optional[torch.Tensor], ascent_norm, *, theta: Optional[float],
              inner_previous=None, kept: Optional[List[torch.Tensor]] = None, deferred: Optional[Deferred] = None):
    """``||eps_t - eps_{t-1}||`` (:func:`plugins.perturbation.stability`; NaN on the first
    ascent), ``last`` the optimizer's record of the last ascent.  ``kept`` None: from scalars,
    where the slope buffer still told ``<v_t, v_{t-1}>`` (``inner_previous`` is
    ``<g_t, v_{t-1}>``); else from ``kept``, the previous ascent, which then takes this
    one.  A 0-dim tensor (read lazily); where the sums cross ranks, finished by
    ``descend()``'s reduction (``deferred``)."""
    eps, scale = step.eps, step.scale
    if kept is None:
        if inner_previous is None or last is None:
            return _NAN
        if theta is not None:  # <d_t, d_{t-1}> from <g_t, d_{t-1}>
            inner_previous = P.moving_average_inner(theta, last[1], inner_previous)
        return P.stability(ascent_norm, last, inner_previous, scale=scale)
    lists = step.lists
    value = _NAN
    if last is not None:
        now = eps if eps is not None else step.slopes
        factor = 1.0 if eps is not None else scale
        if deferred is not None:  # the inner product reduced in descend()

            def finish(inner, diag, current):
                diag["stability"] = P.stability(P.last_ascent_norm(current), last, factor * inner)
            deferred.add(reductions.Sums().inner("now_dot_last", now, kept).local(lists.plan, lists.layout), finish)
        else:
            value = P.stability(ascent_norm, last, factor * reductions.dot(now, kept, lists.plan, lists.layout))
    if eps is not None:
        if kept:
            torch._foreach_copy_(kept, eps)
    elif kept:
        torch._foreach_copy_(kept, step.slopes)
        torch._foreach_mul_(kept, scale)
    return value


def record_loss_gap(diag: "Diagnostics", first, second, partition_group, device) -> None:
    """``diag["loss_gap"]``: in one process, from tensor losses, computed only when read; on
    several ranks the mean of the ranks' gaps, over ``partition_group`` or the default group
    (:func:`mean_over_ranks`)."""
    if torch.is_tensor(first) and torch.is_tensor(second) and D.ranks(partition_group) == 1:
        first, second = first.detach(), second.detach()
        diag.later(("loss_gap",), lambda: loss_gap(first, second).reshape(1))
        return
    mean_over_ranks(diag, "loss_gap", loss_gap(first, second), partition_group, device)
