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

And the guard of the GPU tests: a test that needs a CUDA device carries the ``gpu`` marker,
one that needs two the ``two_gpus`` marker (setup.cfg); each skips where the machine has fewer
(tests/helpers/gpu_marker.py: one reason for each), and ``scripts/test_gpu.sh`` selects the GPU
tests by them. A test that skips for lack of a GPU without its marker fails, so that none is
left out of that selection (CI's CPU stages catch it); under ``VASSO_REQUIRE_GPU=1``
(scripts/test_gpu.sh, once it found a GPU) a test that skips for lack of one fails too, except
a ``two_gpus`` test on a one-GPU node, which is reported as not run.

And the order of the files on the test command's xdist workers (``--dist loadfile``: each file
on one worker, its module and session fixtures built once there): the files that take minutes
start first, longest first (``LONGEST_FIRST``), so that no worker is left with one of them
at the end while the others idle; the files that share a session fixture which takes minutes
to build run on the same worker (``SAME_WORKER``), so that it is built once.

And a line when each test file starts (under xdist, whose dots name no file) and one when it
ends, with its wall time and outcomes (``_FileProgress``): some files take minutes.

And torch's inductor cache folder: importing ``torch._dynamo`` (torchvision does, and
``torch.distributed.checkpoint``) makes ``<tmp>/torchinductor_<user>`` at once, outside every
test's folder. The session points ``TORCHINDUCTOR_CACHE_DIR`` (unless the user set it) at a
folder of its own, which its workers and the commands its tests start inherit, and removes
it at the end.
"""

import atexit
import os
import shutil
import tempfile
import time

import pytest
from checkout import REPO, changes, untracked_files
# the gpu marker's hooks, defined in tests/helpers/gpu_marker.py (tests/test_gpu_marker.py runs them on their own)
from gpu_marker import pytest_make_collect_report, pytest_runtest_makereport, pytest_runtest_setup  # noqa: F401

#: the session's inductor cache folder (None: the user named one), made before any test imports
#: torch._dynamo by the process that loads this file first (xdist's controller), which removes it;
#: its workers and the commands its tests start inherit it
_INDUCTOR_PREFIX = "vasso-tests-inductor-"
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=_INDUCTOR_PREFIX)
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
INDUCTOR_CACHE = os.environ["TORCHINDUCTOR_CACHE_DIR"]
if not os.path.basename(INDUCTOR_CACHE).startswith(_INDUCTOR_PREFIX):
    INDUCTOR_CACHE = None


# The files that take longest in the README's test command (their wall time in a CI run on 2
# cores of an Intel Xeon, beside the other workers: the docs' commands on their own pool of two,
# Slurm's sweeps, the demos, ranks training side by side, fairseq's and DomainBed's own suites,
# commands that each import torch): started first, in this order. A name that no longer exists
# fails the session (pytest_configure), so that the list follows the files.
LONGEST_FIRST = [
    "tests/docs/test_docs_commands.py",  # 773
    "tests/scripts/test_demo.py",  # 677 with test_eval_bleu.py (SAME_WORKER): demo_run, a nudged train, a resume
    "tests/slurm/test_slurm_sweep.py",  # 473
    "tests/fairseq/test_fairseq_sharding.py",  # 282
    "tests/domainbed/test_domainbed_end_to_end.py",  # 250
    "tests/scripts/test_demo_readme.py",  # 233 on AMD (one demo run of 320 updates); skips elsewhere
    "tests/fairseq/test_fairseq_own_suite.py",  # 157
    "tests/domainbed/test_domainbed_own_suite.py",  # 130
    "tests/domainbed/test_domainbed_entry_points.py",  # 99
    "tests/fairseq/test_fairseq_fp16.py",  # 88
    "tests/test_gpu_marker.py",  # 74
    "tests/domainbed/test_domainbed_register.py",  # 74
    "tests/domainbed/test_domainbed_hparam_keys.py",  # 73
    "tests/distributed/test_sharded_step.py",  # 64
    "tests/selftest/test_selftest_command.py",  # 59
    "tests/distributed/test_state_checkpoints.py",  # 57
    "tests/distributed/test_sharded_checks.py",  # 52
    "tests/fairseq/test_fairseq_hooks.py",  # 47
    "tests/scripts/test_gpu_offline_install.py",  # 42
    "tests/fairseq/test_fairseq_distributed.py",  # 41
    "tests/fairseq/test_fairseq_foreign_warnings.py",  # 37
    "tests/distributed/test_flat_shards.py",  # 33
    "tests/digits/test_digits.py",  # 30
    "tests/test_test_command.py",  # 29
    "tests/bench/test_device.py",  # 23
]
# Files whose tests share a session fixture of minutes: one worker runs them all, one after the
# other (tests/scripts/conftest.py's demo_run)
SAME_WORKER = {
    "tests/scripts/test_demo.py": "tests/scripts: demo_run",
    "tests/scripts/test_eval_bleu.py": "tests/scripts: demo_run",
}


def _unit(nodeid):
    """The unit of work of a test on CI's workers: its file, or its SAME_WORKER group."""
    file = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(file, file)


