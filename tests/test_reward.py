"""reward.py: verifier verdicts, the grader pool and its timeout, pass@k, the outcome reward model."""

import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import reward
from reward import Grader, last_boxed, orm_scores, pass_at_k, rule_reward, train_orm

CASES_FILE = Path("/work/shared/verifier_cases/math_verify_cases.jsonl")
CASES = [json.loads(line) for line in CASES_FILE.read_text().splitlines()] if CASES_FILE.exists() else []
HANG = "\\boxed{9^{9^{9^{9}}}}"  # real math-verify hang: sympy evaluates the power tower in C


@pytest.mark.skipif(not CASES, reason="shared verifier cases not present")
@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['kind']}" for i, c in enumerate(CASES)])
def test_rule_reward_agrees_with_math_verify_suite(case):
    # The README's framing: the gold is wrapped as `$...$`; rule_reward does that itself.
    assert rule_reward(case["response"], case["gold"]) == (1.0 if case["equal"] else -1.0)


@pytest.mark.parametrize("response, gold", [
    ("so $\\boxed{\\frac{1}{2}}$", "0.5"),
    ("\\boxed{\\dfrac{3}{4}}", "3/4"),
    ("\\boxed{1,234,567}", "1234567"),
    ("\\boxed{ 2 \\sqrt{ 2 } }", "\\sqrt{8}"),
    ("\\boxed{x=3}", "3"),
])
def test_equivalent_forms_score_plus_one(response, gold):
    assert rule_reward(response, gold) == 1.0


def test_last_box_wins_over_earlier_boxes():
    assert rule_reward("first \\boxed{3}, no wait: \\boxed{4}", "4") == 1.0
    assert rule_reward("first \\boxed{4}, no wait: \\boxed{3}", "4") == -1.0


def test_box_in_prompt_only_is_not_scored():
    prompt = "Example: 2+2 = \\boxed{4}. Now compute 2+2."
    response = "The answer is 4."
    assert rule_reward(response, "4") == -1.0  # callers pass the response alone
    assert rule_reward(prompt + response, "4") == 1.0  # the reason they must


def test_missing_unclosed_or_empty_box_scores_minus_one():
    assert rule_reward("the answer is 4", "4") == -1.0
    assert rule_reward("\\boxed{4} then truncated \\boxed{4", "4") == -1.0
    assert rule_reward("\\boxed{}", "4") == -1.0


def test_nested_braces_and_fbox_are_extracted():
    assert last_boxed("x \\boxed{\\frac{1}{\\sqrt{2}}} y") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("\\boxed{a \\\\}") == "a \\\\"  # a line break \\ before the closing brace
    assert last_boxed("\\boxed{\\\\{x}}") == "\\\\{x}"  # \\ then a group, not \\{
    assert last_boxed("\\boxed{1} and \\fbox{2}") == "2"
    assert rule_reward("\\fbox{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}") == 1.0


def test_escaped_braces_inside_a_box_are_literal_not_grouping():
    """`\\{` and `\\}` are set braces: they neither open nor close the box's group."""
    assert last_boxed("\\boxed{\\left\\{ x > 0 \\right.} done") == "\\left\\{ x > 0 \\right."
    assert last_boxed("so \\boxed{\\}}") == "\\}"


def test_boxed_ground_truth_is_unwrapped():
    assert rule_reward("\\boxed{0.25}", "$\\boxed{\\frac14}$") == 1.0


def test_fast_path_decides_without_math_verify(monkeypatch):
    def fail(*_):
        raise AssertionError("math-verify called")

    monkeypatch.setattr(reward, "_math_equal", fail)
    assert rule_reward("\\boxed{ 1 2 3 }", "1 2   3") == 1.0
    assert rule_reward("\\boxed{0042}", "42") == 1.0
    assert rule_reward("\\boxed{-41}", "42") == -1.0


def test_rule_reward_never_raises_on_garbage():
    for response in [None, 12, "\\boxed{\\frac{", "\\boxed{" + "{" * 5000, "\\boxed{\\begin{x}}", "\\boxed{)(}"]:
        assert rule_reward(response, "1") == -1.0
    assert rule_reward("\\boxed{1}", None) == -1.0


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


def test_grader_rejects_mismatched_lengths_and_bad_settings():
    with pytest.raises(ValueError):
        Grader(num_workers=0)
    with Grader(num_workers=1) as grader:
        with pytest.raises(ValueError):
            grader.grade(["\\boxed{1}"], [])


