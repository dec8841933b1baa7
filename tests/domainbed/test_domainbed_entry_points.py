"""The entry points without DomainBed (clear error), and the paper's sweep recipe
(DomainBed's dummy launcher: prints the children's commands, runs nothing)."""

import os
import sys

import process_group
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("DOMAINBED_ROOT", "PYTHONPATH")}
    env["PYTHONPATH"] = ROOT
    env.update(extra)
    return env


# Runs a module with every sys.path entry that holds a ``domainbed`` package removed, so
# that DomainBed is missing however this environment provides it (PYTHONPATH, a .pth file
# from setup_env.sh --with-domainbed, site-packages, a checkout beside this one).
WITHOUT_DOMAINBED = (
    "import os, runpy, sys\n"
    "os.environ['DOMAINBED_VASSO_BESIDE'] = '0'\n"
    "sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or '.', 'domainbed', '__init__.py'))]\n"
    "module = sys.argv[1]; sys.argv = [module] + sys.argv[2:]\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


@pytest.mark.parametrize("module", ["domainbed_vasso.train", "domainbed_vasso.sweep",
                                    "domainbed_vasso.collect_results"])
def test_missing_domainbed_says_how_to_fix(module, tmp_path):
    proc = process_group.run([sys.executable, "-c", WITHOUT_DOMAINBED, module, "--algorithm", "VASSO"],
                             cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "neither on sys.path nor named by DOMAINBED_ROOT" in proc.stderr
    assert "bash scripts/setup_env.sh --with-domainbed" in proc.stderr  # the fix in a clone
    assert "export DOMAINBED_ROOT=/path/to/DomainBed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_domainbed_root_at_an_empty_folder_says_how_to_fix(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = process_group.run([sys.executable, "-c", WITHOUT_DOMAINBED, "domainbed_vasso.train"], cwd=tmp_path,
                             env=clean_env(DOMAINBED_ROOT=str(empty)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"DOMAINBED_ROOT={empty} does not contain domainbed/__init__.py" in proc.stderr
    assert "export DOMAINBED_ROOT=/path/to/DomainBed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_tables_without_domainbed_say_how_to_fix(tmp_path):
    """vasso-domainbed-tables selects with DomainBed's own code: without it, one clear error."""
    from domainbed_testlib import env_without_domainbed
    proc = process_group.run([sys.executable, "-m", "domainbed_vasso.tables", str(tmp_path)], cwd=tmp_path,
                             env=env_without_domainbed(tmp_path), capture_output=True, text=True, timeout=120)
    assert "needs a DomainBed checkout" in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2
    assert "export DOMAINBED_ROOT=/path/to/DomainBed" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_domainbed_root_is_named(tmp_path):
    proc = process_group.run([sys.executable, "-m", "domainbed_vasso.train"], cwd=tmp_path,
                             env=clean_env(DOMAINBED_ROOT=str(tmp_path / "nowhere")),
                             capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"DOMAINBED_ROOT={tmp_path / 'nowhere'} does not contain domainbed/__init__.py" in proc.stderr


def numpy_only_pythonpath(tmp_path):
    """A PYTHONPATH for ``python -S`` (no site-packages) holding this repository and numpy,
    and not torch: the system Python of a newcomer who forgot the project's .venv."""
    import numpy
    only = tmp_path / "numpy-only"
    only.mkdir()
    (only / "numpy").symlink_to(os.path.dirname(numpy.__file__))
    return os.pathsep.join([ROOT, str(only)])


@pytest.mark.parametrize("module", ["domainbed_vasso.train", "domainbed_vasso.sweep"])
@pytest.mark.parametrize("lacks", ["numpy", "torch"])
def test_python_without_torch_says_use_the_venv_not_clone_domainbed(module, lacks, tmp_path):
    # -S: no site-packages, so a Python without numpy and torch (with numpy when it is put
    # on PYTHONPATH by itself); DomainBed is there: the fix must not be "clone DomainBed"
    from domainbed_testlib import DOMAINBED
    path = ROOT if lacks == "numpy" else numpy_only_pythonpath(tmp_path)
    env = clean_env(PYTHONPATH=path, DOMAINBED_ROOT=DOMAINBED or "")
    proc = process_group.run([sys.executable, "-S", "-m", module, "--algorithm", "VASSO"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"has no module named '{lacks}', which domainbed_vasso imports" in proc.stderr
    assert f".venv/bin/python -m {module}" in proc.stderr
    assert "scripts/setup_env.sh" in proc.stderr
    assert "git clone" not in proc.stderr and "Traceback" not in proc.stderr


def test_missing_requirement_of_domainbed_is_not_reported_as_missing_domainbed(tmp_path):
    from domainbed_testlib import DOMAINBED, SKIP_REASON
    if DOMAINBED is None:
        pytest.skip(SKIP_REASON)
    # DomainBed imports wilds when its datasets load; this interpreter "lacks" it
    code = ("import sys; sys.modules['wilds'] = None; sys.argv[0] = 'train'\n"
            "from domainbed_vasso.train import main; main(['--algorithm', 'VASSO'])")
    proc = process_group.run([sys.executable, "-c", code], cwd=tmp_path,
                             env=clean_env(DOMAINBED_ROOT=DOMAINBED),
                             capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"DomainBed was found at {DOMAINBED}" in proc.stderr
    assert "has no module named 'wilds', which DomainBed imports" in proc.stderr
    assert "pip install wilds" in proc.stderr and ".venv/bin/python" in proc.stderr
    assert "git clone" not in proc.stderr and "Traceback" not in proc.stderr


def test_register_without_domainbed_raises_domainbed_not_found(monkeypatch, tmp_path):
    import domainbed_vasso
    from domainbed_vasso import _locate
    monkeypatch.setenv("DOMAINBED_ROOT", str(tmp_path))
    with pytest.raises(domainbed_vasso.DomainBedNotFound, match="DOMAINBED_ROOT"):
        domainbed_vasso.register()
    assert issubclass(_locate.DomainBedNotFound, ImportError)


def test_paper_recipe_launches_the_four_datasets_with_torchvision_resnet(tmp_path):
    from domainbed_testlib import DOMAINBED, SKIP_REASON
    if DOMAINBED is None:
        pytest.skip(SKIP_REASON)
    env = clean_env(DOMAINBED_ROOT=DOMAINBED, DATA_DIR=str(tmp_path / "data"),
                    OUTPUT_DIR=str(tmp_path / "sweep"), LAUNCHER="dummy", N_HPARAMS="1",
                    N_TRIALS="1", PYTHON=sys.executable)
    proc = process_group.run(["bash", os.path.join(ROOT, "scripts", "domainbed", "paper_sweep.sh"), "launch",
                              "--skip_confirmation"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commands = [line[len("Dummy launcher: "):] for line in proc.stdout.splitlines()
                if line.startswith("Dummy launcher: ")]
    # 4 datasets x 4 algorithms x (4 single + 6 pairs of test envs) x 1 hparam x 1 trial
    assert len(commands) == 160
    for c in commands:
        assert c.startswith(f"{sys.executable} -m domainbed_vasso.train ")
        assert "--hparams '{\"resnet50_augmix\": false, \"freeze_bn\": true}'" in c
    for name in ("PACS", "VLCS", "OfficeHome", "TerraIncognita"):
        assert sum(f"--dataset {name} " in c for c in commands) == 40
    for alg in ("ERM", "SAM", "GSAM", "VASSO"):
        assert sum(c.split("--algorithm ")[1].startswith(alg + " ") for c in commands) == 40


def test_resnet_weights_variable(monkeypatch, tmp_path):
    import torch
    import torchvision

    from domainbed_vasso import _locate
    # let monkeypatch undo what apply_resnet_weights does to torchvision
    monkeypatch.setattr(torchvision.models, "resnet18", torchvision.models.resnet18)
    monkeypatch.setattr(torchvision.models, "resnet50", torchvision.models.resnet50)
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    path = tmp_path / "r18.pth"
    torch.save(reference.state_dict(), path)
    assert _locate.apply_resnet_weights(str(path)) == str(path)
    loaded = torchvision.models.resnet18(pretrained=True)  # DomainBed's call; no download
    for k, v in reference.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    fresh = torchvision.models.resnet18()  # not asked for weights: random init as usual
    assert not torch.equal(fresh.conv1.weight, reference.conv1.weight)
    with pytest.raises(FileNotFoundError, match="DOMAINBED_VASSO_RESNET_WEIGHTS"):
        _locate.apply_resnet_weights(str(tmp_path / "missing.pth"))
    assert _locate.apply_resnet_weights("") is None


def test_help_lists_domainbeds_flags_despite_its_bare_percent(tmp_path):
    from domainbed_testlib import DOMAINBED, SKIP_REASON
    if DOMAINBED is None:
        pytest.skip(SKIP_REASON)
    proc = process_group.run([sys.executable, "-m", "domainbed_vasso.train", "-h"], capture_output=True, text=True,
                             env=clean_env(DOMAINBED_ROOT=DOMAINBED), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--uda_holdout_fraction" in proc.stdout and "% of test" in proc.stdout
    assert "--algorithm" in proc.stdout


DIGITS_SWEEP = os.path.join(ROOT, "scripts", "digits", "digits_sweep.sh")


def test_digits_sweep_finds_domainbed_without_domainbed_root(tmp_path):
    """As after `setup_env.sh --with-domainbed`: DomainBed on sys.path, no DOMAINBED_ROOT
    (DomainBed's dummy launcher: the 90 jobs are printed, not run)."""
    from domainbed_testlib import DOMAINBED, SKIP_REASON
    if DOMAINBED is None:
        pytest.skip(SKIP_REASON)
    env = clean_env(PYTHONPATH=os.pathsep.join([ROOT, DOMAINBED]), PYTHON=sys.executable)
    assert "DOMAINBED_ROOT" not in env
    out = tmp_path / "sweep"
    proc = process_group.run(["bash", DIGITS_SWEEP, str(out), "--command_launcher", "dummy"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
    log = (out / "sweep.log").read_text()
    assert "Launched 90 jobs" in log, proc.stderr[-3000:] + log[-3000:]
    assert log.count(f"{sys.executable} -m domainbed_vasso.train --algorithm") == 90
    assert "DOMAINBED_ROOT" not in proc.stderr


def test_digits_sweep_without_domainbed_names_the_fix_before_writing(tmp_path):
    # the precondition first: an environment where DomainBed cannot be imported, however it is
    # installed (else the script would start its 90 jobs)
    from domainbed_testlib import env_without_domainbed
    out = tmp_path / "sweep"
    proc = process_group.run(["bash", DIGITS_SWEEP, str(out)], cwd=tmp_path,
                             env=env_without_domainbed(tmp_path, PYTHON=sys.executable),
                             capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "digits_sweep.sh: error: domainbed_vasso needs a DomainBed checkout" in proc.stderr
    assert "bash scripts/setup_env.sh --with-domainbed" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("module, extra", [
    ("domainbed_vasso.train", ["--algorithm", "VASSO", "--test_envs", "0", "--output_dir", "OUT"]),
    ("domainbed_vasso.sweep", ["launch", "--algorithms", "VASSO", "--output_dir", "OUT", "--command_launcher",
                               "local", "--skip_confirmation", "--n_hparams", "1", "--n_trials", "1"]),
])
def test_a_dataset_that_needs_a_download_names_the_command(tmp_path, module, extra):
    from domainbed_testlib import DOMAINBED, SKIP_REASON
    if DOMAINBED is None:
        pytest.skip(SKIP_REASON)
    out, data = tmp_path / "out", tmp_path / "data"
    argv = [a if a != "OUT" else str(out) for a in extra]
    proc = process_group.run([sys.executable, "-m", module, "--dataset" if module.endswith("train") else "--datasets",
                              "PACS", "--data_dir", str(data), *argv], cwd=tmp_path,
                             env=clean_env(DOMAINBED_ROOT=DOMAINBED), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"domainbed_vasso: error: --dataset PACS reads {data / 'PACS'}, which does not exist: download it "
            f"first (9,991 images, about 200 MB): .venv/bin/python -m domainbed_vasso.download --data_dir {data} PACS"
            in proc.stderr)
    assert "Traceback" not in proc.stderr and not out.exists()
    # what a failed download used to leave: an empty folder is named as one, with the fix
    (data / "PACS").mkdir(parents=True)
    from domainbed_vasso.download import missing_dataset
    assert "which holds 0 of its 4 domain folders: an interrupted download?" in missing_dataset("PACS", str(data))
    fake_pacs(data / "PACS")
    assert missing_dataset("PACS", str(data)) is None and missing_dataset("Debug28", str(data)) is None


def fake_pacs(folder, images=True):
    """PACS's layout as DomainBed reads it (4 domains, 7 classes), one tiny file per class."""
    for domain in ("art_painting", "cartoon", "photo", "sketch"):
        for cls in ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"):
            (folder / domain / cls).mkdir(parents=True)
            if images:
                (folder / domain / cls / "1.jpg").write_bytes(b"\xff\xd8")


def test_a_failed_download_leaves_nothing_and_a_finished_one_moves_into_place(tmp_path, capsys):
    # no network: DomainBed's download function is simulated, as it behaves (stage_path makes
    # DATA/PACS first, then the download fails; or it ends with DATA/PACS complete)
    from domainbed_vasso import download
    data = tmp_path / "data"
    data.mkdir()

    def failing(data_dir):
        os.makedirs(os.path.join(data_dir, "PACS"))
        raise ConnectionError("Google Drive said no")

    with pytest.raises(ConnectionError):
        download.fetch("PACS", str(data), failing)
    assert os.listdir(data) == []  # no empty PACS/, no staging folder

    def truncated(data_dir):
        fake_pacs(tmp_path / "staged" / "PACS", images=False)
        os.rename(tmp_path / "staged" / "PACS", os.path.join(data_dir, "PACS"))

    with pytest.raises(SystemExit, match="has no images in art_painting; nothing was kept"):
        download.fetch("PACS", str(data), truncated)
    assert os.listdir(data) == []

    def working(data_dir):
        fake_pacs(tmp_path / "kfold")
        os.rename(tmp_path / "kfold", os.path.join(data_dir, "PACS"))

    (data / "PACS").mkdir()  # an older failed download's empty folder is replaced
    assert download.fetch("PACS", str(data), working) == str(data / "PACS")
    assert os.listdir(data) == ["PACS"] and download.incomplete("PACS", str(data / "PACS")) is None
    before = sorted(str(p) for p in (data / "PACS").rglob("*"))
    download.fetch("PACS", str(data), failing)  # complete already: not downloaded again
    assert "complete already" in capsys.readouterr().err
    assert sorted(str(p) for p in (data / "PACS").rglob("*")) == before


def test_download_lists_the_datasets():
    proc = process_group.run([sys.executable, "-m", "domainbed_vasso.download", "--help"], env=clean_env(),
                             capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for name in ("PACS", "VLCS", "OfficeHome", "TerraIncognita", "DomainNet", "--data_dir"):
        assert name in proc.stdout


@pytest.mark.parametrize("module, argv, named", [
    # DomainBed's train script would load the data first, its sweep launch every job to fail
    # (batch_size 8: Debug28 at its default hangs DomainBed's loaders)
    ("domainbed_vasso.train", ["--dataset", "Debug28", "--algorithm", "ERMM", "--test_envs", "0",
                               "--hparams", '{"batch_size": 8}'],
     "--algorithm: 'ERMM' (closest valid: 'ERM') is not one of DomainBed's; expected one of ERM, "),
    ("domainbed_vasso.train", ["--dataset", "PACSS", "--algorithm", "VASSO", "--test_envs", "0"],
     "--dataset: 'PACSS' (closest valid: 'PACS') is not one of DomainBed's; expected one of Debug28, "),
    ("domainbed_vasso.sweep", ["launch", "--datasets", "Debug28", "--algorithms", "ERM", "VASO",
                               "--command_launcher", "dummy", "--skip_confirmation"],
     "--algorithms: 'VASO' (closest valid: 'VASSO') is not one of DomainBed's; expected one of ERM, "),
    ("domainbed_vasso.sweep", ["launch", "--datasets", "RotatedDigit", "--algorithms", "ERM",
                               "--command_launcher", "dummy", "--skip_confirmation"],
     "--datasets: 'RotatedDigit' (closest valid: 'RotatedDigits') is not one of DomainBed's; expected one of "),
], ids=["train-algorithm", "train-dataset", "sweep-algorithms", "sweep-datasets"])
def test_an_algorithm_or_dataset_domainbed_lacks_is_refused_before_any_work(tmp_path, module, argv, named):
    from domainbed_testlib import DOMAINBED, SKIP_REASON
    if DOMAINBED is None:
        pytest.skip(SKIP_REASON)
    out = tmp_path / "out"
    proc = process_group.run([sys.executable, "-m", module, *argv, "--data_dir", str(tmp_path / "data"),
                              "--output_dir", str(out)], cwd=tmp_path, env=clean_env(DOMAINBED_ROOT=DOMAINBED),
                             capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("domainbed_vasso: error: ")]
    assert len(errors) == 1 and named in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists() and "Launched" not in proc.stdout
