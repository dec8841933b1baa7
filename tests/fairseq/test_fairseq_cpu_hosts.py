"""The tests' ``--cpu`` fairseq runs are the same on a CPU-only host and on a GPU host
(tests/helpers/cpu_only.py): stock fairseq's ``--cpu`` puts the gradient norm on a GPU it sees
(``utils.clip_grad_norm_``), so ``--cpu --clip-norm 0.5`` would stop where there is one.

No GPU is needed to show it: a visible GPU is faked by torch's reports (``is_available()``
True, ``current_device()`` the ``meta`` device standing for ``cuda:0``: another device than
the CPU, which is all that fairseq's choice looks at), with apex's fused norm off, as in the
issue's install."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

import os
import sys

import cpu_only
import process_group
import torch
from fairseq import utils as fairseq_utils

from fairseq_vasso.nmt import recipe


@pytest.fixture
def gpu_visible(monkeypatch):
    """torch reports a GPU (the ``meta`` device as ``cuda:0``); fairseq finds no apex."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    monkeypatch.setattr(fairseq_utils, "multi_tensor_l2norm_available", False)


def _grads():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.full((3,), 2.0), torch.full((4,), 1.0)  # norm 4
    return params


def test_stock_clip_grad_norm_takes_a_visible_gpu_and_not_a_hidden_one(gpu_visible):
    # the trap, in the installed fairseq: the norm of CPU gradients goes to the GPU (its branch for
    # CUDA without apex, which says so) ...
    with pytest.warns(UserWarning, match="amp_C fused kernels unavailable"):
        assert fairseq_utils.clip_grad_norm_(_grads(), 0.0).device.type == "meta"
    # ... and, hidden as the tests' in-process --cpu runs hide it, stays on the CPU and clips there
    with cpu_only.in_process():
        params = _grads()
        norm = fairseq_utils.clip_grad_norm_(params, 0.5)
    assert norm.device.type == "cpu" and float(norm) == pytest.approx(4.0)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad for p in params]))
    assert float(clipped) == pytest.approx(0.5, rel=1e-5)
    assert torch.cuda.is_available()  # restored on the way out


def test_an_in_process_cpu_run_with_clip_norm_trains_where_a_gpu_is_visible(toy_data, tmp_path, fs, gpu_visible):
    """conftest's ``train`` runs a ``--cpu`` command line inside cpu_only.in_process(): with a GPU
    visible it trains and clips on the CPU.  Without the hiding, fairseq's ``--cpu`` run calls into
    CUDA from its start (its RNG state, then the gradient norm), which on this fake stops it with
    torch's "Found no NVIDIA driver" where there is no GPU (tried 2026-11-27: the norm is not even
    reached): a GPU that torch reports is not used by the hidden run at all."""
    argv = fs.model_args(toy_data, tmp_path, max_update=2, extra=["--rho", "0.1", "--clip-norm", "0.5", "--no-save"])
    run = fs.train(argv)
    assert [int(s["num_updates"]) for s in run.inner()] == [1, 2]
    assert all(float(s["gnorm"]) > 0.5 and float(s["clip"]) == 100 for s in run.inner())  # clipped every update
    assert torch.cuda.is_available()  # the fake again, after the run


def test_cpu_children_are_given_no_gpu(fs, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cpu_only.env()["CUDA_VISIBLE_DEVICES"] == "" == recipe.cpu_only_env({"PATH": "/usr/bin"})[
        "CUDA_VISIBLE_DEVICES"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # a copy
    # fs.run_cli: a --cpu command line hides the GPU; another keeps the environment's
    seen = []
    monkeypatch.setattr(process_group, "run", lambda args, env, **kw: seen.append((args, env["CUDA_VISIBLE_DEVICES"])))
    fs.run_cli("fairseq_cli.train", ["data", "--cpu"])
    fs.run_cli("fairseq_cli.train", ["--help"])
    assert [device for _, device in seen] == ["", "0"]


def test_a_child_given_no_gpu_sees_none_and_trains_on_one_process():
    # what such a child's torch and fairseq see, on this host whatever it has: no device, and
    # fairseq's default --distributed-world-size (the GPUs it sees at import) is 1
    code = ("import torch\nfrom fairseq.dataclass.configs import DistributedTrainingConfig as C\n"
            "print(torch.cuda.is_available(), torch.cuda.device_count(), C().distributed_world_size)\n")
    out = process_group.run([sys.executable, "-c", code], env=cpu_only.env(), capture_output=True, text=True,
                            timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["False", "0", "1"], out.stdout
