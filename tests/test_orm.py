"""critic.py's outcome reward model (training, scoring) and sampling.py's outcomes on the last token."""

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from critic import orm_scores, train_orm
from sampling import Sampler
from reward import GradeResult

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
    assert all(p.grad is None for p in model.parameters())  # a trained ORM holds no gradients
    assert not model.training  # and is left in eval mode for scoring: no dropout on a backbone that has it
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


def test_train_orm_rejects_mismatched_outcomes(tmp_path, one_thread):
    model = _tiny_value_model(tmp_path)
    batch, outcomes = _synthetic_batch(seed=0, batch_size=4)
    with pytest.raises(ValueError, match="outcomes"):
        train_orm(model, [batch], [outcomes[:3]], steps=1, lr=1e-3)
    with pytest.raises(ValueError, match="outcome tensors"):
        train_orm(model, [batch, batch], [outcomes], steps=1, lr=1e-3)
    with pytest.raises(ValueError, match="loss must be"):  # not Bradley-Terry by default for a typo
        train_orm(model, [batch], [outcomes], steps=1, lr=1e-3, loss="MSE")
    with pytest.raises(ValueError, match="outcome tensors"):  # nothing to train on
        train_orm(model, [], [], steps=1, lr=1e-3)
    batch.response_mask[2] = 0  # a response of no token: its "last token" would be the prompt's
    with pytest.raises(ValueError, match=r"batches\[0\] holds an empty response"):
        train_orm(model, [batch], [outcomes], steps=1, lr=1e-3)


