"""Steps decided on the device (plugins/ondevice.py, docs/design.md, "Where a step is decided") against the
host path they replace: the same training up to float rounding, the same diagnostics, a
non-finite h_t skipped on the device with its warning arriving, and the layouts users have
(channels_last, a state dict saved and loaded mid-run, a parameter joining later)."""

import contextlib
import math
import operator
import warnings

import pytest
import torch

from plugins import SAM, VASSO
from plugins.perturbation import rng_state
from core_helpers import (Dispatched, backward_for, build, closure_for, coin_seed, cpu_scaler, first_backward, flat,
                          fused_adamw_on, make_batches, make_model)
from gpu_numerics import BIT_FOR_BIT, WITHIN_TOLERANCE, comparing

DIAGNOSTICS = ("two_pass", "ascent_norm", "sharpness", "stability", "loss_gap", "nonfinite", "rho")


def train(kind, path, steps=8, base=torch.optim.SGD, model=None, **kw):
    model = model or make_model(dropout=0.1)
    opt = build(kind, model.parameters(), base, lr=0.05, rho=0.2, **kw)
    opt._decide_on_device = path == "device"
    diags = []
    for x, y in make_batches(steps):
        opt.step(closure_for(opt, model, x, y), model=model)
        diags.append(dict(opt.diagnostics))
    return model, opt, diags


@pytest.mark.parametrize("exact_restore", [False, True])
@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eSAM", "eVASSO", "GSAM", "V+G", "ASAM", "adaptive eVASSO"])
def test_the_device_path_trains_as_the_host_path_does(kind, exact_restore):
    host_model, host_opt, host_diags = train(kind, "host", exact_restore=exact_restore)
    dev_model, dev_opt, dev_diags = train(kind, "device", exact_restore=exact_restore)
    assert dev_opt._lists.flat_slope is not None
    assert host_opt._lists.flat_slope is None  # the host path never made one
    if kind in ("eVASSO", "ASAM", "adaptive eVASSO"):  # the previous ascent flat too: their stabilities below
        assert dev_opt._lists.flat_previous_ascent is not None and host_opt._lists.flat_previous_ascent is None
    torch.testing.assert_close(flat(dev_model.parameters()), flat(host_model.parameters()), rtol=1e-5, atol=1e-6)
    for t, (a, b) in enumerate(zip(host_diags, dev_diags)):
        assert set(a) == set(b) == set(DIAGNOSTICS)
        for key in DIAGNOSTICS:
            if math.isnan(a[key]):
                assert math.isnan(b[key]), (t, key, a[key], b[key])
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (t, key)
    assert any(not math.isnan(d["stability"]) for d in dev_diags)


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "GSAM", "ASAM"])  # two passes every step
def test_the_first_steps_stability_is_known_on_the_host_to_be_undefined(kind):
    # the first step has no eps_{t-1}: its stability is the host's NaN, so that a logger (fairseq's
    # meters) skips it without reading the device; later steps leave theirs on the device, unread
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.05, rho=0.2)
    stabilities = []
    for x, y in make_batches(3):
        opt.step(closure_for(opt, model, x, y), model=model)
        stabilities.append(opt.diagnostics.unread()["stability"])
    assert isinstance(stabilities[0], float) and math.isnan(stabilities[0])
    assert all(torch.is_tensor(s) for s in stabilities[1:]), stabilities
    assert all(math.isfinite(float(s)) for s in stabilities[1:])


def alive_in_second_pass(opt, inner, watched):
    """One ``opt.step(closure)`` over the closure ``inner``: for each second pass, how many of
    the tensors ``watched()`` gives right after the first pass are still alive as it begins
    (weak references: the count holds none of them)."""
    import weakref

    refs, alive = [], []

    def closure():
        if opt.in_second_pass:
            alive.append(sum(r() is not None for r in refs))
        loss = inner()
        if not opt.in_second_pass:
            refs.extend(weakref.ref(t) for t in watched())
        return loss

    opt.step(closure)
    return alive


