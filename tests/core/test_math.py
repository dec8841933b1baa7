"""The ascent, the slope, the restore and the corrections against plain re-computations."""

import math

import pytest
import torch

import plugins
from plugins import SAM, VASSO
from plugins.lab.selftest.reference import MEMBERS, reference_steps
from core_helpers import FAMILY, build, closure_for, first_backward, flat, make_batches, make_model


@pytest.mark.parametrize("cls", [SAM, VASSO])
@pytest.mark.parametrize("rho", [0.01, 0.1, 2.0])
def test_ascent_has_norm_rho(cls, rho):
    model = make_model()
    opt = cls(model.parameters(), torch.optim.SGD, rho=rho, lr=0.1)
    for x, y in make_batches(3):
        first_backward(model, x, y)
        before = flat(model.parameters())
        assert opt.perturb()
        eps = flat(model.parameters()) - before
        assert eps.norm().item() == pytest.approx(rho, rel=1e-5)
        assert opt.diagnostics["ascent_norm"] == pytest.approx(rho)
        opt.descend()


@pytest.mark.parametrize("kind", FAMILY)
def test_zero_gradient_gives_zero_ascent_and_no_nan(kind):
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, seed=3)
    before = flat(model.parameters())
    for _ in range(4):
        for q in model.parameters():
            q.grad = torch.zeros_like(q)
        opt.perturb()
        assert torch.equal(flat(model.parameters()), before)
        assert opt.descend()
    assert torch.equal(flat(model.parameters()), before)
    for value in opt.diagnostics.values():
        assert not (isinstance(value, float) and math.isinf(value))


@pytest.mark.parametrize("kind", FAMILY)
def test_parameters_without_gradient_are_left_alone(kind):
    model = make_model()
    frozen = model[0].bias
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.5)
    x, y = make_batches(1)[0]
    before = frozen.detach().clone()
    for _ in range(3):
        first_backward(model, x, y)
        frozen.grad = None
        norm_g = torch.cat([q.grad.reshape(-1) for q in model.parameters() if q.grad is not None]).norm()
        assert math.isfinite(norm_g.item())
        if opt.perturb():
            assert torch.equal(frozen, before)
            first_backward(model, x, y)
            frozen.grad = None
        opt.descend()
    assert torch.equal(frozen, before)
    assert frozen not in opt.state or not opt.state[frozen]


