"""SAM, GSAM and VASSO's update logic on a plain torch featurizer and classifier
(no DomainBed needed)."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from domainbed_vasso import algorithms as A
from domainbed_vasso import hparams as H

ERM_HPARAMS = {"lr": 1e-3, "weight_decay": 1e-4, "nonlinear_classifier": False, "batch_size": 8}


class Featurizer(nn.Module):
    """Conv + BatchNorm + dropout: exercises RNG replay and frozen running stats."""
    n_outputs = 16

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 4 * 4, self.n_outputs)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.drop(self.fc(x.flatten(1)))


def hparams_for(algorithm, **overrides):
    hp = dict(ERM_HPARAMS)
    hp.update({name: default for name, default, _, _ in H.SPECS[algorithm]})
    hp.update(overrides)
    return hp


def build(algorithm, seed=0, **overrides):
    torch.manual_seed(seed)
    featurizer, classifier = Featurizer(), nn.Linear(Featurizer.n_outputs, 3)
    cls = getattr(A, algorithm)
    return cls((3, 4, 4), 3, 2, hparams_for(algorithm, **overrides),
               featurizer=featurizer, classifier=classifier)


class ReferenceERM(nn.Module):
    """DomainBed's ERM, verbatim in substance: Adam over featurizer + classifier."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.network = nn.Sequential(Featurizer(), nn.Linear(Featurizer.n_outputs, 3))
        self.optimizer = torch.optim.Adam(self.network.parameters(), lr=ERM_HPARAMS["lr"],
                                          weight_decay=ERM_HPARAMS["weight_decay"])

    def update(self, minibatches, unlabeled=None):
        all_x = torch.cat([x for x, y in minibatches])
        all_y = torch.cat([y for x, y in minibatches])
        loss = F.cross_entropy(self.network(all_x), all_y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.item()}


def batches(n_steps, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
             for _env in range(2)] for _ in range(n_steps)]


def run(model, data):
    out = []
    for mb in data:
        out.append(model.update(mb))
    return out


def state(model):
    return {k: v.detach().clone() for k, v in model.network.state_dict().items()}


@pytest.mark.parametrize("algorithm", ["SAM", "GSAM", "VASSO"])
def test_rho_zero_steps_exactly_like_erm(algorithm):
    data = batches(4)
    ref = ReferenceERM(seed=5)
    torch.manual_seed(77)
    ref_out = run(ref, data)
    ref_next = torch.rand(3)
    model = build(algorithm, seed=5, rho=0.0)
    torch.manual_seed(77)  # the same dropout stream as the reference
    out = run(model, data)
    # the global RNG stream is where ERM left it (dropout drawn once per step, not twice)
    assert torch.equal(torch.rand(3), ref_next)
    assert [o["loss"] for o in out] == [o["loss"] for o in ref_out]
    a, b = state(ref), state(model)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # weights and BatchNorm running stats, bitwise