@pytest.mark.parametrize("kind", ["SAM", "VASSO"])
def test_the_buffers_the_flat_slope_replaces_are_freed_before_the_second_pass(kind):
    """The first step decided on the device moves the slope buffers into one flat tensor: the
    per-parameter buffers it replaces are gone before that step's second pass (held through
    it, they would add one model's size to the peak memory, as an H100 run showed)."""
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.05, rho=0.2)
    batches = make_batches(2)
    opt._decide_on_device = False
    opt.step(closure_for(opt, model, *batches[0]))  # the host path: per-parameter slope buffers
    opt._decide_on_device = True
    assert opt._lists.flat_slope is None
    alive = alive_in_second_pass(opt, closure_for(opt, model, *batches[1]),
                                 lambda: [opt._own_state[q]["slope"] for q in opt._lists.params])
    assert opt._lists.flat_slope is not None and alive == [0]


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eVASSO", "GSAM", "V+G", "ASAM"])
def test_gradients_of_another_dtype_are_decided_on_the_device(kind):
    """fp16 gradients on fp32 parameters (fairscale's FSDP under fairseq --fp16 on one GPU, as
    the H100 run met them): the step is decided on the device, its slope kept in the
    parameters' dtype, and it is the step given the same gradients as float32, bit for bit;
    GSAM's correction is written into ``.grad``, so with it (GSAM, V+G) the step is that one
    to fp16's rounding of the correction (after 4 steps: 1.8e-4 on weights of ~0.3)."""
    results = []
    for grad_dtype in (torch.float16, torch.float32):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        for q in model.parameters():
            if hasattr(q, "grad_dtype"):  # torch >= 2.10 checks a gradient's dtype unless told otherwise
                q.grad_dtype = None
        opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for _pass in range(2):
                try:
                    for q in model.parameters():
                        q.grad = torch.randn(q.shape, generator=gen).half().to(grad_dtype)
                except RuntimeError as exc:
                    pytest.skip(f"torch {torch.__version__} refuses a gradient of another dtype ({exc})")
                if _pass == 0 and not opt.perturb():
                    break
            opt.descend()
        assert opt._lists.flat_slope is not None and [f.dtype for f in opt._lists.flat_slope.flats] == [torch.float32]
        results.append(flat(model.parameters()))
    exact = kind not in ("GSAM", "V+G")
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0 if exact else 5e-4)
    assert exact or not torch.equal(results[0], results[1])  # the correction did round in fp16


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("api", ["closure", "explicit"])
@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eSAM", "eVASSO", "GSAM", "V+G", "ASAM"])
def test_steps_on_the_device_make_no_tensor_from_host_data(kind, api, scaled):
    """On a GPU a tensor made from host data (``torch.tensor``, an element assigned a Python
    float: ``aten::lift_fresh``) is a synchronizing copy; a read (``_local_scalar_dense``) is
    one too.  None in the steps decided on the device, the first two-pass one after steps the
    coin skipped included (eSAM's step 4: the H100 run's sync debug mode found one there), but
    for the one read of the step that makes the slope buffers: its verdict (a fused base makes
    its state before it looks at ``found_inf``, and a non-finite ``g_0`` must leave no slope)."""
    from plugins.lab.selftest.checks import protocol_step

    model = make_model()
    opt = build(kind, model.parameters(), fused_adamw_on("cpu"), lr=1e-2, rho=0.2, fused=True)
    scaler = cpu_scaler(init_scale=2.0 ** 8) if scaled else None  # the scaler's own calls included
    seen = []
    for t, (x, y) in enumerate(make_batches(8)):
        backward = backward_for(opt, model, x, y, api, scaler)
        with Dispatched("lift_fresh", "lift_fresh_copy", "_local_scalar_dense") as mode:
            protocol_step(opt, model, backward, api, scaler)
        if opt._lists.flat_slope is not None:  # made by the first step that keeps a slope
            seen.append((t, mode.seen))
    assert seen and seen[0][1] == ["_local_scalar_dense"] and all(s == [] for _, s in seen[1:]), seen


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eVASSO", "GSAM", "V+G", "ASAM"])
def test_no_first_gradient_is_held_through_the_second_pass(kind, path):
    """g_t lives on in the slope buffer (GSAM's correction reads it there, or in V+G's copy):
    the step holds no tensor of g_t through the second pass, whose backward is the peak
    of a step's memory (held, they added one model's size to it)."""
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.05, rho=0.2)
    opt._decide_on_device = path == "device"
    second_passes = 0
    for t, (x, y) in enumerate(make_batches(5)):
        alive = alive_in_second_pass(opt, closure_for(opt, model, x, y), lambda: [q.grad for q in model.parameters()])
        assert alive in ([0], []), (t, alive)  # []: eVASSO's coin skipped the second pass
        second_passes += len(alive)
    assert second_passes >= 2  # on the device path too (from the step after the first two-pass one)


