"""tests/conftest.py's guard of the ``gpu`` marker (tests/helpers/gpu_marker.py), on a small
generated test file run by pytest in a subprocess: a test that skips for lack of a GPU
without the marker fails, one with it skips where torch sees no CUDA device, any other skip
stays a skip; under VASSO_REQUIRE_GPU=1 a ``gpu`` test that skips for lack of one fails."""

import os
import sys

import process_group
import torch

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
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
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
    selected = _outcomes(_pytest(tmp_path, "-m", "gpu", "test_generated.py").stdout)
    assert set(selected) == {"test_marked_skipif", "test_marked_runs_where_cuda_is"}


def test_where_a_gpu_is_required_a_gpu_test_that_skips_for_lack_of_one_fails(tmp_path):
    (tmp_path / "test_generated.py").write_text(GENERATED)
    proc = _pytest(tmp_path, "-m", "gpu", "test_generated.py", VASSO_REQUIRE_GPU="1")
    got = _outcomes(proc.stdout)
    assert got["test_marked_skipif"] == "ERROR", proc.stdout[-4000:]  # skipped in its set-up
    assert got["test_marked_runs_where_cuda_is"] == ("PASSED" if torch.cuda.is_available() else "ERROR")
    assert "although scripts/test_gpu.sh found one" in proc.stdout and proc.returncode == 1


def test_a_module_that_skips_itself_for_lack_of_a_gpu_is_an_error(tmp_path):
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    proc = _pytest(tmp_path, "test_module_skip.py")
    assert proc.returncode != 0 and "give its tests the `gpu` marker instead" in proc.stdout, proc.stdout[-3000:]
