"""Item 9: bad flag values make fairseq-train exit non-zero before training, with a
message naming the flag and its range.  Also: the flags show in --help."""

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
    assert out.returncode != 0, text[-2000:]
    assert "ValueError: --rho must be in [0, inf), got -1.0" in text, text[-2000:]
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
])
def test_bad_flags_in_process(toy_data, tmp_path, fs, flags, name):
    """The same code path in this process (fairseq_cli.train.main): raised before training."""
    with pytest.raises(ValueError, match=name.replace("-", r"\-") + " must be in") as info:
        run = None
        run = fs.train(fs.model_args(toy_data, tmp_path) + flags)
    assert run is None and "got" in str(info.value)
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_theta_is_a_vasso_flag_only(toy_data, tmp_path, fs):
    with pytest.raises(SystemExit):
        fs.train(fs.model_args(toy_data, tmp_path, optimizer="sam") + ["--theta", "0.4"])


def test_flags_show_in_help(fs):
    out = fs.run_cli("fairseq_cli.train", ["--user-dir", fs.USER_DIR, "--optimizer", "vasso", "--help"])
    text = out.stdout
    for flag in ("--rho", "--theta", "--adaptive", "--adaptive-eta", "--gsam-alpha", "--perturb-prob",
                 "--adam-betas", "--weight-decay"):
        assert flag in text, flag
    assert "eSAM / eVASSO" in text
