"""Fixtures for the tests of the translation recipes and tools (IWSLT-14 pipeline, recipe,
vasso-bleu, demo). Recipes run as the docs run them (``python scripts/...``), the tools
as ``python -m MODULE``; library code is imported from the installed packages."""

import os
import subprocess
import sys
import tempfile

import process_group
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")


def run_script(name, *args, timeout=600, cwd=None, check=True, env=None):
    """Runs scripts/NAME (a path ending in .py) or the module NAME (``python -m``) with this
    Python, in ``cwd`` (default: a new temporary folder, never the checkout) and ``env``
    (default: this process's); returns the CompletedProcess (text)."""
    if cwd is None:
        with tempfile.TemporaryDirectory(prefix="run-script-") as tmp:
            return run_script(name, *args, timeout=timeout, cwd=tmp, check=check, env=env)
    target = [os.path.join(SCRIPTS, name)] if name.endswith(".py") else ["-m", name]
    # stderr apart: fairseq's import warnings must not mix with what the tests parse
    proc = process_group.run([sys.executable] + target + [str(a) for a in args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
                             cwd=cwd, env=env)
    if check and proc.returncode != 0:
        raise AssertionError("%s %s exited %d:\n%s\n%s" % (name, " ".join(map(str, args)), proc.returncode,
                                                           proc.stdout[-4000:], proc.stderr[-4000:]))
    return proc


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """A scaled-down run of scripts/translation/demo.py (real corpus generation with noisy training targets,
    preprocessing, fairseq-train with adam / sam / vasso for seeds 1 and 2, fairseq-generate and
    scoring).

    Returns (out_dir, stdout, stderr). Every test that needs a trained model and real
    fairseq-generate output uses this one run.
    """
    out = tmp_path_factory.mktemp("demo") / "demo"
    proc = run_script(os.path.join("translation", "demo.py"), "--out", out, *DEMO_ARGS, timeout=900, cwd=out.parent)  # as a user would: beside it
    return str(out), proc.stdout, proc.stderr


DEMO_ARGS = ["--train", 500, "--valid", 40, "--test", 40, "--seeds", 1, 2, "--max-update", 60, "--lr", "5e-3",
             "--warmup-updates", 30, "--bpe-merges", 100, "--methods", "adamw", "sam", "vasso0.4", "--embed-dim", 32,
             "--layers", 1, "--progress-every", 1]


@pytest.fixture(scope="session")
def demo_args():
    """The arguments of demo_run's demo, but --out."""
    return [str(a) for a in DEMO_ARGS]


@pytest.fixture(scope="session")
def script():
    """run_script(name, *args): runs scripts/NAME or module NAME, raises with its output on failure."""
    return run_script
