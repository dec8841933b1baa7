"""The math of one sharpness-aware step, as small functions over lists of tensors.

Every formula of the step (``docs/design.md``, "One step, equation by equation") is written here once: the
moving average ``d_t`` (:func:`moving_average`, the one writer of its values), the ascent
and its undo (:func:`ascend_`, :func:`descend_from_ascent_`), ASAM's ``T``
(:func:`adaptive_scale`), GSAM's correction, the rho schedule, the coin, the stability
and the estimated sharpness.  :mod:`plugins.optimizer` keeps state and calls them in
order; the sums they need come from :mod:`plugins.reductions`.  Torch only.

Notation (the paper's eq. (3) for SAM, eq. (5a)-(5b) for VASSO, Alg. 1-2): ``g`` the
first-pass gradient at ``x``, ``v`` the slope (``g`` for SAM, the moving average ``d``
for VASSO), ``eps`` the ascent, ``h`` the second-pass gradient at ``x + eps``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .reductions import LOW_PRECISION, Sums, global_norm

Tensors = Sequence[torch.Tensor]

_MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------- slope


def moving_average(averages: Tensors, grads: Tensors, theta: float, *, in_place: bool) -> List[torch.Tensor]:
    """VASSO's slope, the paper's eq. (5a): ``d_t = (1 - theta) d_{t-1} + theta g_t``, over
    lists: ``averages`` hold ``d_{t-1}``.  ``in_place``: written into them (the one place
    the values of ``d_t`` are written, whichever buffer then holds them); else returned
    as new tensors (a norm of ``d_t`` taken before ``d_t`` is written)."""
    weight = theta  # of the new gradient g_t
    if in_place:
        if len(averages):
            # gradients of another dtype (fp16 on fp32 shards): lerp takes one dtype
            ends = [g if g.dtype == d.dtype else g.to(d.dtype) for d, g in zip(averages, grads)]
            torch._foreach_lerp_(list(averages), ends, weight)
        return list(averages)
    # tensor by tensor, as the norm of d_t has always been taken (a fused kernel might round otherwise)
    return [torch.lerp(d, g.to(d.dtype), weight) for d, g in zip(averages, grads)]


def moving_average_inner(theta: float, previous_norm, grad_dot_previous):
    """``<d_t, d_{t-1}>`` from scalars: ``(1 - theta) ||d_{t-1}||^2 + theta <g_t, d_{t-1}>``."""
    return (1.0 - theta) * previous_norm * previous_norm + theta * grad_dot_previous


def rule_(slopes: Tensors, grads: Tensors, theta: Optional[float], norm: Callable[[], Any],
          ascend: Optional[Callable[[Any], Any]] = None) -> Tuple[Any, Any]:
    r"""The paper's rule (Li and Giannakis, "Enhancing Sharpness-Aware Optimization Through Variance
    Suppression", NeurIPS 2023, the README's citation: Alg. 1; Alg. 2 for ``p < 1``)::

        d_t   = (1 - theta) d_{t-1} + theta g_t     eq. (5a)  (SAM, eq. (3): v_t = g_t)
        eps_t = rho d_t / ||d_t||                   eq. (5b)  (:func:`ascent_scale`; ASAM: rho T^2 v_t / ||T v_t||)
        x_t  <- x_t + eps_t                         where the coin R_t = 1 (Alg. 2, line 6)

    ``slopes`` hold ``d_{t-1}`` and take ``d_t`` in place (:func:`moving_average`, the one
    writer of its values); ``theta`` None copies ``grads`` in (SAM's ``g_t``, or a ``d_t``
    computed ahead).  ``norm()`` gives ``||v_t||`` as the caller reduces it (where it may
    decide on ``g_t``'s finiteness); ``ascend(||v_t||)`` moves ``x_t`` by ``eps_t`` in the
    caller's geometry and layout.  ``ascend`` None: the coin skipped the second pass, and
    ``d_t`` is updated all the same (Alg. 2, line 5).  Returns ``(||v_t||, ascend's result)``.
    """
    if theta is None:
        if len(slopes):
            torch._foreach_copy_(list(slopes), list(grads))
    else:
        moving_average(slopes, grads, theta, in_place=True)           # eq. (5a)
    slope_norm = norm()                                                 # ||v_t||
    return slope_norm, None if ascend is None else ascend(slope_norm)   # eq. (5b): x_t + eps_t


# --------------------------------------------------------------------------- geometry


def adaptive_scale(param: torch.Tensor, eta: float, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ASAM's element-wise operator ``T = |x| + eta`` (Kwon et al. 2021), into ``out`` if given."""
    return torch.abs(param.detach(), out=out).add_(eta) if out is not None else param.detach().abs().add_(eta)


def adaptive_scales(params: Tensors, adaptive_mask: Sequence[bool], eta: float) -> List[torch.Tensor]:
    """``T`` for every tensor: :func:`adaptive_scale` where ``adaptive_mask`` is True, 1
    elsewhere (biases, norms)."""
    return [adaptive_scale(x, eta) if m else torch.ones_like(x) for x, m in zip(params, adaptive_mask)]


def ascent_direction(
    slopes: Tensors,
    params: Tensors,
    rho: float,
    *,
    adaptive_mask: Optional[Sequence[bool]] = None,
    eta: float = 0.01,
    plan: Optional[List[List[int]]] = None,
    layout=None,
    norm: Optional[float] = None,
) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """The ascent ``eps`` of the sphere's linear maximizer, materialized.

    Plain geometry: ``eps = rho * v / ||v||``.  Adaptive geometry (ASAM):
    ``eps = rho * T^2 v / ||T v||`` with ``T = |x| + eta`` on the tensors whose
    ``adaptive_mask`` entry is True and ``T = 1`` elsewhere (biases, norms).
    Returns ``(eps, ||T v||)``, the norm as a 0-dim float64 tensor: the scale
    ``rho / ||T v||`` stays on the device, so this costs no host sync.  ``eps`` is
    all zeros (never NaN) when ``v == 0``.  Plain geometry callers that only need
    ``x + eps`` should use :func:`ascent_scale` and ``_foreach_add_`` instead:
    no temporaries.
    """
    if adaptive_mask is None:
        scaled = [v.detach().clone() for v in slopes]  # T v with T = 1
        scales = [None] * len(slopes)
    else:
        scales = [adaptive_scale(x, eta) if m else None for x, m in zip(params, adaptive_mask)]
        scaled = [v * t if t is not None else v.detach().clone() for v, t in zip(slopes, scales)]
    if norm is not None:  # ||T v||, reduced already (with the step's first reduction)
        norm = torch.full((), norm, dtype=torch.float64, device=scaled[0].device if scaled else None)
    elif not scaled and (layout is None or not layout.collective):
        return scaled, torch.zeros((), dtype=torch.float64)
    else:
        norm = global_norm(scaled, plan, layout)  # ``plan``/``layout``: see :class:`plugins.reductions.Sums`
    for tv, t in zip(scaled, scales):
        if t is not None:
            tv.mul_(t)  # T (T v) = T^2 v
    if scaled:
        torch._foreach_mul_(scaled, ascent_scale(rho, norm).to(scalar_dtype(scaled)))
    return scaled, norm


def adaptive_direction_(slopes: Tensors, params: Tensors, adaptive_mask: Sequence[bool], eta: float) -> None:
    """``v <- T^2 v`` in place, ``T = |x| + eta`` where ``adaptive_mask`` is True (1
    elsewhere), multiplied as :func:`ascent_direction` multiplies: adaptive geometry's
    ascent is ``rho / ||T v||`` times this."""
    for v, x, m in zip(slopes, params, adaptive_mask):
        if m:
            t = adaptive_scale(x, eta)
            v.mul_(t).mul_(t)


def ascend_along_(params: Tensors, directions: Tensors, rho: float, norm: float, *, adaptive: bool) -> None:
    """Move ``params`` to ``x + eps`` in place from their ascent directions, as their
    owner moved them with :func:`ascend_` (``partition_group``: each rank moves the
    other owners' parameters itself): ``directions`` is ``v`` with ``norm = ||v||``
    (plain geometry), or ``T^2 v`` (:func:`adaptive_direction_`) with ``norm = ||T v||``."""
    params, directions = list(params), list(directions)
    if not adaptive or not params:
        ascend_(params, directions, rho, norm)
        return
    factor = ascent_scale(rho, torch.full((), norm, dtype=torch.float64, device=params[0].device))
    torch._foreach_add_(params, torch._foreach_mul(directions, factor.to(scalar_dtype(directions))))


def ascend_(params: Tensors, slopes: Tensors, rho: float, norm, *,
             adaptive_mask: Optional[Sequence[bool]] = None, eta: float = 0.01,
             plan: Optional[List[List[int]]] = None, layout=None):
    """Move ``params`` to ``x + eps`` in place (the ascent of :func:`ascent_direction`).

    Plain geometry (``adaptive_mask`` None): ``x += s v`` with ``s = rho / ||v||``,
    ``norm`` being ``||v||`` (a float), without materializing ``eps``; returns
    ``(None, s, None)``.  (The step decided on the device moves with :func:`move_` and
    a device scale instead: no host float.)  Adaptive geometry: ``norm`` is ``||T v||`` when reduced
    already (None: reduced here, over ``plan``/``layout``); returns
    ``(eps, None, ||T v||)``, the norm a 0-dim float64 tensor."""
    params, slopes = list(params), list(slopes)
    if adaptive_mask is None:
        scale = ascent_scale(rho, norm)
        move_(params, slopes, scale)
        return None, scale, None
    eps, scaled_norm = ascent_direction(slopes, params, rho, adaptive_mask=adaptive_mask, eta=eta, plan=plan,
                                        layout=layout, norm=norm)
    if params:
        torch._foreach_add_(params, eps)
    return eps, None, scaled_norm


def move_(params: Tensors, slopes: Tensors, scale, *, rho: float = 1.0) -> None:
    """``x += s v`` in place, ``s`` a float, or ``rho`` times a 0-dim device tensor
    (``ascent_scale(1.0, ||v||)``; no host sync, ``rho`` rides along as the add's ``alpha``)."""
    params = list(params)
    if params and torch.is_tensor(scale):
        torch._foreach_add_(params, torch._foreach_mul(list(slopes), scale), alpha=rho)
    elif params:
        torch._foreach_add_(params, list(slopes), alpha=scale)


def descend_from_ascent_(params: Tensors, slopes: Tensors, scale,
                         anchors: Optional[Tensors] = None, *, rho: float = 1.0) -> None:
    """Back from ``x + eps`` to ``x`` in place: a copy of the kept ``anchors`` (exact), or,
    in plain geometry, ``x -= s v`` (the ``s v`` :func:`ascend_` added: ``x`` again up to
    the rounding of one add and one subtract)."""
    params = list(params)
    if anchors is not None:
        if params:
            torch._foreach_copy_(params, list(anchors))
    elif params and torch.is_tensor(scale):  # the same product that move_ added
        torch._foreach_sub_(params, torch._foreach_mul(list(slopes), scale), alpha=rho)
    elif params:  # (products made by the caller come as slopes with scale = rho: the same op as above)
        torch._foreach_sub_(params, list(slopes), alpha=scale)


def scalar_dtype(tensors: Tensors) -> torch.dtype:
    """The dtype of a 0-dim tensor that multiplies ``tensors`` (a device scale, GSAM's factor):
    theirs (the widest of several), float32 for fp16/bf16.  A scalar tensor of another dtype
    sends CUDA's foreach ops to one kernel per tensor; rounded to fp16/bf16, a factor near 1
    would be 1; rounded to float32, float64 parameters would step in float32's precision."""
    return functools.reduce(torch.promote_types, {torch.float32 if t.dtype in LOW_PRECISION else t.dtype
                                                  for t in tensors})


def ascent_scale(rho, norm):
    """Eq. (5b)'s scale ``s = rho / ||v||`` with ``eps = s v``, 0 where ``||v||`` is 0 (``v ==
    0``) or not finite: a float from floats; from a 0-dim tensor a tensor, with no host sync
    (``1 / ||v||`` with ``rho = 1``: the step decided on the device multiplies ``rho`` in last)."""
    if torch.is_tensor(norm):  # (torch's float / tensor is the reciprocal times the float: one op less at 1)
        scale = norm.reciprocal() if not torch.is_tensor(rho) and rho == 1.0 else rho / norm
        return scale.nan_to_num_(0.0, 0.0, 0.0)  # rho / 0 = inf -> 0; rho / inf = 0; NaN -> 0
    return rho / norm if 0.0 < norm < math.inf else 0.0


def plain_ascent_norm(rho: float, slope_norm):
    """``||eps||`` of plain geometry: ``rho``, or 0 when ``v == 0`` (a tensor for a tensor)."""
    if torch.is_tensor(slope_norm):
        return (slope_norm > 0.0).to(slope_norm.dtype) * rho
    return rho if slope_norm > 0.0 else 0.0


def estimated_sharpness(rho: float, slope_norm: float) -> float:
    """The paper's estimated sharpness, the linearized ``rho * ||v||`` (``||T v||`` adaptive)."""
    return rho * slope_norm


def last_ascent_norm(last):
    """``||eps_{t-1}||`` from the last ascent ``[rho, ||v||]`` (plain geometry, whose ascent
    norm follows) or ``[rho, ||v||, ||eps||]`` (adaptive geometry): the optimizer's one record of it."""
    return last[2] if len(last) == 3 else plain_ascent_norm(last[0], last[1])


def stability(ascent_norm, last, inner, *, scale=None):
    """The stability ``||eps_t - eps_{t-1}||`` (``docs/diagnostics.md``) from ``||eps_t||``,
    the last ascent ``last`` (:func:`last_ascent_norm`) and ``<eps_t, eps_{t-1}>``, clamped
    at 0 for rounding.  With ``scale`` (plain geometry's ``s_t``) ``inner`` is
    ``<v_t, v_{t-1}>`` and ``<eps_t, eps_{t-1}> = s_t s_{t-1} <v_t, v_{t-1}>``, ``s_{t-1}``
    from ``last`` (the previous ascent recovered from the slope buffer, no buffer of its own)."""
    if scale is not None:
        inner = scale * ascent_scale(last[0], last[1]) * inner
    previous = last_ascent_norm(last)
    squared = ascent_norm * ascent_norm + previous * previous - 2.0 * inner
    return squared.clamp(min=0.0).sqrt() if torch.is_tensor(squared) else math.sqrt(max(squared, 0.0))


# --------------------------------------------------------------------------- rho schedule


def scheduled_rho(rho_max: float, rho_min: float, lr: float, lr_max: float, lr_min: float,
                  rounding: float = 1e-12) -> float:
    """GSAM's rho schedule (Zhuang et al. 2022), rho proportional to the learning rate:
    ``rho_t = rho_min + (rho_max - rho_min) (lr_t - lr_min) / (lr_max - lr_min)``.

    An lr below ``lr_min`` by at most ``rounding * lr_max`` is ``lr_min`` up to a
    scheduler's float rounding (torch's ``LinearLR`` from 3e-3 to 3e-5 ends at
    2.9999999999999977e-05) and gives ``rho_min`` exactly. Further below, rho would fall
    under ``rho_min`` (negative for ``rho_min = 0``): a ValueError, nothing clamped.
    """
    if not lr >= lr_min:  # NaN too
        if not lr_min - lr <= rounding * lr_max:
            raise ValueError(f"the rho schedule's lr fell below lr_min: lr = {lr!r} < lr_min = {lr_min!r} (by more "
                             f"than rounding, {rounding:g} * lr_max); set lr_min to the schedule's lowest lr "
                             "(0 for a warmup from lr 0)")
        return rho_min
    return rho_min + (rho_max - rho_min) * (lr - lr_min) / (lr_max - lr_min)


# --------------------------------------------------------------------------- descent correction


def gsam_correct(second_grads: Tensors, first_grads: Tensors, alpha: float, *,
                 h_norm: Optional[float] = None, g_dot_h: Optional[float] = None) -> None:
    """GSAM's descent (Zhuang et al. 2022), in place on ``h``.

    ``h <- h - alpha * g_perp`` where ``g_perp = g - (<g, h> / ||h||^2) h`` is the
    component of the first gradient orthogonal to the second; this is the
    decomposition of the authors' reference code.  No-op when ``h == 0``.
    ``h_norm`` and ``g_dot_h`` may be passed when already reduced.
    """
    if alpha == 0.0 or len(second_grads) == 0:
        return
    if h_norm is None or g_dot_h is None:
        sums = Sums().norm("h", list(second_grads)).inner("g_dot_h", list(first_grads), list(second_grads))
        h_norm, g_dot_h = sums.reduce().tolist()
    if torch.is_tensor(h_norm):  # 0-dim device tensors (a step decided on the device): no host decision
        h_sq = h_norm * h_norm
        moved = h_sq > 0.0  # h == 0: left as it is, as below
        dtype = scalar_dtype(second_grads)  # (the sums are float64)
        factor = torch.where(moved, 1.0 + alpha * (g_dot_h / h_sq), torch.ones_like(h_sq)).to(dtype)
        torch._foreach_mul_(list(second_grads), factor)
        # -alpha in that dtype (a bool tensor times a float would be float32, whatever the gradients')
        torch._foreach_add_(list(second_grads), torch._foreach_mul(list(first_grads), moved.to(dtype) * -alpha))
        return
    h_sq = h_norm * h_norm
    if h_sq == 0.0:
        return
    parallel = g_dot_h / h_sq
    # h - alpha * (g - parallel * h) == (1 + alpha * parallel) * h - alpha * g
    torch._foreach_mul_(list(second_grads), 1.0 + alpha * parallel)
    torch._foreach_add_(list(second_grads), list(first_grads), alpha=-alpha)


# --------------------------------------------------------------------------- schedule


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of ``(seed, step)``.

    Pure Python (splitmix64): it touches no torch generator, so it cannot shift
    dropout masks, and every distributed rank and every resumed run draws the same.
    """
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return (mixed >> 11) * (1.0 / (1 << 53))


def second_pass_coin(p: float, seed: int, step: int) -> bool:
    """eSAM / eVASSO's Bernoulli ``R_t``: True with probability ``p`` (Alg. 2)."""
    if p >= 1.0:
        return True
    if p <= 0.0:
        return False
    return uniform(seed, step) < p


# --------------------------------------------------------------------------- host helpers


def rng_state() -> tuple:
    """The CPU generator's state and, once CUDA is initialized, every device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def moved_parameters() -> None:
    """The parameters moved: drop autocast's cached low-precision copies of them.  Inside
    one autocast region torch casts each leaf parameter once and reuses the copy, so a
    second pass under the autocast of the first (``with autocast(): opt.step(closure)``)
    would otherwise run at ``x_t``, not at ``x_t + eps_t``."""
    torch.clear_autocast_cache()


def set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def frozen_running_stats(module: torch.nn.Module) -> Iterator[None]:
    """BatchNorm layers inside normalize with batch statistics but do not update
    their running mean, variance or ``num_batches_tracked``.

    For the second pass at ``x + eps``: the running statistics must come from the
    first pass only (``docs/design.md``, the host protocol).  In training mode torch's BatchNorm
    skips every buffer update when ``track_running_stats`` is False, which is what
    this flips for the duration of the block.
    """
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [m.track_running_stats for m in norms]
    try:
        for m in norms:
            if m.training:
                m.track_running_stats = False
        yield
    finally:
        for m, flag in zip(norms, saved):
            m.track_running_stats = flag


def weight_mask(params: Iterable[torch.Tensor], names: Optional[Sequence[str]] = None) -> List[bool]:
    """Which tensors adaptive geometry scales: by name ('weight' in it, as ASAM's
    reference code) when names are known, else tensors with ``ndim > 1``."""
    params = list(params)
    if names is not None:
        return ["weight" in n for n in names]
    return [p.ndim > 1 for p in params]