def conv_net_and_batch(device: str = "cpu", channels_last: bool = True):
    """A small convolutional net and a batch of six 9x9 images; with ``channels_last`` the 4-D
    weights' storage order is not their logical order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
                                torch.nn.Flatten(), torch.nn.Linear(100, 5))
    x, y = torch.randn(6, 3, 9, 9), torch.randint(0, 5, (6,))
    if channels_last:
        model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    return model.to(device), x.to(device), y.to(device)


def assert_moved_along(params, before, slopes, rho: float) -> None:
    """Each parameter sits at its ``x_t`` plus ``rho * v / ||v||`` of its own slope ``v``."""
    norm = torch.linalg.vector_norm(torch.cat([v.flatten() for v in slopes]))
    for q, x0, v in zip(params, before, slopes):
        torch.testing.assert_close(q.detach() - x0, rho * v / norm, rtol=1e-4, atol=1e-6)


def test_flat_slope_buffers_keep_channels_last():
    model, x, y = conv_net_and_batch()
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) and not model[0].weight.is_contiguous()
    opt = VASSO(model.parameters(), torch.optim.SGD, lr=0.1, rho=0.1)
    for _ in range(3):
        opt.step(closure_for(opt, model, x, y))
    views = opt._lists.flat_slope.views
    for q, v in zip(opt._lists.params, views):
        assert v.shape == q.shape and v.stride() == q.stride()
        assert opt.state[q]["sam_slope"] is v  # the buffers are the flat tensor's views
    assert all(v.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr() for v in views)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["ASAM", "adaptive eVASSO"])
@comparing(WITHIN_TOLERANCE)  # two paths through convolutions, to 1e-5: the same gradients, TF32 off
def test_asams_geometry_on_the_device_scales_each_element_by_its_own_weight_channels_last_too(kind, device):
    """ASAM's ``T = |x| + eta`` is made over a flat buffer from the parameters' storage-order
    views: element for element it must scale the slope element it belongs to, channels_last
    weights (whose storage order is not their logical order) included, and 1 on the biases.
    The same run on the host path (per tensor, logical order) gives the same parameters."""
    runs = {}
    for path in ("host", "device"):
        torch.manual_seed(0)
        model, x, y = conv_net_and_batch(device)
        opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.1)
        opt._decide_on_device = path == "device"
        for _ in range(6):
            opt.step(closure_for(opt, model, x, y))
        assert (opt._lists.flat_slope is not None) == (path == "device")
        runs[path] = flat(model.parameters())
    torch.testing.assert_close(runs["device"], runs["host"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["SAM", "VASSO"])
@comparing(WITHIN_TOLERANCE)  # the ascent against rho v / ||v|| from the same slopes, to 1e-4: TF32 off
def test_the_ascent_moves_each_parameter_along_its_own_slope_channels_last_too(kind, device):
    """The ascent's product is made over the flat slope buffer and added through the
    parameters' 1-D views in storage order (plugins.ondevice.storage_views, Flat.split):
    element for element it lands on the parameter it belongs to, channels_last weights
    (whose storage order is not their logical order) included, and descend() undoes it."""
    model, x, y = conv_net_and_batch(device)
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.1)
    for _ in range(2):  # the first step makes the slope buffers, the second the flat one
        opt.step(closure_for(opt, model, x, y))
    first_backward(model, x, y)
    before = [q.detach().clone() for q in model.parameters()]
    assert opt.perturb() and opt._lists.flat_slope is not None
    assert_moved_along(model.parameters(), before, [opt.state[q]["sam_slope"] for q in model.parameters()], 0.1)
    opt.restore()
    for q, x0 in zip(model.parameters(), before):
        torch.testing.assert_close(q.detach(), x0, rtol=0, atol=1e-6)
    opt.abandon()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["SAM", "VASSO", "GSAM"])
@comparing(BIT_FOR_BIT)  # two runs of 4 steps through convolutions, torch.equal: cuDNN deterministic
def test_the_restore_from_one_flat_product_is_the_per_tensor_restore_bit_for_bit(kind, device, monkeypatch):
    """On a GPU the restore makes the ascent's product in one kernel over the flat slope and
    takes it back through the parameters' storage-order views; on the CPU it goes per tensor
    (plugins.ondevice.flat_scratch_is_cheap).  Either way the same parameters, element for
    element, channels_last weights included, step after step, and no product per tensor."""
    from plugins import ondevice

    runs = {}
    for flat_product in (False, True):
        monkeypatch.setattr(ondevice, "flat_scratch_is_cheap", lambda t, flat_product=flat_product: flat_product)
        model, x, y = conv_net_and_batch(device)
        opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.1)
        products = []
        real_mul = torch._foreach_mul

        def counting_mul(*a, **k):
            products.append(len(a[0]))
            return real_mul(*a, **k)

        monkeypatch.setattr(torch, "_foreach_mul", counting_mul)
        for _ in range(4):
            opt.step(closure_for(opt, model, x, y))
        monkeypatch.setattr(torch, "_foreach_mul", real_mul)
        assert opt._lists.flat_slope is not None
        runs[flat_product] = (flat(model.parameters()), products)
    assert torch.equal(runs[True][0], runs[False][0])
    # GSAM's correction multiplies per tensor on either path; the restores of the four steps,
    # all decided on the device, only per tensor
    assert len(runs[False][1]) - len(runs[True][1]) == 4


@pytest.mark.parametrize("flat_restore", [False, True], ids=["cpu-restore", "gpu-restore"])
@pytest.mark.parametrize("kind", ["SAM", "VASSO"])
def test_the_step_makes_no_view_per_tensor_and_holds_no_scratch_between_uses(kind, flat_restore, monkeypatch):
    """The ascent's product (and, on a GPU, the restore's) goes through views of one scratch
    tensor made once (plugins.ondevice.Flat.scratch): a steady step dispatches no split, whose
    view per tensor costs host time that a host-bound model pays, and the scratch's storage is
    allocated only inside perturb() and the restore, as the product it replaces was: empty
    through the second pass, the peak of a step's memory, and between steps."""
    from plugins import ondevice

    monkeypatch.setattr(ondevice, "flat_scratch_is_cheap", lambda t: flat_restore)
    model, x, y = conv_net_and_batch()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.1, rho=0.1)
    for _ in range(2):  # the first step makes the slope buffers, the second the flat one and its scratch
        opt.step(closure_for(opt, model, x, y))
    (scratch,) = opt._lists.flat_slope._scratch  # one dtype: one flat tensor
    assert scratch.untyped_storage().nbytes() == 0
    storage_sizes = []

    def closure():
        storage_sizes.append(scratch.untyped_storage().nbytes())  # first pass, then second pass
        return closure_for(opt, model, x, y)()

    for _ in range(3):
        before = flat(model.parameters())
        with Dispatched("split", "split_with_sizes") as mode:
            opt.step(closure)
        assert mode.seen == [], mode.seen
        assert not torch.equal(flat(model.parameters()), before)
        assert scratch.untyped_storage().nbytes() == 0
    assert storage_sizes == [0] * 6
    assert opt._lists.flat_slope._scratch[0] is scratch


