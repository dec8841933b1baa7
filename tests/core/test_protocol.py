"""The one second-pass protocol (``opt.second_pass(model, rng)``) and the host
synchronizations of a step."""

import pytest
import torch

from plugins import SAM, VASSO
from plugins import rng_state
from plugins.lab.selftest.checks import protocol_step
from plugins.perturbation import second_pass_coin
from core_helpers import (FAMILY, CountSyncCalls, CountSyncs, backward_for, build, closure_for, cpu_scaler,
                          expected_syncs, first_backward, flat, fused_adamw_on, make_batches, make_model,
                          skip_without_cpu_matmul, steps_on_device)


def bn_closure(opt, model, x, y, counted):
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        counted.append(int(model[1].num_batches_tracked))
        return loss
    return closure


@pytest.mark.parametrize("cls", [SAM, VASSO])
def test_step_with_model_takes_batchnorm_statistics_from_the_first_pass_only(cls):
    x, y = make_batches(1)[0]
    model = make_model(batchnorm=True)
    opt = cls(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    counted = []
    bn = model[1]
    opt.step(bn_closure(opt, model, x, y, counted), model=model)
    assert counted == [1, 1]  # the second call did not count a batch
    # the running statistics are exactly those of one forward at x_t
    reference = make_model(batchnorm=True)
    reference(x)
    assert torch.equal(bn.running_mean, reference[1].running_mean)
    assert torch.equal(bn.running_var, reference[1].running_var)
    assert bn.track_running_stats


def test_step_without_model_keeps_the_old_behaviour():
    x, y = make_batches(1)[0]
    model = make_model(batchnorm=True)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    counted = []
    opt.step(bn_closure(opt, model, x, y, counted))
    assert counted == [1, 2]  # closure users who pass no model: BatchNorm counts both passes


def test_second_pass_replays_rng_and_sets_the_flag():
    model = make_model(dropout=0.5)
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.0, lr=0.1)
    x, y = make_batches(1)[0]
    rng = rng_state()
    first = torch.nn.functional.cross_entropy(model(x), y)
    first.backward()
    assert opt.perturb()
    opt.zero_grad()
    assert not opt.in_second_pass
    with opt.second_pass(model, rng):
        assert opt.in_second_pass
        second = torch.nn.functional.cross_entropy(model(x), y)  # same dropout masks, rho = 0
        second.backward()
    assert not opt.in_second_pass
    assert second.item() == first.item()
    assert opt.descend()


def test_second_pass_abandons_the_step_on_an_exception():
    model = make_model(batchnorm=True)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    x, y = make_batches(1)[0]
    first_backward(model, x, y)
    before = flat(model.parameters())
    assert opt.perturb() and opt.in_flight
    with pytest.raises(KeyboardInterrupt):
        with opt.second_pass(model):
            raise KeyboardInterrupt
    assert not opt.in_flight and not opt.in_second_pass
    assert model[1].track_running_stats
    assert torch.allclose(flat(model.parameters()), before, rtol=0, atol=1e-6)
    first_backward(model, x, y)
    assert opt.perturb()  # the next step starts cleanly
    opt.descend()


def test_second_pass_needs_a_perturbation():
    model = make_model()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1, p=0.0)
    first_backward(model, *make_batches(1)[0])
    assert not opt.perturb()
    with pytest.raises(RuntimeError, match="only when perturb\\(\\) returned True"):
        with opt.second_pass(model):
            pass
    opt.descend()


