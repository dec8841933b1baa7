"""Two gloo ranks, one spawn (dist_cases.two_rank_checks): the host waits of a
distributed step, FSDP2 with mixed precision and with a loss scaler, ZeRO and OSS with a
loss scaler, and wrong use refused with an error that says what to pass."""

import pytest
import torch

from core_helpers import VARIANTS, steps_on_device
from plugins.perturbation import second_pass_coin
from spawn_helpers import run_ranks

FSDP = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(FSDP, "fully_shard") or not hasattr(torch.amp, "GradScaler"):
    pytest.skip(f"FSDP2 and torch.amp.GradScaler('cpu') need torch >= 2.6, this is {torch.__version__}",
                allow_module_level=True)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, "dist_cases:two_rank_checks", timeout=300)


def two_pass_waits(setting, kind):
    """A sharded two-pass step's host waits on gloo, where each collective blocks: the
    sums of perturb() (and ZeRO's exchange) and the verdict of descend(); ASAM's geometry on
    the device one more (``||T v_t||`` needs ``g_t``'s global finiteness first).  On NCCL
    none of those collectives makes the host wait: only the read of the verdict does."""
    return 3 if setting in ("FSDP2", "flat shards") and VARIANTS[kind][1].get("adaptive") else 2


# ------------------------------------------------------------------ host waits


def test_the_host_waits_of_a_step_on_every_path(ranks):
    """Counted as tests/core counts syncs, plus the core's blocking collectives (a
    collective whose result the next read takes is that read's wait): a two-pass step
    waits twice (:func:`two_pass_waits`) and a skipped one once under DDP (where steps decided on the device wait
    once: docs/design.md, "Distributed steps"), FSDP2, ZeRO and flat shards the model
    gathers (torch's FSDP1 with ``PartitionGroup(model_gathers=True)``, the members that
    allow it), for every member and both APIs.  Under ZeRO the first two-pass step builds the exchange (a one-time
    set-up, and its second pass shares the owners' parameters); from the next one on,
    perturb()'s one all_gather carries the sums and the owners' ascent directions
    (docs/design.md, "Distributed steps").  FSDP2's steps and the flat shards' are decided
    on the device, ASAM's geometry included: their collectives block on gloo, not on NCCL,
    and the host reads only the base's verdict, once."""
    settings = set()
    for rank in ranks:
        for (setting, kind, api), steps in rank["host_waits"].items():
            if setting == "ZeRO":  # its first two-pass step builds the exchange (a one-time set-up)
                first = next(i for i, step in enumerate(steps) if step[1])
                steps = steps[first + 1:]
            assert steps, (setting, kind, api)
            settings.add(setting)
            # DDP replicas: steps decided on the device once the slope buffers exist wait once (the
            # base's verdict: SGD cannot take torch's found_inf); the steps here are those after the first
            cls, knobs = VARIANTS[kind]
            coins = [second_pass_coin(knobs.get("p", 1.0), 0, t) for t in range(len(steps) + 1)]
            on_device = steps_on_device(kind, coins)[1:] if setting == "DDP" else [False] * len(steps)
            for (waits, two_pass, events, *_), device in zip(steps, on_device):
                expected = 1 if device else two_pass_waits(setting, kind) if two_pass else 1
                assert waits == expected, (setting, kind, api, waits, two_pass, events)
                if setting != "DDP":  # the decisions' values are global: a collective before each read
                    assert events.count("collective") >= events.count("read") >= 1, events
                if setting in ("FSDP2", "flat shards"):  # on the device: one read
                    assert events.count("read") == 1, (kind, api, events)
    assert settings == {"DDP", "FSDP2", "ZeRO", "flat shards"}, settings  # torch >= 2.6 here: FSDP1 runs on CPUs


