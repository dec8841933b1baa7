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
forward/backward passes.  :mod:`fairseq_vasso.hooks` therefore drives the
two-pass step through the explicit API of the core (``perturb`` after the first
pass, ``descend`` in :meth:`step`); it also checks the flags below as soon as
fairseq has parsed the command line.
"""


from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List, Optional

from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import Adam as _FairseqAdam
import torch
from omegaconf import II, OmegaConf

from plugins import SAM, VASSO, PartitionGroup
from plugins.optimizer import SharpnessAware
from plugins.scaling import step_wrapper
from plugins.validation import Range, check

__all__ = [
    "FairseqSAMConfig",
    "FairseqVASSOConfig",
    "FairseqSharpnessAware",
    "FairseqSAM",
    "FairseqVASSO",
    "check_flags",
    "CONFIGS",
    "FLAGS",
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
    rho_min: Optional[float] = field(
        default=None,
        metadata={"help": "GSAM's rho schedule (Zhuang et al. 2022): rho follows the learning rate, "
                          "rho_t = rho_min + (rho - rho_min) * lr_t / lr, from rho_min at lr 0 to --rho at "
                          "the peak --lr; in [0, --rho] (default: off, constant --rho)"},
    )
    # no help text: these are read from fairseq's own flags, not added as new ones
    seed: int = II("common.seed")
    lr: List[float] = II("optimization.lr")
    fp16: bool = II("common.fp16")
    amp: bool = II("common.amp")
    ddp_backend: str = II("distributed_training.ddp_backend")


@dataclass
class FairseqVASSOConfig(FairseqSAMConfig):
    theta: float = field(
        default=0.4,
        metadata={"help": "VASSO's EMA weight theta in (0, 1]: d_t = (1 - theta) d_{t-1} + theta g_t "
                          "(d_0 = g_0); theta = 1 is SAM (default 0.4)"},
    )


#: ``--optimizer`` name -> its dataclass config
CONFIGS = {"sam": FairseqSAMConfig, "vasso": FairseqVASSOConfig}


def _get(cfg, name, default=None):
    try:
        return getattr(cfg, name, default)
    except Exception:  # omegaconf: a missing interpolation
        return default


#: This host's flag table: config field (the flag is ``--field-name``) -> the core's knob.
#: plugins.validation holds each knob's range; the core gets ``{knob: value}``.
FLAGS = {
    "rho": "rho",
    "rho_min": "rho_min",
    "theta": "theta",  # vasso only
    "adaptive": "adaptive",
    "adaptive_eta": "eta",
    "gsam_alpha": "gsam_alpha",
    "perturb_prob": "p",
}
#: The base Adam's flags that this optimizer adds (fairseq's adam checks none of them).
BASE_FLAGS = {"adam_eps": "adam_eps", "weight_decay": "weight_decay"}


def flag(field_name: str) -> str:
    """``rho_min`` -> ``--rho-min``, as fairseq spells a dataclass field on the command line."""
    return "--" + field_name.replace("_", "-")


def check_flags(cfg) -> dict:
    """The core's keyword arguments from the optimizer config; ValueError naming the
    flag and its range for a bad value."""
    knobs = {}
    for field_name, knob in {**FLAGS, **BASE_FLAGS}.items():
        if not hasattr(cfg, field_name):
            continue
        value = check(knob, _get(cfg, field_name), name=flag(field_name), parse=True)
        if field_name in FLAGS:
            knobs[knob] = value
    if knobs.get("rho_min") is not None:
        check("rho_min", knobs["rho_min"], name="--rho-min", within=Range(0.0, knobs["rho"], "[]"))
    return knobs


class FairseqSharpnessAware(FairseqOptimizer):
    """fairseq adapter over ``plugins.SharpnessAware`` (shared by ``sam`` and ``vasso``).

    ``self.optimizer`` is the core wrapper (a ``torch.optim.Optimizer``); its
    ``param_groups`` are the base Adam's, so fairseq's lr scheduler drives the lr
    that the descent uses.  Its state dict carries the Adam moments and step, d_t
    (VASSO) and the wrapper's step counter (the eSAM/eVASSO coin), so
    ``checkpoint_last.pt`` resumes all of them.

    :meth:`step` is the descent half of the step: the hooks in
    :mod:`fairseq_vasso.hooks` have called :meth:`perturb` after the first
    pass and run the second one; fairseq then all-reduced, scaled and clipped the
    descent gradient h_t exactly as for any optimizer and calls ``step()``.
    """

    core_class = None  # SAM or VASSO

    def __init__(self, cfg, params):
        super().__init__(cfg)
        knobs = check_flags(cfg)  # the same checks again for configs that bypass argparse (hydra)
        lr = self.optimizer_config["lr"]
        # --fp16 / --amp: a loss scaler skips overflowed updates routinely; restore x_t from a
        # copy, bit for bit (the plain-geometry restore subtracts the ascent again, exact only
        # up to one rounding).  fp16 params (--memory-efficient-fp16): the core always does.
        exact = bool(_get(cfg, "fp16", False)) or bool(_get(cfg, "amp", False))
        settings = dict(base_optimizer=_FairseqAdam, seed=int(self.cfg.seed), lr_max=lr if lr > 0 else None,
                        exact_restore=exact, **knobs)
        # its class, with these settings bound, is what --zero-sharding os builds per rank (_partition_class)
        self._optimizer = _partition_class(self.core_class, settings)(params, partition_group=_flat_shards(cfg),
                                                                      **self.optimizer_config)
        self._optimizer.disable_mem_eff_fp16_loading_hack = True  # see _keep_fp32_moments
        self.last_step_taken = False
        self.last_diagnostics = {}

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

    # -------------------------------------------------------------- the core, whole or sharded

    @property
    def core(self) -> SharpnessAware:
        """The core optimizer: ours, or under ``--zero-sharding os`` the one over this rank's
        partition that fairscale's OSS (then ``self.optimizer``) built and holds.  Under
        ``--ddp-backend fully_sharded`` ours, over this rank's slices of FSDP's flat parameters
        (:func:`_flat_shards`)."""
        inner = getattr(self._optimizer, "optim", None)
        return inner if isinstance(inner, SharpnessAware) else self._optimizer

    @property
    def sharded(self) -> bool:
        """``--zero-sharding os``: fairseq replaced the core by fairscale's OSS over per-rank cores."""
        return self.core is not self._optimizer

    # -------------------------------------------------------------- the two halves

    @property
    def in_flight(self) -> bool:
        """The core's: between ``perturb()`` and ``step()`` / ``abandon()``."""
        return self.core.in_flight

    def perturb(self, scaler=None) -> bool:
        """Ascent from g_t in ``.grad`` (see ``plugins.SharpnessAware.perturb``); under
        ``--amp`` ``scaler`` is AMPOptimizer's GradScaler and g_t is scaled by it."""
        self.last_step_taken = False
        if self.sharded:  # the lr (and rho) fairseq's scheduler set on OSS's groups, as OSS.step() copies them
            type(self._optimizer)._sync_param_groups(self._optimizer.param_groups, self.core.param_groups)
        if scaler is None:
            return self.core.perturb()
        return self.core.perturb(scaler=scaler)

    def second_pass(self, model, rng):
        """The core's second-pass protocol (``plugins.SharpnessAware.second_pass``); sharded,
        the owners' parameters at x_t + eps_t reach every rank as it starts."""
        return self.core.second_pass(model, rng)

    def restore(self) -> None:
        """Put x_t back (idempotent)."""
        self.core.restore()

    def abandon(self) -> None:
        """Restore x_t and drop the step in flight (the host skipped the update); idempotent."""
        self.core.abandon()

    def step(self, closure=None, scale=1.0, groups=None):
        """Restore x_t and let the base Adam step with the gradient in ``.grad``."""
        if closure is not None:
            raise RuntimeError("fairseq's sam/vasso optimizers take no closure: the second pass is run by "
                               "fairseq_vasso.hooks inside Trainer.train_step")
        if not self.in_flight:
            raise RuntimeError(
                f"{type(self).__name__}.step() without a first pass: the sam/vasso optimizers only work through "
                "fairseq's Trainer.train_step with the fairseq_vasso user-dir imported (--user-dir)")
        if scale != 1.0:
            self.multiply_grads(1.0 / scale)
        if self.sharded:  # OSS.step(): the core's descend on this rank's partition, then the ranks' broadcast
            self.last_step_taken = bool(self._optimizer.step())
        else:
            self.last_step_taken = self.core.descend()
        self.last_diagnostics = self.core.diagnostics  # read when fairseq logs

    def scaler_step(self, scaler) -> None:
        """``--amp``: finish the step through ``scaler.step(core)``: the scaler hands the
        core its overflow verdict (and the scale, unless ``scaler.unscale_(core)`` already
        ran), so h_t is unscaled exactly once; an overflow skips the base step at x_t."""
        if self.sharded:
            # through OSS (its broadcast follows the step): GradScaler.step(OSS) takes the verdict of
            # the unscale_(OSS) in fairseq's clip_grad_norm and, without an overflow, calls OSS.step(),
            # whose core.step() finishes the step perturb(scaler=...) began with h_t unscaled once
            self.last_step_taken = bool(step_wrapper(scaler, self._optimizer, self.core))
        else:
            self.last_step_taken = bool(scaler.step(self.core))
        self.last_diagnostics = self.core.diagnostics

    # -------------------------------------------------------------- state

    def state_dict(self):
        """The core's state dict; sharded (``--zero-sharding os``), the same dict over all the
        parameters, from the ranks' parts that fairseq gathered (``consolidate_state_dict``)
        before it saves: checkpoints of both modes load in either.  Under ``--ddp-backend
        fully_sharded`` without the per-entry ``sam_counters`` and with ``sam_held`` as its
        ``(name, 0/1)`` pairs: fairscale's ``gather_full_optim_state_dict`` keeps one value of
        each non-tensor entry only if it is hashable, which a dict is not; the top-level
        ``sharpness`` carries the same counters, and loading takes them from there (and takes
        ``sam_held`` in either form)."""
        # fairseq saves crash.pt after a FloatingPointError, possibly mid-step: drop the step first.
        self.abandon()
        if self.sharded:
            return _consolidated(self._optimizer)
        state = self.core.state_dict()
        if _fully_sharded(self.cfg):
            state["state"] = {k: {n: tuple(sorted(v.items())) if n == "sam_held" else v
                                  for n, v in entry.items() if n != "sam_counters"}
                              for k, entry in state["state"].items()}
        return state

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        self.abandon()
        # FP16Optimizer adds "loss_scale" beside our entries; the core does not want it
        own = {k: v for k, v in state_dict.items() if k in ("state", "param_groups", "sharpness")}
        if self.sharded:
            own = _partition_of(own, self._optimizer)
        self.core.load_state_dict(own)
        self._keep_fp32_moments(self.core.base_optimizer_state(own))
        if optimizer_overrides is not None and len(optimizer_overrides) > 0:
            for group in self.core.param_groups:
                group.update(optimizer_overrides)
        if self.sharded:  # OSS's own groups (those fairseq's scheduler and logs read) from the loaded ones
            type(self._optimizer)._sync_param_groups(self.core.param_groups, self._optimizer.param_groups)

    def _keep_fp32_moments(self, saved_state):
        """--memory-efficient-fp16: torch's ``load_state_dict`` casts the Adam moments to the
        fp16 params' dtype; fairseq's Adam keeps them in fp32 (MemoryEfficientFP16Optimizer's
        own fix-up expects a plain torch state dict, so ``disable_mem_eff_fp16_loading_hack``
        turns it off for ours and this does the same job)."""
        base = self.core.base_optimizer
        params = [p for group in base.param_groups for p in group["params"]]
        for index, buffers in saved_state.items():
            p = params[int(index)]
            if p.dtype in (torch.float16, torch.bfloat16):
                base.state[p] = {k: v.to(p.device).clone() if torch.is_tensor(v) else v for k, v in buffers.items()}

    # -------------------------------------------------------------- capabilities

    @property
    def supports_flat_params(self):
        # --fp16's one flat fp32 master vector, and --ddp-backend fully_sharded's slices of FSDP's
        # flat parameters (the core sums over the ranks: _flat_shards): every step is elementwise
        # or global sums.  ASAM's per-tensor T is not, and is refused in both (hooks.check_config)
        return True

    @property
    def supports_memory_efficient_fp16(self):
        # fp16 params: the core restores x_t from an anchor copy, the base Adam computes in fp32
        return True

    @property
    def supports_step_with_scale(self):
        return False

    @property
    def supports_groups(self):
        return False