def model_loss(batches):
    """make_model()'s loss on ``batches[t]`` as a function of its parameters, in float64: the
    model that reference_steps takes."""
    def loss(params, t):
        w1, b1, w2, b2 = params
        x, y = batches[t]
        return torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x.double(), w1, b1)), w2, b2), y)
    return loss


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("member", list(MEMBERS))
def test_float64_parameters_step_as_the_float64_equations(member, path):
    """Every member with float64 parameters, on either path (docs/design.md, "Where a step is
    decided"), six steps of plain SGD: the float64 reference of the equations to float64's
    rounding.  A scalar of the step rounded to float32 (ASAM's rho / ||T v||, GSAM's alpha)
    leaves 1e-10 there."""
    cls, knobs = MEMBERS[member]
    rho, lr = 0.07, 0.1
    model = make_model().double()
    batches = make_batches(6)
    expected = reference_steps(model_loss(batches), list(model.parameters()), len(batches), lr=lr, rho=rho,
                               seed=5, **knobs)
    opt = getattr(plugins, cls)(model.parameters(), torch.optim.SGD, rho=rho, lr=lr, seed=5, **knobs)
    opt._decide_on_device = path == "device"
    for t, (x, y) in enumerate(batches):
        opt.step(closure_for(opt, model, x.double(), y))
        torch.testing.assert_close(flat(model.parameters()), flat(expected[t]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("theta", [0.2, 0.4, 0.9, 1.0])
def test_vasso_matches_the_papers_equations(theta):
    """d_t = (1-theta) d_{t-1} + theta g_t (d_0 = g_0), eps_t = rho d_t/||d_t||, descent with
    g(x_t + eps_t): the float64 reference of the equations (plugins.lab.selftest.reference,
    which vasso-selftest holds every member to on the user's devices) with plain SGD."""
    rho, lr = 0.05, 0.1
    model = make_model()
    batches = make_batches(6)
    expected = reference_steps(model_loss(batches), list(model.parameters()), len(batches), lr=lr, rho=rho, theta=theta)
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=rho, theta=theta, lr=lr)
    for t, (x, y) in enumerate(batches):
        first_backward(model, x, y)
        g = [q.grad.clone() for q in model.parameters()]
        previous = [opt.state[q]["sam_slope"].clone() for q in model.parameters()] if t else g
        before = flat(model.parameters())
        assert opt.perturb()
        d = flat([(1 - theta) * a + theta * b for a, b in zip(previous, g)])
        torch.testing.assert_close(flat(opt.state[q]["sam_slope"] for q in model.parameters()), d, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(flat(model.parameters()) - before, rho * d / d.norm(), rtol=1e-5, atol=1e-7)
        assert opt.diagnostics["sharpness"] == pytest.approx(rho * d.norm().item(), rel=1e-5)
        first_backward(model, x, y)
        opt.descend()
        torch.testing.assert_close(flat(model.parameters()).double(), flat(expected[t]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", FAMILY)
def test_restore_returns_to_the_pre_perturbation_point(kind):
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.3)
    for x, y in make_batches(5):
        first_backward(model, x, y)
        before = flat(model.parameters())
        if opt.perturb():
            assert not torch.equal(flat(model.parameters()), before)
            first_backward(model, x, y)
        opt.restore()
        after = flat(model.parameters())
        if opt.adaptive:  # restored from a copy
            assert torch.equal(after, before)
        else:  # one add and one subtract of the same s*v: a few ulps at most
            ulp = torch.finfo(torch.float32).eps * before.abs().clamp_min(opt.rho)
            assert ((after - before).abs() <= 2 * ulp).all()
        opt.restore()  # idempotent
        assert torch.equal(flat(model.parameters()), after)
        opt.descend()


def test_low_precision_parameters_restore_exactly():
    model = make_model().to(torch.bfloat16)
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, rho=0.5)
    x, y = make_batches(1)[0]
    first_backward(model, x.to(torch.bfloat16), y)
    before = flat(model.parameters())
    assert opt.perturb()
    opt.restore()
    assert torch.equal(flat(model.parameters()), before)
    opt.descend()


def test_adaptive_geometry_matches_asam_and_leaves_biases_unscaled():
    rho, eta = 0.2, 0.01
    model = make_model()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=rho, adaptive=True, eta=eta, lr=0.1)
    x, y = make_batches(1)[0]
    first_backward(model, x, y)
    params = list(model.parameters())
    grads = [q.grad.clone() for q in params]
    T = [(q.detach().abs() + eta) if q.ndim > 1 else torch.ones_like(q) for q in params]
    tv_norm = torch.sqrt(sum(((t * g) ** 2).sum() for t, g in zip(T, grads)))
    expected = [rho * t * t * g / tv_norm for t, g in zip(T, grads)]
    before = [q.detach().clone() for q in params]
    assert opt.perturb()
    for q, b, e in zip(params, before, expected):
        torch.testing.assert_close(q.detach() - b, e, rtol=1e-5, atol=1e-8)
    # biases (1-d) move along the raw gradient: parallel to g
    bias_eps = params[1].detach() - before[1]
    cos = torch.nn.functional.cosine_similarity(bias_eps, grads[1], dim=0)
    assert cos.item() == pytest.approx(1.0, abs=1e-5)
    assert opt.diagnostics["sharpness"] == pytest.approx(rho * tv_norm.item(), rel=1e-5)
    opt.descend()


def test_adaptive_geometry_picks_weights_by_name_when_named():
    model = make_model(batchnorm=True)
    opt = SAM(model.named_parameters(), torch.optim.SGD, rho=0.2, adaptive=True, eta=0.0, lr=0.1)
    x, y = make_batches(1)[0]
    first_backward(model, x, y)
    bn_weight = model[1].weight  # 1-d, but named "...weight": ASAM's code scales it
    with torch.no_grad():  # non-uniform, so that T = |x| and T = 1 give different directions
        bn_weight.copy_(torch.linspace(0.5, 3.0, bn_weight.numel()))
    g = bn_weight.grad.clone()
    before = bn_weight.detach().clone()
    opt.perturb()
    eps = bn_weight.detach() - before
    expected_dir = before.abs() ** 2 * g
    cos = torch.nn.functional.cosine_similarity(eps, expected_dir, dim=0)
    assert cos.item() == pytest.approx(1.0, abs=1e-5)
    assert torch.nn.functional.cosine_similarity(eps, g, dim=0).item() < 0.99
    opt.descend()


def test_gsam_correction_matches_the_reference_decomposition():
    alpha, rho, lr = 0.4, 0.1, 0.05
    model, ref = make_model(), make_model()
    opt = SAM(model.parameters(), torch.optim.SGD, rho=rho, gsam_alpha=alpha, lr=lr)
    x, y = make_batches(1)[0]
    # reference
    ref.zero_grad(); torch.nn.functional.cross_entropy(ref(x), y).backward()
    g = [q.grad.clone() for q in ref.parameters()]
    gn = torch.sqrt(sum((t ** 2).sum() for t in g))
    with torch.no_grad():
        for q, t in zip(ref.parameters(), g):
            q.add_(rho * t / gn)
    ref.zero_grad(); torch.nn.functional.cross_entropy(ref(x), y).backward()
    h = [q.grad.clone() for q in ref.parameters()]
    hn = torch.sqrt(sum((t ** 2).sum() for t in h))
    inner = sum((a * b).sum() for a, b in zip(g, h))
    cosine = inner / (gn * hn)
    vertical = [a - cosine * gn * b / hn for a, b in zip(g, h)]
    expected_descent = [b - alpha * v for b, v in zip(h, vertical)]
    # ours, with SGD so that the step reveals the gradient used
    first_backward(model, x, y)
    before = [q.detach().clone() for q in model.parameters()]
    assert opt.perturb()
    first_backward(model, x, y)
    opt.descend()
    for q, b, e in zip(model.parameters(), before, expected_descent):
        torch.testing.assert_close((b - q.detach()) / lr, e, rtol=1e-4, atol=1e-6)
    # the corrected descent keeps h's component along h's direction unchanged
    used = torch.cat([((b - q.detach()) / lr).reshape(-1) for q, b in zip(model.parameters(), before)])
    hflat = torch.cat([t.reshape(-1) for t in h])
    assert torch.dot(used, hflat).item() == pytest.approx(torch.dot(hflat, hflat).item(), rel=1e-4)


def test_vasso_gsam_takes_the_correction_from_the_raw_gradient():
    """V+G: eps from d_t, the GSAM correction from g_t (this project's reading)."""
    torch.manual_seed(0)
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, rho=0.1, theta=0.3, gsam_alpha=0.5, lr=0.05)
    batches = make_batches(3)
    for x, y in batches[:2]:
        opt.step(closure_for(opt, model, x, y))
    x, y = batches[2]
    first_backward(model, x, y)
    g = [q.grad.clone() for q in model.parameters()]
    before = [q.detach().clone() for q in model.parameters()]
    assert opt.perturb()
    first_backward(model, x, y)
    h = [q.grad.clone() for q in model.parameters()]
    opt.descend()
    hn2 = sum((t ** 2).sum() for t in h)
    par = sum((a * b).sum() for a, b in zip(g, h)) / hn2
    expected = [b - 0.5 * (a - par * b) for a, b in zip(g, h)]
    for q, b, e in zip(model.parameters(), before, expected):
        torch.testing.assert_close((b - q.detach()) / 0.05, e, rtol=1e-4, atol=1e-6)


def test_per_group_learning_rates_share_one_global_ascent_norm():
    model = make_model()
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[3].parameters(), "lr": 0.01}]
    opt = VASSO(groups, torch.optim.SGD, rho=0.25, lr=0.5)
    x, y = make_batches(1)[0]
    first_backward(model, x, y)
    before = flat(model.parameters())
    opt.perturb()
    assert (flat(model.parameters()) - before).norm().item() == pytest.approx(0.25, rel=1e-5)
    opt.descend()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
