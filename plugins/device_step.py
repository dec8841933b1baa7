"""The step decided on the device: the kernel of :meth:`plugins.SharpnessAware.perturb`
and :meth:`~plugins.SharpnessAware.descend` with no host read (``docs/design.md``,
"Where a step is decided").

Functions of tensors, lists and numbers, as torch's optimizers' kernels are: never of the
optimizer, whose methods hand them the step's lists and knobs.  :func:`rule` is the
paper's rule (:func:`plugins.perturbation.rule_`) with its one decision (is ``g_t``
finite?) kept on the device; :func:`diagnose` the step's diagnostics, computed when read;
:func:`verdict_` the verdict on ``g_t`` and ``h_t`` that the base optimizer is handed as
torch's ``found_inf``.  What they work with (the flat buffers, the base step given a
device verdict, the verdicts on their way to the host) is :mod:`plugins.ondevice`; every
formula is :mod:`plugins.perturbation`'s.  Torch only.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from . import distributed as D
from . import ondevice, scaling
from . import perturbation as P
from .inflight import Kind, StepInFlight, StepLists, Store
from .reductions import Sums, long_dot, long_norm

__all__ = ["prepare", "perturb", "descend", "forget_slopes", "flat_buffer", "rule", "diagnose", "verdict_"]

_NAN = float("nan")
_FLAT_ATTRIBUTES = {"slope": "flat_slope", "previous_ascent": "flat_previous_ascent"}


def prepare(step: StepInFlight, own: Store) -> None:
    """The step's slopes as views of one flat buffer (:func:`flat_buffer`), and the previous
    ascent's where the stability keeps one.  A parameter without a slope yet (the first step,
    a layer that joins later) gets one, ``d_0 = g_0`` (:attr:`StepInFlight.new_slopes`)."""
    lists = step.lists
    new = () if lists.flat_slope is not None else tuple(
        i for i, kept in enumerate(lists.kept_slopes(own)) if kept is None)
    if len(new) == len(lists.params) and step.knobs.theta is None and not step.two_pass:
        return  # SAM keeps no slope before its first ascent: the rule only checks g_t's finiteness
    if step.knobs.buffered_stability and step.two_pass:
        flat_buffer(own, lists, "previous_ascent")
    flat = flat_buffer(own, lists, "slope")
    # the flat buffer's views, not the per-parameter buffers it replaced at its first step:
    # held here, those would stay alive through the second pass (one model's size at the peak)
    step.previous_slopes, step.new_slopes = flat.views, new


def perturb(step: StepInFlight, last: Optional[torch.Tensor], scratch: Store) -> Optional[torch.Tensor]:
    """``perturb()`` with no host read: :func:`rule`, then the diagnostics computed when read.
    Where ``g_t`` was not finite nothing moves, and :func:`descend` skips the base step on the
    device.  ``last``: the last applied ascent (None: none yet).  Returns the one to keep."""
    knobs = step.knobs
    if step.two_pass:
        step.keep_for_descent(step.lists.flat_slope.views, scratch)  # x_t for an exact restore, g_t for GSAM
    finite, slope_norm, inner, ascent = rule(step)
    step.finite = finite
    zero, one = step.lists.constants()[:2]
    step.found_inf = torch.where(finite, zero, one)  # the base's verdict; descend() adds h_t's
    if not step.two_pass:
        step.kind = Kind.FIRST_GRADIENT
        step.diagnostics.later(("nonfinite",), lambda: (~finite).double().reshape(1))
        return last
    step.kind = Kind.PERTURBED
    step.grads = None  # g_t is not held through the second pass
    if not knobs.track_stability:  # no ascent to keep
        diagnose(step, slope_norm, inner, ascent, None, buffered=knobs.buffered_stability)
        return last
    return diagnose(step, slope_norm, inner, ascent, _last_on(last, slope_norm, knobs.adaptive),
                    buffered=knobs.buffered_stability, previous=last is not None)


def _last_on(last: Optional[torch.Tensor], like: torch.Tensor, adaptive: bool) -> torch.Tensor:
    """The last applied ascent (``[rho, ||v||]``, adaptive geometry's ``[rho, ||v||, ||eps||]``;
    NaN: none yet) on ``like``'s device, in its dtype: made there (no tensor from host data,
    which would be a host sync on a GPU)."""
    if last is None:
        return torch.full((3 if adaptive else 2,), _NAN, dtype=like.dtype, device=like.device)
    return last.to(like.device, like.dtype)


def descend(step: StepInFlight, base_optimizer: torch.optim.Optimizer, grad_scale: Optional[torch.Tensor],
            found_inf: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[int]]:
    """``descend()``'s base step for a step decided on the device, or on the host under
    ``partition_group`` over a fused base (parameters back at ``x_t`` already): the verdict
    on ``g_t`` and ``h_t`` goes to the base optimizer as torch's ``found_inf``
    (:func:`verdict_`; GSAM's correction on the way).  Under a scaler,
    ``found_inf`` is the scaler's verdict on ``.grad`` and ``grad_scale`` the scale ``.grad``
    still carries.  Returns the verdict's code (0 taken, 1 ``h_t`` or the scaler's, 2 ``g_t``)
    and, where the host had to read it (a base that takes no ``found_inf``), its value."""
    lists = step.lists
    zero, one, two = lists.constants()
    layout = lists.layout
    grads = [h for h in lists.local_grads(missing_ok=True) if h is not None]
    # rho 0: h == g; a rank without gradients joins the ranks' sums all the same (partition_group)
    gsam = (step.kind is Kind.PERTURBED and step.knobs.gsam_alpha > 0.0 and step.rho > 0.0
            and bool(grads or layout.collective))
    # a step perturb() decided on the host, across ranks: its diagnostics' partial sums
    # (plugins.diagnostics.Deferred) ride along with the verdict's all_reduce
    deferred = step.deferred[0] if step.deferred else None
    verdict = verdict_(step.found_inf, found_inf, grads, grad_scale, one, zero,
                       check=step.kind is Kind.PERTURBED, layout=None if gsam or deferred else layout)
    parts = None
    if gsam:
        second, firsts, plan = step.second_grads()
        sums = Sums().norm("h", second).inner("g_dot_h", firsts, second)
        if layout.collective:  # the ranks' verdicts ride along with GSAM's sums: one all_reduce
            extra = {"verdict": verdict, **({"deferred": deferred.sums()} if deferred else {})}
            values = sums.reduce(plan, layout=layout, extra=extra)
            h_norm, g_dot_h, verdict, parts = values[0], values[1], torch.where(values[2] > 0, one, zero), values[3:]
        else:
            h_norm, g_dot_h = sums.reduce(plan).unbind(0)
        if second:
            step.gsam_correct(second, firsts, h_norm, g_dot_h)  # h_t - alpha g_t^perp
    elif deferred:
        values = layout.all_reduce(torch.cat([verdict.reshape(1).double(), deferred.sums()]))
        verdict, parts = torch.where(values[0] > 0, one, zero), values[1:]
    if deferred:
        deferred.finish(parts.unbind(0), *step.deferred[1:])
    code = torch.where(step.finite, verdict, two)
    read = ondevice.base_step(base_optimizer, verdict, code, stepped_before=lists.base_stepped and not step.fresh)
    lists.base_stepped = lists.base_stepped or read == 0
    if read is None:  # the diagnostics say so when read: h_t's verdict or the scaler's too, not only g_t's
        step.diagnostics.later(("nonfinite",), lambda: (code > 0).double().reshape(1))
    P.moved_parameters()
    return code, read


def forget_slopes(step: StepInFlight, own: Store) -> None:
    """Drop the slope buffers a step made from a non-finite ``g_0`` (zeros), so that the next
    step starts them at ``d_0 = g_0``; the kept ones move to the next flat buffer."""
    lists = step.lists
    for i in step.new_slopes:
        own[lists.params[i]].pop("slope", None)
    lists.buffers.pop("slope", None)
    lists.flat_slope = None


def flat_buffer(own: Store, lists: StepLists, key: str) -> ondevice.Flat:
    """The per-parameter buffers ``key`` as views of one flat tensor per dtype, so that a
    check, a selection or an inner product over all of them is one kernel per dtype: made once
    per set of parameters from the buffers earlier steps wrote, zeros where one has none yet."""
    attribute = _FLAT_ATTRIBUTES[key]
    if getattr(lists, attribute) is None:
        kept = [own[q].get(key) if q in own else None for q in lists.params]
        locals_ = lists.local_params()
        flat = ondevice.Flat(locals_, lists.layout.counted)
        if any(v is None for v in kept):
            torch._foreach_zero_(flat.flats)
        pairs = [(view, D.local(v)) for view, v in zip(flat.views, kept) if v is not None]
        if pairs:
            torch._foreach_copy_([view for view, _ in pairs], [v for _, v in pairs])
        for q, v in zip(lists.params, flat.views):
            own[q][key] = D.like(q, v)  # a DTensor parameter's state is a DTensor sharded as it is
        # a parameter left out of this set (no gradient now: a dropped layer, a frozen one) keeps
        # its buffer of its own: as a view it would keep an earlier flat buffer alive
        present = set(map(id, lists.params))
        for q, buffers in own.items():
            s = buffers.get(key)
            if id(q) not in present and torch.is_tensor(s) and D.local(s)._base is not None:
                buffers[key] = D.like(q, D.local(s).clone(memory_format=torch.preserve_format))
        lists.buffers[key] = flat.views
        setattr(lists, attribute, flat)
        if lists.storage_params is None:  # (in the flats' order, as their scratch's pieces)
            lists.storage_params = ondevice.storage_views([locals_[i] for i in flat.order])
    return getattr(lists, attribute)


def rule(step: StepInFlight) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                                     Optional[Tuple[torch.Tensor, torch.Tensor]]]:
    """The paper's rule (:func:`plugins.perturbation.rule_`) with its one decision on the
    device: the slope buffer takes ``v_t`` in place, and where ``g_t`` was not finite one
    ``torch.where`` puts ``v_{t-1}`` back before anything uses it, so that ``d_t = d_{t-1}``
    and the ascent's scale is 0.  Returns, on the device, ``g_t``'s finiteness, ``||v_t||``,
    the stability's inner product (``<v_t, v_{t-1}>``, or with the previous ascent
    ``eps_last``: ``<v_t, eps_last>``, ASAM's ``<eps_t / rho, eps_last>``) and ASAM's
    ``(||T v_t||, ||eps_t||)``.  The scalar stability comes from ``<v_t, v_{t-1}>``, the
    buffered one from the previous ascent kept flat (eVASSO, ASAM), which takes ``eps_t``
    here.  What the restore needs of ``x_t`` (``step.anchors``) is kept already."""
    knobs, lists = step.knobs, step.lists
    theta, adaptive, eta = knobs.theta, knobs.adaptive, knobs.eta
    scalar_stability, buffered_stability = knobs.scalar_stability, knobs.buffered_stability
    layout = lists.layout
    v = lists.flat_slope                                # one flat tensor per dtype: a check or a where is one kernel
    if theta is None and not step.two_pass:         # SAM's slope keeps the last ascent's g: only check g_t
        counted = step.grads if layout.counted is None else [step.grads[i] for i in layout.counted]
        return _total_norm(counted, layout) < math.inf, None, None, None
    grads = step.grads
    if step.loss_scale is not None and not step.two_pass:  # .grad stays as the scaler left it
        grads = scaling.unscale(grads, step.loss_scale, in_place=False)
    out = {"inner": None, "ascent": None}
    with v.scratch() as (previous, pieces):             # freed on leaving
        # v_t where g_t might not be finite, and v_{t-1} to fall back on: SAM copies g_t into the
        # scratch and keeps v_{t-1} in the slope buffer; VASSO averages in place, v_{t-1} copied out
        if theta is None:
            slopes, candidate, kept = v.shaped_scratch(), previous, v.flats
        else:
            slopes, candidate, kept = v.views, v.flats, previous
            torch._foreach_copy_(previous, v.flats)
            if step.new_slopes:                         # d_0 = g_0 (lerp of g_0 towards itself: exactly g_0)
                torch._foreach_copy_([v.views[i] for i in step.new_slopes], [grads[i] for i in step.new_slopes])

        def norm() -> torch.Tensor:                     # ||v_t||: finite iff g_t is (v_{t-1} is)
            if layout.collective:  # the ranks' parts: ||v_t|| and the stability's inner product in one all_reduce
                stability_with = None  # <v_t, .>'s partner (ASAM's is eps_t, known only after the ascent)
                if step.two_pass and scalar_stability:
                    stability_with = kept
                elif step.two_pass and buffered_stability and not adaptive:
                    stability_with = lists.flat_previous_ascent.flats
                summed = v.counting(candidate)  # (a tensor replicated on a mesh dimension: one rank's copy)
                slope_norm, out["inner"] = _global_sums(
                    [summed], summed, None if stability_with is None else v.counting(stability_with), layout,
                    v.flats)
            else:
                slope_norm = _norm(candidate)
                if theta is None and step.two_pass and scalar_stability:  # before the where below takes v_{t-1}
                    out["inner"] = _dot(candidate, kept)  # <v_t, v_{t-1}>
            out["finite"] = finite = slope_norm < math.inf
            for flat, new, old in zip(v.flats, candidate, kept):  # a non-finite g_t leaves v_{t-1}
                torch.where(finite, new, old, out=flat)
            return slope_norm

        def ascend(slope_norm: torch.Tensor) -> torch.Tensor:  # x_t + eps_t, through the scratch (used up)
            finite = out["finite"]
            if scalar_stability and out["inner"] is None:
                out["inner"] = _dot(v.flats, previous)  # VASSO's <v_t, v_{t-1}>, before its copy is used up
            if adaptive:  # T^2 v_t / ||T v_t||, 0 if not finite; with ||eps_t|| and ASAM's stability inner product
                last_ascent = lists.flat_previous_ascent.flats if buffered_stability else None
                scaled_norm, unit, unit_norm, out["inner"] = _adaptive_direction(eta, lists, v, previous, pieces,
                                                                                 finite, last_ascent)
                out["ascent"] = (scaled_norm, unit_norm * step.rho)  # (||T v_t||, ||eps_t||)
            else:  # v_t / ||v_t|| in one kernel per flat buffer, 0 if not finite; rho rides along below
                unit = P.ascent_scale(1.0, slope_norm)
                for flat, product in zip(v.flats, previous):
                    torch.mul(flat, unit, out=product)
            P.move_(lists.storage_params, pieces, step.rho)  # x_t + eps_t
            if buffered_stability:  # eVASSO, ASAM: the previous ascent eps_last, kept flat
                kept = lists.flat_previous_ascent
                if out["inner"] is None:  # <v_t, eps_last> (ASAM's <eps_t / rho, eps_last> came with its sums)
                    out["inner"] = _dot(v.flats, kept.flats)
                # eps_t = rho * that product is the next previous ascent, where g_t was finite
                for product, last in zip(previous, kept.flats):
                    torch.where(finite, product.mul_(step.rho), last, out=last)
            return unit

        slope_norm, unit = P.rule_(slopes, grads, theta, norm, ascend if step.two_pass else None)
    if not step.two_pass:
        return out["finite"], None, None, None
    step.slopes, step.scale, step.slope_norm, step.at_ascent = v.views, unit, slope_norm, True
    P.moved_parameters()
    return out["finite"], slope_norm, out["inner"], out["ascent"]


def _norm(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of flat tensors of several dtypes together (:func:`long_norm` of each), in
    the widest dtype of their norms (``torch.stack`` promotes; fp16/bf16's are float32)."""
    norms = [long_norm(t) for t in parts]
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def _dot(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_i <xs[i], ys[i]>`` over flat tensors of several dtypes (:func:`long_dot` of each),
    in the widest dtype of the dots, as :func:`_norm` takes their norms."""
    dots = [long_dot(x, y) for x, y in zip(xs, ys)]
    return dots[0] if len(dots) == 1 else torch.stack(dots).sum()


def _total_norm(tensors: Sequence[torch.Tensor], layout) -> torch.Tensor:
    """The 2-norm of a list of tensors over every rank's parts (0-dim, on the device)."""
    if not layout.collective:
        return ondevice.total_norm(tensors)
    norms = ondevice.norms(tensors)
    squares = torch.stack(norms).double().square().sum() if norms else torch.zeros(
        (), dtype=torch.float64, device=layout.device)
    return layout.all_reduce(squares).sqrt().float()


def _adaptive_direction(eta: float, lists: StepLists, v: ondevice.Flat, into: List[torch.Tensor], pieces, finite,
                        kept: Optional[List[torch.Tensor]]):
    """ASAM's ascent direction over the flat buffers (eq. (5b) in its geometry, ``eps_t = rho
    T^2 v_t / ||T v_t||``, ``T = |x_t| + eta`` on the weights and 1 elsewhere, as
    :func:`plugins.perturbation.ascent_direction` has it): ``into`` (of ``v``'s sizes, its
    ``pieces`` in the parameters' storage order) becomes ``T^2 v_t / ||T v_t||``, all zeros
    where ``g_t`` was not finite.  Returns ``||T v_t||``, ``1 / ||T v_t||`` (0 then),
    ``||eps_t|| / rho`` and ``<eps_t / rho, kept>`` (None without ``kept``, the previous
    ascent): each from the unnormalised ``T^2 v_t``, so that over ranks one ``all_reduce``
    carries all three sums."""
    torch._foreach_copy_(pieces, lists.storage_params)  # x_t, flat
    for t in into:
        P.adaptive_scale(t, eta, out=t)             # T, and 1 where the geometry is plain (biases, norms):
    plain = [piece for piece, i in zip(pieces, v.order) if not lists.mask[i]]
    if plain:
        torch._foreach_zero_(plain)
        torch._foreach_add_(plain, 1.0)
    scaled = torch._foreach_mul(v.flats, into)          # T v_t (a model-sized temporary, freed on return)
    torch._foreach_mul_(into, scaled)                   # T (T v_t)
    summed = v.counting(into)
    scaled_norm, direction_norm, inner = _global_sums([v.counting(scaled), summed], summed,
                                                      None if kept is None else v.counting(kept), lists.layout,
                                                      v.flats)
    unit = torch.where(finite, P.ascent_scale(1.0, scaled_norm), 0.0)  # a non-finite g_t moves nothing
    for t in into:
        t.mul_(unit)                                    # T^2 v_t / ||T v_t||
    return scaled_norm, unit, direction_norm * unit, None if inner is None else inner * unit


def _global_sums(norms_of: Sequence[Sequence[torch.Tensor]], x: Sequence[torch.Tensor],
                 y: Optional[Sequence[torch.Tensor]], layout, flats: Sequence[torch.Tensor]):
    """The norms of each of ``norms_of`` (flat tensors, one per dtype) and ``<x, y>`` (None
    without ``y``), over every rank's part where the layout is collective: this rank's squares
    and inner product, summed in float64 by one ``all_reduce`` on the device.  Returned in the
    dtype :func:`_norm` gives all of ``flats`` (every flat buffer, counted here or not), so that
    a rank that sums fewer dtypes (or none) scales its ascent in the same precision as the others."""
    dtype = P.scalar_dtype(flats)  # what _norm and _dot give all of them: the widest, fp16/bf16's float32
    if not x:  # a rank that sums none of its tensors (each is another rank's too): zeros
        zero = torch.zeros((), dtype=dtype, device=layout.device)
        norms, dot = [zero] * len(norms_of), None if y is None else zero
    else:
        norms, dot = [_norm(parts) for parts in norms_of], None if y is None else _dot(x, y)
    if not layout.collective:
        return (*norms, dot)
    terms = [n.double().square() for n in norms] + ([dot.double()] if dot is not None else [])
    summed = layout.all_reduce(torch.stack(terms))
    return (*(summed[i].sqrt().to(dtype) for i in range(len(norms))), summed[-1].to(dtype) if dot is not None else None)


def diagnose(step: StepInFlight, slope_norm: torch.Tensor, inner, ascent, last: Optional[torch.Tensor], *,
             buffered: bool, previous: bool = True) -> Optional[torch.Tensor]:
    """The step's diagnostics as the host path gives them, computed only when read
    (:meth:`plugins.diagnostics.Diagnostics.later`), from :func:`rule`'s results and ``last``,
    the last applied ascent (``[rho, ||v||]``, ASAM's ``[rho, ||v||, ||eps||]``,
    :func:`plugins.perturbation.last_ascent_norm`; None: the stability is not tracked).
    Returns the next one, on the device: this ascent where ``g_t`` was finite, else ``last``.
    ``buffered``: ``inner`` is ``<v_t, eps_last>`` (ASAM's ``<eps_t / rho, eps_last>``), else
    ``<v_t, v_{t-1}>``; ``previous`` False: ``last`` holds no ascent yet (NaN), the stability
    stays the host's NaN."""
    rho, finite, unit = step.rho, step.finite, step.scale
    stability = previous and last is not None and inner is not None
    if last is not None:
        values = [torch.full_like(slope_norm, rho), slope_norm] + ([ascent[1]] if ascent is not None else [])
        applied = torch.where(finite, torch.stack(values), last)
    else:
        applied = None

    def compute() -> torch.Tensor:
        norm = slope_norm.double()
        nan = torch.full((), _NAN, dtype=torch.float64, device=norm.device)
        if ascent is not None:  # ASAM: ||eps_t|| and the sharpness rho ||T v_t||
            ascent_norm, sharpness = ascent[1].double(), P.estimated_sharpness(rho, ascent[0].double())
        else:
            ascent_norm, sharpness = P.plain_ascent_norm(rho, norm), P.estimated_sharpness(rho, norm)
        value = nan
        if stability and buffered:  # <eps_t, eps_last> from the buffered previous ascent
            inner_ascents = (rho if ascent is not None else unit.double() * rho) * inner.double()
            value = P.stability(ascent_norm, last.double(), inner_ascents)
        elif stability:  # from the slope buffer's v_{t-1}
            value = P.stability(ascent_norm, last.double(), inner.double(), scale=unit.double() * rho)
        taken = [torch.ones_like(norm), ascent_norm, sharpness] + ([value] if stability else []) + [torch.zeros_like(norm)]
        skipped = [torch.zeros_like(norm), nan, nan] + ([nan] if stability else []) + [torch.ones_like(norm)]
        return torch.where(finite, torch.stack(taken), torch.stack(skipped))
    # without a previous ascent (the first step) the stability stays the host's NaN, so that a
    # logger skips it without reading the device
    keys = ("two_pass", "ascent_norm", "sharpness") + (("stability",) if stability else ()) + ("nonfinite",)
    step.diagnostics.later(keys, compute)
    return applied


def verdict_(found_inf_first: torch.Tensor, found_inf: Optional[torch.Tensor], grads: Sequence[torch.Tensor],
             grad_scale: Optional[torch.Tensor], one: torch.Tensor, zero: torch.Tensor, *,
             check: bool, layout=None) -> torch.Tensor:
    """The verdict on the step as torch's ``found_inf`` (0-dim float32 on the device, 1.0:
    skip), with no host read: ``g_t``'s (``found_inf_first``, from :func:`rule`), joined by a
    scaler's verdict ``found_inf`` on ``.grad`` (``h_t``, or a one-pass step's ``g_t``, not
    checked again) or, with ``check`` and no scaler, by ``h_t``'s finiteness (written into
    ``found_inf_first``).  ``grads`` are unscaled by ``grad_scale`` (the scale ``.grad`` still
    carries) here, exactly once.  ``layout``: where the parts are spread over ranks, the verdict
    is every rank's."""
    verdict = found_inf_first
    if found_inf is not None:
        verdict = torch.maximum(verdict, torch.where(found_inf.to(verdict.device) > 0, one, zero))
    if grad_scale is not None and grads:
        scaling.unscale(grads, grad_scale, in_place=True)
    if check and found_inf is None:
        ondevice.check_finite_(grads, verdict, one)  # h_t's too
    if layout is not None and layout.collective and (check or found_inf is not None):
        # every rank takes the step, or none: h_t's and a scaler's verdicts are this rank's (g_t's
        # came from the global norm), joined by one all_reduce
        verdict = torch.where(layout.all_reduce(verdict.clone()) > 0, one, zero)
    return verdict