def test_zero_over_a_fused_base_reads_the_host_once_per_step(ranks):
    """ZeroRedundancyOptimizer over fused AdamW (torch's found_inf): after its first two-pass
    step (which builds the exchange and takes the base's first step, read on the host), a
    step reads the host once, in perturb() (the exchange's sums); h_t's verdict is every
    rank's (one all_reduce, which blocks on gloo, not on NCCL, and carries ASAM's deferred
    diagnostics' sums) and reaches the base on the device.  It gives the one-process weights
    and diagnostics; a NaN in rank 0's h_t alone skips the step on both ranks, counted, and
    its diagnostics say so.  Split by hand with one rank holding no gradient for a while,
    the ranks decide alike (the model's devices, not the rank's part, decide)."""
    for rank in ranks:
        cases = rank["ZeRO over a fused base"]
        if isinstance(cases, str):
            pytest.skip(f"no CPU fused AdamW in this torch: {cases}")
        assert set(cases) == {"SAM", "VASSO", "GSAM", "V+G", "ASAM"}
        for kind, (error, steps, (diags, ref_diags), flagged, skipped, finite, hand_error) in cases.items():
            assert error <= 1e-5 and hand_error <= 1e-5, (kind, error, hand_error)
            assert all(step[1] for step in steps), kind
            for t, (waits, _, events, *_) in enumerate(steps[1:], start=1):
                assert events.count("read") == 1 and waits == 2, (kind, t, waits, events)
            assert sum(diags, []) == pytest.approx(sum(ref_diags, []), rel=1e-5, nan_ok=True), (kind, diags, ref_diags)
            assert flagged == 1.0 and skipped == 1 and finite, (kind, flagged, skipped, finite)


def test_low_precision_vasso_takes_the_norm_of_d_t_as_rounded(ranks):
    """VASSO with bf16 parameters (d_t rounded to bf16 after its update).  DDP's replicas
    decide on the device, as one process does: one wait per step after its first (the
    verdict: SGD cannot take torch's found_inf).  FSDP2 decides on the device too, its sums
    all-reduced (on gloo the host waits for them: twice per two-pass step).  ZeRO takes the
    host path: d_t is computed before the step's reduction and its norm rides along, so it
    waits twice per two-pass step, as fp32 does (after its first two-pass step, which
    builds the exchange).  Against one process in bf16 on the same path: ZeRO (every rank computing
    the whole batch's gradient, as one process does) gives its weights bit for bit; DDP and
    FSDP2 (whose gradients are averaged over the ranks in bf16) to bf16 rounding, with the
    one-process sharpness (a norm over one rank's shard would be ~30% short)."""
    for rank in ranks:
        for (setting, kind), (error, ref_sharpness, steps) in rank["bf16 VASSO"].items():
            if setting == "ZeRO":
                assert error == 0.0, (kind, error)
                first = next(i for i, step in enumerate(steps) if step[1])
                later = steps[first + 1:]
            else:
                assert error <= 1e-2, (kind, error)
                later = steps[1:] if setting == "DDP" else steps
            assert any(step[1] for step in later), (setting, kind)
            for waits, two_pass, events, *_ in later:
                expected = 1 if setting == "DDP" else two_pass_waits(setting, kind) if two_pass else 1
                assert waits == expected, (setting, kind, waits, two_pass, events)
            sharpness = [step[3] for step in steps]
            assert sharpness == pytest.approx(ref_sharpness, rel=1e-2, nan_ok=True), (setting, kind)
    for key, (error, _, steps) in ranks[0]["bf16 VASSO"].items():  # the same global values on both
        other_error, _, other = ranks[1]["bf16 VASSO"][key]
        assert error == other_error and [s[3] for s in steps] == pytest.approx([s[3] for s in other], nan_ok=True)


def test_a_parameter_whose_first_gradient_comes_later_costs_no_extra_wait(ranks):
    """A branch joins the forward at step 3 (a layer unfrozen mid-run): its parameters get
    their first gradient (VASSO's d_0 = g_0) beside parameters whose slopes are kept.
    Under FSDP2 that step is decided on the device (the newcomers start at d_0 = g_0 in the
    flat buffer, and its verdict is read once, as a first step's); under ZeRO its sums take
    the kept slopes into the one reduction: it waits as the others do, and every member
    gives the one-process weights.  Split
    by hand over partition_group with the branch on rank 1 alone, rank 1 holds no
    gradient before step 3 (it takes part with nothing of its own) and its set alone
    changes there (nothing collective hangs on it)."""
    from dist_cases import LATE

    for rank in ranks:
        for (setting, kind), (error, steps) in rank["late gradient"].items():
            assert error <= 1e-5, (setting, kind, error)
            with_grad = [step[4] for step in steps]
            assert with_grad == [4] * LATE + [6] * (len(steps) - LATE), (setting, kind, with_grad)
            # from step 1 (ZeRO's first two-pass step builds the exchange; FSDP2's is as the others)
            for t, (waits, two_pass, events, *_) in enumerate(steps[1:], start=1):
                assert two_pass and waits == two_pass_waits(setting, kind), (setting, kind, t, waits, events)


