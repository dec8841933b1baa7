"""Every fairseq precision mode a GPU user picks, on a CPU.

--fp16 --fp16-no-flatten-grads runs through fairseq-train on a CPU as it is and stays
close to fp32.  --amp, flattened --fp16 and --memory-efficient-fp16 run fairseq's own
Trainer, FP16Optimizer, MemoryEfficientFP16Optimizer and AMPOptimizer with four
device checks patched (the ``cpu_half_precision`` fixture, tests/fairseq/conftest.py),
with real fp16 overflows, each beside stock --optimizer adam in the same harness.

Overflow in the first pass: the update is skipped before d_t changes, the loss
scale backs off once, as in stock fairseq.  Overflow in the second pass: x_t is
restored bit for bit, the update skipped, the scale backs off once.  --amp unscales
h_t once (stock fairseq 0.12 twice).  A non-finite gradient in fp32 raises fairseq's
FloatingPointError with the parameters back at x_t.  Refused modes."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

import contextlib
import math

import torch

FP16 = ["--fp16", "--fp16-no-flatten-grads"]
#: fairseq's loss-scaled precision modes, as flags; on a CPU they run with the
#: ``cpu_half_precision`` fixture (tests/fairseq/conftest.py: the device checks it patches)
PRECISION_MODES = {
    "amp": ["--amp"],
    "fp16": ["--fp16"],  # fairseq's default: one flat fp32 master vector
    "memory_efficient_fp16": ["--fp16", "--memory-efficient-fp16"],
}


def test_fp16_runs_close_to_fp32(toy_data, tmp_path, fs):
    extra = ["--rho", "0.1", "--no-save"]
    fp32 = fs.train(fs.model_args(toy_data, tmp_path / "fp32", extra=extra))
    fp16 = fs.train(fs.model_args(toy_data, tmp_path / "fp16", extra=extra + FP16))
    assert len(fp16.losses()) == len(fp32.losses()) == 8
    for a, b in zip(fp16.losses(), fp32.losses()):
        assert abs(a - b) < 0.02
    for a, b in zip(fp16.inner(), fp32.inner()):
        assert float(a["loss_scale"]) > 0
        assert abs(float(a["sharpness"]) - float(b["sharpness"])) < 1e-2 * float(b["sharpness"])
        assert float(a["ascent_norm"]) == pytest.approx(0.1, rel=1e-3)


# ------------------------------------------------------------------ real overflows, every loss-scaled mode

INIT_SCALE = 2 ** 20  # this model's fp16 backward overflows above about 2**10: a burst of real overflows
#: fairseq 0.12's AMPOptimizer takes its growth interval from --amp-init-scale when
#: --amp-scale-window is given (its own slip): 4 makes the CPU scaler grow back every
#: 4 updates, so --amp also overflows again mid-run, as --fp16 does with --fp16-scale-window 4
SCALE_GROWTH = {"amp": ["--amp-scale-window", "4", "--amp-init-scale", "4"],
                "fp16": ["--fp16-scale-window", "4"], "memory_efficient_fp16": ["--fp16-scale-window", "4"]}


def overflow_run(fs, data, save_dir, mode, optimizer, extra=()):
    flags = PRECISION_MODES[mode] + SCALE_GROWTH[mode] + ["--fp16-init-scale", str(INIT_SCALE), "--no-save"]
    if optimizer != "adam":
        flags += ["--rho", "0.1"]
    else:  # the same harness without our optimizer's own flags
        extra = [a for a in extra if a != "--adaptive"]
    return fs.train(fs.model_args(data, save_dir, optimizer=optimizer, max_update=12, extra=flags + list(extra)))


def scale_history(fs, run):
    """(scale in force, scale announced) for each overflow, in order, and the scale the
    last update logged; the scale in force is followed through fairseq's own log lines
    (the announced scale after an overflow, the logged ``loss_scale`` after an update)."""
    current, pairs = float(INIT_SCALE), []
    for name, msg in run.records:
        announced = fs.overflow_scales(type(run)([(name, msg)], run.save_dir))
        if announced:
            pairs.append((current, announced[0]))
            current = announced[0]
        elif name == "train_inner" and msg.startswith("{"):
            current = float(__import__("json").loads(msg)["loss_scale"])
    return pairs, current


def first_burst(run):
    """The overflows announced before the first update."""
    out = []
    for name, msg in run.records:
        if name == "train_inner":
            break
        out.append((name, msg))
    return type(run)(out, run.save_dir)


@pytest.mark.parametrize("mode", ["amp", "fp16", "memory_efficient_fp16"])
def test_stock_adam_overflows_for_real(toy_data, tmp_path, fs, cpu_half_precision, mode):
    """The harness itself: stock --optimizer adam meets real fp16 overflows in every
    loss-scaled mode, and fairseq handles each one (skip, back off once, log)."""
    run = overflow_run(fs, toy_data, tmp_path, mode, "adam")
    pairs, last = scale_history(fs, run)
    burst = len(fs.overflow_scales(first_burst(run)))
    assert burst >= 10 and len(pairs) > burst  # a burst at the start, and more once the scale grew back
    assert all(announced == in_force / 2 for in_force, announced in pairs)  # backed off once each time
    assert float(run.inner()[-1]["loss_scale"]) == last
    assert int(run.inner()[-1]["num_updates"]) == 12
    losses = run.losses()
    assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) / 3 < losses[0] - 0.5


_ADAM_RUNS = {}  # (mode, extra flags) -> stock adam's run (the same harness, run once per mode)


def _last_loss(run):
    return sum(run.losses()[-3:]) / 3


ACCUMULATE_AND_CLIP = ("--update-freq", "2", "--clip-norm", "0.5")


@pytest.mark.parametrize("mode, optimizer, extra", [
    *[(mode, optimizer, ()) for mode in PRECISION_MODES for optimizer in ("vasso", "sam")],
    ("amp", "vasso", ACCUMULATE_AND_CLIP),
    ("fp16", "sam", ACCUMULATE_AND_CLIP),
    # ASAM: anchors restore x_t, the diagnostics stay device tensors until fairseq logs
    ("amp", "sam", ("--adaptive",)),
    ("memory_efficient_fp16", "vasso", ("--adaptive",)),
])
def test_overflows_handled_as_stock_adam(toy_data, tmp_path, fs, cpu_half_precision, mode, optimizer, extra):
    """--optimizer vasso|sam in each loss-scaled mode, with real overflows, beside stock
    adam in the same harness (also with --update-freq and --clip-norm): every overflow
    skips the update and backs the scale off once, logged by fairseq's own lines; the
    model learns as adam's does; the diagnostics are those of a two-pass step at rho 0.1."""
    if (mode, extra) not in _ADAM_RUNS:
        _ADAM_RUNS[mode, extra] = overflow_run(fs, toy_data, tmp_path / "adam", mode, "adam", extra)
    adam = _ADAM_RUNS[mode, extra]
    run = overflow_run(fs, toy_data, tmp_path / optimizer, mode, optimizer, extra)
    pairs, last = scale_history(fs, run)
    burst = fs.overflow_scales(first_burst(run))
    assert burst == fs.overflow_scales(first_burst(adam))  # x_0, the same first batch: the same overflows
    assert len(burst) >= 10 and len(pairs) > len(burst)  # and more mid-run, once the scale grew back
    assert all(announced == in_force / 2 for in_force, announced in pairs)  # backed off once each time
    assert float(run.inner()[-1]["loss_scale"]) == last
    assert int(run.inner()[-1]["num_updates"]) == 12
    losses = run.losses()
    assert all(math.isfinite(x) for x in losses) and _last_loss(run) < losses[0] - 0.5
    assert abs(_last_loss(run) - _last_loss(adam)) < 0.3, (run.losses(), adam.losses())
    for i, line in enumerate(run.inner()):  # every update was a two-pass one
        assert float(line["two_pass"]) == 1.0
        if "--adaptive" in extra:  # ||rho T^2 v / ||T v|| || is not rho
            assert 0 < float(line["ascent_norm"]) < 1
        else:
            assert float(line["ascent_norm"]) == pytest.approx(0.1, rel=1e-3)
        assert float(line["sharpness"]) > 0 and math.isfinite(float(line["loss_gap"]))
        assert math.isfinite(float(line["stability"])) == (i > 0)  # none before the second ascent


