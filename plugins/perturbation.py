"""The math of one sharpness-aware step, as small functions over lists of tensors.

Every formula of the step (``docs/design.md``) lives here once; :mod:`plugins.optimizer`
only keeps state and calls these in order.  Torch only.

Notation (paper, Alg. 1-2): ``g`` the first-pass gradient at ``x``, ``v`` the slope
(``g`` for SAM, the moving average ``d`` for VASSO), ``eps`` the ascent,
``h`` the second-pass gradient at ``x + eps``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

Tensors = Sequence[torch.Tensor]

_MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------- reductions

#: Tensors smaller than this many elements are flattened together (one ``torch.cat``
#: per chunk), so that a model of many small tensors costs a few kernels instead of
#: one per tensor; larger tensors are reduced where they are, without a copy.
FLAT_BELOW = 1 << 15
#: A chunk of flattened tensors holds at most this many elements (the transient copy).
FLAT_CHUNK = 1 << 20


def chunk_plan(tensors: Tensors) -> List[List[int]]:
    """Index groups of ``tensors`` that :func:`reductions` flattens together: same
    device and dtype, each under :data:`FLAT_BELOW` elements, at most
    :data:`FLAT_CHUNK` in all (a larger tensor forms a group alone).  Depends only on
    the tensors' sizes, devices and dtypes, so callers cache it."""
    plan: List[List[int]] = []
    open_chunks: dict = {}
    for i, t in enumerate(tensors):
        n = t.numel()
        if n >= FLAT_BELOW:
            plan.append([i])
            continue
        key = (t.device, t.dtype)
        chunk = open_chunks.get(key)
        if chunk is None or chunk[1] + n > FLAT_CHUNK:
            chunk = open_chunks[key] = [[], 0]
            plan.append(chunk[0])
        chunk[0].append(i)
        chunk[1] += n
    return plan


def _flat(tensors: Tensors, chunk: List[int]) -> torch.Tensor:
    t = torch.cat([tensors[i].reshape(-1) for i in chunk])
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, in float32 if it is fp16/bf16."""
    t = t.reshape(-1)
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def reductions(terms: Sequence[tuple], plan: Optional[List[List[int]]] = None, *, layout=None,
               extra: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Several sums over lists of tensors of the same shapes in one go, as one float64
    vector on the tensors' device:

    * ``(xs, None)``: ``||xs||``, one global L2 norm;
    * ``(xs, ys)``: ``<xs, ys>``;
    * ``(ds, gs, theta)``: ``||(1 - theta) ds + theta gs||``, the norm of VASSO's next
      moving average, computed before (and without) updating ``ds``;
    * ``(ds, gs, theta, ts)``: ``||ts * ((1 - theta) ds + theta gs)||``, the same scaled
      pointwise (adaptive geometry's ``||T v||``);

    then the values of the tensors of ``extra``, flattened, summed like the rest.

    The small tensors of each chunk of :func:`chunk_plan` are flattened once per list
    (one ``torch.cat``) and reduced with one kernel per term; large tensors are reduced
    where they are (norms with one ``torch._foreach_norm``).  fp16/bf16 are reduced in
    float32 (no overflow of the sum of squares); the partial sums add up in float64.

    ``layout`` (:class:`plugins.distributed.Layout`): the tensors are this rank's local
    parts (DTensor shards, or a partition of the parameters); only the ones it
    ``counted`` enter, and the partial sums (squares and inner products, not norms) are
    summed over its groups with one ``all_reduce`` before the square roots are taken.
    Every rank must then call this alike, whatever it holds (an empty shard included).
    Reading the result (``tolist()``) is the one host synchronization for all of them."""
    partial = local_sums(terms, plan, layout)
    extra = [e.detach().reshape(-1).to(partial.device, torch.float64) for e in extra]
    if extra:
        partial = torch.cat([partial] + extra)
    if layout is not None and layout.collective:
        layout.all_reduce(partial)
    return finish_sums(terms, partial)


def finish_sums(terms: Sequence[tuple], sums: torch.Tensor) -> torch.Tensor:
    """The terms of :func:`reductions` from their global sums (the partial sums summed
    over the ranks, however): the square roots of the norm terms; entries past the
    terms (``extra``) as they are."""
    is_norm = [len(t) >= 3 or t[1] is None for t in terms] + [False] * (sums.numel() - len(terms))
    if not any(is_norm):
        return sums
    # the roots entry by entry: a mask tensor would be a host-to-device copy per call
    return torch.stack([v.clamp(min=0.0).sqrt() if n else v for v, n in zip(sums.unbind(0), is_norm)])