def test_parameters_whose_data_are_replaced_get_new_flat_buffers():
    """``module.to(memory_format=...)`` replaces each 4-D weight's ``.data`` (the same Parameter,
    other strides, other storage): the cached lists, the flat buffer that mirrors the strides and
    the 1-D aliases of the storage must not be found again, or the ascent would go to the old
    storage; the slopes carry over, value for value."""
    model, x, y = conv_net_and_batch(channels_last=False)
    opt = VASSO(model.parameters(), torch.optim.SGD, lr=0.1, rho=0.1)
    for _ in range(2):
        opt.step(closure_for(opt, model, x, y))
    old = opt._lists
    slopes = [opt.state[q]["sam_slope"].clone() for q in model.parameters()]
    model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    first_backward(model, x, y)
    before = [q.detach().clone() for q in model.parameters()]
    assert opt.perturb()
    assert opt._lists is not old and opt._lists.flat_slope is not None
    kept = [opt.state[q]["sam_slope"] for q in model.parameters()]
    assert kept[0].stride() == model[0].weight.stride()
    d = [0.6 * s + 0.4 * q.grad for s, q in zip(slopes, model.parameters())]  # d_t from the slopes carried over
    assert_moved_along(model.parameters(), before, d, 0.1)
    opt.abandon()


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eVASSO", "ASAM", "adaptive eVASSO"])
def test_a_state_dict_saved_mid_run_resumes_on_the_device_path(kind, tmp_path):
    """The slope buffers are views of one flat tensor: saved and loaded as any state, and made
    flat again by the first step after the load; the resumed run continues bit for bit."""
    model, opt, _ = train(kind, "device", steps=3)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()},
               tmp_path / "ckpt.pt")
    rest = make_batches(6)[3:]
    for x, y in rest:
        opt.step(closure_for(opt, model, x, y), model=model)
    saved = torch.load(tmp_path / "ckpt.pt")
    model2 = make_model(dropout=0.1)
    model2.load_state_dict(saved["model"])
    opt2 = build(kind, model2.parameters(), torch.optim.SGD, lr=0.05, rho=0.2)
    opt2.load_state_dict(saved["opt"])
    torch.set_rng_state(saved["rng"])  # the same dropout masks
    for x, y in rest:
        opt2.step(closure_for(opt2, model2, x, y), model=model2)
    assert opt2._lists.flat_slope is not None
    assert torch.equal(flat(model2.parameters()), flat(model.parameters()))
    assert opt2.state_dict()["state"][0]["sam_counters"] == opt.state_dict()["state"][0]["sam_counters"]


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop base", "fused base"])
def test_a_nonfinite_second_gradient_is_skipped_on_the_device(fused):
    model = make_model()
    base, kw = (fused_adamw_on("cpu"), dict(fused=True)) if fused else (torch.optim.AdamW, {})
    opt = SAM(model.parameters(), base, lr=0.05, rho=0.2, **kw)
    batches = make_batches(3)
    opt.step(closure_for(opt, model, *batches[0]))
    opt.step(closure_for(opt, model, *batches[1]))  # decided on the device from here
    before = flat(model.parameters())
    base_state = {k: v.clone() for k, v in opt.base_optimizer.state[next(iter(model.parameters()))].items()}
    rng = rng_state()
    x, y = batches[2]
    opt.zero_grad()
    first_backward(model, x, y)
    assert opt.perturb()
    opt.zero_grad()
    with opt.second_pass(model, rng):
        first_backward(model, x, y)
    model[0].weight.grad[1, 2] = float("inf")
    with pytest.warns(RuntimeWarning, match="non-finite second-pass gradient at step 3"):
        taken = opt.descend()
        assert opt.nonfinite_steps == 1
    assert taken is (None if fused else False)
    torch.testing.assert_close(flat(model.parameters()), before, rtol=0, atol=1e-6)  # back at x_t, no base step
    after = opt.base_optimizer.state[next(iter(model.parameters()))]
    assert all(torch.equal(base_state[k], after[k]) for k in base_state)
    diag = dict(opt.diagnostics)
    assert diag["two_pass"] == 1.0 and math.isfinite(diag["ascent_norm"])  # the ascent was made
    # the next finite step trains again, with no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(closure_for(opt, model, *batches[0]))
    assert opt.nonfinite_steps == 1 and not torch.equal(flat(model.parameters()), before)


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_a_parameter_that_joins_later_is_decided_on_the_device(nonfinite):
    """A set of parameters with a gradient that grows (a frozen layer unfrozen) is decided on
    the device at once: the newcomer gets d_0 = g_0 while the others' slopes average on.  A
    non-finite gradient at the join skips the step and leaves the newcomer no slope (one host
    read, as a first step's), so that the next step starts it at d_0 = g_0."""
    model = make_model()
    first = list(model.parameters())[0]
    first.requires_grad_(False)
    opt = VASSO(model.parameters(), torch.optim.SGD, lr=0.05, rho=0.2)
    batches = make_batches(4)
    for x, y in batches[:2]:
        opt.step(closure_for(opt, model, x, y))
    assert opt._lists.flat_slope is not None and all(q is not first for q in opt._lists.params)
    kept = {q: opt.state[q]["sam_slope"].clone() for q in opt._lists.params}
    first.requires_grad_(True)

    def explicit_step(x, y, poisoned: bool):
        """One step of the explicit API: (the newcomer's g_t, the others' g_t, descend()'s answer)."""
        rng = rng_state()
        opt.zero_grad()
        first_backward(model, x, y)
        if poisoned:
            first.grad[0, 0] = math.inf
        g0, grads = first.grad.clone(), {q: q.grad.clone() for q in kept}
        assert opt.perturb()  # decided on the device: the coin's answer, whatever g_t holds
        assert opt._lists.flat_slope is not None and any(q is first for q in opt._lists.params)
        opt.zero_grad()
        with opt.second_pass(model, rng):
            first_backward(model, x, y)
        return g0, grads, opt.descend()

    with (pytest.warns(RuntimeWarning, match="non-finite first-pass gradient at step 3; the step is skipped")
          if nonfinite else contextlib.nullcontext()):
        g0, grads, stepped = explicit_step(*batches[2], nonfinite)
    assert stepped is (not nonfinite)
    if nonfinite:
        assert opt.state[first]["sam_held"]["slope"] == 0  # (its sam_slope reads as a zero placeholder)
        assert all(torch.equal(opt.state[q]["sam_slope"], d) for q, d in kept.items())  # d_{t-1} kept
        g0, grads, stepped = explicit_step(*batches[3], False)
        assert stepped
    assert torch.equal(opt.state[first]["sam_slope"], g0)  # d_0 = g_0
    for q, d in kept.items():
        assert torch.equal(opt.state[q]["sam_slope"], torch.lerp(d, grads[q], opt.theta))  # eq. (5a) on
    assert opt._lists.flat_slope is not None and any(q is first for q in opt._lists.params)


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eVASSO", "ASAM"])
def test_parameters_left_out_of_a_step_keep_no_earlier_flat_buffer_alive(kind):
    """LayerDrop-style training: each step a different subset of blocks gets a gradient, and
    each new set gets a flat slope buffer of its own.  The slopes of the parameters left out
    keep their values, in buffers of their own: as views they would keep an earlier flat
    buffer alive, up to one more model's size of state per change of the set."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
    opt = build(kind, blocks.parameters(), torch.optim.SGD, lr=0.05, rho=0.2)
    x = torch.randn(5, 8)
    model_bytes = sum(q.numel() * q.element_size() for q in blocks.parameters())
    for t, used in enumerate(([0, 1, 2, 3], [0, 1, 2, 3], [0, 1], [1, 2, 3], [0, 3], [0, 1, 2, 3], [2])):
        def closure():
            h = x
            for i in used:
                h = torch.tanh(blocks[i](h))
            loss = h.square().mean()
            loss.backward()
            return loss
        left_out = [q for i in range(4) if i not in used for q in blocks[i].parameters()]
        kept = [opt.state[q]["sam_slope"].clone() for q in left_out if "sam_slope" in opt.state[q]]
        opt.zero_grad(set_to_none=True)
        opt.step(closure)
        assert opt._lists.flat_slope is not None  # the device path from the first step, every set
        assert all(torch.equal(opt.state[q]["sam_slope"], k) for q, k in zip(left_out, kept))
        for key in ("slope", "previous_ascent"):  # (eVASSO's previous ascent: from its first two-pass step)
            storages = {}
            for q in blocks.parameters():
                s = opt._own_state[q].get(key)
                if s is not None:
                    storages[s.untyped_storage().data_ptr()] = s.untyped_storage().nbytes()
            assert sum(storages.values()) == (model_bytes if storages or key == "slope" else 0), (key, used)
        if kind == "eVASSO" and t > 1:
            assert opt._lists.flat_previous_ascent is not None or not opt.diagnostics["two_pass"]


def test_a_checkpoint_loaded_over_a_skipped_step_keeps_its_own_count():
    """Rolling back to a checkpoint right after a skipped step (a fused base: the verdict is
    still on its way to the host): the skip belongs to the run left behind, warned about at the
    load, and the loaded run counts from the checkpoint's number."""
    model = make_model()
    opt = SAM(model.parameters(), fused_adamw_on("cpu"), lr=0.05, rho=0.2, fused=True)
    batches = make_batches(4)
    for x, y in batches[:3]:
        opt.step(closure_for(opt, model, x, y))
    saved = opt.state_dict()
    assert saved["state"][0]["sam_counters"]["nonfinite_steps"] == 0

    def diverging():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batches[3][0]), batches[3][1]) * math.inf
        loss.backward()
        return loss
    opt.step(diverging)
    with pytest.warns(RuntimeWarning, match="non-finite first-pass gradient at step 4"):
        opt.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.nonfinite_steps == 0 and opt.num_steps == 3
        opt.step(closure_for(opt, model, *batches[0]))
    assert opt.nonfinite_steps == 0


