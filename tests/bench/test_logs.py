"""Parsing what fairseq_vasso logs (simple and json formats: fairseq_vasso.nmt.logs) and DomainBed's
results.jsonl (domainbed_vasso.logs), as vasso-plot reads them."""

import json
import math

import pytest

from fairseq_vasso.nmt import logs as fairseq_logs

from bench_samples import CONFIG, JSON_EPOCH, JSON_INNER, SIMPLE_EPOCH, SIMPLE_INNER, SIMPLE_VALID


def test_simple_train_inner():
    rec = fairseq_logs.parse_fairseq_line(SIMPLE_INNER[0])
    assert rec["_tag"] == "train_inner"
    assert rec["num_updates"] == 2.0 and rec["stability"] == pytest.approx(0.04301)
    assert rec["loss_gap"] == pytest.approx(0.19491) and rec["ups"] == 7.0 and rec["two_pass"] == 1.0
    assert "epoch" not in rec  # the "epoch 001: 2 / 15" progress prefix is not a key


def test_simple_nan_and_epoch_lines():
    rec = fairseq_logs.parse_fairseq_line(SIMPLE_INNER[2])
    assert math.isnan(rec["stability"]) and rec["two_pass"] == 0.0
    ep = fairseq_logs.parse_fairseq_line(SIMPLE_EPOCH)
    assert ep["_tag"] == "train" and ep["stability"] == pytest.approx(0.0293) and ep["num_updates"] == 12.0
    va = fairseq_logs.parse_fairseq_line(SIMPLE_VALID)
    assert va["_tag"] == "valid" and va["loss"] == pytest.approx(9.053)


def test_json_lines():
    rec = fairseq_logs.parse_fairseq_line(JSON_INNER)
    assert rec["_tag"] == "train_inner" and rec["num_updates"] == 2.0 and rec["stability"] == pytest.approx(0.04301)
    ep = fairseq_logs.parse_fairseq_line(JSON_EPOCH)
    # epoch lines prefix every key with the tag: stripped once
    assert ep["loss"] == pytest.approx(9.671) and ep["stability"] == pytest.approx(0.0293)
    assert ep["train_wall"] == 1.0 and ep["wall"] == 3.0


def test_other_lines_ignored():
    assert fairseq_logs.parse_fairseq_line(CONFIG) is None
    assert fairseq_logs.parse_fairseq_line("2026-11-22 | INFO | fairseq.trainer | loading train data for epoch 1") is None
    assert fairseq_logs.parse_fairseq_line("") is None


def test_optimizer_label(diag):
    opt = fairseq_logs.fairseq_optimizer(CONFIG)
    assert opt["_name"] == "vasso" and opt["theta"] == 0.4 and opt["perturb_prob"] == 0.5
    assert diag.label_for(opt) == "eVASSO (θ=0.4, p=0.5, ρ=0.1)"
    assert diag.label_for({"_name": "sam", "rho": 0.05}) == "SAM (ρ=0.05)"
    assert diag.label_for({"_name": "sam", "adaptive": True, "rho": 0.5}) == "ASAM (ρ=0.5)"
    assert diag.label_for({"_name": "vasso", "theta": 0.9, "gsam_alpha": 0.02}) == "VASSO (θ=0.9, GSAM α=0.02)"


def test_load_fairseq_log_and_dir(diag, tmp_path):
    run_dir = tmp_path / "vasso" / "seed1"
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").write_text("\n".join([CONFIG, *SIMPLE_INNER, SIMPLE_EPOCH]) + "\n")
    run = diag.load_run(str(run_dir))
    assert run.source == "fairseq" and run.label.startswith("eVASSO")
    xs, ys = run.series["stability"]
    assert xs == [2.0, 4.0] and ys == pytest.approx([0.04301, 0.0286])  # nan interval dropped, epoch line not used
    assert run.series["two_pass"][1] == [1.0, 1.0, 0.0]
    named = diag.load_run(f"mine={run_dir / 'train.log'}")
    assert named.label == "mine"
    js = tmp_path / "j.log"
    js.write_text(JSON_INNER + "\n" + JSON_EPOCH + "\n")
    run = diag.load_run(str(js))
    assert run.series["loss_gap"] == ([2.0], [pytest.approx(0.19491)])


def _domainbed_records(alg, hp, stab):
    for i, s in enumerate(stab):
        rec = {"step": 100 * i, "epoch": 0.1 * i, "loss": 1.0, "two_pass": 1.0, "rho": hp["rho"],
               "loss_gap": 0.01 * (i + 1), "env0_in_acc": 0.5, "hparams": hp,
               "args": {"algorithm": alg, "dataset": "PACS", "test_envs": [0]}}
        if s is not None:
            rec["stability"] = s
        yield json.dumps(rec)


def test_domainbed_results(diag, tmp_path):
    path = tmp_path / "out" / "results.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(_domainbed_records("VASSO", {"rho": 0.05, "theta": 0.4, "lr": 5e-5},
                                                 [None, 0.02, 0.03])) + "\n")
    run = diag.load_run(str(path.parent))
    assert run.source == "domainbed" and run.label == "VASSO (θ=0.4, ρ=0.05)"
    assert run.series["stability"] == ([100.0, 200.0], [0.02, 0.03])
    assert run.series["loss_gap"][0] == [0.0, 100.0, 200.0]
    assert run.meta["dataset"] == "PACS"
    erm = tmp_path / "erm.jsonl"
    erm.write_text(json.dumps({"step": 0, "loss": 1.0, "args": {"algorithm": "ERM"}, "hparams": {}}) + "\n")
    assert diag.load_run(str(erm)).series == {}


def test_logging_default_format():
    # fairseq run inside a process whose logging was configured before fairseq_cli.train's
    rec = fairseq_logs.parse_fairseq_line('INFO:train_inner:{"epoch": 1, "ups": "1.3", "num_updates": "2", '
                                  '"stability": "0.05"}')
    assert rec["_tag"] == "train_inner" and rec["stability"] == 0.05 and rec["ups"] == 1.3
    assert fairseq_logs.parse_fairseq_line("INFO:fairseq_cli.train:done training in 8.1 seconds") is None
    assert fairseq_logs.parse_fairseq_line('INFO:train:{"epoch": 1, "train_loss": "10.58"}')["loss"] == 10.58
