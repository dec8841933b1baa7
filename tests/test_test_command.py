"""The README's test command: scripts/test.sh runs pytest with one worker more than the
cores, and tests/conftest.py says, under xdist, whose dots name no file, when each test file
starts and ends, and keeps torch's inductor cache folder in one of the session's own."""

import os
import re
import subprocess
import sys

import pytest

from checkout import REPO

FILES = ["tests/core/test_named_params.py", "tests/core/test_arguments.py"]


def test_each_file_is_named_when_it_starts_and_when_it_ends():
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                          *FILES], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for file in FILES:
        lines = out.stdout.splitlines()
        started = [i for i, line in enumerate(lines) if line == f"{file}: started"]
        ended = [i for i, line in enumerate(lines) if re.fullmatch(re.escape(file) + r": \d+ passed in \d+ s", line)]
        assert len(started) == 1 and len(ended) == 1 and started[0] < ended[0], (file, out.stdout[-3000:])


def test_the_test_command_runs_one_pytest_worker_more_than_the_cores(tmp_path):
    # scripts/test.sh adds pytest-xdist's workers, one more than the cores this process may use (at most 8),
    # whatever OMP_NUM_THREADS says (the quick start exports 1, and nproc counts it), and none where
    # the arguments choose. Its environment is a stand-in: a python that prints its arguments, in a
    # venv that setup_env.sh finds ready (its stamp), so nothing is installed
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: the test command runs one pytest process")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\necho "python $*"\n')
    (venv / "bin" / "python").chmod(0o755)
    stamp = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup_env.sh"), "--stamp"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert re.fullmatch(r"[0-9a-f]{16}\n", stamp), stamp
    (venv / ".vasso-setup-stamp").write_text(stamp)

    def run(*args):
        env = dict(os.environ, VENV=str(venv), OMP_NUM_THREADS="1", DOMAINBED_ROOT="unused")
        out = subprocess.run(["bash", os.path.join(REPO, "scripts", "test.sh"), *args], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "packages up to date" in out.stdout, out.stdout + out.stderr
        return out.stdout.splitlines()[-1]

    assert run("-ra") == f"python -m pytest -n {min(cores + 1, 8)} --dist loadfile -ra"
    assert run("-ra", "-n", "0") == "python -m pytest -ra -n 0"
    assert run("--pdb", "tests/core") == "python -m pytest --pdb tests/core"


def test_torchs_inductor_cache_folder_stays_in_the_sessions_own(tmp_path, pytestconfig):
    # importing torch._dynamo makes <tmp>/torchinductor_<user> at once (torchvision, DCP and
    # DomainBed's scripts import it): tests/conftest.py points the session, and the commands its
    # tests start, at a folder of its own
    conftest = pytestconfig.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    if conftest.INDUCTOR_CACHE is None:
        pytest.skip("TORCHINDUCTOR_CACHE_DIR was set before the session: the user's folder")
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert cache == conftest.INDUCTOR_CACHE
    system_tmp = tmp_path / "tmp"
    system_tmp.mkdir()
    out = subprocess.run([sys.executable, "-c", "import torch._dynamo"], env=dict(os.environ, TMPDIR=str(system_tmp)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(system_tmp.iterdir()) == []
    assert os.path.isdir(cache)