def test_a_flat_scratch_serves_one_use_at_a_time():
    """Flat.scratch's views are made once and outlive its storage, which exists only inside the
    block: a nested use, which would free the outer's storage on leaving, is refused.  Tensors
    of several dtypes get one flat tensor each, their pieces in Flat.order."""
    from plugins import ondevice

    like = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(2, 2).t()]
    flat = ondevice.Flat(like)
    assert flat.order == [0, 2, 1] and [f.dtype for f in flat.flats] == [torch.float32, torch.float64]
    assert [v.stride() for v in flat.views] == [t.stride() for t in like]
    with flat.scratch() as (tensors, pieces):
        assert [p.numel() for p in pieces] == [3, 4, 2]
        assert [t.untyped_storage().nbytes() for t in tensors] == [28, 16]
        with pytest.raises(RuntimeError, match="already in use"):
            with flat.scratch():
                pass
        tensors[0].copy_(torch.arange(7.0))
        assert pieces[1].tolist() == [3.0, 4.0, 5.0, 6.0]
    assert [t.untyped_storage().nbytes() for t in tensors] == [0, 0]
    with flat.scratch() as (again, pieces_again):
        assert all(map(operator.is_, again, tensors)) and all(map(operator.is_, pieces_again, pieces))
        assert again[0].untyped_storage().nbytes() == 28


