"""evaluate.py: the unbiased pass@k estimator."""

import itertools
import math

import pytest

from evaluate import pass_at_k


def test_pass_at_k_matches_brute_force_over_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                hit = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n_and_rejects_bad_counts():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert 0.0 < pass_at_k(10_000, 3, 5) < 1.0 and math.isfinite(pass_at_k(10_000, 3, 5))
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
