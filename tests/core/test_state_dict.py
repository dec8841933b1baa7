"""The optimizer's state dict: torch's shape, the earlier formats refused, torch's checkpoint helpers;
checkpoints at any point (before any step, after skipped steps); copy and pickle.

``state_dict()`` is ``{"state": {index: {...}}, "param_groups": [...]}`` with this
wrapper's buffers (``sam_slope``, ``sam_previous_ascent``) and ``sam_counters`` in each
parameter's entry beside the base optimizer's moments, so that
``torch.distributed.checkpoint.state_dict``'s helpers and ``ZeroRedundancyOptimizer``
carry them (the distributed cases are in ``tests/distributed/test_state_*.py``).
"""

import copy
import math
import pickle
from pathlib import Path

import pytest
import torch
try:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
except ImportError:  # torch 2.1 (the declared floor) has no such helpers yet
    StateDictOptions = get_optimizer_state_dict = set_optimizer_state_dict = None
needs_dcp_helpers = pytest.mark.skipif(
    get_optimizer_state_dict is None,
    reason=f"torch {torch.__version__} has no torch.distributed.checkpoint.state_dict (get/set_optimizer_state_dict)")

from plugins import SAM, VASSO

from core_helpers import FAMILY, VARIANTS, build, closure_for, coin_seed, flat, make_batches, make_model

# Made by the code of commit c0e16db (an unreleased format before this one: {"base_optimizer",
# "state", "sharpness"}, which no longer loads): for each case, the model and optimizer state
# dicts after 5 steps on make_batches(10) (model: make_model()), and the weights that code
# reached after the 5 further steps; this file's CASES builds the same optimizers.
LEGACY = Path(__file__).parent / "data" / "state_dict_c0e16db.pt"

CASES = {
    "eVASSO-AdamW": lambda ps: VASSO(ps, torch.optim.AdamW, rho=0.1, theta=0.4, p=0.6, seed=7, lr=1e-2,
                                     weight_decay=1e-2),
    "GSAM-SGD": lambda ps: SAM(ps, torch.optim.SGD, rho=0.05, gsam_alpha=0.3, lr=0.1, momentum=0.9),
    "adaptive-eVASSO-AdamW": lambda ps: VASSO(ps, torch.optim.AdamW, rho=0.5, theta=0.4, adaptive=True, p=0.5,
                                              seed=3, lr=1e-2),
}


def train(opt, model, batches):
    for x, y in batches:
        opt.step(closure_for(opt, model, x, y))


@pytest.fixture(scope="module")
def legacy():
    return torch.load(LEGACY, weights_only=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_state_dict_of_the_earlier_format_is_refused_naming_the_keys_expected(legacy, case):
    """The unreleased format of c0e16db (it replaced an upgrade of it): refused before
    anything loads, with the keys that were found and those expected."""
    saved = legacy[case]
    assert set(saved["optimizer"]) == {"base_optimizer", "state", "sharpness"}  # the earlier format
    model = make_model(seed=3)
    opt = CASES[case](model.parameters())
    expected = r"got the keys \['base_optimizer', 'sharpness', 'state'\], expected .*'state'.*'param_groups'"
    with pytest.raises(ValueError, match=expected):
        opt.load_state_dict(saved["optimizer"])
    with pytest.raises(ValueError, match=expected):
        type(opt).base_optimizer_state(saved["optimizer"])
    assert opt.num_steps == 0 and not opt.state
    assert all("rho" in g for g in opt.param_groups)


def test_each_entry_holds_the_base_moments_beside_ours():
    model = make_model()
    opt = build("eVASSO", model.parameters(), seed=5)
    train(opt, model, make_batches(4))
    sd = opt.state_dict()
    first = model[0].weight
    entry = sd["state"][0]
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq", "sam_slope", "sam_previous_ascent", "sam_held",
                          "sam_counters"}
    assert entry["sam_held"] == {"slope": 1, "previous_ascent": 1}
    assert entry["exp_avg"] is opt.base_optimizer.state[first]["exp_avg"]
    assert entry["sam_slope"] is opt._own_state[first]["slope"]
    assert entry["sam_counters"]["step"] == 4 and entry["sam_counters"]["seed"] == 5
    assert sd["param_groups"][0]["params"] == list(range(len(list(model.parameters()))))
    # opt.state is the same merged view, in torch's per-parameter shape
    assert set(opt.state[first]) == set(entry) and len(opt.state) == len(sd["state"])
    with pytest.raises(KeyError, match="'sam_slope' there"):  # code meaning our buffer must not read "absent"
        "slope" in opt.state[first]