@pytest.mark.two_gpus  # on one GPU: reported as not run, with the reason (tests/helpers/gpu_marker.py)
def test_a_flat_scratch_stays_on_its_own_gpu_whichever_is_current():
    """Some torch versions resize a CUDA storage on the current device (and re-label it there
    at size 0): the scratch of tensors on cuda:1 must stay on cuda:1 while cuda:0 is current."""
    from plugins import ondevice

    flat = ondevice.Flat([torch.zeros(5, device="cuda:1"), torch.zeros(3, device="cuda:1")])
    with torch.cuda.device(0):
        for _ in range(2):
            with flat.scratch() as ((tensor,), pieces):
                tensor.copy_(torch.arange(8.0, device="cuda:1"))
                assert tensor.untyped_storage().device == torch.device("cuda:1")
                assert pieces[1].tolist() == [5.0, 6.0, 7.0]
    # and a whole run there: the steps decided on the device, a skipped one's verdict read from cuda:1
    model = make_model().to("cuda:1")
    opt = VASSO(model.parameters(), torch.optim.AdamW, lr=0.05, rho=0.2, fused=True)
    with torch.cuda.device(0):
        for i, (x, y) in enumerate(make_batches(4)):
            x, y = x.to("cuda:1"), y.to("cuda:1")
            if i < 3:
                opt.step(closure_for(opt, model, x, y))
                continue
            first_backward(model, x, y)
            model[0].weight.grad[0, 0] = float("nan")
            opt.perturb()
            opt.descend()
    assert opt._lists.flat_slope is not None and torch.isfinite(flat(model.parameters())).all()
    with pytest.warns(RuntimeWarning, match="non-finite first-pass gradient at step 4"):
        assert opt.nonfinite_steps == 1


