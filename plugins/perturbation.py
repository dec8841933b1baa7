"""The math of one sharpness-aware step, as small functions over lists of tensors.

Every formula of ``DESIGN.md`` section 1 lives here once; :mod:`plugins.optimizer`
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


# --------------------------------------------------------------------------- norms


def global_norm(tensors: Tensors) -> torch.Tensor:
    """One L2 norm over every tensor of the list (a 0-dim float32 tensor).

    Uses ``torch._foreach_norm`` (one kernel launch per device/dtype bucket) and
    accumulates the per-tensor norms in float32 so fp16 gradients cannot overflow
    the sum of squares.
    """
    if len(tensors) == 0:
        return torch.zeros(())
    norms = torch._foreach_norm(list(tensors))
    device = norms[0].device
    if any(n.device != device or n.dtype != torch.float32 for n in norms):
        norms = [n.to(device=device, dtype=torch.float32) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms))


def dot(xs: Tensors, ys: Tensors) -> float:
    """Inner product <xs, ys> over all tensors: per-tensor dots in the tensors' precision
    (float32 for fp16/bf16), summed on the device in float64, one host sync."""
    xs, ys = list(xs), list(ys)
    if not xs:
        return 0.0
    device = xs[0].device
    parts = []
    for x, y in zip(xs, ys):
        if x.dtype in (torch.float16, torch.bfloat16):
            x, y = x.float(), y.float()
        parts.append(torch.dot(x.reshape(-1), y.reshape(-1).to(x.dtype)).to(device=device, dtype=torch.float64))
    return float(torch.stack(parts).sum())


# --------------------------------------------------------------------------- slope


def update_moving_average(averages: Tensors, grads: Tensors, theta: float) -> None:
    """VASSO's slope, in place: ``d <- (1 - theta) * d + theta * g`` (paper eq. 4a)."""
    torch._foreach_lerp_(list(averages), list(grads), theta)


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
) -> Tuple[List[torch.Tensor], float]:
    """The ascent ``eps`` of the sphere's linear maximizer, materialized.

    Plain geometry: ``eps = rho * v / ||v||``.  Adaptive geometry (ASAM):
    ``eps = rho * T^2 v / ||T v||`` with ``T = |x| + eta`` on the tensors whose
    ``adaptive_mask`` entry is True and ``T = 1`` elsewhere (biases, norms).
    Returns ``(eps, ||T v||)``; ``eps`` is all zeros (never NaN) when ``v == 0``.
    Plain geometry callers that only need ``x + eps`` should use
    :func:`plain_ascent_scale` and ``_foreach_add_`` instead: no temporaries.
    """
    if adaptive_mask is None:
        scaled = [v.detach().clone() for v in slopes]  # T v with T = 1
        scales = [None] * len(slopes)
    else:
        scales = [adaptive_scale(x, eta) if m else None for x, m in zip(params, adaptive_mask)]
        scaled = [v * t if t is not None else v.detach().clone() for v, t in zip(slopes, scales)]
    norm = float(global_norm(scaled)) if scaled else 0.0
    factor = rho / norm if norm > 0.0 else 0.0
    for tv, t in zip(scaled, scales):
        if t is not None:
            tv.mul_(t)  # T (T v) = T^2 v
    if scaled:
        torch._foreach_mul_(scaled, factor)
    return scaled, norm


def plain_ascent_scale(rho: float, slope_norm: float) -> float:
    """Scalar ``s`` with ``eps = s * v`` in plain geometry; 0 when ``v == 0``."""
    return rho / slope_norm if slope_norm > 0.0 else 0.0


def distance_between_ascents(norm_a: float, norm_b: float, inner: float) -> float:
    """``||a - b||`` from ``||a||``, ``||b||`` and ``<a, b>`` (clamped at 0 for rounding)."""
    return math.sqrt(max(norm_a * norm_a + norm_b * norm_b - 2.0 * inner, 0.0))


# --------------------------------------------------------------------------- descent correction


def gsam_correct(second_grads: Tensors, first_grads: Tensors, alpha: float) -> None:
    """GSAM's descent (Zhuang et al. 2022), in place on ``h``.

    ``h <- h - alpha * g_perp`` where ``g_perp = g - (<g, h> / ||h||^2) h`` is the
    component of the first gradient orthogonal to the second; this is the
    decomposition of the authors' reference code.  No-op when ``h == 0``.
    """
    if alpha == 0.0 or len(second_grads) == 0:
        return
    h_sq = float(global_norm(second_grads)) ** 2
    if h_sq == 0.0:
        return
    parallel = dot(first_grads, second_grads) / h_sq
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
    first pass only (``DESIGN.md`` section 3).  In training mode torch's BatchNorm
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
