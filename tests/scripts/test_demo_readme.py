"""The README's demo table is the code's, exactly: CI runs a demo subset (SAM, seed 1, the
demo's settings and 320 updates, no rounding control; one fairseq-train run, about 2 minutes
on 2 idle cores) and compares its numbers with those the README's "Results" shows for that
run: SAM's seed-1 BLEU in the table, and the rounding control's "SAM s1" row (BLEU,
sacreBLEU, last valid loss, loss gap, stability).

The demo is deterministic for a given torch build: every run on a fixed number of threads
(the same numbers on 2 cores or 64), with the CPU kernels pinned (plugins.lab.pinned_kernels:
the same numbers on every x86-64 CPU with AVX2, AVX512 ones included). The README names the
commit, the torch and the CPU kernels its table was measured with; with another torch, or
where the kernels cannot be pinned (another architecture, a CPU without AVX2), the test
skips, saying so, since the kernels may round otherwise. A change that moves these numbers
(of the core's rounding, of fairseq_vasso, of the demo's settings) must re-run the demo and
update the README's table with them (docs/translation.md, "The result").
"""

import json
import os
import re

import pytest
import torch

from plugins.lab import pinned_kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROVENANCE = re.compile(r"measured at commit ([0-9a-f]{7,40}), torch (\S+), CPU kernels (\w+ \(pinned\)|\w+)")


def readme_demo():
    """(commit, torch, CPU kernels, SAM's per-seed BLEU cell, the rounding control's SAM s1 cells) of the README."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("**The demo**"):]
    section = section[:section.index("\n**", 1)]
    commit, torch_version, cpu = PROVENANCE.search(section).groups()
    rows = {l.split(" | ")[0].strip("| "): [c.strip() for c in l.strip().strip("|").split("|")]
            for l in section.splitlines() if l.startswith("| ")}
    return commit, torch_version, cpu, rows["SAM"][2], rows["SAM s1"][1:]


def test_the_readme_states_where_its_demo_table_was_measured():
    commit, torch_version, cpu, per_seed, control = readme_demo()
    assert len(per_seed.split(", ")) == 3 and len(control) == 5
    assert torch_version.startswith("2.")
    # measured with the kernels pinned, so that every x86-64 CPU with AVX2 checks it
    assert cpu == f"{pinned_kernels.CAPABILITY} (pinned)", cpu


def test_a_demo_subset_gives_the_readme_numbers_exactly(script, tmp_path):
    commit, torch_version, cpu, per_seed, control = readme_demo()
    if torch.__version__.split("+")[0] != torch_version.split("+")[0]:
        pytest.skip(f"the README's demo table was measured with torch {torch_version}; this is torch "
                    f"{torch.__version__}, whose kernels may round otherwise")
    why = pinned_kernels.unavailable()
    if why is not None:
        pytest.skip(f"the README's demo table was measured with the CPU kernels pinned ({cpu}), which cannot "
                    f"apply here: {why}")
    out = tmp_path / "demo"
    # --cpu: the table was measured on a CPU, and on a GPU host the demo would train there
    script("demo.py", "--out", out, "--cpu", "--methods", "sam", "--seeds", "1", "--control", "none",
           "--progress-every", 60, timeout=1800, cwd=tmp_path)
    with open(out / "results.json", encoding="utf-8") as f:
        [run] = json.load(f)["runs"]
    assert (run["method"], run["seed"], run["control"], run["resumed_at"]) == ("sam", 1, False, [])
    assert "%s (pinned)" % run["cpu_capability"] == cpu and run["cpu_kernels_pinned"], run
    mine = ["%.2f" % run["fairseq_bleu"], "%.2f" % run["sacrebleu"], "%.3f" % run["valid_loss"],
            "%.4f" % run["train_loss_gap"], "%.4f" % run["train_stability"]]
    assert (mine[0], mine) == (per_seed.split(", ")[0], control), (
        f"the demo gives other numbers than the README's table (measured at {commit}): re-run the demo "
        "(docs/translation.md) and update the table, saying in the commit what changed them")
