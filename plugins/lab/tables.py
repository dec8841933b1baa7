"""The one mean ± std and the one markdown table writer of every tool (the demo,
``vasso-bleu``, ``vasso-domainbed-tables``, the digits experiments, the benchmark), and
their one refusal to write over a file that exists (``refuse_existing``)."""

from __future__ import annotations

import os
import statistics
from typing import Iterable, Optional, Sequence, Tuple

_ALIGN = {"l": ":---", "r": "---:", "c": ":---:", "-": "---"}


def refuse_existing(parser, outputs, force):
    """Before any work: ``parser.error`` (exit status 2) naming the first of ``outputs``
    ({flag: path or None}) that exists, unless ``force`` (the tool's ``--force``)."""
    for flag, path in outputs.items():
        if path and os.path.exists(path) and not force:
            parser.error(f"{flag} {path} exists: give a new file, or --force to overwrite it")


def mean_std(values: Iterable[Optional[float]]) -> Tuple[Optional[float], Optional[float]]:
    """(mean, sample std) of the values that are not None; the std is None for one value
    (no spread to show), both are None for none."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], None
    return statistics.mean(values), statistics.stdev(values)


def fmt_mean_std(values: Iterable[Optional[float]], digits: int = 2, scale: float = 1.0) -> str:
    """'mean ± std' of ``scale * value``, the mean alone for one value, '-' for none."""
    mean, std = mean_std(None if v is None else v * scale for v in values)
    if mean is None:
        return "-"
    if std is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_table(header: Sequence[object], rows: Sequence[Sequence[object]], *, align: Optional[str] = None,
                   title: Optional[str] = None) -> str:
    """A GitHub markdown table, with a ``### title`` above it when given.  ``align`` has
    one letter per column: l(eft), r(ight), c(entre) or - (none); by default the first
    column is left-aligned and the others right-aligned."""
    header = [str(h) for h in header]
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - set(_ALIGN):
        raise ValueError(f"align must give one of l, r, c, - per column ({len(header)}), got {align!r}")
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(_ALIGN[a] for a in align) + "|"]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"row {cells!r} has {len(cells)} cells, the header has {len(header)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
