"""tests/conftest.py's guard: it sees what a test writes among the checkout's untracked files."""

import subprocess

import process_group
from checkout import changes, untracked_files


def test_guard_lists_files_created_changed_and_removed_in_ignored_folders(tmp_path):
    repo = tmp_path / "repo"
    (repo / "runs" / "demo").mkdir(parents=True)
    (repo / ".gitignore").write_text("/runs/\n")
    (repo / "tracked.txt").write_text("x\n")
    (repo / "runs" / "demo" / "results.md").write_text("table\n")
    (repo / "runs" / "demo" / "train.log").write_text("log\n")
    (repo / "__pycache__").mkdir()
    (repo / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", ".gitignore", "tracked.txt"], check=True)
    before = untracked_files(str(repo))
    assert sorted(before) == ["runs/demo/results.md", "runs/demo/train.log"]
    assert changes(before, untracked_files(str(repo))) == []
    (repo / "runs" / "demo" / "results.md").write_text("a table of zeros\n")
    (repo / "runs" / "demo" / "train.log").unlink()
    (repo / "out").mkdir()
    (repo / "out" / "x.json").write_text("{}")
    (repo / "tracked.txt").write_text("tracked files are git's to show\n")
    assert changes(before, untracked_files(str(repo))) == [
        "created: out/x.json", "changed: runs/demo/results.md", "removed: runs/demo/train.log"]


def test_run_kills_what_the_command_left_running_on_a_timeout(tmp_path):
    # a shell that starts a sleeper and waits: on the timeout both die, not only the shell
    pid_file = tmp_path / "pid"
    try:
        process_group.run(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], timeout=2)
    except subprocess.TimeoutExpired:
        pass
    else:
        raise AssertionError("no timeout")
    pid = int(pid_file.read_text())
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    assert state in ("", "Z"), f"the sleeper {pid} still runs ({state})"