# ------------------------------------------------------------------ unit level: one Trainer


def _trainer(fs, data, save_dir, optimizer, extra):
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    argv = fs.model_args(data, save_dir, optimizer=optimizer, extra=["--dropout", "0.1", *extra])
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("valid")
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    itr = task.get_batch_iterator(dataset=task.dataset("valid"), max_tokens=4000, max_sentences=20,
                                  required_batch_size_multiple=1, seed=1).next_epoch_itr(shuffle=False)
    return trainer, [next(itr)]


def _inner(opt):
    """Our (or stock adam's) fairseq optimizer inside fairseq's precision wrapper."""
    return getattr(opt, "fp32_optimizer", None) or getattr(opt, "wrapped_optimizer", opt)


def _scale(opt):
    """The loss scale: DynamicLossScaler's (--fp16 modes) or the GradScaler's (--amp)."""
    scaler = opt.scaler
    return scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.loss_scale


def _set_scale(opt, value):
    if hasattr(opt.scaler, "get_scale"):
        opt.scaler.update(value)  # GradScaler's public way to set the scale
    else:
        opt.scaler.loss_scale = value


def _snapshot(trainer):
    opt = trainer.optimizer
    inner = _inner(opt)
    core = inner.optimizer
    base = getattr(core, "base_optimizer", core)
    params16 = [p.detach().clone() for p in trainer.model.parameters()]
    params32 = [p.detach().clone() for p in inner.params]  # the params the optimizer steps
    slope = [core.state[p]["sam_slope"].clone() for p in inner.params if "sam_slope" in core.state[p]]
    adam = [base.state[p]["exp_avg"].clone() for p in inner.params if "exp_avg" in base.state[p]]
    return {"p16": params16, "p32": params32, "slope": slope, "adam": adam,
            "steps": getattr(core, "num_steps", None),
            "updates": trainer.get_num_updates(), "scale": _scale(opt) if hasattr(opt, "scaler") else None}


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@contextlib.contextmanager
def _wrapped_task_step(trainer, before=None, after=None):
    """Call ``before(n)`` / ``after(n)`` around the n-th call (1-based) of
    ``task.train_step`` (1: the first pass, 2: the second); yields the list of calls."""
    task = trainer.task
    stock = task.train_step
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if before is not None:
            before(len(calls))
        out = stock(*args, **kwargs)
        if after is not None:
            after(len(calls))
        return out

    task.train_step = wrapped
    try:
        yield calls
    finally:
        del task.train_step


