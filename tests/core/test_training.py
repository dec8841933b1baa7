"""Trajectories, state dicts, the eVASSO coin, memory, schedulers, BatchNorm, diagnostics."""

import copy
import math
import warnings

import pytest
import torch

from plugins import SAM, VASSO, frozen_running_stats, rng_state
from plugins.perturbation import second_pass_coin
from core_helpers import FAMILY, build, closure_for, first_backward, flat, fused_adamw_on, make_batches, make_model

BASES = {
    "SGD+momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.98), "weight_decay": 1e-2}),
}


def run_base(base, kwargs, batches, dropout):
    model = make_model(dropout=dropout)
    opt = base(model.parameters(), **kwargs)
    torch.manual_seed(123)
    losses = []
    for x, y in batches:
        losses.append(opt.step(closure_for(opt, model, x, y)).item())
    return flat(model.parameters()), losses


@pytest.mark.parametrize("kind", FAMILY)
@pytest.mark.parametrize("base_name", list(BASES))
def test_rho_zero_is_exactly_the_base_optimizer(kind, base_name):
    """Dropout on: both passes start from the same RNG state, so h_t == g_t bit for bit."""
    base, kwargs = BASES[base_name]
    batches = make_batches(25)
    expected, expected_losses = run_base(base, kwargs, batches, dropout=0.3)
    model = make_model(dropout=0.3)
    opt = build(kind, model.parameters(), base, rho=0.0, **kwargs)
    torch.manual_seed(123)
    losses = [opt.step(closure_for(opt, model, x, y)).item() for x, y in batches]
    assert losses == expected_losses
    assert torch.equal(flat(model.parameters()), expected)


def test_second_pass_replays_the_dropout_masks():
    model = make_model(dropout=0.5)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.0, lr=0.1)
    x, y = make_batches(1)[0]
    losses = []

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        return loss

    opt.step(closure)
    assert len(losses) == 2 and losses[0] == losses[1]
    assert opt.diagnostics["loss_gap"] == 0.0


def test_state_dict_resume_is_bit_exact():
    batches = make_batches(20)

    def fresh():
        model = make_model(dropout=0.2)
        opt = VASSO(model.parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, p=0.6, seed=7, lr=1e-2,
                    betas=(0.9, 0.98), weight_decay=1e-2)
        return model, opt

    torch.manual_seed(5)
    model, opt = fresh()
    for x, y in batches:
        opt.step(closure_for(opt, model, x, y))
    uninterrupted = flat(model.parameters())

    torch.manual_seed(5)
    model, opt = fresh()
    for x, y in batches[:8]:
        opt.step(closure_for(opt, model, x, y))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()})
    # torch's shape: AdamW's moments and ours (eVASSO: d_t + the diagnostic's buffer) in one entry
    assert set(saved["opt"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "sam_slope", "sam_previous_ascent",
                                             "sam_held", "sam_counters"}
    assert saved["opt"]["state"][0]["sam_counters"]["step"] == 8
    model, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    torch.set_rng_state(saved["rng"])
    assert opt.param_groups is opt.base_optimizer.param_groups
    assert opt.num_steps == 8
    for x, y in batches[8:]:
        opt.step(closure_for(opt, model, x, y))
    assert torch.equal(flat(model.parameters()), uninterrupted)


def test_load_state_dict_relinks_param_groups_for_schedulers():
    model = make_model()
    opt = SAM(model.parameters(), torch.optim.AdamW, lr=1.0)
    opt.load_state_dict(opt.state_dict())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    x, y = make_batches(1)[0]
    opt.step(closure_for(opt, model, x, y))
    sched.step()
    assert opt.base_optimizer.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("on", ["wrapper", "base"])
def test_scheduler_on_either_object_drives_the_lr_used(on):
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.05, lr=1.0)
    target = opt if on == "wrapper" else opt.base_optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(target, lambda step: 0.0 if step >= 1 else 1.0)
    x, y = make_batches(1)[0]
    opt.step(closure_for(opt, model, x, y))
    sched.step()  # lr is now 0: the next step must not move the parameters
    assert opt.base_optimizer.param_groups[0]["lr"] == 0.0
    before = flat(model.parameters())
    opt.step(closure_for(opt, model, x, y))
    # only the rounding of the restore (one add, one subtract) remains; an lr of 1 moves ~1e-1
    torch.testing.assert_close(flat(model.parameters()), before, rtol=0, atol=1e-6)


