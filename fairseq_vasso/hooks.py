"""Every patch ``fairseq_vasso`` makes to fairseq, in one place; inert unless
``--optimizer`` is ``sam`` or ``vasso``.

fairseq's optimizer never sees a closure or a sample: ``Trainer.train_step`` runs
``task.train_step`` (forward/backward) per micro-batch of ``--update-freq``, then
all-reduces the gradients over ranks, multiplies them by ``world_size /
sample_size`` (and by 1/loss_scale under ``--fp16``; ``--amp`` unscales while it
clips), clips them, checks for overflow and calls ``optimizer.step()``.  Importing this module (the user-dir does)
patches:

* ``fairseq.options.parse_args_and_arch``, once: with ``--optimizer sam|vasso`` it
  adds the optimizer's flags to ``--help`` (fairseq prints help before any
  optimizer has added its arguments) and, right after parsing, refuses bad flag
  values and the modes this plugin cannot make correct (:func:`check_config`) with
  one line and exit status 2, like argparse, before the task, model or data exist.
* ``Trainer.__init__``: the same refusals for configs that never went through the
  command line (``fairseq-hydra-train``).
* for the tools, installed only where they call it: the benchmark's step timer
  (:func:`time_train_steps`) and the demo's rounding control (:func:`nudge_initial_weights`,
  ``Trainer.__init__`` then moves the initial weights).
* ``Trainer.load_checkpoint``: a checkpoint already at ``--max-update`` ends the run
  (exit status 0, one line): stock fairseq would train one more update and save it over
  the finished checkpoint, so the same command run twice changed a finished result.
* ``AMPOptimizer.state_dict`` / ``load_state_dict`` (inherited from FairseqOptimizer, they
  read the torch optimizer under ours): with ``sam`` / ``vasso`` they go to ours, which
  drops a step in flight first (fairseq saves crash.pt after a FloatingPointError) and,
  under ``--zero-sharding os``, gathers and slices the ranks' parts.
* ``train_step``: with any other optimizer it calls fairseq's own ``train_step``
  and nothing else.  With ``sam`` / ``vasso`` it runs fairseq's own ``train_step``
  too, with instance-level wrappers that are removed afterwards:

  1. ``task.train_step`` is wrapped to record each micro-batch call (the prepared
     sample, ``ignore_grad``, extra arguments), the RNG state before the first
     one (CPU, and CUDA's when initialized) and each micro-batch's loss.
  2. ``optimizer.multiply_grads`` is wrapped: fairseq calls it once per update,
     after the first pass's gradients were accumulated over all micro-batches and
     all-reduced over ranks.  After fairseq's own scaling, the wrapper holds g_t
     (``--fp16`` / ``--memory-efficient-fp16``: it applies fairseq's pending
     1/loss_scale, into the fp32 master gradients, flat or not, or the fp16 ones;
     ``--amp``: the core unscales g_t with the GradScaler's scale), and:

     - g_t not finite: nothing changes (no perturbation, d_t untouched); fairseq's
       own clip/overflow check then sees the same gradient: fp32 raises fairseq's
       FloatingPointError, a loss scaler lowers the scale and skips the update.
     - ``perturb()``: VASSO updates d_t, the coin (eSAM/eVASSO) is drawn from
       ``(--seed, step)``.  If it says "one pass", ``.grad`` still holds g_t and
       fairseq continues as usual (clip, step with g_t).
     - else the parameters now sit at x_t + eps_t (fp16: the fp32 master copies,
       copied into the fp16 model), the gradients are cleared and, inside the core's
       ``second_pass(model, rng)`` (the RNG state of the first pass replayed,
       BatchNorm running statistics frozen, the step abandoned on an exception),
       every recorded micro-batch runs forward/backward again (``no_sync`` for all
       but the last, as fairseq does); then fairseq's all-reduce and the same
       scaling factor are applied: ``.grad`` holds h_t, exactly as fairseq would
       have left the first pass's gradient.

  3. ``optimizer.step`` is wrapped to note whether the base step was taken; under
     ``--amp`` it replaces AMPOptimizer's ``scaler.step(self.fp32_optimizer)``
     (another object than the torch optimizer its ``clip_grad_norm`` unscaled, so
     the GradScaler would unscale h_t twice) by ``scaler.step`` on the core, then
     ``scaler.update()`` once.

  fairseq's own code then clips h_t (``--clip-norm``), checks it (overflow: the
  loss scale falls and the update is skipped; x_t comes back bit for bit), and calls
  ``optimizer.step()``, which restores x_t and lets Adam step with h_t.  The lr
  is whatever fairseq's scheduler (e.g. ``inverse_sqrt``) set.  ``--amp`` retries
  an overflowed batch by calling ``train_step`` from inside it: the wrappers of
  the retry wrap fairseq's own methods, not ours.

After the update the diagnostics are logged with ``fairseq.logging.metrics`` in
the aggregation context of the step (``train_inner`` and ``train``), so every
log line (simple, json, tqdm, TensorBoard) carries their average over the log
interval: ``ascent_norm`` ||eps_t||, ``loss_gap`` f(x+eps) - f(x) (the logged loss's
units, base 2, over the whole update), ``sharpness`` rho*||v_t|| (the paper's
estimated sharpness), ``stability`` ||eps_t - eps_{t-1}|| (paper Fig. 4),
``two_pass`` (fraction of two-pass updates) and ``rho``.  Quantities that do not
exist for an update (no second pass: no eps_t) are logged with weight 0.  Values
the core left on the device are logged as they are; fairseq reads them when it
prints, at its own log interval, as it does for its loss.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import math
import sys
import time

import torch

#: The fairseq this plugin is tested with; the internals below are checked at import.
TESTED_FAIRSEQ = "fairseq 0.12.2 (as fairseq-fixed 0.12.3.1)"

#: Every fairseq name the hooks read, patch or call beyond fairseq's public CLI:
#: (module, attribute path).  A missing one fails the import with one line.
FAIRSEQ_INTERNALS = (
    ("fairseq.options", "parse_args_and_arch"),
    ("fairseq.dataclass.utils", "gen_parser_from_dataclass"),
    ("fairseq.trainer", "Trainer.__init__"),
    ("fairseq.trainer", "Trainer.train_step"),
    ("fairseq.trainer", "Trainer.load_checkpoint"),
    ("fairseq.trainer", "Trainer.get_num_updates"),
    ("fairseq.trainer", "Trainer.zero_grad"),
    ("fairseq.trainer", "Trainer.optimizer"),
    ("fairseq.trainer", "Trainer.data_parallel_world_size"),
    ("fairseq.trainer", "Trainer.is_fsdp"),
    ("fairseq.tasks.fairseq_task", "FairseqTask.train_step"),
    ("fairseq.optim.fairseq_optimizer", "FairseqOptimizer.multiply_grads"),
    ("fairseq.optim.fairseq_optimizer", "FairseqOptimizer.all_reduce_grads"),
    ("fairseq.optim.fp16_optimizer", "FP16Optimizer._unscale_grads"),
    ("fairseq.optim.fp16_optimizer", "FP16Optimizer._sync_fp32_params_to_fp16"),
    ("fairseq.optim.fp16_optimizer", "MemoryEfficientFP16Optimizer._unscale_grads"),
    ("fairseq.optim.amp_optimizer", "AMPOptimizer.scaler"),
    ("fairseq.logging.metrics", "aggregate"),
    ("fairseq.logging.metrics", "log_scalar"),
    ("fairseq.distributed.utils", "all_reduce"),
)


class FairseqVersionError(ImportError):
    """The installed fairseq lacks an internal the hooks rely on."""


def check_fairseq_internals() -> None:
    """Every name of :data:`FAIRSEQ_INTERNALS` exists, and ``Trainer.train_step`` still
    calls ``optimizer.multiply_grads`` before it clips (the second pass runs inside
    that call, on the all-reduced gradient, before clipping)."""
    missing = []
    for module, path in FAIRSEQ_INTERNALS:
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    if not missing:
        from fairseq.trainer import Trainer

        try:
            source = inspect.getsource(Trainer.train_step)
        except (OSError, TypeError):  # no source shipped: nothing to check the order against
            source = None
        if source is not None:
            multiply, clip = source.find(".multiply_grads("), source.find("self.clip_grad_norm(")
            if not 0 <= multiply < clip:
                missing.append("Trainer.train_step's order (multiply_grads, then clip_grad_norm)")
    if missing:
        import fairseq

        raise FairseqVersionError(
            f"fairseq_vasso needs {TESTED_FAIRSEQ}; the installed fairseq "
            f"{getattr(fairseq, '__version__', '?')} lacks {', '.join(missing)}")


try:
    check_fairseq_internals()
except FairseqVersionError as exc:
    if "fairseq_cli" in sys.modules:  # fairseq-train & co.: one line, no traceback
        raise SystemExit(f"error: {exc}") from None
    raise

from fairseq import options, utils  # noqa: E402
from fairseq.logging import metrics  # noqa: E402
from fairseq.optim import AMPOptimizer, FP16Optimizer, MemoryEfficientFP16Optimizer  # noqa: E402
from fairseq.trainer import Trainer  # noqa: E402

from plugins import rng_state  # noqa: E402
from plugins.reductions import global_norm  # noqa: E402

from .optimizer import CONFIGS, FairseqSharpnessAware, check_flags, flag  # noqa: E402

logger = logging.getLogger(__name__)

OPTIMIZER_NAMES = tuple(CONFIGS)
DIAGNOSTICS = ("ascent_norm", "loss_gap", "sharpness", "stability")


def _stock(fn):
    """The fairseq function under our patch (the module may be imported twice:
    --user-dir and pip), or ``fn`` itself when unpatched."""
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_fairseq_vasso_hook", False) else fn


_stock_init = _stock(Trainer.__init__)
_stock_train_step = _stock(Trainer.train_step)
_stock_load_checkpoint = _stock(Trainer.load_checkpoint)
_stock_parse_args_and_arch = _stock(options.parse_args_and_arch)
_stock_amp_state_dict = _stock(AMPOptimizer.state_dict)
_stock_amp_load_state_dict = _stock(AMPOptimizer.load_state_dict)


class UnsupportedMode(ValueError):
    """A fairseq training mode that --optimizer sam/vasso refuses."""


def _setting(cfg, dotted, default=None):
    """``cfg.common.fp16`` in fairseq's omegaconf config, ``args.fp16`` in the parsed
    command line (an ``argparse.Namespace`` is flat)."""
    parts = dotted.split(".")
    if isinstance(cfg, argparse.Namespace):
        parts = parts[-1:]
    node = cfg
    for part in parts:
        try:
            node = getattr(node, part)
        except Exception:  # omegaconf: a missing key or interpolation
            return default
        if node is None:
            return default
    return node


def optimizer_name(cfg):
    """``--optimizer`` of a parsed command line or an omegaconf config."""
    if isinstance(cfg, argparse.Namespace):
        return getattr(cfg, "optimizer", None)
    return _setting(cfg, "optimizer._name")


def check_config(cfg) -> None:
    """Refuse, with the flag's name, a bad flag value or a mode that ``--optimizer
    sam|vasso`` cannot make correct; ``cfg`` is the parsed command line or fairseq's
    omegaconf config."""
    name = optimizer_name(cfg)
    check_flags(cfg if isinstance(cfg, argparse.Namespace) else cfg.optimizer)

    def refuse(flag, why):
        raise UnsupportedMode(f"--optimizer {name} does not support {flag}: {why}")

    if _setting(cfg, "optimization.use_bmuf", False):
        refuse("--use-bmuf", "BMUF averages models between ranks instead of all-reducing the gradient "
                             "the ascent needs")
    backend = _setting(cfg, "distributed_training.ddp_backend", "")
    if backend == "fully_sharded":
        if _setting(cfg, "common.cpu", False) or not torch.cuda.is_available():
            refuse("--ddp-backend fully_sharded", "fairscale's FullyShardedDataParallel computes on CUDA and "
                   "fairseq 0.12 gives it no CPU device (stock --optimizer adam stops with 'Found no NVIDIA "
                   "driver', also with --cpu-offload); on a CPU use --zero-sharding os (shards the optimizer "
                   "state) or --ddp-backend legacy_ddp / c10d (replicate the model)")
        if _setting(cfg, "distributed_training.cpu_offload", False):
            refuse("--cpu-offload", "FSDP then keeps the parameter shards on the CPU, and the ascent's sums over "
                   "the ranks would be CPU tensors, which fairseq's NCCL process group does not reduce; drop "
                   "--cpu-offload, or use --zero-sharding os")
        if ((_setting(cfg, "distributed_training.distributed_world_size", 1) or 1) == 1
                and not _setting(cfg, "checkpoint.no_save", False)
                and not _setting(cfg, "distributed_training.use_sharded_state", False)):
            # checked here, before training: the stock failure comes at the first save, an epoch in
            refuse("--ddp-backend fully_sharded on one process (--distributed-world-size 1) with checkpoints",
                   "fairscale 0.4.13 cannot gather the optimizer state of an FSDP that does not shard, and the "
                   "first checkpoint save stops with \"'FlatParameter' object has no attribute "
                   "'_full_param_padded'\" (stock --optimizer adam alike); on one GPU use --ddp-backend "
                   "legacy_ddp / c10d, or add --use-sharded-state (a checkpoint file per rank) or --no-save")
        if _setting(cfg, "optimizer.adaptive", False):
            refuse("--adaptive with --ddp-backend fully_sharded", "ASAM scales weight tensors and leaves biases "
                   "alone, and the slices of FSDP's flat parameters no longer tell them apart; use --zero-sharding "
                   "os or --ddp-backend legacy_ddp / c10d for --adaptive")
    if backend == "slowmo":
        refuse("--ddp-backend slowmo", "SlowMo changes the parameters outside the optimizer step")
    zero = _setting(cfg, "distributed_training.zero_sharding", "none")
    if zero not in ("none", "os", None):
        refuse(f"--zero-sharding {zero}", "not a mode of fairseq 0.12 (none, os)")
    if _setting(cfg, "common.bf16", False) or _setting(cfg, "common.memory_efficient_bf16", False):
        refuse("--bf16", "fairseq 0.12 runs bf16 (and --memory-efficient-bf16) on TPUs only (it implies --tpu), "
                         "which is not tested here; use --amp or --fp16 on GPUs")
    flat_fp16 = (_setting(cfg, "common.fp16", False) and not _setting(cfg, "common.memory_efficient_fp16", False)
                 and not _setting(cfg, "common.fp16_no_flatten_grads", False))
    if flat_fp16 and _setting(cfg, "optimizer.adaptive", False):
        refuse("--adaptive with flattened --fp16", "ASAM scales weight tensors and leaves biases alone, and "
                                                   "fairseq's one flat fp32 master vector no longer tells them "
                                                   "apart; add --fp16-no-flatten-grads, or use --amp")
    if _setting(cfg, "common.tpu", False):
        refuse("--tpu", "not tested on XLA")
    if (_setting(cfg, "common.model_parallel_size", 1) or 1) > 1:
        refuse("--model-parallel-size > 1", "the ascent norm would be per shard, not global")
    if _setting(cfg, "distributed_training.pipeline_model_parallel", False):
        refuse("--pipeline-model-parallel", "not supported")


# ------------------------------------------------------------------ the command line


class _PeekError(Exception):
    pass


class _Peek(argparse.ArgumentParser):
    """Reads ``--optimizer`` and ``-h/--help`` the way fairseq's own parser will (argparse:
    ``--optimizer=X``, the last one wins, nothing after ``--``, no abbreviations), and never
    prints or exits: fairseq's parse reports whatever argparse cannot read."""

    def error(self, message):
        raise _PeekError(message)


