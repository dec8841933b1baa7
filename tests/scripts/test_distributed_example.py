"""scripts/distributed_example.py's refusal under torchrun: rank 0 prints it, once, and the
other ranks wait to be stopped (the run itself is docs/distributed.md's command, run by
tests/docs/test_docs_commands.py)."""

import os
import subprocess
import sys

import process_group
from checkout import REPO

SCRIPT = os.path.join(REPO, "scripts", "distributed_example.py")


def test_a_refusal_is_rank_0s_and_the_other_ranks_wait_for_torchrun_to_stop_them(tmp_path):
    # torchrun stops every rank when the first one exits: a rank 1 that exited at once could
    # stop rank 0 before its message was out, and the user would see none
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.txt").write_text("a finished run\n")
    cmd = [sys.executable, SCRIPT, "--out", str(out)]
    other = process_group.popen(cmd, env=dict(os.environ, RANK="1"), cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        first = process_group.run(cmd, env=dict(os.environ, RANK="0"), cwd=tmp_path, capture_output=True,
                                  text=True, timeout=120)
        assert first.returncode == 2 and first.stderr.count("exists and is not empty") == 1, first.stderr
        assert other.poll() is None, "rank 1 exited before rank 0 had printed its refusal"
    finally:
        process_group.kill_group(other)
        printed, _ = other.communicate()
    assert printed == ""
    assert sorted(os.listdir(out)) == ["result.txt"] and (out / "result.txt").read_text() == "a finished run\n"
