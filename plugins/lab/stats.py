"""The one test the tools state their verdicts over seeds with: an exact two-sided
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
from typing import Sequence

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
