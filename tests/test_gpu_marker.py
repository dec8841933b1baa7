"""tests/conftest.py's guard of the ``gpu`` and ``two_gpus`` markers (tests/helpers/gpu_marker.py),
on small generated test files run by pytest in a subprocess: a test that skips for lack of a GPU
without the marker fails, one with it skips where torch sees no CUDA device, any other skip
stays a skip; under VASSO_REQUIRE_GPU=1 a ``gpu`` test that skips for lack of one fails.  And on
a node of one, two or no GPUs (torch's device count faked by the generated folder's conftest.py:
the marker's logic on a CPU), what scripts/test_gpu.sh's selection reports."""

import os
import re
import sys

import gpu_marker
import process_group
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")

GENERATED = '''
import pytest
import torch


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_unmarked_skipif():
    pass


def test_unmarked_skip_in_the_body():
    pytest.skip("no GPU here, so the training tests did not run")


@pytest.fixture
def two_gpus():
    pytest.skip("needs two GPUs")


def test_unmarked_skip_in_a_fixture(two_gpus):
    pass


@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_marked_skipif():
    pass


@pytest.mark.gpu
def test_marked_runs_where_cuda_is():
    assert torch.cuda.is_available()


def test_other_skip():
    pytest.skip("fairseq is not installed")


def test_plain():
    pass
'''

MODULE_SKIP = '''
import pytest

pytest.skip("no CUDA device", allow_module_level=True)


def test_never_collected():
    pass
'''


def _pytest(folder, *args, **env):
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n"
                                       "    two_gpus: needs two CUDA devices\n")
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")]), **env)
    if "VASSO_REQUIRE_GPU" not in env:
        e.pop("VASSO_REQUIRE_GPU", None)
    return process_group.run([sys.executable, "-m", "pytest", "-p", "gpu_marker", "-p", "no:cacheprovider", "-v", "-rs",
                              *args], cwd=folder, env=e, capture_output=True, text=True, timeout=300)


def _outcomes(stdout):
    """test name -> PASSED / FAILED / SKIPPED / ERROR (a failure in set-up), from -v's lines."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            out[parts[0].split("::")[1]] = parts[1]
    return out


def test_a_skip_for_lack_of_a_gpu_fails_without_the_gpu_marker(tmp_path):
    (tmp_path / "test_generated.py").write_text(GENERATED)
    proc = _pytest(tmp_path, "test_generated.py")
    got = _outcomes(proc.stdout)
    cuda = torch.cuda.is_available()
    assert got == {"test_unmarked_skipif": "ERROR", "test_unmarked_skip_in_the_body": "FAILED",
                   "test_unmarked_skip_in_a_fixture": "ERROR", "test_marked_skipif": "SKIPPED",
                   "test_marked_runs_where_cuda_is": "PASSED" if cuda else "SKIPPED",
                   "test_other_skip": "SKIPPED", "test_plain": "PASSED"}, proc.stdout[-4000:]
    assert proc.returncode == 1
    assert "without the `gpu` marker: mark it @pytest.mark.gpu" in proc.stdout
    if not cuda:
        assert "no CUDA device on this machine (a `gpu` test" in proc.stdout
    # scripts/test_gpu.sh's selection: only the marked ones
    selected = _outcomes(_pytest(tmp_path, "-m", gpu_check_selection(), "test_generated.py").stdout)
    assert set(selected) == {"test_marked_skipif", "test_marked_runs_where_cuda_is"}


def test_where_a_gpu_is_required_a_gpu_test_that_skips_for_lack_of_one_fails(tmp_path):
    (tmp_path / "test_generated.py").write_text(GENERATED)
    proc = _pytest(tmp_path, "-m", gpu_check_selection(), "test_generated.py", VASSO_REQUIRE_GPU="1")
    got = _outcomes(proc.stdout)
    assert got["test_marked_skipif"] == "ERROR", proc.stdout[-4000:]  # skipped in its set-up
    assert got["test_marked_runs_where_cuda_is"] == ("PASSED" if torch.cuda.is_available() else "ERROR")
    assert "although scripts/test_gpu.sh found one" in proc.stdout and proc.returncode == 1


def test_a_module_that_skips_itself_for_lack_of_a_gpu_is_an_error(tmp_path):
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    proc = _pytest(tmp_path, "test_module_skip.py")
    assert proc.returncode != 0 and "give its tests the `gpu` marker instead" in proc.stdout, proc.stdout[-3000:]


# ---------------------------------------------------------------- one GPU is a normal node

#: torch's view of the devices, as the environment's FAKE_CUDA_DEVICES says (the hooks ask torch.cuda
#: at run time); the tests themselves only look, so nothing runs on a device that is not there
FAKE_DEVICES = """
import os

import torch

_count = int(os.environ["FAKE_CUDA_DEVICES"])
torch.cuda.is_available = lambda: _count > 0
torch.cuda.device_count = lambda: _count
"""

WELL_MARKED = """
import pytest
import torch


@pytest.mark.gpu
def test_needs_a_gpu():
    assert torch.cuda.device_count() >= 1


@pytest.mark.two_gpus
def test_needs_two_gpus():
    assert torch.cuda.device_count() >= 2


def test_plain():
    pass
"""

WRONGLY_MARKED = """
import pytest
import torch


