"""The sharpness-aware optimizer family as one wrapper over any torch optimizer.

One class, four independent choices (``docs/design.md``, section 1):

=============  ===================================  ===============================
choice         knob                                 members
=============  ===================================  ===============================
slope          ``theta`` (None: raw gradient)       SAM / VASSO
geometry       ``adaptive``, ``eta``                plain / ASAM
correction     ``gsam_alpha``                       none / GSAM
schedule       ``p``, ``seed``                      every step / eSAM, eVASSO
=============  ===================================  ===============================

so VASSO+GSAM (``VASSO(..., gsam_alpha=a)``) or adaptive eVASSO
(``VASSO(..., adaptive=True, p=0.5)``) need no class of their own.

State this wrapper keeps beside the base optimizer's (bytes are counted by
:meth:`SharpnessAware.state_nbytes`):

==========================================  =========================================
variant                                     per-parameter buffers
==========================================  =========================================
SAM, eSAM (plain, fp32 params)              ``slope`` = g of the last two-pass step
VASSO (plain, fp32, p = 1)                  ``slope`` = d_t, plus the scalar ||d_t||
eVASSO (p < 1)                              ``slope`` + ``previous_ascent`` (only for
                                            the stability diagnostic; off with
                                            ``track_stability=False``)
+ GSAM on VASSO (V+G)                       + ``first_grad`` (g_t, needed by GSAM)
+ adaptive geometry                         + ``anchor`` (x_t: T cannot be recomputed
                                            at x_t + eps) + ``previous_ascent``
                                            (diagnostic)
fp16 / bf16 parameters                      + ``anchor`` (exact restore; VASSO first
                                            computes d_t there, before the step's one
                                            reduction, so that its norm as rounded
                                            rides along: no buffer of its own)
==========================================  =========================================

The restore of plain geometry with fp32 parameters subtracts the same ``s * v``
it added, so parameters come back equal up to the rounding of one add and one
subtract; everything else restores from the ``anchor`` copy, exactly.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import warnings
from collections import defaultdict
from collections.abc import MutableMapping
from typing import Any, Dict, Iterator, List, Optional

import torch

from . import distributed as D
from . import perturbation as P
from .named_params import normalize_param_group, normalize_param_groups
from .validation import Closure, Params, Range, check

__all__ = ["SharpnessAware", "SAM", "VASSO", "Diagnostics"]

_EXACT_DTYPES = (torch.float32, torch.float64)
_PERSISTENT = ("slope", "previous_ascent")
_NAN = float("nan")


def _as_float(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


class SharpnessAware(torch.optim.Optimizer):
    r"""Sharpness-aware minimization over any torch optimizer.

    Each step evaluates the gradient ``g_t`` at ``x_t``, builds the slope ``v_t``
    (``g_t``, or VASSO's ``d_t = (1 - theta) d_{t-1} + theta g_t`` with
    ``d_0 = g_0`` as in the authors' code), moves to ``x_t + eps_t`` with
    ``eps_t = rho v_t / ||v_t||`` (one global norm over every parameter group;
    adaptive: ``rho T^2 v_t / ||T v_t||``), evaluates the gradient ``h_t`` there,
    returns to ``x_t`` and lets the base optimizer step with ``h_t`` (GSAM:
    ``h_t - gsam_alpha * g_t^\perp``).  With ``p < 1`` the second pass runs with
    probability ``p`` (a coin that is a function of ``(seed, step)``); otherwise the
    base optimizer steps with ``g_t``.

    Args:
        params: parameters or parameter groups, as for any torch optimizer;
            ``model.named_parameters()`` lets adaptive geometry pick weights by name.
        base_optimizer: an optimizer class (built here with ``**base_kwargs``) or an
            optimizer already built over exactly these parameters.
        rho: radius of the neighbourhood, ``>= 0``; ``0`` steps exactly like the base.
            Held in every param group (``group["rho"]``, all equal: one global norm),
            where a scheduler may change it.
        theta: ``None`` for SAM's raw gradient, else VASSO's EMA weight in ``(0, 1]``.
        adaptive: ASAM geometry (Kwon et al. 2021), ``T = |x| + eta`` on weights.
        eta: ASAM's offset, ``>= 0``.
        gsam_alpha: GSAM's descent correction (Zhuang et al. 2022), ``>= 0``; 0 is off.
        p: probability of the second pass, in ``[0, 1]``; ``< 1`` gives eSAM/eVASSO.
        seed: seeds the coin; the same on every distributed rank.
        rho_min: GSAM's rho schedule (``None``: constant rho): the step's rho is
            ``rho_min + (rho - rho_min) (lr_t - lr_min) / (lr_max - lr_min)`` with
            ``lr_t`` the first group's lr; in ``[0, rho]``.
        lr_max: the schedule's peak lr (default: the first group's lr now).
        lr_min: the schedule's lowest lr, ``>= 0`` (default 0).
        track_stability: compute ``||eps_t - eps_{t-1}||`` (may hold one buffer,
            see the module docstring).
        exact_restore: keep a copy of ``x_t`` during each two-pass step and restore
            from it, bit for bit, instead of subtracting ``eps`` again (one more
            parameter-sized buffer; automatic for adaptive geometry and fp16/bf16).
        partition_group: the ``torch.distributed`` process group over which the
            parameters are split among the ranks' optimizers, each holding only its own
            part: ``ZeroRedundancyOptimizer`` and fairscale's ``OSS`` with this class as
            their optimizer class, or a hand-split model.  The step's sums of squares and
            inner products are then summed over the group, and before the second
            forward every owner sends its parameters at ``x + eps`` to the other ranks,
            so the second pass must be given the model (``step(closure, model=model)``,
            ``second_pass(model, rng)``).  None (the default) for one process, for DDP
            replicas and for DTensor parameters (FSDP2's ``fully_shard``), which carry
            their device mesh; given with DTensors it is refused.  Named this way because
            ``ZeroRedundancyOptimizer`` and ``OSS`` keep ``process_group`` / ``group``
            for themselves: pass them the same group.  They also copy this keyword into
            their ``state_dict()``, where a ``ProcessGroup`` cannot be pickled: pass it
            there as :class:`plugins.PartitionGroup` ``(group)``, which can.  Ranks that
            train models of their own pass a group of one rank
            (``torch.distributed.new_subgroups(1)[0]``): nothing is reduced.  Slices of
            flat parameters that the model all-gathers itself in every forward (fairscale's
            FSDP, torch's FSDP1 without ``use_orig_params``) pass
            ``PartitionGroup(group, model_gathers=True)``: the sums run over the group,
            nothing is sent before the second pass, which then needs no model.

    Two ways to use it.  With a closure (torch's convention)::

        >>> import torch
        >>> from plugins import VASSO
        >>> model = torch.nn.Linear(4, 2)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        >>> opt = VASSO(model.parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-3)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = torch.nn.functional.cross_entropy(model(x), y)
        ...     loss.backward()
        ...     return loss
        >>> loss = opt.step(closure)
        >>> round(opt.diagnostics["ascent_norm"], 6)
        0.1

    ``opt.step(closure, model=model)`` also keeps ``model``'s BatchNorm running
    statistics from the first pass only.  Or, for loops that own their forward and
    backward (fairseq, DomainBed), the host protocol (``docs/design.md``, section 3)::

        >>> from plugins.perturbation import rng_state
        >>> rng = rng_state()
        >>> opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward()
        >>> if opt.perturb():                  # g_t read from .grad; now at x_t + eps_t
        ...     opt.zero_grad()
        ...     with opt.second_pass(model, rng):   # same RNG, BatchNorm frozen, abandon() on error
        ...         torch.nn.functional.cross_entropy(model(x), y).backward()   # h_t
        >>> opt.descend()                      # back to x_t, base step with h_t
        True

    Both APIs take a stock ``torch.amp.GradScaler``: ``opt.step(closure, scaler=scaler)``,
    or ``opt.perturb(scaler=scaler)`` with ``scaler.step(opt)`` in place of
    :meth:`descend`; ``g_t`` and ``h_t`` are unscaled exactly once, an overflow in
    either pass skips the step (``docs/mixed_precision.md``).  ``opt.diagnostics``
    turns its device values into floats when first read (:class:`Diagnostics`).

    Distributed, the step is the one-process step on the whole batch, on every rank
    (``docs/design.md``, section 7): under DDP nothing changes; under FSDP2 the
    parameters are DTensors and each rank computes on its shard, with one
    ``all_reduce`` of a few floats per decision; under ZeRO / OSS pass
    ``partition_group``.  There the wrapper's ``step()`` calls this one, so the closure
    API is ``zero.step(closure, model=model)`` and the explicit API reaches this
    optimizer as ``zero.optim`` (OSS: ``oss.optim``)::

        rng = plugins.rng_state()
        loss(model, batch).backward()
        if zero.optim.perturb():              # this rank's parameters to x_t + eps_t
            zero.zero_grad()
            with zero.optim.second_pass(model, rng):   # the others' arrive first
                loss(model, batch).backward()
        zero.step()                           # descend(), then the wrapper's own sync

    Every rank must call these alike (they hold collectives); the first step also
    checks, with one collective, that plain tensors on several ranks are replicas
    without ``partition_group`` and not with it.
    """

    def __init__(self, params: Params, base_optimizer, rho: float = 0.05, *, theta: Optional[float] = None,
                 adaptive: bool = False, eta: float = 0.01, gsam_alpha: float = 0.0, p: float = 1.0,
                 seed: int = 0, rho_min: Optional[float] = None, lr_max: Optional[float] = None,
                 lr_min: float = 0.0, track_stability: bool = True, exact_restore: bool = False,
                 partition_group=None, **base_kwargs):
        # (name, tensor) pairs -> "param_names" here, as torch >= 2.5 does: older torch refuses them
        params = normalize_param_groups(params)
        rho = check("rho", rho)
        self.theta = None if theta is None else check("theta", theta)
        self.adaptive = check("adaptive", adaptive)
        self.eta = check("eta", eta)
        self.gsam_alpha = check("gsam_alpha", gsam_alpha)
        self.p = check("p", p)
        self.seed = check("seed", seed)
        self.rho_min = check("rho_min", rho_min)
        if self.rho_min is not None:
            check("rho_min", self.rho_min, within=Range(0.0, rho, "[]"))
        self.lr_min = check("lr_min", lr_min)
        self.track_stability = check("track_stability", track_stability)
        self.exact_restore = check("exact_restore", exact_restore)
        # PartitionGroup(group, model_gathers=True): flat shards that the model all-gathers itself
        self._model_gathers = isinstance(partition_group, D.PartitionGroup) and partition_group.model_gathers
        self.partition_group = check("partition_group", partition_group)
        # split over several ranks (a group of one rank: this rank's parameters are its own)
        self._partitioned = (self.partition_group is not None
                             and torch.distributed.get_world_size(self.partition_group) > 1)
        # the second pass must send each owner's parameters at x + eps to the other ranks
        self._exchanges = self._partitioned and not self._model_gathers
        if self._model_gathers and self.adaptive:
            raise ValueError("adaptive=True with PartitionGroup(model_gathers=True): adaptive geometry scales "
                             "weight tensors and leaves biases alone, and a slice of a flat parameter vector no "
                             "longer tells them apart; use plain geometry (adaptive=False) there")

        super().__init__(params, defaults={"rho": rho})
        if isinstance(base_optimizer, torch.optim.Optimizer):
            if base_kwargs:
                raise ValueError(f"base_optimizer is already built: unexpected keyword arguments {sorted(base_kwargs)}")
            mine = {id(q) for g in self.param_groups for q in g["params"]}
            theirs = {id(q) for g in base_optimizer.param_groups for q in g["params"]}
            if mine != theirs:
                raise ValueError("base_optimizer must optimize exactly the parameters given to this optimizer "
                                 f"({len(mine)} given, base has {len(theirs)}, {len(mine & theirs)} in common)")
            self.base_optimizer = base_optimizer
            for group in base_optimizer.param_groups:
                group.setdefault("rho", rho)
        elif isinstance(base_optimizer, type) and issubclass(base_optimizer, torch.optim.Optimizer):
            self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        else:
            raise ValueError(f"base_optimizer must be a torch.optim.Optimizer subclass or instance, got {base_optimizer!r}")
        # One list of groups for both objects: a scheduler on either drives the lr (and rho) used.
        self.param_groups = self.base_optimizer.param_groups
        self.base_optimizer.defaults.setdefault("rho", rho)  # groups added later get it too
        self.defaults = self.base_optimizer.defaults
        self._group_rho()  # groups given with their own rho must agree
        if self.rho_min is not None:
            self.lr_max = check("lr_max", float(self.param_groups[0]["lr"]) if lr_max is None else lr_max)
            if self.lr_max <= self.lr_min:
                raise ValueError(f"lr_max must be in ({self.lr_min:g}, inf) (above lr_min), got {self.lr_max!r}")
        else:
            self.lr_max = check("lr_max", lr_max)

        self.in_second_pass = False
        self.diagnostics: Diagnostics = self._empty_diagnostics()
        self._step = 0
        self._nonfinite_steps = 0
        self._previous: Optional[Dict[str, float]] = None  # norms of the last applied ascent
        self._scratch: Dict[torch.Tensor, Dict[str, torch.Tensor]] = defaultdict(dict)
        self._pending: Optional[Dict[str, Any]] = None  # the step between perturb() and descend()
        self._lists: Optional[_StepLists] = None
        # This wrapper's per-parameter buffers ("slope", "previous_ascent").  ``opt.state`` shows
        # them merged with the base optimizer's state, in torch's shape (``_MergedState``).
        self._own_state: Dict[torch.Tensor, Dict[str, Any]] = defaultdict(dict)
        self.state = _MergedState(self)
        self._exchange: Dict[str, Any] = {}  # partition_group: the AscentExchange of the model
        self._split_checked = False  # Layout.check_split, on the first step
        if self.partition_group is not None and any(D.is_dtensor(q) for q in self._all_params()):
            raise ValueError("partition_group must be None for DTensor parameters (FSDP2, fully_shard): they "
                             "carry their device mesh, over which the step reduces; partition_group names the "
                             "ranks of plain tensors split by hand or by ZeroRedundancyOptimizer / OSS")

    # ------------------------------------------------------------------ plumbing

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        param_group = normalize_param_group(param_group)
        if hasattr(self, "base_optimizer"):
            self.base_optimizer.add_param_group(param_group)
            self._group_rho()
        else:
            super().add_param_group(param_group)

    @staticmethod
    def _empty_diagnostics() -> "Diagnostics":
        return Diagnostics({"two_pass": 0.0, "ascent_norm": _NAN, "sharpness": _NAN, "stability": _NAN,
                            "loss_gap": _NAN, "nonfinite": 0.0, "rho": _NAN})

    # ------------------------------------------------------------------ rho

    def _group_rho(self) -> float:
        """The one rho every param group holds (one global ascent norm), checked."""
        groups = self.param_groups
        rho = groups[0].get("rho") if groups else self.defaults["rho"]
        for group in groups:
            if group.get("rho", rho) != rho:
                values = ", ".join(f"group {i}: {g.get('rho')!r}" for i, g in enumerate(groups))
                raise ValueError("rho must be the same in every param group (one global ascent norm), got "
                                 + values)
        return check("rho", rho, name="param_groups' rho")

    @property
    def rho(self) -> float:
        """The neighbourhood's radius, held in every param group (``group["rho"]``), so
        that a scheduler can drive it; with ``rho_min`` set it is GSAM's ``rho_max``."""
        return self._group_rho()

    @rho.setter
    def rho(self, value: float) -> None:
        value = check("rho", value)
        for group in self.param_groups:
            group["rho"] = value
        self.defaults["rho"] = value

    def current_rho(self) -> float:
        """The rho the next step uses: the groups' rho, or GSAM's schedule from the first
        group's lr when ``rho_min`` is set (:func:`plugins.perturbation.scheduled_rho`)."""
        rho = self._group_rho()
        if self.rho_min is None:
            return rho
        lr = float(self.param_groups[0]["lr"])
        return P.scheduled_rho(rho, self.rho_min, lr, self.lr_max, self.lr_min)  # refuses an lr below lr_min

    # ------------------------------------------------------------------ per-step lists

    def _step_lists(self) -> "_StepLists":
        """The parameters with a gradient and what the step needs about them, cached
        while that set is unchanged (one list comprehension per step on a hit)."""
        params = [q for group in self.param_groups for q in group["params"] if q.grad is not None]
        cached = self._lists
        if cached is not None and len(cached.params) == len(params) and all(
                map(operator.is_, cached.params, params)):
            return cached
        names: List[Optional[str]] = []
        for group in self.param_groups:
            group_names = group.get("param_names")
            for i, q in enumerate(group["params"]):
                if q.grad is not None:
                    if q.grad.is_sparse:
                        raise RuntimeError("sharpness-aware optimizers do not support sparse gradients")
                    names.append(group_names[i] if group_names is not None else None)
        layout = D.Layout(params, self.partition_group, model_gathers=self._model_gathers)
        self._lists = lists = _StepLists(params, names, self.adaptive, layout)
        return lists

    def _buffers(self, lists: "_StepLists", key: str, like: List[torch.Tensor], *, scratch: bool = False,
                 zeros: bool = False) -> List[torch.Tensor]:
        """Per-parameter buffers named ``key`` (in ``state``, or the per-step scratch),
        allocated on first use as copies of ``like`` (or zeros of its shape): the
        parameters or their gradients, DTensors for DTensor parameters (so the state is
        sharded as they are).  Returns this rank's local parts (:func:`plugins.distributed.local`)."""
        out = lists.buffers.get(key)
        if out is not None:
            return out
        store = self._scratch if scratch else self._own_state
        out = []
        for q, src in zip(lists.params, like):
            buf = store[q].get(key)
            if buf is None:
                src = src.detach()
                if D.is_dtensor(q):  # a DTensor sharded as q, its local part from src
                    buf = torch.empty_like(q.detach(), dtype=src.dtype)
                    D.local(buf).zero_() if zeros else D.local(buf).copy_(src)
                else:
                    buf = torch.zeros_like(src) if zeros else src.clone(memory_format=torch.preserve_format)
                store[q][key] = buf
            out.append(D.local(buf))
        lists.buffers[key] = out
        return out

    def _skip_nonfinite(self, which: str, scaled: bool) -> None:
        """Count a step skipped for a non-finite gradient; warn unless a loss scaler is
        in charge (an overflow is then its routine signal to back the scale off)."""
        self._nonfinite_steps += 1
        self.diagnostics["nonfinite"] = 1.0
        if not scaled:
            warnings.warn(f"{type(self).__name__}: non-finite {which} gradient at step {self._step}; "
                          f"the step is skipped ({self._nonfinite_steps} skipped so far)", RuntimeWarning,
                          stacklevel=4)

    @property
    def nonfinite_steps(self) -> int:
        """How many steps were skipped for a non-finite gradient."""
        return self._nonfinite_steps

    @property
    def in_flight(self) -> bool:
        """True between :meth:`perturb` and :meth:`descend` / :meth:`abandon`."""
        return self._pending is not None

    @property
    def num_steps(self) -> int:
        """Steps started so far (the coin of step t is a function of (seed, t))."""
        return self._step

    # ------------------------------------------------------------------ the explicit API

    @torch.no_grad()
    def perturb(self, scaler=None, *, loss=None) -> bool:
        """First half of a step: read ``g_t`` from ``.grad`` and move to ``x_t + eps_t``.

        Returns True when the caller must now clear the gradients and run the second
        forward/backward on the same batch inside :meth:`second_pass`, then call
        :meth:`descend`.  Returns False when no second pass is wanted: the coin
        skipped it (``.grad`` still holds ``g_t``) or ``g_t`` was not finite (the
        step will be skipped); call :meth:`descend` all the same.

        ``scaler``: the ``torch.amp.GradScaler`` the backward went through
        (``scaler.scale(loss).backward()``).  ``g_t`` is unscaled on the device before
        anything uses it, and the step is finished by ``scaler.step(opt)`` instead of
        :meth:`descend` (``docs/mixed_precision.md``).  None or a disabled scaler: no scaling.

        ``loss``: the first pass's loss (optional); handed over with the second's to
        :meth:`descend` it gives ``diagnostics["loss_gap"]``, as ``step(closure)`` records it.
        """
        if self._pending is not None:
            raise RuntimeError("perturb() called twice: finish the step with descend() or abandon() first")
        rho = self.current_rho()  # may refuse: before anything moves
        lists = self._step_lists()
        layout = lists.layout
        # plain tensors on several ranks: replicas, or split over partition_group?  Checked on the
        # first step only: a later change of the set of parameters with a gradient may be one
        # rank's alone (under ZeRO), whose collective the others would not join
        if not self._split_checked:
            layout.check_split(lists.params)
            self._split_checked = True
        params, grads = lists.local_params(), lists.local_grads()
        loss_scale = _loss_scale(scaler, grads)
        scaled = loss_scale is not None
        step = self._step
        self._step += 1
        self.diagnostics = diag = self._empty_diagnostics()
        diag["rho"] = rho
        # (every rank decides alike where the step's sums cross ranks, whatever it holds)
        two_pass = (len(params) > 0 or layout.collective) and P.second_pass_coin(self.p, self.seed, step)
        vasso = self.theta is not None
        if scaled and two_pass:  # the second backward overwrites .grad: unscale g_t where it is
            P.unscale(grads, loss_scale, in_place=True)
        # The stability from scalars alone works where the previous ascent is
        # recoverable from what the slope buffer holds before this step writes it.
        scalar_stability = self.track_stability and not self.adaptive and (not vasso or self.p >= 1.0)
        want_inner = scalar_stability and two_pass and self._previous is not None

        # One reduction, one host sync: ||g_t|| (finiteness, SAM's ||v_t||), for the
        # scalar stability <g_t, v_last> (SAM: g of the last ascent; VASSO: d_{t-1}), and
        # VASSO's ||d_t|| from d_{t-1} and g_t before d_t is written (the ascent's scale).
        # A step the coin skips with a scaler reads only the finiteness of the scaled g_t.
        slopes = lists.buffers.get("slope")
        # Where the sums cross ranks, a step whose set of parameters with a gradient changed
        # (no slope list yet) takes each one's kept slope, and d_0 = g_0 (no previous
        # slope) for the new ones, so that its sums ride along too, as every step's.
        kept = self._kept_slopes(lists) if slopes is None and two_pass and layout.collective else None
        previous = slopes if kept is None else [g if s is None else s for g, s in zip(grads, kept)]
        terms = [(grads, None)]
        inner_index = None
        if want_inner and (slopes is not None or kept is not None):
            inner_index = len(terms)
            terms.append((grads, slopes if kept is None else
                          [torch.zeros_like(g) if s is None else s for g, s in zip(grads, kept)]))
        fused_index = computed = None
        if vasso and two_pass and previous is not None:
            if lists.fuse_average_norm and not lists.low_precision:
                fused_index = len(terms)
                terms.append((previous, grads, self.theta))
            elif lists.fuse_average_norm:
                # fp16/bf16: d_t as rounded in its dtype (a float32 formula would agree only
                # to their rounding), computed before the reduction so that its norm rides
                # along, into the anchor buffers: they hold x_t only from after the slope
                # buffers took d_t (g_t finite) until the restore
                computed = self._buffers(lists, "anchor", params, scratch=True)
                _copy_(computed, previous)
                P.update_moving_average(computed, grads, self.theta)
                fused_index = len(terms)
                terms.append((computed, None))
        # Where the sums cross ranks, adaptive geometry's ||T v_t|| rides along too (the
        # ascent needs it before the second pass: a collective of its own otherwise).
        tv_index = None
        if self.adaptive and two_pass and layout.collective:
            ts = [P.adaptive_scale(x, self.eta) if m else torch.ones_like(x) for x, m in zip(params, lists.mask)]
            tv_index = len(terms)
            # v_t = d_t from d_{t-1} and g_t; SAM's (and VASSO's d_0) is g_t itself
            terms.append((computed, computed, 1.0, ts) if computed is not None else
                         (previous, grads, self.theta, ts) if vasso and previous is not None else
                         (grads, grads, 1.0, ts))
        # partition_group, once the model's exchange is known (built by an earlier second
        # pass): the sums and every rank's ascent directions travel in one all_gather, and
        # each rank moves the other owners' parameters itself (docs/design.md, section 7)
        exchange = self._exchange.get("exchange") if self._partitioned and two_pass else None
        if exchange is not None:
            send, directions = exchange.directions(lists.params)
            if directions:
                if computed is not None:
                    _copy_(directions, computed)
                elif vasso and previous is not None:
                    _copy_(directions, previous)
                    P.update_moving_average(directions, grads, self.theta)
                    if not self.adaptive:  # d_t itself: the slope buffers take it once g_t is known finite
                        computed = directions
                else:  # SAM's v_t, and VASSO's d_0 = g_0
                    _copy_(directions, grads)
                if self.adaptive:
                    P.adaptive_direction_(directions, params, lists.mask, self.eta)
            gathered = exchange.gather(send, P.local_sums(terms, lists.plan, layout), directions is not None)
            values = P.finish_sums(terms, gathered).tolist()
            incomplete = values.pop() > 0
            if incomplete or not math.isfinite(values[0]):  # nothing moves from the directions:
                exchange.release()  # a non-finite g_t, or some rank could not place its own (share() them)
                exchange = None
                if incomplete:  # its optimizer holds a parameter the exchange does not: every rank
                    self._exchange.clear()  # builds it anew in second_pass() (collectively), then shares
        elif params or layout.collective:
            values = P.reductions(terms, lists.plan, layout=layout).tolist()
        else:
            values = [0.0]
        grad_norm = values[0]
        if not math.isfinite(grad_norm):
            self._pending = {"kind": "nonfinite", "scaled": scaled}
            self._skip_nonfinite("first-pass", scaled)
            return False
        inner_previous = None
        if want_inner:  # <g_t, v_last>, as VASSO's <d_t, d_{t-1}> further down
            inner_previous = (values[inner_index] if inner_index is not None
                              else self._inner_with_kept_slopes(lists, grads))

        if scaled and not two_pass and vasso:  # d_t needs g_t unscaled; .grad stays as the scaler left it
            slopes, slope_norm = self._update_slope(lists, P.unscale(grads, loss_scale, in_place=False),
                                                    grad_norm, two_pass, None)
        else:
            slopes, slope_norm = self._update_slope(lists, grads, grad_norm, two_pass,
                                                    values[fused_index] if fused_index is not None else None,
                                                    computed)
        if vasso and inner_previous is not None:
            inner_previous = P.moving_average_inner(self.theta, self._previous["slope_norm"], inner_previous)
        if not two_pass:
            self._pending = {"kind": "first_gradient", "lists": lists, "scaled": scaled}
            return False

        first_grads = None
        if self.gsam_alpha > 0.0:
            if vasso:  # V+G: the correction takes g_t, which d_t does not keep
                first_grads = self._buffers(lists, "first_grad", grads, scratch=True)
                _copy_(first_grads, grads)
            else:
                first_grads = slopes
        anchors = None
        if self.exact_restore or self.adaptive or lists.low_precision:
            anchors = self._buffers(lists, "anchor", params, scratch=True)
            _copy_(anchors, params)

        # Where the sums cross ranks, the diagnostics' own sums (adaptive ||eps_t||, the
        # buffered stability's inner product) are summed with descend()'s reduction.
        deferred: Optional[list] = [] if layout.collective else None
        eps, scale, ascent_norm, sharpness = self._ascend(
            lists, slopes, slope_norm, rho, values[tv_index] if tv_index is not None else None, deferred)
        _moved_parameters()
        diag.update(two_pass=1.0, ascent_norm=ascent_norm, sharpness=sharpness)
        if self.track_stability:
            diag["stability"] = self._stability(lists, grads, slopes, eps, scale, ascent_norm, inner_previous,
                                                scalar_stability, deferred)
        self._previous = {"rho": rho, "slope_norm": slope_norm, "ascent_norm": ascent_norm}

        self._pending = {"kind": "perturbed", "lists": lists, "params": params, "slopes": slopes, "scale": scale,
                         "anchors": anchors, "first_grads": first_grads, "rho": rho, "at_ascent": True,
                         "scaled": scaled, "exchange": None, "second_pass": False,
                         "first_loss": loss.detach() if torch.is_tensor(loss) else loss,
                         "deferred": (torch.cat([part for part, _ in deferred]), [f for _, f in deferred], diag,
                                      self._previous) if deferred else None}
        if exchange is not None:  # the other owners' parameters, moved as they moved theirs
            try:
                self._pending["exchange"] = exchange
                others, directions = exchange.arrived()
                P.ascend_along_(others, directions, rho, values[tv_index] if self.adaptive else slope_norm,
                                adaptive=self.adaptive)
            except BaseException:
                self.abandon()
                raise
        return True

    def _kept_slopes(self, lists: "_StepLists") -> List[Optional[torch.Tensor]]:
        """Each parameter's slope buffer (its local part), None where it has none yet: for a
        step whose set of parameters with a gradient changed."""
        own = self._own_state
        return [D.local(own[q]["slope"]) if "slope" in own.get(q, ()) else None for q in lists.params]

    def _update_slope(self, lists: "_StepLists", grads: List[torch.Tensor], grad_norm: float, two_pass: bool,
                      fused_norm: Optional[float], computed: Optional[List[torch.Tensor]] = None):
        """The slope buffers after this step and ``||v_t||`` (NaN where no ascent is built).
        ``computed``: VASSO's ``d_t``, computed before the step's reduction (fp16/bf16
        parameters, in the anchor buffers; under ``partition_group``, the direction the
        exchange sent), now copied into the slope buffers."""
        slopes = lists.buffers.get("slope")
        if self.theta is None:  # SAM: the slope is g_t, kept only on two-pass steps
            if two_pass:
                if slopes is None:
                    slopes = self._buffers(lists, "slope", grads)
                _copy_(slopes, grads)
            return slopes, grad_norm
        # VASSO: d_t is updated on every step, skipped or not (Alg. 2, line 5)
        kept = None
        if computed is not None:
            slopes = self._buffers(lists, "slope", grads) if slopes is None else slopes
            _copy_(slopes, computed)
        elif slopes is None:  # new buffers start at d_0 = g_0
            fresh = {id(q) for q in lists.params if "slope" not in self._own_state.get(q, ())}
            slopes = self._buffers(lists, "slope", grads)
            kept = [i for i, q in enumerate(lists.params) if id(q) not in fresh]
            if kept:
                P.update_moving_average([slopes[i] for i in kept], [grads[i] for i in kept], self.theta)
        else:
            P.update_moving_average(slopes, grads, self.theta)
        if not two_pass:
            return slopes, _NAN  # a skipped step needs no ||d_t||
        if fused_norm is not None:
            return slopes, fused_norm
        if kept == []:  # every d_0 = g_0, copied exactly (in g's dtype): ||d_0|| = ||g_0||
            return slopes, grad_norm
        return slopes, float(P.global_norm(slopes, lists.plan, lists.layout))

    def _ascend(self, lists: "_StepLists", slopes: List[torch.Tensor], slope_norm: float, rho: float,
                tv_norm: Optional[float] = None, deferred: Optional[list] = None):
        """Move to ``x_t + eps_t``; returns ``(eps or None, s or None, ||eps_t||, sharpness)``:
        plain geometry adds ``s v_t`` without materializing ``eps``.  ``tv_norm``: adaptive
        geometry's ``||T v_t||`` when reduced already; ``deferred``: where the partial sum
        of ``||eps_t||`` goes when it is to be reduced with descend()'s (NaN until then)."""
        params = lists.local_params()
        eps, scale, scaled_norm = P.ascend_(params, slopes, rho, tv_norm if self.adaptive else slope_norm,
                                            adaptive_mask=lists.mask, eta=self.eta, plan=lists.plan,
                                            layout=lists.layout)
        if not self.adaptive:
            return None, scale, P.plain_ascent_norm(rho, slope_norm), P.estimated_sharpness(rho, slope_norm)
        sharpness = P.estimated_sharpness(rho, scaled_norm if tv_norm is None else tv_norm)
        if deferred is not None:
            def finish(values, diag, previous):
                previous["ascent_norm"] = diag["ascent_norm"] = math.sqrt(max(values[0], 0.0))
            deferred.append((P.local_sums([(eps, None)], lists.plan, lists.layout), finish))
            return eps, None, _NAN, sharpness
        # device tensors: the diagnostics read them lazily (no host sync here)
        return eps, None, P.global_norm(eps, lists.plan, lists.layout), sharpness

    def _stability(self, lists, grads, slopes, eps, scale, ascent_norm, inner_previous, scalar: bool,
                   deferred: Optional[list] = None):
        """``||eps_t - eps_{t-1}||`` (NaN on the first ascent): from scalars where the slope
        buffer still told ``<v_t, v_{t-1}>``, else from the kept ``previous_ascent``; a
        0-dim device tensor (read lazily by the diagnostics) where an inner product of
        buffers enters it."""
        previous = self._previous
        if scalar:
            if inner_previous is None:
                return _NAN
            return P.plain_stability(scale, P.plain_ascent_scale(previous["rho"], previous["slope_norm"]),
                                     inner_previous, ascent_norm, previous["ascent_norm"])
        kept = self._buffers(lists, "previous_ascent", grads, zeros=True)
        stability = _NAN
        if previous is not None and deferred is not None:  # the inner product reduced in descend()
            term = (eps, kept) if eps is not None else (slopes, kept)
            factor = 1.0 if eps is not None else scale
            previous_norm = previous["ascent_norm"]

            def finish(values, diag, now):
                diag["stability"] = P.distance_between_ascents(now["ascent_norm"], previous_norm, factor * values[0])
            deferred.append((P.local_sums([term], lists.plan, lists.layout), finish))
        elif previous is not None:
            if eps is not None:
                inner = P.reductions([(eps, kept)], lists.plan, layout=lists.layout)[0]
            else:
                inner = scale * P.reductions([(slopes, kept)], lists.plan, layout=lists.layout)[0]
            stability = P.distance_between_ascents(ascent_norm, previous["ascent_norm"], inner)
        if eps is not None:
            _copy_(kept, eps)
        else:
            _copy_(kept, slopes)
            if kept:
                torch._foreach_mul_(kept, scale)
        return stability

    def _inner_with_kept_slopes(self, lists, grads) -> torch.Tensor:
        """``<g_t, v_last>`` over the parameters that have a slope buffer (the set of
        parameters with a gradient changed since the last step), as a device tensor."""
        layout = lists.layout
        counted = range(len(grads)) if layout.counted is None else layout.counted
        kept = self._kept_slopes(lists)
        pairs = [(grads[i], kept[i]) for i in counted if kept[i] is not None]
        return P.dot([g for g, _ in pairs], [v for _, v in pairs], layout.unfiltered())

    @torch.no_grad()
    def restore(self) -> None:
        """Put the parameters back at ``x_t``; a no-op unless they sit at ``x_t + eps_t``."""
        pending = self._pending
        if pending is None or pending["kind"] != "perturbed" or not pending["at_ascent"]:
            return
        params = pending["params"]
        if pending["anchors"] is not None:
            _copy_(params, pending["anchors"])
        elif params:
            torch._foreach_add_(params, pending["slopes"], alpha=-pending["scale"])
        if pending["exchange"] is not None:  # partition_group: the other owners' parameters too
            pending["exchange"].restore()
        pending["at_ascent"] = False
        _moved_parameters()

    def abandon(self) -> None:
        """Restore and drop the step in flight without a base step (the host skipped the update)."""
        self.restore()
        self._pending = None
        self.in_second_pass = False

    def descend(self, *, loss=None) -> bool:
        """Second half of a step: restore ``x_t`` and let the base optimizer step.

        The base step uses ``h_t`` from ``.grad`` after a second pass (GSAM-corrected
        when ``gsam_alpha > 0``), else ``g_t``.  Returns True iff a base step was
        taken; a non-finite ``g_t`` or ``h_t`` skips it (with a warning).  A step
        started with ``perturb(scaler=...)`` is finished by ``scaler.step(opt)``
        (``scaler.step(opt, loss=second)``).  ``loss``: the second pass's loss, for
        ``diagnostics["loss_gap"]`` when :meth:`perturb` got the first's.
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("descend() without perturb(): call perturb() after the first backward")
        if pending["scaled"]:
            raise RuntimeError(_SCALED_STEP)
        # Through step() (closure-less: _finish_step), the attribute that torch's LR schedulers
        # wrap to learn that the optimizer stepped (and that step hooks run around), so a
        # scheduler sees this step as taken, as it does scaler.step(opt)'s.
        return self.step(loss=loss)

    def _record_loss_gap(self, second) -> None:
        """``loss_gap`` of the step in flight from the losses the explicit API was handed."""
        pending = self._pending
        if (second is not None and pending is not None and pending["kind"] == "perturbed"
                and pending["first_loss"] is not None):
            self._set_loss_gap(_loss_gap(pending["first_loss"], second))

    def _descend(self, grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None) -> bool:
        """:meth:`descend`, then the wait for the loss gap's ``all_reduce`` (issued before
        this step's last reduction, so on gloo it is done by now and on NCCL the wait is
        the stream's): no collective outlives its step, nor the process group at exit."""
        try:
            return self._descend_step(grad_scale, found_inf)
        finally:
            self.diagnostics.wait()

    @torch.no_grad()
    def _descend_step(self, grad_scale: Optional[torch.Tensor] = None,
                      found_inf: Optional[torch.Tensor] = None) -> bool:
        """:meth:`descend`'s work; with a scaler, ``grad_scale`` is the scale ``.grad`` still
        carries (None once ``scaler.unscale_(opt)`` ran) and ``found_inf`` the scaler's
        verdict on it (``GradScaler.step`` hands both over)."""
        pending = self._pending
        if pending["kind"] == "perturbed" and self._exchanges and not pending["second_pass"]:
            self.abandon()  # the second pass ran with the other ranks' parameters at x_t: its h_t is wrong
            raise RuntimeError(_PARTITION_MODEL.replace("the second pass needs", "the second pass ran outside "
                                                        "second_pass(model, rng); it needs"))
        self.restore()
        self._pending = None
        self.in_second_pass = False
        if pending["kind"] == "nonfinite":
            return False
        lists = pending["lists"]
        layout = lists.layout
        if pending["kind"] == "first_gradient":  # g_t, found finite by perturb(): nothing to decide again
            if grad_scale is not None:
                P.unscale(lists.local_grads(), grad_scale, in_place=True)
            self._base_step()
            return True
        firsts = pending["first_grads"]
        second = lists.local_grads(missing_ok=True)
        plan = lists.plan
        if any(h is None for h in second):  # a parameter got no gradient in the second pass
            if layout.counted is not None:  # keep the indices: zeros count for nothing
                second = [torch.zeros_like(q) if h is None else h for q, h in zip(pending["params"], second)]
            else:
                keep = [i for i, h in enumerate(second) if h is not None]
                second = [second[i] for i in keep]
                firsts = None if firsts is None else [firsts[i] for i in keep]
                plan = None
        if grad_scale is not None and second:
            P.unscale(second, grad_scale, in_place=True)
        # rho = 0: h == g
        gsam = self.gsam_alpha > 0.0 and pending["rho"] > 0.0 and (len(second) > 0 or layout.collective)
        # One host sync: is h_t finite (the scaler's verdict when it has one, else ||h_t||),
        # with GSAM's ||h_t|| and <g_t, h_t> from the same read; where the sums cross
        # ranks, the one all_reduce carries the scaler's verdict too (the same on every rank).
        terms = [(second, None)] + ([(firsts, second)] if gsam else [])
        if layout.collective:  # the diagnostics' partial sums and the scaler's verdict ride along
            deferred = pending.get("deferred")
            extra = ([deferred[0]] if deferred else []) + ([found_inf] if found_inf is not None else [])
            values = P.reductions(terms, plan, layout=layout, extra=extra).tolist()
            if found_inf is not None:
                finite, values = values[-1] == 0.0, values[:-1]
            else:
                finite = math.isfinite(values[0])
            if deferred:
                sums, finishers, diag, previous = deferred
                at = len(terms)
                for finish in finishers:
                    finish(values[at:], diag, previous)
                    at += 1
                values = values[:len(terms)]
        elif found_inf is not None:
            reduced = P.reductions(terms, plan) if gsam else None
            verdict = found_inf.detach().reshape(1).double()
            if reduced is not None:
                verdict = torch.cat([verdict.to(reduced.device), reduced])
            values = verdict.tolist()
            finite, values = values[0] == 0.0, values[1:]
        else:
            values = P.reductions(terms, plan, layout=layout).tolist() if second or layout.collective else [0.0]
            finite = math.isfinite(values[0])
        if not finite:
            self._skip_nonfinite("second-pass", pending["scaled"])
            return False
        if gsam:
            present = [i for i, h in enumerate(lists.local_grads(missing_ok=True)) if h is not None]
            if len(present) < len(second):  # zeros stood in for the missing h: correct the others
                second, firsts = [second[i] for i in present], [firsts[i] for i in present]
            P.gsam_correct(second, firsts, self.gsam_alpha, h_norm=values[0], g_dot_h=values[1])
        self._base_step()
        return True

    def _base_step(self) -> None:
        self.base_optimizer.step()
        _moved_parameters()

    @contextlib.contextmanager
    def second_pass(self, model: Optional[torch.nn.Module] = None, rng: Optional[tuple] = None) -> Iterator[None]:
        """The second forward/backward, at ``x_t + eps_t``, as every host runs it::

            rng = plugins.perturbation.rng_state()      # before the first forward
            ...first forward/backward...
            if opt.perturb():
                opt.zero_grad()
                with opt.second_pass(model, rng):
                    ...second forward/backward...
            opt.descend()

        Inside the block ``in_second_pass`` is True, the RNG state ``rng`` of the
        first pass is replayed (same dropout masks) and ``model``'s BatchNorm layers
        keep their running statistics from the first pass only.  An exception puts
        the parameters back at ``x_t`` and drops the step (:meth:`abandon`).
        """
        pending = self._pending
        if pending is None or pending["kind"] != "perturbed":
            raise RuntimeError("second_pass() without a perturbation: enter it only when perturb() returned True")
        if self._exchanges:
            if model is None:
                self.abandon()
                raise ValueError(_PARTITION_MODEL)
            try:  # the other ranks' parameters at x + eps, before the second forward
                exchange = D.exchange_for(self._exchange, model, self._all_params(), self.partition_group)
                if pending["exchange"] is not exchange:  # perturb() did not move them for this model
                    if pending["exchange"] is not None:
                        pending["exchange"].restore()
                    pending["exchange"] = exchange
                    exchange.share()
                pending["second_pass"] = True
            except BaseException:
                self.abandon()
                raise
        if rng is not None:
            P.set_rng_state(rng)
        self.in_second_pass = True
        try:
            with (P.frozen_running_stats(model) if model is not None else contextlib.nullcontext()):
                yield
        except BaseException:
            self.abandon()
            raise
        finally:
            self.in_second_pass = False

    # ------------------------------------------------------------------ the ecosystem's names

    def _drop_grads(self) -> None:
        """``zero_grad(set_to_none=True)`` as a plain loop: half its cost on many small tensors."""
        for group in self.param_groups:
            for q in group["params"]:
                q.grad = None

    def first_step(self, zero_grad: bool = False, *, loss=None) -> bool:
        """:meth:`perturb` under the name davda54/sam, pytorch_optimizer and the official
        VaSSO code use: ascend from the gradients in ``.grad``; ``zero_grad=True`` clears
        them afterwards.  Returns whether the second pass is wanted (False when the
        coin of ``p < 1`` skips it, or ``g_t`` is not finite).

        A loop written for those libraries runs the second pass whatever this returns;
        :meth:`second_step` then ignores that pass's gradients and steps with ``g_t``,
        which is kept for it on skipped steps: the ``.grad`` tensors themselves with
        ``zero_grad=True`` (no copy), else a copy of them, until :meth:`second_step`.
        ``loss``: the first pass's loss, for ``loss_gap`` (as in :meth:`perturb`).

        Not under ``partition_group`` (but with ``model_gathers=True``): those loops run the
        second pass outside :meth:`second_pass`, where the other ranks' parameters could not arrive.
        """
        if self._exchanges:
            raise ValueError("first_step()/second_step() run the second pass outside second_pass(), so under "
                             "partition_group the other ranks' parameters would stay at x_t: use "
                             "step(closure, model=model), or perturb(), second_pass(model, rng) and descend()")
        wanted = self.perturb(loss=loss)
        pending = self._pending
        if pending["kind"] == "first_gradient":  # the coin skipped: keep g_t for second_step
            params = self._step_lists().params
            pending["kept_grads"] = (params, [q.grad if zero_grad else q.grad.clone() for q in params])
        if zero_grad:
            self.zero_grad()
        return wanted

    def second_step(self, zero_grad: bool = False, *, loss=None) -> bool:
        """:meth:`descend` under the ecosystem's name: back to ``x_t``, base step with
        the gradients in ``.grad`` (``g_t`` when :meth:`first_step` returned False);
        ``zero_grad=True`` clears them afterwards.  Returns True iff a base step was taken.
        ``loss``: the second pass's loss, for ``loss_gap`` (as in :meth:`descend`)."""
        pending = self._pending
        if pending is None:
            raise RuntimeError("second_step() without first_step(): call first_step() after the first backward")
        kept = pending.get("kept_grads")
        if kept is not None:  # whatever a second pass left in .grad is not this step's gradient
            self._drop_grads()
            for q, g in zip(*kept):
                q.grad = g
        taken = self.descend(loss=loss)
        if zero_grad:
            self.zero_grad()
        return taken

    # ------------------------------------------------------------------ the closure API

    # GradScaler.step(opt) calls step() itself, handing over its scale and overflow flag as
    # the attributes grad_scale and found_inf (torch's protocol for optimizers that unscale
    # themselves), so that the one overflow decision is the scaler's and costs no host sync there.
    _step_supports_amp_scaling = True

    def step(self, closure: Closure = None, model: Optional[torch.nn.Module] = None, scaler=None, *, loss=None,
             **unexpected):
        """One full step.  ``closure`` computes the loss, calls ``backward()`` and
        returns the loss; it runs at ``x_t`` and, unless the coin skips, at
        ``x_t + eps_t`` inside :meth:`second_pass` (the same RNG state, so the same
        dropout masks; ``in_second_pass`` is True).  Given ``model``, its BatchNorm
        running statistics come from the first call only.  Returns the first loss.

        The gradients are cleared before each call, so a closure that does not clear
        them (davda54/sam's, pytorch_optimizer's and the official VaSSO code's, whose
        loops run the first backward before ``step``) gets the right step too; that
        loop's own first backward is then wasted work (``docs/migration.md``).

        ``scaler``: a ``torch.amp.GradScaler`` whose ``scale(loss).backward()`` the
        closure calls; the step goes through ``scaler.step(opt)``, and the caller then
        calls ``scaler.update()`` once (``docs/mixed_precision.md``).

        Without a closure, ``step()`` finishes the step :meth:`perturb` started, as
        :meth:`descend` does: this is what ``scaler.step(opt)`` calls in the explicit
        API.  It then returns True iff a base step was taken, and takes the second
        pass's ``loss`` as :meth:`descend` does (``scaler.step(opt, loss=second)``).
        """
        if unexpected:  # the official VaSSO loop's epoch=, step=, ...: refused, with the port
            raise TypeError(_unexpected_step_arguments(type(self).__name__, unexpected))
        if closure is None:
            return self._finish_step(loss)
        if loss is not None:
            raise TypeError(f"{type(self).__name__}.step(closure, loss=...): the closure returns the losses; "
                            "loss= is for step() without a closure (scaler.step(opt, loss=second))")
        if self._exchanges and model is None:
            raise ValueError(_PARTITION_MODEL)
        rng = P.rng_state()
        self._drop_grads()  # stale gradients (a first backward outside) must not add to g_t
        with torch.enable_grad():
            loss = closure()
        try:
            perturbed = self.perturb(scaler)
        except BaseException:
            self.abandon()
            raise
        if perturbed:
            self._drop_grads()  # nor g_t to h_t
            with self.second_pass(model, rng), torch.enable_grad():
                second = closure()
            if loss is not None and second is not None:
                self._set_loss_gap(_loss_gap(loss, second))
        if self._pending["scaled"]:
            scaler.step(self)  # records the overflow in the scaler, then calls step() to finish
        else:
            self._descend()  # not descend(): this step() is the one torch's wrappers see
        return loss

    def _set_loss_gap(self, gap) -> None:
        """The loss gap of the closure API; on several ranks the mean of the ranks' gaps
        (each rank's loss is its batch slice's mean, as DDP's is, so the mean is the
        one-process gap for equal slices), over ``partition_group`` or the default
        group, by an ``all_reduce`` the diagnostics wait for when first read."""
        dist = torch.distributed
        group = self.partition_group
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            self.diagnostics["loss_gap"] = gap
            return
        lists = self._lists
        device = lists.layout.device if lists is not None else torch.device("cpu")
        gap = (gap.detach().clone() if torch.is_tensor(gap)
               else torch.tensor(gap, dtype=torch.float64)).to(device, torch.float64).reshape(())
        gap.div_(dist.get_world_size(group))
        self.diagnostics["loss_gap"] = gap
        self.diagnostics.wait_for(dist.all_reduce(gap, group=group, async_op=True))

    def _finish_step(self, loss=None) -> bool:
        """``step()`` without a closure: the explicit API's descend, directly or through
        ``scaler.step(opt)`` (which sets ``found_inf`` and ``grad_scale`` around the call)."""
        found_inf = self.__dict__.get("found_inf")
        grad_scale = self.__dict__.get("grad_scale")
        pending = self._pending
        problem = None
        if pending is None and self._is_state_initialization():
            self.base_optimizer.step()  # lr 0, zero gradients: creates the base's state, moves nothing
            return False
        if pending is None:
            problem = (f"{type(self).__name__}.step() needs a closure that re-evaluates the loss; "
                       "loops that own forward/backward use perturb() and descend() (or scaler.step(opt) "
                       "after perturb(scaler=scaler)): no step is in flight")
        elif pending["scaled"] and found_inf is None:
            problem = _SCALED_STEP
        elif not pending["scaled"] and found_inf is not None:
            problem = ("scaler.step(opt) finishes a step whose perturb() was given no scaler, so g_t was used "
                       "scaled: pass the scaler to perturb(scaler=scaler)")
        if problem is not None:
            # GradScaler deletes its attributes only when step() returns: do it here, or
            # a stale grad_scale would multiply into the next scaler.step(opt)
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            raise RuntimeError(problem)
        self._record_loss_gap(loss)
        return self._descend(grad_scale, found_inf)

    # ------------------------------------------------------------------ copy and pickle

    # What a copy leaves out, as torch.optim.Optimizer.__getstate__ does (it keeps defaults,
    # state and param_groups only): the hooks, an LR scheduler's step() wrapper and its flags
    # (a scheduler stays bound to the original); and the step's caches, rebuilt empty.
    _NOT_COPIED = frozenset({"state", "_lists", "_scratch", "_exchange", "step", "_opt_called", "_step_count"})

    def __getstate__(self) -> Dict[str, Any]:
        """``copy.deepcopy`` and ``pickle`` give an independent optimizer that steps as this
        one does, as for torch's optimizers; copy or pickle it together with its model
        (``copy.deepcopy((model, opt))``) so that the copy optimizes the copied parameters.
        Refused in the middle of a step, and with ``partition_group`` (a process group
        cannot be copied): save :meth:`state_dict` there instead."""
        if self._pending is not None:
            raise RuntimeError(f"cannot copy or pickle a {type(self).__name__} in the middle of a step: call "
                               "descend() or abandon() first")
        if self.partition_group is not None:
            raise TypeError(f"cannot copy or pickle a {type(self).__name__} built with partition_group (a process "
                            "group cannot be copied): save its state_dict() and load it into an optimizer built "
                            "on the live group")
        self.diagnostics.wait()
        return {k: v for k, v in self.__dict__.items() if k not in self._NOT_COPIED and not k.startswith("_optimizer_")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)  # torch's: empty hooks, its step() profiling wrapper
        self.state = _MergedState(self)
        self._lists = None
        self._scratch = defaultdict(dict)
        self._exchange = {}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict: ``{"state": {index: {...}}, "param_groups": [...]}``.

        Each parameter's entry holds the base optimizer's state (Adam's ``exp_avg``, ...)
        beside this wrapper's: ``sam_slope`` (``d_t`` for VASSO), ``sam_previous_ascent``
        where kept (zero placeholders until a step makes them, so that an entry has the
        same keys at every step), ``sam_held`` (which of them are real) and
        ``sam_counters`` (the step counter and seed of the coin, the skipped-step count and
        the last ascent's norms, the same in every entry, as Adam's ``step``), so that
        tools which handle per-parameter state only (torch's ``get_optimizer_state_dict`` /
        ``set_optimizer_state_dict`` under FSDP2, ``ZeroRedundancyOptimizer.consolidate_state_dict``)
        carry all of it.  The param
        groups are the base optimizer's (they carry ``rho``); ``"sharpness"`` repeats the
        counters with the knobs, for provenance.
        """
        if self._pending is not None:
            raise RuntimeError("state_dict() in the middle of a step: call descend() or abandon() first")
        base = self.base_optimizer.state_dict()
        counters = self._counters()
        state = {k: v for k, v in base["state"].items() if not isinstance(k, int)}  # torch keeps strays
        for i, q in enumerate(self._all_params()):
            entry = dict(base["state"].get(i, {}))
            view = self.state[q]
            entry.update((k, view[k]) for k in view.own_keys())  # buffers not copied, as torch's are not
            if entry:
                state[i] = entry
        return {
            "state": state,
            "param_groups": [self._saved_group(g) for g in base["param_groups"]],
            "sharpness": {"step": counters["step"], "seed": counters["seed"],
                          "previous": self._previous and {k: _as_float(v) for k, v in self._previous.items()},
                          "nonfinite_steps": counters["nonfinite_steps"],
                          # recorded for provenance; the constructor's values are the ones used
                          "rho": self.rho, "theta": self.theta, "adaptive": self.adaptive, "eta": self.eta,
                          "gsam_alpha": self.gsam_alpha, "p": self.p, "rho_min": self.rho_min,
                          "lr_max": self.lr_max, "lr_min": self.lr_min},
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, keyed by index or (as torch's
        ``set_optimizer_state_dict`` passes it) by parameter name, or a state dict
        of the earlier format (``{"base_optimizer", "state", "sharpness"}``)."""
        if "base_optimizer" in state_dict:
            state_dict = _from_wrapped_format(state_dict)
        if "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("not an optimizer state dict (no 'state'/'param_groups' entries)")
        base_state: Dict[Any, Dict[str, Any]] = {}
        own: Dict[Any, Dict[str, Any]] = {}
        counters = []
        for key, entry in state_dict["state"].items():
            if entry is None:  # ZeroRedundancyOptimizer clears the entries other ranks hold
                continue
            base_part, own_part, entry_counters = _split_entry(entry)
            if base_part:  # no entry where the base holds nothing, as its own state dict has none
                base_state[key] = base_part  # (torch 2.1's Adam reads "step" from the first entry)
            if own_part:
                own[key] = own_part
            if entry_counters is not None:
                counters.append(entry_counters)
        if not counters and "sharpness" in state_dict:  # no entry carries them: no parameter had state
            meta = state_dict["sharpness"]
            counters.append(_counters_dict(meta["step"], meta["seed"], meta.get("nonfinite_steps", 0),
                                           meta.get("previous")))
        if not counters:
            raise ValueError("not a sharpness-aware optimizer state dict (no 'sam_counters' in its entries, "
                             "no 'sharpness' entry)")
        if len({repr(sorted(c.items())) for c in counters}) > 1:  # repr: NaN (no ascent yet) equals NaN
            raise ValueError("the state dict's entries disagree on 'sam_counters': "
                             f"{sorted({str(c) for c in counters})}")

        rho = self.defaults["rho"]
        self.base_optimizer.load_state_dict({"state": base_state, "param_groups": state_dict["param_groups"]})
        # torch's load_state_dict rebuilds the group list: link it again.
        self.param_groups = self.base_optimizer.param_groups
        for group in self.param_groups:  # a state dict from before rho lived in the groups
            group.setdefault("rho", rho)
        self._group_rho()
        # entries are matched to parameters by position in the groups, as torch does
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        by_key = dict(zip(saved, self._all_params()))
        self._own_state = defaultdict(dict)
        self._set_counters(counters[0])
        for key, buffers in own.items():  # real buffers only: _split_entry dropped the placeholders
            q = by_key[key]
            self._own_state[q] = {k: v.detach().to(device=q.device, dtype=q.dtype).clone()
                                  for k, v in buffers.items()}
        self._scratch = defaultdict(dict)
        self._pending = None
        self._lists = None

    @staticmethod
    def upgrade_state_dict(state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """A state dict of this class in today's shape: one of the earlier format
        (``{"base_optimizer", "state", "sharpness"}``, saved before this release) converted,
        today's returned as it is (for hosts that re-index entries, as fairseq's
        ``--zero-sharding os`` does)."""
        return _from_wrapped_format(state_dict) if "base_optimizer" in state_dict else state_dict

    @staticmethod
    def base_optimizer_state(state_dict: Dict[str, Any]) -> Dict[Any, Dict[str, Any]]:
        """The base optimizer's per-parameter state (``exp_avg``, ...) in a state dict of
        this class, of today's format or the earlier one, keyed as there."""
        if "base_optimizer" in state_dict:
            state_dict = _from_wrapped_format(state_dict)
        return {k: _split_entry(v)[0] for k, v in state_dict["state"].items() if v is not None}

    def _saved_group(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """A param group as saved: without this class's own keywords, which
        ``ZeroRedundancyOptimizer`` and ``OSS`` copy into every group of the optimizer they
        build (``partition_group``, a process group, cannot be saved at all; ``base_optimizer``
        is a class); ``rho`` stays, it lives in the groups."""
        own = _KEYWORDS.difference(self.base_optimizer.defaults)
        return {k: v for k, v in group.items() if k not in own}

    def _counters(self) -> Dict[str, Any]:
        return _counters_dict(self._step, self.seed, self._nonfinite_steps, self._previous)

    def _set_counters(self, counters: Dict[str, Any]) -> None:
        self._step = int(counters["step"])
        self.seed = int(counters["seed"])
        self._nonfinite_steps = int(counters["nonfinite_steps"])
        last = [float(counters[k]) for k in ("last_rho", "last_slope_norm", "last_ascent_norm")]
        self._previous = None if math.isnan(last[0]) else dict(zip(("rho", "slope_norm", "ascent_norm"), last))
        self._lists = None

    def _persistent_names(self) -> List[str]:
        """The persistent buffers a parameter with a gradient holds once this configuration
        has stepped: ``slope``, and ``previous_ascent`` where the stability needs it."""
        scalar_stability = not self.adaptive and (self.theta is None or self.p >= 1.0)
        return ["slope"] + (["previous_ascent"] if self.track_stability and not scalar_stability else [])

    def _is_state_initialization(self) -> bool:
        """True for ``step()`` as torch's checkpoint tools call it to create the state of an
        optimizer that has none (``torch.distributed.checkpoint.state_dict._init_optim_state``:
        every gradient zero, every lr 0, no closure)."""
        # (not only at step 0: after steps the coin skipped, SAM over plain SGD holds no state yet)
        if self.state or not self.param_groups:
            return False
        for group in self.param_groups:
            if float(group.get("lr", 0.0)) != 0.0:
                return False
            for q in group["params"]:
                if q.grad is None:
                    if q.requires_grad:
                        return False
                    continue
                grad = q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad
                if bool(grad.any()):
                    return False
        return True

    def _all_params(self) -> List[torch.Tensor]:
        return [q for g in self.param_groups for q in g["params"]]

    def state_nbytes(self, *, include_scratch: bool = True) -> int:
        """Bytes this wrapper holds beyond the base optimizer (persistent state, and
        the per-step scratch buffers such as ``anchor`` when ``include_scratch``)."""
        total = sum(v.numel() * v.element_size() for b in self._own_state.values() for v in b.values()
                    if torch.is_tensor(v))
        if include_scratch:
            total += sum(v.numel() * v.element_size() for b in self._scratch.values() for v in b.values())
        return total


# the constructor's keywords, which a param group holds only when a wrapper put them there
_KEYWORDS = frozenset(inspect.signature(SharpnessAware.__init__).parameters) - {"self", "params", "rho", "base_kwargs"}
_OWN_PREFIX = "sam_"  # this wrapper's keys in a parameter's merged state: no torch optimizer uses it
_COUNTERS = "sam_counters"
# which of the entry's buffers are real (1) and which zero placeholders (0): the entry lists
# every buffer at every step, so that a template from a fresh optimizer has the saved keys
_HELD = "sam_held"
_UNPREFIXED = ("opt.state[p] merges the base optimizer's state with this wrapper's, whose {key!r} is "
               "'sam_{key}' there (the wrapper's own store is opt._own_state)")


def _counters_dict(step, seed, nonfinite_steps, previous) -> Dict[str, Any]:
    """The wrapper's scalars as plain numbers (NaN norms: no ascent yet), the value of
    ``sam_counters``: ints and floats only, which every checkpoint tool keeps."""
    previous = previous or {}
    return {"step": int(step), "seed": int(seed), "nonfinite_steps": int(nonfinite_steps),
            "last_rho": _as_float(previous.get("rho", _NAN)),
            "last_slope_norm": _as_float(previous.get("slope_norm", _NAN)),
            "last_ascent_norm": _as_float(previous.get("ascent_norm", _NAN))}


def _split_entry(entry: Dict[str, Any]):
    """One parameter's merged state -> (the base optimizer's, this wrapper's real buffers,
    counters or None).  Placeholders are dropped: those ``sam_held`` marks 0, and, in
    entries saved before ``sam_held`` existed, every buffer of a state at step 0 (they
    were all placeholders then)."""
    base, own, counters, held = {}, {}, None, None
    for key, value in entry.items():
        if key == _COUNTERS:
            counters = {k: value[k] for k in ("step", "seed", "nonfinite_steps", "last_rho", "last_slope_norm",
                                               "last_ascent_norm")}
        elif key == _HELD:  # a dict, or its (name, 0/1) pairs (hashable, for fairscale's FSDP consolidation)
            held = dict(value)
        elif isinstance(key, str) and key.startswith(_OWN_PREFIX):
            name = key[len(_OWN_PREFIX):]
            if name not in _PERSISTENT:
                raise ValueError(f"unknown sharpness-aware state {key!r} (known: "
                                 f"{[_OWN_PREFIX + n for n in _PERSISTENT] + [_HELD, _COUNTERS]})")
            own[name] = value
        else:
            base[key] = value
    if held is not None:
        own = {name: v for name, v in own.items() if int(held.get(name, 0))}
    elif counters is not None and int(counters["step"]) == 0:
        own = {}
    return base, own, counters


def _from_wrapped_format(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A state dict of the earlier format, ``{"base_optimizer": <the base's state dict>,
    "state": {index: {"slope": ...}}, "sharpness": {...}}``, in today's shape."""
    if "sharpness" not in state_dict:
        raise ValueError("not a sharpness-aware optimizer state dict (no 'base_optimizer'/'sharpness' entries)")
    base = state_dict["base_optimizer"]
    state = {k: dict(v) for k, v in base["state"].items()}
    for k, buffers in state_dict.get("state", {}).items():
        state.setdefault(int(k), {}).update((_OWN_PREFIX + name, v) for name, v in buffers.items())
    return {"state": state, "param_groups": base["param_groups"], "sharpness": state_dict["sharpness"]}


class _MergedState(MutableMapping):
    """``opt.state``: per parameter, the base optimizer's state and this wrapper's, as one
    dict in torch's shape (``exp_avg``, ..., ``sam_slope``, ``sam_counters``).

    torch's checkpoint tools read and write an optimizer's per-parameter state through
    ``opt.state`` (``ZeroRedundancyOptimizer.load_state_dict`` assigns ``opt.state[p]``;
    ``set_optimizer_state_dict`` lists ``opt.state[p]``'s keys), so this view routes each
    key to where it lives: ``sam_*`` to the wrapper, the rest to the base optimizer.  A
    parameter is in the mapping when it holds real state.

    An entry lists the same keys at every step: a parameter that requires a gradient
    lists every buffer this configuration keeps (``_persistent_names``), as a zero
    placeholder until the step that makes it (VASSO's ``d_t`` on the first finite step,
    SAM's ``g`` and the stability's ``previous_ascent`` on the first two-pass step), and
    ``sam_held`` says which are real.  ``torch.distributed.checkpoint`` loads into a
    template made from a freshly built optimizer and needs every key it holds to be in
    the checkpoint (and loads no key that is not in it), so a checkpoint taken at any
    point (before any step, after steps the coin skipped) has the fresh optimizer's keys.
    Loading drops the placeholders: a buffer made later starts as the step makes it
    (VASSO's ``d_0 = g_0``), not from zeros.
    """

    __slots__ = ("_opt",)

    def __init__(self, opt: "SharpnessAware"):
        self._opt = opt

    def _holds(self, q) -> bool:
        return bool(self._opt.base_optimizer.state.get(q)) or bool(self._opt._own_state.get(q))

    def __getitem__(self, q) -> "_ParamState":
        return _ParamState(self._opt, q)  # never a KeyError: torch's state is a defaultdict

    def __setitem__(self, q, entry) -> None:
        opt = self._opt
        base, own, counters = _split_entry(dict(entry))
        if base:
            opt.base_optimizer.state[q] = base
        else:
            opt.base_optimizer.state.pop(q, None)
        if own:
            opt._own_state[q] = own
        else:
            opt._own_state.pop(q, None)
        if counters is not None:
            opt._set_counters(counters)
        opt._lists = None

    def __delitem__(self, q) -> None:
        self._opt.base_optimizer.state.pop(q, None)
        self._opt._own_state.pop(q, None)
        self._opt._lists = None

    def __contains__(self, q) -> bool:
        return self._holds(q)

    def __iter__(self):
        seen = set()
        for q in list(self._opt._all_params()) + list(self._opt.base_optimizer.state) + list(self._opt._own_state):
            if id(q) not in seen and self._holds(q):
                seen.add(id(q))
                yield q

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} parameters with state)"


class _ParamState(MutableMapping):
    """One parameter's entry of :class:`_MergedState`."""

    __slots__ = ("_opt", "_q")

    def __init__(self, opt: "SharpnessAware", q):
        self._opt, self._q = opt, q

    def own_keys(self) -> List[str]:
        """This wrapper's keys for the parameter: its buffers (``sam_slope``, ...,
        placeholders included), ``sam_held`` and ``sam_counters``; empty when the
        parameter has no entry."""
        return list(self._own()) + ([_HELD, _COUNTERS] if self._keys() else [])

    def _own(self) -> Dict[str, bool]:
        """``sam_<buffer>`` -> whether it is real (False: a zero placeholder, see _MergedState)."""
        opt, q = self._opt, self._q
        own = opt._own_state.get(q, {})
        real = {_OWN_PREFIX + k: True for k in own if k in _PERSISTENT}
        if getattr(q, "requires_grad", False):
            real.update((_OWN_PREFIX + k, False) for k in opt._persistent_names() if k not in own)
        return real

    def _keys(self) -> List[str]:
        base = list(self._opt.base_optimizer.state.get(self._q, ()))
        own = list(self._own())
        return base + own + ([_HELD, _COUNTERS] if base or own else [])

    def __contains__(self, key) -> bool:
        if key in _PERSISTENT:  # the internal name: code meaning the wrapper's buffer must not read False
            raise KeyError(_UNPREFIXED.format(key=key))
        return key in self._keys()

    def __getitem__(self, key):
        opt, q = self._opt, self._q
        if key in _PERSISTENT:
            raise KeyError(_UNPREFIXED.format(key=key))
        if key == _COUNTERS and self._keys():
            return opt._counters()
        if key == _HELD and self._keys():
            return {k[len(_OWN_PREFIX):]: int(real) for k, real in self._own().items()}
        if isinstance(key, str) and key.startswith(_OWN_PREFIX):
            own = opt._own_state.get(q, {})
            name = key[len(_OWN_PREFIX):]
            if name in own:
                return own[name]
            if key in self._own():
                return torch.zeros_like(q, memory_format=torch.preserve_format)
            raise KeyError(key)
        return opt.base_optimizer.state.get(q, {})[key]

    def __setitem__(self, key, value) -> None:
        opt, q = self._opt, self._q
        if key == _COUNTERS:
            opt._set_counters(value)
        elif key == _HELD:  # entries copied key by key: the placeholders copied before it go
            for name, real in value.items():
                if not int(real):
                    opt._own_state.get(q, {}).pop(name, None)
        elif isinstance(key, str) and key.startswith(_OWN_PREFIX):
            _, own, _ = _split_entry({key: value})
            opt._own_state[q].update(own)
        else:
            opt.base_optimizer.state[q][key] = value
        opt._lists = None

    def __delitem__(self, key) -> None:
        opt, q = self._opt, self._q
        if isinstance(key, str) and key.startswith(_OWN_PREFIX) and key not in (_COUNTERS, _HELD):
            del opt._own_state[q][key[len(_OWN_PREFIX):]]
        elif key in (_COUNTERS, _HELD):
            raise KeyError(f"{key!r} is the optimizer's, it cannot be deleted")
        else:
            del opt.base_optimizer.state[q][key]
        opt._lists = None

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __repr__(self) -> str:
        return repr(dict(self))


class _StepLists:
    """What a step needs about the parameters that have a gradient, built once per
    set of such parameters: the reduction plan, the adaptive mask, whether any is
    fp16/bf16, and the per-parameter buffer lists (filled on first use)."""

    __slots__ = ("params", "names", "layout", "plan", "mask", "low_precision", "fuse_average_norm",
                 "buffers")

    def __init__(self, params: List[torch.Tensor], names: List[Optional[str]], adaptive: bool, layout: D.Layout):
        self.params = params
        self.names = names
        self.layout = layout
        locals_ = self.local_params()
        counted = locals_ if layout.counted is None else [locals_[i] for i in layout.counted]
        self.plan = P.chunk_plan(counted)  # over this rank's local parts (uneven shards too)
        self.mask = P.weight_mask(params, None if any(n is None for n in names) else names) if adaptive else None
        self.low_precision = any(q.dtype not in _EXACT_DTYPES for q in params)
        # VASSO's ||d_t|| from the first reduction saves a host sync but costs a pass that
        # writes d_t's size: worth it on accelerators, and on the CPU (where a "sync"
        # costs nothing) only when every tensor is copied into a flat chunk anyway.
        # (fp16/bf16, whose d_t is rounded to their precision by the update: the norm of
        # d_t computed before the reduction.)  Where the sums cross ranks, a separate norm
        # would cost a collective too: always fuse there (decided from the global sizes,
        # so every rank reduces the same terms).
        all_flat = all(q.numel() < P.FLAT_BELOW for q in params)
        on_cpu = all(q.device.type == "cpu" for q in params)
        self.fuse_average_norm = all_flat or not on_cpu or layout.collective
        self.buffers: Dict[str, List[torch.Tensor]] = {}

    def local_params(self) -> List[torch.Tensor]:
        """This rank's parts of the parameters (the parameters themselves unless DTensors)."""
        return [D.local(q) for q in self.params] if self.layout.sharded else self.params

    def local_grads(self, missing_ok: bool = False) -> List[Optional[torch.Tensor]]:
        if not self.layout.sharded:
            return [q.grad for q in self.params]
        return [None if q.grad is None and missing_ok else D.local(q.grad) for q in self.params]


def _copy_(destinations: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """``torch._foreach_copy_`` for lists that may be empty: under ``partition_group`` a
    rank whose parameters have no gradient yet (frozen, or not in the forward) takes part
    in the step's collectives with nothing of its own."""
    if destinations:
        torch._foreach_copy_(destinations, sources)


def _loss_gap(first, second):
    """``f(x + eps) - f(x)``: a 0-dim float64 device tensor for tensor losses (the
    diagnostics read it lazily, so it costs no host sync of its own), else a float."""
    if torch.is_tensor(first) and torch.is_tensor(second) and first.numel() == 1 and second.numel() == 1:
        return second.detach().reshape(()).to(first.device, torch.float64) - first.detach().reshape(()).double()
    return _as_float(second) - _as_float(first)


def _moved_parameters() -> None:
    """The parameters moved: drop autocast's cached low-precision copies of them.  Inside
    one autocast region torch casts each leaf parameter once and reuses the copy, so a
    second pass under the autocast of the first (``with autocast(): opt.step(closure)``)
    would otherwise run at ``x_t``, not at ``x_t + eps_t``."""
    torch.clear_autocast_cache()


def _loss_scale(scaler, grads: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The scaler's current scale as a 0-dim tensor on the gradients' device, read with
    its public ``scale()`` (no host sync), or None without a scaler or with a disabled one."""
    if scaler is None:
        return None
    if not (callable(getattr(scaler, "scale", None)) and callable(getattr(scaler, "is_enabled", None))
            and callable(getattr(scaler, "step", None))):
        raise ValueError(f"scaler must be a torch.amp.GradScaler (or torch.cuda.amp.GradScaler) or None, "
                         f"got {scaler!r}")
    if not scaler.is_enabled():
        return None
    device = grads[0].device if grads else torch.device("cpu")
    return scaler.scale(torch.ones((), dtype=torch.float32, device=device))


def _unexpected_step_arguments(cls: str, unexpected: Dict[str, Any]) -> str:
    names = ", ".join(f"{k}=" for k in unexpected)
    return (f"{cls}.step() got unexpected keyword arguments {names} (it takes closure, model=, scaler= "
            "and loss=). "
            "A loop written for the official VaSSO code or davda54/sam ports in one of two ways: "
            "call first_step(zero_grad=True) after the first backward and second_step(zero_grad=True) "
            "after the second, or pass a torch-style closure (it clears the gradients, computes the loss "
            "and calls backward()) as step(closure, model=model); see docs/migration.md")

_PARTITION_MODEL = ("partition_group: the second pass needs every parameter at x + eps on every rank, and each "
                    "rank's optimizer holds only its own: pass the model, step(closure, model=model) or "
                    "second_pass(model, rng), so that the owners can send theirs (docs/design.md, section 7)")

_SCALED_STEP = ("this step's gradients are scaled (perturb(scaler=...)): finish it with scaler.step(opt), "
                "then scaler.update()")


class Diagnostics(MutableMapping):
    """The last step's diagnostics (``docs/diagnostics.md``), read as floats.

    Values the step computed on the device stay 0-dim tensors until someone reads
    one; the first read turns them all into floats with one host sync (per device),
    so a step whose diagnostics nobody reads pays none for them.  ``dict(diag)``
    gives plain floats.  A new mapping is made for every step: keeping a reference
    keeps that step's values.
    """

    __slots__ = ("_values", "_works")

    def __init__(self, values: Optional[Dict[str, Any]] = None):
        self._values: Dict[str, Any] = dict(values or {})
        self._works: List[Any] = []

    def wait_for(self, work) -> None:
        """A collective (``async_op=True``) writing into one of the values: waited for
        before any value is read, so issuing it costs the step no wait of its own."""
        self._works.append(work)

    def wait(self) -> None:
        """Wait for the collectives still writing the values (no read of the values)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def __getitem__(self, key: str) -> float:
        value = self._values[key]
        if torch.is_tensor(value):
            self._read_all()
            value = self._values[key]
        return value

    def __setitem__(self, key: str, value) -> None:
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"

    def unread(self) -> Dict[str, Any]:
        """The values as they are, without a host sync: floats, and 0-dim device tensors
        nobody has read yet (for a host that logs them and reads them at its own log
        point, as fairseq's meters do).  Collectives still writing them are waited for."""
        self.wait()
        return dict(self._values)

    def _read_all(self) -> None:
        self.wait()
        lazy = [k for k, v in self._values.items() if torch.is_tensor(v)]
        for device in {self._values[k].device for k in lazy}:
            keys = [k for k in lazy if self._values[k].device == device]
            floats = torch.stack([self._values[k].detach().reshape(()).double() for k in keys]).tolist()
            self._values.update(zip(keys, floats))


class SAM(SharpnessAware):
    """SAM (Foret et al. 2021): the ascent follows the raw gradient ``g_t``.

    ``adaptive=True`` gives ASAM, ``gsam_alpha > 0`` GSAM, ``p < 1`` eSAM (Zhao et
    al. 2022).  See :class:`SharpnessAware` for the arguments and the two APIs.

    >>> import torch
    >>> from plugins import SAM
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
    >>> def closure():
    ...     opt.zero_grad(); loss = model(torch.ones(2, 3)).pow(2).mean(); loss.backward(); return loss
    >>> _ = opt.step(closure)
    >>> opt.diagnostics["two_pass"]
    1.0
    """

    def __init__(self, params: Params, base_optimizer, rho: float = 0.05, **kwargs):
        if "theta" in kwargs:
            raise ValueError("SAM takes no theta: its slope is the raw gradient g_t; "
                             "use VASSO(..., theta=...) for the moving average d_t")
        super().__init__(params, base_optimizer, rho, theta=None, **kwargs)


class VASSO(SharpnessAware):
    """VASSO (Li and Giannakis, 2023): the ascent follows ``d_t``, an EMA of gradients.

    ``d_t = (1 - theta) d_{t-1} + theta g_t`` with ``d_0 = g_0`` (the authors' code);
    ``eps_t = rho d_t / ||d_t||`` is recomputed from ``d_t`` and its norm, so the
    only buffer is ``d_t`` (the paper's memory-efficient implementation).
    ``p < 1`` gives eVASSO (Alg. 2), ``gsam_alpha > 0`` VASSO+GSAM ("V+G": the
    ascent from ``d_t``, the GSAM correction from ``g_t``; no published code
    exists for it, this is this project's reading), ``adaptive=True`` adaptive VASSO.

    >>> import torch
    >>> from plugins import VASSO
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = VASSO(model.parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=5e-4,
    ...             betas=(0.9, 0.98), weight_decay=1e-4)
    >>> def closure():
    ...     opt.zero_grad(); loss = model(torch.ones(2, 3)).pow(2).mean(); loss.backward(); return loss
    >>> _ = opt.step(closure)
    >>> sorted(opt.state[model.weight])     # AdamW's moments beside d_t and the wrapper's counters
    ['exp_avg', 'exp_avg_sq', 'sam_counters', 'sam_held', 'sam_slope', 'step']
    """

    def __init__(self, params: Params, base_optimizer, rho: float = 0.05, *, theta: float = 0.4, **kwargs):
        if theta is None:
            raise ValueError("theta must be in (0, 1], got None (use SAM for the raw gradient)")
        super().__init__(params, base_optimizer, rho, theta=theta, **kwargs)


def _family_signature(theta: Optional[inspect.Parameter]) -> inspect.Signature:
    """:class:`SharpnessAware`'s signature with ``theta`` removed (SAM) or given its
    default (VASSO): the knobs are declared and documented once, there, while
    ``help()`` and editors still show every keyword of each class."""
    params = [p for p in inspect.signature(SharpnessAware.__init__).parameters.values() if p.name != "theta"]
    if theta is not None:
        params.insert(next(i for i, p in enumerate(params) if p.kind is p.KEYWORD_ONLY), theta)
    return inspect.Signature(params)


SAM.__init__.__signature__ = _family_signature(None)
VASSO.__init__.__signature__ = _family_signature(
    inspect.Parameter("theta", inspect.Parameter.KEYWORD_ONLY, default=0.4, annotation=float))
