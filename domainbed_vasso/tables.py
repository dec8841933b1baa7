#!/usr/bin/env python
"""Per-dataset DomainBed tables in the layout of the VASSO paper's appendix
(tab.PACS, tab.VLCS, tab.OfficeHome, tab.TerraInc) and its summary (tab.domain),
with the paper's Adam / SAM / GSAM / VASSO numbers beside yours.

    python scripts/domainbed_tables.py sweep/                       # markdown
    python scripts/domainbed_tables.py sweep/ --format latex
    python scripts/domainbed_tables.py sweep/ --selection loo iid oracle --err sem

Reads a ``domainbed_vasso.sweep`` (or DomainBed sweep) output directory: every
``<dir>/*/results.jsonl``, as DomainBed's ``collect_results`` does. For each
dataset, test domain and algorithm it selects, per trial, the (hparams, checkpoint)
chosen by the model selection method and reports the test-domain accuracy as
mean +- std over trials (``--err sem`` for DomainBed's standard error); the
"Average" row averages the per-domain means, as the paper and DomainBed do.

Model selection: ``loo`` is DomainBed's leave-one-domain-out cross-validation (the
paper's). It needs the runs with two test environments that DomainBed's sweep
launches by default; a sweep with ``--single_test_envs`` has none, and its ``loo``
cells read "-". ``iid`` is training-domain validation, ``oracle`` test-domain
validation. When DomainBed is importable (PYTHONPATH or DOMAINBED_ROOT), its own
``domainbed.model_selection`` code selects; otherwise this script's re-statement of
it does (same rules, same tie-breaking) and says so.

Test domains are matched by name: the paper orders PACS P, A, C, S and VLCS V, L,
C, S and TerraIncognita L38, L43, L46, L100, while DomainBed's environment indices
are alphabetical (PACS A, C, P, S; VLCS C, L, S, V; TerraIncognita L100, L38, L43,
L46). The paper's "+-" values are printed as the paper prints them.
"""

import argparse
import collections
import itertools
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# DomainBed's ENVIRONMENTS (index order) for the datasets the paper uses.
ENVIRONMENTS = {
    "PACS": ["A", "C", "P", "S"],
    "VLCS": ["C", "L", "S", "V"],
    "OfficeHome": ["A", "C", "P", "R"],
    "TerraIncognita": ["L100", "L38", "L43", "L46"],
}

PAPER_METHODS = ["Adam", "SAM", "GSAM", "VASSO"]
#: our algorithm name of each of the paper's columns (ERM in DomainBed is Adam there)
PAPER_TO_OURS = {"Adam": "ERM", "SAM": "SAM", "GSAM": "GSAM", "VASSO": "VASSO"}

