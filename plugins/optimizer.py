"""The sharpness-aware optimizer family as one thin class over any torch optimizer.

:class:`SharpnessAware` keeps the param groups, the state and the step protocol; the step's
work is done by functions of tensors and knobs: :mod:`plugins.device_step` where the step is
decided on the device, :mod:`plugins.host_step` where a host read decides, both over
:mod:`plugins.perturbation`'s formulas (``docs/design.md``).  The family's four choices
(slope, geometry, correction, schedule) are knobs, so VASSO+GSAM or adaptive eVASSO need no
class of their own; :class:`SAM` and :class:`VASSO` only set ``theta``.  The buffers each
member keeps: ``docs/torch.md``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Optional

import torch

from . import device_step, diagnostics, host_step, ondevice, scaling
from . import distributed as D
from . import perturbation as P
from . import state as S
from .diagnostics import Diagnostics
from .inflight import Kind, Knobs, StepInFlight, StepLists
from .named_params import normalize_param_group, normalize_param_groups
from .validation import Closure, Params, Range, check

__all__ = ["SharpnessAware", "SAM", "VASSO", "Diagnostics"]

_NAN = float("nan")


_ABSENT = object()


def _ends_with_the_diagnostics_wait(descend):
    """``descend`` then waits for the loss gap's ``all_reduce`` (issued before the step's
    last reduction, so on gloo it is done by then and on NCCL the wait is the stream's):
    no collective outlives its step, nor the process group at exit."""
    @functools.wraps(descend)
    def waiting(self, *args, **kwargs):
        try:
            return descend(self, *args, **kwargs)
        finally:
            self.diagnostics.wait()
    return waiting


class SharpnessAware(torch.optim.Optimizer):
    r"""Sharpness-aware minimization over any torch optimizer (``docs/torch.md``).

    A step reads ``g_t`` at ``x_t``, updates the slope ``v_t`` (SAM: ``g_t``; VASSO:
    ``d_t = (1 - theta) d_{t-1} + theta g_t``, ``d_0 = g_0``), moves to ``x_t + eps_t`` with
    ``eps_t = rho v_t / ||v_t||`` (one norm over every group; ASAM: ``rho T^2 v_t / ||T v_t||``),
    reads ``h_t`` there, comes back and lets the base optimizer step with ``h_t`` (GSAM:
    ``h_t - gsam_alpha g_t^perp``).  With ``p < 1`` a coin of ``(seed, t)`` may skip the second
    pass; the base then steps with ``g_t``.  The equations and the functions that state them:
    ``docs/design.md``.

    ``params`` and ``base_optimizer`` (a class built here with ``**base_kwargs``, or an
    optimizer over exactly these parameters) are as for torch; ``rho`` lives in every param
    group, where a scheduler may change it.  The family's knobs (``theta``, ``adaptive``,
    ``eta``, ``gsam_alpha``, ``p``, ``seed``, ``rho_min``/``lr_max``/``lr_min``) and their ranges:
    the README's table.  ``track_stability``: compute ``||eps_t - eps_{t-1}||`` (eVASSO and ASAM
    keep one buffer for it); ``exact_restore``: come back to ``x_t`` from a copy, bit for bit
    (automatic for ASAM and fp16/bf16).
    ``partition_group``: the group over which ZeRO, OSS or a hand split divide the parameters
    (``docs/distributed.md``); None for one process, DDP and FSDP2.

    Take a step with a closure, as torch does, or through :meth:`perturb`,
    :meth:`second_pass` and :meth:`descend` for loops that own their backward; both take a
    ``torch.amp.GradScaler`` (``docs/mixed_precision.md``).  Every rank calls them alike.

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
        >>> from plugins.perturbation import rng_state
        >>> rng = rng_state()
        >>> opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward()
        >>> if opt.perturb():                  # g_t read from .grad; now at x_t + eps_t
        ...     opt.zero_grad()
        ...     with opt.second_pass(model, rng):   # same RNG, BatchNorm frozen, abandon() on error
        ...         torch.nn.functional.cross_entropy(model(x), y).backward()   # h_t
        >>> opt.descend()                      # back to x_t, base step with h_t
        True
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
        for name, value in dict(adaptive=adaptive, eta=eta, gsam_alpha=gsam_alpha, p=p, seed=seed, rho_min=rho_min,
                                lr_min=lr_min, track_stability=track_stability, exact_restore=exact_restore).items():
            setattr(self, name, check(name, value))
        if self.rho_min is not None:
            check("rho_min", self.rho_min, within=Range(0.0, rho, "[]"))
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
        self.base_optimizer = _built_base(base_optimizer, self.param_groups, rho, base_kwargs)
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
        self.diagnostics: Diagnostics = diagnostics.empty()
        self._step = 0
        self._nonfinite_steps = 0
        # the last applied ascent, for the next step's stability (None before the first): a tensor
        # [rho, ||v||] (plain geometry), [rho, ||v||, ||eps||] (adaptive), float64
        self._last: Optional[torch.Tensor] = None
        self._verdicts = ondevice.Verdicts()  # steps decided on the device, on their way to the host
        self._pending: Optional[StepInFlight] = None  # the step between perturb() and descend()
        # This wrapper's per-parameter buffers ("slope", "previous_ascent"), and its per-step scratch
        # (``_scratch``: "anchor", "first_grad").  ``opt.state`` shows them merged with the base
        # optimizer's state, in torch's shape (:class:`plugins.state.MergedState`).
        self._own_state: Dict[torch.Tensor, Dict[str, Any]] = defaultdict(dict)
        S.reset_caches(self)  # opt.state, _scratch, the step's lists, the exchange (partition_group)
        self._split_checked = False  # Layout.check_split, on the first step
        if self.partition_group is not None and any(D.is_dtensor(q) for q in self._all_params()):
            raise ValueError(D.DTENSOR_PARTITION)

    # ------------------------------------------------------------------ plumbing

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        param_group = normalize_param_group(param_group)
        if hasattr(self, "base_optimizer"):
            self.base_optimizer.add_param_group(param_group)
            self._group_rho()
        else:
            super().add_param_group(param_group)

    @property
    def knobs(self) -> Knobs:
        """The family's choices as the step's kernels take them (read at each step, so that a
        knob set on the optimizer, as ``opt.theta = 0.5``, takes effect at the next)."""
        return Knobs(self.theta, self.adaptive, self.eta, self.gsam_alpha, self.p, self.track_stability,
                     self.exact_restore)

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

    def _step_lists(self) -> StepLists:
        self._lists = StepLists.of(self.param_groups, self._lists, self.partition_group, self._model_gathers,
                                   self.adaptive)
        return self._lists

    def _skip_nonfinite(self, which: str, scaled: bool, step: Optional[int] = None) -> None:
        """Count a step skipped for a non-finite gradient; warn unless a loss scaler is
        in charge (an overflow is then its routine signal to back the scale off).
        ``step``: a step decided on the device whose verdict arrived later (its
        diagnostics said so already)."""
        self._nonfinite_steps += 1
        if step is None:
            self.diagnostics["nonfinite"] = 1.0
        if not scaled:
            warnings.warn(f"{type(self).__name__}: non-finite {which} gradient at step "
                          f"{self._step if step is None else step + 1}; the step is skipped "
                          f"({self._nonfinite_steps} skipped so far)", RuntimeWarning, stacklevel=4)

    def _count_arrived(self, *, wait: bool) -> None:
        """Count (and warn about) the skipped steps among the device's verdicts that have
        reached the host (all of them with ``wait``: a host sync, where one is pending)."""
        if len(self._verdicts):
            for t, which, scaled in self._verdicts.arrived(wait=wait):
                self._skip_nonfinite(which, scaled, step=t)

    @property
    def nonfinite_steps(self) -> int:
        """How many steps were skipped for a non-finite gradient (waits for the verdicts of
        steps decided on the device that have not reached the host yet)."""
        self._count_arrived(wait=True)
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

    # The step decided on the device (plugins.device_step) where decides() allows it; False:
    # every step reads its scalars on the host, as before the device path (tests compare the two)
    _decide_on_device = True

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
        step = self._begin(scaler, loss)          # the coin, rho, the step's lists; g_t unscaled where kept
        if self._decides_on_device(step):         # no host read: the finiteness of g_t stays on the device
            device_step.prepare(step, self._own_state)
            self._last = device_step.perturb(step, self._last, self._scratch)
            self._pending = step
            return step.two_pass
        has_last = self._last is not None         # on the host: one reduction, one read (||g_t||, ||d_t||, ...)
        sums = host_step.first_pass_sums(step, has_last, self._scratch, self._exchange)
        if not math.isfinite(sums["grad"]):       # the finiteness decision: nothing has moved, d_{t-1} kept
            step.kind = Kind.NONFINITE
            self._pending = step
            self._skip_nonfinite("first-pass", step.scaled)
            return False
        inner = host_step.previous_inner(step, has_last, sums, self._own_state)  # before d_t is written
        host_step.rule(step, sums, self._own_state, self._scratch)  # eqs. (5a)-(5b): d_t, x_t + eps_t
        if not step.two_pass:                     # the coin skipped: the base will step with g_t
            step.kind = Kind.FIRST_GRADIENT
            self._pending = step
            return False
        self._last = host_step.diagnose(step, sums, inner, self._last, self._own_state)
        step.kind = Kind.PERTURBED
        step.grads = None                         # g_t lives on in the buffers: not held through the second pass
        self._pending = step
        if step.exchange is not None:             # partition_group: the other owners' parameters too
            self._exchange_leg(step, sums)
        return True

    # -------------------------------------------------------------- perturb()'s phases

    def _begin(self, scaler, loss) -> StepInFlight:
        """The step's start: its rho (may refuse: before anything moves), its lists, the
        coin ``R_t`` (the same on every rank: where the sums cross ranks every rank
        decides alike, whatever it holds), and ``g_t`` unscaled where it stays in ``.grad``."""
        rho = self.current_rho()
        self._count_arrived(wait=False)  # the verdicts of earlier steps decided on the device
        lists = self._step_lists()
        layout = lists.layout
        # plain tensors on several ranks: replicas, or split over partition_group?  Checked on the
        # first step only: a later change of the set of parameters with a gradient may be one
        # rank's alone (under ZeRO), whose collective the others would not join
        if not self._split_checked:
            layout.check_split(lists.params)
            self._split_checked = True
        params, grads = lists.local_params(), lists.local_grads()
        loss_scale = scaling.loss_scale(scaler, grads)
        if loss_scale is not None:
            scaling.refuse_unscaled(scaler, self)
        t = self._step
        self._step += 1
        self.diagnostics = diag = diagnostics.empty()
        diag["rho"] = rho
        two_pass = (len(params) > 0 or layout.collective) and P.second_pass_coin(self.p, self.seed, t)
        if loss_scale is not None and two_pass:  # the second backward overwrites .grad: unscale g_t where it is
            scaling.unscale(grads, loss_scale, in_place=True)
        step = StepInFlight(Kind.NONFINITE, scaled=loss_scale is not None, knobs=self.knobs, lists=lists, rho=rho,
                            params=params,
                            two_pass=two_pass, grads=grads, loss_scale=loss_scale, diagnostics=diag,
                            first_loss=loss.detach() if torch.is_tensor(loss) else loss)
        # d_{t-1}; where the sums cross ranks, a step whose set of parameters with a gradient
        # changed (no slope list yet) takes each one's kept slope, and d_0 = g_0 for the new
        # ones, so that its sums ride along too, as every step's
        slopes = lists.buffers.get("slope")
        if slopes is None and two_pass and layout.collective:
            step.previous_slopes = [g if s is None else s for g, s in zip(grads, lists.kept_slopes(self._own_state))]
        else:
            step.previous_slopes = slopes
        if self._partitioned and two_pass:
            step.exchange = self._exchange.get("exchange")
        return step

    def _decides_on_device(self, step: StepInFlight) -> bool:
        """Whether this step keeps its decisions on the device (:mod:`plugins.device_step`): one
        process, replicas or shards every rank counts, one device and dtype, no exchange."""
        return (self._decide_on_device and step.lists.on_device and step.exchange is None
                and (self.partition_group is None or self._model_gathers))

    def _exchange_leg(self, step: StepInFlight, sums: Dict[str, float]) -> None:
        """``partition_group``: move the other owners' parameters as they moved theirs,
        from the directions that came with the step's sums."""
        norm = sums["scaled_slope"] if self.adaptive else step.slope_norm
        try:
            D.move_others(step.exchange, lambda others, directions: P.ascend_along_(
                others, directions, step.rho, norm, adaptive=self.adaptive))
        except BaseException:
            self.abandon()
            raise

    # -------------------------------------------------------------- the second half

    @torch.no_grad()
    def restore(self) -> None:
        """Put the parameters back at ``x_t``; a no-op unless they sit at ``x_t + eps_t``."""
        step = self._pending
        if step is None or step.kind is not Kind.PERTURBED or not step.at_ascent:
            return
        flat = step.lists.flat_slope
        if step.finite is not None and step.anchors is None and ondevice.flat_scratch_is_cheap(flat.flat):
            # decided on the device: the ascent's product again as perturb() made it, one kernel over
            # the flat slope, taken back through the parameters' storage-order views by the same
            # subtraction as per tensor (bit for bit that restore)
            with flat.scratch() as (product, pieces):
                torch.mul(flat.flat, step.scale, out=product)
                P.descend_from_ascent_(step.lists.storage_params, pieces, step.rho)
        else:  # per tensor (on the CPU one flat product would be a block glibc maps anew every step)
            P.descend_from_ascent_(step.params, step.slopes, step.scale, step.anchors,
                                   rho=step.rho if torch.is_tensor(step.scale) else 1.0)
        if step.exchange is not None:  # partition_group: the other owners' parameters too
            step.exchange.restore()
        step.at_ascent = False
        P.moved_parameters()

    def abandon(self) -> None:
        """Restore and drop the step in flight without a base step (the host skipped the update)."""
        step = self._pending
        self.restore()
        if step is not None and step.fresh and not bool(step.finite):  # (one host read, on a first step only)
            device_step.forget_slopes(step, self._own_state)
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
        if self._pending is None:
            raise RuntimeError("descend() without perturb(): call perturb() after the first backward")
        if self._pending.scaled:
            raise RuntimeError(scaling.SCALED_STEP)
        # Through step() (closure-less: _finish_step), the attribute that torch's LR schedulers
        # wrap to learn that the optimizer stepped (and that step hooks run around), so a
        # scheduler sees this step as taken, as it does scaler.step(opt)'s.
        return self.step(loss=loss)

    @_ends_with_the_diagnostics_wait
    @torch.no_grad()
    def _descend(self, grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None) -> bool:
        """:meth:`descend`'s work: back to ``x_t``; the base steps with ``g_t`` (the coin
        skipped), or with ``h_t`` (GSAM-corrected) if it is finite, or not at all.  With a
        scaler, ``grad_scale`` is the scale ``.grad`` still carries (None once
        ``scaler.unscale_(opt)`` ran) and ``found_inf`` the scaler's verdict on it
        (``GradScaler.step`` hands both over)."""
        step = self._pending
        if step.kind is Kind.PERTURBED and self._exchanges and not step.second_pass:
            self.abandon()  # the second pass ran with the other ranks' parameters at x_t: its h_t is wrong
            raise RuntimeError(D.PARTITION_MODEL.replace("the second pass needs", "the second pass ran outside "
                                                         "second_pass(model, rng); it needs"))
        self.restore()
        self._pending = None
        self.in_second_pass = False
        if step.finite is not None:  # perturb() decided on the device
            return self._descend_on_device(step, grad_scale, found_inf)
        if step.kind is Kind.NONFINITE:
            return False
        if step.kind is Kind.FIRST_GRADIENT:  # g_t, found finite by perturb(): nothing to decide again
            if grad_scale is not None:
                scaling.unscale(step.lists.local_grads(), grad_scale, in_place=True)
            self._base_step()
            return True
        second, firsts, plan = step.second_grads()
        if grad_scale is not None and second:
            scaling.unscale(second, grad_scale, in_place=True)
        finite, sums = host_step.second_pass_sums(step, second, firsts, plan, found_inf)
        if not finite:
            self._skip_nonfinite("second-pass", step.scaled)
            return False
        if "g_dot_h" in sums:  # GSAM: h_t - alpha g_t^perp
            step.gsam_correct(second, firsts, sums["h"], sums["g_dot_h"])
        self._base_step()
        return True

    def _descend_on_device(self, step: StepInFlight, grad_scale: Optional[torch.Tensor],
                           found_inf: Optional[torch.Tensor]) -> Optional[bool]:
        """:meth:`descend` for a step decided on the device (:func:`plugins.device_step.descend`):
        whether the base stepped, where the host read the verdict; None where the device decided."""
        code, read = device_step.descend(step, self.base_optimizer, grad_scale, found_inf)
        if step.fresh and read == 2:  # a non-finite g_0 leaves no slope: d_0 = g_0 at the next step
            device_step.forget_slopes(step, self._own_state)
        if read is None:  # decided on the device: counted, and warned about, once the verdict arrives
            self._verdicts.send(self._step - 1, code, step.scaled)
            return None
        if read:
            self._skip_nonfinite(ondevice.Verdicts.WHICH[read], step.scaled)
        else:
            step.diagnostics["nonfinite"] = 0.0  # read already: reading it costs nothing more
        return read == 0

    def _base_step(self) -> None:
        self.base_optimizer.step()
        self._lists.base_stepped = True  # a fused base has its state now (plugins.ondevice.base_step)
        P.moved_parameters()

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
        if pending is None or pending.kind is not Kind.PERTURBED:
            raise RuntimeError("second_pass() without a perturbation: enter it only when perturb() returned True")
        if self._exchanges:
            if model is None:
                self.abandon()
                raise ValueError(D.PARTITION_MODEL)
            try:  # the other ranks' parameters at x + eps, before the second forward
                exchange = D.exchange_for(self._exchange, model, self._all_params(), self.partition_group)
                if pending.exchange is not exchange:  # perturb() did not move them for this model
                    if pending.exchange is not None:
                        pending.exchange.restore()
                    pending.exchange = exchange
                    exchange.share()
                pending.second_pass = True
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
        if pending.scaled and pending.finite is not None:  # decided on the device, under a scaler
            ondevice.overflow_into_(pending.lists.local_grads(missing_ok=True), pending.finite)

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
        if pending.kind is Kind.FIRST_GRADIENT:  # the coin skipped: keep g_t for second_step
            params = self._step_lists().params
            pending.kept_grads = (params, [q.grad if zero_grad else q.grad.clone() for q in params])
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
        kept = pending.kept_grads
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
            raise ValueError(D.PARTITION_MODEL)
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
                self._set_loss_gap(loss, second)
        if self._pending.scaled:
            self._finish_through(scaler)  # records the overflow in the scaler, then finishes
        else:
            self._descend()  # not descend(): this step() is the one torch's wrappers see
        return loss

    def _finish_through(self, scaler) -> None:
        """``scaler.step(self)`` inside ``step(closure, scaler=)``: the scaler records its
        verdict and calls ``self.step()``, which is this step's finish, not a second step:
        that call goes to :meth:`_finish_step` directly, so torch's step hooks, profiler
        range and an LR scheduler's count see one step, the one the user called.  (An
        instance attribute for the call: an LR scheduler's own wrapper, if any, comes back.)"""
        own = self.__dict__.get("step", _ABSENT)
        self.step = self._finish_step
        try:
            scaler.step(self)
        finally:
            if own is _ABSENT:
                del self.step
            else:
                self.step = own

    def _set_loss_gap(self, first, second) -> None:
        """The loss gap; on several ranks the mean of the ranks' gaps, over
        ``partition_group`` or the default group (:func:`plugins.diagnostics.mean_over_ranks`);
        in one process, from tensor losses, computed only when read."""
        if torch.is_tensor(first) and torch.is_tensor(second) and D.ranks(self.partition_group) == 1:
            first, second = first.detach(), second.detach()
            self.diagnostics.later(("loss_gap",), lambda: diagnostics.loss_gap(first, second).reshape(1))
            return
        gap = diagnostics.loss_gap(first, second)
        lists = self._lists
        device = lists.layout.device if lists is not None else torch.device("cpu")
        diagnostics.mean_over_ranks(self.diagnostics, "loss_gap", gap, self.partition_group, device)

    def _record_loss_gap(self, second) -> None:
        """``loss_gap`` of the step in flight from the losses the explicit API was handed."""
        step = self._pending
        if second is not None and step is not None and step.kind is Kind.PERTURBED and step.first_loss is not None:
            self._set_loss_gap(step.first_loss, second)

    def _finish_step(self, loss=None) -> bool:
        """``step()`` without a closure: the explicit API's descend, directly or through
        ``scaler.step(opt)`` (which sets ``found_inf`` and ``grad_scale`` around the call)."""
        found_inf, grad_scale = scaling.handed_verdict(self)
        pending = self._pending
        problem = None
        if pending is None and S.is_state_initialization(self):
            self.base_optimizer.step()  # lr 0, zero gradients: creates the base's state, moves nothing
            return False
        if pending is None:
            problem = (f"{type(self).__name__}.step() needs a closure that re-evaluates the loss; "
                       "loops that own forward/backward use perturb() and descend() (or scaler.step(opt) "
                       "after perturb(scaler=scaler)): no step is in flight")
        elif pending.scaled and found_inf is None:
            problem = scaling.SCALED_STEP
        elif not pending.scaled and found_inf is not None:
            problem = ("scaler.step(opt) finishes a step whose perturb() was given no scaler, so g_t was used "
                       "scaled: pass the scaler to perturb(scaler=scaler)")
        if problem is not None:
            # GradScaler deletes its attributes only when step() returns: do it here, or
            # a stale grad_scale would multiply into the next scaler.step(opt)
            scaling.drop_verdict(self)
            raise RuntimeError(problem)
        self._record_loss_gap(loss)
        return self._descend(grad_scale, found_inf)

    # ------------------------------------------------------------------ copy, pickle and state

    def __getstate__(self) -> Dict[str, Any]:
        """``copy.deepcopy`` and ``pickle`` give an independent optimizer, as torch's do; copy it
        with its model (``copy.deepcopy((model, opt))``).  Refused mid-step and with
        ``partition_group`` (:func:`plugins.state.getstate`)."""
        return S.getstate(self)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(S.upgrade(state))  # torch's: empty hooks, its step() profiling wrapper
        S.reset_caches(self)

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
        carry all of it.  The param groups are the base optimizer's (they carry ``rho``);
        ``"sharpness"`` repeats the counters with the knobs, for provenance.
        """
        if self._pending is not None:
            raise RuntimeError("state_dict() in the middle of a step: call descend() or abandon() first")
        return S.state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, keyed by index or (as torch's
        ``set_optimizer_state_dict`` passes it) by parameter name; any other format is
        refused, naming the keys expected."""
        S.load_state_dict(self, state_dict)

    @staticmethod
    def base_optimizer_state(state_dict: Dict[str, Any]) -> Dict[Any, Dict[str, Any]]:
        """The base optimizer's per-parameter state (``exp_avg``, ...) in a state dict of
        this class, keyed as there."""
        return S.base_optimizer_state(state_dict)

    def _counters(self) -> Dict[str, Any]:
        return S.counters_dict(self._step, self.seed, self.nonfinite_steps, self._last)

    def _set_counters(self, counters: Dict[str, Any]) -> None:
        S.set_counters(self, counters)

    def _persistent_names(self) -> List[str]:
        return self.knobs.persistent_buffers()

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
SharpnessAware._KEYWORDS = frozenset(inspect.signature(SharpnessAware.__init__).parameters) - {
    "self", "params", "rho", "base_kwargs"}






