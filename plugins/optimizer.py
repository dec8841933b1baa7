"""The sharpness-aware optimizer family as one wrapper over any torch optimizer.

One class, four independent choices (``DESIGN.md`` section 1):

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
fp16 / bf16 parameters                      + ``anchor`` (exact restore)
==========================================  =========================================

The restore of plain geometry with fp32 parameters subtracts the same ``s * v``
it added, so parameters come back equal up to the rounding of one add and one
subtract; everything else restores from the ``anchor`` copy, exactly.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional

import torch

from . import perturbation as P
from .named_params import normalize_param_group, normalize_param_groups

__all__ = ["SharpnessAware", "SAM", "VASSO"]

_EXACT_DTYPES = (torch.float32, torch.float64)
_PERSISTENT = ("slope", "previous_ascent")
_NAN = float("nan")


def _check_number(name: str, value: Any, low: float, high: float, *, low_open: bool = False,
                  high_open: bool = False) -> float:
    """``value`` as a float within the interval, else ValueError naming ``name`` and the range."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number in {interval}, got {value!r} ({type(value).__name__})")
    v = float(value)
    if math.isnan(v) or v < low or v > high or (low_open and v == low) or (high_open and v == high):
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return v


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
        theta: ``None`` for SAM's raw gradient, else VASSO's EMA weight in ``(0, 1]``.
        adaptive: ASAM geometry (Kwon et al. 2021), ``T = |x| + eta`` on weights.
        eta: ASAM's offset, ``>= 0``.
        gsam_alpha: GSAM's descent correction (Zhuang et al. 2022), ``>= 0``; 0 is off.
        p: probability of the second pass, in ``[0, 1]``; ``< 1`` gives eSAM/eVASSO.
        seed: seeds the coin; the same on every distributed rank.
        track_stability: compute ``||eps_t - eps_{t-1}||`` (may hold one buffer,
            see the module docstring).
        exact_restore: keep a copy of ``x_t`` during each two-pass step and restore
            from it, bit for bit, instead of subtracting ``eps`` again (one more
            parameter-sized buffer; automatic for adaptive geometry and fp16/bf16).

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

    Or, for loops that own their forward and backward (fairseq, DomainBed)::

        >>> opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward()
        >>> if opt.perturb():                  # g_t read from .grad; now at x_t + eps_t
        ...     opt.zero_grad()
        ...     torch.nn.functional.cross_entropy(model(x), y).backward()   # h_t
        >>> opt.descend()                      # back to x_t, base step with h_t
        True
    """

    def __init__(self, params, base_optimizer, rho: float = 0.05, *, theta: Optional[float] = None,
                 adaptive: bool = False, eta: float = 0.01, gsam_alpha: float = 0.0, p: float = 1.0,
                 seed: int = 0, track_stability: bool = True, exact_restore: bool = False, **base_kwargs):
        # (name, tensor) pairs -> "param_names" here, as torch >= 2.5 does: older torch refuses them
        params = normalize_param_groups(params)
        self.rho = _check_number("rho", rho, 0.0, math.inf, high_open=True)
        self.theta = None if theta is None else _check_number("theta", theta, 0.0, 1.0, low_open=True)
        self.eta = _check_number("eta", eta, 0.0, math.inf, high_open=True)
        self.gsam_alpha = _check_number("gsam_alpha", gsam_alpha, 0.0, math.inf, high_open=True)
        self.p = _check_number("p", p, 0.0, 1.0)
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {adaptive!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.adaptive = adaptive
        self.seed = int(seed)
        self.track_stability = bool(track_stability)
        self.exact_restore = bool(exact_restore)

        super().__init__(params, defaults={})
        if isinstance(base_optimizer, torch.optim.Optimizer):
            if base_kwargs:
                raise ValueError(f"base_optimizer is already built: unexpected keyword arguments {sorted(base_kwargs)}")
            mine = {id(q) for g in self.param_groups for q in g["params"]}
            theirs = {id(q) for g in base_optimizer.param_groups for q in g["params"]}
            if mine != theirs:
                raise ValueError("base_optimizer must optimize exactly the parameters given to this optimizer "
                                 f"({len(mine)} given, base has {len(theirs)}, {len(mine & theirs)} in common)")
            self.base_optimizer = base_optimizer
        elif isinstance(base_optimizer, type) and issubclass(base_optimizer, torch.optim.Optimizer):
            self.base_optimizer = base_optimizer(self.param_groups, **base_kwargs)
        else:
            raise ValueError(f"base_optimizer must be a torch.optim.Optimizer subclass or instance, got {base_optimizer!r}")
        # One list of groups for both objects: a scheduler on either drives the lr used.
        self.param_groups = self.base_optimizer.param_groups
        self.defaults = self.base_optimizer.defaults

        self.in_second_pass = False
        self.diagnostics: Dict[str, float] = self._empty_diagnostics()
        self._step = 0
        self._nonfinite_steps = 0
        self._previous: Optional[Dict[str, float]] = None  # norms of the last applied ascent
        self._scratch: Dict[torch.Tensor, Dict[str, torch.Tensor]] = defaultdict(dict)
        self._pending: Optional[Dict[str, Any]] = None  # the step between perturb() and descend()

    # ------------------------------------------------------------------ plumbing

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        param_group = normalize_param_group(param_group)
        if hasattr(self, "base_optimizer"):
            self.base_optimizer.add_param_group(param_group)
        else:
            super().add_param_group(param_group)

    @staticmethod
    def _empty_diagnostics() -> Dict[str, float]:
        return {"two_pass": 0.0, "ascent_norm": _NAN, "sharpness": _NAN, "stability": _NAN,
                "loss_gap": _NAN, "nonfinite": 0.0}

    def _params_with_grad(self):
        params, names = [], []
        for group in self.param_groups:
            group_names = group.get("param_names")
            for i, q in enumerate(group["params"]):
                if q.grad is None:
                    continue
                if q.grad.is_sparse:
                    raise RuntimeError("sharpness-aware optimizers do not support sparse gradients")
                params.append(q)
                names.append(group_names[i] if group_names is not None else None)
        return params, names

    def _buffers(self, params, key: str, like: List[torch.Tensor], store=None, *,
                 zeros: bool = False) -> List[torch.Tensor]:
        """Per-parameter buffers named ``key``, allocated on first use as copies of
        ``like`` (or zeros of its shape)."""
        store = self.state if store is None else store
        out = []
        for q, src in zip(params, like):
            buf = store[q].get(key)
            if buf is None:
                src = src.detach()
                buf = store[q][key] = torch.zeros_like(src) if zeros else src.clone(memory_format=torch.preserve_format)
            out.append(buf)
        return out

    def _warn_nonfinite(self, which: str) -> None:
        self._nonfinite_steps += 1
        warnings.warn(f"{type(self).__name__}: non-finite {which} gradient at step {self._step}; "
                      f"the step is skipped ({self._nonfinite_steps} skipped so far)", RuntimeWarning,
                      stacklevel=3)

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
    def perturb(self) -> bool:
        """First half of a step: read ``g_t`` from ``.grad`` and move to ``x_t + eps_t``.

        Returns True when the caller must now clear the gradients and run the second
        forward/backward on the same batch (same RNG state; BatchNorm frozen with
        :func:`plugins.frozen_running_stats`), then call :meth:`descend`.  Returns
        False when no second pass is wanted: the coin skipped it (``.grad`` still
        holds ``g_t``) or ``g_t`` was not finite (the step will be skipped); call
        :meth:`descend` all the same.
        """
        if self._pending is not None:
            raise RuntimeError("perturb() called twice: finish the step with descend() or abandon() first")
        step = self._step
        self._step += 1
        self.diagnostics = diag = self._empty_diagnostics()
        params, names = self._params_with_grad()
        grads = [q.grad for q in params]
        grad_norm = float(P.global_norm(grads))
        if not math.isfinite(grad_norm):
            diag["nonfinite"] = 1.0
            self._pending = {"kind": "nonfinite"}
            self._warn_nonfinite("first-pass")
            return False

        two_pass = P.second_pass_coin(self.p, self.seed, step) and len(params) > 0
        plain = not self.adaptive
        # The stability diagnostic from scalars alone works where the previous ascent
        # is recoverable from what the slope buffer holds before this step writes it.
        scalar_stability = self.track_stability and plain and (self.theta is None or self.p >= 1.0)

        if self.theta is None:  # SAM: the slope is g_t; keep it only if it is used
            inner_prev = None
            if two_pass and scalar_stability and self._previous is not None:
                # <g_t, g_last>: the buffer still holds the slope of the last applied ascent
                kept = [(g, self.state[q]["slope"]) for q, g in zip(params, grads) if "slope" in self.state[q]]
                inner_prev = P.dot([g for g, _ in kept], [s for _, s in kept])
            slopes = self._buffers(params, "slope", grads) if two_pass else grads
            if two_pass:
                torch._foreach_copy_(slopes, grads)
            slope_norm = grad_norm
        else:  # VASSO: d_t is updated on every step, skipped or not (Alg. 2, line 5)
            fresh_ids = {id(q) for q in params if "slope" not in self.state[q]}
            slopes = self._buffers(params, "slope", grads)  # new entries start at d_0 = g_0
            update = [(d, g) for q, d, g in zip(params, slopes, grads) if id(q) not in fresh_ids]
            inner_prev = None
            if scalar_stability and self._previous is not None:
                # <d_t, d_{t-1}> = (1 - theta) ||d_{t-1}||^2 + theta <g_t, d_{t-1}>
                gd = P.dot([g for _, g in update], [d for d, _ in update])
                prev_norm = self._previous["slope_norm"]
                inner_prev = (1.0 - self.theta) * prev_norm * prev_norm + self.theta * gd
            if update:
                P.update_moving_average([d for d, _ in update], [g for _, g in update], self.theta)
            # ||d_t|| only where eps is built (a skipped step needs none)
            slope_norm = float(P.global_norm(slopes)) if two_pass else _NAN

        if not two_pass:
            self._pending = {"kind": "first_gradient"}
            return False

        if self.gsam_alpha > 0.0 and self.theta is not None:
            torch._foreach_copy_(self._buffers(params, "first_grad", grads, self._scratch), grads)
        need_anchor = self.exact_restore or self.adaptive or any(q.dtype not in _EXACT_DTYPES for q in params)
        if need_anchor:
            torch._foreach_copy_(self._buffers(params, "anchor", params, self._scratch), params)

        rho = self.rho
        if plain:
            scale = P.plain_ascent_scale(rho, slope_norm)
            torch._foreach_add_(params, slopes, alpha=scale)
            ascent_norm = rho if slope_norm > 0.0 else 0.0
            diag["sharpness"] = rho * slope_norm
            eps = None
        else:
            mask = P.weight_mask(params, None if any(n is None for n in names) else names)
            eps, scaled_norm = P.ascent_direction(slopes, params, rho, adaptive_mask=mask, eta=self.eta)
            torch._foreach_add_(params, eps)
            ascent_norm = float(P.global_norm(eps))
            diag["sharpness"] = rho * scaled_norm
            scale = None
        diag["two_pass"] = 1.0
        diag["ascent_norm"] = ascent_norm

        if self.track_stability:
            if scalar_stability:
                # eps_t = s_t v_t and eps_last = s_last v_last: <eps_t, eps_last> from <v_t, v_last>
                if self._previous is not None and inner_prev is not None:
                    prev = self._previous
                    inner = scale * P.plain_ascent_scale(prev["rho"], prev["slope_norm"]) * inner_prev
                    diag["stability"] = P.distance_between_ascents(ascent_norm, prev["ascent_norm"], inner)
            else:
                prev_bufs = self._buffers(params, "previous_ascent", grads, zeros=True)
                if self._previous is not None:
                    inner = P.dot(eps, prev_bufs) if eps is not None else scale * P.dot(slopes, prev_bufs)
                    diag["stability"] = P.distance_between_ascents(ascent_norm, self._previous["ascent_norm"], inner)
                if eps is not None:
                    torch._foreach_copy_(prev_bufs, eps)
                else:
                    torch._foreach_copy_(prev_bufs, slopes)
                    torch._foreach_mul_(prev_bufs, scale)
        self._previous = {"rho": rho, "slope_norm": slope_norm, "ascent_norm": ascent_norm}

        self._pending = {"kind": "perturbed", "params": params, "slopes": slopes, "scale": scale,
                         "anchored": need_anchor, "at_ascent": True}
        return True

    @torch.no_grad()
    def restore(self) -> None:
        """Put the parameters back at ``x_t``; a no-op unless they sit at ``x_t + eps_t``."""
        pending = self._pending
        if pending is None or pending["kind"] != "perturbed" or not pending["at_ascent"]:
            return
        params = pending["params"]
        if pending["anchored"]:
            torch._foreach_copy_(params, [self._scratch[q]["anchor"] for q in params])
        else:
            torch._foreach_add_(params, pending["slopes"], alpha=-pending["scale"])
        pending["at_ascent"] = False

    def abandon(self) -> None:
        """Restore and drop the step in flight without a base step (the host skipped the update)."""
        self.restore()
        self._pending = None
        self.in_second_pass = False

    @torch.no_grad()
    def descend(self) -> bool:
        """Second half of a step: restore ``x_t`` and let the base optimizer step.

        The base step uses ``h_t`` from ``.grad`` after a second pass (GSAM-corrected
        when ``gsam_alpha > 0``), else ``g_t``.  Returns True iff a base step was
        taken; a non-finite ``g_t`` or ``h_t`` skips it (with a warning).
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("descend() without perturb(): call perturb() after the first backward")
        self.restore()
        self._pending = None
        self.in_second_pass = False
        if pending["kind"] == "nonfinite":
            return False
        if pending["kind"] == "perturbed":
            params = [q for q in pending["params"] if q.grad is not None]
            second = [q.grad for q in params]
            if not math.isfinite(float(P.global_norm(second))):
                self.diagnostics["nonfinite"] = 1.0
                self._warn_nonfinite("second-pass")
                return False
            if self.gsam_alpha > 0.0 and self.rho > 0.0:  # rho = 0: h == g, nothing to correct
                key, store = ("slope", self.state) if self.theta is None else ("first_grad", self._scratch)
                P.gsam_correct(second, [store[q][key] for q in params], self.gsam_alpha)
        self.base_optimizer.step()
        return True

    # ------------------------------------------------------------------ the closure API

    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None):
        """One full step.  ``closure`` clears the gradients, computes the loss, calls
        ``backward()`` and returns the loss; it runs at ``x_t`` and, unless the coin
        skips, at ``x_t + eps_t`` from the same RNG state (same dropout masks).
        Returns the first loss.  ``in_second_pass`` is True during the second call.
        """
        if closure is None:
            raise RuntimeError(f"{type(self).__name__}.step() needs a closure that re-evaluates the loss; "
                               "loops that own forward/backward use perturb() and descend()")
        rng = P.rng_state()
        with torch.enable_grad():
            loss = closure()
        try:
            if self.perturb():
                P.set_rng_state(rng)
                self.in_second_pass = True
                with torch.enable_grad():
                    second = closure()
                self.in_second_pass = False
                if loss is not None and second is not None:
                    self.diagnostics["loss_gap"] = _as_float(second) - _as_float(loss)
        except BaseException:
            self.abandon()
            raise
        self.descend()
        return loss

    # ------------------------------------------------------------------ state

    def _all_params(self) -> List[torch.Tensor]:
        return [q for g in self.param_groups for q in g["params"]]

    def state_dict(self) -> Dict[str, Any]:
        """The base optimizer's state dict plus this wrapper's buffers and counters."""
        if self._pending is not None:
            raise RuntimeError("state_dict() in the middle of a step: call descend() or abandon() first")
        index = {id(q): i for i, q in enumerate(self._all_params())}
        own = {index[id(q)]: {k: v for k, v in buffers.items() if k in _PERSISTENT}
               for q, buffers in self.state.items() if id(q) in index}
        return {
            "base_optimizer": self.base_optimizer.state_dict(),
            "state": {i: b for i, b in own.items() if b},
            "sharpness": {"step": self._step, "seed": self.seed, "previous": self._previous,
                          "nonfinite_steps": self._nonfinite_steps,
                          # recorded for provenance; the constructor's values are the ones used
                          "rho": self.rho, "theta": self.theta, "adaptive": self.adaptive, "eta": self.eta,
                          "gsam_alpha": self.gsam_alpha, "p": self.p},
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "base_optimizer" not in state_dict or "sharpness" not in state_dict:
            raise ValueError("not a sharpness-aware optimizer state dict (no 'base_optimizer'/'sharpness' entries)")
        self.base_optimizer.load_state_dict(state_dict["base_optimizer"])
        # torch's load_state_dict rebuilds the group list: link it again.
        self.param_groups = self.base_optimizer.param_groups
        params = self._all_params()
        self.state = defaultdict(dict)
        for i, buffers in state_dict["state"].items():
            q = params[int(i)]
            self.state[q] = {k: v.detach().to(device=q.device, dtype=q.dtype).clone() for k, v in buffers.items()}
        meta = state_dict["sharpness"]
        self._step = int(meta["step"])
        self.seed = int(meta["seed"])
        self._previous = dict(meta["previous"]) if meta["previous"] is not None else None
        self._nonfinite_steps = int(meta.get("nonfinite_steps", 0))
        self._scratch = defaultdict(dict)
        self._pending = None

    def state_nbytes(self, *, include_scratch: bool = True) -> int:
        """Bytes this wrapper holds beyond the base optimizer (persistent state, and
        the per-step scratch buffers such as ``anchor`` when ``include_scratch``)."""
        total = sum(v.numel() * v.element_size() for b in self.state.values() for v in b.values()
                    if torch.is_tensor(v))
        if include_scratch:
            total += sum(v.numel() * v.element_size() for b in self._scratch.values() for v in b.values())
        return total


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

    def __init__(self, params, base_optimizer, rho: float = 0.05, *, adaptive: bool = False, eta: float = 0.01,
                 gsam_alpha: float = 0.0, p: float = 1.0, seed: int = 0, track_stability: bool = True,
                 exact_restore: bool = False, **base_kwargs):
        super().__init__(params, base_optimizer, rho, theta=None, adaptive=adaptive, eta=eta,
                         gsam_alpha=gsam_alpha, p=p, seed=seed, track_stability=track_stability,
                         exact_restore=exact_restore, **base_kwargs)


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
    >>> sorted(opt.state[model.weight])
    ['slope']
    """

    def __init__(self, params, base_optimizer, rho: float = 0.05, *, theta: float = 0.4, adaptive: bool = False,
                 eta: float = 0.01, gsam_alpha: float = 0.0, p: float = 1.0, seed: int = 0,
                 track_stability: bool = True, exact_restore: bool = False, **base_kwargs):
        if theta is None:
            raise ValueError("theta must be in (0, 1], got None (use SAM for the raw gradient)")
        super().__init__(params, base_optimizer, rho, theta=theta, adaptive=adaptive, eta=eta,
                         gsam_alpha=gsam_alpha, p=p, seed=seed, track_stability=track_stability,
                         exact_restore=exact_restore, **base_kwargs)
