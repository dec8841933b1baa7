"""The statistics the tools state their verdicts with.

:func:`median_interval`: a distribution-free confidence interval for a median (the device
benchmark's verdicts on per-round ratios of step times, ``vasso_bench.device``).

:func:`permutation_test`, the one test of differences over seeds: an exact two-sided
permutation test of a difference of means (the demo's BLEU and stability between methods).

With a few seeds per method no distribution can be assumed, so every way of splitting the
pooled values into groups of the two sizes is enumerated (``comb(n + m, n)`` splits: 20 for
3 seeds against 3). The p-value is the fraction of splits whose difference of means is at
least as large in absolute value as the observed one. It can never be below
:func:`smallest_p`: 0.1 for 3 against 3, so no difference between two methods of 3 seeds
each can be significant at the 0.05 level, however large; p = 0.1 there means only that
the seeds separate completely (every value of one method above every value of the other).
"""

from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence, Tuple

# splits whose |difference| is this close to the observed one count as "at least as large":
# the same split's difference computed in another summation order must not fall out by rounding
_RELATIVE_TIE = 1e-9


def permutation_test(a: Sequence[float], b: Sequence[float]) -> float:
    """The exact two-sided p-value of ``mean(b) - mean(a)`` under the permutation null
    (the values are exchangeable between the groups): the fraction of the
    ``comb(len(a) + len(b), len(a))`` splits of the pooled values with
    ``|mean(second) - mean(first)| >= |mean(b) - mean(a)|``. ValueError for an empty group."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if not a or not b:
        raise ValueError(f"each group needs a value, got {len(a)} and {len(b)}")
    pooled = a + b
    n, total = len(a), sum(pooled)

    def gap(first_sum):
        return abs((total - first_sum) / len(b) - first_sum / n)

    observed = gap(sum(a))
    tie = _RELATIVE_TIE * max(1.0, observed, max(abs(v) for v in pooled))
    splits = list(itertools.combinations(range(len(pooled)), n))
    extreme = sum(gap(sum(pooled[i] for i in first)) >= observed - tie for first in splits)
    return extreme / len(splits)


def smallest_p(n: int, m: int) -> float:
    """The smallest p-value :func:`permutation_test` can give for groups of ``n`` and ``m``
    values: one split (and, for equal sizes, its mirror image) out of ``comb(n + m, n)``."""
    if n < 1 or m < 1:
        raise ValueError(f"each group needs a value, got {n} and {m}")
    return (2 if n == m else 1) / math.comb(n + m, n)


def median_interval(xs: Sequence[float], confidence: float = 0.95) -> Optional[Tuple[float, float]]:
    """A confidence interval for the median of the distribution the independent draws ``xs``
    come from, assuming nothing of its shape: the order statistics ``x_(k)`` and
    ``x_(n+1-k)`` (1-based, sorted), ``k`` the largest with ``P(Binomial(n, 1/2) < k) <=
    (1 - confidence) / 2``, so that the interval covers the median with probability at least
    ``confidence``.  Narrower as ``n`` grows (30 draws at 0.95: the 10th and 21st; 8 draws:
    their whole range), unlike the interquartile range, which describes the draws' spread
    and does not shrink.  None where even the whole range covers less than ``confidence``
    (fewer than 6 draws at 0.95).  ValueError for a confidence outside (0, 1)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    xs = sorted(float(x) for x in xs)
    n = len(xs)
    tail, k = 0.0, 0
    while k < n:
        p = math.comb(n, k) / 2.0 ** n  # P(B = k): B < k + 1 then has probability tail + p
        if tail + p > (1.0 - confidence) / 2.0:
            break
        tail += p
        k += 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]
