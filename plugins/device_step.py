"""The step decided on the device: :meth:`plugins.SharpnessAware.perturb`'s and
:meth:`~plugins.SharpnessAware.descend`'s phases with no host read (``docs/design.md``,
"Where a step is decided").

:meth:`~plugins.SharpnessAware.perturb` hands a step here when :func:`decides` says its
configuration allows it; the rule is then :func:`rule`, the paper's rule as
:meth:`~plugins.SharpnessAware._rule` states it with its one decision (is ``g_t``
finite?) kept on the device, and :func:`descend` hands the base optimizer the verdict
as torch's ``found_inf``.  What these phases work with (the flat buffers, the base step
given a device verdict, the verdicts on their way to the host) is :mod:`plugins.ondevice`;
every formula is :mod:`plugins.perturbation`'s.  As torch's FSDP does with its runtime,
each phase is a function of the optimizer whose state it reads and writes.  Torch only.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import ondevice, scaling
from . import perturbation as P
from .inflight import Kind, StepInFlight, StepLists
from .reductions import Sums, long_dot, long_norm

__all__ = ["decides", "perturb", "rule", "descend"]

_NAN = float("nan")


def decides(opt, step: StepInFlight) -> bool:
    """Whether this step keeps its decisions on the device: one process or replicas, one
    device and dtype (float32/64), a GradScaler or none, and a slope buffer
    for every parameter already (the first step, which makes them, ``d_0 = g_0`` from a
    finite ``g_0``, reads on the host once), and the previous ascent too (made by the first
    two-pass step) where the stability keeps it (eVASSO, ASAM)."""
    if not (opt._decide_on_device and step.lists.on_device and opt.partition_group is None):
        return False
    dtype = step.lists.params[0].dtype
    if any(g.dtype is not dtype for g in step.grads):
        return False  # gradients of another dtype (fairscale FSDP's fp16 on fp32 shards): the host path casts
    flat = _flat_buffer(opt, step.lists, "slope")
    if flat is None:
        return False
    # the flat buffer's views, not the per-parameter buffers it replaced at its first step:
    # held here, those would stay alive through the second pass (one model's size at the peak)
    step.previous_slopes = flat.views
    return not buffered_stability(opt) or _flat_buffer(opt, step.lists, "previous_ascent") is not None


def buffered_stability(opt) -> bool:
    """eVASSO's and ASAM's stability: the coin's one-pass steps move ``d_t`` too, and ASAM's
    ascent depends on ``x_t``, so the previous ascent is not recoverable from the slope
    buffer and is kept in a buffer of its own (``previous_ascent``, one model's size, as on
    the host path)."""
    return opt.track_stability and not opt._scalar_stability()


#: the StepLists attribute of each buffer kept flat on the device path
_FLAT_ATTRIBUTES = {"slope": "flat_slope", "previous_ascent": "flat_previous_ascent"}


def _flat_buffer(opt, lists: StepLists, key: str) -> Optional[ondevice.Flat]:
    """The per-parameter buffers ``key`` as views of one flat tensor, so that a check, a
    selection or an inner product over all of them is one kernel: made once per set of
    parameters, from the buffers the first steps wrote (None while a parameter has none)."""
    attribute = _FLAT_ATTRIBUTES[key]
    if getattr(lists, attribute) is None:
        own = opt._own_state
        kept = [own[q].get(key) if q in own else None for q in lists.params]
        if any(v is None for v in kept):
            return None
        flat = ondevice.Flat(lists.params)
        torch._foreach_copy_(flat.views, kept)
        for q, v in zip(lists.params, flat.views):
            own[q][key] = v
        # a parameter left out of this set (no gradient now: a dropped layer, a frozen one) keeps
        # its buffer of its own: as a view it would keep an earlier flat buffer alive
        present = set(map(id, lists.params))
        for q, buffers in own.items():
            s = buffers.get(key)
            if id(q) not in present and torch.is_tensor(s) and s._base is not None:
                buffers[key] = s.clone(memory_format=torch.preserve_format)
        lists.buffers[key] = flat.views
        setattr(lists, attribute, flat)
        if lists.storage_params is None:
            lists.storage_params = ondevice.storage_views(lists.params)
    return getattr(lists, attribute)


def perturb(opt, step: StepInFlight) -> bool:
    """:meth:`~plugins.SharpnessAware.perturb` with no host read.  Returns the coin: True
    means run the second pass, even where ``g_t`` was not finite (nothing moved then, and
    :func:`descend` skips the base step on the device)."""
    finite, slope_norm, inner, ascent = rule(opt, step)
    step.finite = finite
    zero, one = step.lists.constants()[:2]
    step.found_inf = torch.where(finite, zero, one)  # the base's verdict; descend() adds h_t's
    if step.two_pass:
        _diagnose(opt, step, slope_norm, inner, ascent)
        step.kind = Kind.PERTURBED
        step.grads = None  # as perturb()'s: g_t is not held through the second pass
    else:
        step.kind = Kind.FIRST_GRADIENT
        step.diagnostics.later(("nonfinite",), lambda: (~finite).double().reshape(1))
    opt._pending = step
    return step.two_pass


def rule(opt, step: StepInFlight) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                                          Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """The paper's rule as :meth:`~plugins.SharpnessAware._rule` states it, with its one
    decision on the device: the slope buffer takes ``v_t`` in place, and where ``g_t`` was
    not finite one ``torch.where`` puts ``v_{t-1}`` back before anything uses it, so that
    ``d_t = d_{t-1}`` and the ascent's scale is 0.  Returns, on the device, ``g_t``'s
    finiteness, ``||v_t||``, the stability's inner product (``<v_t, v_{t-1}>``, or with the
    previous ascent ``eps_last``: ``<v_t, eps_last>``, ASAM's ``<eps_t / rho, eps_last>``)
    and ASAM's ``(||T v_t||, ||eps_t||)``."""
    lists, theta = step.lists, opt.theta
    v = lists.flat_slope                                # one flat tensor: a check or a where is one kernel
    if theta is None and not step.two_pass:             # SAM's slope keeps the last ascent's g: only check g_t
        return ondevice.total_norm(step.grads) < math.inf, None, None, None
    grads = step.grads
    if step.loss_scale is not None and not step.two_pass:  # .grad stays as the scaler left it
        grads = scaling.unscale(grads, step.loss_scale, in_place=False)
    with v.scratch() as (previous, pieces):             # v_{t-1}, for a non-finite g_t (freed on leaving)
        previous.copy_(v.flat)
        if theta is not None:
            P.moving_average(v.views, grads, theta, in_place=True)  # eq. (5a): d_t
        else:
            torch._foreach_copy_(v.views, step.grads)   # SAM: v_t = g_t
        slope_norm = long_norm(v.flat)                  # ||v_t||: finite iff g_t is (v_{t-1} is)
        finite = slope_norm < math.inf
        torch.where(finite, v.flat, previous, out=v.flat)  # a non-finite g_t leaves v_{t-1}
        if not step.two_pass:
            return finite, None, None, None
        inner = ascent = None
        if opt._scalar_stability():
            inner = long_dot(v.flat, previous)          # <v_t, v_{t-1}>, before v_{t-1}'s copy is used up
        opt._keep_for_descent(step, v.views)           # x_t for an exact restore (ASAM's), g_t for GSAM
        if opt.adaptive:  # into v_{t-1}'s copy (used up): T^2 v_t / ||T v_t||, 0 if not finite
            scaled_norm, unit = _adaptive_direction(opt, lists, v, previous, pieces, finite)
            ascent = (scaled_norm, long_norm(previous) * step.rho)  # (||T v_t||, ||eps_t||)
        else:
            unit = P.unit_scale(slope_norm)             # eq. (5b): eps_t = rho * v_t / ||v_t||, 0 if not finite
            # v_t * unit in one kernel over the flat buffer, into v_{t-1}'s copy (used up)
            torch.mul(v.flat, unit, out=previous)
        P.move_(lists.storage_params, pieces, step.rho)  # x_t + eps_t
        if buffered_stability(opt):  # eVASSO, ASAM: the previous ascent eps_last, kept flat
            kept = lists.flat_previous_ascent
            # the stability's inner product: ASAM's <eps_t / rho, eps_last>, else <v_t, eps_last>
            inner = long_dot(previous if opt.adaptive else v.flat, kept.flat)
            # eps_t = rho * that product is the next previous ascent, where g_t was finite
            torch.where(finite, previous.mul_(step.rho), kept.flat, out=kept.flat)
    step.slopes, step.scale, step.slope_norm, step.at_ascent = v.views, unit, slope_norm, True
    P.moved_parameters()
    return finite, slope_norm, inner, ascent


