"""The demo's report is the code's, exactly: CI runs a demo subset (SAM, seed 1, the demo's
settings and 320 updates, no rounding control; one fairseq-train run, about 2 minutes on 2
idle cores) and compares its numbers with those docs/reports/demo.md shows for that run:
SAM's seed-1 BLEU in the table, and the rounding control's "SAM s1" row (BLEU, sacreBLEU,
last valid loss, loss gap, stability). The README's results table shows the report's, cell
for cell.

The demo is deterministic for a given torch build: every run on a fixed number of threads
(the same numbers on 2 cores or 64), with the CPU kernels pinned (plugins.lab.pinned_kernels:
the same numbers on the x86-64 CPUs of the vendor they were measured on, AVX2 or AVX512). The report's
environment line names the commit, the torch and the CPU kernels its table was measured
with; with another torch, or where the kernels cannot be pinned (another architecture, a CPU
without AVX2), the test skips, saying so, since the kernels may round otherwise. A change
that moves these numbers (of the core's rounding, of fairseq_vasso, of the demo's settings)
must re-run the demo and replace the report's tables and the README's with them.
"""

import json
import os
import re

import pytest
import torch

from plugins.lab import pinned_kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = os.path.join(REPO, "docs", "reports", "demo.md")
PROVENANCE = re.compile(r"measured at commit ([0-9a-f]{7,40}), torch (\S+), CPU kernels (\w+ \(pinned\)|\w+)")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _table(text, head):
    """{first cell: [cells]} of the markdown table whose header row starts with ``head``, and its header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    header = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells
    return header, rows


def report_demo():
    """(commit, torch, CPU kernels, SAM's per-seed BLEU cell, the rounding control's SAM s1 cells) of the report."""
    text = _read(REPORT)
    commit, torch_version, cpu = PROVENANCE.search(text).groups()
    _, methods = _table(text, "| Method |")
    _, control = _table(text, "| run |")
    return commit, torch_version, cpu, methods["SAM"][2], control["SAM s1"][1:]


def test_the_readme_states_where_its_demo_table_was_measured():
    # the README's results link the report, whose environment line says where its table was measured
    assert "](docs/reports/demo.md)" in _read(os.path.join(REPO, "README.md"))
    commit, torch_version, cpu, per_seed, control = report_demo()
    assert len(per_seed.split(", ")) == 3 and len(control) == 5
    assert torch_version.startswith("2.")
    # measured with the kernels pinned, so that every CPU of its vendor checks it
    assert cpu == f"{pinned_kernels.CAPABILITY} (pinned)", cpu


def test_the_readmes_results_table_is_the_reports():
    # the README shows some of the report's columns for every method: each cell is the report's
    readme = _read(os.path.join(REPO, "README.md"))
    readme = readme[readme.index("## Results"):]
    header, rows = _table(readme, "| Method |")
    report_header, report_rows = _table(_read(REPORT), "| Method |")
    assert len(header) >= 3 and set(header) <= set(report_header), header
    assert rows.keys() == report_rows.keys(), (rows.keys(), report_rows.keys())
    for method, cells in rows.items():
        for column, cell in zip(header, cells):
            assert cell == report_rows[method][report_header.index(column)], (method, column, cell)


def test_a_demo_subset_gives_the_readme_numbers_exactly(script, tmp_path):
    commit, torch_version, cpu, per_seed, control = report_demo()
    if torch.__version__.split("+")[0] != torch_version.split("+")[0]:
        pytest.skip(f"the demo's report was measured with torch {torch_version}; this is torch "
                    f"{torch.__version__}, whose kernels may round otherwise")
    why = pinned_kernels.unmeasured()
    if why is not None:
        pytest.skip(f"the demo's report was measured with the CPU kernels pinned ({cpu}), and does not "
                    f"apply here: {why}")
    out = tmp_path / "demo"
    # --cpu: the table was measured on a CPU, and on a GPU host the demo would train there
    script(os.path.join("translation", "demo.py"), "--out", out, "--cpu", "--methods", "sam", "--seeds", "1", "--control", "none",
           "--progress-every", 60, timeout=1800, cwd=tmp_path)
    with open(out / "results.json", encoding="utf-8") as f:
        [run] = json.load(f)["runs"]
    assert (run["method"], run["seed"], run["control"], run["resumed_at"]) == ("sam", 1, False, [])
    assert "%s (pinned)" % run["cpu_capability"] == cpu and run["cpu_kernels_pinned"], run
    mine = ["%.2f" % run["fairseq_bleu"], "%.2f" % run["sacrebleu"], "%.3f" % run["valid_loss"],
            "%.4f" % run["train_loss_gap"], "%.4f" % run["train_stability"]]
    assert (mine[0], mine) == (per_seed.split(", ")[0], control), (
        f"the demo gives other numbers than docs/reports/demo.md (measured at {commit}): re-run the demo "
        "(docs/translation.md) and replace the report's tables and the README's, saying in the commit what "
        "changed them")
