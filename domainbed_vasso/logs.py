"""DomainBed's ``results.jsonl`` (one record per checkpoint, written by
``python -m domainbed_vasso.train``) as a run of diagnostics for ``vasso-plot``.
Plain JSON reading: importing this does not import DomainBed."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from plugins.lab.runs import Run, label_for, series

#: what ``vasso-plot`` (``plugins.lab.runs.load_run``) looks for in a run's folder
FILE_NAMES = ("results.jsonl",)


def _number(v):
    """ints (``step``) and floats alike as float; everything else as it is."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def read_records(path: str) -> List[Dict[str, object]]:
    """Every record of a results.jsonl, numbers as floats."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                records.append({k: _number(v) for k, v in json.loads(line).items()})
    return records


def claims(path: str, first_line: str) -> bool:
    """A .jsonl file, or one whose first line is a JSON record with a ``step``."""
    return path.endswith(".jsonl") or (first_line.startswith("{") and '"step"' in first_line)


def load_run(path: str, label: Optional[str] = None) -> Run:
    """A results.jsonl as a :class:`plugins.lab.runs.Run` over ``step``, labelled from
    its algorithm and hparams."""
    records = read_records(path)
    meta: Dict[str, object] = {}
    if records:
        args = records[0].get("args") or {}
        hp = records[0].get("hparams") or {}
        meta = {"algorithm": args.get("algorithm"), "hparams": hp, "dataset": args.get("dataset"),
                "test_envs": args.get("test_envs")}
        if label is None and args.get("algorithm"):
            alg = str(args["algorithm"])
            info = {"_name": alg.lower(), "theta": hp.get("theta"), "p": hp.get("p", 1.0),
                    "adaptive": hp.get("adaptive", False), "rho": hp.get("rho")}
            if alg.upper() == "GSAM":
                info = {"_name": "sam", "gsam_alpha": hp.get("gsam_alpha", hp.get("alpha", 0.0)) or 0.0,
                        "rho": hp.get("rho"), "p": hp.get("p", 1.0)}
                label = "GSAM" + (f" (ρ={float(hp['rho']):g})" if hp.get("rho") is not None else "")
            else:
                label = label_for(info)
    meta["records"] = len(records)
    return Run(label or os.path.basename(os.path.dirname(os.path.abspath(path))) or path, path, "domainbed",
               series(records, "step"), meta)
