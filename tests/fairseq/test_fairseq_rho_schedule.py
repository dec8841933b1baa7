"""--rho-min: GSAM's rho schedule follows fairseq's learning rate (here inverse_sqrt
with warmup), from --rho-min at lr 0 to --rho at the peak --lr; without it rho is
constant."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

PEAK_LR = 2e-3  # model_args' --lr


def test_logged_rho_follows_the_lr(toy_data, tmp_path, fs):
    extra = ["--rho", "0.2", "--rho-min", "0.05", "--disable-validation", "--no-save"]
    lines = fs.train(fs.model_args(toy_data, tmp_path, max_update=8, extra=extra)).inner()
    assert len(lines) == 8
    lrs = [float(s["lr"]) for s in lines]
    rhos = [float(s["rho"]) for s in lines]
    # fairseq logs the lr set after the update (the next update's): update i used lrs[i - 1]
    for lr, rho in zip(lrs[:-1], rhos[1:]):
        assert rho == pytest.approx(0.05 + (0.2 - 0.05) * lr / PEAK_LR, abs=2e-5)
    assert max(rhos) == pytest.approx(0.2, abs=2e-5) and min(rhos) < 0.1  # warmup from lr 0, then decay


def test_without_rho_min_rho_is_constant(toy_data, tmp_path, fs):
    lines = fs.train(fs.model_args(toy_data, tmp_path, max_update=4,
                                   extra=["--rho", "0.2", "--disable-validation", "--no-save"])).inner()
    assert [float(s["rho"]) for s in lines] == [0.2] * 4