def _requested_optimizer(argv):
    """``(--optimizer, help asked)`` in ``argv``; ``(None, False)`` when argparse cannot read it
    (fairseq's own parse then fails exactly as without the plugin).  fairseq's helpers pass
    ``None`` items (an unset ``--save-dir``), which argparse reads as positionals."""
    peek = _Peek(add_help=False, allow_abbrev=False)
    peek.add_argument("--optimizer")
    peek.add_argument("-h", "--help", action="store_true")
    try:
        known, _ = peek.parse_known_args(argv)
    except Exception:  # _PeekError, or argparse's TypeError on a non-string item
        return None, False
    return known.optimizer, known.help


def _misplaced_flag(argv, requested):
    """One line for a flag of another of our optimizers given to ``requested``
    (``--optimizer sam --theta 0.4``), which argparse would report after the whole usage
    text as an unrecognized argument; None when there is none."""
    if requested not in CONFIGS:
        return None
    flags = {name: {flag(f.name) for f in dataclasses.fields(config)} for name, config in CONFIGS.items()}
    for arg in argv:
        if not isinstance(arg, str):  # fairseq's helpers pass None items: fairseq's parse reads them
            continue
        given = arg.split("=", 1)[0]
        owners = [name for name in CONFIGS if given in flags[name]]
        if owners and requested not in owners:
            return (f"{given} is a flag of --optimizer {' and '.join(owners)} only, not of --optimizer "
                    f"{requested} (drop it, or use --optimizer {owners[0]})")
    return None


