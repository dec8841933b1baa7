"""A run's diagnostics over updates, whatever host wrote its log: the :class:`Run` type,
the format-neutral helpers the hosts' log readers build it with (:func:`series`,
:func:`label_for`), and :func:`load_run`, which hands a file to the reader that claims it.

The readers live with their hosts (``fairseq_vasso.nmt.logs``, ``domainbed_vasso.logs``:
plain text, importing neither fairseq nor DomainBed) and import this module; this module
imports none of them, and finds them by the names in :data:`READERS` when a run is
loaded (``docs/design.md``, "The house").  A reader module has ``FILE_NAMES`` (the log
files it looks for in a run's folder), ``claims(path, first_line)`` and
``load_run(path, label)``.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

DIAGNOSTIC_KEYS = ("stability", "loss_gap", "sharpness", "ascent_norm", "two_pass", "rho")

#: The hosts' log readers, by module name, asked in this order; the last takes any text.
READERS = ("domainbed_vasso.logs", "fairseq_vasso.nmt.logs")


@dataclass
class Run:
    label: str
    path: str
    source: str  # "fairseq" or "domainbed"
    series: Dict[str, Tuple[List[float], List[float]]] = field(default_factory=dict)
    meta: Dict[str, object] = field(default_factory=dict)


def label_for(opt: Dict[str, object]) -> Optional[str]:
    """SAM / VASSO (theta=..) / eVASSO(p=..) / ASAM / +GSAM, with rho; None if unknown."""
    name = str(opt.get("_name", opt.get("algorithm", ""))).lower()
    if not name:
        return None
    p = opt.get("perturb_prob", opt.get("p", 1.0))
    p = float(p) if isinstance(p, (int, float)) else 1.0
    adaptive = bool(opt.get("adaptive", False))
    alpha = opt.get("gsam_alpha", 0.0)
    alpha = float(alpha) if isinstance(alpha, (int, float)) else 0.0
    if name in ("sam", "vasso"):
        base = "SAM" if name == "sam" else "VASSO"
        if adaptive:
            base = "A" + base if name == "sam" else "adaptive " + base
        if p < 1.0:
            base = "e" + base
        extras = []
        if name == "vasso" and opt.get("theta") is not None:
            extras.append(f"θ={float(opt['theta']):g}")
        if p < 1.0:
            extras.append(f"p={p:g}")
        if alpha > 0:
            extras.append(f"GSAM α={alpha:g}")
        if opt.get("rho") is not None:
            extras.append(f"ρ={float(opt['rho']):g}")
        return base + (f" ({', '.join(extras)})" if extras else "")
    if name == "adam":
        return "AdamW"  # fairseq's --optimizer adam decouples weight decay
    return name.upper() if name in ("erm", "gsam") else name


def series(records: Sequence[Dict[str, object]], xkey: str) -> Dict[str, Tuple[List[float], List[float]]]:
    """``{key: (xs, ys)}`` of every diagnostic the records carry as finite floats."""
    out: Dict[str, Tuple[List[float], List[float]]] = {}
    for key in DIAGNOSTIC_KEYS:
        xs, ys = [], []
        for r in records:
            x, y = r.get(xkey), r.get(key)
            if isinstance(x, float) and isinstance(y, float) and math.isfinite(x) and math.isfinite(y):
                xs.append(x)
                ys.append(y)
        if xs:
            out[key] = (xs, ys)
    return out


def load_run(spec: str) -> Run:
    """``path`` or ``label=path`` (a log file, or a run's folder holding one), read by the
    first reader of :data:`READERS` that claims it."""
    label = None
    if "=" in spec and not os.path.exists(spec):
        label, spec = spec.split("=", 1)
    path = spec
    readers = [importlib.import_module(name) for name in READERS]
    if os.path.isdir(path):
        for name in (n for reader in readers for n in reader.FILE_NAMES):
            if os.path.exists(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
    first = ""
    if not path.endswith(".jsonl"):
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline().strip()
    reader = next(r for r in readers if r.claims(path, first))
    return reader.load_run(path, label)
