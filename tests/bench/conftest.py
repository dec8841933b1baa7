"""Fixtures for the tests of the benchmark (plugins.lab.bench, vasso_bench.fairseq_runs,
scripts/benchmark/benchmark.py) and of the plots (plugins.lab.plot).

Nothing here times anything: the benchmark's logic runs on tiny models for 1-3
updates and its ratios are checked on made-up block timings.
"""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def diag():
    pytest.importorskip("matplotlib")
    from plugins.lab.plot import diagnostics

    return diagnostics


@pytest.fixture(scope="session")
def sphere():
    pytest.importorskip("matplotlib")
    from plugins.lab.plot import sphere

    return sphere