@needs_dcp_helpers
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("kind", ["eVASSO", "eSAM", "V+G", "adaptive eVASSO"])
def test_torch_checkpoint_helpers_resume_bit_for_bit(kind, flatten):
    """get/set_optimizer_state_dict (what torch.distributed.checkpoint saves), one process:
    the template of a fresh optimizer has every key, loading it continues bit for bit."""
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    batches = make_batches(10)
    model = make_model()
    opt = build(kind, model.parameters(), seed=3)
    train(opt, model, batches[:5])
    saved_opt = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
    saved_model = copy.deepcopy(model.state_dict())
    train(opt, model, batches[5:])

    resumed = make_model(seed=9)
    resumed.load_state_dict(saved_model)
    fresh = build(kind, resumed.parameters(), seed=0)
    before = flat(resumed.parameters())
    template = get_optimizer_state_dict(resumed, fresh, options=options)  # torch's zero-lr initialization
    assert torch.equal(flat(resumed.parameters()), before)  # it moved nothing
    assert sorted(template) == sorted(saved_opt) if flatten else sorted(template["state"]["0.weight"]) == sorted(
        saved_opt["state"]["0.weight"])
    set_optimizer_state_dict(resumed, fresh, saved_opt, options=options)
    assert fresh.num_steps == 5 and fresh.seed == 3
    train(fresh, resumed, batches[5:])
    assert torch.equal(flat(resumed.parameters()), flat(model.parameters()))


@needs_dcp_helpers
def test_a_checkpoint_taken_before_the_first_step_starts_vasso_at_d0_equal_g0():
    """Before any step the entries hold zero placeholders (a template needs a tensor for each
    buffer); loading them must not turn d_0 = g_0 into theta * g_0."""
    batches = make_batches(3)
    model = make_model()
    opt = build("VASSO", model.parameters())
    template = get_optimizer_state_dict(model, opt)
    assert all(torch.count_nonzero(e["sam_slope"]) == 0 for e in template["state"].values())
    set_optimizer_state_dict(model, opt, copy.deepcopy(template))
    train(opt, model, batches)

    reference = make_model()
    ref_opt = build("VASSO", reference.parameters())
    # the reference takes torch's initialization too (an AdamW step with lr 0: step count 1)
    get_optimizer_state_dict(reference, ref_opt)
    train(ref_opt, reference, batches)
    assert torch.equal(flat(model.parameters()), flat(reference.parameters()))
    for q, r in zip(model.parameters(), reference.parameters()):
        assert torch.equal(opt.state[q]["sam_slope"], ref_opt.state[r]["sam_slope"])


def entry_keys(osd):
    """The per-parameter keys of a nested ({fqn: sorted keys}) or flattened optimizer state dict."""
    if "state" in osd:
        return {fqn: sorted(entry) for fqn, entry in osd["state"].items()}
    return sorted(k for k in osd if k.startswith("state."))


# fresh; after only steps the coin skipped (p < 1); after the first two-pass step; mid-run
POINTS = (0, 2, 3, 5)
STEPS = 7