def _adaptive_direction(opt, lists: StepLists, v: ondevice.Flat, into: torch.Tensor, pieces, finite):
    """ASAM's ascent direction over the flat buffers (eq. (5b) in its geometry, ``eps_t = rho
    T^2 v_t / ||T v_t||``, ``T = |x_t| + eta`` on the weights and 1 elsewhere, as
    :func:`plugins.perturbation.ascent_direction` has it): ``into`` (of ``v``'s size, its
    ``pieces`` in the parameters' storage order) becomes ``T^2 v_t / ||T v_t||``, all zeros
    where ``g_t`` was not finite.  Returns ``||T v_t||`` and ``1 / ||T v_t||`` (0 then)."""
    torch._foreach_copy_(pieces, lists.storage_params)  # x_t, flat
    into.abs_().add_(opt.eta)                           # T, and 1 where the geometry is plain (biases, norms):
    plain = [piece for piece, weight in zip(pieces, lists.mask) if not weight]
    if plain:
        torch._foreach_zero_(plain)
        torch._foreach_add_(plain, 1.0)
    scaled = torch.mul(v.flat, into)                    # T v_t (a model-sized temporary, freed on return)
    scaled_norm = long_norm(scaled)
    unit = torch.where(finite, P.unit_scale(scaled_norm), 0.0)  # a non-finite g_t moves nothing
    into.mul_(scaled).mul_(unit)                        # T (T v_t) / ||T v_t||
    return scaled_norm, unit


