"""plugins.lab.stats: the exact two-sided permutation test the demo states its verdicts with,
checked against p-values counted by hand on small cases."""

import math

import pytest

from plugins.lab.stats import permutation_test, smallest_p


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
