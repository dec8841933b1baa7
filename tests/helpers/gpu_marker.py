"""The ``gpu`` and ``two_gpus`` markers (setup.cfg): a test that needs a CUDA device carries
``gpu``, one that needs two carries ``two_gpus``; each skips where the machine has fewer
(:func:`pytest_runtest_setup`: one reason for each), and ``scripts/test_gpu.sh`` selects them
by these markers (``-m "gpu or two_gpus"``).  A test that skips for lack of a GPU without the
marker fails (:func:`pytest_runtest_makereport`), so that none is left out of that selection:
CI's CPU stages catch it; a ``gpu`` test that skips for lack of a second GPU fails too (it
must carry ``two_gpus``: one GPU is a normal node).  Under ``VASSO_REQUIRE_GPU=1``
(scripts/test_gpu.sh sets it once it found a GPU) a test that skips for lack of a GPU fails,
except a ``two_gpus`` test on a node with one: that one is reported as not run, with its reason.

tests/conftest.py imports these hooks; ``pytest -p gpu_marker`` loads them alone."""

import os
import re

import pytest
import torch

GPU = "gpu"
TWO_GPUS = "two_gpus"
#: The reason a ``gpu`` test skips with where torch sees no CUDA device.
NO_CUDA = "no CUDA device on this machine (a `gpu` test: scripts/test_gpu.sh runs these where there is one)"
#: The reason a ``two_gpus`` test skips with where torch sees fewer than two.
ONE_GPU = ("needs two CUDA devices, this machine has {count} (a `two_gpus` test: scripts/test_gpu.sh runs these "
           "where there are two or more)")
#: How a skip's reason says that the machine lacks a GPU ("no CUDA device", "needs CUDA",
#: "without a GPU", "needs two GPUs"): such a test must carry the ``gpu`` marker.
LACKS_A_GPU = re.compile(r"\b(no|without|needs?|lacks?|requires?)\s+(a |an |any |one |two |\d+ )?"
                         r"(CUDA|GPUs?|NVIDIA)\b", re.IGNORECASE)
#: How it says that the machine lacks a second GPU ("needs two CUDA devices", "2 GPUs"):
#: such a test must carry the ``two_gpus`` marker.
LACKS_A_SECOND_GPU = re.compile(r"\b(two|2|several|multiple)\s+(CUDA\s+devices|GPUs|CUDA)\b", re.IGNORECASE)


def skip_reason(report) -> str:
    """The reason a skipped report gives (pytest keeps it as (path, line, "Skipped: ...")."""
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr or "")
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def gpu_marker_problem(markers, reason: str, gpu_required: bool, device_count: int):
    """What is wrong with a skip for ``reason`` of a test that carries ``markers`` (the names
    of its markers among ``gpu`` and ``two_gpus``) on a machine where torch sees
    ``device_count`` CUDA devices, or None."""
    if not LACKS_A_GPU.search(reason):
        return None
    two = LACKS_A_SECOND_GPU.search(reason) is not None
    if TWO_GPUS not in markers and (two or GPU not in markers):
        marker = TWO_GPUS if two else GPU
        return (f"skipped for lack of {'a second' if two else 'a'} GPU ({reason}) without the `{marker}` marker: "
                f"mark it @pytest.mark.{marker} (setup.cfg), so that scripts/test_gpu.sh runs it where there "
                f"{'are two GPUs' if two else 'is a GPU'}" + (" and reports it as not run on one" if two else ""))
    if gpu_required and not (TWO_GPUS in markers and device_count == 1):
        if device_count == 0:
            return (f"skipped for lack of a GPU ({reason}) although scripts/test_gpu.sh found one: torch sees "
                    "none: is this torch a CUDA build? (python -m torch.utils.collect_env)")
        return f"skipped for lack of a GPU ({reason}) where torch sees {device_count}"
    return None


def _markers(item):
    return {name for name in (GPU, TWO_GPUS) if item.get_closest_marker(name) is not None}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    markers = _markers(item)
    if markers and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    if TWO_GPUS in markers and torch.cuda.device_count() < 2:
        pytest.skip(ONE_GPU.format(count=torch.cuda.device_count()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not LACKS_A_GPU.search(reason):  # (asks torch for its devices only when it matters)
            return
        problem = gpu_marker_problem(_markers(item), reason, os.environ.get("VASSO_REQUIRE_GPU") == "1",
                                     torch.cuda.device_count() if torch.cuda.is_available() else 0)
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
