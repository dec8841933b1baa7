"""The optimizer's state: its own per-parameter buffers, the merged view ``opt.state``,
and the state dict in torch's shape.

Each parameter's entry holds the base optimizer's state (Adam's ``exp_avg``, ...) beside
this wrapper's: ``sam_slope`` (``d_t`` for VASSO), ``sam_previous_ascent`` where kept,
``sam_held`` (which of them are real; the others are zero placeholders, so that an entry
has the same keys at every step) and ``sam_counters`` (the step counter and seed of the
coin, the skipped-step count and the last ascent's norms, the same in every entry, as
Adam's ``step``).  Tools that handle per-parameter state only (torch's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` under FSDP2,
``ZeroRedundancyOptimizer.consolidate_state_dict``) carry all of it.  One format is
loaded, today's; anything else is refused, naming the keys expected.  Torch only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import MutableMapping
from typing import Any, Dict, List, Optional

import torch

from . import ondevice, perturbation
from .diagnostics import as_float

__all__ = ["PERSISTENT", "counters_dict", "split_entry", "MergedState", "state_dict", "load_state_dict",
           "is_state_initialization"]

#: This wrapper's persistent per-parameter buffers (the per-step scratch is not saved).
PERSISTENT = ("slope", "previous_ascent")
_NAN = float("nan")
_OWN_PREFIX = "sam_"  # this wrapper's keys in a parameter's merged state: no torch optimizer uses it
_COUNTERS = "sam_counters"
# which of the entry's buffers are real (1) and which zero placeholders (0): the entry lists
# every buffer at every step, so that a template from a fresh optimizer has the saved keys
_HELD = "sam_held"
_COUNTER_KEYS = ("step", "seed", "nonfinite_steps", "last_rho", "last_slope_norm", "last_ascent_norm")
_UNPREFIXED = ("opt.state[p] merges the base optimizer's state with this wrapper's, whose {key!r} is "
               "'sam_{key}' there (the wrapper's own store is opt._own_state)")
_EXPECTED = ("a state dict of SharpnessAware.state_dict(): the keys 'state' (per parameter index or name: "
             "the base optimizer's state beside 'sam_slope', 'sam_previous_ascent', 'sam_held' and "
             "'sam_counters') and 'param_groups' (each with 'rho'), optionally 'sharpness'")


def counters_dict(step, seed, nonfinite_steps, last) -> Dict[str, Any]:
    """The wrapper's scalars as plain numbers (NaN norms: no ascent yet), the value of
    ``sam_counters``: ints and floats only, which every checkpoint tool keeps.  ``last``: the
    optimizer's record of its last ascent (``SharpnessAware._last``, read
    here) or a state dict's ``previous`` entry; None before the first ascent."""
    if torch.is_tensor(last):
        values = last.tolist()
        norm = values[2] if len(values) == 3 else perturbation.plain_ascent_norm(values[0], values[1])
        last = None if math.isnan(values[0]) else {"rho": values[0], "slope_norm": values[1], "ascent_norm": norm}
    previous = last or {}
    return {"step": int(step), "seed": int(seed), "nonfinite_steps": int(nonfinite_steps),
            "last_rho": as_float(previous.get("rho", _NAN)),
            "last_slope_norm": as_float(previous.get("slope_norm", _NAN)),
            "last_ascent_norm": as_float(previous.get("ascent_norm", _NAN))}


def split_entry(entry: Dict[str, Any]):
    """One parameter's merged state -> (the base optimizer's, this wrapper's real buffers,
    counters or None); the placeholders, which ``sam_held`` marks 0, are dropped."""
    base, own, counters, held = {}, {}, None, None
    for key, value in entry.items():
        if key == _COUNTERS:
            counters = {k: value[k] for k in _COUNTER_KEYS}
        elif key == _HELD:
            held = dict(value)  # a dict, or its (name, 0/1) pairs (fairscale's FSDP: see the host quirks below)
        elif isinstance(key, str) and key.startswith(_OWN_PREFIX):
            name = key[len(_OWN_PREFIX):]
            if name not in PERSISTENT:
                raise ValueError(f"unknown sharpness-aware state {key!r} (known: "
                                 f"{[_OWN_PREFIX + n for n in PERSISTENT] + [_HELD, _COUNTERS]})")
            own[name] = value
        else:
            base[key] = value
    if own and held is None:
        raise ValueError(f"a parameter's entry holds {sorted(_OWN_PREFIX + n for n in own)} without "
                         f"{_HELD!r}, which says which of them are real: expected {_EXPECTED}")
    if held is not None:
        own = {name: v for name, v in own.items() if int(held.get(name, 0))}
    return base, own, counters


