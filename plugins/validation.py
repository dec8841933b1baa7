"""One argument validator for the core and every host that exposes its knobs.

Each knob of the family has one entry in :data:`KNOBS` (its kind and allowed
range); the core checks its constructor arguments here, and the hosts check their
own flags here too, under their own names: ``--rho`` in fairseq, the ``rho``
hparam in DomainBed.  Adding a knob means one entry here, its use in the core, and
one row in each host's flag table.

    >>> from plugins.validation import check
    >>> check("rho", 0.1)
    0.1
    >>> check("rho", -1, name="--rho")
    Traceback (most recent call last):
        ...
    ValueError: --rho must be in [0, inf), got -1
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

__all__ = ["Range", "Knob", "KNOBS", "check", "describe", "Params", "Closure", "Loss", "Number"]

# Type aliases shared by the core and the hosts.
Number = Union[int, float]
Params = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]], Iterable[Tuple[str, torch.Tensor]]]
Loss = Optional[Union[torch.Tensor, float]]
Closure = Optional[Callable[[], Loss]]


@dataclass(frozen=True)
class Range:
    """An interval of the reals; ``bounds`` is ``"[]"``, ``"[)"``, ``"(]"`` or ``"()"``."""

    low: float
    high: float
    bounds: str = "[]"

    def __contains__(self, value: float) -> bool:
        if math.isnan(value):
            return False
        above = value > self.low if self.bounds[0] == "(" else value >= self.low
        below = value < self.high if self.bounds[1] == ")" else value <= self.high
        return above and below

    def __str__(self) -> str:
        return f"{self.bounds[0]}{self.low:g}, {self.high:g}{self.bounds[1]}"


@dataclass(frozen=True)
class Knob:
    """A knob's kind (``"real"``, ``"bool"``, ``"int"`` or ``"group"``, a process group)
    and, for reals, its range.
    ``optional`` knobs accept None (their documented "off" value)."""

    kind: str
    range: Optional[Range] = None
    optional: bool = False


_NON_NEGATIVE = Range(0.0, math.inf, "[)")

#: Every knob of the family, by the core's argument name.
KNOBS: Dict[str, Knob] = {
    "rho": Knob("real", _NON_NEGATIVE),
    "theta": Knob("real", Range(0.0, 1.0, "(]")),
    "adaptive": Knob("bool"),
    "eta": Knob("real", _NON_NEGATIVE),
    "gsam_alpha": Knob("real", _NON_NEGATIVE),
    "p": Knob("real", Range(0.0, 1.0, "[]")),
    "seed": Knob("int"),
    "rho_min": Knob("real", _NON_NEGATIVE, optional=True),
    "lr_max": Knob("real", Range(0.0, math.inf, "()"), optional=True),
    "lr_min": Knob("real", _NON_NEGATIVE),
    "track_stability": Knob("bool"),
    "exact_restore": Knob("bool"),
    "partition_group": Knob("group", optional=True),
    "model_gathers": Knob("bool"),  # PartitionGroup's: shards the model gathers itself (FSDP1's flat shards)
    # the base optimizer's, checked by the hosts that build it
    "lr": Knob("real", _NON_NEGATIVE),
    "weight_decay": Knob("real", _NON_NEGATIVE),
    "adam_eps": Knob("real", _NON_NEGATIVE),
}


def describe(knob: str, *, within: Optional[Range] = None, words: Tuple[str, str] = ("True", "False")) -> str:
    """What a knob accepts, as the error messages say it: ``in [0, inf)``."""
    spec = KNOBS[knob]
    if spec.kind == "bool":
        return f"{words[0]} or {words[1]}"
    if spec.kind == "int":
        return "an integer"
    if spec.kind == "group":
        return "a torch.distributed ProcessGroup this rank belongs to (or a plugins.PartitionGroup), or None"
    return f"in {within or spec.range}"


def check(knob: str, value: Any, *, name: Optional[str] = None, within: Optional[Range] = None,
          words: Tuple[str, str] = ("True", "False"), parse: bool = False) -> Any:
    """``value`` as the knob's Python type (float, bool or int) if it is allowed,
    else ValueError naming it ``name`` (default: the knob) and its range.

    ``within`` narrows the range for a host; ``words`` spells the booleans in the
    host's vocabulary (``("true", "false")`` for JSON); ``parse`` accepts strings
    that spell a number (command-line flags).
    """
    spec = KNOBS[knob]
    name = name or knob
    if value is None and spec.optional:
        return None
    if spec.kind == "bool":
        if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
            return bool(value)
        raise ValueError(f"{name} must be {words[0]} or {words[1]}, got {value!r} ({type(value).__name__})")
    if spec.kind == "group":
        return _process_group(value, name)
    if spec.kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(value)
    interval = within or spec.range
    if parse and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a real number in {interval}, got {value!r}") from None
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number in {interval}, got {value!r} ({type(value).__name__})")
    else:
        number = float(value)
    if number not in interval:
        shown = number if isinstance(value, str) else value
        raise ValueError(f"{name} must be in {interval}, got {shown!r}")
    return number


def _process_group(value: Any, name: str) -> Any:
    """The process group ``value`` names (a ``ProcessGroup``, or the live group of a
    :class:`plugins.distributed.PartitionGroup`) if ``torch.distributed`` is initialized
    and this rank belongs to it, else ValueError saying what to pass."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name} names a torch.distributed process group, but torch.distributed is not "
                         f"initialized (call torch.distributed.init_process_group first), got {value!r}")
    handle = type(value).__name__ == "PartitionGroup" and hasattr(value, "ranks")
    if handle:  # plugins.distributed.PartitionGroup: the live group inside
        if value.group is None:
            raise ValueError(f"{name}: {value!r} was loaded from a checkpoint and holds no process group: pass "
                             "the live group (PartitionGroup(group)) when building the optimizer")
        value = value.group
    if not isinstance(value, dist.ProcessGroup):
        raise ValueError(f"{name} must be a torch.distributed ProcessGroup (dist.group.WORLD, dist.new_group(...), "
                         f"the group given to ZeroRedundancyOptimizer / OSS), a plugins.PartitionGroup or None, "
                         f"got {value!r} ({type(value).__name__})")
    if dist.get_rank(value) < 0:
        raise ValueError(f"{name}: this rank ({dist.get_rank()}) is not a member of the process group given")
    return value


def group_rho(groups, default: float) -> float:
    """The one rho every param group holds (``group["rho"]``: one global ascent norm), checked."""
    rho = groups[0].get("rho") if groups else default
    for group in groups:
        if group.get("rho", rho) != rho:
            values = ", ".join(f"group {i}: {g.get('rho')!r}" for i, g in enumerate(groups))
            raise ValueError("rho must be the same in every param group (one global ascent norm), got " + values)
    return check("rho", rho, name="param_groups' rho")
