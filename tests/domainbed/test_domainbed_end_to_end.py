"""End to end through an unmodified DomainBed checkout.

Skipped unless DomainBed is importable (the skip says how: ``SKIP_REASON``, the one
message of ``domainbed_vasso._locate.NOT_IMPORTABLE``).
Debug28/Debug224 have 16 examples per environment (13 in a training split): the
batch size must stay <= 13 or DomainBed's loader never yields a batch (hangs).
"""

import json
import os

import pytest

from domainbed_testlib import DOMAINBED, PY, SKIP_REASON, run_all, train_cmd

pytestmark = pytest.mark.skipif(DOMAINBED is None, reason=SKIP_REASON)
IGNORED = {"step_time", "mem_gb", "args", "hparams"}


def records(out):
    with open(os.path.join(out, "results.jsonl")) as f:
        return [json.loads(line) for line in f]


RUNS = {
    "ERM": ("ERM", {"batch_size": 8}),
    "SAM": ("SAM", {"batch_size": 8}),
    "GSAM": ("GSAM", {"batch_size": 8}),
    "VASSO": ("VASSO", {"batch_size": 8, "theta": 0.4}),
    "SAM_rho0": ("SAM", {"batch_size": 8, "rho": 0.0}),
    "VASSO_rho0": ("VASSO", {"batch_size": 8, "rho": 0}),
}


@pytest.fixture(scope="module")
def debug28_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("debug28")
    names = list(RUNS)
    results = run_all([train_cmd(base / n, *RUNS[n]) for n in names])
    for name, (code, output) in zip(names, results):
        assert code == 0, f"{name} failed:\n{output[-3000:]}"
    return {n: str(base / n) for n in names}


@pytest.mark.parametrize("name", ["ERM", "SAM", "GSAM", "VASSO"])
def test_each_algorithm_trains_on_debug28_with_usual_outputs(debug28_runs, name):
    out = debug28_runs[name]
    for f in ("out.txt", "err.txt", "results.jsonl", "model.pkl", "done"):
        assert os.path.exists(os.path.join(out, f)), f
    recs = records(out)
    assert [r["step"] for r in recs] == [0, 2, 4]
    last = recs[-1]
    assert last["args"]["algorithm"] == RUNS[name][0]
    assert {"env0_in_acc", "env0_out_acc", "env1_in_acc", "env2_out_acc", "loss"} <= set(last)
    if name != "ERM":
        for key in ("loss_gap", "loss_perturbed", "sharpness", "stability", "rho", "two_pass"):
            assert key in last, key
        assert last["two_pass"] == 1.0
        assert last["hparams"]["rho"] == 0.05
    if name == "VASSO":
        assert last["hparams"]["theta"] == 0.4
    if name == "GSAM":
        assert last["hparams"]["gsam_alpha"] == 0.1
    with open(os.path.join(out, "err.txt")) as f:
        assert "Traceback" not in f.read()


@pytest.mark.parametrize("name", ["SAM_rho0", "VASSO_rho0"])
def test_rho_zero_reproduces_erm_results(debug28_runs, name):
    erm, other = records(debug28_runs["ERM"]), records(debug28_runs[name])
    assert len(erm) == len(other)
    for a, b in zip(erm, other):
        for key in set(a) - IGNORED:
            assert a[key] == b[key], (name, a["step"], key)
        ha, hb = a["hparams"], b["hparams"]
        assert {k: hb[k] for k in ha} == ha  # every ERM hparam equal


def test_invalid_hparam_stops_before_training(tmp_path):
    [(code, output)] = run_all([train_cmd(tmp_path / "bad", "VASSO", {"batch_size": 8, "theta": 1.5})])
    assert code == 2
    assert "theta must be in (0, 1], got 1.5" in output
    assert not os.path.exists(tmp_path / "bad")


def test_registry_pairs_hparams_with_erm():
    import domainbed_vasso
    domainbed_vasso.register()
    from domainbed import algorithms, hparams_registry
    from domainbed.lib import misc
    assert algorithms.get_algorithm_class("VASSO").__name__ == "VASSO"
    assert {"SAM", "GSAM", "VASSO"} <= set(algorithms.ALGORITHMS)
    for dataset in ("PACS", "Debug28", "TerraIncognita"):
        erm = hparams_registry.default_hparams("ERM", dataset)
        for alg in ("SAM", "GSAM", "VASSO"):
            ours = hparams_registry.default_hparams(alg, dataset)
            assert {k: ours[k] for k in erm} == erm
        for hseed in (1, 2, 7):
            seed = misc.seed_hash(hseed, 0)
            erm = hparams_registry.random_hparams("ERM", dataset, seed)
            ours = hparams_registry.random_hparams("VASSO", dataset, seed)
            assert {k: ours[k] for k in erm} == erm
            assert ours["theta"] in (0.2, 0.4, 0.9)
    domainbed_vasso.register()  # idempotent
    assert algorithms.ALGORITHMS.count("VASSO") == 1


