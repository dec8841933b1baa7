"""scripts/install_domainbed.sh (what `setup_env.sh --with-domainbed` runs) on a bare venv:
a local checkout or tarball becomes importable through a .pth file; a failed clone
leaves one line naming the alternatives and exit code 0."""

import os
import shutil
import subprocess
import sys
import tarfile

import process_group
import pytest
from domainbed_testlib import DOMAINBED, ROOT, SKIP_REASON

SCRIPT = os.path.join(ROOT, "scripts", "install_domainbed.sh")
TESTED = "b93c22a1cfc3b2428398272c1a116c8de1f4139e"

needs_checkout = pytest.mark.skipif(DOMAINBED is None, reason=SKIP_REASON)


@pytest.fixture
def venv(tmp_path):
    """A bare venv (no pip: nothing to download) of this interpreter."""
    path = tmp_path / "venv"
    process_group.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path


def install(venv, *args, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("DOMAINBED_ROOT", "PYTHONPATH")}
    e.update(VENV=str(venv), **env)
    return process_group.run(["bash", SCRIPT, *args], env=e, capture_output=True, text=True, timeout=300)


def imported_from(venv):
    """Where the venv's python imports ``domainbed`` from, with a clean environment."""
    code = "import os, domainbed; print(os.path.dirname(os.path.dirname(domainbed.__file__)))"
    proc = process_group.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                             env={"PATH": os.environ.get("PATH", "")}, cwd=venv, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@needs_checkout
def test_a_local_checkout_with_its_commit_becomes_importable(venv):
    proc = install(venv, f"{DOMAINBED}@b93c22a")
    assert proc.returncode == 0, proc.stderr
    dest = venv / "src" / "DomainBed"
    assert imported_from(venv) == str(dest)
    assert (dest / "COMMIT").read_text().strip() == "b93c22a"
    assert proc.stdout.strip() == f"DomainBed b93c22a at {dest}, importable in {venv}"
    # a copy, not a link: the source may go away
    assert not os.path.islink(dest) and (dest / "domainbed" / "algorithms.py").is_file()


@needs_checkout
def test_a_local_source_without_a_commit_is_installed_with_a_warning(venv, tmp_path):
    source = tmp_path / "DomainBed"  # a copy without .git, which would tell the commit
    shutil.copytree(DOMAINBED, source, ignore=shutil.ignore_patterns(".git"))
    proc = install(venv, str(source))
    assert proc.returncode == 0, proc.stderr
    assert imported_from(venv) == str(venv / "src" / "DomainBed")
    assert "its commit is unknown, this project is tested at b93c22a" in proc.stdout


@needs_checkout
def test_a_github_style_tarball_names_its_commit(venv, tmp_path):
    tarball = tmp_path / "DomainBed.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(DOMAINBED, arcname=f"DomainBed-{TESTED}")
    proc = install(venv, str(tarball))
    assert proc.returncode == 0, proc.stderr
    assert imported_from(venv) == str(venv / "src" / "DomainBed")
    assert (venv / "src" / "DomainBed" / "COMMIT").read_text().strip() == TESTED


@needs_checkout
def test_a_copy_without_history_that_claims_the_tested_commit_is_checked_by_content(venv, tmp_path):
    source = tmp_path / "DomainBed"
    shutil.copytree(DOMAINBED, source, ignore=shutil.ignore_patterns(".git"))
    (source / "domainbed" / "data").mkdir(exist_ok=True)  # a user's downloads are not code
    (source / "domainbed" / "data" / "x.txt").write_text("data\n")
    proc = install(venv, f"{source}@b93c22a")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"DomainBed b93c22a at {venv / 'src' / 'DomainBed'}, importable in {venv}"
    # one changed line of DomainBed's code: the claim is refused, with the fix, before anything is installed
    shutil.rmtree(venv / "src")
    with open(source / "domainbed" / "algorithms.py", "a") as f:
        f.write("# changed\n")
    proc = install(venv, f"{source}@b93c22a")
    assert proc.returncode == 2
    assert f"{source} claims commit b93c22a, but its domainbed/*.py differ from DomainBed b93c22a's" in proc.stderr
    assert "give an unmodified copy of b93c22a" in proc.stderr and "without @b93c22a" in proc.stderr
    assert not (venv / "src").exists()


