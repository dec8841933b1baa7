"""The ``gpu`` marker (setup.cfg): a test that needs a CUDA device carries it, skips without
one (:func:`pytest_runtest_setup`: one reason for all), and ``scripts/test_gpu.sh`` selects
the GPU tests by it (``-m gpu``).  A test that skips for lack of a GPU without the marker
fails (:func:`pytest_runtest_makereport`), so that none is left out of that selection: CI's
CPU stages catch it.  Under ``VASSO_REQUIRE_GPU=1`` (scripts/test_gpu.sh sets it where
nvidia-smi lists a GPU) a ``gpu`` test that skips for lack of one fails too.

tests/conftest.py imports these hooks; ``pytest -p gpu_marker`` loads them alone."""

import os
import re

import pytest
import torch

GPU = "gpu"
#: The reason a ``gpu`` test skips with where torch sees no CUDA device.
NO_CUDA = "no CUDA device on this machine (a `gpu` test: scripts/test_gpu.sh runs these where there is one)"
#: How a skip's reason says that the machine lacks a GPU ("no CUDA device", "needs CUDA",
#: "without a GPU", "needs two GPUs"): such a test must carry the ``gpu`` marker.
LACKS_A_GPU = re.compile(r"\b(no|without|needs?|lacks?|requires?)\s+(a |an |any |one |two |\d+ )?"
                         r"(CUDA|GPUs?|NVIDIA)\b", re.IGNORECASE)


def skip_reason(report) -> str:
    """The reason a skipped report gives (pytest keeps it as (path, line, "Skipped: ...")."""
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr or "")
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def gpu_marker_problem(marked: bool, reason: str, gpu_required: bool):
    """What is wrong with a skip for ``reason`` of a test with or without the ``gpu`` marker,
    or None."""
    if not LACKS_A_GPU.search(reason):
        return None
    if not marked:
        return (f"skipped for lack of a GPU ({reason}) without the `gpu` marker: mark it @pytest.mark.gpu "
                "(setup.cfg), so that scripts/test_gpu.sh runs it where there is a GPU")
    if gpu_required:
        return (f"skipped for lack of a GPU ({reason}) although scripts/test_gpu.sh found one with nvidia-smi: "
                "is this torch a CUDA build? (python -m torch.utils.collect_env)")
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker(GPU) is not None and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        problem = gpu_marker_problem(item.get_closest_marker(GPU) is not None, skip_reason(report),
                                     os.environ.get("VASSO_REQUIRE_GPU") == "1")
        if problem:
            report.outcome, report.longrepr = "failed", f"{item.nodeid}: {problem}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:  # a module that skips itself for lack of a GPU: its tests could not carry the marker
        reason = skip_reason(report)
        if LACKS_A_GPU.search(reason):
            report.outcome = "failed"
            report.longrepr = (f"{collector.nodeid} skips itself for lack of a GPU ({reason}): give its tests the "
                               "`gpu` marker instead (pytestmark = pytest.mark.gpu), which skips them without one")
