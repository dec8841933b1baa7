"""The fairseq optimizers ``sam`` and ``vasso``: fairseq's AdamW under a sharpness-aware wrapper.

The wrapper (``plugins.SAM`` / ``plugins.VASSO``) does the math; this module only
adapts it to fairseq's optimizer interface.  The base optimizer is fairseq's own
pure-PyTorch ``fairseq.optim.adam.Adam`` (decoupled weight decay, the update that
``--optimizer adam`` makes on CPU), built with the same ``--adam-betas``,
``--adam-eps``, ``--weight-decay`` and ``--lr`` as ``--optimizer adam``; so
``--rho 0`` steps exactly like ``--optimizer adam``.  (On GPUs where fairseq finds a
FusedAdam kernel, stock ``adam`` uses that kernel instead: the same update up to
rounding.)

fairseq never hands an optimizer a closure: its ``Trainer.train_step`` runs the
forward/backward passes.  :mod:`fairseq_vasso.trainer_hooks` therefore drives the
two-pass step through the explicit API of the core (``perturb`` after the first
pass, ``descend`` in :meth:`step`).
"""


import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import Adam as _FairseqAdam
from omegaconf import II, OmegaConf

from plugins import SAM, VASSO

__all__ = [
    "FairseqSAMConfig",
    "FairseqVASSOConfig",
    "FairseqSharpnessAware",
    "FairseqSAM",
    "FairseqVASSO",
    "check_flags",
]


@dataclass
class FairseqSAMConfig(FairseqDataclass):
    adam_betas: Any = field(
        default=(0.9, 0.999), metadata={"help": "betas for the Adam(W) base optimizer, as --optimizer adam"}
    )
    adam_eps: float = field(
        default=1e-8, metadata={"help": "epsilon for the Adam(W) base optimizer, as --optimizer adam"}
    )
    weight_decay: float = field(
        default=0.0, metadata={"help": "decoupled weight decay (AdamW), as --optimizer adam"}
    )
    rho: float = field(
        default=0.05,
        metadata={"help": "radius of the sharpness-aware neighbourhood, >= 0 "
                          "(0 steps exactly like --optimizer adam; default 0.05)"},
    )
    adaptive: bool = field(
        default=False,
        metadata={"help": "adaptive geometry (ASAM, Kwon et al. 2021): eps = rho T^2 v / ||T v||, "
                          "T = |x| + eta on weight tensors (ndim > 1), T = 1 on biases and norms (default off)"},
    )
    adaptive_eta: float = field(
        default=0.01, metadata={"help": "ASAM's offset eta in T = |x| + eta, >= 0 (with --adaptive; default 0.01)"}
    )
    gsam_alpha: float = field(
        default=0.0,
        metadata={"help": "GSAM descent correction alpha, >= 0 (Zhuang et al. 2022): the descent uses "
                          "h - alpha * (component of g orthogonal to h); 0 is off (default)"},
    )
    perturb_prob: float = field(
        default=1.0,
        metadata={"help": "probability of the second (perturbed) pass per update, in [0, 1]; "
                          "< 1 gives eSAM / eVASSO (the coin is a function of --seed and the step; default 1)"},
    )
    # no help text: these are read from fairseq's own flags, not added as new ones
    seed: int = II("common.seed")
    lr: List[float] = II("optimization.lr")


@dataclass
class FairseqVASSOConfig(FairseqSAMConfig):
    theta: float = field(
        default=0.4,
        metadata={"help": "VASSO's EMA weight theta in (0, 1]: d_t = (1 - theta) d_{t-1} + theta g_t "
                          "(d_0 = g_0); theta = 1 is SAM (default 0.4)"},
    )


def _get(cfg, name, default=None):
    try:
        return getattr(cfg, name, default)
    except Exception:  # omegaconf: a missing interpolation
        return default


def _check_range(flag, value, low, high, *, low_open=False, high_open=False):
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be a number in {interval}, got {value!r}") from None
    if (math.isnan(v) or v < low or v > high or (low_open and v == low)
            or (high_open and v == high)):
        raise ValueError(f"{flag} must be in {interval}, got {value!r}")
    return v


def check_flags(cfg) -> None:
    """ValueError naming the flag and its range for a bad optimizer flag."""
    _check_range("--rho", _get(cfg, "rho"), 0.0, math.inf, high_open=True)
    if _get(cfg, "theta") is not None:
        _check_range("--theta", _get(cfg, "theta"), 0.0, 1.0, low_open=True)
    _check_range("--adaptive-eta", _get(cfg, "adaptive_eta", 0.01), 0.0, math.inf, high_open=True)
    _check_range("--gsam-alpha", _get(cfg, "gsam_alpha", 0.0), 0.0, math.inf, high_open=True)
    _check_range("--perturb-prob", _get(cfg, "perturb_prob", 1.0), 0.0, 1.0)
    _check_range("--adam-eps", _get(cfg, "adam_eps", 1e-8), 0.0, math.inf, high_open=True)
    _check_range("--weight-decay", _get(cfg, "weight_decay", 0.0), 0.0, math.inf, high_open=True)


