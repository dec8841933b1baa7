"""register() leaves DomainBed whole: DomainBed's lists and default sweep stay its own,
RotatedDigits trains with default hparams for every algorithm, and a registering
collect_results tables a RotatedDigits sweep (leave-one-domain-out included)."""

import functools
import itertools
import json
import tempfile

import process_group
import pytest
from domainbed_testlib import DOMAINBED, PY, SKIP_REASON, env, run_all

pytestmark = pytest.mark.skipif(DOMAINBED is None, reason=SKIP_REASON)

OURS = ("SAM", "GSAM", "VASSO")


@functools.lru_cache(maxsize=None)
def stock_lists():
    """DomainBed's DATASETS and ALGORITHMS in a process that never called register()."""
    code = ("import json; from domainbed import algorithms, datasets; "
            "print(json.dumps([datasets.DATASETS, algorithms.ALGORITHMS]))")
    out = process_group.run([PY, "-c", code], env=env(), cwd=tempfile.gettempdir(), capture_output=True, text=True,
                            timeout=300, check=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.fixture(scope="module")
def domainbed():
    import domainbed_vasso
    domainbed_vasso.register(apply_environment=False)
    from domainbed import algorithms, datasets, hparams_registry
    return algorithms, datasets, hparams_registry


def test_register_keeps_domainbeds_datasets_and_appends_only_our_algorithms(domainbed):
    algorithms, datasets, _ = domainbed
    stock_datasets, stock_algorithms = stock_lists()
    assert "RotatedDigits" not in stock_datasets
    assert datasets.DATASETS == stock_datasets
    assert algorithms.ALGORITHMS == stock_algorithms + [a for a in OURS if a not in stock_algorithms]
    assert datasets.get_dataset_class("RotatedDigits").ENVIRONMENTS == ["0", "30", "60", "90"]


@pytest.mark.parametrize("algorithm", ["ERM", "DANN", "IRM", *OURS])
def test_rotated_digits_has_mlp_and_small_image_hparams(domainbed, algorithm):
    _, _, registry = domainbed
    default = registry.default_hparams(algorithm, "RotatedDigits")
    assert {"mlp_width", "mlp_depth", "mlp_dropout"} <= set(default)
    # DomainBed's own entries of a rotated small-image dataset (RotatedMNIST), MLP hparams added
    mnist = registry.default_hparams(algorithm, "RotatedMNIST")
    assert {k: v for k, v in default.items() if not k.startswith("mlp_")} == \
        {k: v for k, v in mnist.items() if not k.startswith("mlp_")}
    assert default["lr"] == 1e-3 and default["batch_size"] == 64
    drawn = registry.random_hparams(algorithm, "RotatedDigits", 7)
    assert drawn == registry.random_hparams(algorithm, "RotatedDigits", 7)  # deterministic
    assert drawn.keys() == default.keys()
    assert 64 <= drawn["mlp_width"] <= 1024 and drawn["mlp_depth"] in (3, 4, 5)
    if algorithm == "DANN":  # DomainBed defines DANN's MLP itself: kept, not overridden
        assert drawn["mlp_width"] == registry.random_hparams("DANN", "RotatedMNIST", 7)["mlp_width"]


def test_stock_datasets_get_domainbeds_hparams_unchanged(domainbed):
    _, _, registry = domainbed
    original = registry._hparams._domainbed_vasso_original
    for dataset in ("PACS", "RotatedMNIST"):
        for algorithm in ("ERM", "DANN"):
            assert registry._hparams(algorithm, dataset, 3) == original(algorithm, dataset, 3)


def test_default_sweep_is_domainbeds(tmp_path):
    stock_datasets, _ = stock_lists()
    proc = process_group.run([PY, "-m", "domainbed_vasso.sweep", "launch", "--data_dir", str(tmp_path / "data"),
                              "--output_dir", str(tmp_path / "sweep"), "--algorithms", "VASSO",
                              "--n_hparams", "1", "--n_trials", "1", "--command_launcher", "dummy",
                              "--skip_confirmation"], cwd=tmp_path, env=env(), capture_output=True,
                             text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commands = [line for line in proc.stdout.splitlines() if line.startswith("Dummy launcher: ")]
    launched = {c.split("--dataset ")[1].split()[0] for c in commands}
    assert launched == {d for d in stock_datasets if "Debug" not in d}  # DomainBed's default
    assert not any("RotatedDigits" in c for c in commands)


def collect_results(input_dir, cwd):
    proc = process_group.run([PY, "-m", "domainbed_vasso.collect_results", "--input_dir", str(input_dir)],
                             cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def table_rows(text, header):
    """``{row label: cells}`` of the table printed under ``header`` by collect_results."""
    block = text.split(header, 1)[1].split("-------- ", 1)[0]
    rows = {}
    for line in block.splitlines():
        cells = line.split()
        if cells and cells[0] not in ("Algorithm",):
            rows[cells[0]] = " ".join(cells[1:])
    return rows


def test_every_algorithm_trains_on_rotated_digits_with_default_hparams(tmp_path):
    algorithms = ["ERM", *OURS]
    runs = tmp_path / "runs"
    cmds = [[PY, "-m", "domainbed_vasso.train", "--data_dir", str(tmp_path), "--dataset", "RotatedDigits",
             "--algorithm", a, "--test_envs", "0", "--steps", "3", "--checkpoint_freq", "2",
             "--output_dir", str(runs / a)] for a in algorithms]
    for algorithm, (code, out) in zip(algorithms, run_all(cmds)):
        assert code == 0, f"{algorithm}:\n{out[-3000:]}"
        records = [json.loads(line) for line in (runs / algorithm / "results.jsonl").read_text().splitlines()]
        assert records[-1]["hparams"]["mlp_width"] == 256 and records[-1]["hparams"]["lr"] == 1e-3
        assert (runs / algorithm / "done").exists()
    # their records reach the registering collect_results (training-domain validation table)
    rows = table_rows(collect_results(runs, tmp_path),
                      "Dataset: RotatedDigits, model selection method: training-domain validation set")
    assert set(rows) == set(algorithms)
    # one number each, under test domain 0 (the other domains were not held out: X)
    assert all(cells.split()[1:3] == ["+/-", "0.0"] and cells.split()[3:] == ["X"] * 4
               for cells in rows.values()), rows


def test_collect_results_tables_a_rotated_digits_sweep_leave_one_domain_out(tmp_path):
    """A sweep's layout and records (one hparam seed, one trial, steps 0 and 1, single test
    domains and pairs), with accuracies chosen so that the expected table is known."""
    single = {"ERM": [0.612, 0.724, 0.836, 0.948], "VASSO": [0.653, 0.765, 0.857, 0.969]}
    runs = []
    for algorithm in single:
        for test_envs in [[t] for t in range(4)] + [list(p) for p in itertools.combinations(range(4), 2)]:
            records = []
            for step in (0, 1):
                r = {"args": {"dataset": "RotatedDigits", "algorithm": algorithm, "test_envs": test_envs,
                              "hparams_seed": 0, "trial_seed": 0, "holdout_fraction": 0.2}, "step": step}
                for i in range(4):
                    # validation domains are best at step 1, the test domain is worse there in
                    # a single run: leave-one-domain-out must pick step 1 from the pairs
                    r[f"env{i}_in_acc"] = (0.99 if step == 0 else single[algorithm][i]) \
                        if test_envs == [i] else (0.5 if step == 0 else 0.9)
                    r[f"env{i}_out_acc"] = 0.5
                records.append(r)
            runs.append(records)
    sweep = tmp_path / "sweep"
    for n, records in enumerate(runs):
        (sweep / f"run{n}").mkdir(parents=True)
        (sweep / f"run{n}" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    text = collect_results(sweep, tmp_path)
    rows = table_rows(text, "Dataset: RotatedDigits, model selection method: leave-one-domain-out cross-validation")
    for algorithm, accs in single.items():
        expected = [f"{100 * a:.1f} +/- 0.0" for a in accs] + [f"{100 * sum(accs) / 4:.1f}"]
        assert rows[algorithm] == " ".join(expected), text
    averages = table_rows(text, "Averages, model selection method: leave-one-domain-out cross-validation")
    assert averages["VASSO"].startswith(f"{100 * sum(single['VASSO']) / 4:.1f} +/- 0.0"), text
    assert (sweep / "results.txt").exists()