def test_zero_falls_back_to_sharing_for_another_model_and_abandons_on_an_exception(ranks):
    """Once perturb() moves the other owners' parameters itself: a second pass given
    another model than the exchange's shares them instead (the one-process weights),
    and an exception in the second pass puts every parameter back at x_t on every rank
    (the received ones exactly, the rank's own to the rounding of plain geometry's
    subtraction)."""
    for rank in ranks:
        for kind, (error, distance, idle) in rank["exchange fallbacks"].items():
            assert error <= 1e-6 and distance <= 1e-7 and idle, (kind, error, distance, idle)


def test_a_parameter_joining_one_ranks_optimizer_makes_every_rank_share_then_rebuild_the_exchange(ranks):
    """Split by hand, the exchange built at the first step: at step LATE a branch joins
    the forward and rank 1's optimizer (add_param_group on rank 1 alone).  Rank 1 cannot
    place its direction, says so in perturb()'s all_gather, and every rank shares the
    parameters and builds the exchange anew in second_pass() (rank 0 alone would keep the
    old one: its collectives would not match rank 1's); the run matches one process, and
    the next steps wait twice again."""
    from dist_cases import LATE

    for rank in ranks:
        for kind, (error, steps) in rank["late owner"].items():
            assert error <= 1e-5, (kind, error)
            assert [step[4] for step in steps] == [4] * LATE + [6] * (len(steps) - LATE), kind
            assert all(step[1] for step in steps), kind  # every step two-pass (p = 1)
            waits = [step[0] for step in steps]
            # the first step and step LATE set the exchange up (and share); the others wait twice
            assert waits[LATE] > 2 and waits[1:LATE] + waits[LATE + 1:] == [2] * (len(steps) - 2), (kind, waits)


# ------------------------------------------------------------------ mixed precision


def test_fsdp2_with_a_bf16_policy_takes_the_global_norm(ranks):
    """MixedPrecisionPolicy(bf16 parameters, fp32 reduction) against one process computing
    in bf16: the same updates and sharpness (rho ||g||) to bf16 rounding on both ranks; a
    norm over one rank's shard would be ~30% short."""
    for rank in ranks:
        for kind, (error, sharpness, reference) in rank["bf16"].items():
            assert error <= 2e-2, (kind, error)
            assert sharpness == pytest.approx(reference, rel=2e-2), kind
    assert ranks[0]["bf16"] == ranks[1]["bf16"]  # the same global values on both


def test_fsdp2_with_fp16_autocast_and_a_grad_scaler_skips_an_overflow_on_every_rank(ranks):
    """An overflow on rank 0 only, in the first pass of step 2 and the second pass of
    step 5: both ranks skip those steps and back the scale off as one process does."""
    for rank in ranks:
        fp16 = rank["fp16"]
        for kind, api in [k for k in fp16 if k[0] != "reference"]:
            error, taken, scales = fp16[(kind, api)]
            ref_taken, ref_scales = fp16[("reference", kind, api)]
            assert taken == ref_taken and scales == ref_scales, (kind, api)
            assert [t for t, ok in enumerate(taken) if not ok] == [2, 5], (kind, api)
            assert error <= 1e-2, (kind, api, error)
    assert ranks[0]["fp16"] == ranks[1]["fp16"]


