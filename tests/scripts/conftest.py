"""Fixtures for the tests of scripts/ (IWSLT-14 pipeline, recipe, BLEU evaluation, demo)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)


def run_script(name, *args, timeout=600, cwd=None, check=True):
    """Runs scripts/NAME with this Python; returns the CompletedProcess (text)."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, name)] + [str(a) for a in args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          cwd=cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError("%s %s exited %d:\n%s" % (name, " ".join(map(str, args)), proc.returncode,
                                                       proc.stdout[-6000:]))
    return proc


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """A scaled-down run of scripts/demo.py (real corpus generation with noisy training targets,
    preprocessing, fairseq-train with adam / sam / vasso for seeds 1 and 2, fairseq-generate and
    scoring).

    Returns (out_dir, stdout). Every test that needs a trained model and real
    fairseq-generate output uses this one run.
    """
    out = tmp_path_factory.mktemp("demo") / "demo"
    proc = run_script("demo.py", "--out", out, "--train", 500, "--valid", 40, "--test", 40, "--seeds", 1, 2,
                      "--max-update", 60, "--lr", "5e-3", "--warmup-updates", 30, "--bpe-merges", 100,
                      "--methods", "adamw", "sam", "vasso0.4", "--embed-dim", 32, "--layers", 1,
                      "--progress-every", 1, timeout=900)
    return str(out), proc.stdout


@pytest.fixture(scope="session")
def script():
    """run_script(name, *args): runs scripts/NAME, raises with its output on failure."""
    return run_script
