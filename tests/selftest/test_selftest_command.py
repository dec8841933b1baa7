"""``vasso-selftest`` as a user runs it: the whole CPU path once per module (a subprocess,
``python -m plugins.lab.selftest --ranks 2 --json ...``), its table, JSON report and exit
status; the refusals before any work; a failing check's report and bug-report note."""

import configparser
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import plugins
import plugins.perturbation as P
from plugins.lab.selftest import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One run of the command on this machine's CPU with two gloo ranks."""
    report = tmp_path_factory.mktemp("selftest") / "report.json"
    path = [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, "-m", "plugins.lab.selftest", "--ranks", "2", "--json", str(report)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads(report.read_text()) if report.exists() else None


def rows(report, check):
    return [r for r in report["results"] if r["check"] == check]


def test_the_cpu_path_passes_every_check_it_can_run(cpu_run):
    proc, report = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["summary"]["FAIL"] == 0
    for check in ("environment", "math", "mixed precision", "host syncs", "ranks (DDP)", "ranks (FSDP2)", "cost"):
        cpu = [r for r in rows(report, check) if r["device"].startswith("cpu")]
        assert cpu and all(r["result"] == "pass" for r in cpu), (check, cpu)
    ranks = rows(report, "ranks (DDP)")
    assert any(r["device"] == "cpu x2" and "2 gloo ranks" in r["figure"] for r in ranks)
    fsdp2 = next(r for r in rows(report, "ranks (FSDP2)") if r["device"] == "cpu x2")
    assert "2 gloo ranks under FSDP2" in fsdp2["figure"] and fsdp2["details"]["max_error"]
    math_row = next(r for r in rows(report, "math") if r["device"] == "cpu")
    assert set(math_row["details"]["members"]) == {"SAM", "VASSO", "eSAM", "eVASSO", "ASAM", "GSAM", "V+G"}
    errors = math_row["details"]["max_error"]  # far inside the tolerances the mutants of test_selftest_checks break
    assert max(v for k, v in errors.items() if k.endswith("float32")) < 1e-6
    assert max(v for k, v in errors.items() if k.endswith("float64")) < 1e-8
    assert report["environment"]["torch"] == torch.__version__
    assert report["environment"]["vasso-plugins"] == plugins.__version__


def test_the_hosts_run_when_found_and_say_why_not_otherwise(cpu_run):
    _, report = cpu_run
    fairseq = rows(report, "fairseq fp32")[0]
    if importlib.util.find_spec("fairseq") is None:
        assert fairseq["result"] == "skipped" and fairseq["reason"].startswith("fairseq not installed")
    else:
        assert fairseq["result"] == "pass", fairseq
        assert fairseq["details"]["losses"][-1] < fairseq["details"]["losses"][0]
        assert report["environment"]["fairseq"]
    domainbed = rows(report, "DomainBed")[0]
    if os.environ.get("DOMAINBED_ROOT"):
        assert domainbed["result"] == "pass", domainbed
        assert report["environment"]["domainbed"]["root"]
    else:
        assert domainbed["result"] in ("pass", "skipped")
        if domainbed["result"] == "skipped":
            assert domainbed["reason"].startswith("DomainBed not found: ")


def test_every_gpu_check_says_why_it_did_not_run_without_one(cpu_run):
    _, report = cpu_run
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CUDA rows ran")
    cuda = [r for r in report["results"] if r["device"].startswith("cuda")]
    assert {r["check"] for r in cuda} >= {"math", "mixed precision", "host syncs", "ranks (DDP)", "ranks (FSDP2)",
                                          "cost"}
    assert all(r["result"] == "skipped" and r["reason"] == "no CUDA device" for r in cuda), cuda


def test_the_table_has_every_row_with_its_time_and_figure(cpu_run):
    proc, report = cpu_run
    out = proc.stdout
    assert "| check | device | result | time | figure |" in out
    for r in report["results"]:
        result = r["result"] if r["result"] != "skipped" else f"skipped: {r['reason']}"
        assert f"| {r['check']} | {r['device']} | {result} | {r['seconds']:.1f} s |" in out
    assert "0 failed" in out and f"wrote {report['command'][-1]}" in out
    assert "FAILED" not in out


def test_an_existing_report_is_not_overwritten_without_force(tmp_path, capsys):
    existing = tmp_path / "report.json"
    existing.write_text("keep")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--json", str(existing), "--checks", "math"])
    assert exc.value.code == 2 and existing.read_text() == "keep"
    assert "--force" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [(["--ranks", "3"], "--ranks must be one of 1, 2, 4, 8"),
                                         (["--ranks", "0"], "--ranks must be one of 1, 2, 4, 8"),
                                         (["--json", "/nonexistent/dir/r.json"], "does not exist"),
                                         (["--checks", "nothing"], "invalid choice")])
def test_bad_arguments_are_refused_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_a_failing_check_exits_non_zero_and_says_what_to_attach(tmp_path, monkeypatch, capsys):
    stock = P.plain_ascent_scale
    monkeypatch.setattr(P, "plain_ascent_scale", lambda rho, norm: 1.5 * stock(rho, norm))
    report = tmp_path / "r.json"
    assert cli.main(["--checks", "math", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "| math | cpu | FAIL |" in out
    assert f"attach the JSON report {report}" in out and "the project's issue tracker" in out
    data = json.loads(report.read_text())
    failed = [r for r in data["results"] if r["result"] == "FAIL"]
    assert {r["check"] for r in failed} == {"math"} and failed[0]["device"] == "cpu"  # and each GPU's, if any
    assert failed[0]["details"]["max_error"]["SAM float32"] > 1e-3
    # without --json, the note says how to get the report
    assert cli.main(["--checks", "math"]) == 1
    assert "run again with --json selftest.json" in capsys.readouterr().out


def test_the_console_script_and_the_module_are_the_same_entry_point():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "setup.cfg"))
    scripts = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    module, function = scripts["vasso-selftest"].split(":")
    assert getattr(importlib.import_module(module), function) is cli.main
    main_module = importlib.import_module("plugins.lab.selftest.__main__")
    assert main_module.main is cli.main
