"""The suite's guard of the user's files: no test may write into the checkout. Each test
runs in its own temporary folder (a relative output path lands there), and:

At the start of a session it records every untracked file of the checkout, ignored or
not (``runs/``, ``data/``, ``out/``, ``sweep/``, a stray ``diagnostics.png``: where a
user's results live), with its size and modification time; at the end, after every
fixture was torn down, it lists what appeared, changed or disappeared there. The
environment (``.venv``), Python's caches and pip's metadata are left out.

With ``VASSO_CHECKOUT_GUARD=strict`` (CI sets it: a fresh clone where nothing else
writes) such a change fails the session. Otherwise it is reported at the end of the
summary and the exit status is left alone, since a user may run the suite while a demo
or a sweep of theirs writes into the same checkout.

And the guard of the GPU tests: a test that needs a CUDA device carries the ``gpu`` marker
(setup.cfg), skips without one (tests/helpers/gpu_marker.py: one reason for all), and ``scripts/test_gpu.sh``
selects the GPU tests by it (``-m gpu``). A test that skips for lack of a GPU without the
marker fails, so that none is left out of that selection (CI's CPU stages catch it); under
``VASSO_REQUIRE_GPU=1`` (scripts/test_gpu.sh, where nvidia-smi lists a GPU) a ``gpu`` test
that skips for lack of one fails too.
"""

import os

import pytest
from checkout import REPO, changes, untracked_files
# the gpu marker's hooks, defined in tests/helpers/gpu_marker.py (tests/test_gpu_marker.py runs them on their own)
from gpu_marker import pytest_make_collect_report, pytest_runtest_makereport, pytest_runtest_setup  # noqa: F401


@pytest.fixture(autouse=True)
def _cwd_outside_the_checkout(tmp_path, monkeypatch):
    """Every test runs in its own temporary folder: a relative path that a test, or a command
    it starts, writes to (a tool's default output: runs/demo, diagnostics.png, checkpoints/)
    lands there, never in the checkout. (Session and module fixtures are set up before this
    and name their folders themselves.)"""
    monkeypatch.chdir(tmp_path)


def pytest_sessionstart(session):
    session.config._vasso_untracked = untracked_files()


@pytest.hookimpl(trylast=True)  # after the session fixtures' teardown
def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "_vasso_untracked", None)
    if before is None:
        return
    found = changes(before, untracked_files())
    session.config._vasso_checkout_changes = found
    if found and os.environ.get("VASSO_CHECKOUT_GUARD") == "strict" and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    found = getattr(config, "_vasso_checkout_changes", None)
    if not found:
        return
    strict = os.environ.get("VASSO_CHECKOUT_GUARD") == "strict"
    terminalreporter.section("files of the checkout written during the session", sep="=", red=strict,
                             yellow=not strict)
    terminalreporter.line("Untracked files of the checkout appeared, changed or disappeared while the tests ran "
                          f"({REPO}). A test must write only in its own temporary folders"
                          + ("; VASSO_CHECKOUT_GUARD=strict: the session fails." if strict else
                             "; if nothing else was writing there, a test did (VASSO_CHECKOUT_GUARD=strict "
                             "makes this fail the session, as CI does)."))
    for line in found[:50]:
        terminalreporter.line("  " + line)
    if len(found) > 50:
        terminalreporter.line(f"  ... and {len(found) - 50} more")
