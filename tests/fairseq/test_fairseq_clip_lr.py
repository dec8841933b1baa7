"""Item 4: --clip-norm clips the descent gradient h_t, the 1/sample_size scaling is
stock fairseq's, and inverse_sqrt drives the lr the base Adam uses."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

import math

import torch

import plugins
from fairseq.optim.adam import Adam as FairseqAdam
from fairseq.trainer import Trainer


def _norm(tensors):
    return float(torch.linalg.vector_norm(torch.stack([t.float().norm() for t in tensors])))


def test_clip_scaling_and_lr(toy_data, tmp_path, fs, monkeypatch):
    seen = {"perturb": [], "clip_in": [], "adam": [], "lr": []}

    stock_perturb = plugins.SharpnessAware.perturb

    def perturb(self):
        seen["perturb"].append(_norm([p.grad for g in self.param_groups for p in g["params"]
                                      if p.grad is not None]))
        return stock_perturb(self)

    stock_clip = Trainer.clip_grad_norm

    def clip(self, clip_norm):
        seen["clip_in"].append(_norm([p.grad for p in self.optimizer.params if p.grad is not None]))
        return stock_clip(self, clip_norm)

    stock_step = FairseqAdam.step

    def adam_step(self, closure=None):
        seen["adam"].append(_norm([p.grad for g in self.param_groups for p in g["params"]
                                   if p.grad is not None]))
        seen["lr"].append(self.param_groups[0]["lr"])
        return stock_step(self, closure)

    monkeypatch.setattr(plugins.SharpnessAware, "perturb", perturb)
    monkeypatch.setattr(Trainer, "clip_grad_norm", clip)
    monkeypatch.setattr(FairseqAdam, "step", adam_step)

    clip_norm, lr, warmup = 0.05, 2e-3, 4
    common = ["--clip-norm", str(clip_norm), "--dropout", "0.1"]

    # stock: rho = 0 with clipping gives bit-identical parameters (scaling, clipping, lr as stock)
    fs.train(fs.model_args(toy_data, tmp_path / "adam", optimizer="adam", extra=common))
    stock_lr = list(seen["lr"])
    for k in seen:
        seen[k].clear()
    fs.train(fs.model_args(toy_data, tmp_path / "sam0", optimizer="sam", extra=common + ["--rho", "0"]))
    pa = fs.load_checkpoint(tmp_path / "adam" / "checkpoint_last.pt")["model"]
    p0 = fs.load_checkpoint(tmp_path / "sam0" / "checkpoint_last.pt")["model"]
    assert all(torch.equal(pa[k], p0[k]) for k in pa)
    assert seen["lr"] == stock_lr
    for k in seen:
        seen[k].clear()

    run = fs.train(fs.model_args(toy_data, tmp_path / "sam", optimizer="sam", extra=common + ["--rho", "0.5"]))
    n = len(run.inner())
    assert n == 8 and len(seen["perturb"]) == len(seen["clip_in"]) == len(seen["adam"]) == n
    for g, h, stepped, logged in zip(seen["perturb"], seen["clip_in"], seen["adam"], run.inner()):
        # fairseq clipped (and logged as gnorm) the second-pass gradient h_t, not g_t
        assert abs(h - g) > 1e-3 * g
        assert abs(float(logged["gnorm"]) - h) <= 1e-3 * max(h, 1.0) + 1e-3
        # the gradient Adam stepped with is h_t clipped to --clip-norm
        assert h > clip_norm
        assert math.isclose(stepped, clip_norm, rel_tol=1e-4)
    # inverse_sqrt: linear warmup from 0 to --lr over --warmup-updates, then lr * sqrt(warmup / t)
    expected = [lr * t / warmup if t < warmup else lr * math.sqrt(warmup / t) for t in range(n)]
    assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) for a, b in zip(seen["lr"], expected))
    assert seen["lr"] == stock_lr