@functools.wraps(_stock_parse_args_and_arch)
def _patched_parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    argv = sys.argv[1:] if input_args is None else list(input_args)
    if input_args is not None and iter(input_args) is input_args:
        input_args = iter(argv)  # an iterator, spent by list(): fairseq gets an equal one
    requested, wants_help = _requested_optimizer(argv)
    misplaced = _misplaced_flag(argv, requested)
    if misplaced is not None:  # one line, as the DomainBed side names another algorithm's hparam
        parser.exit(2, f"{parser.prog}: error: {misplaced}\n")
    if requested in CONFIGS and wants_help:
        # fairseq prints --help before any optimizer added its flags: add ours first
        from fairseq.dataclass.utils import gen_parser_from_dataclass

        try:
            group = parser.add_argument_group(f"optimizer '{requested}' (fairseq_vasso)")
            gen_parser_from_dataclass(group, CONFIGS[requested]())
        except argparse.ArgumentError:  # added already (a second parse): the help has them
            pass
    out = _stock_parse_args_and_arch(parser, input_args, *args, **kwargs)
    parsed = out[0] if isinstance(out, tuple) else out
    if getattr(parsed, "optimizer", None) in OPTIMIZER_NAMES:
        try:
            check_config(parsed)
        except ValueError as exc:  # one line, exit status 2, as argparse reports fairseq's own flags
            parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return out


