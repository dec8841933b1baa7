"""Fixtures for the benchmark and diagnostics scripts' tests.

The scripts live in ``scripts/`` (not a package); they are loaded from their files.
Nothing here times anything: the benchmark's logic runs on tiny models for 1-3
updates and its ratios are checked on made-up block timings.
"""

import importlib.util
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
# the tests import their shared log samples (bench_samples.py) as a top-level module
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)


def _load(name):
    path = os.path.join(REPO, "scripts", name + ".py")
    key = "_bench_scripts_" + name
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def bench():
    return _load("benchmark")


@pytest.fixture(scope="session")
def diag():
    pytest.importorskip("matplotlib")
    return _load("plot_diagnostics")


@pytest.fixture(scope="session")
def sphere():
    pytest.importorskip("matplotlib")
    return _load("adversary_sphere")
