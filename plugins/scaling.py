"""Loss scaling: what a sharpness-aware step does with a ``torch.amp.GradScaler``.

The step reads the scaler's scale once (:func:`loss_scale`, no host sync), unscales
``g_t`` and ``h_t`` exactly once on the device (:func:`unscale`), and leaves the one
overflow decision of the second pass to the scaler: ``scaler.step(opt)`` hands the
optimizer its verdict and the scale ``.grad`` still carries as the attributes
``found_inf`` and ``grad_scale`` (torch's protocol for optimizers that unscale
themselves, ``_step_supports_amp_scaling``), read here by :func:`handed_verdict`.  Under a
wrapper whose ``step()`` calls the core's (``ZeroRedundancyOptimizer``, OSS; fairseq's
``--zero-sharding os`` under ``--amp``), :func:`step_wrapper` finishes the step through
``scaler.step(wrapper)`` (``docs/mixed_precision.md``).  Torch only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

__all__ = ["loss_scale", "refuse_unscaled", "unscale", "handed_verdict", "drop_verdict", "verdict_given",
           "step_wrapper", "SCALED_STEP"]

#: The refusal of a loss-scaled step finished without the scaler.
SCALED_STEP = ("this step's gradients are scaled (perturb(scaler=...)): finish it with scaler.step(opt), "
               "then scaler.update(); under a wrapper whose step() calls this optimizer's "
               "(ZeroRedundancyOptimizer, OSS), with plugins.scaling.step_wrapper(scaler, wrapper, opt)")


def loss_scale(scaler, grads: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
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


def refuse_unscaled(scaler, opt) -> None:
    """Refuse a ``scaler.unscale_(opt)`` made before ``perturb(scaler=...)``: ``g_t`` would be
    unscaled twice (a silently tiny ``g_t``), and the scaler, marked as done with ``opt``,
    would leave ``h_t`` scaled.  Read from the scaler's own record of ``opt`` (torch's
    ``_per_optimizer_states``, there since torch 1.6); a scaler without one is not checked."""
    states = getattr(scaler, "_per_optimizer_states", None)
    stage = states.get(id(opt), {}).get("stage") if isinstance(states, dict) else None
    if getattr(stage, "name", None) == "UNSCALED":
        raise RuntimeError("perturb(scaler=...) after scaler.unscale_(opt): g_t would be unscaled twice. "
                           "perturb() unscales g_t itself; call scaler.unscale_(opt) only after the second "
                           "backward, e.g. to clip h_t (docs/mixed_precision.md)")


def unscale(tensors: Sequence[torch.Tensor], scale: torch.Tensor, *, in_place: bool) -> List[torch.Tensor]:
    """``tensors / scale`` for a loss scale held in a 0-dim tensor, on the device (no host
    sync): in place, or as new tensors.  The reciprocal is taken in float64, as
    ``torch.amp.GradScaler`` takes it, so a power-of-two scale unscales exactly."""
    inverse = scale.detach().double().reciprocal().float()
    tensors = list(tensors)
    out = list(tensors)
    for device in {t.device for t in tensors}:
        index = [i for i, t in enumerate(tensors) if t.device == device]
        group = [tensors[i] for i in index]
        factor = inverse.to(device, non_blocking=True)
        if in_place:
            torch._foreach_mul_(group, factor)
        else:
            for i, t in zip(index, torch._foreach_mul(group, factor)):
                out[i] = t
    return out


def handed_verdict(opt) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(found_inf, grad_scale)`` as ``scaler.step(opt)`` (or :func:`verdict_given`)
    handed them to ``opt``'s ``step()``; ``(None, None)`` outside such a call."""
    return opt.__dict__.get("found_inf"), opt.__dict__.get("grad_scale")


def drop_verdict(opt) -> None:
    """Forget a handed verdict.  GradScaler deletes its attributes only when ``step()``
    returns: a ``step()`` that raises must drop them itself, or a stale ``grad_scale``
    would multiply into the next ``scaler.step(opt)``."""
    opt.__dict__.pop("found_inf", None)
    opt.__dict__.pop("grad_scale", None)


@contextlib.contextmanager
def verdict_given(opt, found_inf: torch.Tensor, grad_scale: Optional[torch.Tensor] = None) -> Iterator[None]:
    """Hand ``opt`` a scaler's verdict for the ``opt.step()`` that another object calls
    inside the block (a sharding wrapper's ``step()`` under ``scaler.step(wrapper)``), as
    ``scaler.step(opt)`` would hand it; dropped when the block ends."""
    opt.found_inf, opt.grad_scale = found_inf, grad_scale
    try:
        yield
    finally:
        drop_verdict(opt)


def step_wrapper(scaler, wrapper, core):
    """``scaler.step(wrapper)`` for a wrapper whose ``step()`` calls ``core``'s, the sharpness-
    aware optimizer whose ``perturb(scaler=...)`` began the step (``ZeroRedundancyOptimizer``,
    fairscale's ``OSS``): the scaler unscales the wrapper's gradients (``h_t``) and steps it
    only where they are finite, so ``core`` is handed that verdict; where the scaler skipped
    (an overflow in ``h_t``), ``core`` is handed the overflow and steps as under
    ``scaler.step(core)``: the parameters back at ``x_t``, no base step, the skip counted in
    ``nonfinite_steps``.  Every rank must reach the same verdict (as DDP's averaged gradients
    give), as the wrapper's own step requires.  Returns what ``scaler.step`` returns; the
    caller calls ``scaler.update()`` after (``docs/mixed_precision.md``)."""
    params = [p for group in core.param_groups for p in group["params"]]
    finite = torch.zeros((), device=params[0].device if params else torch.device("cpu"))
    try:
        with verdict_given(core, finite):
            taken = scaler.step(wrapper)
    except BaseException:
        if core.in_flight:  # x_t back, the step dropped
            core.abandon()
        raise
    if core.in_flight:  # the scaler skipped wrapper.step(): the core takes the overflow as its verdict
        with verdict_given(core, torch.ones_like(finite)):
            core.step()
    return taken


_ABSENT = object()


def step_through(opt, scaler, finish) -> None:
    """``scaler.step(opt)`` whose call of ``opt.step()`` goes to ``finish``: inside
    ``step(closure, scaler=)`` that call is this step's finish, not a second step, so torch's
    step hooks and an LR scheduler's count see one step.  (An instance attribute for the call:
    an LR scheduler's own wrapper, if any, comes back after.)"""
    own = opt.__dict__.get("step", _ABSENT)
    opt.step = finish
    try:
        scaler.step(opt)
    finally:
        if own is _ABSENT:
            del opt.step
        else:
            opt.step = own


def finish_problem(name: str, pending, found_inf) -> Optional[str]:
    """Why ``step()`` without a closure cannot finish the step in flight ``pending`` (None: it
    can); ``found_inf``: the verdict ``scaler.step(opt)`` handed over, None without a scaler."""
    if pending is None:
        return (f"{name}.step() needs a closure that re-evaluates the loss; loops that own forward/backward "
                "use perturb() and descend() (or scaler.step(opt) after perturb(scaler=scaler)): no step is "
                "in flight")
    if pending.scaled and found_inf is None:
        return SCALED_STEP
    if not pending.scaled and found_inf is not None:
        return ("scaler.step(opt) finishes a step whose perturb() was given no scaler, so g_t was used scaled: "
                "pass the scaler to perturb(scaler=scaler)")
    return None