# ------------------------------------------------------------------ the Trainer


def _sharpness_optimizer(trainer):
    opt = trainer.optimizer  # builds it on first use, as fairseq's own train_step does
    inner = getattr(opt, "fp32_optimizer", None) or getattr(opt, "wrapped_optimizer", opt)
    return inner if isinstance(inner, FairseqSharpnessAware) else None


@functools.wraps(_stock_init)
def _patched_init(self, cfg, *args, **kwargs):
    if optimizer_name(cfg) in OPTIMIZER_NAMES:
        check_config(cfg)
    _stock_init(self, cfg, *args, **kwargs)


@functools.wraps(_stock_load_checkpoint)
def _patched_load_checkpoint(self, filename, *args, **kwargs):
    # fairseq resumed at --max-update still trains one update and saves it over the
    # finished checkpoint: a run of the same command again must leave it as it is
    extra_state = _stock_load_checkpoint(self, filename, *args, **kwargs)
    max_update = _setting(self.cfg, "optimization.max_update", 0) or 0
    if (extra_state is not None and optimizer_name(self.cfg) in OPTIMIZER_NAMES and 0 < max_update
            <= self.get_num_updates()):
        logger.info("%s is at update %d, --max-update %d: trained already, nothing to do (a larger "
                    "--max-update continues it)", filename, self.get_num_updates(), max_update)
        raise SystemExit(0)
    return extra_state