_RANK = {_unit(file): rank for rank, file in reversed(list(enumerate(LONGEST_FIRST)))}


def pytest_configure(config):
    stale = [f for f in LONGEST_FIRST + list(SAME_WORKER) if not os.path.isfile(os.path.join(REPO, f))]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py names test files that do not exist: {stale}")
    if not hasattr(config, "workerinput") and config.option.verbose >= 0:  # where the terminal is; not with -q
        config.pluginmanager.register(_FileProgress(config), "vasso-file-progress")


class _FileProgress:
    """Writes ``FILE: started`` when a file's first test starts (under xdist only: pytest names
    the file itself without it) and ``FILE: N passed, ... in S s`` when its last test ends, on the
    terminal of the session (xdist's controller forwards its workers' test events)."""

    def __init__(self, config):
        self.config = config
        self.xdist = bool(getattr(config.option, "numprocesses", None))
        self.total, self.done, self.start, self.outcomes = {}, {}, {}, {}

    def _line(self, text):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):
                reporter.write("\n")  # after xdist's dots, which leave no file open for write_line to end
            reporter.write_line(text)

    def _count(self, nodeids):
        if not self.total:  # every xdist worker collects the same tests
            for nodeid in nodeids:
                file = nodeid.split("::", 1)[0]
                self.total[file] = self.total.get(file, 0) + 1

    def pytest_collection_finish(self, session):
        self._count(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self._count(ids)

    def pytest_runtest_logstart(self, nodeid, location):
        file = nodeid.split("::", 1)[0]
        if file not in self.start:
            self.start[file] = time.monotonic()
            if self.xdist:
                self._line(f"{file}: started")

    def pytest_runtest_logreport(self, report):
        outcomes = self.outcomes.setdefault(report.nodeid.split("::", 1)[0], {})
        if report.failed:
            outcomes[report.nodeid] = "failed" if report.when == "call" else "error"
        elif report.when == "call" or report.skipped:
            outcomes.setdefault(report.nodeid, report.outcome)

    def pytest_runtest_logfinish(self, nodeid, location):
        file = nodeid.split("::", 1)[0]
        self.done[file] = self.done.get(file, 0) + 1
        if self.done[file] == self.total.get(file):
            counts = {}
            for outcome in self.outcomes.get(file, {}).values():
                counts[outcome] = counts.get(outcome, 0) + 1
            shown = ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "no outcome"
            self._line(f"{file}: {shown} in {time.monotonic() - self.start[file]:.0f} s")


def _loadfile(config):
    return getattr(config.option, "dist", None) == "loadfile"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with SAME_WORKER's groups as units, in the order of the workers'
    collection (pytest_collection_modifyitems: LONGEST_FIRST first), not xdist's (most
    tests first, which leaves a file of two long tests to the end)."""
    if not _loadfile(config):
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return _unit(nodeid)

    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.6
        config.option.loadscopereorder = False
    return Scheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    if hasattr(config, "workerinput"):  # on an xdist worker (whose --dist reads "no"): the order the scheduler gets
        order = {}
        for item in items:
            order.setdefault(_unit(item.nodeid), len(order))
        items.sort(key=lambda item: (_RANK.get(_unit(item.nodeid), len(_RANK)), order[_unit(item.nodeid)]))


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