def test_sweep_children_know_vasso_and_collect_results_reads_it(tmp_path):
    out = tmp_path / "sweep"
    cmd = [PY, "-m", "domainbed_vasso.sweep", "launch", "--datasets", "Debug28",
           "--algorithms", "ERM", "VASSO", "--n_hparams", "1", "--n_trials", "1", "--single_test_envs",
           "--steps", "1", "--command_launcher", "multi_gpu", "--skip_confirmation",
           "--hparams", '{"batch_size": 8}', "--data_dir", str(tmp_path), "--output_dir", str(out)]
    # DomainBed's multi_gpu launcher runs one job per entry of CUDA_VISIBLE_DEVICES, each
    # prefixed with CUDA_VISIBLE_DEVICES=<i>: two at a time here (on CPU if there is no GPU)
    [(code, output)] = run_all([cmd], timeout=900, CUDA_VISIBLE_DEVICES="0,1")
    assert code == 0, output[-3000:]
    assert "Launched 6 jobs" in output
    runs = sorted(os.listdir(out))
    assert len(runs) == 6
    algs = set()
    for d in runs:
        assert os.path.exists(out / d / "done"), d
        algs.add(records(out / d)[-1]["args"]["algorithm"])
    assert algs == {"ERM", "VASSO"}
    table = in_process("domainbed.scripts.collect_results", ["--input_dir", str(out)])
    assert "Total records: 6" in table  # 6 runs x 1 checkpoint (--steps 1)
    iid = table.split("model selection method: training-domain validation set")[1].split("--------")[0]
    rows = {line.split()[0]: line.split()[1:] for line in iid.strip().splitlines()[1:]}
    assert set(rows) == {"ERM", "VASSO"}
    assert "X" not in rows["VASSO"]
    # and our own tables script reads the same sweep
    import contextlib
    import io

    from domainbed_vasso import tables
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert tables.main([str(out), "--selection", "iid"]) == 0
    mine = buf.getvalue()
    assert "### Debug28, model selection: training-domain validation set" in mine
    assert "| Test domain | ERM | VASSO |" in mine
    assert "selection by DomainBed's model_selection" in mine


def in_process(script, argv):
    """Run a DomainBed script module as __main__ here; its stdout."""
    import io
    import runpy
    import sys
    saved = sys.argv, sys.stdout, sys.stderr
    buf = io.StringIO()
    tee = None
    try:
        sys.argv, sys.stdout = [script] + argv, buf
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    finally:
        tee = sys.stdout
        sys.argv, sys.stdout, sys.stderr = saved
        if tee is not buf and hasattr(tee, "file"):  # collect_results tees into results.txt
            tee.file.close()
    return buf.getvalue()


def test_one_vasso_step_on_debug224_resnet50_without_weights(tmp_path):
    import torch
    out = tmp_path / "r50"
    hparams = {"batch_size": 2, "resnet50_augmix": False, "rho": 0.05, "theta": 0.4}
    [(code, output)] = run_all([train_cmd(out, "VASSO", hparams, steps=1, dataset="Debug224")],
                               DOMAINBED_VASSO_RESNET_WEIGHTS="none", OMP_NUM_THREADS="2")
    assert code == 0, output[-3000:]
    [rec] = records(out)
    assert rec["step"] == 0 and rec["two_pass"] == 1.0
    assert rec["ascent_norm"] == pytest.approx(0.05, rel=1e-4)
    assert rec["hparams"]["resnet50_augmix"] is False and rec["hparams"]["freeze_bn"] is False
    saved = torch.load(out / "model.pkl", map_location="cpu", weights_only=True)
    tracked = {k: int(v) for k, v in saved["model_dict"].items()
               if k.startswith("featurizer.") and k.endswith("num_batches_tracked")}
    assert len(tracked) == 53  # every BatchNorm of ResNet-50
    # one step, two passes: the running statistics saw the first pass only
    assert set(tracked.values()) == {1}