def state_dict(opt) -> Dict[str, Any]:
    """``opt.state_dict()``: torch's shape (see the module docstring); the param groups
    are the base optimizer's (they carry ``rho``); ``"sharpness"`` repeats the counters
    with the knobs, for provenance."""
    base = opt.base_optimizer.state_dict()
    counters = counters_of(opt)
    state = {k: v for k, v in base["state"].items() if not isinstance(k, int)}  # torch keeps strays
    for i, q in enumerate(opt._all_params()):
        entry = dict(base["state"].get(i, {}))
        view = opt.state[q]
        entry.update((k, view[k]) for k in view.own_keys())  # buffers not copied, as torch's are not
        if entry:
            state[i] = entry
    own_keywords = opt._KEYWORDS.difference(opt.base_optimizer.defaults)
    return {
        "state": state,
        "param_groups": [{k: v for k, v in g.items() if k not in own_keywords} for g in base["param_groups"]],
        "sharpness": {"step": counters["step"], "seed": counters["seed"],
                      "previous": None if math.isnan(counters["last_rho"]) else {
                          k: counters["last_" + k] for k in ("rho", "slope_norm", "ascent_norm")},
                      "nonfinite_steps": counters["nonfinite_steps"],
                      # recorded for provenance; the constructor's values are the ones used
                      "rho": opt.rho, "theta": opt.theta, "adaptive": opt.adaptive, "eta": opt.eta,
                      "gsam_alpha": opt.gsam_alpha, "p": opt.p, "rho_min": opt.rho_min,
                      "lr_max": opt.lr_max, "lr_min": opt.lr_min},
    }