def _scheduled_run(api):
    """eVASSO with a LambdaLR on the wrapper, 4 steps through ``api``: the lr after each
    scheduler step, the warnings, the step post-hook's calls and the final weights."""
    from plugins.perturbation import rng_state

    model = make_model()
    opt = build("eVASSO", model.parameters(), seed=1, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    hooked = []
    opt.register_step_post_hook(lambda *_: hooked.append(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if api in ("scaler", "closure-scaler") else None
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in make_batches(4):
            if api == "closure":
                opt.step(closure_for(opt, model, x, y))
            elif api == "closure-scaler":  # step() finishes through scaler.step(opt), which calls step() again
                def closure():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    scaler.scale(loss).backward()
                    return loss

                opt.step(closure, scaler=scaler)
                scaler.update()
            elif api == "first_step":
                first_backward(model, x, y)
                opt.first_step(zero_grad=True)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.second_step(zero_grad=True)
            else:  # perturb/second_pass, finished by descend() or scaler.step(opt)
                scale = scaler.scale if scaler is not None else (lambda loss: loss)
                rng = rng_state()
                opt.zero_grad()
                scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
                if opt.perturb(scaler=scaler):
                    opt.zero_grad()
                    with opt.second_pass(model, rng):
                        scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.descend()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return lrs, [str(w.message) for w in caught], len(hooked), flat(model.parameters())


_CPU_SCALER = pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"),
                                 reason="torch.amp.GradScaler (a real scaler on the CPU): torch >= 2.3")


@pytest.mark.parametrize("api", ["explicit", "first_step", pytest.param("scaler", marks=_CPU_SCALER),
                                 pytest.param("closure-scaler", marks=_CPU_SCALER)])
def test_a_scheduler_sees_the_explicit_apis_steps_as_the_closures(api):
    """torch's schedulers learn that the optimizer stepped from the step() they wrap: each
    API's step goes through it once (no "lr_scheduler.step() before optimizer.step()"
    warning, the step hooks run once: also where step(closure, scaler=) finishes through
    scaler.step(opt), whose call of step() is that step's finish, not a second step), and
    the lr sequence is the closure API's."""
    lrs, caught, hooked, weights = _scheduled_run(api)
    want_lrs, want_caught, want_hooked, want_weights = _scheduled_run("closure")
    assert want_caught == [] and want_hooked == 4
    assert caught == [] and hooked == 4
    assert lrs == want_lrs == [0.1 * 0.5 ** k for k in range(1, 5)]
    if "scaler" not in api:  # (the scaler's unscaling rounds differently)
        assert torch.equal(weights, want_weights)


def test_evasso_coin_is_binomial_updates_d_every_step_and_resumes():
    p, n = 0.3, 400
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.05, theta=0.5, p=p, seed=11, lr=0.01)
    batches = make_batches(n, batch=4)
    draws, d_changes = [], []
    for i, (x, y) in enumerate(batches):
        d_before = None if i == 0 else flat(opt.state[q]["sam_slope"] for q in model.parameters())
        opt.step(closure_for(opt, model, x, y))
        draws.append(opt.diagnostics["two_pass"] == 1.0)
        d_after = flat(opt.state[q]["sam_slope"] for q in model.parameters())
        if d_before is not None:
            d_changes.append(not torch.equal(d_before, d_after))
        if i == 199:
            resumed_state = copy.deepcopy(opt.state_dict())
    frac = sum(draws) / n
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(frac - p) < 4 * sd
    assert all(d_changes)  # d_t moves on skipped steps too
    # the coin is a function of (seed, step) only ...
    assert draws == [second_pass_coin(p, 11, t) for t in range(n)]
    assert [second_pass_coin(p, 12, t) for t in range(n)] != draws
    # ... and survives a state_dict round-trip
    model2 = make_model()
    opt2 = VASSO(model2.parameters(), torch.optim.SGD, rho=0.05, theta=0.5, p=p, seed=999, lr=0.01)
    opt2.load_state_dict(resumed_state)
    later = []
    for x, y in batches[200:]:
        opt2.step(closure_for(opt2, model2, x, y))
        later.append(opt2.diagnostics["two_pass"] == 1.0)
    assert later == draws[200:]


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_coin_extremes(p):
    assert all(second_pass_coin(p, 0, t) == (p == 1.0) for t in range(100))


def state_bytes_after_steps(opt, model, n=3):
    for x, y in make_batches(n):
        opt.step(closure_for(opt, model, x, y))
    return opt.state_nbytes()


def test_plain_sam_and_vasso_hold_exactly_one_parameter_sized_buffer():
    for cls in (SAM, VASSO):
        model = make_model()
        param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
        opt = cls(model.parameters(), torch.optim.AdamW, rho=0.1, lr=1e-3)
        assert state_bytes_after_steps(opt, model) == param_bytes, cls.__name__
        keys = {k for s in opt.state.values() for k in s if k.startswith("sam_")}
        assert keys == {"sam_slope", "sam_held", "sam_counters"}
        base_bytes = sum(v.numel() * v.element_size() for s in opt.base_optimizer.state.values()
                         for v in s.values() if torch.is_tensor(v) and v.ndim > 0)
        assert base_bytes == 2 * param_bytes  # AdamW's own two moments are separate


@pytest.mark.parametrize("kind, buffers", [
    ("eSAM", 1), ("GSAM", 1), ("eVASSO", 2), ("V+G", 2), ("ASAM", 3), ("adaptive eVASSO", 3),
])
def test_other_variants_hold_what_the_docs_list(kind, buffers):
    model = make_model()
    param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, seed=1)
    assert state_bytes_after_steps(opt, model, n=8) == buffers * param_bytes