def _poisoned_gradient(trainer, on_call, value):
    """Fill one parameter's gradient with ``value`` after the ``on_call``-th pass."""
    def poison(n):
        if n == on_call:
            next(trainer.model.parameters()).grad.fill_(value)
    return _wrapped_task_step(trainer, after=poison)


def _real_overflow(trainer, on_call, scale=2.0 ** 60):
    """Raise the loss scale to ``scale`` just before the ``on_call``-th pass: its fp16
    backward then overflows for real."""
    def raise_scale(n):
        if n == on_call:
            _set_scale(trainer.optimizer, scale)
    return _wrapped_task_step(trainer, before=raise_scale)


#: the unit-level modes: the three of the end-to-end runs, and --fp16 with per-parameter masters
UNIT_MODES = {**PRECISION_MODES, "fp16_no_flatten": ["--fp16", "--fp16-no-flatten-grads"]}


def _mode_trainer(fs, data, tmp_path, mode, optimizer, extra=()):
    flags = UNIT_MODES[mode] + (["--amp-batch-retries", "0"] if mode == "amp" else [])  # skip, do not retry
    return _trainer(fs, data, tmp_path, optimizer, flags + ["--rho", "0.1"] * (optimizer != "adam") + list(extra))


@pytest.mark.parametrize("optimizer", ["vasso", "sam", "adam"])
@pytest.mark.parametrize("mode", list(UNIT_MODES))
def test_real_overflow_on_first_pass(toy_data, tmp_path, fs, cpu_half_precision, mode, optimizer):
    trainer, samples = _mode_trainer(fs, toy_data, tmp_path, mode, optimizer)
    assert trainer.train_step(samples) is not None  # one good update: d_t and Adam moments exist
    before = _snapshot(trainer)
    with _real_overflow(trainer, on_call=1) as calls:  # the scaled loss overflows fp16 in backward
        assert trainer.train_step(samples) is None  # fairseq: overflow, update skipped
    # no second pass; under --amp the core decides on the device (no host read of g_t's
    # finiteness: the scaler's verdict joins its own there), so the pass runs, at x_t, and is
    # lost with the step (docs/design.md, "Where a step is decided")
    assert len(calls) == (2 if mode == "amp" and optimizer != "adam" else 1)
    after = _snapshot(trainer)
    assert after["updates"] == before["updates"] == 1
    assert after["scale"] == 2.0 ** 59  # backed off once, by fairseq's factor, as stock
    assert _same(after["p16"], before["p16"]) and _same(after["p32"], before["p32"])
    assert _same(after["adam"], before["adam"])
    if optimizer == "vasso":
        assert _same(after["slope"], before["slope"]) and before["slope"]  # d_t untouched
    if optimizer != "adam":
        assert not _inner(trainer.optimizer).in_flight
    # and training goes on (at a scale that does not overflow)
    _set_scale(trainer.optimizer, 128.0)
    assert trainer.train_step(samples) is not None and trainer.get_num_updates() == 2


