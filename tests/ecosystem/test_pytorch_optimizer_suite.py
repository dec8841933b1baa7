"""pytorch_optimizer's own SAM and GSAM tests, ported to ours, run on both libraries.

Ported from kozistr/pytorch_optimizer's ``tests/`` (read, not copied; pytorch_optimizer
4.1.0): ``test_wrapper_optimizers.py`` (``test_sam_optimizer``,
``test_sam_optimizer_with_closure``, ``test_gsam_optimizer``), ``test_gradients.py``
(``test_sam_no_gradient``) and ``test_optimizer_parameters.py``
(``test_sam_family_methods``), with the helpers they use from ``tests/utils.py`` and
``tests/conftest.py`` (the two-blob data, the 2-2-1 logistic regression, the
``Trainer``'s SAM-style and closure loops).  Each test is parametrized over ``ours`` and
``theirs``: ours must pass wherever theirs passes.  Their quirks are kept, because they
are what their implementation passes: the loss is called as ``loss_fn(y, model(x))``
(arguments swapped), the closure loop runs the first backward outside ``step``.

What differs, and why: their ``test_sam_optimizer`` turns on ``use_gc`` (gradient
centralization), which ours does not have, so theirs runs with it and ours without;
their ``NoClosureError`` is our ``RuntimeError``; GSAM's reference API
(``set_closure``, ``rho_scheduler``, ``update_rho_t``) is ``SAM(..., gsam_alpha=...)``
with a closure here.  Their own suite skips ``test_gsam_optimizer``
(``pytest.skip('skip GSAM optimizer')``); here theirs runs too and passes.
"""

import numpy as np
import pytest
import torch
from torch import nn

from plugins import SAM

pytorch_optimizer = pytest.importorskip(
    "pytorch_optimizer", reason="the reference: pip install pytorch-optimizer (setup.cfg's test extra)")
from pytorch_optimizer import load_optimizer  # noqa: E402
from pytorch_optimizer.base.exception import NoClosureError  # noqa: E402

IMPLEMENTATIONS = ["ours", "theirs"]


@pytest.fixture(scope="module")
def environment():
    """Their data: two Gaussian blobs of 50 points in 2-D, labels 0 and 1."""
    rng = np.random.RandomState(42)
    x = rng.randn(100, 2) * 2
    x[:50] -= 2
    x[50:] += 2
    y = np.array([0] * 50 + [1] * 50).reshape(100, 1)
    return torch.Tensor(x), torch.Tensor(y)


