"""The checkout as the tests see it: what a clone of it holds (``clone_files``,
``copy_clone``: a copy to build, install or run commands in, never the checkout itself),
and its untracked files (``untracked_files``, ``changes``: tests/conftest.py's guard)."""

import os
import shutil
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/helpers/ -> the checkout
LEFT_OUT = ("__pycache__", ".pytest_cache")
_LEFT_OUT_TOP = (".venv", ".git")


def clone_files(repo=REPO):
    """The files a clone of ``repo`` holds, relative to it: those git tracks and the new ones it
    does not ignore (never ``runs/``, ``data/``, ``out/``, ``build/`` or any other output)."""
    out = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return sorted({p for p in out.split("\0") if p and os.path.isfile(os.path.join(repo, p))})


def copy_clone(dest, repo=REPO):
    """Copies ``clone_files(repo)`` into the folder ``dest`` (copies, not links: what is
    written there stays there); returns ``dest``."""
    for rel in clone_files(repo):
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(repo, rel), os.path.join(dest, rel))
    return dest


def untracked_files(repo=REPO):
    """{path relative to ``repo``: (size, mtime_ns)} of its untracked files, ignored ones
    included; {} when ``repo`` is not a git checkout."""
    try:
        out = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--others", "--", "."]
                             + [f":(exclude){name}" for name in _LEFT_OUT_TOP],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    files = {}
    for rel in out.stdout.split("\0"):
        parts = rel.split("/")
        if not rel or any(p in LEFT_OUT or p.endswith(".egg-info") for p in parts) or rel.endswith(".pyc"):
            continue
        try:
            st = os.lstat(os.path.join(repo, rel))
        except FileNotFoundError:
            continue
        files[rel] = (st.st_size, st.st_mtime_ns)
    return files


def changes(before, after):
    """Lines naming the files created, changed or removed between two ``untracked_files``."""
    lines = [f"created: {p}" for p in sorted(set(after) - set(before))]
    lines += [f"changed: {p}" for p in sorted(set(after) & set(before)) if after[p] != before[p]]
    lines += [f"removed: {p}" for p in sorted(set(before) - set(after))]
    return lines