# The paper's appendix tables (vasso.tex, tab.PACS ... tab.TerraInc): per dataset,
# rows in the paper's order as (DomainBed env name, paper's label, {method: (mean, +-)}),
# and the "Average" row; tab.domain holds the same averages with their +-.
PAPER = {
    "PACS": {
        "label": "tab.PACS",
        "rows": [
            ("P", "Photo", {"Adam": (97.2, 0.3), "SAM": (97.0, 0.4), "GSAM": (97.5, 0.0), "VASSO": (95.4, 0.2)}),
            ("A", "Art painting", {"Adam": (84.7, 0.4), "SAM": (85.6, 2.1), "GSAM": (86.9, 0.1), "VASSO": (84.2, 0.6)}),
            ("C", "Cartoon", {"Adam": (80.8, 0.6), "SAM": (80.9, 1.2), "GSAM": (80.4, 0.2), "VASSO": (81.8, 0.5)}),
            ("S", "Sketch", {"Adam": (79.3, 1.0), "SAM": (79.6, 1.6), "GSAM": (78.7, 0.8), "VASSO": (82.5, 0.4)}),
        ],
        "average": {"Adam": (85.5, 0.2), "SAM": (85.8, 0.2), "GSAM": (85.9, 0.1), "VASSO": (86.0, 0.1)},
    },
    "VLCS": {
        "label": "tab.VLCS",
        "rows": [
            ("V", "VOC2007", {"Adam": (75.2, 1.6), "SAM": (79.8, 0.1), "GSAM": (78.5, 0.8), "VASSO": (78.9, 0.7)}),
            ("L", "LabelMe", {"Adam": (64.7, 1.2), "SAM": (65.0, 1.0), "GSAM": (64.9, 0.2), "VASSO": (65.9, 0.5)}),
            ("C", "Caltech101", {"Adam": (98.0, 0.3), "SAM": (99.1, 0.2), "GSAM": (98.7, 0.3), "VASSO": (99.0, 0.2)}),
            ("S", "SUN09", {"Adam": (71.4, 1.2), "SAM": (73.7, 1.0), "GSAM": (74.3, 0.0), "VASSO": (74.4, 0.9)}),
        ],
        "average": {"Adam": (77.3, 0.4), "SAM": (79.4, 0.1), "GSAM": (79.1, 0.2), "VASSO": (79.6, 0.2)},
    },
    "OfficeHome": {
        "label": "tab.OfficeHome",
        "rows": [
            ("A", "Art", {"Adam": (61.3, 0.7), "SAM": (64.5, 0.3), "GSAM": (64.9, 0.1), "VASSO": (64.8, 0.5)}),
            ("C", "Clipart", {"Adam": (52.4, 0.3), "SAM": (56.5, 0.2), "GSAM": (55.2, 0.2), "VASSO": (57.1, 0.4)}),
            ("P", "Product", {"Adam": (75.8, 0.1), "SAM": (77.4, 0.1), "GSAM": (77.8, 0.0), "VASSO": (78.2, 0.2)}),
            ("R", "Real world", {"Adam": (76.6, 0.3), "SAM": (79.8, 0.4), "GSAM": (79.2, 0.2), "VASSO": (79.3, 0.1)}),
        ],
        "average": {"Adam": (66.5, 0.3), "SAM": (69.6, 0.1), "GSAM": (69.3, 0.0), "VASSO": (69.8, 0.2)},
    },
    "TerraIncognita": {
        "label": "tab.TerraInc",
        "rows": [
            ("L38", "Location 38", {"Adam": (42.1, 1.4), "SAM": (38.4, 2.4), "GSAM": (39.3, 0.2), "VASSO": (38.5, 0.7)}),
            ("L43", "Location 43", {"Adam": (56.9, 1.8), "SAM": (54.0, 1.0), "GSAM": (59.6, 0.0), "VASSO": (60.7, 0.2)}),
            ("L46", "Location 46", {"Adam": (35.7, 3.9), "SAM": (34.5, 0.8), "GSAM": (38.2, 0.8), "VASSO": (37.5, 0.8)}),
            ("L100", "Location 100", {"Adam": (49.8, 4.4), "SAM": (46.3, 1.0), "GSAM": (50.8, 0.1), "VASSO": (51.4, 0.8)}),
        ],
        "average": {"Adam": (46.1, 1.8), "SAM": (43.3, 0.7), "GSAM": (47.0, 0.8), "VASSO": (47.0, 0.3)},
    },
}
PAPER_OVERALL = {"Adam": 68.9, "SAM": 69.5, "GSAM": 70.3, "VASSO": 70.6}
PAPER_DATASETS = list(PAPER)

SELECTIONS = {
    "loo": ("LeaveOneOutSelectionMethod", "leave-one-domain-out cross-validation"),
    "iid": ("IIDAccuracySelectionMethod", "training-domain validation set"),
    "oracle": ("OracleSelectionMethod", "test-domain validation set (oracle)"),
}
ALGORITHM_ORDER = ["ERM", "SAM", "GSAM", "VASSO"]


# ----------------------------------------------------------------------------- loading

def load_records(dirs):
    """Every JSON line of ``<dir>/*/results.jsonl`` (as DomainBed's ``load_records``)."""
    records = []
    for path in dirs:
        if not os.path.isdir(path):
            raise SystemExit(f"domainbed_tables: {path} is not a directory")
        for sub in sorted(os.listdir(path)):
            results = os.path.join(path, sub, "results.jsonl")
            if os.path.isfile(results):
                with open(results) as f:
                    records.extend(json.loads(line) for line in f if line.strip())
    return records


