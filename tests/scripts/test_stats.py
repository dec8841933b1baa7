"""plugins.lab.stats: the exact two-sided permutation test the demo states its verdicts with,
checked against p-values counted by hand on small cases; the distribution-free interval of a
median the device benchmark states its verdicts with, against the binomial tables and by its
coverage."""

import math

import pytest

from plugins.lab.stats import median_interval, permutation_test, smallest_p


def test_three_against_three_separated_gives_the_smallest_p_0_1():
    # 20 splits of 1..6; only {1,2,3} | {4,5,6} and its mirror are as extreme
    assert permutation_test([1, 2, 3], [4, 5, 6]) == 0.1
    assert permutation_test([4, 5, 6], [1, 2, 3]) == 0.1  # two-sided
    assert smallest_p(3, 3) == 0.1


def test_counts_every_split_at_least_as_extreme():
    # observed |mean diff| = 7/3 (sum of the first group 7); the splits with a first-group sum
    # of 6, 7, 14 or 15 are as extreme: {1,2,3}, {1,2,4}, {3,5,6}, {4,5,6} -> 4 of 20
    assert permutation_test([1, 2, 4], [3, 5, 6]) == 0.2
    # {1,3,5} | {2,4,6}: |diff| 1 (sums 9); sums <= 9 or >= 12: 1+1+2+3 of 20 below 10, mirrored -> 14 of 20
    assert permutation_test([1, 3, 5], [2, 4, 6]) == 0.7


def test_no_difference_gives_1():
    assert permutation_test([5, 5, 5], [5, 5, 5]) == 1.0
    assert permutation_test([1, 2], [2, 1]) == 1.0


def test_two_against_two_and_unequal_groups():
    assert permutation_test([0, 1], [2, 3]) == pytest.approx(1 / 3) and smallest_p(2, 2) == pytest.approx(1 / 3)
    # 1 against 3: the lone value 10 is the one extreme split of 4 (|10 - 1| = 9; 0 alone: 4.33)
    assert permutation_test([10], [0, 1, 2]) == 0.25 and smallest_p(1, 3) == 0.25
    # 0 alone is as far from the mean of the others (2) as 3 alone (from 1): 2 of 4
    assert permutation_test([0], [1, 2, 3]) == 0.5


def test_rounding_of_a_split_does_not_drop_its_mirror():
    # 0.1 + 0.2 + 0.3 and 0.4 + 0.5 + 0.6 are not exact in binary: the mirror split still counts
    assert permutation_test([0.1, 0.2, 0.3], [0.4, 0.5, 0.6]) == 0.1
    assert permutation_test([0.1309, 0.1348, 0.1320], [0.0725, 0.0811, 0.0782]) == 0.1


def test_more_seeds_can_reach_significance():
    assert smallest_p(4, 4) == pytest.approx(2 / 70) and smallest_p(4, 4) < 0.05
    assert permutation_test([1, 2, 3, 4, 5], [11, 12, 13, 14, 15]) == pytest.approx(2 / math.comb(10, 5))


def test_empty_groups_are_refused():
    with pytest.raises(ValueError, match="each group needs a value"):
        permutation_test([], [1.0])
    with pytest.raises(ValueError, match="each group needs a value"):
        smallest_p(0, 3)


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (8, (1, 8)), (10, (2, 9)), (12, (3, 10)), (30, (10, 21)),
                                      (100, (40, 61))])
def test_the_median_interval_takes_the_order_statistics_of_the_binomial_tables(n, ranks):
    # the ranks of the tables for 95 %: k the largest with P(Binomial(n, 1/2) <= k - 1) <= 0.025
    lo, hi = ranks
    tail = sum(math.comb(n, j) for j in range(lo)) / 2 ** n
    assert tail <= 0.025 < tail + math.comb(n, lo) / 2 ** n
    shuffled = [float(v) for v in range(n, 0, -1)]  # the draws in any order: sorted first
    assert median_interval(shuffled) == (float(lo), float(hi))


def test_too_few_draws_give_no_interval_and_a_bad_confidence_is_refused():
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # even the range covers 1 - 2/32 < 0.95
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0], confidence=0.9) == (1.0, 5.0)
    assert median_interval([]) is None
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="confidence"):
            median_interval([1.0] * 10, confidence=bad)


def test_the_median_interval_covers_the_median_as_often_as_it_says_and_narrows_with_more_draws():
    import random

    rng = random.Random(0)
    true_median = math.log(2.0)  # of the exponential distribution with rate 1: skewed, heavy right tail
    covered, widths = 0, {}
    for trial in range(2000):
        lo, hi = median_interval([rng.expovariate(1.0) for _ in range(30)])
        covered += lo <= true_median <= hi
    assert 0.94 <= covered / 2000 <= 0.985  # at least 95 % in theory (95.7 % for 30 draws), up to the sampling
    for n in (30, 300):
        intervals = [median_interval([rng.expovariate(1.0) for _ in range(n)]) for _ in range(200)]
        widths[n] = sum(hi - lo for lo, hi in intervals) / len(intervals)
    assert widths[300] < 0.4 * widths[30]  # about 1/sqrt(10) as wide
