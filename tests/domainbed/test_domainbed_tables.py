"""vasso-domainbed-tables (domainbed_vasso.tables) on synthetic sweep records.

The selection is DomainBed's own: skipped unless DomainBed is importable."""

import itertools
import json
import random
import sys

import process_group
import pytest

from domainbed_testlib import DOMAINBED, SKIP_REASON, env
from domainbed_vasso import tables as T

pytestmark = pytest.mark.skipif(DOMAINBED is None, reason=SKIP_REASON)


def synthetic_records(dataset="PACS", algorithms=("ERM", "VASSO"), trials=(0, 1), hseeds=(0, 1, 2),
                      steps=(0, 300, 600), n_env=4, single=False, seed=0):
    rng = random.Random(seed)
    recs = []
    combos = [[i] for i in range(n_env)]
    if not single:
        combos += [list(c) for c in itertools.combinations(range(n_env), 2)]
    for trial, alg, envs, hs, step in itertools.product(trials, algorithms, combos, hseeds, steps):
        r = {"args": {"dataset": dataset, "algorithm": alg, "test_envs": envs, "hparams_seed": hs,
                      "trial_seed": trial, "holdout_fraction": 0.2}, "step": step}
        for i in range(n_env):
            # quantized so that ties happen and tie-breaking is exercised
            r[f"env{i}_in_acc"] = rng.choice([0.5, 0.6, 0.7, 0.8])
            r[f"env{i}_out_acc"] = rng.choice([0.5, 0.6, 0.7, 0.8])
        recs.append(r)
    return recs


def write_sweep(path, records):
    by_run = {}
    for r in records:
        a = r["args"]
        key = (a["dataset"], a["algorithm"], tuple(a["test_envs"]), a["hparams_seed"], a["trial_seed"])
        by_run.setdefault(key, []).append(r)
    for i, recs in enumerate(by_run.values()):
        d = path / f"run{i}"
        d.mkdir(parents=True)
        with open(d / "results.jsonl", "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")


def test_leave_one_out_by_hand():
    # 3 envs, test env 0, one hparam seed, two steps: step 1 has the better validation
    base = {"dataset": "D", "algorithm": "VASSO", "hparams_seed": 0, "trial_seed": 0}

    def rec(envs, step, accs):
        r = {"args": dict(base, test_envs=envs), "step": step}
        for i, a in enumerate(accs):
            r[f"env{i}_in_acc"] = a
            r[f"env{i}_out_acc"] = 0.0
        return r

    records = [rec([0], 0, [0.30, 0.9, 0.9]), rec([0, 1], 0, [0, 0.50, 0]), rec([0, 2], 0, [0, 0, 0.50]),
               rec([0], 1, [0.70, 0.9, 0.9]), rec([0, 1], 1, [0, 0.60, 0]), rec([0, 2], 1, [0, 0, 0.80])]
    accs = T.selected_accuracies(records, "loo")
    assert accs[("D", "VASSO", 0)] == {0: 0.70}
    # without the two-test-env runs there is nothing to select from
    assert ("D", "VASSO", 0) not in T.selected_accuracies(
        [r for r in records if len(r["args"]["test_envs"]) == 1], "loo")


def test_tables_map_domains_by_name_and_show_the_paper(tmp_path):
    records = synthetic_records(algorithms=("ERM", "SAM", "GSAM", "VASSO"), trials=(0, 1, 2))
    # PACS env 2 is "P" in DomainBed: make its accuracy unmistakable for VASSO
    for r in records:
        if r["args"]["algorithm"] == "VASSO":
            r["env2_in_acc"] = 0.123
    write_sweep(tmp_path / "sweep", records)
    loaded = T.load_records([str(tmp_path / "sweep")])
    assert len(loaded) == len(records)
    text = T.render(loaded, selections=("loo", "iid"), fmt="both")
    md = text.split("### PACS, model selection: leave-one-domain-out cross-validation")[1].split("###")[0]
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| Test domain | ERM | SAM | GSAM | VASSO | paper Adam | paper SAM")
    assert lines[1].startswith("| Photo (P) |")  # the paper's order, P first
    photo = [c.strip() for c in lines[1].split("|")[1:-1]]
    assert photo[4] == "12.3 ± 0.0"  # VASSO on DomainBed env 2 == P
    assert photo[5:] == ["97.2 ± 0.3", "97.0 ± 0.4", "97.5 ± 0.0", "95.4 ± 0.2"]
    assert [line.split("|")[1].strip() for line in lines[1:]] == [
        "Photo (P)", "Art painting (A)", "Cartoon (C)", "Sketch (S)", "Average"]
    assert lines[-1].split("|")[-5:-1] == [" 85.5 ", " 85.8 ", " 85.9 ", " 86.0 "]
    assert "12.3 $\\pm$ 0.0" in text and "\\label{tab.PACS-ours-loo}" in text
    assert "training-domain validation set" in text
    overall = text.split("### Average over test domains, model selection: leave-one-domain-out")[1]
    assert "| PACS |" in overall and "85.5 ± 0.2" in overall


def test_mean_and_std_over_trials():
    recs = []
    for trial, acc in ((0, 0.6), (1, 0.8)):
        for envs in ([0], [1], [0, 1]):
            r = {"args": {"dataset": "VLCS", "algorithm": "VASSO", "test_envs": envs, "hparams_seed": 0,
                          "trial_seed": trial}, "step": 0}
            for i in range(4):
                r[f"env{i}_in_acc"] = acc
                r[f"env{i}_out_acc"] = acc
            recs.append(r)
    text = T.render(recs, selections=("iid",), paper=False)
    # VLCS env 0 is C (Caltech101): mean 70.0, population std 10.0 over the two trials
    assert "| C | 70.0 ± 10.0 |" in text
    assert "| C | 70.0 ± 7.1 |" in T.render(recs, selections=("iid",), paper=False, err="sem")
    assert "| V | - |" in text  # no runs with V as test domain
    # one trial: its accuracy alone, no "± 0.0" spread
    one = T.render([r for r in recs if r["args"]["trial_seed"] == 0], selections=("iid",), paper=False)
    assert "| C | 60.0 |" in one and "± 0.0" not in one


def test_cli_single_test_envs_note(tmp_path, capsys):
    write_sweep(tmp_path / "s", synthetic_records(single=True, trials=(0,)))
    T.main([str(tmp_path / "s"), "--no_paper"])  # (the paper prints a "97.5 ± 0.0" of its own)
    out = capsys.readouterr().out
    assert "needs runs with two test environments" in out
    assert "1 trial(s)" in out and "± 0.0" not in out
    with pytest.raises(SystemExit):
        T.main([str(tmp_path / "empty_does_not_exist")])


def test_command_answers_help_and_reads_a_sweep(tmp_path):
    """The command as users run it: python -m (the console script vasso-domainbed-tables
    calls the same main)."""
    write_sweep(tmp_path / "s", synthetic_records(trials=(0, 1)))
    cmd = [sys.executable, "-m", "domainbed_vasso.tables"]
    help_ = process_group.run(cmd + ["--help"], capture_output=True, text=True, env=env(), timeout=120)
    assert help_.returncode == 0 and "--selection" in help_.stdout and "leave-one-domain-out" in help_.stdout
    run = process_group.run(cmd + [str(tmp_path / "s"), "--selection", "loo"], capture_output=True, text=True,
                            env=env(), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "### PACS, model selection: leave-one-domain-out cross-validation" in run.stdout
