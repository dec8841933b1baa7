"""rho in the param groups (one value, a scheduler may change it) and GSAM's rho schedule."""

import copy

import pytest
import torch

from plugins import SAM, VASSO
from plugins.perturbation import scheduled_rho
from core_helpers import build, closure_for, flat, make_batches, make_model


def test_every_group_holds_rho_and_the_step_uses_it():
    model = make_model()
    opt = VASSO([{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 0.01}],
                torch.optim.SGD, rho=0.1, lr=0.1)
    assert [g["rho"] for g in opt.param_groups] == [0.1, 0.1] and opt.rho == 0.1
    for g in opt.param_groups:  # what a scheduler does
        g["rho"] = 0.3
    x, y = make_batches(1)[0]
    before = flat(model.parameters())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert opt.perturb()
    assert (flat(model.parameters()) - before).norm().item() == pytest.approx(0.3, rel=1e-5)
    assert opt.diagnostics["rho"] == 0.3
    opt.descend()
    opt.rho = 0.05
    assert [g["rho"] for g in opt.param_groups] == [0.05, 0.05]


def test_groups_that_disagree_are_refused():
    model = make_model()
    with pytest.raises(ValueError, match="rho must be the same in every param group"):
        SAM([{"params": model[0].parameters(), "rho": 0.2}, {"params": model[3].parameters()}],
            torch.optim.SGD, rho=0.1, lr=0.1)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.1, lr=0.1)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert opt.param_groups[1]["rho"] == 0.1  # a new group gets the common value
    opt.param_groups[1]["rho"] = 0.5
    with pytest.raises(ValueError, match="group 0: 0.1, group 1: 0.5"):
        opt.step(closure_for(opt, model, *make_batches(1)[0]))
    opt.param_groups[0]["rho"] = -1.0
    opt.param_groups[1]["rho"] = -1.0
    with pytest.raises(ValueError, match="rho must be in \\[0, inf\\)"):
        opt.step(closure_for(opt, model, *make_batches(1)[0]))


def test_scheduled_rho_is_the_gsam_formula():
    assert scheduled_rho(0.2, 0.05, 1e-3, 1e-3, 0.0) == 0.2
    assert scheduled_rho(0.2, 0.05, 0.0, 1e-3, 0.0) == 0.05
    assert scheduled_rho(0.2, 0.05, 4e-4, 1e-3, 2e-4) == pytest.approx(0.05 + 0.15 * 2e-4 / 8e-4)


def test_an_lr_below_lr_min_by_rounding_only_gives_rho_min():
    # torch's LinearLR from 3e-3 to 3e-5 ends one rounding step below its target
    assert scheduled_rho(0.2, 0.0, 2.9999999999999977e-05, 3e-3, 3e-5) == 0.0
    assert scheduled_rho(0.2, 0.05, 3e-5 - 0.9e-12 * 3e-3, 3e-3, 3e-5) == 0.05  # within the documented tolerance
    assert scheduled_rho(0.2, 0.0, -1e-20, 1e-3, 0.0) == 0.0
    for lr in (3e-5 - 3e-12 * 3e-3, 2.9e-5, 0.0, float("nan")):  # beyond rounding: refused, not clamped
        with pytest.raises(ValueError, match="lr fell below lr_min.*set lr_min to the schedule's lowest lr"):
            scheduled_rho(0.2, 0.05, lr, 3e-3, 3e-5)


def linear_decay(opt):  # the paper's ViT row: lr 3e-3 -> 3e-5
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.01, total_iters=10)


def one_cycle(opt):  # warmup from max_lr / 25 to max_lr, then anneal to max_lr / 25 / 1e4
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=12)


def warmup_from_zero_then_decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(step / 3, 1.0) * 0.7 ** max(0, step - 3))


@pytest.mark.parametrize("make_scheduler, lr_min", [(linear_decay, 3e-5), (one_cycle, 3e-3 / 25 / 1e4),
                                                    (warmup_from_zero_then_decay, 0.0)])
def test_torch_schedulers_run_to_their_end_with_lr_min_their_lowest_lr(make_scheduler, lr_min):
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.2, rho_min=0.0, lr=3e-3, lr_min=lr_min)
    sched = make_scheduler(opt)
    rhos, lrs = [], []
    for x, y in make_batches(12):
        lr = opt.param_groups[0]["lr"]
        lrs.append(lr)
        opt.step(closure_for(opt, model, x, y))
        rhos.append(opt.diagnostics["rho"])
        assert rhos[-1] == pytest.approx(max(0.0, 0.2 * (lr - lr_min) / (3e-3 - lr_min)), rel=1e-9, abs=1e-15)
        sched.step()
    assert min(rhos) == pytest.approx(0.0, abs=1e-15) and max(rhos) > 0.19  # from the peak to the floor
    assert all(0.0 <= r <= 0.2 + 1e-15 for r in rhos)
    if make_scheduler is linear_decay:  # the case that ends one rounding step below lr_min
        assert min(lrs) == 2.9999999999999977e-05 and min(rhos) == 0.0


