"""The paper's three-dimensional illustration (Fig. 3, Appendix A.2): adversaries on the sphere.

A true gradient ``grad f = [0.2, -0.1, 0.6]`` plus Gaussian noise ``xi`` gives the
minibatch gradients ``g_t``.  SAM's adversary ``eps_t = rho g_t / ||g_t||`` (the
maximizer of ``<g_t, eps>`` over ``||eps|| <= rho``) spreads over the whole sphere
as the signal-to-noise ratio falls; VASSO's ``eps_t = rho d_t / ||d_t||`` with the
moving average ``d_t = (1 - theta) d_{t-1} + theta g_t`` (``d_0 = g_0``) stays
closer together.  100 adversaries per SNR, for SNR 5, 1, 0.1 and 0.01 (the paper's
panels (a)-(d)); the top row is SAM, the bottom row VASSO on the same noise.

Our reading of the appendix ("xi_1, xi_2, xi_3 are iid Gaussian random variables
with variance scaling with 0.2, 1, 2, respectively. Scaling is used to vary the
SNR"): the coordinates' noise variances are in the ratio 0.2 : 1 : 2, and one
common factor ``c`` sets the SNR, defined as ``||grad f||^2 / E||xi||^2``, so
``Var(xi_i) = c * (0.2, 1, 2)_i`` with ``c = ||grad f||^2 / (3.2 * SNR)``.

    python -m plugins.lab.plot.sphere -o adversaries.png [--theta 0.4 --seed 0]

Each panel's title gives the mean angle between ``eps_t`` and ``grad f`` and the
mean ``||eps_t - eps_{t-1}||`` (the paper's stability measure, rho = 1); the same
numbers are printed as a table.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Sequence

import numpy as np

from ..tables import refuse_existing
from .diagnostics import pyplot

GRAD = (0.2, -0.1, 0.6)
NOISE_SHAPE = (0.2, 1.0, 2.0)
SNRS = (5.0, 1.0, 0.1, 0.01)


def noise_scale(snr: float, grad: Sequence[float] = GRAD, shape: Sequence[float] = NOISE_SHAPE) -> float:
    """``c`` with ``||grad||^2 / E||xi||^2 == snr`` for ``Var(xi_i) = c * shape_i``."""
    return float(np.dot(grad, grad)) / (float(np.sum(shape)) * snr)


def adversaries(snr: float, n: int = 100, *, theta: float = 0.4, rho: float = 1.0, burn_in: int = 20,
                seed: int = 0, grad: Sequence[float] = GRAD, shape: Sequence[float] = NOISE_SHAPE) -> Dict[str, np.ndarray]:
    """SAM's and VASSO's adversaries for the same ``burn_in + n`` noisy gradients (last n kept)."""
    rng = np.random.default_rng(seed)
    std = np.sqrt(noise_scale(snr, grad, shape) * np.asarray(shape, dtype=float))
    g = np.asarray(grad, dtype=float) + rng.standard_normal((burn_in + n, 3)) * std
    sam = rho * g / np.linalg.norm(g, axis=1, keepdims=True)
    d = np.empty_like(g)
    d[0] = g[0]  # d_0 = g_0, as the authors' code
    for t in range(1, len(g)):
        d[t] = (1.0 - theta) * d[t - 1] + theta * g[t]
    vasso = rho * d / np.linalg.norm(d, axis=1, keepdims=True)
    return {"sam": sam[burn_in:], "vasso": vasso[burn_in:], "gradients": g[burn_in:]}


def spread(eps: np.ndarray, grad: Sequence[float] = GRAD) -> Dict[str, float]:
    """Mean angle (degrees) to grad f and mean ||eps_t - eps_{t-1}||."""
    u = np.asarray(grad, dtype=float) / np.linalg.norm(grad)
    unit = eps / np.linalg.norm(eps, axis=1, keepdims=True)
    angles = np.degrees(np.arccos(np.clip(unit @ u, -1.0, 1.0)))
    steps = np.linalg.norm(np.diff(eps, axis=0), axis=1)
    return {"angle": float(angles.mean()), "stability": float(steps.mean())}


def plot(out: str, *, snrs: Sequence[float] = SNRS, n: int = 100, theta: float = 0.4, burn_in: int = 20,
         seed: int = 0, dpi: int = 130) -> List[Dict[str, float]]:
    plt = pyplot()

    rows = []
    fig = plt.figure(figsize=(3.3 * len(snrs), 7.0))
    u, v = np.mgrid[0:2 * np.pi:30j, 0:np.pi:16j]
    sphere = (np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v))
    true = np.asarray(GRAD) / np.linalg.norm(GRAD)
    for j, snr in enumerate(snrs):
        adv = adversaries(snr, n, theta=theta, burn_in=burn_in, seed=seed + j)
        for i, (key, name, color) in enumerate((("sam", "SAM", "C1"), ("vasso", f"VASSO (θ={theta:g})", "C0"))):
            ax = fig.add_subplot(2, len(snrs), i * len(snrs) + j + 1, projection="3d")
            ax.plot_wireframe(*sphere, color="0.85", linewidth=0.4)
            pts = adv[key]
            ax.scatter(pts[:, 0], pts[:, 1], pts[:, 2], s=9, color=color, depthshade=False, alpha=0.85)
            ax.quiver(0, 0, 0, *true, color="k", linewidth=1.8, arrow_length_ratio=0.15)
            s = spread(pts)
            rows.append({"snr": snr, "method": name, **s})
            ax.set_title(f"{name}, SNR = {snr:g}\nangle to " + r"$\nabla f$" + f" {s['angle']:.0f}°, "
                         + r"$\|\epsilon_t - \epsilon_{t-1}\|$" + f" = {s['stability']:.2f}", fontsize=9)
            ax.set_xlim(-1, 1), ax.set_ylim(-1, 1), ax.set_zlim(-1, 1)
            ax.set_box_aspect((1, 1, 1))
            ax.set_xticks([]), ax.set_yticks([]), ax.set_zticks([])
            ax.view_init(elev=20, azim=35)
    fig.suptitle(r"Adversaries $\epsilon_t$ on the sphere ($\rho = 1$) for $\nabla f$ = " + f"{list(GRAD)} "
                 f"plus Gaussian noise (variances ∝ {list(NOISE_SHAPE)}); {n} per SNR; "
                 r"black arrow: $\nabla f / \|\nabla f\|$", fontsize=10)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.88, wspace=0.02, hspace=0.18)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", default="adversaries.png")
    ap.add_argument("--theta", type=float, default=0.4, help="VASSO's EMA weight (default 0.4)")
    ap.add_argument("-n", type=int, default=100, help="adversaries per SNR (default 100, as the paper)")
    ap.add_argument("--burn-in", type=int, default=20, help="EMA steps drawn and dropped first (default 20)")
    ap.add_argument("--snr", type=float, nargs="+", default=list(SNRS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dpi", type=int, default=130)
    ap.add_argument("--force", action="store_true", help="overwrite --out if it exists (else refused)")
    args = ap.parse_args(argv)
    if not 0.0 < args.theta <= 1.0:
        ap.error("--theta must be in (0, 1]")
    refuse_existing(ap, {"--out": args.out}, args.force)
    rows = plot(args.out, snrs=args.snr, n=args.n, theta=args.theta, burn_in=args.burn_in, seed=args.seed,
                dpi=args.dpi)
    print("| SNR | method | mean angle to grad f (deg) | mean ||eps_t - eps_{t-1}|| (rho = 1) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['snr']:g} | {r['method']} | {r['angle']:.1f} | {r['stability']:.3f} |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
