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
from .validation import Closure, Params, Range, check, group_rho

__all__ = ["SharpnessAware", "SAM", "VASSO", "Diagnostics"]

_NAN = float("nan")


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

    A step reads ``g_t`` at ``x_t``, updates the slope ``v_t`` (SAM: ``g_t``; VASSO: ``d_t``),
    moves to ``x_t + eps_t``, ``eps_t = rho v_t / ||v_t||``, reads ``h_t`` there, comes back and
    lets the base optimizer step with ``h_t``; the equations: ``docs/design.md``.  The knobs and
    their ranges: the README's table.  ``base_optimizer``: a class built with ``**base_kwargs``,
    or an optimizer over these parameters.  ``track_stability``: compute ``||eps_t - eps_{t-1}||``;
    ``exact_restore``: come back to ``x_t`` from a copy, bit for bit (automatic for ASAM and
    fp16/bf16).  ``partition_group``: the group over which ZeRO, OSS or a hand split divide the
    parameters (``docs/distributed.md``).  A step: a closure, or :meth:`perturb`,
    :meth:`second_pass` and :meth:`descend` for loops that own their backward; every rank calls
    them alike.

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
        self.partition_group = check("partition_group", partition_group)
        # flat shards the model gathers itself; split over several ranks; the second pass must send
        # each owner's parameters at x + eps to the other ranks
        roles = D.partition_roles(partition_group, self.partition_group, self.adaptive)
        self._model_gathers, self._partitioned, self._exchanges = roles

        super().__init__(params, defaults={"rho": rho})
        self.base_optimizer = _built_base(base_optimizer, self.param_groups, rho, base_kwargs)
        # One list of groups for both objects: a scheduler on either drives the lr (and rho) used.
        self.param_groups = self.base_optimizer.param_groups
        self.base_optimizer.defaults.setdefault("rho", rho)  # groups added later get it too
        self.defaults = self.base_optimizer.defaults
        self._group_rho()  # groups given with their own rho must agree
        if self.rho_min is not None and lr_max is None:
            lr_max = float(self.param_groups[0]["lr"])
        self.lr_max = check("lr_max", lr_max)
        if self.rho_min is not None:
            check("lr_max", self.lr_max, within=Range(self.lr_min, math.inf, "()"))  # above lr_min

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
        return group_rho(self.param_groups, self.defaults["rho"])

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

    def _skip_nonfinite(self, which: str, scaled: bool, step: Optional[int] = None) -> None:
        """Count a skipped step; warn unless a loss scaler is in charge (an overflow is its routine
        signal).  ``step``: a step decided on the device whose verdict arrived later."""
        self._nonfinite_steps += 1
        if step is None:
            self.diagnostics["nonfinite"] = 1.0
        if not scaled:
            warnings.warn(f"{type(self).__name__}: non-finite {which} gradient at step "
                          f"{self._step if step is None else step + 1}; the step is skipped "
                          f"({self._nonfinite_steps} skipped so far)", RuntimeWarning, stacklevel=4)

    def _count_arrived(self, *, wait: bool) -> None:
        """Count the skipped steps among the device's verdicts that reached the host (``wait``: all)."""
        if len(self._verdicts):
            for t, which, scaled in self._verdicts.arrived(wait=wait):
                self._skip_nonfinite(which, scaled, step=t)

    @property
    def nonfinite_steps(self) -> int:
        """Steps skipped for a non-finite gradient (waits for the device's verdicts on their way)."""
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

    # False: every step is decided on the host (plugins.host_step); tests compare the two paths
    _decide_on_device = True

    @torch.no_grad()
    def perturb(self, scaler=None, *, loss=None) -> bool:
        """First half of a step: read ``g_t`` from ``.grad`` and move to ``x_t + eps_t``.

        True: clear the gradients, run the second forward/backward inside :meth:`second_pass`,
        then :meth:`descend`.  False (the coin skipped, or ``g_t`` was not finite on the host
        path): call :meth:`descend` all the same.  ``scaler``: the ``GradScaler`` the backward
        went through; ``scaler.step(opt)`` then finishes the step (``docs/mixed_precision.md``).
        ``loss``: the first pass's loss, for ``diagnostics["loss_gap"]`` (``docs/torch.md``)."""
        if self._pending is not None:
            raise RuntimeError("perturb() called twice: finish the step with descend() or abandon() first")
        step = self._begin(scaler, loss)  # the coin, rho, the step's lists; g_t unscaled where kept
        if self._decides_on_device(step):  # no host read: g_t's finiteness stays on the device
            device_step.prepare(step, self._own_state)
            self._last = device_step.perturb(step, self._last, self._scratch)
        else:  # one reduction, one host read
            self._last, sums = host_step.perturb(step, self._last, self._own_state, self._scratch, self._exchange)
            if step.kind is Kind.NONFINITE:
                self._skip_nonfinite("first-pass", step.scaled)
        self._pending = step
        if step.exchange is not None and step.kind is Kind.PERTURBED:  # partition_group: the others' too
            try:
                host_step.move_others(step, sums)
            except BaseException:
                self.abandon()
                raise
        return step.kind is Kind.PERTURBED

    def _begin(self, scaler, loss) -> StepInFlight:
        """The step's start: its rho (may refuse: before anything moves), its lists, the
        coin ``R_t`` (the same on every rank: where the sums cross ranks every rank
        decides alike, whatever it holds), and ``g_t`` unscaled where it stays in ``.grad``."""
        rho = self.current_rho()
        self._count_arrived(wait=False)  # the verdicts of earlier steps decided on the device
        self._lists = lists = StepLists.of(self.param_groups, self._lists, self.partition_group,
                                           self._model_gathers, self.adaptive)
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
                            params=params, two_pass=two_pass, grads=grads, loss_scale=loss_scale, diagnostics=diag,
                            first_loss=loss.detach() if torch.is_tensor(loss) else loss)
        if self._partitioned and two_pass:
            step.exchange = self._exchange.get("exchange")
        return step

    def _decides_on_device(self, step: StepInFlight) -> bool:
        """Whether this step keeps its decisions on the device (:mod:`plugins.device_step`): one
        process, replicas or shards every rank counts, one device, no exchange."""
        return (self._decide_on_device and step.lists.on_device and step.exchange is None
                and (self.partition_group is None or self._model_gathers))

    @torch.no_grad()
    def restore(self) -> None:
        """Put the parameters back at ``x_t``; a no-op unless they sit at ``x_t + eps_t``."""
        if self._pending is not None:
            self._pending.restore()

    def abandon(self) -> None:
        """Restore and drop the step in flight without a base step (the host skipped the update)."""
        step = self._pending
        self.restore()
        if step is not None and step.fresh and not bool(step.finite):  # (one host read, on a first step only)
            device_step.forget_slopes(step, self._own_state)
        self._pending = None
        self.in_second_pass = False

    def descend(self, *, loss=None) -> bool:
        """Second half of a step: back to ``x_t``, and the base optimizer steps with ``h_t``
        (GSAM-corrected) or, where the coin skipped, ``g_t``.  Returns whether it stepped (None
        where a fused base decided on the device); a non-finite ``g_t`` or ``h_t`` skips the
        step.  ``loss``: the second pass's loss, for ``diagnostics["loss_gap"]``."""
        if self._pending is None:
            raise RuntimeError("descend() without perturb(): call perturb() after the first backward")
        if self._pending.scaled:
            raise RuntimeError(scaling.SCALED_STEP)
        # through step(), which torch's LR schedulers and step hooks wrap: they see this step taken
        return self.step(loss=loss)

    @_ends_with_the_diagnostics_wait
    @torch.no_grad()
    def _descend(self, grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None) -> bool:
        """:meth:`descend`'s work.  ``grad_scale``: the scale ``.grad`` still carries (None once
        ``scaler.unscale_(opt)`` ran); ``found_inf``: the scaler's verdict on it."""
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
        if self._decide_on_device and host_step.verdict_on_device(step, self.base_optimizer):
            return self._descend_on_device(step, grad_scale, found_inf)  # h_t's verdict stays on the device
        if not host_step.descend(step, grad_scale, found_inf):  # one host read: is h_t finite?
            self._skip_nonfinite("second-pass", step.scaled)
            return False
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
        """The block of the second forward/backward, at ``x_t + eps_t`` (``docs/torch.md``): the
        first pass's RNG state ``rng`` replayed (the same dropout masks), ``model``'s BatchNorm
        statistics kept from the first pass, ``in_second_pass`` True; an exception restores
        ``x_t`` and drops the step (:meth:`abandon`)."""
        pending = self._pending
        if pending is None or pending.kind is not Kind.PERTURBED:
            raise RuntimeError("second_pass() without a perturbation: enter it only when perturb() returned True")
        if self._exchanges:
            if model is None:
                self.abandon()
                raise ValueError(D.PARTITION_MODEL)
            try:  # the other ranks' parameters at x + eps, before the second forward
                pending.join(D.exchange_for(self._exchange, model, self._all_params(), self.partition_group))
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
        """:meth:`perturb` under davda54/sam's and the official VaSSO code's name
        (``docs/migration.md``); ``zero_grad=True`` clears the gradients afterwards.  Their loops
        run the second pass whatever this returns, so a step the coin skips keeps ``g_t`` for
        :meth:`second_step`.  Refused under ``partition_group`` (the second pass would run
        outside :meth:`second_pass`, without the other ranks' parameters)."""
        if self._exchanges:
            raise ValueError("first_step()/second_step() run the second pass outside second_pass(), so under "
                             "partition_group the other ranks' parameters would stay at x_t: use "
                             "step(closure, model=model), or perturb(), second_pass(model, rng) and descend()")
        wanted = self.perturb(loss=loss)
        pending = self._pending
        if pending.kind is Kind.FIRST_GRADIENT:  # the coin skipped: keep g_t for second_step
            params = pending.lists.params
            pending.kept_grads = (params, [q.grad if zero_grad else q.grad.clone() for q in params])
        if zero_grad:
            self.zero_grad()
        return wanted

    def second_step(self, zero_grad: bool = False, *, loss=None) -> bool:
        """:meth:`descend` under the ecosystem's name; ``zero_grad=True`` clears the gradients after."""
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
        """One full step (``docs/torch.md``): ``closure`` (clears nothing it needs: the gradients
        are cleared before each call) computes the loss, calls ``backward()`` and returns the
        loss, at ``x_t`` and, unless the coin skips, inside :meth:`second_pass`.  Returns the
        first loss.  ``scaler``: the ``GradScaler`` the closure's backward goes through; the
        caller calls ``scaler.update()`` after.  Without a closure, finishes the step
        :meth:`perturb` started, as :meth:`descend` (what ``scaler.step(opt)`` calls)."""
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
        if self._pending.scaled:  # scaler.step(self), whose call of step() finishes this one: hooks see one step
            scaling.step_through(self, scaler, self._finish_step)
        else:
            self._descend()  # not descend(): this step() is the one torch's wrappers see
        return loss

    def _set_loss_gap(self, first, second) -> None:
        """The loss gap (:func:`plugins.diagnostics.record_loss_gap`)."""
        device = self._lists.layout.device if self._lists is not None else torch.device("cpu")
        diagnostics.record_loss_gap(self.diagnostics, first, second, self.partition_group, device)

    def _finish_step(self, loss=None) -> bool:
        """``step()`` without a closure: the explicit API's descend, directly or through
        ``scaler.step(opt)`` (which sets ``found_inf`` and ``grad_scale`` around the call)."""
        found_inf, grad_scale = scaling.handed_verdict(self)
        pending = self._pending
        if pending is None and S.is_state_initialization(self):
            self.base_optimizer.step()  # lr 0, zero gradients: creates the base's state, moves nothing
            return False
        problem = scaling.finish_problem(type(self).__name__, pending, found_inf)
        if problem is not None:
            # GradScaler deletes its attributes only when step() returns: do it here, or
            # a stale grad_scale would multiply into the next scaler.step(opt)
            scaling.drop_verdict(self)
            raise RuntimeError(problem)
        if loss is not None and pending.kind is Kind.PERTURBED and pending.first_loss is not None:
            self._set_loss_gap(pending.first_loss, loss)  # the explicit API's losses
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
        """torch's optimizer state dict, each parameter's entry holding the base optimizer's
        state beside this wrapper's ``sam_slope``, ``sam_previous_ascent``, ``sam_held`` and
        ``sam_counters``, so that tools which handle per-parameter state only carry all of it
        (:mod:`plugins.state`)."""
        if self._pending is not None:
            raise RuntimeError("state_dict() in the middle of a step: call descend() or abandon() first")
        return S.state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, keyed by index or by parameter name (as torch's
        ``set_optimizer_state_dict`` passes it); any other format is refused, naming the keys."""
        S.load_state_dict(self, state_dict)

    @staticmethod
    def base_optimizer_state(state_dict: Dict[str, Any]) -> Dict[Any, Dict[str, Any]]:
        """The base optimizer's per-parameter state (``exp_avg``, ...) in a state dict of
        this class, keyed as there."""
        return S.base_optimizer_state(state_dict)

    def _all_params(self) -> List[torch.Tensor]:
        return [q for g in self.param_groups for q in g["params"]]

    def state_nbytes(self, *, include_scratch: bool = True) -> int:
        """Bytes this wrapper holds beyond the base optimizer (persistent state, and
        the per-step scratch buffers such as ``anchor`` when ``include_scratch``)."""
        return S.nbytes(self._own_state) + (S.nbytes(self._scratch) if include_scratch else 0)


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