@pytest.mark.parametrize("optimizer", ["vasso", "sam"])
@pytest.mark.parametrize("mode", list(UNIT_MODES))
def test_real_overflow_on_second_pass(toy_data, tmp_path, fs, cpu_half_precision, mode, optimizer):
    trainer, samples = _mode_trainer(fs, toy_data, tmp_path, mode, optimizer)
    assert trainer.train_step(samples) is not None
    before = _snapshot(trainer)
    with _real_overflow(trainer, on_call=2) as calls:  # the second pass, at x_t + eps_t
        assert trainer.train_step(samples) is None
    assert len(calls) == 2
    after = _snapshot(trainer)
    assert after["updates"] == 1 and after["scale"] == 2.0 ** 59  # backed off once
    # x_t restored, bit for bit, in what the optimizer steps and in the model; Adam untouched
    assert _same(after["p32"], before["p32"]) and _same(after["p16"], before["p16"])
    assert _same(after["adam"], before["adam"])
    if optimizer == "vasso":  # d_t did absorb the (finite) g_t of the first pass: documented
        assert not _same(after["slope"], before["slope"])
    inner = _inner(trainer.optimizer)
    assert not inner.in_flight
    inner.optimizer.state_dict()  # no step in flight
    _set_scale(trainer.optimizer, 128.0)
    assert trainer.train_step(samples) is not None and trainer.get_num_updates() == 2