@pytest.mark.slow
@pytest.mark.skipif(not CASES, reason="shared verifier cases not present")
def test_grader_agrees_with_suite_and_reuses_its_workers():
    cases = CASES[::4]  # every kind of answer is checked in-process above; this checks the pool
    responses = [c["response"] for c in cases] + ["no box here"]
    golds = [c["gold"] for c in cases] + ["1"]
    with Grader(num_workers=2, timeout_s=10.0) as grader:
        pids = [w.proc.pid for w in grader.workers]
        first = grader.grade(responses, golds)
        second = grader.grade(responses[:10][::-1], golds[:10][::-1])
        assert [w.proc.pid for w in grader.workers] == pids  # no restart between calls
    assert first.rewards == [1.0 if c["equal"] else -1.0 for c in cases] + [-1.0]
    assert second.rewards == first.rewards[:10][::-1]
    assert first.num_missing_box == 1 and first.num_timeouts == 0


@pytest.mark.slow
def test_hanging_item_is_killed_scored_minus_one_and_worker_replaced():
    timeout_s = 1.0
    with Grader(num_workers=2, timeout_s=timeout_s) as grader:
        grader.grade(["\\boxed{0.5}"] * 4, ["1/2"] * 4)  # workers up
        responses = ["\\boxed{\\frac{1}{3}}", HANG, "\\boxed{0.75}", "\\boxed{2}"] * 3
        golds = ["0.3333333", "5", "3/4", "\\sqrt{4}"] * 3
        t0 = time.monotonic()
        result = grader.grade(responses, golds)
        elapsed = time.monotonic() - t0
        assert result.num_timeouts == 3
        assert result.rewards == [1.0, -1.0, 1.0, 1.0] * 3
        # Each hang costs ~timeout_s plus a replacement's start-up (1-3 s on 2 busy cores); without
        # the kill the power tower would never finish.
        assert elapsed < 3 * timeout_s + 12.0
        again = grader.grade(["\\boxed{\\frac{2}{4}}"], ["0.5"])  # the pool still works
        assert again.rewards == [1.0] and again.num_timeouts == 0


@pytest.mark.slow
def test_grader_workers_do_not_load_torch():
    with Grader(num_workers=1) as grader:
        grader.grade(["\\boxed{0.5}"], ["1/2"])  # the worker has imported reward and graded
        maps = Path(f"/proc/{grader.workers[0].proc.pid}/maps")
        if not maps.exists():
            pytest.skip("needs /proc")
        assert "libtorch" not in maps.read_text()
    out = subprocess.run([sys.executable, "-c", "import reward, sys; print('torch' in sys.modules)"],
                         cwd=os.path.dirname(reward.__file__), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- outcome reward model --------------------------------------------------------------------

MARK = 7  # the label is +1 iff this token occurs in the response


@pytest.fixture
def one_thread():
    """Tiny models run ~10x faster on one thread when the two cores are shared (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_value_model(tmp_path):
    """A random 2-layer Qwen2 (hidden 128, head_dim 64) saved as a causal LM, loaded with a new head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from critic import load_value_model

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "lm")
    return load_value_model(str(tmp_path / "lm"), head_init_std=0.02)


def _synthetic_batch(seed: int, batch_size: int = 16):
    """Left-padded prompts, right-padded responses ending in EOS; label +1 iff MARK occurs."""
    from rollout import RolloutBatch, left_pad

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(8, 32, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(batch_size)]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0)
    lengths = torch.randint(3, 10, (batch_size,), generator=g)
    T = int(lengths.max())
    response = torch.randint(8, 32, (batch_size, T), generator=g)
    has_mark = torch.arange(batch_size) % 2 == 0
    for b in range(batch_size):
        if has_mark[b]:
            response[b, int(torch.randint(0, int(lengths[b]) - 1, (1,), generator=g))] = MARK
        response[b, int(lengths[b]) - 1] = 1  # EOS
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                         response_ids=response.masked_fill(mask == 0, 0), response_mask=mask,
                         logprobs=torch.zeros(batch_size, T), finish_reasons=["stop"] * batch_size)
    return batch, has_mark.float() * 2 - 1


