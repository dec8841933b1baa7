"""fairseq-train's log lines as records: the stats lines (``train_inner``, ``train``,
``valid``...) in ``--log-format simple`` or ``json``, and the optimizer config printed
at start.  Plain text parsing: importing this imports neither fairseq nor the hooks.
``vasso-plot`` (:mod:`plugins.lab.plot.diagnostics`) and the benchmark read logs here.
"""

from __future__ import annotations

import ast
import json
import os
import re
from typing import Dict, List, Optional

from plugins.lab.runs import Run, label_for, series

#: what ``vasso-plot`` (``plugins.lab.runs.load_run``) looks for in a run's folder
FILE_NAMES = ("train.log", "log.txt")

_TAGS = r"(train_inner|train|valid|valid_\w+|test)"
# "2026-.. | INFO | train_inner | ..." (fairseq-train's console format) or "INFO:train_inner:..." (logging's
# default format, when fairseq runs inside a process that configured logging first)
_TAG_RE = re.compile(r"\|\s*" + _TAGS + r"\s*\|\s?(.*)$")
_TAG_RE_DEFAULT = re.compile(r"^(?:[A-Z]+):" + _TAGS + r":(.*)$")
_INNER_PREFIX_RE = re.compile(r"^epoch\s+\d+:\s+\d+\s*/\s*\d+\s+")
_OPT_RE = re.compile(r"'optimizer':\s*\{'_name':\s*'(\w+)'([^}]*)\}")
_NUM_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(nan|inf)$", re.IGNORECASE)


def _num(v):
    """fairseq writes numbers as strings in its json lines: back to float where possible."""
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and _NUM_RE.match(v.strip()):
        return float(v)
    return v


def parse_fairseq_line(line: str) -> Optional[Dict[str, object]]:
    """One fairseq stats line as a dict (``_tag`` = train_inner / train / valid ...), else None.

    Handles ``--log-format json`` (``| train_inner | {"loss": "9.8", ...}``; epoch
    lines prefix their keys with the tag: ``train_loss``, which is stripped) and
    ``--log-format simple`` (``| train_inner | epoch 001:  10 / 15 loss=9.8, ups=12, ...``
    and ``| train | epoch 001 | loss 9.671 | ups 12 | ...``).
    """
    line = line.rstrip("\n")
    m = _TAG_RE.search(line) or _TAG_RE_DEFAULT.match(line.strip())
    if not m:
        return None
    tag, payload = m.group(1), m.group(2).strip()
    rec: Dict[str, object] = {}
    if payload.startswith("{"):
        try:
            raw = json.loads(payload)
        except json.JSONDecodeError:
            return None
        prefix = tag + "_"
        for k, v in raw.items():
            key = k[len(prefix):] if tag != "train_inner" and k.startswith(prefix) else k
            rec[key] = _num(v)
    elif "=" in payload:  # simple format, train_inner
        body = _INNER_PREFIX_RE.sub("", payload)
        for item in body.split(","):
            if "=" in item:
                k, v = item.split("=", 1)
                rec[k.strip()] = _num(v.strip())
    else:  # simple format, epoch summary: "epoch 001 | loss 9.6 | ..."
        for item in payload.split("|"):
            parts = item.strip().split(None, 1)
            if len(parts) == 2:
                rec[parts[0]] = _num(parts[1].strip())
    if not rec:
        return None
    rec["_tag"] = tag
    return rec


def parse_fairseq_log_text(text: str) -> List[Dict[str, object]]:
    """Every stats line of a fairseq log, in order."""
    out = []
    for line in text.splitlines():
        rec = parse_fairseq_line(line)
        if rec is not None:
            out.append(rec)
    return out


def fairseq_optimizer(text: str) -> Dict[str, object]:
    """The optimizer section of the config fairseq prints at start ({} if absent)."""
    m = _OPT_RE.search(text)
    if not m:
        return {}
    try:
        return ast.literal_eval("{'_name': '%s'%s}" % (m.group(1), m.group(2)))
    except (ValueError, SyntaxError):
        return {"_name": m.group(1)}


def claims(path: str, first_line: str) -> bool:
    """Any text: fairseq's is the format ``vasso-plot`` reads when no other claims a file."""
    return True


def load_run(path: str, label: Optional[str] = None) -> Run:
    """A fairseq log as a :class:`plugins.lab.runs.Run` over ``num_updates`` (its
    ``train_inner`` lines), labelled from the optimizer config it printed."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    records = [r for r in parse_fairseq_log_text(text) if r["_tag"] == "train_inner"]
    opt = fairseq_optimizer(text)
    return Run(label or label_for(opt) or os.path.basename(os.path.dirname(os.path.abspath(path))) or path,
               path, "fairseq", series(records, "num_updates"), {"optimizer": opt, "lines": len(records)})