def check_format(state_dict: Dict[str, Any]) -> None:
    """Today's format, or a ValueError naming the keys expected."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict \
            or set(state_dict) - {"state", "param_groups", "sharpness"}:
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"not an optimizer state dict of this format: got the keys {got}, expected {_EXPECTED}")


def load_state_dict(opt, state_dict: Dict[str, Any]) -> None:
    """``opt.load_state_dict()``: today's format, keyed by index or (as torch's
    ``set_optimizer_state_dict`` passes it) by parameter name."""
    check_format(state_dict)
    base_state: Dict[Any, Dict[str, Any]] = {}
    own: Dict[Any, Dict[str, Any]] = {}
    counters = []
    for key, entry in state_dict["state"].items():
        if entry is None:  # host quirk: ZeroRedundancyOptimizer clears the entries other ranks hold
            continue
        base_part, own_part, entry_counters = split_entry(entry)
        if base_part:  # no entry where the base holds nothing, as its own state dict has none
            base_state[key] = base_part  # (torch 2.1's Adam reads "step" from the first entry)
        if own_part:
            own[key] = own_part
        if entry_counters is not None:
            counters.append(entry_counters)
    if not counters and "sharpness" in state_dict:
        # no entry carries them: no parameter had state, or a host dropped them (fairscale's FSDP, below)
        meta = state_dict["sharpness"]
        counters.append(counters_dict(meta["step"], meta["seed"], meta["nonfinite_steps"], meta["previous"]))
    if not counters:
        raise ValueError("not a sharpness-aware optimizer state dict (no 'sam_counters' in its entries, "
                         "no 'sharpness' entry)")
    if len({repr(sorted(c.items())) for c in counters}) > 1:  # repr: NaN (no ascent yet) equals NaN
        raise ValueError("the state dict's entries disagree on 'sam_counters': "
                         f"{sorted({str(c) for c in counters})}")
    for i, group in enumerate(state_dict["param_groups"]):
        if "rho" not in group:
            raise ValueError(f"param group {i} of the state dict has no 'rho' (keys {sorted(group)}): "
                             f"expected {_EXPECTED}")

    # the verdicts of steps decided on the device still on their way belong to the run being
    # replaced: counted (and warned about) there now, not into the loaded run's count later
    opt._count_arrived(wait=True)
    opt.base_optimizer.load_state_dict({"state": base_state, "param_groups": state_dict["param_groups"]})
    # torch's load_state_dict rebuilds the group list: link it again.
    opt.param_groups = opt.base_optimizer.param_groups
    opt._group_rho()
    # entries are matched to parameters by position in the groups, as torch does
    saved = [k for g in state_dict["param_groups"] for k in g["params"]]
    by_key = dict(zip(saved, opt._all_params()))
    opt._own_state = defaultdict(dict)
    set_counters(opt, counters[0])
    for key, buffers in own.items():  # real buffers only: split_entry dropped the placeholders
        q = by_key[key]
        opt._own_state[q] = {k: v.detach().to(device=q.device, dtype=q.dtype).clone() for k, v in buffers.items()}
    opt._scratch = defaultdict(dict)
    opt._pending = None
    opt._lists = None


def base_optimizer_state(state_dict: Dict[str, Any]) -> Dict[Any, Dict[str, Any]]:
    """The base optimizer's per-parameter state (``exp_avg``, ...) in a state dict of
    this format, keyed as there."""
    check_format(state_dict)
    return {k: split_entry(v)[0] for k, v in state_dict["state"].items() if v is not None}


# ---------------------------------------------------------------------- host quirks
# What the hosts' checkpoint tools do to an optimizer's state, and what this module does
# about it, in one place:
#
# * torch.distributed.checkpoint (FSDP2) loads into a template made from a freshly built
#   optimizer, needs every key it holds to be in the checkpoint and loads no key that is
#   not: so every entry lists every buffer of the configuration at every step, as zero
#   placeholders until made (MergedState), and ``sam_held`` says which are real.  Its
#   ``_init_optim_state`` creates the state with a zero-lr step() on zero gradients
#   (is_state_initialization).
# * ZeroRedundancyOptimizer assigns ``opt.state[p]`` entry by entry when it loads, and
#   clears (None) the entries the other ranks hold in its consolidated state dict
#   (load_state_dict skips them).
# * fairscale's FSDP consolidation keeps one value of each non-tensor entry only if it is
#   hashable: fairseq_vasso saves ``sam_held`` as (name, 0/1) pairs there and drops the
#   per-entry ``sam_counters``; the top-level ``sharpness`` carries the same counters
#   (load_state_dict takes them from there, split_entry takes ``sam_held`` in either form).


def is_state_initialization(opt) -> bool:
    """True for ``step()`` as torch's checkpoint tools call it to create the state of an
    optimizer that has none (``torch.distributed.checkpoint.state_dict._init_optim_state``:
    every gradient zero, every lr 0, no closure)."""
    # (not only at step 0: after steps the coin skipped, SAM over plain SGD holds no state yet)
    if opt.state or not opt.param_groups:
        return False
    for group in opt.param_groups:
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


class MergedState(MutableMapping):
    """``opt.state``: per parameter, the base optimizer's state and this wrapper's, as one
    dict in torch's shape (``exp_avg``, ..., ``sam_slope``, ``sam_counters``).

    torch's checkpoint tools read and write an optimizer's per-parameter state through
    ``opt.state`` (``ZeroRedundancyOptimizer.load_state_dict`` assigns ``opt.state[p]``;
    ``set_optimizer_state_dict`` lists ``opt.state[p]``'s keys), so this view routes each
    key to where it lives: ``sam_*`` to the wrapper, the rest to the base optimizer.  A
    parameter is in the mapping when it holds real state.

    An entry lists the same keys at every step: a parameter that requires a gradient
    lists every buffer this configuration keeps (``opt.knobs.persistent_buffers()``), as a zero
    placeholder until the step that makes it (VASSO's ``d_t`` on the first finite step,
    SAM's ``g`` and the stability's ``previous_ascent`` on the first two-pass step), and
    ``sam_held`` says which are real (the host quirks above).  Loading drops the
    placeholders: a buffer made later starts as the step makes it (VASSO's ``d_0 = g_0``),
    not from zeros.
    """

    __slots__ = ("_opt",)

    def __init__(self, opt):
        self._opt = opt

    def _holds(self, q) -> bool:
        return bool(self._opt.base_optimizer.state.get(q)) or bool(self._opt._own_state.get(q))

    def __getitem__(self, q) -> "ParamState":
        return ParamState(self._opt, q)  # never a KeyError: torch's state is a defaultdict

    def __setitem__(self, q, entry) -> None:
        opt = self._opt
        base, own, counters = split_entry(dict(entry))
        if base:
            opt.base_optimizer.state[q] = base
        else:
            opt.base_optimizer.state.pop(q, None)
        if own:
            opt._own_state[q] = own
        else:
            opt._own_state.pop(q, None)
        if counters is not None:
            set_counters(opt, counters)
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


class ParamState(MutableMapping):
    """One parameter's entry of :class:`MergedState`."""

    __slots__ = ("_opt", "_q")

    def __init__(self, opt, q):
        self._opt, self._q = opt, q

    def own_keys(self) -> List[str]:
        """This wrapper's keys for the parameter: its buffers (``sam_slope``, ...,
        placeholders included), ``sam_held`` and ``sam_counters``; empty when the
        parameter has no entry."""
        return list(self._own()) + ([_HELD, _COUNTERS] if self._keys() else [])

    def _own(self) -> Dict[str, bool]:
        """``sam_<buffer>`` -> whether it is real (False: a zero placeholder, see MergedState)."""
        opt, q = self._opt, self._q
        own = opt._own_state.get(q, {})
        real = {_OWN_PREFIX + k: True for k in own if k in PERSISTENT}
        if getattr(q, "requires_grad", False):
            real.update((_OWN_PREFIX + k, False) for k in opt.knobs.persistent_buffers() if k not in own)
        return real

    def _keys(self) -> List[str]:
        base = list(self._opt.base_optimizer.state.get(self._q, ()))
        own = list(self._own())
        return base + own + ([_HELD, _COUNTERS] if base or own else [])

    def __contains__(self, key) -> bool:
        if key in PERSISTENT:  # the internal name: code meaning the wrapper's buffer must not read False
            raise KeyError(_UNPREFIXED.format(key=key))
        return key in self._keys()

    def __getitem__(self, key):
        opt, q = self._opt, self._q
        if key in PERSISTENT:
            raise KeyError(_UNPREFIXED.format(key=key))
        if key == _COUNTERS and self._keys():
            return counters_of(opt)
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
            set_counters(opt, value)
        elif key == _HELD:  # entries copied key by key: the placeholders copied before it go
            for name, real in value.items():
                if not int(real):
                    opt._own_state.get(q, {}).pop(name, None)
        elif isinstance(key, str) and key.startswith(_OWN_PREFIX):
            name = key[len(_OWN_PREFIX):]
            if name not in PERSISTENT:
                split_entry({key: value})  # the refusal of an unknown key
            opt._own_state[q][name] = value
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


def counters_of(opt) -> Dict[str, Any]:
    """``opt``'s counters as ``sam_counters`` holds them."""
    return counters_dict(opt._step, opt.seed, opt.nonfinite_steps, opt._last)


def set_counters(opt, counters: Dict[str, Any]) -> None:
    opt._step = int(counters["step"])
    opt.seed = int(counters["seed"])
    opt._nonfinite_steps = int(counters["nonfinite_steps"])
    opt._last = last_ascent([counters[k] for k in ("last_rho", "last_slope_norm", "last_ascent_norm")], opt.adaptive)
    opt._lists = None


def last_ascent(values, adaptive: bool) -> Optional[torch.Tensor]:
    """The optimizer's record of its last ascent (``SharpnessAware._last``)
    from the saved ``[rho, ||v||, ||eps||]``: None where ``rho`` is NaN (no ascent yet)."""
    values = [as_float(v) for v in values]
    if math.isnan(values[0]):
        return None
    return torch.tensor(values if adaptive else values[:2], dtype=torch.float64)


# What a copy leaves out, as torch.optim.Optimizer.__getstate__ does (it keeps defaults,
# state and param_groups only): the hooks, an LR scheduler's step() wrapper and its flags
# (a scheduler stays bound to the original); and the step's caches, rebuilt empty.
_NOT_COPIED = frozenset({"state", "_lists", "_scratch", "_exchange", "step", "_opt_called", "_step_count"})


def getstate(opt) -> Dict[str, Any]:
    """What ``copy.deepcopy`` and ``pickle`` keep of ``opt``: an independent optimizer that
    steps as this one does.  Refused in the middle of a step, and with ``partition_group`` (a
    process group cannot be copied): save ``state_dict()`` there instead."""
    name = type(opt).__name__
    if opt._pending is not None:
        raise RuntimeError(f"cannot copy or pickle a {name} in the middle of a step: call descend() or abandon() "
                           "first")
    if opt.partition_group is not None:
        raise TypeError(f"cannot copy or pickle a {name} built with partition_group (a process group cannot be "
                        "copied): save its state_dict() and load it into an optimizer built on the live group")
    opt.diagnostics.wait()
    opt._count_arrived(wait=True)  # no verdict left on its way (CUDA events do not copy)
    return {k: v for k, v in opt.__dict__.items() if k not in _NOT_COPIED and not k.startswith("_optimizer_")}


def upgrade(state: Dict[str, Any]) -> Dict[str, Any]:
    """A pickled optimizer's ``__dict__`` in today's form: the last ascent, once a dict of
    floats, as the tensor ``_last``."""
    for old in ("_previous", "_previous_host"):
        previous = state.pop(old, None)
        if previous and state.get("_last") is None:
            state["_last"] = last_ascent([previous[k] for k in ("rho", "slope_norm", "ascent_norm")],
                                         state["adaptive"])
    state.setdefault("_last", None)
    state.setdefault("_verdicts", ondevice.Verdicts())
    return state


def reset_caches(opt) -> None:
    """The merged state view and the step's caches, rebuilt empty (after a copy or a load)."""
    opt.state = MergedState(opt)
    opt._lists = None
    opt._scratch = defaultdict(dict)
    opt._exchange = {}


def nbytes(store) -> int:
    """The bytes of the tensors in a per-parameter buffer store."""
    return sum(v.numel() * v.element_size() for b in store.values() for v in b.values() if torch.is_tensor(v))
