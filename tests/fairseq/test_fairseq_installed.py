"""The package pip-installed elsewhere works with --user-dir pointing at the
installed folder (found with ``python -c "import fairseq_vasso, os;
print(os.path.dirname(fairseq_vasso.__file__))"``), outside the repository."""

import os
import sys

import cpu_only
import process_group
import pytest
from checkout import copy_clone

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)


def test_installed_user_dir_trains_outside_the_repo(toy_data, tmp_path, fs):
    target = tmp_path / "site"
    # from a copy of the clone: pip builds in the source folder (build/, *.egg-info)
    source = copy_clone(str(tmp_path / "clone"), str(fs.REPO))
    pip = process_group.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", str(target), source], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"cannot build the package here: {pip.stderr[-500:]}")
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    where = process_group.run([sys.executable, "-c", "import fairseq_vasso, os; print(os.path.dirname(fairseq_vasso.__file__))"],
                             cwd=str(tmp_path), env=env, capture_output=True, text=True)
    user_dir = where.stdout.strip()
    assert user_dir == str(target / "fairseq_vasso"), where.stderr[-1000:]
    argv = fs.model_args(toy_data, tmp_path / "ck", max_update=3, extra=["--rho", "0.1", "--log-format", "simple"])
    argv[argv.index("--user-dir") + 1] = user_dir
    run = process_group.run([sys.executable, "-m", "fairseq_cli.train", *argv], cwd=str(tmp_path),
                            env=cpu_only.env(env), capture_output=True, text=True, timeout=300)
    text = run.stdout + run.stderr
    assert "done training" in text, text[-3000:]  # (fairseq may abort at exit after this line)
    assert "ascent_norm=0.1" in text and "num_updates=3" in text
