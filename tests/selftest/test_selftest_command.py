"""``vasso-selftest`` as a user runs it: the whole command once per test session (a
subprocess, ``python -m plugins.lab.selftest --ranks 2 --json ...``, on every device found:
tests/selftest/conftest.py), its table, JSON report and exit status, the GPU rows where there
is a GPU (``gpu`` tests); the refusals before any work; a failing check's report, hint and
bug-report note."""

import configparser
import importlib
import json
import os

import pytest
import torch

import plugins
import plugins.perturbation as P
from plugins.lab.selftest import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_MODES = ("fairseq fp32", "fairseq --fp16", "fairseq --amp", "fairseq --memory-efficient-fp16")


@pytest.fixture
def cpu_run(selftest_run):
    """The session's one run of the command (tests/selftest/conftest.py)."""
    return selftest_run


def rows(report, check):
    return [r for r in report["results"] if r["check"] == check]


def test_the_cpu_path_passes_every_check_it_can_run(cpu_run):
    proc, report = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["summary"]["FAIL"] == 0
    for check in ("environment", "math", "mixed precision", "host syncs", "ranks (DDP)", "ranks (FSDP2)"):
        cpu = [r for r in rows(report, check) if r["device"].startswith("cpu")]
        assert cpu and all(r["result"] == "pass" for r in cpu), (check, cpu)
    # the cost: judged where its paired repeats' spread allows, else "too noisy" with the figure (not a failure);
    # a median below 1 is noise
    cost = next(r for r in rows(report, "cost") if r["device"] == "cpu")
    q1, q3 = cost["details"]["iqr"]
    expected = ("noise" if cost["details"]["vasso_over_adamw_2pass"] < 1 else "pass" if q3 <= 1.25 else "too noisy")
    assert cost["details"]["verdict"] == expected and q1 <= 1.25, cost
    if cost["result"] == "skipped":
        assert cost["reason"].startswith("too noisy to judge here") and "interquartile range" in cost["figure"]
    else:
        assert cost["result"] == "pass" and "interquartile range" in cost["figure"]
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
    fairseq = next(r for r in rows(report, "fairseq fp32") if r["device"] == "cpu")
    if importlib.util.find_spec("fairseq") is None:
        assert fairseq["result"] == "skipped" and fairseq["reason"].startswith("fairseq not installed")
    else:
        assert fairseq["result"] == "pass", fairseq
        assert fairseq["details"]["losses"][-1] < fairseq["details"]["losses"][0]
        assert report["environment"]["fairseq"]
        # fairseq's --cpu still puts --clip-norm's norm on CUDA where a GPU is visible: the child sees none
        assert fairseq["details"]["CUDA_VISIBLE_DEVICES"] == ""
        assert fairseq["details"]["command"].startswith("CUDA_VISIBLE_DEVICES= fairseq-train ")
    domainbed = next(r for r in rows(report, "DomainBed") if r["device"] == "cpu")
    from domainbed_vasso import selftest as domainbed_check  # the one locator, as the command uses it

    if domainbed_check.domainbed_missing() is None:
        assert domainbed["result"] == "pass", domainbed
        assert report["environment"]["domainbed"]["root"] == domainbed_check.domainbed_root()
    else:
        assert domainbed["result"] == "skipped" and domainbed["reason"].startswith("DomainBed not found: ")


def test_every_gpu_check_runs_on_every_gpu_or_says_why_it_did_not(cpu_run):
    _, report = cpu_run
    cuda = [r for r in report["results"] if r["device"].startswith("cuda")]
    assert {r["check"] for r in cuda} >= {"math", "mixed precision", "host syncs", "ranks (DDP)", "ranks (FSDP2)",
                                          "cost"}
    gpus = [g["device"] for g in report["environment"].get("gpus", [])]
    assert report["environment"]["cuda_available"] == torch.cuda.is_available() == bool(gpus)
    if not gpus:
        assert all(r["result"] == "skipped" and r["reason"] == "no CUDA device" for r in cuda), cuda
    else:  # the rows of each GPU, in full: test_every_check_passes_on_every_gpu
        assert {r["device"] for r in cuda if r["check"] == "math"} == set(gpus)


@pytest.mark.gpu
def test_every_check_passes_on_every_gpu(cpu_run):
    """On each GPU: the math, mixed precision (fp16 with the scaler, bf16 where supported),
    host syncs counted and by torch's own sync debug mode (1 decided on the device, 2 on the host
    path; none over fused AdamW, scaled or not), fairseq-train in fp32 and
    the three loss-scaled modes, DomainBed where found, and the cost (judged, or too noisy to judge)."""
    proc, report = cpu_run
    gpus = [g["device"] for g in report["environment"]["gpus"]]
    assert gpus == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    fairseq = importlib.util.find_spec("fairseq") is not None
    for device in gpus:
        got = {r["check"]: r for r in report["results"] if r["device"] == device}
        for check in ("environment", "math", "mixed precision", "host syncs") + (GPU_MODES if fairseq else ()):
            assert got[check]["result"] == "pass", (device, got.get(check))
        details = got["host syncs"]["details"]
        syncs, limits = details["cuda_sync_debug_mode"], details["limit"]
        assert syncs and all(n <= limits[key.split()[0]] for key, n in syncs.items()), syncs
        fused = details.get("fused_cuda_sync_debug_mode")  # none without a fused AdamW on the device
        assert fused is None or set(fused.values()) == {0}, fused
        if fairseq:
            assert got["fairseq fp32"]["details"]["CUDA_VISIBLE_DEVICES"] == device.split(":")[1]
            assert all(got[m]["details"]["loss_scale"] for m in GPU_MODES[1:])
        if report["environment"]["domainbed"]:
            assert got["DomainBed"]["result"] == "pass", got["DomainBed"]
        cost = got["cost"]
        assert cost["result"] == "pass" or (cost["result"] == "skipped"
                                            and cost["reason"].startswith("too noisy to judge here")), cost
    assert proc.returncode == 0, proc.stdout[-3000:]


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
    assert "What to do, math on cpu: the core's step is off the paper's equations" in out  # the row's hint
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
