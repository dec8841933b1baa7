"""domainbed_vasso's one DomainBed locator (``_locate.domainbed_root``), which the entry
points, ``vasso-selftest`` and the tests share: DOMAINBED_ROOT, then sys.path, then, for a
source checkout only, a DomainBed checkout beside it (``../shared/DomainBed``, where
scripts/test.sh and CI find it)."""

import os
import sys

import process_group
import pytest

from domainbed_vasso import _locate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layout(tmp_path, *, git=True, domainbed=True):
    checkout = tmp_path / "work" / "vasso-plugins"
    (checkout / "domainbed_vasso").mkdir(parents=True)
    (checkout / "setup.cfg").write_text("[metadata]\n")
    if git:
        (checkout / ".git").write_text("gitdir: elsewhere\n")  # a worktree's .git is a file
    beside = tmp_path / "work" / "shared" / "DomainBed"
    if domainbed:
        (beside / "domainbed").mkdir(parents=True)
        (beside / "domainbed" / "__init__.py").write_text("")
    return checkout, beside


def test_a_source_checkout_finds_domainbed_beside_it_and_an_installed_copy_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv(_locate.ENV_BESIDE, raising=False)
    checkout, beside = _layout(tmp_path)
    assert _locate.source_checkout(str(checkout / "domainbed_vasso")) == str(checkout)
    assert _locate.beside_the_checkout(str(checkout)) == str(beside)
    monkeypatch.setenv(_locate.ENV_BESIDE, "0")  # the tests' environments that must lack DomainBed
    assert _locate.beside_the_checkout(str(checkout)) is None
    monkeypatch.delenv(_locate.ENV_BESIDE)
    installed, _ = _layout(tmp_path / "site", git=False)  # no git metadata: an installed copy
    assert _locate.source_checkout(str(installed / "domainbed_vasso")) is None
    empty, _ = _layout(tmp_path / "bare", domainbed=False)
    assert _locate.beside_the_checkout(str(empty)) is None


def test_the_entry_points_find_domainbed_where_the_tests_do_without_domainbed_root(tmp_path):
    """python -m domainbed_vasso.train in this checkout, without DOMAINBED_ROOT and with no
    copy on sys.path, finds the DomainBed beside it that the test command finds."""
    beside = _locate.beside_the_checkout(ROOT)
    if beside is None:
        pytest.skip(f"no DomainBed at ../{_locate.BESIDE_THE_CHECKOUT} beside this checkout")
    strip = ("import os, runpy, sys\n"
             "sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or '.', 'domainbed', "
             "'__init__.py'))]\n"
             "from domainbed_vasso import _locate\n"
             "print('ROOT', _locate.domainbed_root())\n"
             "sys.argv = ['domainbed_vasso.train', '--help']\n"
             "runpy.run_module('domainbed_vasso.train', run_name='__main__', alter_sys=True)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DOMAINBED_ROOT", "PYTHONPATH", _locate.ENV_BESIDE)}
    env["PYTHONPATH"] = ROOT
    proc = process_group.run([sys.executable, "-c", strip], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ROOT {beside}" in proc.stdout and "--test_envs" in proc.stdout
