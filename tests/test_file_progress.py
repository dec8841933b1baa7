"""tests/conftest.py's progress lines: under xdist, whose dots name no file, the session says
when each test file starts and when it ends, with its outcomes and time."""

import os
import re
import subprocess
import sys

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