def local_sums(terms: Sequence[tuple], plan: Optional[List[List[int]]] = None, layout=None) -> torch.Tensor:
    """The terms of :func:`reductions` as this rank's partial sums (squares for the
    norms, no square root) over the tensors ``layout`` counts, with no collective: to
    be reduced later, with another reduction's ``extra``."""
    if layout is not None and layout.counted is not None:
        keep = layout.counted
        terms = [tuple([xs[i] for i in keep] if isinstance(xs, (list, tuple)) else xs for xs in term)
                 for term in terms]
    return _partial_sums(terms, plan, layout)


def _partial_sums(terms: Sequence[tuple], plan: Optional[List[List[int]]], layout) -> torch.Tensor:
    """The local sums of squares (norm terms) and inner products, float64."""
    first = terms[0][0]
    if len(first) == 0:
        device = layout.device if layout is not None else torch.device("cpu")
        return torch.zeros(len(terms), dtype=torch.float64, device=device)
    plan = chunk_plan(first) if plan is None else plan
    alone = [c[0] for c in plan if len(c) == 1]
    chunks = [c for c in plan if len(c) > 1]
    flats: dict = {}

    def flat(xs, k):
        key = (id(xs), k)
        f = flats.get(key)
        if f is None:
            f = flats[key] = _flat(xs, chunks[k])
        return f

    results = []
    for term in terms:
        if len(term) >= 3 or term[1] is None:  # a norm: the sum of the squared per-tensor / per-chunk norms
            if len(term) >= 3:
                ds, gs, theta = term[:3]
                ts = term[3] if len(term) == 4 else None

                def averaged(d, g, t=None):
                    v = torch.lerp(d, g.to(d.dtype), theta)
                    return v if t is None else v * t.to(v.dtype)
                parts = [torch.linalg.vector_norm(averaged(_wide(ds[i]), _wide(gs[i]),
                                                           None if ts is None else _wide(ts[i]))) for i in alone]
                parts += [torch.linalg.vector_norm(averaged(flat(ds, k), flat(gs, k),
                                                            None if ts is None else flat(ts, k)))
                          for k in range(len(chunks))]
            else:
                xs = term[0]
                big = [xs[i] for i in alone]
                if big and all(t.dtype in (torch.float32, torch.float64) for t in big):
                    parts = list(torch._foreach_norm(big))
                else:
                    parts = [torch.linalg.vector_norm(_wide(t)) for t in big]
                parts += [torch.linalg.vector_norm(flat(xs, k)) for k in range(len(chunks))]
            results.append(torch.stack([q.double() for q in parts]).square().sum())
        else:
            xs, ys = term
            parts = [torch.dot(_wide(xs[i]), _wide(ys[i]).to(_wide(xs[i]).dtype)) for i in alone]
            parts += [torch.dot(flat(xs, k), flat(ys, k).to(flat(xs, k).dtype)) for k in range(len(chunks))]
            results.append(torch.stack([q.double() for q in parts]).sum() if len(parts) > 1
                           else parts[0].double())
    return torch.stack(results)


def global_norm(tensors: Tensors, plan: Optional[List[List[int]]] = None, layout=None) -> torch.Tensor:
    """One L2 norm over every tensor of the list (a 0-dim float64 tensor)."""
    return reductions([(list(tensors), None)], plan, layout=layout)[0]


def dot(xs: Tensors, ys: Tensors, layout=None) -> torch.Tensor:
    """Inner product <xs, ys> over all tensors, as a 0-dim float64 tensor (no host sync)."""
    xs, ys = list(xs), list(ys)
    if not xs and (layout is None or not layout.collective):
        return torch.zeros((), dtype=torch.float64)
    return reductions([(xs, ys)], layout=layout)[0]


# --------------------------------------------------------------------------- slope


def update_moving_average(averages: Tensors, grads: Tensors, theta: float) -> None:
    """VASSO's slope, in place: ``d <- (1 - theta) * d + theta * g`` (paper eq. 4a)."""
    if len(averages):
        torch._foreach_lerp_(list(averages), list(grads), theta)


def moving_average_inner(theta: float, previous_norm: float, grad_dot_previous: float) -> float:
    """``<d_t, d_{t-1}>`` from scalars: ``(1 - theta) ||d_{t-1}||^2 + theta <g_t, d_{t-1}>``."""
    return (1.0 - theta) * previous_norm * previous_norm + theta * grad_dot_previous


# --------------------------------------------------------------------------- geometry


def adaptive_scale(param: torch.Tensor, eta: float) -> torch.Tensor:
    """ASAM's element-wise operator ``T = |x| + eta`` (Kwon et al. 2021)."""
    return param.detach().abs().add_(eta)


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
    ``x + eps`` should use :func:`plain_ascent_scale` and ``_foreach_add_`` instead:
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
        norm = global_norm(scaled, plan, layout)  # ``plan``/``layout``: see :func:`reductions`
    for tv, t in zip(scaled, scales):
        if t is not None:
            tv.mul_(t)  # T (T v) = T^2 v
    if scaled:
        torch._foreach_mul_(scaled, _ascent_factor(rho, norm))
    return scaled, norm


