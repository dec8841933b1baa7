"""``--hparams`` keys the algorithm's registry does not define are refused by the train
and sweep entry points before anything is written (DomainBed itself would ignore them,
so a typo trains with the default); ``--allow-unknown-hparams`` keeps DomainBed's way."""

import json

import pytest

from domainbed_testlib import DOMAINBED, PY, SKIP_REASON, run_all, train_cmd

pytestmark = pytest.mark.skipif(DOMAINBED is None, reason=SKIP_REASON)


def one_error_line(output):
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("domainbed_vasso: error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


@pytest.mark.parametrize("algorithm, hparams, named", [
    ("VASSO", {"batch_size": 8, "theat": 0.5}, "'theat' (closest valid: 'theta') is not an hparam of VASSO"),
    ("ERM", {"rho": 0.1}, "'rho' (an hparam of SAM, GSAM, VASSO only) is not an hparam of ERM"),
    ("SAM", {"theta": 0.4}, "'theta' (an hparam of VASSO only) is not an hparam of SAM"),
    ("CORAL", {"mmd_gammma": 1.0}, "'mmd_gammma' (closest valid: 'mmd_gamma') is not an hparam of CORAL"),
])
def test_train_refuses_an_unknown_key_before_writing_anything(tmp_path, algorithm, hparams, named):
    out = tmp_path / "out"
    [(code, output)] = run_all([train_cmd(out, algorithm, hparams)])
    assert code == 2
    line = one_error_line(output)
    assert named in line and "--allow-unknown-hparams" in line
    assert not out.exists()


# runs the train entry point and, as it exits, names which of DomainBed's heavy modules it had imported
LOADED_AT_EXIT = ("import atexit, runpy, sys\n"
                  "atexit.register(lambda: print('loaded:', [m for m in ('domainbed.algorithms', 'domainbed.datasets',"
                  " 'torchvision') if m in sys.modules]))\n"
                  "sys.argv[0] = 'domainbed_vasso.train'\n"
                  "runpy.run_module('domainbed_vasso.train', run_name='__main__')\n")


@pytest.mark.parametrize("hparams, named", [
    ({"theat": 0.5}, "'theat' (closest valid: 'theta') is not an hparam of VASSO"),
    ({"theta": 1.5}, "theta must be in"),
])
def test_train_refuses_a_bad_hparam_of_ours_before_loading_domainbeds_models_and_datasets(tmp_path, hparams,
                                                                                          named):
    # SAM's, GSAM's and VASSO's hparams are checked against the registry alone: torchvision and
    # wilds, which DomainBed's algorithms and datasets import, take seconds a refusal need not wait
    out = tmp_path / "out"
    cmd = train_cmd(out, "VASSO", hparams)
    assert cmd[:3] == [PY, "-m", "domainbed_vasso.train"]
    [(code, output)] = run_all([[PY, "-c", LOADED_AT_EXIT] + cmd[3:]])
    assert code == 2, output[-3000:]
    assert named in one_error_line("\n".join(l for l in output.splitlines() if not l.startswith("loaded:")))
    assert "loaded: []" in output.splitlines(), output[-3000:]
    assert not out.exists()


def test_allow_unknown_hparams_trains_as_domainbed_does(tmp_path):
    out = tmp_path / "out"
    [(code, output)] = run_all([train_cmd(out, "VASSO", {"batch_size": 8, "theat": 0.5}, steps=1,
                                          extra=["--allow-unknown-hparams"])])
    assert code == 0, output[-3000:]
    assert "'theat' (closest valid: 'theta') is not an hparam of VASSO" in output  # a warning now
    with open(out / "results.jsonl") as f:
        hparams = json.loads(f.readlines()[-1])["hparams"]
    assert hparams["theat"] == 0.5 and hparams["theta"] == 0.4  # DomainBed's behaviour: ignored


def sweep_cmd(tmp_path, hparams, *extra):
    return [PY, "-m", "domainbed_vasso.sweep", "launch", "--datasets", "Debug28", "--algorithms", "ERM", "VASSO",
            "--n_hparams", "1", "--n_trials", "1", "--single_test_envs", "--steps", "1",
            "--command_launcher", "dummy", "--skip_confirmation", "--hparams", json.dumps(hparams),
            "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "sweep"), *extra]


def test_sweep_refuses_a_key_unknown_to_any_swept_algorithm(tmp_path):
    [(code, output)] = run_all([sweep_cmd(tmp_path, {"batch_size": 8, "theta": 0.5})])
    assert code == 2
    assert "'theta' (an hparam of VASSO only) is not an hparam of ERM on Debug28" in one_error_line(output)
    assert not (tmp_path / "sweep").exists()


def test_sweep_passes_allow_unknown_hparams_to_its_children(tmp_path):
    [(code, output)] = run_all([sweep_cmd(tmp_path, {"batch_size": 8, "theta": 0.5}, "--allow-unknown-hparams")])
    assert code == 0, output[-3000:]
    children = [line for line in output.splitlines() if "-m domainbed_vasso.train" in line]
    assert len(children) == 6 and all(" -m domainbed_vasso.train --allow-unknown-hparams --" in c for c in children)


def test_known_keys_pass(tmp_path):
    [(code, output)] = run_all([sweep_cmd(tmp_path, {"batch_size": 8, "lr": 1e-3})])
    assert code == 0, output[-3000:]
    assert "Launched 6 jobs" in output and "--allow-unknown-hparams" not in output, output[-2000:]
