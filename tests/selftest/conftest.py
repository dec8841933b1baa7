import json
import os
import subprocess
import sys
import types

import pytest
import torch

# Tiny tensors: one thread avoids OpenMP spinning against other processes on 2 cores.
torch.set_num_threads(1)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A folder where the command has run already (scripts/test_gpu.sh runs it first, as its own
#: timed part): report.json, output.txt (stdout and stderr) and returncode; the tests read that
#: run instead of starting another.
ENV_RUN = "VASSO_SELFTEST_RUN"


@pytest.fixture(scope="session")
def selftest_run(tmp_path_factory):
    """One run of ``python -m plugins.lab.selftest --ranks 2 --json ...`` per test session, on
    every device this machine has (the CPU, with two gloo ranks, and each GPU): ``(process,
    report)``, the process's ``returncode``, ``stdout`` and ``stderr``."""
    given = os.environ.get(ENV_RUN)
    if given:
        with open(os.path.join(given, "returncode")) as f:
            returncode = int(f.read())
        with open(os.path.join(given, "output.txt"), encoding="utf-8") as f:
            output = f.read()
        with open(os.path.join(given, "report.json"), encoding="utf-8") as f:
            report = json.load(f)
        assert report["command"][1:] == ["--ranks", "2", "--json", os.path.join(given, "report.json")], (
            f"{ENV_RUN}={given}: not a run of `vasso-selftest --ranks 2 --json {given}/report.json`: "
            f"{report['command']}")
        return types.SimpleNamespace(returncode=returncode, stdout=output, stderr=""), report
    report = tmp_path_factory.mktemp("selftest") / "report.json"
    path = [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, "-m", "plugins.lab.selftest", "--ranks", "2", "--json", str(report)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return proc, json.loads(report.read_text()) if report.exists() else None