def _gradient_at_base_step(optimizer):
    """Record the global norm of ``.grad`` each time ``optimizer`` (a torch optimizer) steps."""
    seen = []
    stock = optimizer.step

    def step(*args, **kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return stock(*args, **kwargs)

    optimizer.step = step
    return seen


@pytest.mark.parametrize("optimizer, extra", [("vasso", ()), ("sam", ()), ("adam", ()),
                                             ("vasso", ("--perturb-prob", "0"))])  # eVASSO's one-pass steps
def test_amp_unscales_once_where_stock_adam_unscales_twice(toy_data, tmp_path, fs, cpu_half_precision,
                                                           optimizer, extra):
    """--amp --clip-norm 0.5: the gradient that reaches the base Adam's step.  fairseq's
    AMPOptimizer.clip_grad_norm unscales (scaler.unscale_ of the torch optimizer) and clips
    to 0.5.  Ours then steps with that gradient: unscaled exactly once.  Stock fairseq 0.12
    (--optimizer adam) hands scaler.step its fairseq wrapper, another object, so the
    GradScaler unscales again: Adam gets the clipped gradient divided by the scale (128)."""
    trainer, samples = _mode_trainer(fs, toy_data, tmp_path, "amp", optimizer, ["--clip-norm", "0.5", *extra])
    torch_optimizer = _inner(trainer.optimizer).optimizer
    seen = _gradient_at_base_step(getattr(torch_optimizer, "base_optimizer", torch_optimizer))
    norms = []
    stock_clip = trainer.clip_grad_norm
    trainer.clip_grad_norm = lambda max_norm: norms.append(float(stock_clip(max_norm))) or torch.tensor(norms[-1])
    for _ in range(3):
        assert trainer.train_step(samples) is not None
    scale = _scale(trainer.optimizer)
    assert scale == 128.0 and len(seen) == len(norms) == 3
    assert all(n > 0.5 for n in norms)  # every update was clipped
    expected = 0.5 if optimizer != "adam" else 0.5 / scale
    assert seen == pytest.approx([expected] * 3, rel=1e-4), (seen, norms)


def test_memory_efficient_fp16_resume_keeps_fp32_moments(toy_data, tmp_path, fs, cpu_half_precision):
    """--memory-efficient-fp16: a state dict loaded into a new Trainer gives back the
    Adam moments in fp32 (torch would cast them to the fp16 params' dtype), d_t and the
    loss scale, and the next update is the one the first Trainer makes."""
    first, samples = _mode_trainer(fs, toy_data, tmp_path / "a", "memory_efficient_fp16", "vasso")
    for _ in range(2):
        assert first.train_step(samples) is not None
    state = first.optimizer.state_dict()
    second, _ = _mode_trainer(fs, toy_data, tmp_path / "b", "memory_efficient_fp16", "vasso")
    with torch.no_grad():
        for p, q in zip(second.model.parameters(), first.model.parameters()):
            p.copy_(q)
    second.optimizer.load_state_dict(state)
    a, b = _snapshot(first), _snapshot(second)
    assert b["adam"] and all(m.dtype == torch.float32 for m in b["adam"]) and _same(a["adam"], b["adam"])
    assert _same(a["slope"], b["slope"]) and b["scale"] == a["scale"]
    second.set_num_updates(first.get_num_updates())
    for trainer in (first, second):
        assert trainer.train_step(samples) is not None
    assert _same(_snapshot(first)["p16"], _snapshot(second)["p16"])


class _NoNanDetector:
    # fairseq's NanDetector re-runs the batch with module hooks that break on this torch
    # (StopIteration in a backward hook, also with --optimizer adam): leave it out
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("which", [1, 2])
def test_fp32_nonfinite_raises_floating_point_error(toy_data, tmp_path, fs, which, monkeypatch):
    import fairseq.trainer

    monkeypatch.setattr(fairseq.trainer, "NanDetector", _NoNanDetector)
    trainer, samples = _trainer(fs, toy_data, tmp_path, "vasso", ["--rho", "0.1"])
    assert trainer.train_step(samples) is not None
    before = _snapshot(trainer)
    with _poisoned_gradient(trainer, on_call=which, value=float("nan")):
        with pytest.raises(FloatingPointError):
            trainer.train_step(samples)
    after = _snapshot(trainer)
    assert _same(after["adam"], before["adam"]) and after["updates"] == 1
    if which == 1:  # nothing moved, d_t untouched
        assert _same(after["p32"], before["p32"]) and _same(after["slope"], before["slope"])
    else:  # back at x_t up to the rounding of one add and one subtract (fp32, plain geometry)
        for a, b in zip(after["p32"], before["p32"]):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert not trainer.optimizer.in_flight


# ------------------------------------------------------------------ refused modes

@pytest.mark.parametrize("flags, named", [
    (["--fp16", "--adaptive"], "--adaptive with flattened --fp16"),
    (["--bf16"], "--bf16"),
    (["--memory-efficient-bf16"], "--bf16"),
    (["--use-bmuf"], "--use-bmuf"),
    (["--ddp-backend", "slowmo"], "slowmo"),
    (["--ddp-backend", "fully_sharded"], "--ddp-backend fully_sharded"),
])
def test_unsupported_modes_are_refused(toy_data, tmp_path, fs, flags, named, capsys):
    """Refused while the command line is parsed (fairseq_vasso.hooks): exit status 2 and
    one line naming the mode, before fairseq built the task or the model."""
    built = []
    with pytest.MonkeyPatch.context() as mp:
        from fairseq import tasks

        mp.setattr(tasks, "setup_task", lambda *a, **k: built.append(a) or pytest.fail("task built"))
        with pytest.raises(SystemExit) as info:
            fs.train(fs.model_args(toy_data, tmp_path, extra=flags + ["--no-save"]))
    assert info.value.code == 2 and not built
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --optimizer vasso does not support" in last and named in last, last


@pytest.mark.gpu  # skips without a CUDA device (tests/conftest.py)
@pytest.mark.parametrize("mode", list(UNIT_MODES))
def test_mixed_precision_end_to_end_on_cuda(toy_data, tmp_path, fs, mode):
    """On a GPU, nothing patched: each mode from a scale that overflows, with vasso."""
    base = [a for a in fs.model_args(toy_data, tmp_path / "x", extra=["--rho", "0.1", "--no-save"]) if a != "--cpu"]
    run = fs.train(base + UNIT_MODES[mode] + ["--fp16-init-scale", str(2 ** 40), "--fp16-scale-window", "2"])
    scales = [float(s["loss_scale"]) for s in run.inner()]
    assert fs.overflow_scales(run) and scales and scales[-1] < 2 ** 40  # overflows happened, the scale fell
    assert all(math.isfinite(x) for x in run.losses())