@functools.wraps(_stock_train_step)
def _patched_train_step(self, samples, raise_oom=False):
    sa = _sharpness_optimizer(self)
    if sa is None:
        return _stock_train_step(self, samples, raise_oom)
    return _two_pass_train_step(self, sa, samples, raise_oom)


class _StepContext:
    def __init__(self):
        self.calls = []  # (args, kwargs) of task.train_step, first pass
        self.first_losses = []  # loss per micro-batch (None for dummy batches)
        self.rng = None
        self.multiplied = False
        self.step_taken = False  # this update's base step was taken
        self.loss_gap = float("nan")


def _loss_scaled(trainer):
    """fairseq's --fp16 or --memory-efficient-fp16 wrapper (DynamicLossScaler) around
    ours, else None."""
    opt = trainer.optimizer
    return opt if isinstance(opt, (FP16Optimizer, MemoryEfficientFP16Optimizer)) else None


def _fp32_masters(trainer):
    """fairseq's --fp16 wrapper (fp32 master params, flat or not) around ours, else None."""
    opt = trainer.optimizer
    return opt if isinstance(opt, FP16Optimizer) else None


def _amp(trainer):
    """fairseq's --amp wrapper (a torch GradScaler) around ours, else None."""
    opt = trainer.optimizer
    return opt if isinstance(opt, AMPOptimizer) else None


def _grads_finite(trainer, params) -> bool:
    norm = global_norm([p.grad for p in params if p.grad is not None])
    if trainer.is_fsdp and trainer.data_parallel_world_size > 1:
        # each rank holds a slice of the gradient (FSDP's reduce-scatter): decide alike on every
        # rank, or some would enter perturb()'s collectives without the others
        from fairseq.distributed import utils as distributed_utils

        norm = distributed_utils.all_reduce(norm.detach().double().reshape(1).to(trainer.device),
                                            group=trainer.data_parallel_process_group)[0]
    return bool(torch.isfinite(norm))


def _loss_value(logging_output):
    """The micro-batch's loss, kept on its device (no host sync; read at the log point)."""
    value = logging_output.get("loss") if isinstance(logging_output, dict) else None
    if value is None:
        return None
    return value.detach().double() if torch.is_tensor(value) else float(value)


