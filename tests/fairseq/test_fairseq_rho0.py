"""Item 1: --rho 0 reproduces --optimizer adam update for update, with dropout on.

The second pass must replay the first pass's RNG state (dropout masks): if it drew
fresh masks, h_t would differ from g_t and the trajectories would split."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

import torch


def _params(fs, save_dir):
    return fs.load_checkpoint(save_dir / "checkpoint_last.pt")["model"]


def test_rho0_matches_adam_update_for_update(toy_data, tmp_path, fs):
    extra = ["--dropout", "0.3", "--attention-dropout", "0.1", "--clip-norm", "0.5"]
    adam = fs.train(fs.model_args(toy_data, tmp_path / "adam", optimizer="adam", extra=extra))
    runs = {}
    for opt, more in (("vasso", ["--theta", "0.4"]), ("sam", [])):
        runs[opt] = fs.train(fs.model_args(toy_data, tmp_path / opt, optimizer=opt,
                                           extra=extra + ["--rho", "0"] + more))
    assert len(adam.losses()) == 8
    ref = _params(fs, tmp_path / "adam")
    for opt, run in runs.items():
        # every logged update has the same loss and gradient norm
        assert run.losses() == adam.losses(), opt
        assert [s["gnorm"] for s in run.inner()] == [s["gnorm"] for s in adam.inner()], opt
        # both passes really ran (two_pass = 1) and the parameters are bit for bit the same
        assert all(float(s["two_pass"]) == 1.0 for s in run.inner())
        got = _params(fs, tmp_path / opt)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (opt, k)

    # control: with rho > 0 the same command does something else
    moved = fs.train(fs.model_args(toy_data, tmp_path / "rho", optimizer="vasso", extra=extra + ["--rho", "0.5"]))
    got = _params(fs, tmp_path / "rho")
    assert any(not torch.equal(got[k], ref[k]) for k in ref)
    assert moved.losses()[0] == adam.losses()[0]


def test_store_ema_tracks_the_updated_model(toy_data, tmp_path, fs):
    """--store-ema is supported: fairseq steps the EMA after the update, when the
    parameters are back at x_t and updated (never at x_t + eps_t)."""
    ema = ["--store-ema", "--ema-decay", "0.5", "--ema-start-update", "4", "--no-save-optimizer-state"]
    fs.train(fs.model_args(toy_data, tmp_path / "adam", optimizer="adam", extra=ema))
    fs.train(fs.model_args(toy_data, tmp_path / "sam0", optimizer="sam", extra=ema + ["--rho", "0"]))
    a = fs.load_checkpoint(tmp_path / "adam" / "checkpoint_last.pt")["extra_state"]["ema"]
    b = fs.load_checkpoint(tmp_path / "sam0" / "checkpoint_last.pt")["extra_state"]["ema"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # before --ema-start-update the EMA is a copy of the model: it equals the restored,
    # updated parameters bit for bit
    fs.train(fs.model_args(toy_data, tmp_path / "vasso", optimizer="vasso",
                           extra=ema[:-1] + ["--ema-start-update", "100", "--rho", "0.5"]))
    ck = fs.load_checkpoint(tmp_path / "vasso" / "checkpoint_last.pt")
    model, copy = ck["model"], ck["extra_state"]["ema"]
    # (fairseq's EMA does not copy the "version" buffers)
    assert all(torch.equal(model[k], copy[k]) for k in model if "version" not in k)


def test_other_optimizers_run_fairseqs_own_code(toy_data, tmp_path, fs, monkeypatch):
    """With the user-dir imported, --optimizer adam makes the same updates as with
    fairseq exactly as shipped: every patch of fairseq_vasso.hooks (argument parsing,
    Trainer.__init__, Trainer.train_step) taken out."""
    from fairseq import options
    from fairseq.trainer import Trainer

    from fairseq_vasso import hooks

    extra = ["--dropout", "0.3", "--update-freq", "2", "--clip-norm", "0.5"]
    assert getattr(Trainer.train_step, "_fairseq_vasso_hook", False)
    fs.train(fs.model_args(toy_data, tmp_path / "hooked", optimizer="adam", extra=extra))
    with hooks.stock_fairseq():
        assert not any(getattr(getattr(owner, attr), "_fairseq_vasso_hook", False)
                       for owner, attr in ((Trainer, "train_step"), (Trainer, "__init__"),
                                           (options, "parse_args_and_arch")))
        fs.train(fs.model_args(toy_data, tmp_path / "stock", optimizer="adam", extra=extra))
    a = _params(fs, tmp_path / "hooked")
    b = _params(fs, tmp_path / "stock")
    assert all(torch.equal(a[k], b[k]) for k in a)