class FairseqSharpnessAware(FairseqOptimizer):
    """fairseq adapter over ``plugins.SharpnessAware`` (shared by ``sam`` and ``vasso``).

    ``self.optimizer`` is the core wrapper (a ``torch.optim.Optimizer``); its
    ``param_groups`` are the base Adam's, so fairseq's lr scheduler drives the lr
    that the descent uses.  Its state dict carries the Adam moments and step, d_t
    (VASSO) and the wrapper's step counter (the eSAM/eVASSO coin), so
    ``checkpoint_last.pt`` resumes all of them.

    :meth:`step` is the descent half of the step: the hooks in
    :mod:`fairseq_vasso.trainer_hooks` have called :meth:`perturb` after the first
    pass and run the second one; fairseq then all-reduced, scaled and clipped the
    descent gradient h_t exactly as for any optimizer and calls ``step()``.
    """

    core_class = None  # SAM or VASSO

    def __init__(self, cfg, params):
        super().__init__(cfg)
        check_flags(cfg)
        self._optimizer = self.core_class(params, _FairseqAdam, **self._core_kwargs(), **self.optimizer_config)
        self._in_flight = False  # perturb() called, descend()/abandon() not yet
        self.last_step_taken = False
        self.last_diagnostics = {}

    def _core_kwargs(self):
        return dict(rho=float(self.cfg.rho), adaptive=bool(self.cfg.adaptive),
                    eta=float(self.cfg.adaptive_eta), gsam_alpha=float(self.cfg.gsam_alpha),
                    p=float(self.cfg.perturb_prob), seed=int(self.cfg.seed))

    @property
    def optimizer_config(self):
        """Overrides for the base Adam, the same dictionary as fairseq's ``adam``."""
        lr = self.cfg.lr
        betas = self.cfg.adam_betas
        return {
            "lr": lr[0] if isinstance(lr, Collection) else lr,
            "betas": tuple(eval(betas) if isinstance(betas, str) else OmegaConf.to_container(betas)
                           if OmegaConf.is_config(betas) else betas),
            "eps": self.cfg.adam_eps,
            "weight_decay": self.cfg.weight_decay,
        }

    # -------------------------------------------------------------- the two halves

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    def perturb(self, exact_restore: bool = False) -> bool:
        """Ascent from g_t in ``.grad`` (see ``plugins.SharpnessAware.perturb``).

        ``exact_restore``: keep a copy of x_t and restore from it, bit for bit (used
        under ``--fp16``, where these parameters are the fp32 master copies; the
        core's plain-geometry restore of fp32 tensors subtracts the ascent it added,
        which is exact only up to one rounding).
        """
        self.last_step_taken = False
        self._in_flight = True
        self._optimizer.exact_restore = bool(exact_restore)
        try:
            return self._optimizer.perturb()
        except BaseException:
            self.abandon()
            raise

    def restore(self) -> None:
        """Put x_t back (idempotent)."""
        self._optimizer.restore()

    def abandon(self) -> None:
        """Restore x_t and drop the step in flight (the host skipped the update)."""
        if self._in_flight:
            self.restore()
            self._optimizer.abandon()
        self._in_flight = False

    def step(self, closure=None, scale=1.0, groups=None):
        """Restore x_t and let the base Adam step with the gradient in ``.grad``."""
        if closure is not None:
            raise RuntimeError("fairseq's sam/vasso optimizers take no closure: the second pass is run by "
                               "fairseq_vasso.trainer_hooks inside Trainer.train_step")
        if not self._in_flight:
            raise RuntimeError(
                f"{type(self).__name__}.step() without a first pass: the sam/vasso optimizers only work through "
                "fairseq's Trainer.train_step with the fairseq_vasso user-dir imported (--user-dir)")
        if scale != 1.0:
            self.multiply_grads(1.0 / scale)
        self._in_flight = False
        self.restore()  # exact under --fp16; descend()'s own restore is then a no-op
        self.last_step_taken = self._optimizer.descend()
        self.last_diagnostics = dict(self._optimizer.diagnostics)

    # -------------------------------------------------------------- state

    def state_dict(self):
        # fairseq saves crash.pt after a FloatingPointError, possibly mid-step: drop the step first.
        self.abandon()
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        self.abandon()
        # FP16Optimizer adds "loss_scale" beside our entries; the core does not want it
        own = {k: v for k, v in state_dict.items() if k in ("base_optimizer", "state", "sharpness")}
        self._optimizer.load_state_dict(own)
        if optimizer_overrides is not None and len(optimizer_overrides) > 0:
            for group in self.param_groups:
                group.update(optimizer_overrides)

    # -------------------------------------------------------------- capabilities

    @property
    def supports_flat_params(self):
        # --fp16 needs --fp16-no-flatten-grads (checked early by the trainer hooks)
        return False

    @property
    def supports_memory_efficient_fp16(self):
        return False

    @property
    def supports_step_with_scale(self):
        return False

    @property
    def supports_groups(self):
        return False


@register_optimizer("sam", dataclass=FairseqSAMConfig)
class FairseqSAM(FairseqSharpnessAware):
    """SAM (Foret et al. 2021) over fairseq's AdamW; ``--adaptive`` gives ASAM,
    ``--gsam-alpha`` GSAM, ``--perturb-prob < 1`` eSAM."""

    core_class = SAM


@register_optimizer("vasso", dataclass=FairseqVASSOConfig)
class FairseqVASSO(FairseqSharpnessAware):
    """VASSO (Li and Giannakis 2023) over fairseq's AdamW: the ascent follows
    d_t = (1 - theta) d_{t-1} + theta g_t (d_0 = g_0); ``--perturb-prob < 1`` gives
    eVASSO, ``--gsam-alpha`` VASSO+GSAM (this project's reading), ``--adaptive``
    adaptive VASSO."""

    core_class = VASSO

    def _core_kwargs(self):
        kw = super()._core_kwargs()
        kw["theta"] = float(self.cfg.theta)
        return kw
