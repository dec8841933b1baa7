"""fairseq's import prints three FutureWarnings of torch's and fairscale's (torch.jit.script,
torch.cuda.amp.custom_fwd / custom_bwd): none in a process that imports the plugin first, nor
in the Python processes it starts (fairseq_vasso/_foreign_warnings.py)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("fairseq")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_fairseq_imported_alone_prints_them():
    # the control: without the plugin, the three are there (else the tests below show nothing)
    err = _run("import fairseq").stderr
    for message in ("`torch.jit.script` is deprecated", "`torch.cuda.amp.custom_fwd(args...)` is deprecated",
                    "`torch.cuda.amp.custom_bwd(args...)` is deprecated"):
        assert message in err, err[-3000:]


def test_none_where_the_plugin_comes_first_nor_in_the_processes_it_starts():
    out = _run("import fairseq_vasso, fairseq, subprocess, sys\n"
               "sys.exit(subprocess.run([sys.executable, '-c', 'import fairseq']).returncode)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FutureWarning" not in out.stderr, out.stderr[-3000:]


def test_pythonwarnings_keeps_the_users_rules_first():
    from fairseq_vasso._foreign_warnings import AT_FAIRSEQ_IMPORT, pythonwarnings

    value = pythonwarnings("error::DeprecationWarning")
    assert value.split(",")[0] == "error::DeprecationWarning" and len(value.split(",")) == 1 + len(AT_FAIRSEQ_IMPORT)
    assert pythonwarnings(value) == value
    # each rule parses as Python parses PYTHONWARNINGS, and matches only its warning
    out = _run("import warnings, os\n"
               f"for rule in {value!r}.split(','): warnings._setoption(rule)\n"
               "warnings.warn('`torch.jit.script` is deprecated. Please switch', FutureWarning)\n"
               "warnings.warn('`torch.jit.trace` is deprecated', FutureWarning)\n")
    assert "jit.script" not in out.stderr and "jit.trace" in out.stderr, out.stderr