def test_evasso_without_stability_tracking_holds_one_buffer():
    model = make_model()
    param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    opt = VASSO(model.parameters(), torch.optim.SGD, p=0.5, track_stability=False, lr=0.1)
    assert state_bytes_after_steps(opt, model, n=8) == param_bytes
    assert math.isnan(opt.diagnostics["stability"])


def test_frozen_running_stats_in_the_second_pass():
    model = make_model(batchnorm=True)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    bn = model[1]
    x, y = make_batches(1)[0]
    first_backward(model, x, y)
    stats = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    assert opt.perturb()
    with frozen_running_stats(model):
        first_backward(model, x, y)
    assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])
    assert torch.equal(bn.num_batches_tracked, stats[2])
    assert bn.track_running_stats
    opt.descend()
    # without the guard the second pass would have moved them
    model(x)
    assert not torch.equal(bn.running_mean, stats[0])


def test_closure_can_freeze_batchnorm_in_the_second_pass():
    model = make_model(batchnorm=True)
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    x, y = make_batches(1)[0]
    counted = []

    def closure():
        opt.zero_grad()
        frozen = opt.in_second_pass
        with (frozen_running_stats(model) if frozen else torch.enable_grad()):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        counted.append(int(model[1].num_batches_tracked))
        return loss

    opt.step(closure)
    assert counted == [1, 1]


@pytest.mark.parametrize("path", ["host", "device", "device, fused base"])
def test_nonfinite_first_gradient_skips_the_step_and_keeps_d(path):
    """The host path knows at perturb(); decided on the device, perturb() returns the coin
    (the second pass runs at x_t) and the step is skipped all the same: no parameter,
    d_{t-1} or base state moves, and the warning comes with descend() (a base that takes
    found_inf: once the verdict has reached the host, here at once)."""
    model = make_model()
    base, kw = (fused_adamw_on("cpu"), dict(fused=True)) if "fused" in path else (torch.optim.SGD, {})
    opt = VASSO(model.parameters(), base, rho=0.1, lr=0.1, **kw)
    opt._decide_on_device = path != "host"
    batches = make_batches(3)
    opt.step(closure_for(opt, model, *batches[0]))
    d = flat(opt.state[q]["sam_slope"] for q in model.parameters())
    base_state = [v.clone() for q in model.parameters() for v in opt.base_optimizer.state[q].values()
                  if torch.is_tensor(v)]
    before = flat(model.parameters())
    rng = rng_state()
    first_backward(model, batches[1][0], batches[1][1])
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite first-pass gradient"):
        if path == "host":
            assert not opt.perturb()
        else:
            assert opt.perturb()  # the coin: nothing moved
            assert torch.equal(flat(model.parameters()), before)
            opt.zero_grad()
            with opt.second_pass(model, rng):
                first_backward(model, batches[1][0], batches[1][1])
        assert opt.descend() is (None if "fused" in path else False)
        opt.nonfinite_steps  # the count waits for a verdict on its way (with a fused base)
    assert torch.equal(flat(model.parameters()), before)
    assert torch.equal(flat(opt.state[q]["sam_slope"] for q in model.parameters()), d)
    assert all(torch.equal(a, b) for a, b in zip(base_state, [v for q in model.parameters() for v in
                                                             opt.base_optimizer.state[q].values() if torch.is_tensor(v)]))
    assert opt.diagnostics["nonfinite"] == 1.0 and opt.nonfinite_steps == 1
    # training goes on afterwards
    opt.step(closure_for(opt, model, *batches[2]))
    assert not torch.equal(flat(model.parameters()), before)