@pytest.mark.gpu
def test_a_gpu_test_that_skips_for_a_second_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


def test_unmarked_skip_for_a_second_gpu():
    pytest.skip("needs 2 GPUs")
"""


def gpu_check_selection():
    """scripts/test_gpu.sh's -m expression (part 2), which the tests here run as it does."""
    with open(os.path.join(REPO, "scripts", "test_gpu.sh"), encoding="utf-8") as f:
        found = set(re.findall(r'-m "([^"]+)"', f.read()))  # its command, and its --help saying it
    assert len(found) == 1, found
    return found.pop()


def test_the_gpu_check_selects_the_tests_of_either_marker():
    assert gpu_check_selection() == "gpu or two_gpus"


def _on_gpus(folder, count, *args, required=True):
    (folder / "conftest.py").write_text(FAKE_DEVICES)
    env = dict(FAKE_CUDA_DEVICES=str(count), **({"VASSO_REQUIRE_GPU": "1"} if required else {}))
    return _pytest(folder, "-m", gpu_check_selection(), *args, **env)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_on_one_gpu_the_two_gpu_tests_are_reported_not_run_and_the_check_passes(tmp_path, count):
    (tmp_path / "test_generated.py").write_text(WELL_MARKED)
    proc = _on_gpus(tmp_path, count, "test_generated.py")
    got = _outcomes(proc.stdout)
    assert got == {"test_needs_a_gpu": "PASSED",
                   "test_needs_two_gpus": "SKIPPED" if count == 1 else "PASSED"}, proc.stdout[-4000:]
    assert proc.returncode == 0, proc.stdout[-4000:]
    if count == 1:  # -rs's summary names the reason
        assert re.search(r"SKIPPED \[1\] .*needs two CUDA devices, this machine has 1 \(a `two_gpus` test",
                         proc.stdout), proc.stdout[-3000:]


def test_on_a_node_whose_torch_sees_no_gpu_every_gpu_test_fails_under_the_check(tmp_path):
    (tmp_path / "test_generated.py").write_text(WELL_MARKED)
    proc = _on_gpus(tmp_path, 0, "test_generated.py")
    assert _outcomes(proc.stdout) == {"test_needs_a_gpu": "ERROR", "test_needs_two_gpus": "ERROR"}, proc.stdout[-4000:]
    assert proc.stdout.count("torch sees none: is this torch a CUDA build?") == 2 and proc.returncode == 1
    # outside the check (no VASSO_REQUIRE_GPU), skips
    proc = _on_gpus(tmp_path, 0, "test_generated.py", required=False)
    assert _outcomes(proc.stdout) == {"test_needs_a_gpu": "SKIPPED", "test_needs_two_gpus": "SKIPPED"}
    assert proc.returncode == 0


@pytest.mark.parametrize("required", [True, False], ids=["in the check", "outside it"])
def test_a_skip_for_lack_of_a_second_gpu_without_the_two_gpus_marker_fails(tmp_path, required):
    (tmp_path / "test_generated.py").write_text(WRONGLY_MARKED)
    proc = _on_gpus(tmp_path, 1, "test_generated.py", required=required)
    assert _outcomes(proc.stdout) == {"test_a_gpu_test_that_skips_for_a_second_gpu": "FAILED"}, proc.stdout[-4000:]
    assert "without the `two_gpus` marker: mark it @pytest.mark.two_gpus" in proc.stdout and proc.returncode == 1
    # and CI's CPU stages catch the unmarked one (no selection, no GPU)
    proc = _pytest(tmp_path, "test_generated.py", FAKE_CUDA_DEVICES="0")
    assert _outcomes(proc.stdout) == {"test_a_gpu_test_that_skips_for_a_second_gpu": "SKIPPED",
                                      "test_unmarked_skip_for_a_second_gpu": "FAILED"}, proc.stdout[-4000:]
    assert "without the `two_gpus` marker" in proc.stdout


@pytest.mark.parametrize("markers, reason, required, count, problem", [
    ((), "fairseq is not installed", True, 1, None),
    ((), "needs a CUDA device", False, 0, "without the `gpu` marker"),
    ((), "needs two GPUs", False, 0, "without the `two_gpus` marker"),
    (("gpu",), gpu_marker.NO_CUDA, False, 0, None),
    (("gpu",), gpu_marker.NO_CUDA, True, 0, "torch sees none"),
    (("gpu",), "needs two CUDA devices", False, 1, "without the `two_gpus` marker"),
    (("gpu",), "needs a CUDA device", True, 1, "where torch sees 1"),
    (("two_gpus",), gpu_marker.ONE_GPU.format(count=1), True, 1, None),  # one GPU: reported as not run
    (("two_gpus",), gpu_marker.ONE_GPU.format(count=0), False, 0, None),
    (("two_gpus",), gpu_marker.NO_CUDA, True, 0, "torch sees none"),
    (("two_gpus",), "needs two CUDA devices", True, 2, "where torch sees 2"),
    (("gpu", "two_gpus"), gpu_marker.ONE_GPU.format(count=1), True, 1, None),
])
def test_what_a_skip_for_lack_of_a_gpu_is_judged(markers, reason, required, count, problem):
    found = gpu_marker.gpu_marker_problem(set(markers), reason, required, count)
    assert (found is None) if problem is None else (problem in (found or "")), found