def try_domainbed():
    """DomainBed's (model_selection, Q, datasets) or None."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    try:
        from domainbed_vasso import _locate
        _locate.domainbed_root()
        from domainbed import model_selection
        from domainbed.lib.query import Q
        try:
            import domainbed_vasso
            domainbed_vasso.register()  # the plugin's datasets (RotatedDigits) get their domain names
            from domainbed import datasets
        except ImportError:
            datasets = None
        return model_selection, Q, datasets
    except ImportError:
        return None


# ------------------------------------------------- DomainBed's selection, re-stated

def _group(items, key):
    """Q.group: [(key, [items])] sorted by key (keys JSON-encoded when unhashable)."""
    groups = {}
    for x in items:
        k = key(x)
        try:
            hash(k)
            hk = k
        except TypeError:
            hk = json.dumps({"_": k}, sort_keys=True)
        groups.setdefault(hk, (k, []))[1].append(x)
    return [groups[k] for k in sorted(groups)]


def _n_envs(record):
    n = 0
    for i in itertools.count():
        if f"env{i}_out_acc" not in record:
            return n
        n += 1


class _Fallback:
    """The selection methods of DomainBed's model_selection.py (commit b93c22a),
    for when DomainBed is not importable."""

    @staticmethod
    def iid_run_acc(run):
        tests = [r for r in run if len(r["args"]["test_envs"]) == 1]
        if not tests:
            return None
        best = None
        for r in tests:
            t = r["args"]["test_envs"][0]
            val = float(np.mean([r[f"env{i}_out_acc"] for i in range(_n_envs(r)) if i != t]))
            acc = {"val_acc": val, "test_acc": r[f"env{t}_in_acc"]}
            if best is None or acc["val_acc"] > best["val_acc"]:
                best = acc
        return best

    @staticmethod
    def oracle_run_acc(run):
        tests = [r for r in run if len(r["args"]["test_envs"]) == 1]
        if not tests:
            return None
        t = tests[0]["args"]["test_envs"][0]
        last = sorted(tests, key=lambda r: r["step"])[-1]
        return {"val_acc": last[f"env{t}_out_acc"], "test_acc": last[f"env{t}_in_acc"]}

    @staticmethod
    def _loo_step_acc(records):
        tests = [r for r in records if len(r["args"]["test_envs"]) == 1]
        if len(tests) != 1:
            return None
        t = tests[0]["args"]["test_envs"][0]
        n = _n_envs(records[0])
        val = np.zeros(n) - 1
        for r in records:
            if len(r["args"]["test_envs"]) == 2:
                v = (set(r["args"]["test_envs"]) - {t}).pop()
                val[v] = r[f"env{v}_in_acc"]
        val = list(val[:t]) + list(val[t + 1:])
        if any(v == -1 for v in val):
            return None
        return {"val_acc": np.sum(val) / (n - 1), "test_acc": tests[0][f"env{t}_in_acc"]}

    @classmethod
    def loo_run_acc(cls, run):
        best = None
        for _, step_records in _group(run, lambda r: r["step"]):
            acc = cls._loo_step_acc(step_records)
            if acc is not None and (best is None or acc["val_acc"] > best["val_acc"]):
                best = acc
        return best

    @classmethod
    def sweep_acc(cls, method, records):
        run_acc = {"loo": cls.loo_run_acc, "iid": cls.iid_run_acc, "oracle": cls.oracle_run_acc}[method]
        accs = [(run_acc(run), run) for _, run in _group(records, lambda r: r["args"]["hparams_seed"])]
        accs = [a for a in accs if a[0] is not None]
        if not accs:
            return None
        return sorted(accs, key=lambda a: a[0]["val_acc"])[::-1][0][0]["test_acc"]


def grouped(records):
    """{(trial_seed, dataset, algorithm, test_env): [records]} as DomainBed's
    ``reporting.get_grouped_records`` (a 2-test-env record joins both groups)."""
    out = collections.defaultdict(list)
    for r in records:
        a = r["args"]
        for t in a["test_envs"]:
            out[(a["trial_seed"], a["dataset"], a["algorithm"], t)].append(r)
    return out


def selected_accuracies(records, method, domainbed=None):
    """{(dataset, algorithm, test_env): {trial_seed: test accuracy in [0, 1]}}."""
    out = collections.defaultdict(dict)
    if domainbed is not None:
        model_selection, Q, _ = domainbed
        selector = getattr(model_selection, SELECTIONS[method][0])
    for (trial, dataset, algorithm, env), recs in grouped(records).items():
        if domainbed is not None:
            acc = selector.sweep_acc(Q(recs))
        else:
            acc = _Fallback.sweep_acc(method, recs)
        if acc is not None:
            out[(dataset, algorithm, env)][trial] = float(acc)
    return out


# ----------------------------------------------------------------------------- tables

def summarize(values, err):
    """mean and +- (std over trials, or standard error) in percent."""
    v = 100.0 * np.asarray(list(values), dtype=float)
    if v.size == 0:
        return None
    spread = float(np.std(v)) if err == "std" else float(np.std(v) / math.sqrt(v.size))
    return float(np.mean(v)), spread, int(v.size)


def environments(dataset, domainbed, records):
    if domainbed is not None and domainbed[2] is not None:
        try:
            return list(domainbed[2].get_dataset_class(dataset).ENVIRONMENTS)
        except Exception:
            pass
    if dataset in ENVIRONMENTS:
        return ENVIRONMENTS[dataset]
    n = max(_n_envs(r) for r in records if r["args"]["dataset"] == dataset)
    return [str(i) for i in range(n)]


def dataset_table(dataset, algorithms, accs, envs, err, paper=True):
    """(header, rows) of one dataset; a cell is a string."""
    spec = PAPER.get(dataset) if paper else None
    if spec:
        order = [(name, label) for name, label, _ in spec["rows"]]
        order += [(e, e) for e in envs if e not in {n for n, _ in order}]
    else:
        order = [(e, e) for e in envs]
    header = ["Test domain"] + list(algorithms)
    if spec:
        header += [f"paper {m}" for m in PAPER_METHODS]
    rows, means = [], collections.defaultdict(list)
    for name, label in order:
        row = [f"{label} ({name})" if label != name else name]
        env = envs.index(name) if name in envs else None
        for alg in algorithms:
            s = summarize(accs.get((dataset, alg, env), {}).values(), err) if env is not None else None
            means[alg].append(None if s is None else s[0])
            row.append("-" if s is None else f"{s[0]:.1f} ± {s[1]:.1f}")
        if spec:
            paper_row = {n: vals for n, _, vals in spec["rows"]}.get(name, {})
            row += [f"{paper_row[m][0]:.1f} ± {paper_row[m][1]:.1f}" if m in paper_row else "-"
                    for m in PAPER_METHODS]
        rows.append(row)
    avg = ["Average"]
    for alg in algorithms:
        m = means[alg]
        avg.append(f"{np.mean(m):.1f}" if m and None not in m else "-")
    if spec:
        avg += [f"{spec['average'][m][0]:.1f}" for m in PAPER_METHODS]
    rows.append(avg)
    return header, rows


def overall_table(datasets, algorithms, accs, envs_of, err, paper=True):
    """tab.domain: per dataset, mean +- over trials of the per-trial average over test
    domains (DomainBed's "Averages" table), and the average over datasets."""
    header = ["Dataset"] + list(algorithms)
    show_paper = paper and all(d in PAPER for d in datasets)
    if show_paper:
        header += [f"paper {m}" for m in PAPER_METHODS]
    rows, per_alg = [], collections.defaultdict(list)
    for d in datasets:
        row = [d]
        n_env = len(envs_of[d])
        for alg in algorithms:
            trials = collections.defaultdict(list)
            for e in range(n_env):
                for trial, acc in accs.get((d, alg, e), {}).items():
                    trials[trial].append(acc)
            complete = [np.mean(v) for v in trials.values() if len(v) == n_env]
            s = summarize(complete, err)
            per_alg[alg].append(None if s is None else s[0])
            row.append("-" if s is None else f"{s[0]:.1f} ± {s[1]:.1f}")
        if show_paper:
            row += [f"{PAPER[d]['average'][m][0]:.1f} ± {PAPER[d]['average'][m][1]:.1f}" for m in PAPER_METHODS]
        rows.append(row)
    avg = ["Average"]
    for alg in algorithms:
        m = per_alg[alg]
        avg.append(f"{np.mean(m):.1f}" if m and None not in m else "-")
    if show_paper:
        if list(datasets) == PAPER_DATASETS or sorted(datasets) == sorted(PAPER_DATASETS):
            avg += [f"{PAPER_OVERALL[m]:.1f}" for m in PAPER_METHODS]
        else:
            avg += [f"{np.mean([PAPER[d]['average'][m][0] for d in datasets]):.1f}" for m in PAPER_METHODS]
    rows.append(avg)
    return header, rows


def markdown(title, header, rows):
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _tex(cell):
    cell = cell.replace("±", "$\\pm$").replace("%", "\\%").replace("_", "\\_")
    return cell


def latex(title, header, rows, label=None):
    lines = ["\\begin{table}[ht]", "\\centering", f"\\caption{{{_tex(title)}}}",
             "\\begin{tabular}{l|" + "c" * (len(header) - 1) + "}", "\\toprule",
             " & ".join(_tex(h) for h in header) + " \\\\", "\\midrule"]
    for i, r in enumerate(rows):
        if i == len(rows) - 1 and r[0] == "Average":
            lines.append("\\midrule")
        lines.append(" & ".join(_tex(c) for c in r) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    if label:
        lines.append(f"\\label{{{label}}}")
    lines.append("\\end{table}")
    return "\n".join(lines) + "\n"


def render(records, selections=("loo", "iid"), fmt="markdown", err="std", datasets=None,
           algorithms=None, paper=True, domainbed=None):
    """All the tables as one string."""
    present_datasets = sorted({r["args"]["dataset"] for r in records})
    if datasets:
        present_datasets = [d for d in datasets if d in present_datasets]
    else:  # the paper's datasets in its order, then the others
        present_datasets = ([d for d in PAPER_DATASETS if d in present_datasets]
                            + [d for d in present_datasets if d not in PAPER_DATASETS])
    present_algs = {r["args"]["algorithm"] for r in records}
    if algorithms:
        algs = [a for a in algorithms if a in present_algs]
    else:
        algs = [a for a in ALGORITHM_ORDER if a in present_algs] + sorted(present_algs - set(ALGORITHM_ORDER))
    envs_of = {d: environments(d, domainbed, records) for d in present_datasets}
    spread = "std over trials" if err == "std" else "standard error over trials"
    out = []
    source = ("DomainBed's model_selection" if domainbed is not None
              else "this script's re-statement of DomainBed's model_selection (DomainBed not importable)")
    out.append(f"{len(records)} records; accuracy (%) mean ± {spread}; selection by {source}. "
               "Paper columns: VASSO paper (Li & Giannakis, NeurIPS 2023), leave-one-domain-out.\n")
    for method in selections:
        accs = selected_accuracies(records, method, domainbed)
        name = SELECTIONS[method][1]
        if method == "loo" and not any(len(r["args"]["test_envs"]) == 2 for r in records):
            out.append(f"Note: {name} needs runs with two test environments (a sweep without "
                       "--single_test_envs); this sweep has none, so its cells read '-'.\n")
        for d in present_datasets:
            header, rows = dataset_table(d, algs, accs, envs_of[d], err, paper)
            title = f"{d}, model selection: {name}"
            label = PAPER.get(d, {}).get("label") if paper else None
            if fmt in ("markdown", "both"):
                out.append(markdown(title, header, rows))
            if fmt in ("latex", "both"):
                out.append(latex(title, header, rows, label and f"{label}-ours-{method}"))
        header, rows = overall_table(present_datasets, algs, accs, envs_of, err, paper)
        title = f"Average over test domains, model selection: {name}"
        if fmt in ("markdown", "both"):
            out.append(markdown(title, header, rows))
        if fmt in ("latex", "both"):
            out.append(latex(title, header, rows, f"tab.domain-ours-{method}" if paper else None))
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input_dirs", nargs="+", help="sweep output directories")
    parser.add_argument("--selection", nargs="+", choices=list(SELECTIONS), default=["loo", "iid"])
    parser.add_argument("--format", choices=["markdown", "latex", "both"], default="markdown")
    parser.add_argument("--err", choices=["std", "sem"], default="std",
                        help="spread over trials: std (default) or standard error (DomainBed's)")
    parser.add_argument("--datasets", nargs="+", default=None)
    parser.add_argument("--algorithms", nargs="+", default=None)
    parser.add_argument("--no_paper", action="store_true", help="leave the paper's numbers out")
    parser.add_argument("--no_domainbed", action="store_true",
                        help="use this script's selection code even when DomainBed is importable")
    args = parser.parse_args(argv)
    records = load_records(args.input_dirs)
    if not records:
        raise SystemExit(f"domainbed_tables: no results.jsonl under {', '.join(args.input_dirs)}")
    domainbed = None if args.no_domainbed else try_domainbed()
    print(render(records, args.selection, args.format, args.err, args.datasets, args.algorithms,
                 not args.no_paper, domainbed))


if __name__ == "__main__":
    main()
