"""Per-dataset DomainBed tables in the layout of the VASSO paper's appendix
(tab.PACS, tab.VLCS, tab.OfficeHome, tab.TerraInc) and its summary (tab.domain),
with the paper's Adam / SAM / GSAM / VASSO numbers beside yours.

    vasso-domainbed-tables sweep/                       # markdown
    vasso-domainbed-tables sweep/ --format latex
    vasso-domainbed-tables sweep/ --selection loo iid oracle --err sem
    python -m domainbed_vasso.tables ...                # the same without the console script

Reads a ``domainbed_vasso.sweep`` (or DomainBed sweep) output directory with
DomainBed's own code: ``domainbed.lib.reporting`` loads every ``<dir>/*/results.jsonl``
and groups the records by (trial, dataset, algorithm, test domain), and
``domainbed.model_selection`` selects, per trial, the (hparams, checkpoint) of each
group, as DomainBed's ``collect_results`` does. What this adds is the layout: the
test-domain accuracy as mean +- std over trials (``--err sem`` for DomainBed's
standard error; a single trial shows its accuracy alone), the paper's domain order
and labels, the "Average" row (the mean of the per-domain means, as the paper and
DomainBed do) and the paper's numbers beside yours.

Model selection: ``loo`` is DomainBed's leave-one-domain-out cross-validation (the
paper's). It needs the runs with two test environments that DomainBed's sweep
launches by default; a sweep with ``--single_test_envs`` has none, and its ``loo``
cells read "-". ``iid`` is training-domain validation, ``oracle`` test-domain
validation. DomainBed must be importable (PYTHONPATH or DOMAINBED_ROOT).

Test domains are matched by name (DomainBed's ``ENVIRONMENTS``): the paper orders
PACS P, A, C, S and VLCS V, L, C, S and TerraIncognita L38, L43, L46, L100, while
DomainBed's environment indices are alphabetical (PACS A, C, P, S; VLCS C, L, S, V;
TerraIncognita L100, L38, L43, L46). The paper's "+-" values are printed as the
paper prints them.
"""

import argparse
import collections
import itertools
import math
import os
import sys

import numpy as np

from plugins.lab.tables import markdown_table

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


# ----------------------------------------------------------------------------- DomainBed

def domainbed():
    """Registers this plugin with DomainBed (so its datasets, e.g. RotatedDigits, have
    their domain names) and returns DomainBed's (model_selection, reporting, datasets).
    Raises :class:`domainbed_vasso.DomainBedNotFound` (with the fix) without DomainBed."""
    from . import register

    register()
    from domainbed import datasets, model_selection
    from domainbed.lib import reporting

    return model_selection, reporting, datasets


def load_records(dirs):
    """Every record of ``<dir>/*/results.jsonl`` of every dir (DomainBed's ``load_records``)."""
    _, reporting, _ = domainbed()
    records = []
    for path in dirs:
        if not os.path.isdir(path):
            raise SystemExit(f"vasso-domainbed-tables: {path} is not a directory")
        records.extend(reporting.load_records(path))
    return records


def selected_accuracies(records, method):
    """{(dataset, algorithm, test_env): {trial_seed: test accuracy in [0, 1]}}, each
    selected by DomainBed's model selection ``method`` (a key of SELECTIONS)."""
    model_selection, reporting, _ = domainbed()
    selector = getattr(model_selection, SELECTIONS[method][0])
    out = collections.defaultdict(dict)
    for group in reporting.get_grouped_records(records):
        acc = selector.sweep_acc(group["records"])
        if acc is not None:
            out[(group["dataset"], group["algorithm"], group["test_env"])][group["trial_seed"]] = float(acc)
    return out


def _n_envs(record):
    """The number of environments a record reports (as DomainBed's selection counts them)."""
    return next(i for i in itertools.count() if f"env{i}_out_acc" not in record)


# ----------------------------------------------------------------------------- tables

def summarize(values, err):
    """mean and +- (std over trials, or standard error; None for one trial) in percent, and
    the number of trials."""
    v = 100.0 * np.asarray(list(values), dtype=float)
    if v.size == 0:
        return None
    if v.size == 1:
        return float(v[0]), None, 1
    spread = float(np.std(v)) if err == "std" else float(np.std(v) / math.sqrt(v.size))
    return float(np.mean(v)), spread, int(v.size)


