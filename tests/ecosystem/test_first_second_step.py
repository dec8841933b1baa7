"""``first_step`` / ``second_step``: the ecosystem's names for ``perturb`` / ``descend``,
with every invariant of the explicit API (docs/design.md, "Invariants")."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from core_helpers import FAMILY, build, flat, make_batches, make_model
from plugins import rng_state


def loss_of(model, x, y):
    return F.cross_entropy(model(x), y)


def explicit_run(kind, batches, dropout=0.0, **kw):
    """The host protocol: perturb, second pass inside second_pass() only when wanted, descend."""
    model = make_model(dropout=dropout)
    opt = build(kind, model.parameters(), **kw)
    for x, y in batches:
        rng = rng_state()
        opt.zero_grad()
        loss_of(model, x, y).backward()
        if opt.perturb():
            opt.zero_grad()
            with opt.second_pass(model, rng):
                loss_of(model, x, y).backward()
        opt.descend()
    return model, opt


def ecosystem_run(kind, batches, zero_grad=True, dropout=0.0, replay=False, **kw):
    """davda54/sam's loop: first_step, the second pass whatever first_step returned, second_step."""
    model = make_model(dropout=dropout)
    opt = build(kind, model.parameters(), **kw)
    wanted = []
    for x, y in batches:
        rng = rng_state()
        if not zero_grad:  # nothing cleared the last step's h_t
            opt.zero_grad()
        loss_of(model, x, y).backward()
        wanted.append(opt.first_step(zero_grad=zero_grad))
        if not zero_grad:
            opt.zero_grad()
        if replay and wanted[-1]:
            with opt.second_pass(model, rng):
                loss_of(model, x, y).backward()
        elif replay:  # the unwanted pass, on its own RNG stream: the later masks stay the explicit run's
            with torch.random.fork_rng():
                loss_of(model, x, y).backward()
        else:
            loss_of(model, x, y).backward()
        opt.second_step(zero_grad=zero_grad)
    return model, opt, wanted


@pytest.mark.parametrize("kind", FAMILY)
@pytest.mark.parametrize("zero_grad", [True, False])
def test_first_and_second_step_are_perturb_and_descend(kind, zero_grad):
    # with p < 1 the loop runs the second pass on every step anyway; the skipped steps
    # must still be the base step with g_t, so the trajectory is the explicit API's
    batches = make_batches(8)
    expected, reference = explicit_run(kind, batches)
    model, opt, wanted = ecosystem_run(kind, batches, zero_grad=zero_grad)
    assert torch.equal(flat(model.parameters()), flat(expected.parameters()))
    assert opt.num_steps == reference.num_steps == 8
    if reference.p < 1.0:
        assert False in wanted and True in wanted  # the test exercises both kinds of step


def test_a_skipped_step_ignores_the_second_pass_gradient():
    # dropout makes the unwanted second pass's gradient differ from g_t: the result is still g_t's step
    batches = make_batches(6)
    for zero_grad in (True, False):
        expected, _ = explicit_run("eSAM", batches, dropout=0.3)
        model, _, wanted = ecosystem_run("eSAM", batches, zero_grad=zero_grad, dropout=0.3, replay=True)
        assert False in wanted
        assert torch.equal(flat(model.parameters()), flat(expected.parameters()))
    # without the replay of the RNG the two-pass steps differ (other dropout masks): the
    # comparison above is sensitive to what the second pass computes
    model, _, _ = ecosystem_run("eSAM", batches, dropout=0.3)
    assert not torch.equal(flat(model.parameters()), flat(expected.parameters()))


def test_zero_grad_clears_after_each_call_and_false_keeps_the_gradients():
    model = make_model()
    opt = build("SAM", model.parameters())
    (x, y), = make_batches(1)
    loss_of(model, x, y).backward()
    g = [q.grad.clone() for q in model.parameters()]
    assert opt.first_step() is True
    assert all(torch.equal(q.grad, gq) for q, gq in zip(model.parameters(), g))  # g_t still there
    opt.zero_grad()
    loss_of(model, x, y).backward()
    assert opt.second_step(zero_grad=True) is True
    assert all(q.grad is None for q in model.parameters())
    loss_of(model, x, y).backward()
    opt.first_step(zero_grad=True)
    assert all(q.grad is None for q in model.parameters())
    loss_of(model, x, y).backward()
    h = [q.grad.clone() for q in model.parameters()]
    opt.second_step()
    assert all(torch.equal(q.grad, hq) for q, hq in zip(model.parameters(), h))  # h_t left in .grad


def test_skipped_steps_keep_g_t_without_a_copy_when_zero_grad_is_true():
    model = make_model()
    opt = build("SAM", model.parameters(), p=1e-9)  # the coin always skips
    (x, y), = make_batches(1)
    loss_of(model, x, y).backward()
    grads = [q.grad for q in model.parameters()]
    assert opt.first_step(zero_grad=True) is False
    kept = opt._pending.kept_grads[1]
    assert all(a is b for a, b in zip(kept, grads))  # the tensors themselves
    loss_of(model, x, y).backward()
    opt.second_step(zero_grad=True)
    assert not opt.in_flight