def _fully_sharded(cfg) -> bool:
    backend = _get(cfg, "ddp_backend")
    return str(getattr(backend, "value", backend)) == "fully_sharded"


def _flat_shards(cfg):
    """``--ddp-backend fully_sharded``: each rank's optimizer holds its slices of the flat
    parameters of fairscale's FSDP, which all-gathers them itself in every forward; the core
    sums its norms over fairseq's data-parallel group (the ranks FSDP shards over) and sends
    nothing before the second pass (``PartitionGroup(model_gathers=True)``).  None otherwise,
    and on one rank (FSDP then holds whole flat vectors)."""
    if not _fully_sharded(cfg) or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from fairseq.distributed import utils as distributed_utils

    group = distributed_utils.get_data_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return None
    return PartitionGroup(group, model_gathers=True)


def _partition_class(core_class, settings):
    """``core_class`` with ``settings`` (base optimizer, seed, knobs) bound.  fairseq's
    ``--zero-sharding os`` replaces an optimizer by fairscale's OSS, which builds one of its
    class over each rank's partition of the parameters as ``type(optimizer)(partition,
    **optimizer_config)`` (``fairseq.optim.shard``); built that way, the core sums its norms
    over fairseq's data-parallel group (the ranks OSS shards over: ``partition_group``)."""

    def __init__(self, params, partition_group=_DATA_PARALLEL_GROUP, **base_overrides):
        if partition_group is _DATA_PARALLEL_GROUP:
            from fairseq.distributed import utils as distributed_utils

            partition_group = distributed_utils.get_data_parallel_group()
        core_class.__init__(self, params, partition_group=partition_group, **settings, **base_overrides)

    return type(core_class.__name__, (core_class,), {"__init__": __init__, "__module__": core_class.__module__,
                                                     "__qualname__": core_class.__qualname__})


