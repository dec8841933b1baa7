"""Plot what the sharpness-aware optimizers log: the stability of the adversary and the perturbed-loss gap.

Reads any mix of

* fairseq-train logs (the console output or ``--log-file``) with ``--log-format
  simple`` or ``--log-format json``; the ``train_inner`` lines carry, averaged over
  ``--log-interval``: ``stability`` (||eps_t - eps_{t-1}||), ``loss_gap``
  (f(x + eps) - f(x), base 2 like fairseq's ``loss``), ``sharpness`` (rho ||v_t||),
  ``ascent_norm``, ``two_pass``, ``rho``.  (``--log-format tqdm`` writes no
  ``train_inner`` lines to the log: use simple or json.)
* DomainBed ``results.jsonl`` (``python -m domainbed_vasso.train``): one record per
  checkpoint with ``step`` and the same keys averaged since the previous checkpoint
  (``loss_gap`` there is in nats).

and writes one PNG with two panels over updates: ||eps_t - eps_{t-1}|| for every run
on the same axes (the paper's Fig. 4: VASSO's adversary moves less than SAM's) and
the perturbed-loss gap.  Runs are labelled from what the log says (optimizer, theta,
perturb probability, rho), or ``label=path`` on the command line::

    vasso-plot runs/sam/train.log runs/vasso/train.log -o diagnostics.png
    vasso-plot SAM=sweep/a/results.jsonl VASSO=sweep/b/results.jsonl -o db.png
    python -m plugins.lab.plot ...          # the same without the console script

It also prints a small table (median stability and loss gap per run).  Matplotlib
with the Agg backend: no display needed.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

# The run type and the reading of logs live in plugins.lab.runs, which the hosts' readers
# import (docs/design.md, "The house"); re-exported here for vasso-plot's users.
from plugins.lab.runs import DIAGNOSTIC_KEYS, Run, label_for, load_run, series  # noqa: F401
from plugins.lab.tables import refuse_existing


# --------------------------------------------------------------------------- plotting


def _smooth(ys: List[float], window: int) -> List[float]:
    if window <= 1 or len(ys) < 2:
        return list(ys)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


PANELS = (
    ("stability", r"$\|\epsilon_t - \epsilon_{t-1}\|$", "Stability of the adversary (lower: steadier; paper Fig. 4)"),
    ("loss_gap", r"$f_B(x+\epsilon) - f_B(x)$", "Perturbed-loss gap"),
)


def pyplot():
    """matplotlib.pyplot with the Agg backend (no display), imported only when a plot is drawn."""
    # a host that logs at DEBUG (fairseq, the demo) would print every font matplotlib scores
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: Sequence[Run], out: str, *, smooth: int = 1, title: Optional[str] = None,
              logy: bool = False, dpi: int = 130) -> Dict[str, Dict[str, Tuple[List[float], List[float]]]]:
    """Write the two-panel PNG; returns {panel key: {run label: (x, y)}} exactly as drawn."""
    plt = pyplot()

    drawn: Dict[str, Dict[str, Tuple[List[float], List[float]]]] = {k: {} for k, _, _ in PANELS}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.4))
    # SAM orange and VASSO blue as in the paper's figure; every other run its own colour and dash
    looks, spare = [], iter([("C2", "--"), ("C3", "-."), ("C4", ":"), ("C5", "--"), ("C6", "-."), ("C7", ":"),
                             ("C8", "--"), ("C9", "-.")] * 4)
    firsts = set()
    for run in runs:
        kind = "SAM" if run.label.startswith("SAM") else ("VASSO" if run.label.startswith("VASSO") else None)
        if kind and kind not in firsts:
            firsts.add(kind)
            looks.append(("C1" if kind == "SAM" else "C0", "-"))
        else:
            looks.append(next(spare))
    for ax, (key, ylabel, panel_title) in zip(axes, PANELS):
        for run, (color, style) in zip(runs, looks):
            if key not in run.series:
                continue
            xs, ys = run.series[key]
            ys = _smooth(ys, smooth)
            ax.plot(xs, ys, style, color=color, lw=1.6, label=run.label, marker="o" if len(xs) <= 30 else None, ms=3)
            drawn[key][run.label] = (list(xs), list(ys))
        ax.set_xlabel("updates")
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title, fontsize=10)
        if key == "loss_gap":
            ax.axhline(0.0, color="0.6", lw=0.8)
        if logy and key == "stability":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if drawn[key]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data in these logs", ha="center", va="center", transform=ax.transAxes)
    sources = sorted({r.source for r in runs})
    note = ("fairseq: mean over each --log-interval" if "fairseq" in sources else "") + \
           ("; " if len(sources) > 1 else "") + \
           ("DomainBed: mean between checkpoints" if "domainbed" in sources else "")
    fig.suptitle((title + "\n" if title else "") + note + (f", smoothed over {smooth} points" if smooth > 1 else ""),
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return drawn


def summary(runs: Sequence[Run]) -> str:
    def med(run, key):
        s = run.series.get(key)
        return f"{statistics.median(s[1]):.4g}" if s else "n/a"

    lines = ["| run | source | points | median stability | median loss gap | median sharpness |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        n = len(r.series.get("stability", ([], []))[0])
        lines.append(f"| {r.label} | {r.source} | {n} | {med(r, 'stability')} | {med(r, 'loss_gap')} | "
                     f"{med(r, 'sharpness')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="vasso-plot", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="fairseq log, DomainBed results.jsonl (or its folder); label=path to name it")
    ap.add_argument("-o", "--out", default="diagnostics.png", help="PNG to write (default diagnostics.png)")
    ap.add_argument("--smooth", type=int, default=1, help="moving average over this many points")
    ap.add_argument("--logy", action="store_true", help="log scale for the stability panel")
    ap.add_argument("--title", help="the figure's title")
    ap.add_argument("--dpi", type=int, default=130, help="resolution of the PNG (default 130)")
    ap.add_argument("--force", action="store_true", help="overwrite --out if it exists (else refused)")
    args = ap.parse_args(argv)
    refuse_existing(ap, {"--out": args.out}, args.force)
    for spec in args.runs:
        path = spec if os.path.exists(spec) or "=" not in spec else spec.split("=", 1)[1]
        if not os.path.exists(path):
            ap.error(f"runs: no such file or folder: {path}")
    if args.smooth < 1:
        ap.error(f"--smooth must be >= 1, got {args.smooth}")
    runs = [load_run(s) for s in args.runs]
    seen: Dict[str, int] = {}
    for r in runs:  # several seeds of one method: keep the labels apart
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label} #{seen[r.label]}"
    empty = [r.label for r in runs if "stability" not in r.series and "loss_gap" not in r.series]
    for label in empty:
        print(f"warning: {label}: no stability/loss_gap values found (fairseq: --optimizer sam|vasso with "
              f"--log-format simple or json; DomainBed: an algorithm of domainbed_vasso, e.g. SAM, GSAM, VASSO)",
              file=sys.stderr)
    plot_runs(runs, args.out, smooth=args.smooth, title=args.title, logy=args.logy, dpi=args.dpi)
    print(summary(runs))
    print(f"wrote {args.out}")
    return 0 if len(empty) < len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