class LogisticRegression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 2)
        self.fc2 = nn.Linear(2, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build_model():
    torch.manual_seed(42)
    return LogisticRegression(), nn.BCEWithLogitsLoss()


def sam(impl, params, base, **kw):
    if impl == "theirs":
        return pytorch_optimizer.SAM(params, base, **kw)
    kw.pop("use_gc", None)  # gradient centralization: theirs only
    return SAM(params, base, **kw)


def swapped_loss(model, loss_fn, x, y):
    return loss_fn(y, model(x))  # their Trainer's compute_loss(swap_args=True)


def assert_loss_decreased(init_loss, loss, threshold):  # losses as tensors or floats
    init_loss, loss = float(torch.as_tensor(init_loss).detach()), float(torch.as_tensor(loss).detach())
    assert init_loss > threshold * loss, f"loss did not decrease enough: {init_loss:.4f} vs {threshold} * {loss:.4f}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("adaptive", [True, False])
def test_sam_optimizer(impl, adaptive, environment):
    x, y = environment
    model, loss_fn = build_model()
    optimizer = sam(impl, model.parameters(), load_optimizer("asgd"), lr=5e-1, adaptive=adaptive, use_gc=True)
    init_loss = loss = None
    for _ in range(3):  # their Trainer.run_sam_style
        loss = swapped_loss(model, loss_fn, x, y)
        loss.backward()
        optimizer.first_step(zero_grad=True)
        swapped_loss(model, loss_fn, x, y).backward()
        optimizer.second_step(zero_grad=True)
        init_loss = init_loss or loss
    assert_loss_decreased(init_loss, loss, 2.0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("adaptive", [True, False])
def test_sam_optimizer_with_closure(impl, adaptive, environment):
    x, y = environment
    model, loss_fn = build_model()
    optimizer = sam(impl, model.parameters(), load_optimizer("adamw"), lr=5e-1, adaptive=adaptive)

    def closure():  # their Trainer.run_with_closure: no zero_grad, the first backward is outside
        first_loss = swapped_loss(model, loss_fn, x, y)
        first_loss.backward()
        return first_loss

    init_loss = loss = None
    for _ in range(3):
        loss = swapped_loss(model, loss_fn, x, y)
        loss.backward()
        optimizer.step(closure)
        optimizer.zero_grad()
        init_loss = init_loss or loss
    assert_loss_decreased(init_loss, loss, 2.0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_sam_no_gradient(impl, environment):
    x, y = environment
    model, loss_fn = build_model()
    model.fc1.weight.requires_grad = False
    model.fc1.weight.grad = None
    frozen = model.fc1.weight.detach().clone()
    others = [q.detach().clone() for q in (model.fc1.bias, model.fc2.weight, model.fc2.bias)]

    optimizer = sam(impl, model.parameters(), load_optimizer("adamp"))
    optimizer.zero_grad()
    loss_fn(y, model(x)).backward()
    optimizer.first_step(zero_grad=True)
    loss_fn(y, model(x)).backward()
    optimizer.second_step(zero_grad=True)
    # theirs only checks that nothing raises; the frozen weight must also stay put
    assert torch.equal(model.fc1.weight, frozen)
    moved = [q for q, q0 in zip((model.fc1.bias, model.fc2.weight, model.fc2.bias), others) if not torch.equal(q, q0)]
    assert len(moved) == 3


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_sam_family_methods(impl):
    def simple_parameter():
        param = torch.zeros(1, 1).requires_grad_(True)
        param.grad = torch.zeros(1, 1)
        return param

    base = load_optimizer("lion")
    opt = sam(impl, [simple_parameter()], base)
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(NoClosureError if impl == "theirs" else RuntimeError, match="(?i)closure"):
        opt.step()
    with pytest.raises(ValueError, match="rho"):
        sam(impl, [simple_parameter()], base, rho=-0.1)


def gsam_run(impl, adaptive, x, y, num_iterations=25, lr=5e-1):
    """Their test_gsam_optimizer's loop; returns the losses and the parameters after each step."""
    model, loss_fn = build_model()
    if impl == "theirs":
        base_optimizer = load_optimizer("adamp")(model.parameters(), lr=lr)
        lr_scheduler = pytorch_optimizer.CosineScheduler(base_optimizer, t_max=num_iterations, max_lr=lr,
                                                         min_lr=lr, init_lr=lr)
        rho_scheduler = pytorch_optimizer.ProportionScheduler(lr_scheduler, max_lr=lr, min_lr=lr)
        optimizer = pytorch_optimizer.GSAM(model.parameters(), base_optimizer=base_optimizer, model=model,
                                           rho_scheduler=rho_scheduler, adaptive=adaptive)
    else:
        # their constant schedule: rho 2.0 (ProportionScheduler's default values), alpha 0.4 (GSAM's
        # default); their adaptive geometry is ours with eta = 0 on every parameter (docs/migration.md)
        params = [(f"weight/{name}", q) for name, q in model.named_parameters()]
        optimizer = SAM(params, load_optimizer("adamp"), rho=2.0, gsam_alpha=0.4, adaptive=adaptive, eta=0.0, lr=lr)

    losses, trajectory = [], []
    for _ in range(num_iterations):
        if impl == "theirs":
            optimizer.set_closure(loss_fn, x, y)
            _, loss = optimizer.step()
            lr_scheduler.step()
            optimizer.update_rho_t()
        else:
            def closure():
                optimizer.zero_grad()
                first = loss_fn(model(x), y)
                first.backward()
                return first
            loss = optimizer.step(closure, model=model)
        losses.append(float(loss.detach()))
        trajectory.append(torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()]))
    return losses, trajectory


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("adaptive", [True, pytest.param(False, marks=pytest.mark.xfail(
    strict=True, reason="pytorch_optimizer's GSAM fails it too (its suite skips this test): "
                        "the loss goes 0.807 -> 0.696 in 25 steps, short of the test's 1.2x"))])
def test_gsam_optimizer(impl, adaptive, environment):
    losses, _ = gsam_run(impl, adaptive, *environment)
    assert_loss_decreased(losses[0], losses[-1], 1.2)


@pytest.mark.parametrize("adaptive", [True, False])
def test_gsam_takes_their_steps(adaptive, environment):
    # beyond their test: the same trajectory, to float32 rounding, which rho = 2 and lr = 0.5
    # grow to about 6e-6 in 25 steps (theirs also adds 1e-12 to its norms and its cosine)
    _, mine = gsam_run("ours", adaptive, *environment)
    _, reference = gsam_run("theirs", adaptive, *environment)
    for t, (a, b) in enumerate(zip(mine, reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=lambda m, t=t: f"step {t}: {m}")