@pytest.mark.parametrize("kind", FAMILY)
def test_nonfinite_second_gradient_leaves_parameters_at_x(kind):
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.2, p=1.0)
    x, y = make_batches(1)[0]
    first_backward(model, x, y)
    before = flat(model.parameters())
    assert opt.perturb()
    first_backward(model, x, y)
    model[3].bias.grad[0] = float("inf")
    with pytest.warns(RuntimeWarning, match="non-finite second-pass gradient"):
        assert not opt.descend()
    torch.testing.assert_close(flat(model.parameters()), before, rtol=0, atol=1e-6)
    assert all(torch.isfinite(flat(model.parameters())))


def test_abandon_restores_and_forgets_the_step():
    model = make_model()
    opt = SAM(model.parameters(), torch.optim.AdamW, rho=0.3, lr=0.1)
    x, y = make_batches(1)[0]
    first_backward(model, x, y)
    before = flat(model.parameters())
    assert opt.perturb()
    opt.abandon()
    torch.testing.assert_close(flat(model.parameters()), before, rtol=0, atol=1e-6)
    assert len(opt.base_optimizer.state) == 0  # no base step was taken
    opt.state_dict()  # not mid-step any more


def direct_stability(history):
    return [float((a - b).norm()) for a, b in zip(history[1:], history[:-1])]


@pytest.mark.parametrize("kind", FAMILY)
def test_stability_diagnostic_is_the_distance_between_applied_ascents(kind):
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.05, rho=0.1, seed=4)
    applied, reported = [], []
    for x, y in make_batches(14):
        first_backward(model, x, y)
        before = flat(model.parameters())
        if opt.perturb():
            applied.append(flat(model.parameters()) - before)
            reported.append(opt.diagnostics["stability"])
            first_backward(model, x, y)
        else:
            assert math.isnan(opt.diagnostics["ascent_norm"])
        opt.descend()
    assert len(applied) >= 4
    assert math.isnan(reported[0])
    expected = direct_stability(applied)
    assert reported[1:] == pytest.approx(expected, rel=1e-3, abs=1e-6)


def test_vasso_adversary_is_more_stable_than_sams():
    """The paper's Fig. 4 in miniature: a noisy gradient, VASSO's eps moves less."""
    def mean_stability(opt, model):
        out = []
        for x, y in make_batches(40, seed=9, batch=4):
            opt.step(closure_for(opt, model, x, y))
            out.append(opt.diagnostics["stability"])
        return sum(out[1:]) / len(out[1:])

    m1, m2 = make_model(), make_model()
    sam = mean_stability(SAM(m1.parameters(), torch.optim.SGD, rho=0.1, lr=0.01), m1)
    vasso = mean_stability(VASSO(m2.parameters(), torch.optim.SGD, rho=0.1, theta=0.2, lr=0.01), m2)
    assert vasso < 0.7 * sam


@pytest.mark.parametrize("kind", FAMILY)
def test_every_member_trains(kind):
    torch.manual_seed(0)
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.AdamW, lr=1e-2, rho=0.05, seed=2)
    x, y = make_batches(1, batch=64)[0]
    first = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(60):
            loss = opt.step(closure_for(opt, model, x, y)).item()
            first = loss if first is None else first
    assert loss < 0.7 * first
    assert torch.isfinite(flat(model.parameters())).all()


@pytest.mark.parametrize("kind", FAMILY)
def test_a_parameter_that_starts_receiving_gradients_late(kind):
    """A parameter unused for the first steps (grad None) joins later: no crash, and its
    slope starts at its own first gradient."""
    model = make_model()
    late = model[3].bias
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.05, rho=0.1, seed=4)
    for i, (x, y) in enumerate(make_batches(8)):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if i < 3:
                late.grad = None
            return loss
        opt.step(closure)
        assert torch.isfinite(flat(model.parameters())).all()
    assert opt.state[late]["sam_held"]["slope"] == 1 or kind in ("ASAM",) or opt.theta is None


@pytest.mark.parametrize("cls", [SAM, VASSO])
def test_exact_restore_is_bit_exact_and_in_flight_tracks_the_step(cls):
    model = make_model()
    opt = cls(model.parameters(), torch.optim.SGD, rho=0.7, lr=0.1, exact_restore=True)
    x, y = make_batches(1)[0]
    for _ in range(3):
        first_backward(model, x, y)
        before = flat(model.parameters())
        assert not opt.in_flight
        assert opt.perturb() and opt.in_flight
        opt.restore()
        assert torch.equal(flat(model.parameters()), before)
        opt.descend()
        assert not opt.in_flight
