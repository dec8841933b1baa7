"""scripts/wheelhouse.sh refuses, before any work (the folder not even made), to compile
fairseq-fixed with a Python that cannot make a wheel the node loads: another Python version,
no torch (nor numpy, cython), or another torch than the node's (--torch); each refusal names
PYTHON. And an index it cannot reach is said to be that, not a missing wheel.

No network: pip is given no index (PIP_NO_INDEX), so that it finds no fairseq-fixed wheel, as
PyPI has none for the Pythons here; the network case cuts it (``unshare -n``)."""

import os
import subprocess
import sys

import process_group
import pytest
import torch
from checkout import REPO

WHEELHOUSE = os.path.join(REPO, "scripts", "wheelhouse.sh")
HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"
OTHER = f"{sys.version_info[0]}.{sys.version_info[1] + 1}"


def run(folder, *args, python=sys.executable, prefix=(), **pip_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHON=str(python), **(pip_env or {"PIP_NO_INDEX": "1"}))
    return process_group.run([*prefix, "bash", WHEELHOUSE, str(folder), "--platform", "manylinux_2_28_x86_64", *args],
                             env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def python_without_torch(tmp_path):
    """A Python with pip and nothing else: a venv of this one's base, pip linked in alone."""
    import pip

    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    only_pip = tmp_path / "only-pip"
    only_pip.mkdir()
    (only_pip / "pip").symlink_to(os.path.dirname(pip.__file__))
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "only_pip.pth"), "w") as f:
        f.write(str(only_pip) + "\n")
    return venv / "bin" / "python"


def refused(proc, folder):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not folder.exists()  # before any work
    assert "is there a wheel of fairseq-fixed==" in proc.stdout and "will be compiled here" not in proc.stdout
    return proc.stderr.strip().splitlines()[-1]


def test_a_builder_without_torch_is_refused_naming_python(tmp_path, python_without_torch):
    folder = tmp_path / "wheels"
    said = refused(run(folder, "--python-version", HERE, "--torch", "2.11.0", python=python_without_torch), folder)
    assert f"must be compiled here, against the node's torch, and {python_without_torch} cannot: it lacks torch, " \
           "numpy, Cython" in said
    assert f"PYTHON=/path/to/python{HERE} with the node's torch (2.11.0), numpy and cython" in said


def test_a_builder_with_another_torch_than_the_nodes_is_refused(tmp_path):
    folder = tmp_path / "wheels"
    said = refused(run(folder, "--python-version", HERE, "--torch", "0.0.1"), folder)
    assert f"its torch is {torch.__version__}, the node's (--torch) 0.0.1" in said and "PYTHON=" in said


def test_a_builder_of_another_python_version_is_refused(tmp_path):
    folder = tmp_path / "wheels"
    said = refused(run(folder, "--python-version", OTHER), folder)
    assert f"must be compiled here, by a Python {OTHER}; {sys.executable} is {HERE}" in said
    assert f"PYTHON=/path/to/python{OTHER}" in said


def test_an_index_out_of_reach_is_said_to_be_that(tmp_path):
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not allowed here: the network cannot be cut")
    folder = tmp_path / "wheels"
    proc = run(folder, "--python-version", HERE, prefix=["unshare", "-n"], PIP_INDEX_URL="https://pypi.org/simple",
               PIP_RETRIES="0", PIP_TIMEOUT="5")
    assert proc.returncode == 1 and not folder.exists(), proc.stderr[-2000:]
    assert "could not ask the index about fairseq-fixed==" in proc.stderr and "Could not fetch URL" in proc.stderr


def test_a_constraint_file_that_is_not_there_is_refused_before_any_work(tmp_path):
    folder = tmp_path / "wheels"
    missing = tmp_path / "node-constraints.txt"
    proc = run(folder, "--python-version", HERE, "--constraint", missing)
    assert proc.returncode == 2 and not folder.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == ""  # before the index is asked anything
    assert proc.stderr.strip() == f"wheelhouse.sh: --constraint needs a file of pip constraints, got '{missing}'"
