"""The family's step written out from the paper's equations, in float64 on the CPU: the
reference the core is held to (``tests/core/test_math.py`` and ``vasso-selftest``'s math
check both use it; docs/design.md, "One step, equation by equation").

Plain SGD is the base optimizer (``x <- x - lr * descent``), so the reference needs no
state beyond VASSO's moving average; the model is given as a function of its parameters.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from plugins.perturbation import second_pass_coin

#: One member per choice of the family (slope, geometry, correction, schedule), by name:
#: (class name in :mod:`plugins`, knobs).
MEMBERS: Dict[str, tuple] = {
    "SAM": ("SAM", {}),
    "VASSO": ("VASSO", {"theta": 0.4}),
    "eSAM": ("SAM", {"p": 0.5}),
    "eVASSO": ("VASSO", {"theta": 0.4, "p": 0.5}),
    "ASAM": ("SAM", {"adaptive": True, "eta": 0.01}),
    "GSAM": ("SAM", {"gsam_alpha": 0.3}),
    "V+G": ("VASSO", {"theta": 0.4, "gsam_alpha": 0.3}),
}


def _norm(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum((t * t).sum() for t in ts))


def _dot(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((a * b).sum() for a, b in zip(xs, ys))


def reference_steps(loss: Callable[[List[torch.Tensor], int], torch.Tensor], params: Sequence[torch.Tensor],
                    steps: int, *, lr: float, rho: float, theta: Optional[float] = None, p: float = 1.0,
                    seed: int = 0, adaptive: bool = False, eta: float = 0.01, gsam_alpha: float = 0.0,
                    weights: Optional[Sequence[bool]] = None) -> List[List[torch.Tensor]]:
    """The parameters after each of ``steps`` steps (float64, CPU), from the equations:

    1. ``g_t = grad f_t(x_t)``; VASSO: ``d_t = (1 - theta) d_{t-1} + theta g_t``, ``d_0 = g_0``,
       on every step; the slope ``v_t`` is ``d_t`` (VASSO) or ``g_t`` (SAM);
    2. with probability ``p`` (the coin of ``(seed, t)``), the ascent
       ``eps_t = rho T^2 v_t / ||T v_t||`` (``T = |x_t| + eta`` on weights when adaptive,
       else 1), ``h_t = grad f_t(x_t + eps_t)``, and the descent ``h_t``, or GSAM's
       ``h_t - alpha (g_t - <g_t, h_t>/||h_t||^2 h_t)``; without the second pass, ``g_t``;
    3. ``x_{t+1} = x_t - lr * descent``.

    ``loss(params, t)`` is the loss of step ``t``'s batch at ``params``; ``weights`` marks
    the tensors adaptive geometry scales (default: ``ndim > 1``).
    """
    x = [q.detach().to("cpu", torch.float64).clone() for q in params]
    weights = [q.ndim > 1 for q in x] if weights is None else list(weights)

    def grad(at: List[torch.Tensor], t: int) -> List[torch.Tensor]:
        at = [a.detach().requires_grad_(True) for a in at]
        return [gr.detach() for gr in torch.autograd.grad(loss(at, t), at)]

    d = None
    out = []
    for t in range(steps):
        g = grad(x, t)
        if theta is not None:
            d = [gi.clone() for gi in g] if d is None else [(1 - theta) * di + theta * gi for di, gi in zip(d, g)]
        v = d if theta is not None else g
        if second_pass_coin(p, seed, t):
            T = [(xi.abs() + eta) if (adaptive and w) else torch.ones_like(xi) for xi, w in zip(x, weights)]
            tv_norm = _norm([ti * vi for ti, vi in zip(T, v)])
            eps = [rho * ti * ti * vi / tv_norm for ti, vi in zip(T, v)]
            h = grad([xi + ei for xi, ei in zip(x, eps)], t)
            descent = h
            if gsam_alpha:
                parallel = _dot(g, h) / _dot(h, h)
                descent = [hi - gsam_alpha * (gi - parallel * hi) for gi, hi in zip(g, h)]
        else:
            descent = g
        x = [xi - lr * di for xi, di in zip(x, descent)]
        out.append([xi.clone() for xi in x])
    return out
