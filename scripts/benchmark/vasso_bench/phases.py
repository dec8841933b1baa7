"""The phases of one step of the family, marked from outside the core: the closure's calls
(the first and the second forward/backward pass) and the base optimizer's ``step`` are the
boundaries, the rest of ``opt.step(closure)`` falls between them.  The core is not touched
(no ranges in it): :class:`StepPhases` wraps the closure and ``base_optimizer.step`` of one
optimizer instance, opens ``torch.profiler.record_function`` ranges there when asked, and
calls ``on_mark`` at every boundary (a clock, a sync counter).

    step start   before the first pass: the RNG state, dropping stale gradients
    first pass   forward + backward at x_t (g_t)
    perturb      after it, before the second pass: the EMA, the norm, x_t + eps_t
    second pass  forward + backward at x_t + eps_t (h_t)
    descend      after the second pass, outside the base step: the restore, the checks
    base step    the base optimizer's step (AdamW)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

PHASES = ("step start", "first pass", "perturb", "second pass", "descend", "base step")
#: the phases that are the optimizer's own code (neither the passes nor the base step)
OWN = ("step start", "perturb", "descend")
#: the phase that runs after each boundary mark
AFTER = {"step>": "step start", "pass1>": "first pass", "<pass1": "perturb", "pass2>": "second pass",
         "<pass2": "descend", "base>": "base step", "<base": "descend"}
#: record_function names (the trace's user annotations)
RANGES = {"step": "bench::step", "pass": "bench::pass", "base": "bench::base step"}


def segments(marks: Sequence[Tuple[str, Any]]) -> List[Tuple[str, Any, Any]]:
    """[(phase, value at its start, value at its end)] from the boundary marks of one step,
    in order; ``"<step"`` ends the last one."""
    out = []
    for (name, a), (_, b) in zip(marks, marks[1:]):
        if name in AFTER:
            out.append((AFTER[name], a, b))
    return out


def per_phase(marks: Sequence[Tuple[str, float]]) -> Dict[str, float]:
    """The sum of (end - start) per phase over one step's marks (a clock's seconds, a
    counter's increments)."""
    out = {p: 0.0 for p in PHASES}
    for phase, a, b in segments(marks):
        out[phase] += b - a
    return out


class StepPhases:
    """``step()`` runs ``opt.step(closure)`` with its boundaries marked: ``marks`` holds
    ``(name, on_mark())`` for ``step>``, ``pass1>``, ``<pass1``, ``pass2>``, ``<pass2``,
    ``base>``, ``<base``, ``<step``.  ``ranges=True`` also opens record_function ranges
    (:data:`RANGES`) for the profiler."""

    def __init__(self, opt, closure: Callable, on_mark: Callable[[], Any] = lambda: None, ranges: bool = False):
        self.opt, self.user_closure, self.on_mark, self.ranges = opt, closure, on_mark, ranges
        self.marks: List[Tuple[str, Any]] = []
        self._passes = 0
        base = opt.base_optimizer
        inner = base.step

        def base_step(*a, **k):
            return self._marked("base>", "<base", RANGES["base"], inner, *a, **k)

        base.step = base_step

    def _marked(self, enter: str, leave: str, range_name: str, fn: Callable, *a, **k):
        self.marks.append((enter, self.on_mark()))
        try:
            if self.ranges:
                with torch.profiler.record_function(range_name):
                    return fn(*a, **k)
            return fn(*a, **k)
        finally:
            self.marks.append((leave, self.on_mark()))

    def _closure(self):
        self._passes += 1
        n = min(self._passes, 2)
        return self._marked(f"pass{n}>", f"<pass{n}", RANGES["pass"], self.user_closure)

    def step(self):
        self.marks, self._passes = [], 0
        return self._marked("step>", "<step", RANGES["step"], self.opt.step, self._closure)


def median_per_phase(samples: Sequence[Dict[str, float]]) -> Dict[str, float]:
    from plugins.lab.bench.timing import median

    return {p: median([s[p] for s in samples]) for p in PHASES}


def run_marked(phases: StepPhases, n: int, clock: Callable[[], float]) -> Tuple[List[Dict[str, float]], List[float]]:
    """n steps: per step, the clock's time per phase, and the whole step's."""
    phases.on_mark = clock
    per, total = [], []
    for _ in range(n):
        phases.step()
        per.append(per_phase(phases.marks))
        total.append(phases.marks[-1][1] - phases.marks[0][1])
    return per, total


def own_time(per: Dict[str, float]) -> float:
    return sum(per[p] for p in OWN)