def test_a_warmup_from_lr_0_needs_lr_min_0():
    model = make_model()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.2, rho_min=0.0, lr=3e-3, lr_min=3e-5)
    warmup_from_zero_then_decay(opt)
    with pytest.raises(ValueError, match=r"lr = 0.0 < lr_min = 3e-05.*\(0 for a warmup from lr 0\)"):
        opt.step(closure_for(opt, model, *make_batches(1)[0]))
    assert not opt.in_flight


def lr_lambda(step):
    return min(1.0, (step + 1) / 5) * 0.9 ** max(0, step - 5)  # warmup, then decay


def test_schedule_follows_the_lr_against_the_formula():
    model = make_model()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.2, rho_min=0.02, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    seen = set()
    for x, y in make_batches(15):
        lr = opt.param_groups[0]["lr"]
        opt.step(closure_for(opt, model, x, y))
        expected = 0.02 + (0.2 - 0.02) * lr / 0.1
        assert opt.diagnostics["rho"] == pytest.approx(expected, rel=1e-12)
        assert opt.diagnostics["ascent_norm"] == pytest.approx(expected, rel=1e-12)
        seen.add(round(expected, 6))
        sched.step()
    assert len(seen) >= 10  # it did move


def test_schedule_options_are_checked():
    model = make_model()
    with pytest.raises(ValueError, match=r"rho_min must be in \[0, 0.1\], got 0.2"):
        VASSO(model.parameters(), torch.optim.SGD, rho=0.1, rho_min=0.2, lr=0.1)
    with pytest.raises(ValueError, match="lr_max must be in"):
        VASSO(model.parameters(), torch.optim.SGD, rho=0.1, rho_min=0.0, lr=0.1, lr_min=0.2)
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.1, rho_min=0.0, lr=0.1, lr_min=0.05)
    opt.param_groups[0]["lr"] = 0.01  # below lr_min: rho_t would be negative
    with pytest.raises(ValueError, match="lr fell below lr_min"):
        opt.step(closure_for(opt, model, *make_batches(1)[0]))
    assert not opt.in_flight


def run(opt, sched, model, batches):
    for x, y in batches:
        opt.step(closure_for(opt, model, x, y))
        sched.step()


@pytest.mark.parametrize("cls", [SAM, VASSO])
def test_resume_mid_schedule_is_bit_exact(cls):
    batches = make_batches(16)

    def fresh():
        model = make_model(dropout=0.2)
        opt = cls(model.parameters(), torch.optim.AdamW, rho=0.2, rho_min=0.05, lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    torch.manual_seed(5)
    model, opt, sched = fresh()
    run(opt, sched, model, batches)
    expected = flat(model.parameters())

    torch.manual_seed(5)
    model, opt, sched = fresh()
    run(opt, sched, model, batches[:7])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict(), torch.get_rng_state()))
    model, opt, sched = fresh()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    torch.set_rng_state(saved[3])
    assert opt.current_rho() == pytest.approx(0.05 + 0.15 * opt.param_groups[0]["lr"] / 1e-2)
    run(opt, sched, model, batches[7:])
    assert torch.equal(flat(model.parameters()), expected)


def test_a_state_dict_from_before_rho_lived_in_the_groups_is_refused():
    """The unreleased format whose groups held no rho (it replaced an upgrade that took
    the constructor's): refused, naming the key expected, before anything loads."""
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.1, lr=0.1)
    opt.step(closure_for(opt, model, *make_batches(1)[0]))
    old = opt.state_dict()
    for g in old["param_groups"]:
        del g["rho"]
    opt2 = VASSO(model.parameters(), torch.optim.SGD, rho=0.3, lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 of the state dict has no 'rho'.*expected .*'rho'"):
        opt2.load_state_dict(old)
    assert [g["rho"] for g in opt2.param_groups] == [0.3] and opt2.num_steps == 0


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "GSAM"])
def test_rho_zero_with_the_schedule_is_the_base_optimizer_bit_for_bit(kind):
    batches = make_batches(10)
    base_model = make_model(dropout=0.3)
    base = torch.optim.AdamW(base_model.parameters(), lr=1e-2)
    base_sched = torch.optim.lr_scheduler.LambdaLR(base, lr_lambda)
    torch.manual_seed(1)
    run(base, base_sched, base_model, batches)
    model = make_model(dropout=0.3)
    opt = build(kind, model.parameters(), torch.optim.AdamW, rho=0.0, rho_min=0.0, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    torch.manual_seed(1)
    run(opt, sched, model, batches)
    assert torch.equal(flat(model.parameters()), flat(base_model.parameters()))


def test_sam_refuses_theta_with_a_clear_message():
    with pytest.raises(ValueError, match="SAM takes no theta.*VASSO"):
        SAM(make_model().parameters(), torch.optim.AdamW, theta=0.4)
