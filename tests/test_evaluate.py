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


def test_scores_are_reported_per_data_source_as_val_metrics():
    """Two held-out sets (MATH-500 and AIME, say) get their own pass@1, pass@2, length and
    truncated share; the built-in task's one set is val/held_out."""
    from evaluate import summarize, val_metrics

    records = [{"prompt": "a", "answer": "1", "data_source": "math500"},
               {"prompt": "b", "answer": "2", "data_source": "aime"},
               {"prompt": "c", "answer": "3", "data_source": "math500"}]
    # (record, correct, length, truncated, text), two samples per record
    samples = [(0, True, 10, False, ""), (0, False, 20, False, ""), (1, False, 30, True, ""),
               (1, False, 50, True, ""), (2, True, 4, False, ""), (2, True, 6, False, "")]
    metrics = val_metrics(summarize(records, samples, n=2))
    assert metrics == {"val/aime/pass@1": 0.0, "val/aime/mean_length": 40.0, "val/aime/truncated": 1.0,
                       "val/aime/pass@2": 0.0, "val/math500/pass@1": 0.75, "val/math500/mean_length": 10.0,
                       "val/math500/truncated": 0.0, "val/math500/pass@2": 1.0}
    builtin = [{k: v for k, v in r.items() if k != "data_source"} for r in records]
    assert val_metrics(summarize(builtin, samples, n=2)) == {
        "val/held_out/pass@1": 0.5, "val/held_out/mean_length": 20.0, "val/held_out/truncated": 1 / 3,
        "val/held_out/pass@2": 2 / 3}