def _unpatched(fn):
    """fairseq's own bound method under one of our step-scoped wrappers: fairseq's --amp
    retries an overflowed batch by calling ``train_step`` again from inside it."""
    return getattr(fn, "_fairseq_vasso_stock", fn)


@contextlib.contextmanager
def _instance_patches(patches):
    """Set ``(obj, name, value)`` as instance attributes for the block, then put back
    what was there (an outer step's wrapper) or delete them."""
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old in saved:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def _two_pass_train_step(trainer, sa, samples, raise_oom):
    ctx = _StepContext()
    task = trainer.task
    opt = trainer.optimizer
    amp = _amp(trainer)
    stock_task_step = _unpatched(task.train_step)
    stock_multiply = _unpatched(opt.multiply_grads)
    stock_step = _unpatched(opt.step)

    def recording_task_step(*args, **kwargs):
        if not ctx.calls:
            ctx.rng = rng_state()
        ctx.calls.append((args, kwargs))
        out = stock_task_step(*args, **kwargs)
        ignore = kwargs.get("ignore_grad", args[5] if len(args) > 5 else False)
        ctx.first_losses.append(None if ignore else _loss_value(out[2]))
        return out

    def multiply_then_second_pass(c):
        stock_multiply(c)
        if ctx.multiplied:  # once per update; anything later is not ours
            return
        ctx.multiplied = True
        _ascent_and_second_pass(trainer, sa, ctx, stock_task_step, stock_multiply, c)

    def step(*args, **kwargs):
        if amp is not None:
            # AMPOptimizer.step would run scaler.step(self.fp32_optimizer): the fairseq wrapper,
            # not the torch optimizer that its clip_grad_norm unscaled, so GradScaler would
            # unscale h_t a second time.  Ours goes to the core, which the scaler has unscaled
            # once (clip_grad_norm) and whose overflow verdict it holds; then one update().
            sa.scaler_step(amp.scaler)
            amp.scaler.update()
        else:
            stock_step(*args, **kwargs)
        ctx.step_taken = sa.last_step_taken

    recording_task_step._fairseq_vasso_stock = stock_task_step
    multiply_then_second_pass._fairseq_vasso_stock = stock_multiply
    step._fairseq_vasso_stock = stock_step
    patches = [(task, "train_step", recording_task_step), (opt, "multiply_grads", multiply_then_second_pass),
               (opt, "step", step)]
    try:
        with _instance_patches(patches):
            out = _stock_train_step(trainer, samples, raise_oom)
    finally:
        if sa.in_flight:
            # the update was skipped (fp16 overflow) or failed: back to x_t (the core may
            # have done so already; abandon() is idempotent)
            sa.abandon()
        masters = _fp32_masters(trainer)
        if masters is not None and not ctx.step_taken:
            # also in the fp16 model (the core restored the masters, or dropped the step on an
            # exception in the second pass); a step taken synced them itself
            masters._sync_fp32_params_to_fp16()
    if ctx.step_taken:
        # the aggregation context of fairseq's own train_step stats (decorated with
        # metrics.aggregate("train")), plus whatever the caller has active ("train_inner")
        with metrics.aggregate("train"):
            _log_diagnostics(sa, ctx)
    return out


def _maybe_no_sync(trainer, i, n):
    if (trainer.data_parallel_world_size > 1 and hasattr(trainer.model, "no_sync") and i < n - 1
            and not trainer.is_fsdp):
        return trainer.model.no_sync()
    return contextlib.ExitStack()


