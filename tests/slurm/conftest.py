"""A private single-node Slurm for the whole session (scripts/local_slurm.sh), stopped by
process id at the end, also when tests fail. The tests skip, giving the reason, when it
cannot be started (no Slurm packages, and not root with apt-get to install them, ...);
VASSO_REQUIRE_SLURM=1 turns that skip into an error (for CI)."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = os.path.join(ROOT, "scripts", "local_slurm.sh")


def _unavailable(reason):
    if os.environ.get("VASSO_REQUIRE_SLURM") == "1":
        pytest.fail(f"VASSO_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


def _recorded_pids(slurm_dir):
    pids = {}
    for name, path in (("munged", "munge/munged.pid"), ("slurmctld", "run/slurmctld.pid"),
                       ("slurmd", "run/slurmd.pid")):
        try:
            with open(os.path.join(slurm_dir, path)) as f:
                pids[name] = int(f.read().strip())
        except (OSError, ValueError):
            pass
    return pids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.fixture(scope="session")
def slurm():
    """``{"conf": path to slurm.conf, "dir": its folder, "env": environment with SLURM_CONF}``."""
    import domainbed_vasso
    try:
        from domainbed_vasso import _locate
        _locate.import_domainbed()
        domainbed_root = domainbed_vasso.domainbed_root()
    except ImportError:
        pytest.skip(_locate.NOT_IMPORTABLE)
    try:
        import submitit  # noqa: F401
    except ImportError:
        _unavailable("submitit is not installed (pip install submitit, or the [slurm] extra)")
    if shutil.which("bash") is None or not sys.platform.startswith("linux"):
        _unavailable("the local Slurm needs Linux and bash")
    # a short path: munge's socket lives there (unix socket paths are limited to ~107 bytes)
    slurm_dir = tempfile.mkdtemp(prefix="vslurm-", dir="/tmp")
    env = dict(os.environ, LOCAL_SLURM_DIR=slurm_dir)
    conf = os.path.join(slurm_dir, "slurm.conf")
    try:
        start = subprocess.run(["bash", SCRIPT, "start"], env=env, capture_output=True, text=True,
                               timeout=600)
        if start.returncode != 0:
            _unavailable("cannot start a local Slurm with scripts/local_slurm.sh: "
                         + (start.stderr.strip() or start.stdout.strip())[-500:])
        pids = _recorded_pids(slurm_dir)
        assert set(pids) == {"munged", "slurmctld", "slurmd"}, pids
        test_env = dict(os.environ, SLURM_CONF=conf, DOMAINBED_ROOT=domainbed_root,
                        DOMAINBED_VASSO_NUM_WORKERS="0", OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join(
                            [ROOT, domainbed_root]
                            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        test_env.pop("DOMAINBED_VASSO_SLURM", None)
        yield {"conf": conf, "dir": slurm_dir, "env": test_env, "pids": pids}
    finally:
        pids = _recorded_pids(slurm_dir)
        subprocess.run(["bash", SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=300)
        left = {name: pid for name, pid in pids.items() if _alive(pid)}
        if not left:
            shutil.rmtree(slurm_dir, ignore_errors=True)
        assert not left, f"scripts/local_slurm.sh stop left {left} running (logs in {slurm_dir}/log)"
