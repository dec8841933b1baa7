"""Helpers of the DomainBed tests: where DomainBed is, and running the entry points."""

import json
import os
import subprocess
import sys
import tempfile
import time

import process_group
from domainbed_vasso._locate import NOT_IMPORTABLE as SKIP_REASON  # the one message, in every test folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _domainbed_root():
    try:
        import domainbed_vasso
        from domainbed_vasso import _locate
        _locate.import_domainbed()
        return domainbed_vasso.domainbed_root()
    except ImportError:
        return None


DOMAINBED = _domainbed_root()

PY = sys.executable
STEPS = 5


def env(**extra):
    e = dict(os.environ)
    e.update(DOMAINBED_ROOT=DOMAINBED or "", DOMAINBED_VASSO_NUM_WORKERS="0", OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join([ROOT, DOMAINBED or ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    e.update(extra)
    return e


# sitecustomize runs after site-packages' .pth files: it takes out every sys.path entry that
# holds a ``domainbed`` package, however it came there (PYTHONPATH, setup_env.sh
# --with-domainbed's .pth file, site-packages), and turns off the locator's look beside the checkout
_NO_DOMAINBED_SITECUSTOMIZE = (
    "import os, sys\n"
    "os.environ['DOMAINBED_VASSO_BESIDE'] = '0'\n"
    "sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or '.', 'domainbed', '__init__.py'))]\n")


def env_without_domainbed(folder, **extra):
    """An environment (dict) whose Pythons, children included, cannot import DomainBed: this
    repository on PYTHONPATH, no DOMAINBED_ROOT, and a sitecustomize (written into ``folder``)
    that hides any installed copy. Checked before it is returned, so that a test that expects
    a missing DomainBed never launches work that would find one (a 90-job sweep)."""
    site_dir = os.path.join(str(folder), "no-domainbed-site")
    os.makedirs(site_dir, exist_ok=True)
    with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
        f.write(_NO_DOMAINBED_SITECUSTOMIZE)
    e = {k: v for k, v in os.environ.items() if k not in ("DOMAINBED_ROOT", "PYTHONPATH")}
    e["PYTHONPATH"] = os.pathsep.join([site_dir, ROOT])
    e.update(extra)
    probe = process_group.run([PY, "-c", "import sys\nfrom domainbed_vasso import _locate\ntry:\n"
                               "    _locate.domainbed_root()\nexcept ImportError:\n    sys.exit(0)\nsys.exit(1)"],
                              env=e, cwd=str(folder), capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, ("DomainBed is still importable in an environment built to lack it: "
                                   f"{probe.stderr[-2000:]}")
    return e


def train_cmd(out, algorithm, hparams, steps=STEPS, dataset="Debug28", seed=1, extra=()):
    return [PY, "-m", "domainbed_vasso.train", "--dataset", dataset, "--algorithm", algorithm,
            "--test_envs", "0", "--steps", str(steps), "--checkpoint_freq", "2", "--seed", str(seed),
            "--output_dir", str(out), "--hparams", json.dumps(hparams), *extra]


def run_all(cmds, parallel=2, timeout=600, cwd=None, **env_extra):
    """Run commands, ``parallel`` at a time, each in its own process group (process_group.popen),
    in ``cwd`` (default: a new temporary folder); return their (exit status, output)."""
    if cwd is None:  # never the checkout: what a command writes to a relative path lands here
        with tempfile.TemporaryDirectory(prefix="domainbed-run-") as tmp:
            return run_all(cmds, parallel, timeout, tmp, **env_extra)
    pending, running, done = list(enumerate(cmds)), [], {}
    start = time.time()
    while pending or running:
        while pending and len(running) < parallel:
            i, cmd = pending.pop(0)
            running.append((i, process_group.popen(cmd, cwd=cwd, env=env(**env_extra), text=True,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        try:
            for item in list(running):
                i, proc = item
                if proc.poll() is not None:
                    done[i] = (proc.returncode, proc.stdout.read())
                    process_group.kill_group(proc)
                    running.remove(item)
            if time.time() - start > timeout:
                raise TimeoutError(f"commands did not finish in {timeout}s")
            time.sleep(0.1)
        except BaseException:  # a timeout or an interrupted test: no command left running
            for _, proc in running:
                process_group.kill_group(proc)
                proc.wait()
            raise
    return [done[i] for i in range(len(cmds))]