def _ascent_and_second_pass(trainer, sa, ctx, stock_task_step, stock_multiply, c):
    amp = _amp(trainer)
    if amp is not None:
        # --amp: .grad holds g_t times the GradScaler's scale; the core computes with the
        # unscaled g_t and, on an overflow, leaves the verdict to the scaler (fairseq's
        # clip_grad_norm unscales and sees it, AMPOptimizer logs it, the step is skipped)
        if not sa.perturb(scaler=amp.scaler):
            return  # overflow, or a one-pass update: .grad still holds the scaled g_t
    else:
        scaled = _loss_scaled(trainer)
        if scaled is not None:
            # g_t: fairseq's pending factor 1/loss_scale * c applied (--fp16: into the fp32 master
            # gradients, flat or not; --memory-efficient-fp16: to the fp16 gradients, as its step does)
            scaled._unscale_grads()
        if not _grads_finite(trainer, list(sa.params)):
            # leave everything to fairseq: fp32 raises FloatingPointError, fp16 lowers the scale and skips
            return
        if not sa.perturb():
            return  # one-pass update (eSAM/eVASSO coin): .grad holds g_t
    masters = _fp32_masters(trainer)
    trainer.zero_grad()
    second_losses = []
    n = len(ctx.calls)
    # the core's protocol: RNG of the first pass replayed, BatchNorm frozen, abandon() on an exception;
    # --zero-sharding os: the owners' parameters at x_t + eps_t reach every rank first
    with sa.second_pass(_second_pass_model(trainer, sa), ctx.rng):
        if masters is not None:  # the fp32 masters moved (all of them, now): the fp16 model runs the second pass
            masters._sync_fp32_params_to_fp16()
        for i, (args, kwargs) in enumerate(ctx.calls):
            with _maybe_no_sync(trainer, i, n):
                loss, _, logging_output = stock_task_step(*args, **kwargs)
                del loss
            second_losses.append(_loss_value(logging_output))
    trainer.optimizer.all_reduce_grads(trainer.model)
    if utils.has_parameters(trainer.criterion):
        trainer.optimizer.all_reduce_grads(trainer.criterion)
    stock_multiply(c)
    ctx.loss_gap = _loss_gap(trainer, ctx.first_losses, second_losses, c)


def _second_pass_model(trainer, sa):
    """The model whose BatchNorm layers the second pass freezes; sharded (``--zero-sharding
    os``), also every parameter the optimizers hold, in the same order on every rank: the
    criterion's (fairseq's Trainer optimizes both), and under ``--fp16`` the fp32 masters."""
    if not sa.sharded:
        return trainer.model
    parts = [trainer.model]
    masters = _fp32_masters(trainer)
    if masters is not None:  # the cores hold the fp32 masters, which the model does not
        parts.append(torch.nn.ParameterList(masters.fp32_params))
    elif utils.has_parameters(trainer.criterion):
        parts.append(trainer.criterion)
    return parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)


def _loss_gap(trainer, first, second, c):
    """f_B(x + eps) - f_B(x) over the whole update (all micro-batches and ranks), in
    the units fairseq logs ``loss`` in (sum / sample_size / ln 2); a device tensor when
    fairseq's losses are (read at the log point)."""
    pairs = [(a, b) for a, b in zip(first, second) if a is not None and b is not None]
    total = sum((b - a for a, b in pairs), 0.0)
    if trainer.data_parallel_world_size > 1:
        from fairseq.distributed import utils as distributed_utils

        t = torch.as_tensor(total, dtype=torch.float64).reshape(1).to(trainer.device)
        total = distributed_utils.all_reduce(t, group=trainer.data_parallel_process_group)[0]
    # c == world_size / sample_size (fairseq's multiply_grads factor)
    if not torch.is_tensor(c) and (not math.isfinite(c) or c == 0.0):
        return float("nan")
    sample_size = trainer.data_parallel_world_size / c
    return total / sample_size / math.log(2)


def _finite_on_host(value) -> bool:
    """False only for a non-finite Python float: device tensors stay unread (they are
    finite whenever the step was taken: it was checked on g_t and h_t)."""
    return torch.is_tensor(value) or math.isfinite(value)


def _log_diagnostics(sa, ctx):
    """Log this update's diagnostics into fairseq's meters.  Values the core left on
    the device stay tensors: fairseq reads them (one host sync per log line) when it
    prints, at its own log interval, as it does for its loss."""
    diag = sa.last_diagnostics
    raw = diag.unread() if hasattr(diag, "unread") else diag  # the core's lazy Diagnostics, unread
    two_pass = raw.get("two_pass", 0.0)
    if torch.is_tensor(two_pass):
        # decided on the device: the coin said two passes, and this step, logged because it was
        # taken, was finite; reading the value would cost a host sync every update
        two_pass = 1.0
    values = {
        "ascent_norm": raw.get("ascent_norm", float("nan")),
        "loss_gap": ctx.loss_gap if two_pass else float("nan"),
        "sharpness": raw.get("sharpness", float("nan")),
        "stability": raw.get("stability", float("nan")),
    }
    for i, (key, value) in enumerate(values.items()):
        ok = two_pass > 0 and _finite_on_host(value)
        metrics.log_scalar(key, value if ok else float("nan"), weight=1 if ok else 0, priority=810 + i, round=5)
    metrics.log_scalar("two_pass", two_pass, weight=1, priority=815, round=3)
    metrics.log_scalar("rho", float(raw.get("rho", sa.core.rho)), weight=1, priority=816, round=5)