def test_a_nonfinite_gradient_skips_the_step():
    """The step is decided on the device: first_step() moves nothing (the ascent's scale is 0)
    and asks for the second pass all the same; second_step() skips the base step and warns
    (the first step reads its verdict on the host), and no d_t is kept."""
    model = make_model()
    opt = build("VASSO", model.parameters())
    (x, y), = make_batches(1)
    before = flat(model.parameters())
    loss_of(model, x, y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    assert opt.first_step(zero_grad=True) is True
    assert torch.equal(flat(model.parameters()), before)  # nothing moved
    loss_of(model, x, y).backward()
    with pytest.warns(RuntimeWarning, match="non-finite first-pass"):
        assert opt.second_step(zero_grad=True) is False
    assert torch.equal(flat(model.parameters()), before)
    assert opt.nonfinite_steps == 1 and opt.state[model[0].weight]["sam_held"] == {"slope": 0}  # no d_t yet


@pytest.mark.parametrize("kind", ["SAM", "ASAM", "VASSO"])
def test_the_restore_is_exact_where_promised(kind):
    model = make_model()
    opt = build(kind, model.parameters(), base=torch.optim.SGD, lr=0.0, exact_restore=True)
    (x, y), = make_batches(1)
    before = flat(model.parameters())
    loss_of(model, x, y).backward()
    assert opt.first_step(zero_grad=True)
    assert not torch.equal(flat(model.parameters()), before)  # at x_t + eps_t
    loss_of(model, x, y).backward()
    opt.second_step(zero_grad=True)
    assert torch.equal(flat(model.parameters()), before)  # lr 0: exactly x_t again


def test_rng_replay_makes_it_step_with_a_closure_bit_for_bit():
    batches = make_batches(5)
    model, _, _ = ecosystem_run("VASSO", batches, dropout=0.3, replay=True)
    twin = make_model(dropout=0.3)
    opt = build("VASSO", twin.parameters())
    for x, y in batches:
        def closure():
            loss = loss_of(twin, x, y)
            loss.backward()
            return loss
        opt.step(closure)
    assert torch.equal(flat(model.parameters()), flat(twin.parameters()))


@pytest.mark.parametrize("kind", ["eVASSO", "GSAM"])
def test_resume_after_second_step_continues_bit_for_bit(kind):
    batches = make_batches(8)
    straight, _, _ = ecosystem_run(kind, batches)
    model, opt, _ = ecosystem_run(kind, batches[:4])
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = make_model()
    resumed.load_state_dict(saved_model)
    opt = build(kind, resumed.parameters())
    opt.load_state_dict(saved_opt)
    for x, y in batches[4:]:
        loss_of(resumed, x, y).backward()
        opt.first_step(zero_grad=True)
        loss_of(resumed, x, y).backward()
        opt.second_step(zero_grad=True)
    assert torch.equal(flat(resumed.parameters()), flat(straight.parameters()))


def test_second_step_without_first_step_says_so():
    model = make_model()
    opt = build("SAM", model.parameters())
    with pytest.raises(RuntimeError, match=r"second_step\(\) without first_step\(\)"):
        opt.second_step()
    (x, y), = make_batches(1)
    loss_of(model, x, y).backward()
    opt.first_step()
    with pytest.raises(RuntimeError, match="called twice"):
        opt.first_step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.second_step()


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "GSAM", "eVASSO"])
def test_loss_gap_where_the_loop_hands_over_both_losses(kind):
    # step(closure) records f(x + eps) - f(x); the explicit API and first_step/second_step
    # give the same value when handed the two losses, and NaN (no gap known) without them.
    batches = make_batches(6)
    runs = {}
    for api in ("closure", "explicit", "ecosystem", "scaler", "not handed"):
        model = make_model()
        opt = build(kind, model.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
        gaps = []
        for x, y in batches:
            if api == "closure":
                def closure():
                    opt.zero_grad()
                    loss = loss_of(model, x, y)
                    loss.backward()
                    return loss
                opt.step(closure)
            elif api == "ecosystem":
                first = loss_of(model, x, y)
                first.backward()
                opt.first_step(zero_grad=True, loss=first)
                second = loss_of(model, x, y)
                second.backward()
                opt.second_step(zero_grad=True, loss=second)
            else:
                opt.zero_grad()
                first = loss_of(model, x, y)
                (scaler.scale(first) if api == "scaler" else first).backward()
                second = None
                if opt.perturb(**({"scaler": scaler} if api == "scaler" else {}),
                               **({} if api == "not handed" else {"loss": first})):
                    opt.zero_grad()
                    with opt.second_pass(model):
                        second = loss_of(model, x, y)
                        (scaler.scale(second) if api == "scaler" else second).backward()
                if api == "scaler":
                    scaler.step(opt, loss=second)
                    scaler.update()
                elif api == "not handed":
                    opt.descend()
                else:
                    opt.descend(loss=second)
            gaps.append((opt.diagnostics["two_pass"], opt.diagnostics["loss_gap"]))
        runs[api] = (gaps, flat(model.parameters()))
    reference, params = runs.pop("closure")
    assert any(two for two, _ in reference)
    for two, gap in reference:  # the closure's record: a gap on every two-pass step, NaN on the others
        assert (two == 1.0) == (gap == gap)
    for api, (gaps, other) in runs.items():
        assert torch.allclose(other, params, rtol=0, atol=1e-6), api
        for (two, gap), (two_ref, gap_ref) in zip(gaps, reference):
            assert two == two_ref, api
            if api == "not handed" or not two:
                assert gap != gap, (api, gap)  # NaN: no gap known
            else:
                assert abs(gap - gap_ref) < 1e-6, (api, gap, gap_ref)
