"""Item 9: bad flag values make fairseq-train exit non-zero before it builds the task,
model or data, with one line naming the flag and its range.  Also: the flags show in
--help."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)


def test_bad_flag_exits_nonzero_before_training(toy_data, tmp_path, fs):
    """The real command line (one process): --rho -1."""
    out = fs.run_cli("fairseq_cli.train", fs.model_args(toy_data, tmp_path) + ["--rho", "-1"])
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-2000:]
    assert "error: --rho must be in [0, inf), got -1.0" in text, text[-2000:]
    # one line, the last (no traceback, no usage text)
    assert "Traceback" not in text and "usage:" not in text, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("error: --rho must be in [0, inf), got -1.0")
    # refused before fairseq set up the task (dictionaries) or built the model
    assert "dictionary:" not in text and "num. shared model params" not in text, text[-2000:]
    assert "begin training epoch" not in text and "train_inner" not in text
    assert not (tmp_path / "checkpoint_last.pt").exists()


@pytest.mark.parametrize("flags, name", [
    (["--optimizer", "vasso", "--theta", "1.5"], "--theta"),
    (["--optimizer", "sam", "--perturb-prob", "2"], "--perturb-prob"),
    (["--optimizer", "vasso", "--theta", "0"], "--theta"),
    (["--optimizer", "sam", "--gsam-alpha", "-0.1"], "--gsam-alpha"),
    (["--optimizer", "sam", "--adaptive", "--adaptive-eta", "-1"], "--adaptive-eta"),
    (["--optimizer", "vasso", "--perturb-prob", "-0.5"], "--perturb-prob"),
    (["--optimizer", "vasso", "--rho", "nan"], "--rho"),
    (["--optimizer", "vasso", "--rho", "0.1", "--rho-min", "0.2"], "--rho-min"),
    (["--optimizer", "sam", "--rho-min", "-1"], "--rho-min"),
    (["--optimizer", "sam", "--weight-decay", "-1"], "--weight-decay"),
])
def test_bad_flags_in_process(toy_data, tmp_path, fs, flags, name, capsys):
    """The same code path in this process: refused while the command line is parsed."""
    with pytest.raises(SystemExit) as info:
        run = None
        run = fs.train(fs.model_args(toy_data, tmp_path) + flags)
    assert run is None and info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and f"error: {name} must be in" in err[-1] and "got" in err[-1], err
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_bad_flag_in_a_config_that_bypasses_the_command_line(toy_data, tmp_path, fs):
    """Configs built without argparse (hydra) meet the same check when the trainer is built."""
    from fairseq_vasso.hooks import check_config
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"optimizer": {"_name": "vasso", "rho": 0.1, "rho_min": 0.5, "theta": 0.4}})
    with pytest.raises(ValueError, match=r"--rho-min must be in \[0, 0.1\], got 0.5"):
        check_config(cfg)


@pytest.mark.parametrize("theta", [["--theta", "0.4"], ["--theta=0.4"]])
def test_theta_is_a_vasso_flag_only(toy_data, tmp_path, fs, capsys, theta):
    # one line that says whose flag it is, not argparse's usage text and "unrecognized arguments"
    with pytest.raises(SystemExit) as stop:
        fs.train(fs.model_args(toy_data, tmp_path, optimizer="sam") + theta)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].endswith(
        "error: --theta is a flag of --optimizer vasso only, not of --optimizer sam (drop it, or use --optimizer vasso)")
    assert "usage:" not in err and "unrecognized arguments" not in err


def test_flags_show_in_help(fs):
    out = fs.run_cli("fairseq_cli.train", ["--user-dir", fs.USER_DIR, "--optimizer", "vasso", "--help"])
    text = out.stdout
    for flag in ("--rho", "--theta", "--adaptive", "--adaptive-eta", "--gsam-alpha", "--perturb-prob",
                 "--adam-betas", "--weight-decay"):
        assert flag in text, flag
    assert "eSAM / eVASSO" in text
