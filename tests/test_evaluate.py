"""evaluate.py: the unbiased pass@k estimator, and evaluate() over a sampler's graded samples."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from evaluate import evaluate, pass_at_k


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


def test_held_out_sampling_takes_its_own_temperature_and_length_where_set():
    from support import config
    from evaluate import eval_sampler
    from sampling import Sampler

    base = config.parse_config(["--temperature", "0.9", "--max-new-tokens", "50"])
    sampler = Sampler(base, engine=None, tokenizer=None, grader=None)
    assert (eval_sampler(sampler).cfg.temperature, eval_sampler(sampler).cfg.max_new_tokens) == (0.9, 50)
    own = config.parse_config(["--temperature", "0.9", "--max-new-tokens", "50", "--eval-temperature", "0.6",
                               "--eval-max-new-tokens", "80"])
    evaluator = eval_sampler(Sampler(own, engine=None, tokenizer=None, grader=None))
    assert (evaluator.cfg.temperature, evaluator.cfg.max_new_tokens) == (0.6, 80)
    assert own.temperature == 0.9 and own.max_new_tokens == 50  # training's own settings are left as they were


class GradedSampler:
    """A sampler whose verdicts are fixed per prompt: the i-th sample of record r is right when
    verdicts[r][i] > 0 (evaluate() only reads outcomes, lengths and truncation)."""

    def __init__(self, verdicts, samples):
        self.verdicts = verdicts
        self.cfg = SimpleNamespace(eval_samples=samples, prompts_per_step=len(verdicts), samples_per_prompt=samples, seed=0)

    def sample_and_score(self, records, seed):
        seen, outcomes = {}, []
        for record in records:
            r = record["prompt_ids"][0]
            outcomes.append(self.verdicts[r][seen.get(r, 0)])
            seen[r] = seen.get(r, 0) + 1
        lengths = torch.tensor([10 * (1 + r["prompt_ids"][0]) for r in records])
        batch = SimpleNamespace(lengths=lengths, truncated=[False] * len(records))
        return SimpleNamespace(batch=batch, outcomes=torch.tensor(outcomes), texts=[""] * len(records))


def test_evaluate_counts_a_positive_outcome_as_a_correct_sample():
    """Record 0 right in 2 of 2 samples, record 1 in 1 of 2 (its second), record 2 in 2 of 2: pass@1
    = 5/6, pass@2 = 1 (a pattern whose inverse gives other numbers: 1/6 and 1/3)."""
    records = [{"prompt": str(r), "prompt_ids": [r], "answer": str(r)} for r in range(3)]
    result = evaluate(GradedSampler({0: [1.0, 1.0], 1: [-1.0, 1.0], 2: [1.0, 1.0]}, samples=2), records, "test")
    assert result["pass@1"] == pytest.approx(5 / 6) and result["pass@2"] == pytest.approx(1.0)
    assert result["mean_length"] == pytest.approx(20.0)  # 10, 20, 30 tokens, two samples each


def test_accuracy_and_length_are_reported_per_difficulty_over_each_records_own_samples():
    """The built-in task's records carry a difficulty: each gets the accuracy and mean length of its
    own records' samples (n per record), not of the first len(records) samples, and the mean length
    is over every sample of the difficulty, right or wrong."""
    from evaluate import summarize

    records = [{"prompt": "a", "answer": "1", "difficulty": 3}, {"prompt": "b", "answer": "2", "difficulty": 1},
               {"prompt": "c", "answer": "3", "difficulty": 3}]
    # (record, correct, length, truncated, text), two samples per record
    samples = [(0, True, 10, False, ""), (0, False, 20, False, ""), (1, False, 30, True, ""),
               (1, False, 50, True, ""), (2, True, 4, False, ""), (2, True, 6, False, "")]
    result = summarize(records, samples, n=2)
    assert result["by_difficulty"] == {1: {"accuracy": 0.0, "mean_length": 40.0},
                                       3: {"accuracy": 0.75, "mean_length": 10.0}}
    assert list(result["by_difficulty"]) == [1, 3]  # sorted by difficulty


def test_a_ranks_padding_samples_are_not_counted():
    """Under torchrun a rank's share is padded with record 0 so that every rank makes as many generate
    calls; those samples must be dropped, or record 0 is counted twice (here: on rank 1 of 2, whose
    own record is record 1 only)."""
    import evaluate as ev

    records = [{"prompt": str(r), "prompt_ids": [r], "answer": str(r)} for r in range(3)]
    sampler = GradedSampler({0: [1.0, 1.0], 1: [-1.0, 1.0], 2: [1.0, 1.0]}, samples=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ev, "rank", lambda: 1)
        patch.setattr(ev, "world_size", lambda: 2)
        result = ev.evaluate(sampler, records, "test")
    assert result["pass@1"] == pytest.approx(0.5) and result["pass@2"] == pytest.approx(1.0)
    assert result["mean_length"] == pytest.approx(20.0)  # record 1's samples only
    assert [s["prompt"] for s in result["samples"]] == ["1", "1"]


def test_each_chunk_of_held_out_samples_is_drawn_with_its_own_seed():
    """Held-out prompts are sampled in chunks of a training rollout's size; a seed reused across
    chunks would draw every chunk's samples from the same random numbers (correlated samples of
    same-length prompts), so each chunk gets its own (deterministic) seed."""
    records = [{"prompt": str(r), "prompt_ids": [r], "answer": str(r)} for r in range(3)]
    sampler = GradedSampler({0: [1.0, 1.0], 1: [-1.0, 1.0], 2: [1.0, 1.0]}, samples=2)
    sampler.cfg.prompts_per_step = 1  # a rollout of 2 rows: one chunk per record
    seeds = []
    sample_and_score = sampler.sample_and_score
    sampler.sample_and_score = lambda part, seed: seeds.append(seed) or sample_and_score(part, seed)
    first = evaluate(sampler, records, "test")
    assert len(seeds) == 3 and len(set(seeds)) == 3
    again = []
    sampler.sample_and_score = lambda part, seed: again.append(seed) or sample_and_score(part, seed)
    assert evaluate(sampler, records, "test") == first and again == seeds  # replayed exactly