_DATA_PARALLEL_GROUP = object()


def _global_index(oss):
    """``id(parameter) -> index`` in the order of OSS's (all the parameters') groups."""
    return {id(p): i for i, p in enumerate(p for group in oss.param_groups for p in group["params"])}


def _partition(oss, rank):
    """Rank ``rank``'s parameters in its core's order (its groups, each in OSS's order)."""
    return [p for group in oss.partition_parameters()[rank] for p in group["params"]]


def _consolidated(oss) -> dict:
    """The core's state dict over all the parameters, from each rank's core's state dict
    (OSS.consolidate_state_dict keeps them, in rank order, where fairseq saves)."""
    parts = oss._all_states
    if not parts:
        raise RuntimeError("--zero-sharding os: the optimizer state was not gathered; fairseq's Trainer calls "
                           "consolidate_optimizer() on every rank before it saves")
    index = _global_index(oss)
    state = {}
    for rank, part in enumerate(parts):
        local = _partition(oss, rank)
        for i, entry in part["state"].items():  # Adam's moments beside d_t and the counters
            if isinstance(i, int):
                state[index[id(local[i])]] = entry
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [index[id(p)] for p in group["params"]]}
              for group in oss.param_groups]
    # the step counter, the coin's seed and the last ascent's norms are global: equal on every rank
    return {"state": dict(sorted(state.items())), "param_groups": groups, "sharpness": parts[0]["sharpness"]}


def _partition_of(state_dict, oss) -> dict:
    """This rank's part of a state dict over all the parameters (:func:`_consolidated`'s
    form, or an unsharded run's), indexed as this rank's core numbers its parameters."""
    index = _global_index(oss)
    local = {index[id(p)]: i for i, p in enumerate(_partition(oss, oss.rank))}
    return {
        "state": {local[int(i)]: v for i, v in state_dict["state"].items() if int(i) in local},
        "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                          "params": [local[int(i)] for i in group["params"] if int(i) in local]}
                         for group in state_dict["param_groups"]],
        "sharpness": state_dict["sharpness"],
    }


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