def test_same_seed_same_initial_weights_as_erm():
    ref, model = ReferenceERM(seed=9), build("VASSO", seed=9)
    for (k, v), (k2, v2) in zip(ref.network.state_dict().items(), model.network.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_update_reports_floats_and_diagnostics():
    model = build("VASSO", rho=0.05, theta=0.4)
    outs = run(model, batches(3))
    for i, out in enumerate(outs):
        assert all(type(v) is float for v in out.values()), out
        assert out["two_pass"] == 1.0 and out["rho"] == 0.05
        assert out["loss_gap"] == pytest.approx(out["loss_perturbed"] - out["loss"])
        assert out["ascent_norm"] == pytest.approx(0.05, rel=1e-5)
        assert out["sharpness"] > 0
        assert ("stability" in out) == (i > 0)  # ||eps_t - eps_{t-1}|| needs a previous eps
        assert 0 <= out.get("stability", 0) <= 2 * 0.05 + 1e-6


def test_second_pass_does_not_touch_batchnorm_running_stats():
    data = batches(1)
    model = build("SAM", rho=0.5)
    probe = copy.deepcopy(model.network)
    all_x = torch.cat([x for x, _ in data[0]])
    probe.train()
    probe(all_x)  # one first-pass forward updates the running stats once
    model.update(data[0])
    bn, expected = model.network[0].bn, probe[0].bn
    assert torch.equal(bn.running_mean, expected.running_mean)
    assert torch.equal(bn.running_var, expected.running_var)
    assert int(bn.num_batches_tracked) == 1


def test_vasso_theta_one_is_sam_and_gsam_alpha_zero_is_sam():
    data = batches(3)
    sam = build("SAM", seed=1, rho=0.1)
    torch.manual_seed(0)
    run(sam, data)
    for name, kw in (("VASSO", dict(theta=1.0)), ("GSAM", dict(gsam_alpha=0.0))):
        other = build(name, seed=1, rho=0.1, **kw)
        torch.manual_seed(0)
        run(other, data)
        for k, v in state(sam).items():
            assert torch.allclose(v, state(other)[k], atol=1e-6), (name, k)


def test_vasso_and_gsam_differ_from_sam():
    data = batches(3)
    results = {}
    for name, kw in (("SAM", {}), ("VASSO", dict(theta=0.2)), ("GSAM", dict(gsam_alpha=0.3))):
        model = build(name, seed=1, rho=0.1, **kw)
        torch.manual_seed(0)
        run(model, data)
        results[name] = torch.cat([p.detach().flatten() for p in model.network.parameters()])
    assert not torch.allclose(results["SAM"], results["VASSO"])
    assert not torch.allclose(results["SAM"], results["GSAM"])


def test_evasso_skips_some_second_passes_and_omits_their_diagnostics():
    model = build("VASSO", rho=0.05, p=0.5)
    outs = run(model, batches(16))
    flags = [o["two_pass"] for o in outs]
    assert 0.0 in flags and 1.0 in flags
    for o in outs:
        assert ("loss_gap" in o) == (o["two_pass"] == 1.0)
    # the coin is a function of (seed, step): the same run again gives the same flags
    again = build("VASSO", rho=0.05, p=0.5)
    assert [o["two_pass"] for o in run(again, batches(16))] == flags


def test_nonfinite_gradient_skips_the_step():
    model = build("VASSO")
    before = state(model)
    x = torch.full((4, 3, 4, 4), float("nan"))
    with pytest.warns(RuntimeWarning):
        out = model.update([(x, torch.zeros(4, dtype=torch.long))])
    assert out["nonfinite"] == 1.0
    after = state(model)
    for k in before:
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(before[k], after[k]), k


def test_adaptive_geometry_runs():
    model = build("VASSO", adaptive=True, rho=0.5)
    outs = run(model, batches(2))
    assert all(math.isfinite(o["loss_gap"]) for o in outs)


@pytest.mark.parametrize("algorithm,key,value,message", [
    ("VASSO", "theta", 2.0, "theta must be in (0, 1]"),
    ("VASSO", "theta", 0.0, "theta must be in (0, 1]"),
    ("SAM", "rho", -0.1, "rho must be in [0, inf)"),
    ("GSAM", "gsam_alpha", -1, "gsam_alpha must be in [0, inf)"),
    ("SAM", "p", 0.0, "p must be in (0, 1]"),
    ("VASSO", "p", 1.5, "p must be in (0, 1]"),
    ("VASSO", "rho", "0.05", "rho must be a real number"),
    ("SAM", "adaptive", "yes", "adaptive must be true or false"),
    ("VASSO", "rho", float("nan"), "rho must be in"),
])
def test_invalid_hparams_are_refused_before_training(algorithm, key, value, message):
    with pytest.raises(H.HParamError) as info:
        build(algorithm, **{key: value})
    assert message in str(info.value)
    assert algorithm in str(info.value)


def test_missing_hparam_is_named():
    hp = hparams_for("VASSO")
    del hp["theta"]
    with pytest.raises(H.HParamError, match="theta is missing"):
        A.VASSO((3, 4, 4), 3, 2, hp, featurizer=Featurizer(), classifier=nn.Linear(16, 3))


def test_unknown_hparam_keys_are_named_with_the_closest_valid_one():
    defined = hparams_for("VASSO")
    assert H.unknown_hparams("VASSO", "PACS", {"theta": 0.5, "lr": 1e-3}, defined) is None
    message = H.unknown_hparams("VASSO", "PACS", {"theat": 0.5, "rho": 0.1}, defined)
    assert message == ("--hparams: 'theat' (closest valid: 'theta') is not an hparam of VASSO on PACS "
                       "(DomainBed would ignore it; --allow-unknown-hparams lets it)")
    message = H.unknown_hparams("SAM", "PACS", {"theta": 0.4, "zzz": 1}, hparams_for("SAM"))
    assert message.startswith("--hparams: 'theta' (an hparam of VASSO only), 'zzz' are not hparams of SAM")
    assert "\n" not in message


def test_hparam_defaults_and_random_grids():
    def seed_hash(*args):  # DomainBed's, re-stated
        import hashlib
        return int(hashlib.md5(str(args).encode("utf-8")).hexdigest(), 16) % (2 ** 31)

    d = {k: v[0] for k, v in H.own_hparams("VASSO", 0, seed_hash).items()}
    assert d == {"rho": 0.05, "theta": 0.4, "gsam_alpha": 0.0, "p": 1.0, "adaptive": False, "eta": 0.01}
    assert {k: v[0] for k, v in H.own_hparams("GSAM", 0, seed_hash).items()}["gsam_alpha"] == 0.1
    thetas, rhos, alphas = set(), set(), set()
    for seed in range(1, 60):
        v = {k: r for k, (_, r) in H.own_hparams("VASSO", seed, seed_hash).items()}
        g = {k: r for k, (_, r) in H.own_hparams("GSAM", seed, seed_hash).items()}
        s = {k: r for k, (_, r) in H.own_hparams("SAM", seed, seed_hash).items()}
        assert v["rho"] == g["rho"] == s["rho"]  # seeded per name: same rho for the same seed
        assert type(v["theta"]) is float and type(v["adaptive"]) is bool
        H.validate("VASSO", {**v, "lr": 1e-3, "weight_decay": 0.0})
        thetas.add(v["theta"])
        rhos.add(v["rho"])
        alphas.add(g["gsam_alpha"])
    assert thetas == {0.2, 0.4, 0.9}
    assert rhos == {0.01, 0.02, 0.05, 0.1}
    assert alphas <= {0.01, 0.05, 0.1, 0.2, 0.3} and len(alphas) > 2


def test_parse_overrides():
    assert H.parse_overrides(None) == {}
    assert H.parse_overrides('{"rho": 0.1}') == {"rho": 0.1}
    with pytest.raises(H.HParamError, match="not valid JSON"):
        H.parse_overrides("{rho: 0.1}")
    with pytest.raises(H.HParamError, match="JSON object"):
        H.parse_overrides("[1]")


def test_sweep_command_rewrite():
    from domainbed_vasso import sweep
    cmd = "python -m domainbed.scripts.train --algorithm VASSO --dataset PACS --hparams '{\"rho\": 0.1}'"
    out = sweep.rewrite_command(cmd, python="/opt/my env/bin/python")
    assert out == ("'/opt/my env/bin/python' -m domainbed_vasso.train --algorithm VASSO --dataset PACS "
                   "--hparams '{\"rho\": 0.1}'")
    with pytest.raises(RuntimeError, match="not supported"):
        sweep.rewrite_command("python3 -m domainbed.scripts.train_autolr --x 1")


def test_num_workers_variable():
    from types import SimpleNamespace

    from domainbed_vasso import _locate

    class Base:
        N_WORKERS = 8

    class Sub(Base):
        N_WORKERS = 4

    module = SimpleNamespace(MultipleDomainDataset=Base, Sub=Sub, other=int)
    assert _locate.apply_num_workers(module, "") is None and Sub.N_WORKERS == 4
    assert _locate.apply_num_workers(module, "0") == 0
    assert Base.N_WORKERS == 0 and Sub.N_WORKERS == 0
    with pytest.raises(ValueError, match="DOMAINBED_VASSO_NUM_WORKERS"):
        _locate.apply_num_workers(module, "-1")