def test_closure_exception_in_the_second_pass_restores_x():
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.5, lr=0.1)
    x, y = make_batches(1)[0]
    calls = []

    def closure():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return closure_for(opt, model, x, y)()

    before = flat(model.parameters())
    with pytest.raises(RuntimeError, match="boom"):
        opt.step(closure)
    assert not opt.in_flight
    assert torch.allclose(flat(model.parameters()), before, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ host synchronizations
# The counters live in core_helpers (CountSyncs: aten._local_scalar_dense plus Tensor.tolist;
# CountSyncCalls: the Python-level calls); tests/core/test_mixed_precision.py counts the
# scaled paths and the explicit API.


def syncs_per_step(opt, model, batches, **step_kw):
    """Host syncs of ``opt.step`` beyond the base optimizer's own (AdamW reads its step count),
    by both counters, and those of reading the diagnostics afterwards."""
    base_step = opt.base_optimizer.step
    base_counts = []

    def counted_base_step(*a, **k):
        with CountSyncs() as inner:
            out = base_step(*a, **k)
        base_counts.append(inner.count)
        return out

    opt.base_optimizer.step = counted_base_step
    counts, calls, reads = [], [], []
    for x, y in batches:
        closure = closure_for(opt, model, x, y)
        with CountSyncs() as mode, CountSyncCalls() as python_calls:
            opt.step(closure, **step_kw)
        with CountSyncs() as reading:
            diag = dict(opt.diagnostics)  # the lazy values, all in one read
        assert all(isinstance(v, float) for v in diag.values())
        counts.append(mode.count)
        calls.append(python_calls.count)
        reads.append(reading.count)
    opt.base_optimizer.step = base_step
    own = [c - b for c, b in zip(counts, base_counts)]
    return own, [c - b for c, b in zip(calls, base_counts)], reads


# The documented figures (docs/design.md, "Where a step is decided"): on the host path perturb() 1, descend()
# 1; decided on the device, only the base optimizer's verdict (1; 0 where the base takes
# torch's found_inf, below); the loss gap and the other device-side diagnostics none until
# read (then 1 for all of them); with fp16/bf16 parameters too (decided on the device, as fp32's).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", FAMILY)
def test_host_synchronizations_per_step(kind, dtype):
    skip_without_cpu_matmul(dtype)
    model = make_model(dropout=0.1).to(dtype)
    opt = build(kind, model.parameters(), torch.optim.AdamW, lr=1e-2, rho=0.1, eps=1e-4)  # 1e-8 is 0 in fp16
    two_pass = []
    own, calls, reads = syncs_per_step(opt, model, [(x.to(dtype), y) for x, y in make_batches(6)])
    opt2 = build(kind, make_model(dropout=0.1).parameters(), torch.optim.AdamW, lr=1e-2, rho=0.1)
    for t in range(6):  # the coin is a function of (seed, step): the same draws
        two_pass.append(second_pass_coin(opt2.p, opt2.seed, t))
    expected = expected_syncs(kind, two_pass, dtype)
    assert own == expected, (own, two_pass)
    assert calls == own  # the Python-level counter agrees
    # a skipped step has only floats (the host path's, or the device path's verdict, which this base,
    # unable to take found_inf, read); a two-pass step's device values are read together
    assert reads == [int(tp) for tp in two_pass]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("api", ["closure", "explicit"])
@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eSAM", "GSAM", "V+G"])
def test_a_base_that_takes_found_inf_leaves_the_step_without_a_host_sync(kind, api, scaled, dtype):
    """fp32 or bf16 parameters, autocast's path (no GradScaler) and fp16's (a GradScaler, whose
    verdict joins the step's on the device): nobody reads the diagnostics, a base that skips
    on the device (torch's fused AdamW): 0 host syncs per step once the slope buffers exist,
    in both APIs, the scaler's own calls included; reading the diagnostics costs one."""
    skip_without_cpu_matmul(dtype)
    base = fused_adamw_on("cpu")
    scaler = cpu_scaler(init_scale=2.0 ** 8) if scaled else None  # the scaler's own calls included
    model = make_model(dropout=0.1).to(dtype)
    opt = build(kind, model.parameters(), base, lr=1e-2, rho=0.1, fused=True)
    coins = [second_pass_coin(opt.p, opt.seed, t) for t in range(6)]
    counts, reads = [], []
    for x, y in [(x.to(dtype), y) for x, y in make_batches(6)]:
        backward = backward_for(opt, model, x, y, api, scaler)
        with CountSyncs() as syncs:
            protocol_step(opt, model, backward, api, scaler)
        counts.append(syncs.count)
        with CountSyncs() as reading:
            diag = dict(opt.diagnostics)
        reads.append(reading.count)
        assert diag["nonfinite"] == 0.0
    expected = expected_syncs(kind, coins, fused=True)
    assert counts == expected, (counts, coins)
    if scaled:  # the scale grew, never backed off: every step was taken
        assert scaler.get_scale() == 2.0 ** 8
    # the device's values, read together; a skipped step whose verdict the host read has only floats
    assert all(steps_on_device(kind, coins)) and reads == [1 if tp or n == 0 else 0 for tp, n in zip(coins, expected)]
    assert opt.nonfinite_steps == 0


def test_host_synchronizations_of_a_skipped_step():
    model = make_model()
    opt = SAM(model.parameters(), torch.optim.AdamW, lr=1e-2, rho=0.1, p=0.0)
    own, _, reads = syncs_per_step(opt, model, make_batches(3))
    assert own == [1] * 3 and reads == [0] * 3  # the finiteness of g_t only


def test_reading_the_diagnostics_twice_syncs_once():
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, lr=1e-2, rho=0.1)
    opt.step(closure_for(opt, model, *make_batches(1)[0]))
    with CountSyncs() as reading:
        gap = opt.diagnostics["loss_gap"]
        again = dict(opt.diagnostics)
    assert reading.count == 1 and again["loss_gap"] == gap and isinstance(gap, float)


def test_sync_counters_see_a_sync():
    """The counters are not blind: known syncs show."""
    with CountSyncs() as mode, CountSyncCalls() as calls:
        torch.ones(()).item()
        float(torch.ones(()))
        torch.ones(2).tolist()
        bool(torch.ones(()) > 0)
    assert mode.count == 4 and calls.count == 4
