"""The step decided on the host: the kernel of :meth:`plugins.SharpnessAware.perturb` and
:meth:`~plugins.SharpnessAware.descend` where a host read decides (``docs/design.md``, "Where
a step is decided"): ZeRO/OSS and hand splits, several devices.

Functions of the step record, its lists and the optimizer's buffer stores, never of the
optimizer.  :func:`first_pass_sums` is the step's one reduction and host read;
:func:`rule` the paper's rule (:func:`plugins.perturbation.rule_`) once ``g_t`` is known
finite; :func:`diagnose` the step's diagnostics; :func:`second_pass_sums` descend()'s one
read, or :func:`verdict_on_device` hands ``h_t``'s verdict to a fused base.  Every formula
is :mod:`plugins.perturbation`'s.  Torch only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import diagnostics, ondevice, reductions, scaling
from . import distributed as D
from . import perturbation as P
from .diagnostics import Deferred
from .inflight import Kind, StepInFlight, Store, copy_
from .reductions import Sums

__all__ = ["perturb", "move_others", "descend", "verdict_on_device", "first_pass_sums", "previous_inner", "rule",
           "diagnose", "second_pass_sums"]

_NAN = float("nan")


def perturb(step: StepInFlight, last: Optional[torch.Tensor], own: Store, scratch: Store,
            exchange_cache: Dict[str, Any]) -> Tuple[Optional[torch.Tensor], Dict[str, float]]:
    """``perturb()`` decided by one host read: the step's sums, then, where ``g_t`` is finite,
    the paper's rule and the diagnostics.  Sets ``step.kind``; returns the last applied ascent
    to keep (``last``: the one before) and the sums (the exchange's norm comes with them)."""
    # d_{t-1}; where the sums cross ranks, a step whose set of parameters with a gradient changed
    # (no slope list yet) takes each one's kept slope, and d_0 = g_0 for the new ones, so that its
    # sums ride along too, as every step's
    step.previous_slopes = step.lists.buffers.get("slope")
    if step.previous_slopes is None and step.two_pass and step.lists.layout.collective:
        step.previous_slopes = [g if d is None else d for g, d in zip(step.grads, step.lists.kept_slopes(own))]
    sums = first_pass_sums(step, last is not None, scratch, exchange_cache)
    if not math.isfinite(sums["grad"]):  # nothing has moved, d_{t-1} kept
        step.kind = Kind.NONFINITE
        return last, sums
    inner = previous_inner(step, last is not None, sums, own)  # before d_t is written
    rule(step, sums, own, scratch)  # eqs. (5a)-(5b): d_t, and x_t + eps_t
    # fp16/bf16 VASSO: <d_t, d_{t-1}> itself (maybe read with ||d_t||), not <g_t, d_{t-1}>
    of_slopes = "slope_dot_last" in sums
    inner = sums["slope_dot_last"] if of_slopes else inner
    if not step.two_pass:  # the coin skipped: the base will step with g_t
        step.kind = Kind.FIRST_GRADIENT
        return last, sums
    step.kind = Kind.PERTURBED
    last = diagnose(step, sums, inner, last, own, of_slopes=of_slopes)
    step.grads = None  # g_t lives on in the buffers: not held through the second pass
    return last, sums


def move_others(step: StepInFlight, sums: Dict[str, float]) -> None:
    """``partition_group``: move the other owners' parameters as they moved theirs, from the
    directions that came with the step's sums."""
    adaptive = step.knobs.adaptive
    norm = sums["scaled_slope"] if adaptive else step.slope_norm
    D.move_others(step.exchange, lambda others, directions: P.ascend_along_(
        others, directions, step.rho, norm, adaptive=adaptive))


def descend(step: StepInFlight, grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> bool:
    """``descend()``'s decision by one host read, for a step whose ``g_t`` was finite: whether
    the base may step, ``.grad`` then unscaled (``grad_scale``: the scale it still carries) and,
    after a second pass, GSAM-corrected.  ``found_inf``: a scaler's verdict on ``.grad``."""
    if step.kind is Kind.FIRST_GRADIENT:  # g_t, found finite by perturb(): nothing to decide again
        if grad_scale is not None:
            scaling.unscale(step.lists.local_grads(), grad_scale, in_place=True)
        return True
    second, firsts, plan = step.second_grads()
    if grad_scale is not None and second:
        scaling.unscale(second, grad_scale, in_place=True)
    finite, sums = second_pass_sums(step, second, firsts, plan, found_inf)
    if finite and "g_dot_h" in sums:  # GSAM: h_t - alpha g_t^perp
        step.gsam_correct(second, firsts, sums["h"], sums["g_dot_h"])
    return finite


def verdict_on_device(step: StepInFlight, base_optimizer: torch.optim.Optimizer) -> bool:
    """Whether a two-pass step perturb() decided here, under ``partition_group`` (ZeRO/OSS, a
    hand split), hands ``h_t``'s verdict to its base on the device (a fused base, the model on
    one device: :func:`plugins.device_step.descend`); if so the step is set up for it (``g_t``
    was found finite).  Every rank decides alike: the step's exchange, the one its second pass
    joined, describes the model, not this rank's part (a base's first step reads the verdict
    all the same: :func:`ondevice.base_step`)."""
    exchange = step.exchange
    if not (step.kind is Kind.PERTURBED and exchange is not None and exchange.one_device
            and ondevice.takes_found_inf(base_optimizer)):
        return False
    zero = step.lists.constants()[0]
    step.finite, step.found_inf = torch.ones((), dtype=torch.bool, device=zero.device), zero.clone()
    return True


def first_pass_sums(step: StepInFlight, has_last: bool, scratch: Store, exchange_cache: Dict[str, Any]
                    ) -> Dict[str, float]:
    """The step's one reduction and host read: ``grad`` ``||g_t||`` (finiteness, SAM's
    ``||v_t||``); ``grad_dot_last`` ``<g_t, v_last>`` for the scalar stability (SAM: g of the
    last ascent; VASSO: d_{t-1}), or in fp16/bf16 VASSO's ``slope_dot_last`` ``<d_t, d_{t-1}>``
    of ``d_t`` as rounded; ``slope`` VASSO's ``||d_t||`` from ``d_{t-1}`` and ``g_t``
    before ``d_t`` is written (the ascent's scale); where the sums cross ranks, adaptive
    geometry's ``||T v_t||`` (``scaled_slope``), which the ascent needs before the second
    pass.  A step the coin skips with a scaler reads only the finiteness of the scaled ``g_t``.
    ``has_last``: an ascent was applied before."""
    knobs, lists, grads, previous = step.knobs, step.lists, step.grads, step.previous_slopes
    theta, layout = knobs.theta, lists.layout
    sums = Sums().norm("grad", grads)
    vasso_norm = theta is not None and step.two_pass and previous is not None and lists.fuse_average_norm
    last_slopes = None
    if knobs.scalar_stability and step.two_pass and has_last and previous is not None:
        last_slopes = lists.buffers.get("slope")  # (kept slopes: zeros stand in for the new ones' d_{t-1})
        if last_slopes is None:
            last_slopes = [torch.zeros_like(g) if d is g else d for g, d in zip(grads, previous)]
        if theta is None or not lists.low_precision:
            sums.inner("grad_dot_last", grads, last_slopes)
        elif not vasso_norm:  # read with ||d_t|| after d_t is written (_slope_norm), against d_{t-1}
            # kept where x_t goes only later (_ascend)
            step.inner_against = lists.buffer(scratch, "anchor", step.params)
            copy_(step.inner_against, last_slopes)
    if vasso_norm and not lists.low_precision:
        sums.norm_of("slope", lambda d, g: P.moving_average(d, g, theta, in_place=False), previous, grads)
    elif vasso_norm:
        # fp16/bf16: d_t as rounded in its dtype (a float32 formula would agree only to their
        # rounding), computed before the reduction so that its norm rides along, into the
        # anchor buffers: they hold x_t only from after the slope buffers took d_t (g_t
        # finite) until the restore
        step.computed = _slope_ahead(step, lists.buffer(scratch, "anchor", step.params))
        sums.norm("slope", step.computed)
        if last_slopes is not None:  # <d_t, d_{t-1}> of d_t as rounded, as the device path takes it:
            # from <g_t, d_{t-1}> (moving_average_inner) it would miss d_t's rounding, which the
            # stability's cancellation magnifies (rho^2 / stability^2, about 100 times)
            sums.inner("slope_dot_last", step.computed, last_slopes)
    if knobs.adaptive and step.two_pass and layout.collective:
        ts = P.adaptive_scales(step.params, lists.mask, knobs.eta)
        if step.computed is not None or theta is None or previous is None:  # v_t is there already
            v = step.computed if step.computed is not None else grads  # (SAM's, and VASSO's d_0 = g_0)
            sums.norm_of("scaled_slope", _times, v, ts)
        else:
            sums.norm_of("scaled_slope", lambda d, g, t: _times(P.moving_average(d, g, theta, in_place=False), t),
                         previous, grads, ts)
    if step.exchange is not None:
        values, step.exchange = D.exchange_sums(exchange_cache, step.exchange, lists.params, sums, lists.plan,
                                                layout, functools.partial(_directions, step))
        return values
    if step.params or layout.collective:
        return sums.read(sums.reduce(lists.plan, layout=layout))
    return {"grad": 0.0}


def _slope_ahead(step: StepInFlight, into: List[torch.Tensor]) -> List[torch.Tensor]:
    """VASSO's ``d_t`` computed into scratch buffers before the step's sums (its norm rides
    along with them; under ``partition_group`` it is sent), from ``d_{t-1}``."""
    copy_(into, step.previous_slopes)
    P.rule_(into, step.grads, step.knobs.theta, lambda: None)  # eq. (5a) alone: the ascent waits for the sums
    return into


def _directions(step: StepInFlight, directions: List[torch.Tensor]) -> None:
    """This rank's ascent directions, for the exchange: ``v_t`` (VASSO's ``d_t`` computed
    ahead; SAM's ``g_t`` and VASSO's ``d_0 = g_0`` copied), times ``T^2`` in adaptive geometry."""
    knobs = step.knobs
    if step.computed is not None:
        copy_(directions, step.computed)
    elif knobs.theta is not None and step.previous_slopes is not None:
        _slope_ahead(step, directions)
        if not knobs.adaptive:  # d_t itself: the slope buffers take it once g_t is known finite
            step.computed = directions
    else:
        copy_(directions, step.grads)
    if knobs.adaptive:
        P.adaptive_direction_(directions, step.params, step.lists.mask, knobs.eta)


def _times(vs: List[torch.Tensor], ts: List[torch.Tensor]) -> List[torch.Tensor]:
    """``T v`` tensor by tensor, for the norm ``||T v_t||`` taken before the ascent."""
    return [v * t.to(v.dtype) for v, t in zip(vs, ts)]


def previous_inner(step: StepInFlight, has_last: bool, sums: Dict[str, float], own: Store):
    """``<g_t, v_last>`` for the scalar stability, from the sums or (a changed set of
    parameters with a gradient) from the kept slopes; None where not wanted, or where the
    sums take fp16/bf16 VASSO's ``<d_t, d_{t-1}>`` instead."""
    if not (step.knobs.scalar_stability and step.two_pass and has_last):
        return None
    if "grad_dot_last" in sums:
        return sums["grad_dot_last"]
    if "slope_dot_last" in sums or step.inner_against is not None:
        return None  # fp16/bf16 VASSO's <d_t, d_{t-1}>, with ||d_t||: perturb() takes it from the sums
    layout = step.lists.layout
    counted = range(len(step.grads)) if layout.counted is None else layout.counted
    kept = step.lists.kept_slopes(own)
    pairs = [(step.grads[i], kept[i]) for i in counted if kept[i] is not None]
    return reductions.dot([g for g, _ in pairs], [v for _, v in pairs], layout=layout.unfiltered())


def rule(step: StepInFlight, sums: Dict[str, float], own: Store, scratch: Store) -> None:
    """The paper's rule (:func:`plugins.perturbation.rule_`, eqs. (5a)-(5b)) once ``g_t`` is
    known finite: ``||d_t||`` came with the first pass's sums where it could
    (``sums["slope"]``); ``d_t`` is updated on the steps the coin skips too (Alg. 2)."""
    theta = step.knobs.theta
    if theta is None and not step.two_pass:
        return  # SAM's slope keeps the last ascent's g_t
    if step.loss_scale is not None and not step.two_pass:
        g = scaling.unscale(step.grads, step.loss_scale, in_place=False)  # .grad stays as the scaler left it
    else:
        g = step.grads
    slopes, targets, sources, theta, fresh = _slope_targets(step, g, own)
    ascend = functools.partial(_ascend, step, slopes, sums, scratch) if step.two_pass else None
    P.rule_(targets, sources, theta, lambda: _slope_norm(step, slopes, sums, fresh), ascend)


def _slope_targets(step: StepInFlight, grads: List[torch.Tensor], own: Store):
    """Where eq. (5a) writes: ``(slope buffers, the buffers written, what enters them, theta,
    fresh)``.  SAM's ``g_t`` and a ``d_t`` computed ahead of the sums are copied in (theta
    None); new buffers start at ``d_0 = g_0`` and only the kept ones (``fresh``, their
    indices) are averaged; else every buffer takes ``d_t`` from ``d_{t-1}``."""
    lists, theta = step.lists, step.knobs.theta
    slopes = lists.buffers.get("slope")
    if theta is None or step.computed is not None:
        slopes = lists.buffer(own, "slope", grads) if slopes is None else slopes
        return slopes, slopes, grads if theta is None else step.computed, None, None
    if slopes is None:
        fresh = [i for i, kept in enumerate(lists.kept_slopes(own)) if kept is not None]
        slopes = lists.buffer(own, "slope", grads)
        return slopes, [slopes[i] for i in fresh], [grads[i] for i in fresh], theta, fresh
    return slopes, slopes, grads, theta, None


def _slope_norm(step: StepInFlight, slopes: List[torch.Tensor], sums: Dict[str, float], fresh) -> float:
    """``||v_t||`` (NaN where no ascent is built): from the first pass's sums, or reduced now."""
    if step.knobs.theta is None:
        return sums["grad"]
    if not step.two_pass:
        return _NAN  # a skipped step needs no ||d_t||
    if "slope" in sums:
        return sums["slope"]
    if fresh == []:  # every d_0 = g_0, copied exactly (in g's dtype): ||d_0|| = ||g_0||
        return sums["grad"]
    lists = step.lists
    if step.inner_against is not None:  # fp16/bf16: <d_t, d_{t-1}> as first_pass_sums takes it
        after = Sums().norm("slope", slopes).inner("slope_dot_last", slopes, step.inner_against)
        sums.update(after.read(after.reduce(lists.plan, layout=lists.layout)))
        step.inner_against = None
        return sums["slope"]
    return float(reductions.global_norm(slopes, lists.plan, lists.layout))


def _ascend(step: StepInFlight, slopes: List[torch.Tensor], sums: Dict[str, float], scratch: Store,
            d_t_norm) -> None:
    """Eq. (5b) on the host path: ``x_t + eps_t`` in the step's geometry and layout."""
    knobs, lists = step.knobs, step.lists
    step.keep_for_descent(slopes, scratch)                  # x_t for an exact restore, g_t for GSAM
    norm = sums.get("scaled_slope") if knobs.adaptive else d_t_norm  # ||d_t|| (ASAM: ||T d_t||)
    step.eps, step.scale, tv_norm = P.ascend_(step.params, slopes, step.rho, norm, adaptive_mask=lists.mask,
                                              eta=knobs.eta, plan=lists.plan, layout=lists.layout)
    step.slopes, step.slope_norm, step.at_ascent = slopes, d_t_norm, True
    if knobs.adaptive and "scaled_slope" not in sums:
        sums["scaled_slope"] = tv_norm                      # ||T v_t||, reduced by the ascent
    P.moved_parameters()


def diagnose(step: StepInFlight, sums: Dict[str, float], inner_previous, last: Optional[torch.Tensor],
             own: Store, *, of_slopes: bool) -> Optional[torch.Tensor]:
    """The step's diagnostics (:mod:`plugins.diagnostics`): ``||eps_t||``, the estimated
    sharpness ``rho ||v_t||`` (``rho ||T v_t||``) and the stability ``||eps_t - eps_{t-1}||``
    from ``last``, the previous ascent.  Where the sums cross ranks, their own sums (adaptive
    ``||eps_t||``, the buffered stability's inner product) ride along with descend()'s
    reduction.  ``of_slopes``: ``inner_previous`` is ``<v_t, v_{t-1}>`` already, not ``<g_t,
    v_{t-1}>``.  Returns the ascent to keep as the next step's ``last``."""
    knobs, rho, diag = step.knobs, step.rho, step.diagnostics
    deferred = Deferred() if step.lists.layout.collective else None
    ascent_norm, sharpness = diagnostics.of_ascent(step, rho, knobs.adaptive, sums.get("scaled_slope"), deferred)
    diag.update(two_pass=1.0, ascent_norm=ascent_norm, sharpness=sharpness)
    applied = None
    if knobs.track_stability:
        kept = step.lists.buffer(own, "previous_ascent", step.grads, zeros=True) if knobs.buffered_stability else None
        diag["stability"] = diagnostics.stability(step, last, ascent_norm, theta=None if of_slopes else knobs.theta,
                                                  inner_previous=inner_previous, kept=kept, deferred=deferred)
        applied = _record_ascent(step, ascent_norm)
    if deferred:
        step.deferred = (deferred, diag, applied)
    return last if applied is None else applied


def _record_ascent(step: StepInFlight, ascent_norm) -> torch.Tensor:
    """The applied ascent as the optimizer keeps it (``[rho, ||v||]``, adaptive geometry's
    ``[rho, ||v||, ||eps||]``: float64, on the parameters' device, filled from the step's
    floats and 0-dim tensors)."""
    values = [step.rho, step.slope_norm] + ([ascent_norm] if step.knobs.adaptive else [])
    last = torch.empty(len(values), dtype=torch.float64, device=step.lists.layout.device)
    for i, value in enumerate(values):
        last[i:i + 1].fill_(value)
    return last


def second_pass_sums(step: StepInFlight, second, firsts, plan, found_inf):
    """descend()'s one host sync: is ``h_t`` finite (the scaler's verdict when it has one,
    else ``||h_t||``), with GSAM's ``||h_t||`` and ``<g_t, h_t>`` from the same read; where the
    sums cross ranks, the one ``all_reduce`` carries the scaler's verdict and the deferred
    diagnostics' sums too (the same on every rank).  Returns ``(finite, sums)``."""
    layout = step.lists.layout
    gsam = step.knobs.gsam_alpha > 0.0 and step.rho > 0.0 and (len(second) > 0 or layout.collective)  # rho 0: h == g
    sums = Sums().norm("h", second)
    if gsam:
        sums.inner("g_dot_h", firsts, second)
    if layout.collective:
        extra = {}
        if step.deferred:
            extra["deferred"] = step.deferred[0].sums()
        if found_inf is not None:
            extra["found_inf"] = found_inf
        values = sums.read(sums.reduce(plan, layout=layout, extra=extra))
        finite = values["found_inf"] == 0.0 if found_inf is not None else math.isfinite(values["h"])
        if step.deferred:
            deferred, diag, previous = step.deferred
            parts = values["deferred"]
            deferred.finish(parts if isinstance(parts, list) else [parts], diag, previous)
        return finite, values
    if found_inf is not None:
        verdict = found_inf.detach().reshape(1).double()
        if gsam:
            reduced = sums.reduce(plan)
            verdict = torch.cat([verdict.to(reduced.device), reduced])
        floats = verdict.tolist()
        return floats[0] == 0.0, dict(zip(sums.names, floats[1:])) if gsam else {}
    if second or layout.collective:
        values = sums.read(sums.reduce(plan, layout=layout))
    else:
        values = {"h": 0.0}
    return math.isfinite(values["h"]), values if gsam else {}
