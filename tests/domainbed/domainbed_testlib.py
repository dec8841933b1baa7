"""Helpers of the DomainBed tests: where DomainBed is, and running the entry points."""

import json
import os
import subprocess
import sys
import time

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


def train_cmd(out, algorithm, hparams, steps=STEPS, dataset="Debug28", seed=1, extra=()):
    return [PY, "-m", "domainbed_vasso.train", "--dataset", dataset, "--algorithm", algorithm,
            "--test_envs", "0", "--steps", str(steps), "--checkpoint_freq", "2", "--seed", str(seed),
            "--output_dir", str(out), "--hparams", json.dumps(hparams), *extra]


def run_all(cmds, parallel=2, timeout=600, **env_extra):
    """Run commands, ``parallel`` at a time; return their CompletedProcess-like results."""
    pending, running, done = list(enumerate(cmds)), [], {}
    start = time.time()
    while pending or running:
        while pending and len(running) < parallel:
            i, cmd = pending.pop(0)
            running.append((i, subprocess.Popen(cmd, cwd=ROOT, env=env(**env_extra), text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        for item in list(running):
            i, proc = item
            if proc.poll() is not None:
                done[i] = (proc.returncode, proc.stdout.read())
                running.remove(item)
        if time.time() - start > timeout:
            for _, proc in running:
                proc.kill()
            raise TimeoutError(f"commands did not finish in {timeout}s")
        time.sleep(0.1)
    return [done[i] for i in range(len(cmds))]