@pytest.mark.parametrize("wrapper", ["ZeRO", "OSS"])
def test_zero_and_oss_under_a_grad_scaler_skip_an_overflow_on_every_rank(ranks, wrapper):
    """ZeroRedundancyOptimizer and fairscale's OSS (partition_group, over DDP) under
    GradScaler("cpu"), in both APIs (the explicit one finished by
    plugins.scaling.step_wrapper): an overflow on rank 0 only, in the first pass of step 2
    and the second pass of step 5, skips those steps on both ranks, counts each once, backs
    the scale off and leaves no step in flight, as one process under scaler.step(opt) does."""
    from dist_cases import SCALED_KINDS

    scaled = ranks[0]["ZeRO and OSS scaled"]
    if wrapper == "OSS" and ("OSS", "SAM", "closure") not in scaled:
        pytest.skip("fairscale is not installed")
    for rank in ranks:
        scaled = rank["ZeRO and OSS scaled"]
        for kind in SCALED_KINDS:
            for api in ("closure", "explicit"):
                error, taken, scales, in_flight, counted = scaled[(wrapper, kind, api)]
                ref_taken, ref_scales, ref_in_flight, ref_counted = scaled[("reference", kind, api)]
                assert (taken, scales) == (ref_taken, ref_scales), (kind, api)
                assert [t for t, ok in enumerate(taken) if not ok] == [2, 5], (kind, api)
                assert counted == ref_counted == 2, (kind, api)
                assert scales[2] < scales[1] and scales[5] < scales[4], (kind, api, scales)
                assert not in_flight and not ref_in_flight, (kind, api)
                assert error <= 1e-5, (kind, api, error)
    assert ranks[0]["ZeRO and OSS scaled"] == ranks[1]["ZeRO and OSS scaled"]


# ------------------------------------------------------------------ wrong use


@pytest.mark.parametrize("case, words", [
    ("hand-split", "pass partition_group="),
    ("zero without partition_group", "pass partition_group="),
    ("replicas with partition_group", "drop partition_group"),
    ("partition_group, no model", "step(closure, model=model)"),
    ("partition_group with DTensors", "partition_group must be None for DTensor"),
    ("Partial placement", "Shard and Replicate placements only"),
    ("partition_group=3", "partition_group must be a torch.distributed ProcessGroup"),
    ("loaded PartitionGroup", "holds no process group: pass the live group"),
    ("second pass outside second_pass", "ran outside second_pass(model, rng)"),
    ("first_step", "use step(closure, model=model), or perturb(), second_pass(model, rng)"),
])
def test_wrong_use_is_refused_with_what_to_pass(ranks, case, words):
    for rank in ranks:
        error = rank["refusals"][case]
        assert error is not None and error[0] in ("ValueError", "RuntimeError") and words in error[1], (case, error)
    for rank in ranks:  # refused before the weights moved, or put back
        assert rank["refusals"]["hand-split unmoved"] and rank["refusals"]["outside: unmoved"]


def test_ranks_with_models_of_their_own_name_a_group_of_one_rank(ranks):
    """The way out the hand-split error names: partition_group of this rank alone gives
    each rank the one-process step of its own model, bit for bit."""
    assert ranks[0]["refusals"]["own models"] and ranks[1]["refusals"]["own models"]


def test_a_partition_group_handle_survives_the_wrappers_state_dict(ranks):
    """ZeroRedundancyOptimizer copies partition_group into its param_groups; as a
    PartitionGroup it pickles (as its ranks, no live group)."""
    for rank in ranks:
        assert rank["refusals"]["PartitionGroup pickles"] == (True, True)


def test_unknown_tensor_types_and_an_uninitialized_group_are_refused():
    """One process: a tensor subclass other than DTensor, and partition_group without
    torch.distributed initialized."""
    from plugins import SAM

    class Tagged(torch.Tensor):
        pass

    weight = torch.nn.Parameter(torch.randn(3, 2).as_subclass(Tagged))
    weight.grad = torch.randn(3, 2)
    opt = SAM([weight], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="plain tensors and DTensors"):
        opt.perturb()
    assert not opt.in_flight
    with pytest.raises(ValueError, match="partition_group .*not initialized"):
        SAM(torch.nn.Linear(2, 1).parameters(), torch.optim.SGD, lr=0.1, partition_group=object())


def test_a_non_finite_g_or_h_on_one_rank_skips_the_step_on_every_rank(ranks):
    """FSDP2 decides on the device: g_t's finiteness comes from the all-reduced norm, and
    h_t's verdict is each rank's own until one all_reduce joins them, so a NaN in rank 0's
    part alone skips the step on both ranks (a rank that stepped would move its shard
    alone), ASAM's geometry included."""
    for rank in ranks:
        kinds = rank["one rank non-finite"]
        assert {"ASAM", "adaptive eVASSO"} <= set(kinds)
        for kind, (skipped, finite) in kinds.items():
            h_t = second_pass_coin(VARIANTS[kind][1].get("p", 1.0), 0, 2)  # (eVASSO's coin may skip step 2's pass)
            assert (skipped, finite) == (1 + h_t, True), kind