@functools.wraps(_stock_amp_state_dict)
def _patched_amp_state_dict(self):
    # AMPOptimizer inherits FairseqOptimizer's, which reads the torch optimizer under ours: the
    # core, or under --zero-sharding os fairscale's OSS, whose state dict ours gathers itself
    inner = getattr(self, "fp32_optimizer", None)
    if isinstance(inner, FairseqSharpnessAware):
        return inner.state_dict()
    return _stock_amp_state_dict(self)


@functools.wraps(_stock_amp_load_state_dict)
def _patched_amp_load_state_dict(self, state_dict, optimizer_overrides=None):
    inner = getattr(self, "fp32_optimizer", None)
    if isinstance(inner, FairseqSharpnessAware):
        return inner.load_state_dict(state_dict, optimizer_overrides)
    return _stock_amp_load_state_dict(self, state_dict, optimizer_overrides)


# ------------------------------------------------------------------ installing

#: (owner, attribute, our function): every patch this module makes
PATCHES = (
    (options, "parse_args_and_arch", _patched_parse_args_and_arch),
    (Trainer, "__init__", _patched_init),
    (Trainer, "train_step", _patched_train_step),
    (Trainer, "load_checkpoint", _patched_load_checkpoint),
    (AMPOptimizer, "state_dict", _patched_amp_state_dict),
    (AMPOptimizer, "load_state_dict", _patched_amp_load_state_dict),
)


def install() -> None:
    """Install every patch, once per process (the package may be imported under two
    names: --user-dir and pip)."""
    for owner, attr, ours in PATCHES:
        ours._fairseq_vasso_hook = True
        if not getattr(getattr(owner, attr), "_fairseq_vasso_hook", False):
            setattr(owner, attr, ours)


@contextlib.contextmanager
def stock_fairseq():
    """fairseq exactly as shipped inside the block (for comparisons and tests)."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in PATCHES]
    for owner, attr, current in saved:
        setattr(owner, attr, _stock(current))
    try:
        yield
    finally:
        for owner, attr, current in saved:
            setattr(owner, attr, current)


def time_train_steps(write):
    """Time every update from the outside of the (hooked) ``Trainer.train_step``: after each,
    ``write(cpu_s, wall_s, passes, passes_cpu_s)`` with the update's CPU and wall seconds and
    its forward/backward passes (``task.train_step`` calls) and their CPU seconds.  For the
    benchmark (:mod:`vasso_bench.fairseq_runs`); it stays installed for the process."""
    from fairseq.tasks.fairseq_task import FairseqTask

    hooked_train_step = Trainer.train_step
    stock_task_step = FairseqTask.train_step
    passes = {"n": 0, "cpu": 0.0}

    def timed_task_step(self, *a, **k):  # one forward/backward of one micro-batch
        c0 = time.process_time()
        try:
            return stock_task_step(self, *a, **k)
        finally:
            passes["n"] += 1
            passes["cpu"] += time.process_time() - c0

    def timed_train_step(self, *a, **k):
        passes["n"], passes["cpu"] = 0, 0.0
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return hooked_train_step(self, *a, **k)
        finally:
            write(time.process_time() - c0, time.perf_counter() - w0, passes["n"], passes["cpu"])

    FairseqTask.train_step = timed_task_step
    Trainer.train_step = timed_train_step


def nudge_up(parameters, ulps):
    """Moves every tensor of ``parameters`` ``ulps`` floats up, to the next float of its dtype
    towards +inf each time (``torch.nextafter``; in place, without autograd)."""
    with torch.no_grad():
        for q in parameters:
            for _ in range(ulps):
                q.copy_(torch.nextafter(q, torch.full_like(q, float("inf"))))


def nudge_initial_weights(ulps):
    """Once fairseq's ``Trainer`` holds the freshly initialized model, move each of its
    parameters ``ulps`` floats up (:func:`nudge_up`): the demo's rounding control
    (``scripts/translation/nudged_train.py``).  A run resumed from a checkpoint loads its
    weights over the nudged ones.  It stays installed for the process."""
    hooked_init = Trainer.__init__

    def init_then_nudge(self, cfg, task, model, criterion, *args, **kwargs):
        hooked_init(self, cfg, task, model, criterion, *args, **kwargs)
        # the model itself (self.model would build a distributed wrapper early); its parameters()
        # yields a shared tensor (tied embeddings) once, so each weight moves once
        nudge_up(self._model.parameters(), ulps)

    Trainer.__init__ = init_then_nudge


install()