@needs_checkout
def test_a_copy_without_history_claiming_another_commit_is_installed_as_unchecked(venv, tmp_path):
    source = tmp_path / "DomainBed"
    shutil.copytree(DOMAINBED, source, ignore=shutil.ignore_patterns(".git"))
    proc = install(venv, f"{source}@0123abcd")
    assert proc.returncode == 0, proc.stderr
    assert "its commit is 0123abcd as given, not checked (the copy has no git history" in proc.stdout
    assert (venv / "src" / "DomainBed" / "COMMIT").read_text().strip() == "0123abcd"


@needs_checkout
def test_a_git_checkout_must_be_at_the_commit_it_is_given_with(venv, tmp_path):
    source = tmp_path / "DomainBed"
    shutil.copytree(DOMAINBED, source, ignore=shutil.ignore_patterns(".git"))
    git = ["git", "-C", str(source), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], check=True, timeout=60)
    subprocess.run(git + ["add", "-A"], check=True, timeout=60)
    subprocess.run(git + ["commit", "-q", "-m", "copy"], check=True, timeout=60)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    proc = install(venv, f"{source}@b93c22a")  # not this checkout's HEAD
    assert proc.returncode == 2
    assert f"{source} is a checkout at {head[:7]}, not at b93c22a" in proc.stderr
    assert f"git -C {source} checkout b93c22a" in proc.stderr
    assert not (venv / "src").exists()
    proc = install(venv, f"{source}@{head[:10]}")
    assert proc.returncode == 0, proc.stderr
    assert (venv / "src" / "DomainBed" / "COMMIT").read_text().strip() == head
    assert "not checked" not in proc.stdout


def test_a_failed_clone_says_what_to_do_in_one_line_and_leaves_the_venv_usable(venv, tmp_path):
    proc = install(venv, DOMAINBED_GIT_URL=f"file://{tmp_path}/no-such-repository")
    assert proc.returncode == 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "could not clone" in lines[0] and "DOMAINBED_ROOT" in lines[0] and "--with-domainbed=" in lines[0]
    assert not (venv / "src" / "DomainBed").exists()
    assert process_group.run([str(venv / "bin" / "python"), "-c", "pass"], timeout=60).returncode == 0


def test_a_source_that_is_not_domainbed_is_refused(venv, tmp_path):
    proc = install(venv, str(tmp_path))
    assert proc.returncode == 2
    assert "has no domainbed/__init__.py" in proc.stderr


def test_setup_env_refuses_an_unknown_argument():
    proc = process_group.run(["bash", os.path.join(ROOT, "scripts", "setup_env.sh"), "--with-domainbd"],
                             capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown argument --with-domainbd" in proc.stderr


def test_one_message_for_a_missing_domainbed_in_every_test_folder():
    """Every test that skips without DomainBed, and scripts/compat.sh, say the same thing,
    defined once in domainbed_vasso._locate, naming both ways to get it."""
    from domainbed_vasso._locate import NOT_IMPORTABLE

    assert "bash scripts/setup_env.sh --with-domainbed" in NOT_IMPORTABLE and "DOMAINBED_ROOT=" in NOT_IMPORTABLE
    users, own = [], []
    for folder in ("tests", "scripts"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".sh")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                    rel = os.path.relpath(path, ROOT)
                    if "NOT_IMPORTABLE" in text:
                        users.append(rel)
                    if "DomainBed not importable" in text and not rel.endswith("test_domainbed_install.py"):
                        own.append(rel)
    assert not own, f"a message of their own for a missing DomainBed: {own}"
    for rel in ("tests/domainbed/domainbed_testlib.py", "tests/digits/test_digits_domainbed.py",
                "tests/slurm/conftest.py", "tests/docs/test_docs_commands.py", "scripts/compat.sh"):
        assert rel in users, rel