def test_orm_steps_report_the_gradient_norm_of_the_mean_loss_and_clip_to_max_grad_norm(tmp_path, one_thread):
    """The loss is the mean over the batch's rows (summed, divided by the global count): its gradient
    norm is what the step reports, and clip_grad_norm_ bounds it to max_grad_norm; at 0 the clipped
    gradient is zero, so AdamW (no weight decay) moves no weight."""
    import copy

    from critic import _last_token_outputs

    model = _tiny_value_model(tmp_path)
    batch, outcomes = _synthetic_batch(seed=0, batch_size=8)
    probe = copy.deepcopy(model)
    ((_last_token_outputs(probe, batch) - outcomes) ** 2).mean().backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in probe.parameters() if p.grad is not None]))
    history = train_orm(model, [batch], [outcomes], steps=1, lr=1e-3)
    assert history[0]["orm/grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    frozen = copy.deepcopy(probe)
    train_orm(frozen, [batch], [outcomes], steps=2, lr=1e-3, max_grad_norm=0.0)
    assert all(torch.equal(a, b) for a, b in zip(frozen.parameters(), probe.parameters()))


def test_the_cached_orm_is_keyed_by_every_setting_its_training_samples_and_steps_depend_on():
    """The ORM is cached once and shared by runs: a run that samples it otherwise (more samples per prompt,
    a higher temperature, longer responses) or trains it otherwise must not take the cached one."""
    import dataclasses

    from critic import orm_settings
    from support.config import parse_config

    cfg = parse_config(["--preset", "tiny"])
    changes = {"orm_batches": 8, "orm_steps": 30, "orm_lr": 1e-4, "orm_loss": "bradley-terry", "prompts_per_step": 16,
               "samples_per_prompt": 4, "max_new_tokens": 200, "temperature": 0.7, "top_p": 0.9,
               "truncation_reward": 0.0, "task_train_size": 1000, "task_difficulty": (40, 44), "max_prompt_tokens": 256,
               "eval_fraction": 0.2, "prompt_template": "{prompt} go", "answer_format": "math"}
    for name, value in changes.items():
        assert getattr(cfg, name) != value, name
        assert orm_settings(dataclasses.replace(cfg, **{name: value})) != orm_settings(cfg), name


def test_a_diverging_orm_stops_with_a_message_before_a_nan_step(tmp_path, one_thread):
    """At lr 1e25 the first step sends the ORM's outputs to NaN: the second step's loss is NaN, and
    training stops there instead of stepping every weight to NaN and going on (to be cached)."""
    model = _tiny_value_model(tmp_path)
    data = [_synthetic_batch(seed, batch_size=8) for seed in range(2)]
    with pytest.raises(FloatingPointError, match="ORM training step 1: gradient norm is nan"):
        train_orm(model, [b for b, _ in data], [y for _, y in data], steps=6, lr=1e25)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the NaN step was not taken


class FixedGrader:
    """Returns the given outcomes whatever the texts."""

    def __init__(self, outcomes):
        self.outcomes = outcomes

    def grade(self, responses, answers):
        assert len(responses) == len(answers) == len(self.outcomes)
        return GradeResult(outcomes=list(self.outcomes), num_timeouts=2, num_missing_box=1)


class FixedRollout:
    """A rollout engine that returns the given batch whatever the prompts."""

    def __init__(self, batch):
        self.batch = batch

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        assert len(prompt_ids) == len(self.batch)
        return self.batch


class DigitTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("truncation_reward", [-0.5, None])
def test_sample_and_score_puts_the_outcome_on_the_last_valid_token_and_scores_cut_responses(truncation_reward):
    """The outcome reward sits on token L_b - 1 and nowhere else; a response cut at max_new_tokens
    (finish "length") scores cfg.truncation_reward when it is set, its grade if not."""
    batch, _ = _synthetic_batch(seed=5, batch_size=4)
    batch.finish_reasons = ["stop", "length", "stop", "length"]
    grades = [1.0, 1.0, -1.0, -1.0]
    cfg = SimpleNamespace(truncation_reward=truncation_reward, max_new_tokens=8, temperature=1.0, top_p=1.0)
    sampler = Sampler(cfg, FixedRollout(batch), DigitTokenizer(), FixedGrader(grades))
    scored = sampler.sample_and_score([{"prompt_ids": [3], "answer": "1"}] * 4, seed=0)
    cut = -0.5 if truncation_reward is not None else None
    expected = [g if f == "stop" or cut is None else cut for g, f in zip(grades, batch.finish_reasons)]
    assert scored.outcomes.tolist() == expected
    assert scored.token_rewards.shape == batch.response_mask.shape
    for b, length in enumerate(batch.lengths.tolist()):
        assert length > 1
        assert scored.token_rewards[b, length - 1].item() == expected[b]
        assert (scored.token_rewards[b, : length - 1] == 0).all() and (scored.token_rewards[b, length:] == 0).all()
    assert (scored.grader_timeouts, scored.missing_box) == (2, 1)
    assert scored.texts[0] == " ".join(map(str, batch.response_ids[0, : batch.lengths[0]].tolist()))


def test_a_users_run_whose_responses_hold_no_box_is_told_once(capsys):
    """The grader reads only a \\boxed{} answer: where 90% of a batch of users' data holds none (verl's
    GSM8K prompts ask for '#### answer'), one note says so, for the sampler and its evaluation copy.
    Responses cut at max_new_tokens hold none for want of room: they are left out of the count."""
    from evaluate import eval_sampler
    from reward import last_boxed
    from support.config import Config

    batch, _ = _synthetic_batch(seed=5, batch_size=8)
    records = [{"prompt_ids": [3], "answer": "1"}] * 8

    class BoxCountingGrader(FixedGrader):  # as the Grader counts: responses without a box, cut ones too
        def grade(self, responses, answers):
            return GradeResult(outcomes=list(self.outcomes), num_timeouts=0,
                               num_missing_box=sum(last_boxed(r) is None for r in responses))

    class TextTokenizer:  # the responses' texts, one per row, in turn
        def __init__(self, texts):
            self.texts = itertools.cycle(texts)

        def decode(self, ids, skip_special_tokens=True):
            return next(self.texts)

    def notes(data, boxed, finish="stop"):
        batch.finish_reasons = [finish] * 8
        texts = ["so \\boxed{2}"] * boxed + ["#### 2"] * (8 - boxed)
        sampler = Sampler(dataclasses.replace(Config(), data=data), FixedRollout(batch), TextTokenizer(texts),
                          BoxCountingGrader([-1.0] * 8))
        for s in (sampler, eval_sampler(sampler), sampler):
            s.sample_and_score(records, seed=0)
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]

    said = notes("train.jsonl", boxed=0)
    assert len(said) == 1 and said[0].startswith("note: 8 of 8 complete responses hold no \\boxed{...}, the only")
    assert notes("train.jsonl", boxed=1) == []  # 7 of 8: below 90%
    assert notes("train.jsonl", boxed=0, finish="length") == []  # every one cut: no room to box, not the prompt
    assert notes(None, boxed=0) == []  # the built-in task: a pi_SFT not yet trained to box, no prompt to change