def _diagnose(opt, step: StepInFlight, slope_norm: torch.Tensor, inner, ascent) -> None:
    """The step's diagnostics as :meth:`~plugins.SharpnessAware._diagnose` gives them,
    computed only when read (:meth:`plugins.diagnostics.Diagnostics.later`); the last
    applied ascent is kept on the device for the next step's stability
    (:meth:`~plugins.SharpnessAware._last_ascent`: ``[s, ||v||]``, ASAM's ``[rho, ||v||, ||eps||]``)."""
    rho, finite, unit = step.rho, step.finite, step.scale
    stability = opt.track_stability and inner is not None
    buffered = buffered_stability(opt)  # inner is <v_t, eps_last> (ASAM's <eps_t / rho, eps_last>), else <v_t, v_{t-1}>
    last = opt._last_ascent(unit) if opt.track_stability else None
    if opt.track_stability and ascent is not None:
        opt._last = torch.where(finite, torch.stack([torch.full_like(unit, rho), slope_norm.to(unit.dtype),
                                                     ascent[1].to(unit.dtype)]), last)
    elif opt.track_stability:  # s = rho / ||v||: the next step's previous ascent
        opt._last = torch.where(finite, torch.stack([unit * rho, slope_norm.to(unit.dtype)]), last)

    def compute() -> torch.Tensor:
        norm = slope_norm.double()
        nan = torch.full((), _NAN, dtype=torch.float64, device=norm.device)
        if ascent is not None:  # ASAM: ||eps_t|| and the sharpness rho ||T v_t||
            ascent_norm, sharpness = ascent[1].double(), P.estimated_sharpness(rho, ascent[0].double())
        else:
            ascent_norm, sharpness = P.plain_ascent_norm(rho, norm), P.estimated_sharpness(rho, norm)
        value = nan
        if stability:
            previous = last.double()  # [s, ||v||], ASAM's [rho, ||v||, ||eps||]
            last_norm = previous[2] if ascent is not None else previous[0] * previous[1]
            if buffered:  # ||eps_t - eps_last|| from <eps_t, eps_last>
                inner_ascents = (rho if ascent is not None else unit.double() * rho) * inner.double()
                value = P.distance_between_ascents(ascent_norm, last_norm, inner_ascents)
            else:
                value = P.plain_stability(unit.double() * rho, previous[0], inner.double(), ascent_norm, last_norm)
        taken = torch.stack([torch.ones_like(norm), ascent_norm, sharpness, value, torch.zeros_like(norm)])
        skipped = torch.stack([torch.zeros_like(norm), nan, nan, nan, torch.ones_like(norm)])
        return torch.where(finite, taken, skipped)
    step.diagnostics.later(("two_pass", "ascent_norm", "sharpness", "stability", "nonfinite"), compute)


def descend(opt, step: StepInFlight, grad_scale: Optional[torch.Tensor] = None,
            found_inf: Optional[torch.Tensor] = None) -> Optional[bool]:
    """:meth:`~plugins.SharpnessAware.descend`'s base step for a step decided on the device
    (parameters back at ``x_t`` already): the verdict on ``g_t`` and ``h_t`` goes to the
    base optimizer as torch's ``found_inf``; one host read where the base cannot take it
    (then returns whether it stepped; None where the device decided).  Under a scaler,
    ``found_inf`` is the scaler's verdict on ``.grad`` (``h_t``, or a one-pass step's
    ``g_t``: not checked again) and ``grad_scale`` the scale ``.grad`` still carries."""
    zero, one, two = step.lists.constants()
    verdict = step.found_inf  # g_t's, from perturb()
    if found_inf is not None:
        verdict = torch.maximum(verdict, torch.where(found_inf.to(verdict.device) > 0, one, zero))
    grads = [h for h in step.lists.local_grads(missing_ok=True) if h is not None]
    if grad_scale is not None and grads:  # unscaled exactly once
        scaling.unscale(grads, grad_scale, in_place=True)
    if step.kind is Kind.PERTURBED:
        if found_inf is None:
            ondevice.check_finite_(grads, verdict, one)  # h_t's too
        if opt.gsam_alpha > 0.0 and step.rho > 0.0 and grads:  # GSAM: h_t - alpha g_t^perp (rho 0: h == g)
            second, firsts, plan = opt._second_grads(step)
            h_norm, g_dot_h = Sums().norm("h", second).inner("g_dot_h", firsts, second).reduce(plan).unbind(0)
            opt._gsam_correct(step, second, firsts, h_norm, g_dot_h)
    code = torch.where(step.finite, verdict, two)  # 0 taken, 1 h_t (or the scaler's), 2 g_t
    read = ondevice.base_step(opt.base_optimizer, verdict, code,  # the code, where the host had to read it
                              stepped_before=step.lists.base_stepped)
    step.lists.base_stepped = step.lists.base_stepped or read == 0
    P.moved_parameters()
    if read is None:  # decided on the device: counted, and warned about, once the verdict arrives
        opt._verdicts.send(opt._step - 1, code, step.scaled)
        return None
    if read:
        opt._skip_nonfinite(ondevice.Verdicts.WHICH[read], step.scaled)
    return read == 0
