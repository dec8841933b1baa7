"""Shared by the IWSLT-14 recipe, the BLEU evaluation and the demo.

* ``METHODS``: the rows of the paper's table ``tab.nmt`` and the fairseq
  optimizer flags that select each (``--optimizer adam`` is fairseq's AdamW:
  decoupled weight decay), with the paper's test BLEU;
* where the fairseq console scripts and the ``fairseq_vasso`` user-dir are;
* ``run_logged``: run a fairseq command with its output in a log file, and judge
  a ``fairseq-train`` run by its log: with some torch/fairseq builds the process
  aborts at exit (rc 134, "terminate called without an active exception") after
  it logged "done training" and saved its checkpoints; such a run is a success.
"""

import collections
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Method = collections.namedtuple("Method", "name label paper_bleu flags")


def _method(name, label, paper_bleu, flags):
    return Method(name, label, paper_bleu, tuple(flags))


# rho = 0.1 for every sharpness-aware row: "Hyperparameter rho is tuned for SAM from
# {0.01, 0.05, 0.1, 0.2}, and rho = 0.1 performs the best. The same rho is picked for
# ASAM and VASSO." (paper, Sec. 5).  "{rho}" is filled in by method_flags().
METHODS = collections.OrderedDict(
    (m.name, m)
    for m in [
        _method("adamw", "AdamW", 34.66, ["--optimizer", "adam"]),
        _method("sam", "SAM", 34.75, ["--optimizer", "sam", "--rho", "{rho}"]),
        _method("asam", "ASAM", 34.76, ["--optimizer", "sam", "--adaptive", "--rho", "{rho}"]),
        _method("vasso0.9", "VASSO (theta=0.9)", 34.81, ["--optimizer", "vasso", "--rho", "{rho}", "--theta", "0.9"]),
        _method("vasso0.4", "VASSO (theta=0.4)", 34.88, ["--optimizer", "vasso", "--rho", "{rho}", "--theta", "0.4"]),
    ]
)
PAPER_RHO = 0.1


def method_flags(name, rho=PAPER_RHO):
    return [f.format(rho=rho) for f in METHODS[name].flags]


def fairseq_bin(name):
    """The fairseq console script next to this Python (a venv's bin/), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(here):
        return here
    found = shutil.which(name)
    if not found:
        raise SystemExit("%s not found: install fairseq into this Python's environment" % name)
    return found


def default_user_dir():
    """The fairseq_vasso user-dir: the repository's folder, else the installed package's."""
    here = os.path.join(REPO, "fairseq_vasso")
    if os.path.exists(os.path.join(here, "__init__.py")):
        return here
    try:
        import importlib.util

        spec = importlib.util.find_spec("fairseq_vasso")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise SystemExit("fairseq_vasso not found: run from the repository or pip-install it, or pass --user-dir")
    return os.path.dirname(spec.origin)


def shell_join(cmd):
    import shlex

    return " ".join(shlex.quote(c) for c in cmd)


def run_logged(cmd, log_path, env=None, cwd=None):
    """Runs cmd with stdout+stderr in log_path; returns the exit status."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("+ " + shell_join(cmd) + "\n")
        log.flush()
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode


def train_finished(log_path):
    """True when a fairseq-train log says it finished ("done training")."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return any("done training in" in line for line in f)
    except FileNotFoundError:
        return False


def judge_train(rc, log_path):
    """(ok, note) for a finished fairseq-train process, judged by its log."""
    if rc == 0:
        return True, "ok"
    if train_finished(log_path):
        return True, "ok (exit status %d after 'done training'; judged by the log)" % rc
    return False, "failed with exit status %d, see %s" % (rc, log_path)


def tail(path, n=30):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return ""