def cell(summary):
    """'mean ± spread', the mean alone for a single trial, '-' for none."""
    if summary is None:
        return "-"
    mean, spread, _ = summary
    return f"{mean:.1f}" if spread is None else f"{mean:.1f} ± {spread:.1f}"


def environments(dataset, records):
    """The dataset's domain names in DomainBed's index order (DomainBed's ENVIRONMENTS);
    their indices for a dataset DomainBed does not know."""
    _, _, datasets = domainbed()
    try:
        return list(datasets.get_dataset_class(dataset).ENVIRONMENTS)
    except NotImplementedError:
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
            row.append(cell(s))
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
            row.append(cell(s))
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


def paper_summary_table():
    """(header, rows) of the paper's tab.domain: per dataset, each method's average over
    test domains with its +-, and the average over the datasets."""
    header = ["Dataset"] + PAPER_METHODS
    rows = [[d] + [f"{PAPER[d]['average'][m][0]:.1f} ± {PAPER[d]['average'][m][1]:.1f}" for m in PAPER_METHODS]
            for d in PAPER_DATASETS]
    rows.append(["Average"] + [f"{PAPER_OVERALL[m]:.1f}" for m in PAPER_METHODS])
    return header, rows


def markdown(title, header, rows):
    return markdown_table(header, rows, align="-" + "c" * (len(header) - 1), title=title) + "\n"


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
           algorithms=None, paper=True, paper_summary=False):
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
    envs_of = {d: environments(d, records) for d in present_datasets}
    spread = "std over trials" if err == "std" else "standard error over trials"
    trials = len({r["args"]["trial_seed"] for r in records})
    out = []
    out.append(f"{len(records)} records, {trials} trial(s); accuracy (%) mean ± {spread} (one trial: its "
               "accuracy alone); selection by DomainBed's model_selection. "
               "Paper columns: VASSO paper (Li & Giannakis, NeurIPS 2023), leave-one-domain-out.\n")
    for method in selections:
        accs = selected_accuracies(records, method)
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
    if paper_summary:
        title = ("Paper (tab.domain; ResNet-50 fine-tuned with Adam on PACS, VLCS, OfficeHome, TerraIncognita, "
                 "leave-one-domain-out; the paper's Adam column is ERM here)")
        header, rows = paper_summary_table()
        if fmt in ("markdown", "both"):
            out.append(markdown(title, header, rows))
        if fmt in ("latex", "both"):
            out.append(latex(title, header, rows, "tab.domain"))
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="vasso-domainbed-tables", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Example: vasso-domainbed-tables ./sweep_vasso --selection loo iid")
    parser.add_argument("input_dirs", nargs="+", help="sweep output directories (DomainBed's --output_dir)")
    parser.add_argument("--selection", nargs="+", choices=list(SELECTIONS), default=["loo", "iid"],
                        help="model selection methods, one set of tables each: loo (leave-one-domain-out, the "
                             "paper's), iid (training-domain validation), oracle (test-domain validation); "
                             "default: loo iid")
    parser.add_argument("--format", choices=["markdown", "latex", "both"], default="markdown",
                        help="table format (default: markdown)")
    parser.add_argument("--err", choices=["std", "sem"], default="std",
                        help="spread over trials: std (default) or standard error (DomainBed's)")
    parser.add_argument("--datasets", nargs="+", default=None,
                        help="only these datasets, in this order (default: every one in the sweep)")
    parser.add_argument("--algorithms", nargs="+", default=None,
                        help="only these algorithms, in this order (default: every one in the sweep)")
    parser.add_argument("--no_paper", action="store_true", help="leave the paper's numbers out")
    parser.add_argument("--paper_summary", action="store_true",
                        help="also print the paper's tab.domain (its four datasets' averages), e.g. beside a "
                             "sweep of another dataset")
    args = parser.parse_args(argv)
    from ._cli import register_or_exit

    register_or_exit()  # one line naming the fix where DomainBed is missing
    records = load_records(args.input_dirs)
    if not records:
        raise SystemExit(f"vasso-domainbed-tables: no results.jsonl under {', '.join(args.input_dirs)}")
    print(render(records, args.selection, args.format, args.err, args.datasets, args.algorithms,
                 not args.no_paper, args.paper_summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