def test_sample_and_score_samples_with_the_runs_settings_and_the_given_seed():
    """The engine is asked for the run's max_new_tokens, temperature and top_p (each in its own place:
    the defaults are all 1.0, so a swap goes unnoticed elsewhere) and the caller's seed, which makes
    the draw replayable; each prompt's own tokens, in order."""
    batch, _ = _synthetic_batch(seed=5, batch_size=4)
    calls = []

    class RecordingRollout(FixedRollout):
        def generate(self, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
            calls.append((prompt_ids, max_new_tokens, temperature, top_p, seed))
            return super().generate(prompt_ids, max_new_tokens, temperature, top_p, seed)

    cfg = SimpleNamespace(truncation_reward=None, max_new_tokens=8, temperature=0.6, top_p=0.9)
    sampler = Sampler(cfg, RecordingRollout(batch), DigitTokenizer(), FixedGrader([1.0, -1.0, 1.0, -1.0]))
    sampler.sample_and_score([{"prompt_ids": [3 + i, 1], "answer": "1"} for i in range(4)], seed=1234)
    assert calls == [([[3, 1], [4, 1], [5, 1], [6, 1]], 8, 0.6, 0.9, 1234)]


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
    # A cut response under --truncation-reward 0 is a wrong one (orm_quality counts it so): a negative
    # score is right about it. sign(0) matched no score, so it counted as wrong whatever the ORM said.
    signs = torch.sign(orm_scores(model, batch))  # after that step's update
    assert (signs < 0).any() and (signs > 0).any()
    cut = signs.clamp(min=0.0)  # right where positive, cut (0) where negative: every score is right
    assert train_orm(model, [batch], [cut], steps=1, lr=1e-3)[0]["orm/sign_accuracy"] == pytest.approx(1.0)


# --- the Bradley-Terry reward model and the ORM's held-out quality ------------------------------


def test_preference_pairs_are_right_over_wrong_responses_to_one_prompt():
    from critic import preference_pairs

    outcomes = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    winners, losers = preference_pairs(outcomes, group=2)  # prompts: rows 0-1, 2-3, 4-5, 6-7, 8-9, 10
    assert list(zip(winners.tolist(), losers.tolist())) == [(0, 1), (7, 6), (8, 9)]
    winners, losers = preference_pairs(outcomes[:6], group=3)  # rows 0-2 and 3-5
    assert list(zip(winners.tolist(), losers.tolist())) == [(0, 1), (0, 2), (4, 3), (5, 3)]


def test_a_response_cut_with_truncation_reward_zero_is_a_loser_never_a_winner():
    """--truncation-reward 0 gives a cut response the outcome 0: not right, so the Bradley-Terry ORM
    must rank it below a right one and never above a wrong one (a pair needs outcome > 0 >= outcome)."""
    from critic import preference_pairs

    winners, losers = preference_pairs(torch.tensor([1.0, 0.0, -1.0, 0.0]), group=4)
    assert list(zip(winners.tolist(), losers.tolist())) == [(0, 1), (0, 2), (0, 3)]


def test_bradley_terry_ranks_right_above_wrong_and_trains_only_score_differences(tmp_path, one_thread):
    from critic import orm_quality, roc_auc

    model = _tiny_value_model(tmp_path)
    data = [_synthetic_batch(seed, batch_size=8) for seed in range(4)]  # rows 2i (right) and 2i+1 (wrong)
    history = train_orm(model, [b for b, _ in data], [y for _, y in data], steps=40, lr=2e-3, loss="bradley-terry")
    assert history[0]["orm/loss"] == pytest.approx(0.693, abs=0.05)  # -log sigmoid(~0) before training
    last = sum(h["orm/loss"] for h in history[-8:]) / 8
    assert last < 0.3 and sum(h["orm/pair_accuracy"] for h in history[-8:]) / 8 >= 0.9
    held_out, labels = _synthetic_batch(seed=99)
    scores = orm_scores(model, held_out)
    scored = [SimpleNamespace(batch=held_out, outcomes=labels)]
    quality = orm_quality(model, scored)["all"]
    assert quality["auc"] == roc_auc(scores.numpy(), labels.numpy() > 0) and quality["auc"] >= 0.8
    assert quality["responses"] == 16 and quality["correct"] == 8 and quality["base_rate"] == 0.5

    # A constant added to every score leaves the loss and its gradient unchanged: only differences train.
    with torch.no_grad():
        model.score.bias.add_(5.0)
    shifted = train_orm(model, [data[0][0]], [data[0][1]], steps=1, lr=0.0, loss="bradley-terry")
    unshifted = train_orm(model, [data[0][0]], [data[0][1]], steps=1, lr=0.0, loss="mse")
    assert shifted[0]["orm/loss"] < 0.3 and unshifted[0]["orm/loss"] > 10  # MSE sees the +5, BT does not


def test_orm_quality_judges_the_complete_responses_apart_from_all_of_them(tmp_path, one_thread):
    """quality.json's "complete" part holds only the responses that ended with EOS ("stop"), as a reward
    model is trained on; "all" holds the cut ones ("length") too."""
    import dataclasses

    from critic import orm_quality, roc_auc

    model = _tiny_value_model(tmp_path)
    batch, labels = _synthetic_batch(seed=5, batch_size=8)  # labels +1, -1, +1, ...
    finished = ["stop", "stop", "length", "length"] * 2
    batch = dataclasses.replace(batch, finish_reasons=finished)
    quality = orm_quality(model, [SimpleNamespace(batch=batch, outcomes=labels)])
    assert quality["all"]["responses"] == 8 and quality["complete"]["responses"] == 4
    assert quality["complete"]["correct"] == 2  # rows 0, 1, 4, 5: +1, -1, +1, -1
    keep = torch.tensor([f == "stop" for f in finished])
    scores = orm_scores(model, batch)
    assert quality["complete"]["auc"] == roc_auc(scores[keep].numpy(), labels[keep].numpy() > 0)


def test_a_held_out_auc_over_equal_outcomes_is_logged_as_undefined_not_nan(tmp_path, one_thread):
    """Every held-out response right (or every one wrong) leaves no pair to rank: the ORM's log line said
    "held-out AUC nan"; it says why there is no number, as the value pretraining's explained variance does."""
    from critic import auc_text, orm_quality

    model = _tiny_value_model(tmp_path)
    batch, labels = _synthetic_batch(seed=7, batch_size=4)
    quality = orm_quality(model, [SimpleNamespace(batch=batch, outcomes=torch.ones_like(labels))])["all"]
    assert auc_text(quality["auc"]) == "undefined (all outcomes equal)"
    assert auc_text(0.75) == "0.750"


def test_bradley_terry_without_a_right_and_a_wrong_answer_to_one_prompt_is_a_clear_error(tmp_path, one_thread):
    from support.config import ConfigError

    model = _tiny_value_model(tmp_path)
    batch, _ = _synthetic_batch(seed=0, batch_size=4)
    with pytest.raises(ConfigError, match="no pair to rank; raise --orm-batches or --samples-per-prompt"):
        train_orm(model, [batch], [-torch.ones(4)], steps=1, lr=1e-3, loss="bradley-terry")


def test_a_run_with_a_model_of_its_own_keeps_its_orm_apart():
    """The built-in task's ORM is shared by its runs; a run with --model has its own, named after the run
    (orm-<run name>, orm-bt-<run name> for Bradley-Terry): another run's model and data are not its."""
    import dataclasses
    import os

    from critic import orm_path
    from support.config import parse_config

    a, b = (parse_config(["--model", "m", "--run-name", name]) for name in ("a", "b"))
    assert orm_path(a).endswith(os.path.join("_shared", "orm-a")) and orm_path(b).endswith(os.path.join("_shared", "orm-b"))
    assert orm_path(dataclasses.replace(a, orm_loss="bradley-terry")).endswith(os.path.join("_shared", "orm-bt-a"))
