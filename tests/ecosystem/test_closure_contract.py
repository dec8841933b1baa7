"""``step(closure)`` with the other libraries' closure contract.

The official VaSSO code (BingcongLi/VaSSO, ``utils/engine.py``), davda54/sam's README and
pytorch_optimizer's tests all run the first forward/backward *before* ``step`` and hand
it a closure that runs only the second pass and does not clear the gradients; their
``step`` ascends from the gradients already in ``.grad``.  Ours follows torch's contract
(the closure computes the whole loss, at ``x_t`` and at ``x_t + eps_t``), and clears the
gradients before each closure call, so that loop gets the right step: its own first
backward is wasted, nothing is summed.  The loops below are ours, in the shape of those
loops (not their code).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from core_helpers import build, closure_for, flat, make_batches, make_model
from plugins import rng_state


def torch_style_run(kind, batches, **kw):
    """The reference: a closure that clears the gradients, torch's convention."""
    model = make_model(batchnorm=True)
    opt = build(kind, model.parameters(), **kw)
    for x, y in batches:
        opt.step(closure_for(opt, model, x, y), model=model)
    return model, opt


def official_vasso_run(kind, batches, **kw):
    """The official VaSSO code's train_one_epoch, in its shape: forward, loss,
    zero_grad, backward, then ``step(closure, model=model)``; its closure runs a forward
    and a backward and neither clears the gradients nor returns the loss."""
    model = make_model(batchnorm=True)
    optimizer = build(kind, model.parameters(), **kw)
    stale = []
    for x, y in batches:
        def closure():
            output = model(x)
            loss = F.cross_entropy(output, y)
            loss.backward()

        output = model(x)
        loss = F.cross_entropy(output, y)
        optimizer.zero_grad()
        loss.backward()
        stale.append(all(q.grad is not None for q in model.parameters()))
        optimizer.step(closure, model=model)
    assert all(stale)  # the trap is armed: step() is entered with the first gradient in .grad
    return model, optimizer


def readme_closure_run(kind, batches, **kw):
    """davda54/sam's README and pytorch_optimizer's tests: backward, step(closure), zero_grad()."""
    model = make_model(batchnorm=True)
    optimizer = build(kind, model.parameters(), **kw)
    for x, y in batches:
        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        F.cross_entropy(model(x), y).backward()
        optimizer.step(closure)
        optimizer.zero_grad()
    return model, optimizer


def parameters_close(a, b):
    # BatchNorm normalizes with batch statistics in training: the running statistics,
    # which these loops update a different number of times, never enter the gradients
    return torch.allclose(flat(a.parameters()), flat(b.parameters()), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "GSAM", "eVASSO"])
def test_the_official_vasso_loop_gets_the_right_step(kind):
    batches = make_batches(6)
    expected, _ = torch_style_run(kind, batches)
    model, opt = official_vasso_run(kind, batches)
    assert parameters_close(model, expected)
    assert opt.num_steps == 6


@pytest.mark.parametrize("kind", ["SAM", "VASSO"])
def test_the_readme_closure_loop_gets_the_right_step(kind):
    batches = make_batches(6)
    expected, _ = torch_style_run(kind, batches)
    model, _ = readme_closure_run(kind, batches)
    assert parameters_close(model, expected)


def test_the_trap_is_real_without_clearing():
    # what our step would do with that loop if it did not clear: three passes summed
    # (g_t twice in the ascent, g_t + h_t in the base step), far from the right step
    batches = make_batches(6)
    expected, _ = torch_style_run("VASSO", batches)
    model = make_model(batchnorm=True)
    opt = build("VASSO", model.parameters())
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()      # the loop's first backward
        F.cross_entropy(model(x), y).backward()      # the closure at x_t, added
        opt.perturb()
        with opt.second_pass(model):
            F.cross_entropy(model(x), y).backward()  # the closure at x_t + eps_t, added
        opt.descend()
    assert not parameters_close(model, expected)


def test_the_official_call_with_its_extra_arguments_fails_loudly():
    # The official loop also passes epoch=, step=, batch_idx=, train_data=, logger=,
    # which its optimizers ignore; ours refuses them by name instead of ignoring them.
    model = make_model()
    opt = build("VASSO", model.parameters())
    (x, y), = make_batches(1)
    F.cross_entropy(model(x), y).backward()
    before = flat(model.parameters())
    with pytest.raises(TypeError) as error:
        opt.step(lambda: F.cross_entropy(model(x), y).backward(), epoch=0, step=0, batch_idx=0, model=model,
                 train_data=[], logger=None)
    message = str(error.value)
    # every unexpected argument by name, model= (ours) not among them, and the two ports
    for name in ("epoch=", "step=", "batch_idx=", "train_data=", "logger="):
        assert name in message
    assert "model=," not in message.split("(it takes")[0]
    for port in ("first_step(zero_grad=True)", "second_step(zero_grad=True)", "torch-style closure",
                 "step(closure, model=model)", "docs/migration.md"):
        assert port in message, port
    assert not opt.in_flight and opt.num_steps == 0
    assert torch.equal(flat(model.parameters()), before)
    # the port the message names gives the step of a torch-style closure
    (x, y), = make_batches(1)
    expected, _ = torch_style_run("VASSO", [(x, y)])
    model = make_model(batchnorm=True)
    opt = build("VASSO", model.parameters())
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(TypeError, match="loss= is for step"):  # a closure returns its losses
        opt.step(lambda: F.cross_entropy(model(x), y).backward(), loss=1.0)
    opt.step(closure_for(opt, model, x, y), model=model)
    assert parameters_close(model, expected)


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "GSAM", "eVASSO", "ASAM"])
def test_a_torch_style_closure_sees_no_change_and_no_warning(kind):
    # bit for bit the explicit protocol, which step(closure) has always been
    batches = make_batches(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt = torch_style_run(kind, batches)
    twin = make_model(batchnorm=True)
    explicit = build(kind, twin.parameters())
    for x, y in batches:
        rng = rng_state()
        explicit.zero_grad()
        F.cross_entropy(twin(x), y).backward()
        if explicit.perturb():
            explicit.zero_grad()
            with explicit.second_pass(twin, rng):
                F.cross_entropy(twin(x), y).backward()
        explicit.descend()
    assert torch.equal(flat(model.parameters()), flat(twin.parameters()))
    assert torch.equal(twin[1].running_mean, model[1].running_mean)