def _ascent_factor(rho: float, norm: torch.Tensor) -> torch.Tensor:
    """``rho / norm`` as a float32 device tensor, 0 when ``norm == 0`` (``v == 0``)."""
    return torch.where(norm > 0.0, rho / norm, torch.zeros_like(norm)).float()


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
    factor = _ascent_factor(rho, torch.full((), norm, dtype=torch.float64, device=params[0].device))
    torch._foreach_add_(params, torch._foreach_mul(directions, factor))


def ascend_(params: Tensors, slopes: Tensors, rho: float, norm, *,
             adaptive_mask: Optional[Sequence[bool]] = None, eta: float = 0.01,
             plan: Optional[List[List[int]]] = None, layout=None):
    """Move ``params`` to ``x + eps`` in place (the ascent of :func:`ascent_direction`).

    Plain geometry (``adaptive_mask`` None): ``x += s v`` with ``s = rho / ||v||``,
    ``norm`` being ``||v||`` (a float), without materializing ``eps``; returns
    ``(None, s, None)``.  Adaptive geometry: ``norm`` is ``||T v||`` when reduced
    already (None: reduced here, over ``plan``/``layout``); returns
    ``(eps, None, ||T v||)``, the norm a 0-dim float64 tensor."""
    params, slopes = list(params), list(slopes)
    if adaptive_mask is None:
        scale = plain_ascent_scale(rho, norm)
        if params:
            torch._foreach_add_(params, slopes, alpha=scale)
        return None, scale, None
    eps, scaled_norm = ascent_direction(slopes, params, rho, adaptive_mask=adaptive_mask, eta=eta, plan=plan,
                                        layout=layout, norm=norm)
    if params:
        torch._foreach_add_(params, eps)
    return eps, None, scaled_norm


def plain_ascent_scale(rho: float, slope_norm: float) -> float:
    """Scalar ``s`` with ``eps = s * v`` in plain geometry; 0 when ``v == 0``."""
    return rho / slope_norm if slope_norm > 0.0 else 0.0


def plain_ascent_norm(rho: float, slope_norm: float) -> float:
    """``||eps||`` of plain geometry: ``rho``, or 0 when ``v == 0``."""
    return rho if slope_norm > 0.0 else 0.0


def estimated_sharpness(rho: float, slope_norm: float) -> float:
    """The paper's estimated sharpness, the linearized ``rho * ||v||`` (``||T v||`` adaptive)."""
    return rho * slope_norm


def distance_between_ascents(norm_a, norm_b, inner):
    """``||a - b||`` from ``||a||``, ``||b||`` and ``<a, b>`` (clamped at 0 for rounding);
    a float from floats, a 0-dim tensor (no host sync) when any of them is one."""
    squared = norm_a * norm_a + norm_b * norm_b - 2.0 * inner
    if torch.is_tensor(squared):
        return squared.clamp(min=0.0).sqrt()
    return math.sqrt(max(squared, 0.0))


def plain_stability(scale: float, previous_scale: float, inner_slopes, ascent_norm, previous_ascent_norm):
    """The stability ``||eps_t - eps_{t-1}||`` of plain geometry from scalars alone:
    ``eps_t = s_t v_t`` and ``eps_{t-1} = s_{t-1} v_{t-1}``, so
    ``<eps_t, eps_{t-1}> = s_t s_{t-1} <v_t, v_{t-1}>``."""
    inner = scale * previous_scale * inner_slopes
    return distance_between_ascents(ascent_norm, previous_ascent_norm, inner)


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
        h_norm, g_dot_h = reductions([(list(second_grads), None), (list(first_grads), list(second_grads))]).tolist()
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


# --------------------------------------------------------------------------- loss scaling


def unscale(tensors: Tensors, scale: torch.Tensor, *, in_place: bool) -> List[torch.Tensor]:
    """``tensors / scale`` for a loss scale held in a 0-dim tensor, on the device (no host
    sync): in place, or as new tensors.  The reciprocal is taken in float64, as
    ``torch.amp.GradScaler`` takes it, so a power-of-two scale unscales exactly."""
    inverse = scale.detach().double().reciprocal().float()
    tensors = list(tensors)
    out = list(tensors)
    for device in {t.device for t in tensors}:
        index = [i for i, t in enumerate(tensors) if t.device == device]
        group = [tensors[i] for i in index]
        factor = inverse.to(device, non_blocking=True)
        if in_place:
            torch._foreach_mul_(group, factor)
        else:
            for i, t in zip(index, torch._foreach_mul(group, factor)):
                out[i] = t
    return out


# --------------------------------------------------------------------------- host helpers


def rng_state() -> tuple:
    """The CPU generator's state and, once CUDA is initialized, every device's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


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