@pytest.mark.parametrize("finish", ["descend", "abandon"])
@pytest.mark.parametrize("kind", ["VASSO", "eVASSO"])
def test_a_nonfinite_first_gradient_leaves_no_slope_and_the_next_step_starts_d_0(kind, finish):
    """The first step is decided on the device: it makes the flat slope buffer and averages g_0
    into it with weight 1.  Where g_0 is not finite, nothing moves and no slope is left, whether
    the step finishes (its verdict is read) or is abandoned; the next step starts d_0 = g_1,
    exactly, as the host path does."""
    model = make_model()
    opt = build(kind, model.parameters(), torch.optim.SGD, lr=0.05, rho=0.2, seed=coin_seed(0.5, skipped=0))
    before = flat(model.parameters())
    (x0, y0), (x1, y1) = make_batches(2)
    rng = rng_state()
    first_backward(model, x0, y0)
    model[0].weight.grad[0, 0] = float("nan")
    assert opt.perturb()  # the coin: the second pass is asked for, nothing moved
    assert opt._lists.flat_slope is not None and torch.equal(flat(model.parameters()), before)
    if finish == "descend":
        opt.zero_grad()
        with opt.second_pass(model, rng):
            first_backward(model, x0, y0)
        with pytest.warns(RuntimeWarning, match="non-finite first-pass gradient at step 1"):
            assert opt.descend() is False
    else:
        opt.abandon()
    assert torch.equal(flat(model.parameters()), before)
    assert opt._lists.flat_slope is None and all(opt.state[q]["sam_held"]["slope"] == 0 for q in model.parameters())
    first_backward(model, x1, y1)
    g1 = [q.grad.clone() for q in model.parameters()]
    opt.perturb()
    assert all(torch.equal(opt.state[q]["sam_slope"], g) for q, g in zip(model.parameters(), g1))  # d_0 = g_1
    opt.abandon()