def _built_base(base_optimizer, groups: List[Dict[str, Any]], rho: float, base_kwargs: Dict[str, Any]):
    """The base optimizer over ``groups``: built from its class with ``base_kwargs``, or one
    already built, checked to hold exactly these parameters (its groups then get ``rho``)."""
    if isinstance(base_optimizer, torch.optim.Optimizer):
        if base_kwargs:
            raise ValueError(f"base_optimizer is already built: unexpected keyword arguments {sorted(base_kwargs)}")
        mine = {id(q) for g in groups for q in g["params"]}
        theirs = {id(q) for g in base_optimizer.param_groups for q in g["params"]}
        if mine != theirs:
            raise ValueError("base_optimizer must optimize exactly the parameters given to this optimizer "
                             f"({len(mine)} given, base has {len(theirs)}, {len(mine & theirs)} in common)")
        for group in base_optimizer.param_groups:
            group.setdefault("rho", rho)
        return base_optimizer
    if isinstance(base_optimizer, type) and issubclass(base_optimizer, torch.optim.Optimizer):
        return base_optimizer(groups, **base_kwargs)
    raise ValueError(f"base_optimizer must be a torch.optim.Optimizer subclass or instance, got {base_optimizer!r}")


def _unexpected_step_arguments(cls: str, unexpected: Dict[str, Any]) -> str:
    names = ", ".join(f"{k}=" for k in unexpected)
    return (f"{cls}.step() got unexpected keyword arguments {names} (it takes closure, model=, scaler= "
            "and loss=). "
            "A loop written for the official VaSSO code or davda54/sam ports in one of two ways: "
            "call first_step(zero_grad=True) after the first backward and second_step(zero_grad=True) "
            "after the second, or pass a torch-style closure (it clears the gradients, computes the loss "
            "and calls backward()) as step(closure, model=model); see docs/migration.md")


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