def test_orm_loss_falls_and_save_load_round_trips(tmp_path, one_thread):
    from critic import load_value_model

    torch.manual_seed(0)
    model = _tiny_value_model(tmp_path)
    data = [_synthetic_batch(seed, batch_size=8) for seed in range(4)]
    history = train_orm(model, [b for b, _ in data], [y for _, y in data], steps=40, lr=2e-3)
    first = sum(h["orm/loss"] for h in history[:8]) / 8
    last = sum(h["orm/loss"] for h in history[-8:]) / 8
    assert last < 0.5 * first, (first, last)
    held_out, labels = _synthetic_batch(seed=99)
    scores = orm_scores(model, held_out)
    assert (torch.sign(scores) == labels).float().mean() >= 0.75
    model.save_pretrained(tmp_path / "orm")
    reloaded = load_value_model(str(tmp_path / "orm"))
    torch.testing.assert_close(orm_scores(reloaded, held_out), scores)


def test_orm_score_reads_the_last_response_token_only(tmp_path, one_thread):
    from critic import value_outputs

    model = _tiny_value_model(tmp_path)
    batch, _ = _synthetic_batch(seed=3, batch_size=4)
    scores = orm_scores(model, batch)
    with torch.no_grad():
        outputs = value_outputs(model, **batch.model_inputs())
    P = batch.prompt_ids.shape[1]
    expected = torch.stack([outputs[b, P + int(batch.lengths[b]) - 1] for b in range(len(batch))])
    torch.testing.assert_close(scores, expected)
    # Extra right padding (a wider batch) leaves every score unchanged.
    pad = torch.zeros(len(batch), 3)
    wider = type(batch)(batch.prompt_ids, batch.prompt_mask,
                        torch.cat([batch.response_ids, pad.long()], 1), torch.cat([batch.response_mask, pad], 1),
                        torch.cat([batch.logprobs, pad], 1), batch.finish_reasons)
    torch.testing.assert_close(orm_scores(model, wider), scores, atol=1e-5, rtol=1e-5)


def test_train_orm_rejects_mismatched_labels(tmp_path, one_thread):
    model = _tiny_value_model(tmp_path)
    batch, labels = _synthetic_batch(seed=0, batch_size=4)
    with pytest.raises(ValueError, match="labels"):
        train_orm(model, [batch], [labels[:3]], steps=1, lr=1e-3)
    with pytest.raises(ValueError, match="labels"):
        train_orm(model, [batch, batch], [labels], steps=1, lr=1e-3)


class FixedGrader:
    """Returns the given verdicts whatever the texts."""

    def __init__(self, rewards):
        self.rewards = rewards

    def grade(self, responses, answers):
        assert len(responses) == len(answers) == len(self.rewards)
        return reward.GradeResult(rewards=list(self.rewards), num_timeouts=2, num_missing_box=1)


@pytest.mark.parametrize("truncation_reward", [-0.5, None])
def test_score_rollout_puts_the_score_on_the_last_valid_token_and_scores_cut_responses(truncation_reward):
    """DESIGN.md: the outcome reward sits on token L_b - 1 and nowhere else; a response cut at
    max_new_tokens (finish "length") scores cfg.truncation_reward when it is set, its grade if not."""
    from types import SimpleNamespace

    batch, _ = _synthetic_batch(seed=5, batch_size=4)
    batch.finish_reasons = ["stop", "length", "stop", "length"]
    grades = [1.0, 1.0, -1.0, -1.0]
    scores, token_rewards, counts = reward.score_rollout(
        batch, ["text"] * 4, [{"answer": "1"}] * 4, FixedGrader(grades),
        SimpleNamespace(truncation_reward=truncation_reward))
    cut = -0.5 if truncation_reward is not None else None
    expected = [g if f == "stop" or cut is None else cut for g, f in zip(grades, batch.finish_reasons)]
    assert scores.tolist() == expected
    assert token_rewards.shape == batch.response_mask.shape
    for b, length in enumerate(batch.lengths.tolist()):
        assert length > 1
        assert token_rewards[b, length - 1].item() == expected[b]
        assert (token_rewards[b, : length - 1] == 0).all() and (token_rewards[b, length:] == 0).all()
    assert counts == {"timeouts": 2, "missing_box": 1}


def test_orm_sign_accuracy_is_the_share_of_scores_with_the_label_sign(tmp_path, one_thread):
    """train_orm's orm/sign_accuracy at a step: the share of rows whose score (before that step's
    update) has the sign of the label. Labels agree with the initial scores on 3 rows of 4."""
    model = _tiny_value_model(tmp_path)
    batch, _ = _synthetic_batch(seed=2, batch_size=4)
    signs = torch.sign(orm_scores(model, batch))
    assert (signs != 0).all()
    labels = signs.clone()
    labels[0] = -labels[0]
    history = train_orm(model, [batch], [labels], steps=1, lr=1e-3)
    assert history[0]["orm/sign_accuracy"] == pytest.approx(0.75)