def resume_through(route, model, opt, kind, seed, tmp_path, flatten):
    """A new model and optimizer (another seed, which the checkpoint's must replace), loaded
    from ``model``/``opt`` by ``route``: torch.distributed.checkpoint into the template of
    the fresh optimizer, torch's state_dict()/load_state_dict(), or the entries assigned one
    by one to ``opt.state[p]`` as ZeroRedundancyOptimizer.load_state_dict does."""
    resumed = make_model(seed=9)
    fresh = build(kind, resumed.parameters(), seed=seed + 1)
    if route == "dcp":
        import torch.distributed.checkpoint as dcp
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        saved = get_optimizer_state_dict(model, opt, options=options)
        dcp.save({"model": model.state_dict(), "optim": saved}, checkpoint_id=tmp_path)
        template = {"model": resumed.state_dict(), "optim": get_optimizer_state_dict(resumed, fresh, options=options)}
        # dcp.load refuses a key of the template missing in the checkpoint, and ignores one it lacks
        assert entry_keys(template["optim"]) == entry_keys(saved)
        dcp.load(template, checkpoint_id=tmp_path)
        resumed.load_state_dict(template["model"])
        set_optimizer_state_dict(resumed, fresh, template["optim"], options=options)
        return resumed, fresh
    saved = copy.deepcopy(opt.state_dict())
    resumed.load_state_dict(copy.deepcopy(model.state_dict()))
    if route == "state_dict":
        fresh.load_state_dict(saved)
    else:
        for i, q in enumerate(resumed.parameters()):
            fresh.state[q] = saved["state"][i]
        for group, saved_group in zip(fresh.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
    return resumed, fresh


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("route", [pytest.param("dcp", marks=needs_dcp_helpers), "state_dict", "entries"])
@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eSAM", "eVASSO", "adaptive eVASSO"])
def test_a_checkpoint_taken_at_any_point_resumes_bit_for_bit(kind, route, tmp_path):
    """Before any step, after steps the coin skipped, after the first two-pass step and
    mid-run: the fresh optimizer's entries have the checkpoint's keys (its buffers still
    zero placeholders), loading drops the placeholders (VASSO's d_0 = g_0 all the same)
    and the run continues bit for bit."""
    p = VARIANTS[kind][1].get("p", 1.0)
    seed = coin_seed(p)
    batches = make_batches(STEPS)
    for i, point in enumerate(POINTS):
        model = make_model()
        opt = build(kind, model.parameters(), seed=seed)
        train(opt, model, batches[:point])
        # VASSO's d_t is made on the first step, SAM's g on the first two-pass one (the third, p < 1)
        made = point > 0 and (p == 1.0 or kind.endswith("VASSO") or point > 2)
        assert all(e["sam_held"]["slope"] == made for e in opt.state_dict()["state"].values()), (kind, point)
        resumed, fresh = resume_through(route, model, opt, kind, seed, tmp_path / str(point), flatten=i % 2 == 1)
        assert fresh.num_steps == point and fresh.seed == seed, (kind, point)
        train(opt, model, batches[point:])
        train(fresh, resumed, batches[point:])
        assert torch.equal(flat(resumed.parameters()), flat(model.parameters())), (kind, route, point)


@pytest.mark.parametrize("point", [0, 2])
def test_entries_without_sam_held_are_refused(point):
    """Entries of the unreleased format before ``sam_held`` (it replaced an upgrade of
    them), and param groups without ``rho`` (the format before rho lived in the groups):
    refused, naming what is expected, before anything loads."""
    model = make_model()
    opt = build("VASSO", model.parameters())
    train(opt, model, make_batches(4)[:point])
    saved = copy.deepcopy(opt.state_dict())
    for entry in saved["state"].values():
        del entry["sam_held"]
    fresh = build("VASSO", make_model(seed=9).parameters())
    with pytest.raises(ValueError, match=r"holds \['sam_slope'\] without 'sam_held'.*expected .*'sam_held'"):
        fresh.load_state_dict(saved)
    no_rho = copy.deepcopy(opt.state_dict())
    del no_rho["param_groups"][0]["rho"]
    with pytest.raises(ValueError, match="param group 0 of the state dict has no 'rho'"):
        fresh.load_state_dict(no_rho)
    assert fresh.num_steps == 0 and not fresh.state


def test_entries_assigned_one_by_one_resume_bit_for_bit():
    """ZeroRedundancyOptimizer.load_state_dict writes ``opt.state[p] = entry`` for each of its
    parameters and copies the param groups' values: the view must take that too."""
    batches = make_batches(8)
    model = make_model()
    opt = build("adaptive eVASSO", model.parameters(), seed=2)
    train(opt, model, batches[:4])
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    train(opt, model, batches[4:])

    resumed = make_model(seed=4)
    resumed.load_state_dict(saved_model)
    fresh = build("adaptive eVASSO", resumed.parameters(), seed=0)
    train(fresh, resumed, batches[:1])  # state of its own, which the assignment must replace
    resumed.load_state_dict(saved_model)
    for i, q in enumerate(resumed.parameters()):
        fresh.state[q] = copy.deepcopy(saved_opt["state"][i])
    for group, saved_group in zip(fresh.param_groups, saved_opt["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    assert fresh.num_steps == 4 and fresh.seed == 2
    train(fresh, resumed, batches[4:])
    assert torch.equal(flat(resumed.parameters()), flat(model.parameters()))


def test_step_without_closure_still_refuses_outside_torchs_initialization():
    model = make_model()
    opt = build("SAM", model.parameters())
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="needs a closure"):  # lr is not 0: a user's mistake
        opt.step()
    opt.param_groups[0]["lr"] = 0.0
    model[0].weight.grad[0, 0] = 1.0  # a real gradient: not torch's initialization either
    with pytest.raises(RuntimeError, match="needs a closure"):
        opt.step()
    assert not opt.state and opt.num_steps == 0


def test_malformed_state_dicts_are_refused():
    model = make_model()
    opt = build("VASSO", model.parameters())
    train(opt, model, make_batches(2))
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        opt.load_state_dict({"state": sd["state"]})
    bad = copy.deepcopy(sd)
    bad["state"][0]["sam_velocity"] = bad["state"][0]["sam_slope"]
    with pytest.raises(ValueError, match="unknown sharpness-aware state 'sam_velocity'"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][1]["sam_counters"]["step"] = 7
    with pytest.raises(ValueError, match="disagree on 'sam_counters'"):
        opt.load_state_dict(bad)
    # entries loaded one by one (as torch.distributed.checkpoint does) hold NaNs that are not one object
    before_any_ascent = build("eSAM", model.parameters(), p=0.0).state_dict()
    for entry in before_any_ascent["state"].values():
        entry["sam_counters"] = {k: float(repr(v)) if isinstance(v, float) else v
                                 for k, v in entry["sam_counters"].items()}
    assert math.isnan(before_any_ascent["state"][0]["sam_counters"]["last_rho"])
    build("eSAM", model.parameters(), p=0.0).load_state_dict(before_any_ascent)
    plain = torch.optim.AdamW(model.parameters()).state_dict()  # not ours
    with pytest.raises(ValueError, match="not a sharpness-aware optimizer state dict"):
        opt.load_state_dict(plain)
    assert opt.num_steps == 2 and math.isfinite(opt.state[model[0].weight]["sam_counters"]["last_rho"])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_and_pickle_give_an_independent_optimizer_that_steps_as_the_original(how):
    """As torch's optimizers: a copy of (model, optimizer), taken mid-run with a scheduler
    and a hook attached (which the copy leaves out, as torch does), continues exactly as
    the original, whose state it does not share."""
    copy_of = copy.deepcopy if how == "deepcopy" else (lambda obj: pickle.loads(pickle.dumps(obj)))
    for kind in FAMILY:
        batches = make_batches(6)
        model = make_model()
        opt = build(kind, model.parameters(), seed=2, lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9 ** step)
        opt.register_step_post_hook(lambda *_: None)  # a lambda: neither copied nor pickled
        train(opt, model, batches[:3])
        sched.step()
        twin_model, twin = copy_of((model, opt))
        assert twin.num_steps == 3 and twin.param_groups is twin.base_optimizer.param_groups, kind
        first, twin_first = model[0].weight, twin_model[0].weight
        assert twin.state[twin_first]["sam_slope"] is not opt.state[first]["sam_slope"], kind
        assert torch.equal(twin.state[twin_first]["sam_slope"], opt.state[first]["sam_slope"]), kind
        train(opt, model, batches[3:])
        train(twin, twin_model, batches[3:])
        assert torch.equal(flat(twin_model.parameters()), flat(model.parameters())), kind


def test_copy_in_the_middle_of_a_step_is_refused():
    model = make_model()
    opt = build("VASSO", model.parameters())
    x, y = make_batches(1)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert opt.perturb()
    with pytest.raises(RuntimeError, match="middle of a step: call descend"):
        copy.deepcopy(opt)
    opt.abandon()
    assert copy.deepcopy(opt).num_steps == 1
