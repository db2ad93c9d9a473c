"""How train.py and value_pretrain.py wire the concept files together (Algorithm 1), checked in
milliseconds: scripted rollouts, a scripted grader and a critic whose values are set by hand, with
`update_model` replaced by a recorder of what each optimizer step would be given.

Each expected tensor is derived here from its definition (README "Tensor layout", docstrings):
rewards on the last valid token, GAE from the plain reference loop `gae_reference` with the two
lambdas of decoupled GAE, Monte-Carlo targets of value pretraining, GRPO's group normalisation,
log-probs from the model's full forward, the clipped value loss of Eq. (2).
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support import step_metrics
from support import task
import train
import value_pretrain
from support.config import Config
from gae import gae_reference, length_adaptive_lambda
from ppo import response_logprobs
from rollout import RolloutBatch, left_pad
from sampling import Sampler
from support.data import sample_prompts, stream_seed
from reward import GradeResult

# Responses of the scripted rollout (characters of the task's alphabet) and how each one ended.
# Rows 2k and 2k+1 share a prompt (samples_per_prompt = 2); MAX_NEW_TOKENS-long rows were cut.
MAX_NEW_TOKENS = 12
RESPONSES = ["12=\n", "7*2^a=", "\\boxed{3}", "abcdefghijkl", "4:9?x", "ABCDEFGHIJKL"]
FINISH = ["stop", "stop", "stop", "length", "stop", "length"]
GRADES = [1.0, -1.0, 1.0, 1.0, -1.0, -1.0]  # the grader's verdicts; a cut response gets TRUNCATION
TRUNCATION = -0.5


class ScriptedRollout:
    """A rollout engine whose "samples" are fixed: row b gets RESPONSES[b], ended as FINISH[b]."""

    def __init__(self, tokenizer, responses=RESPONSES, finish=FINISH):
        self.pad_id = tokenizer.pad_token_id
        self.responses = [tokenizer(r)["input_ids"] for r in responses]
        self.finish = list(finish)
        self.batch = None

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        assert len(prompt_ids) == len(self.responses)
        self.prompts, self.seed = [list(p) for p in prompt_ids], seed
        ids, prompt_mask = left_pad(prompt_ids, self.pad_id)
        width = max(map(len, self.responses))
        response = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), width)
        for b, r in enumerate(self.responses):
            response[b, : len(r)] = torch.tensor(r)
            mask[b, : len(r)] = 1.0
        self.batch = RolloutBatch(ids, prompt_mask, response, mask, torch.zeros(len(ids), width), self.finish)
        return self.batch

    def sleep(self):
        pass


class ScriptedGrader:
    """Returns the given verdicts, whatever the texts."""

    def __init__(self, outcomes=GRADES):
        self.outcomes = list(outcomes)

    def grade(self, responses, answers):
        assert len(responses) == len(answers) == len(self.outcomes)
        return GradeResult(outcomes=list(self.outcomes), num_timeouts=0, num_missing_box=0)


class TokenValueCritic(torch.nn.Module):
    """A value model whose output at a position is a hand-set number of the token there:
    V(s_t) = table[token at sequence position P + t - 1] (the critic's reading position)."""

    def __init__(self, vocab_size, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab_size, generator=gen))

    def forward(self, input_ids, attention_mask, position_ids, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids].unsqueeze(-1))


def make_config(**overrides):
    cfg = dataclasses.replace(Config(), prompts_per_step=3, samples_per_prompt=2, max_new_tokens=MAX_NEW_TOKENS,
                              micro_batch_size=4, num_minibatches=2, truncation_reward=TRUNCATION, **overrides)
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def tokenizer():
    return task.build_tokenizer()


@pytest.fixture(scope="module")
def actor(tokenizer):
    return task.make_tiny_model(tokenizer, num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1,
                                intermediate_size=128, seed=0)


@pytest.fixture(scope="module")
def records(tokenizer):
    prompts = ["12*2^a=\n", "3*2^b=\n", "407*2^c=\n", "5*2^d=\n"]  # different lengths: left padding
    return [{"prompt_ids": tokenizer(p)["input_ids"], "answer": str(i)} for i, p in enumerate(prompts)]


def expected_scores(grades=GRADES, finish=FINISH, truncation=TRUNCATION):
    return torch.tensor([truncation if f == "length" else g for g, f in zip(grades, finish)])


def last_token_rewards(scores, mask):
    """The outcome reward on the last valid token t = L_b - 1, 0 elsewhere."""
    rewards = torch.zeros_like(mask)
    for b, length in enumerate(mask.sum(1).long().tolist()):
        rewards[b, length - 1] = scores[b]
    return rewards


def critic_values(critic, batch):
    """V(s_t) read token by token from the hand-set table: the input at position P + t - 1."""
    inputs = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    P = batch.prompt_ids.shape[1]
    values = torch.zeros_like(batch.response_mask)
    for b, length in enumerate(batch.lengths.tolist()):
        for t in range(length):
            values[b, t] = critic.table[inputs[b, P + t - 1]]
    return values


def full_forward_logprobs(actor, batch, temperature):
    """log pi(y_t | s_t) from the logits of the whole sequence, at the positions before each token."""
    with torch.no_grad():
        logits = batch.response_slice(actor(**batch.model_inputs()).logits)
    return response_logprobs(logits, batch.response_ids, temperature) * batch.response_mask, logits


def whiten(x, mask):
    """(x - mean) / std over the valid tokens (Bessel-corrected), 0 on padding."""
    valid = x[mask.bool()]
    return torch.where(mask.bool(), (x - valid.mean()) / valid.std(), torch.zeros_like(x))


def record_update_model(calls, metrics=None):
    """A stand-in for ppo_update.update_model that keeps what each model's update would be given."""

    def update_model(cfg, model, optimizer, batch, per_token, loss_fn, seed, prefix):
        calls[prefix] = SimpleNamespace(model=model, batch=batch, loss_fn=loss_fn, seed=seed,
                                        per_token={k: v.clone() for k, v in per_token.items()})
        return dict(metrics or {})

    return update_model


def run_ppo_step(cfg, actor, critic, tokenizer, records, monkeypatch, reference=None, engine=None):
    calls = {}
    monkeypatch.setattr(train, "update_model", record_update_model(calls))
    engine = engine or ScriptedRollout(tokenizer)
    models = {"actor": actor} | ({"critic": critic} if critic is not None else {})
    sampler = Sampler(cfg, engine, tokenizer, ScriptedGrader())
    metrics = train.ppo_step(cfg, 0, sampler, records, models, {name: None for name in models}, reference)
    return engine.batch, calls, metrics


def test_ppo_step_feeds_decoupled_gae_advantages_to_the_actor_and_lambda_critic_returns_to_the_critic(
        tokenizer, actor, records, monkeypatch):
    """Algorithm 1 / §3.3: the outcome score (or the truncation reward) on each response's last
    token; V(s_t) from the critic; advantages = GAE(lam_actor), whitened over the valid tokens;
    critic targets = GAE(lam_critic) + V, not whitened; old log-probs = the policy's log-probs at
    the rollout temperature; per-position advantage metrics from the raw advantages."""
    cfg = make_config(lam_actor=0.5, lam_critic=1.0, gamma=0.99, temperature=0.7)
    critic = TokenValueCritic(len(tokenizer), seed=1)
    batch, calls, metrics = run_ppo_step(cfg, actor, critic, tokenizer, records, monkeypatch)
    mask = batch.response_mask
    assert set(calls) == {"actor", "critic"} and calls["actor"].per_token.keys() == calls["critic"].per_token.keys()
    per_token = calls["actor"].per_token

    values = critic_values(critic, batch)
    rewards = last_token_rewards(expected_scores(), mask)
    advantages, _ = gae_reference(rewards, values, mask, cfg.gamma, cfg.lam_actor)
    _, returns = gae_reference(rewards, values, mask, cfg.gamma, cfg.lam_critic)
    # lam_actor and lam_critic give visibly different targets here, so a swap cannot pass.
    assert (gae_reference(rewards, values, mask, cfg.gamma, cfg.lam_actor)[1] - returns).abs().max() > 0.1

    torch.testing.assert_close(per_token["old_values"], values)
    torch.testing.assert_close(per_token["returns"], returns, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_token["advantages"], whiten(advantages, mask), atol=1e-5, rtol=1e-5)
    old_logprobs, _ = full_forward_logprobs(actor, batch, cfg.temperature)
    torch.testing.assert_close(per_token["old_logprobs"], old_logprobs, atol=1e-5, rtol=1e-5)

    # advantage/pos_bin{k}: mean advantage over the tokens at the k-th quarter of positions 0..max_new_tokens-1.
    lengths = batch.lengths.tolist()
    for k in range(step_metrics.POSITION_BINS):
        in_bin = [advantages[b, t] for b, n in enumerate(lengths) for t in range(n)
                  if t * step_metrics.POSITION_BINS // MAX_NEW_TOKENS == k]
        assert metrics[f"advantage/pos_bin{k}"] == pytest.approx(sum(in_bin).item() / len(in_bin), abs=1e-5)
    assert metrics["advantage/pos_bin_tokens"] == MAX_NEW_TOKENS / step_metrics.POSITION_BINS  # what the bins are
    valid = [advantages[b, t] for b, n in enumerate(lengths) for t in range(n)]
    assert metrics["advantage/mean"] == pytest.approx(sum(valid).item() / len(valid), abs=1e-5)  # unwhitened
    assert metrics["reward/mean"] == pytest.approx(expected_scores().mean().item())


def test_ppo_step_without_whitening_passes_the_raw_gae_advantages(tokenizer, actor, records, monkeypatch):
    """--no-whiten-advantages: the actor gets GAE(lam_actor) itself."""
    cfg = make_config(lam_actor=0.8, lam_critic=1.0, whiten_advantages=False)
    critic = TokenValueCritic(len(tokenizer), seed=2)
    batch, calls, _ = run_ppo_step(cfg, actor, critic, tokenizer, records, monkeypatch)
    mask = batch.response_mask
    advantages, _ = gae_reference(last_token_rewards(expected_scores(), mask), critic_values(critic, batch),
                                  mask, cfg.gamma, cfg.lam_actor)
    torch.testing.assert_close(calls["actor"].per_token["advantages"], advantages, atol=1e-5, rtol=1e-5)


def test_ppo_step_takes_the_kl_terms_ref_logprobs_from_the_reference_policy(tokenizer, actor, records, monkeypatch):
    """--kl-coef > 0: per_token["ref_logprobs"] = log pi_ref(y_t | s_t) of the frozen reference model
    (its own full forward, at the rollout temperature), not of the actor being trained; the actor's
    old log-probs stay the actor's."""
    cfg = make_config(kl_coef=0.1, temperature=0.7)
    reference = task.make_tiny_model(tokenizer, num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1,
                                     intermediate_size=128, seed=5)
    critic = TokenValueCritic(len(tokenizer), seed=1)
    batch, calls, _ = run_ppo_step(cfg, actor, critic, tokenizer, records, monkeypatch, reference=reference)
    per_token = calls["actor"].per_token
    expected_ref, _ = full_forward_logprobs(reference, batch, cfg.temperature)
    expected_old, _ = full_forward_logprobs(actor, batch, cfg.temperature)
    assert (expected_ref - expected_old).abs().max() > 0.1  # the two models disagree: a mix-up cannot pass
    torch.testing.assert_close(per_token["ref_logprobs"], expected_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(per_token["old_logprobs"], expected_old, atol=1e-5, rtol=1e-5)


def test_ppo_step_with_length_adaptive_alpha_gives_each_response_the_lambda_of_its_length(
        tokenizer, actor, records, monkeypatch):
    """--length-adaptive-alpha (VAPO): the actor's advantages are GAE with lambda = 1 - 1/(alpha L_b)
    per response (gae.length_adaptive_lambda), not --lam-actor; the critic's targets keep lam_critic."""
    alpha = 0.5  # lambdas 0.5 (4 tokens) to ~0.83 (12 tokens), far from lam_actor
    cfg = make_config(lam_actor=0.95, lam_critic=1.0, length_adaptive_alpha=alpha, whiten_advantages=False)
    critic = TokenValueCritic(len(tokenizer), seed=2)
    batch, calls, _ = run_ppo_step(cfg, actor, critic, tokenizer, records, monkeypatch)
    mask = batch.response_mask
    rewards, values = last_token_rewards(expected_scores(), mask), critic_values(critic, batch)
    lam = length_adaptive_lambda(batch.lengths, alpha)
    assert len(set(lam.tolist())) > 1  # responses of several lengths: one lambda for all cannot pass
    expected, _ = gae_reference(rewards, values, mask, cfg.gamma, lam=lam)
    plain, _ = gae_reference(rewards, values, mask, cfg.gamma, cfg.lam_actor)
    assert (expected - plain).abs().max() > 0.05
    per_token = calls["actor"].per_token
    torch.testing.assert_close(per_token["advantages"], expected, atol=1e-5, rtol=1e-5)
    _, returns = gae_reference(rewards, values, mask, cfg.gamma, cfg.lam_critic)
    torch.testing.assert_close(per_token["returns"], returns, atol=1e-5, rtol=1e-5)


def test_ppo_step_logs_the_truncated_share_the_prompt_length_and_the_mean_return_of_its_batch(
        tokenizer, actor, records, monkeypatch):
    """response_length/clip_ratio = the share of responses cut at max_new_tokens (FINISH: 2 of 6);
    prompt_length/mean = the mean number of prompt tokens the engine was given (not the padded
    width); critic/returns/mean = the token-mean of the critic's targets GAE(lam_critic) + V;
    response_length/mean and /max from the scripted responses."""
    cfg = make_config(lam_actor=0.5, lam_critic=0.9, gamma=0.99)
    critic = TokenValueCritic(len(tokenizer), seed=6)
    engine = ScriptedRollout(tokenizer)
    batch, _, metrics = run_ppo_step(cfg, actor, critic, tokenizer, records, monkeypatch, engine=engine)
    mask = batch.response_mask
    assert metrics["response_length/clip_ratio"] == pytest.approx(FINISH.count("length") / len(FINISH))
    prompt_lengths = [len(p) for p in engine.prompts]
    assert len(set(prompt_lengths)) > 1  # ragged prompts: the padded width differs from the mean
    assert metrics["prompt_length/mean"] == pytest.approx(sum(prompt_lengths) / len(prompt_lengths))
    response_lengths = [len(r) for r in engine.responses]
    assert metrics["response_length/mean"] == pytest.approx(sum(response_lengths) / len(response_lengths))
    assert metrics["response_length/max"] == max(response_lengths)
    values = critic_values(critic, batch)
    _, returns = gae_reference(last_token_rewards(expected_scores(), mask), values, mask, cfg.gamma, cfg.lam_critic)
    valid = mask.bool()
    assert abs(returns[valid].mean() - values[valid].mean()) > 0.05  # the values' mean cannot pass for it
    assert metrics["critic/returns/mean"] == pytest.approx(returns[valid].mean().item(), abs=1e-5)
    assert metrics["critic/values_mean"] == pytest.approx(values[valid].mean().item(), abs=1e-5)


def test_the_truncated_share_counts_the_responses_cut_not_the_longest(tokenizer, actor, records, monkeypatch):
    """A response is cut when it ends at max_new_tokens without its EOS, whatever its length: the first,
    short one here; the two longest end at their EOS."""
    engine = ScriptedRollout(tokenizer, finish=["length", "stop", "stop", "stop", "stop", "stop"])
    _, _, metrics = run_ppo_step(make_config(), actor, TokenValueCritic(len(tokenizer)), tokenizer, records,
                                 monkeypatch, engine=engine)
    assert metrics["response_length/clip_ratio"] == pytest.approx(1 / 6)


def test_ppo_critic_update_uses_the_value_loss_clipped_around_the_old_values(
        tokenizer, actor, records, monkeypatch):
    """Eq. (2) with c = cfg.value_clip: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2),
    token-mean over the given normaliser. Here the critic has moved by 2 > c since the rollout."""
    cfg = make_config(value_clip=0.5)
    critic = TokenValueCritic(len(tokenizer), seed=3)
    batch, calls, _ = run_ppo_step(cfg, actor, critic, tokenizer, records, monkeypatch)
    update = calls["critic"]
    assert update.model is critic
    per_token, mask = update.per_token, batch.response_mask
    with torch.no_grad():
        critic.table += 2.0
    values = critic_values(critic, batch)
    old, target = per_token["old_values"], per_token["returns"]
    clipped = old + (values - old).clamp(-cfg.value_clip, cfg.value_clip)
    per_token_loss = 0.5 * torch.maximum((values - target) ** 2, (clipped - target) ** 2)
    normalizer = float(mask.sum())
    loss, _ = update.loss_fn(critic, batch, per_token, normalizer, cfg)
    assert loss.item() == pytest.approx(((per_token_loss * mask).sum() / normalizer).item(), rel=1e-5)
    unclipped = 0.5 * ((values - target) ** 2 * mask).sum() / normalizer
    assert abs(loss.item() - unclipped.item()) > 0.01  # the clip matters here (tokens moved towards R)


def test_grpo_step_normalises_each_score_within_its_prompt_group(tokenizer, actor, records, monkeypatch):
    """GRPO (the baseline): no critic; A = (r - mean_g) / (std_g + eps) over the samples_per_prompt
    consecutive responses of one prompt (Bessel std), on every valid token of the response."""
    cfg = make_config(estimator="grpo", whiten_advantages=False)
    batch, calls, metrics = run_ppo_step(cfg, actor, None, tokenizer, records, monkeypatch)
    assert set(calls) == {"actor"} and "returns" not in calls["actor"].per_token
    scores = expected_scores().tolist()
    expected = torch.zeros_like(batch.response_mask)
    for start in range(0, len(scores), cfg.samples_per_prompt):
        group = scores[start : start + cfg.samples_per_prompt]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        for b in range(start, start + len(group)):
            expected[b] = (scores[b] - mean) / (std + 1e-6) * batch.response_mask[b]
    torch.testing.assert_close(calls["actor"].per_token["advantages"], expected, atol=1e-4, rtol=1e-5)
    assert not [key for key in metrics if key.startswith("critic/")]


def test_each_ppo_step_draws_its_prompts_samples_and_shuffle_from_its_own_streams(
        tokenizer, actor, records, monkeypatch):
    """PPO step s takes its prompts from the stream "ppo", its sampling seed from "ppo/sampling" and
    the mini-batch shuffle of the actor's and the critic's updates alike from "ppo/shuffle", each at
    step s (data.stream_seed): a resumed run replays its steps, and no two steps share a draw."""
    cfg = make_config()
    critic = TokenValueCritic(len(tokenizer), seed=1)
    draws = {}
    for step in (0, 3):
        calls, engine = {}, ScriptedRollout(tokenizer)
        monkeypatch.setattr(train, "update_model", record_update_model(calls))
        train.ppo_step(cfg, step, Sampler(cfg, engine, tokenizer, ScriptedGrader()), records,
                       {"actor": actor, "critic": critic}, {"actor": None, "critic": None})
        assert engine.prompts == [r["prompt_ids"] for r in sample_prompts(records, cfg, step, stream="ppo")]
        assert engine.seed == stream_seed(cfg.seed, "ppo/sampling", step)
        assert calls["actor"].seed == calls["critic"].seed == stream_seed(cfg.seed, "ppo/shuffle", step)
        draws[step] = engine.prompts, engine.seed, calls["actor"].seed
    assert all(a != b for a, b in zip(draws[0], draws[3]))


def test_a_response_cut_with_truncation_reward_0_is_not_counted_accurate(tokenizer, actor, records, monkeypatch):
    """reward/accuracy is the share of responses scored > 0: the two cut responses score 0 here
    (--truncation-reward 0), which is no correct answer."""
    cfg = dataclasses.replace(make_config(), truncation_reward=0.0)
    _, _, metrics = run_ppo_step(cfg, actor, TokenValueCritic(len(tokenizer)), tokenizer, records, monkeypatch)
    scores = expected_scores(truncation=0.0)
    assert (scores == 0).sum() == 2
    assert metrics["reward/accuracy"] == pytest.approx((scores > 0).float().mean().item())  # 2 of 6


def test_a_position_bin_that_no_response_reaches_is_logged_as_undefined(tokenizer, actor, records, monkeypatch):
    """Responses of 1 or 2 tokens have tokens in the first quarter of the 12 positions only: the mean
    advantage over no token is NaN, not 0."""
    short = ScriptedRollout(tokenizer, responses=["1", "2=", "3", "4=", "5", "6="], finish=["stop"] * 6)
    _, _, metrics = run_ppo_step(make_config(), actor, TokenValueCritic(len(tokenizer)), tokenizer, records,
                                 monkeypatch, engine=short)
    assert [math.isnan(metrics[f"advantage/pos_bin{k}"]) for k in range(4)] == [False, True, True, True]


def test_ppo_step_metrics_are_reduced_over_ranks_by_their_kind(tokenizer, actor, records, monkeypatch):
    """Under torchrun each rank holds a share of the batch: rollout_metrics hands
    fsdp_utils.reduce_metrics the longest response as a maximum, the grader's counts as sums, and
    each token-mean with the number of this rank's tokens it is over (a mean over every rank's
    tokens); both explained variances (of the targets, and of the Monte-Carlo return) sum their
    moments over ranks (fsdp_utils.all_reduce). The step's
    time is the sum of its stages', and the throughput counts prompt and response tokens."""
    seen, totals = {}, []
    reduce_metrics, explained_variance = step_metrics.fsdp_utils.reduce_metrics, step_metrics.explained_variance

    def reduce_spy(metrics, sums=(), maxes=(), tokens=None):
        seen.update(sums=set(sums), maxes=set(maxes), tokens=dict(tokens))
        return reduce_metrics(metrics, sums=sums, maxes=maxes, tokens=tokens)

    def explained_variance_spy(*args, **kwargs):
        totals.append(kwargs.get("total"))
        return explained_variance(*args, **kwargs)

    monkeypatch.setattr(step_metrics.fsdp_utils, "reduce_metrics", reduce_spy)
    monkeypatch.setattr(step_metrics, "explained_variance", explained_variance_spy)
    engine = ScriptedRollout(tokenizer)
    batch, _, metrics = run_ppo_step(make_config(), actor, TokenValueCritic(len(tokenizer)), tokenizer, records,
                                     monkeypatch, engine=engine)
    assert seen["maxes"] == {"response_length/max"}
    assert seen["sums"] == {"reward/grader_timeouts", "reward/missing_box"}
    mask = batch.response_mask
    tokens, rows = mask.sum().item(), len(mask)
    in_bins = [int(in_bin.sum()) for in_bin in step_metrics.position_bins(mask, MAX_NEW_TOKENS)]
    assert len(set(in_bins)) > 1  # bins of different sizes: one count for all cannot pass
    assert seen["tokens"] == {"advantage/mean": tokens, "critic/values_mean": tokens, "critic/returns/mean": tokens,
                              "critic/value_error/all": tokens, "critic/value_error/first_quarter": in_bins[0],
                              "advantage/last_token": rows, "advantage/other_tokens": tokens - rows,
                              **{f"advantage/pos_bin{k}": n for k, n in enumerate(in_bins)}}
    assert totals == [step_metrics.fsdp_utils.all_reduce] * 2

    stages = {k: v for k, v in metrics.items() if k.startswith("timing_s/") and k != "timing_s/step"}
    assert stages.keys() == {f"timing_s/{k}" for k in ("rollout", "reward", "forward", "update")}
    assert metrics["timing_s/step"] == pytest.approx(sum(stages.values()))
    prompt_tokens = sum(map(len, engine.prompts))
    assert metrics["perf/throughput"] == pytest.approx((prompt_tokens + tokens) / metrics["timing_s/step"])


# --- the actor's loss and forward ------------------------------------------------------------


def actor_config(**overrides):
    return SimpleNamespace(**{"temperature": 0.7, "clip_low": 0.2, "clip_high": 0.28, "dual_clip": None,
                              "loss_agg": "token-mean", "entropy_coef": 0.0, "kl_coef": 0.0,
                              "kl_estimator": "k3", "logprob_chunk_tokens": None} | overrides)


@pytest.fixture(scope="module")
def scripted_batch(tokenizer, records):
    """A scripted rollout batch (ragged prompts and responses) without any training around it."""
    engine = ScriptedRollout(tokenizer)
    return engine.generate([records[i % len(records)]["prompt_ids"] for i in range(len(RESPONSES))], MAX_NEW_TOKENS)


def test_policy_forward_reads_the_logits_before_each_response_token(actor, scripted_batch):
    """policy_forward keeps only the logits it needs; they must be those at positions
    P - 1 + t (README "Tensor layout"), as in a plain forward over the whole sequence; entropy alike."""
    expected, logits = full_forward_logprobs(actor, scripted_batch, 0.7)
    with torch.no_grad():
        logprobs, entropy = train.policy_forward(actor, scripted_batch, 0.7, with_entropy=True)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
    p = torch.softmax(logits / 0.7, -1)
    mask = scripted_batch.response_mask.bool()
    torch.testing.assert_close(entropy[mask], -(p * p.log()).sum(-1)[mask], atol=1e-5, rtol=1e-5)


def test_actor_loss_ratio_is_taken_against_the_old_logprobs(actor, scripted_batch):
    """rho = pi / pi_old with pi_old from per_token["old_logprobs"]: a policy that moved up by e^0.5 on
    every token, with A = +1, is clipped at 1 + eps_high on all of them."""
    cfg = actor_config()
    now, _ = full_forward_logprobs(actor, scripted_batch, cfg.temperature)
    mask = scripted_batch.response_mask
    per_token = {"old_logprobs": (now - 0.5) * mask, "advantages": mask.clone()}
    loss, metrics = train.actor_loss(actor, scripted_batch, per_token, float(mask.sum()), cfg)
    assert loss.item() == pytest.approx(-(1 + cfg.clip_high), rel=1e-5)
    assert metrics["pg_clipfrac_high"].item() == 1.0


def test_entropy_bonus_lowers_and_kl_penalty_raises_the_actor_loss(actor, scripted_batch):
    """loss = pg_loss - entropy_coef * mean H(pi) + kl_coef * mean k3, token-means over valid
    tokens; k3 = pi_ref/pi - 1 - log(pi_ref/pi) >= 0 estimates KL(pi || pi_ref)."""
    now, logits = full_forward_logprobs(actor, scripted_batch, 0.7)
    mask = scripted_batch.response_mask
    tokens = float(mask.sum())
    gen = torch.Generator().manual_seed(0)
    per_token = {"old_logprobs": now, "advantages": torch.randn(mask.shape, generator=gen) * mask,
            "ref_logprobs": (now + 0.3 * torch.randn(mask.shape, generator=gen)) * mask}
    base, _ = train.actor_loss(actor, scripted_batch, per_token, tokens, actor_config())

    p = torch.softmax(logits / 0.7, -1)
    mean_entropy = (-(p * p.log()).sum(-1) * mask).sum() / tokens
    with_entropy, _ = train.actor_loss(actor, scripted_batch, per_token, tokens, actor_config(entropy_coef=0.1))
    assert with_entropy.item() == pytest.approx(base.item() - 0.1 * mean_entropy.item(), abs=1e-5)

    log_r = per_token["ref_logprobs"] - now
    mean_k3 = ((log_r.exp() - 1 - log_r) * mask).sum() / tokens
    assert mean_k3 > 0.01
    with_kl, metrics = train.actor_loss(actor, scripted_batch, per_token, tokens, actor_config(kl_coef=0.1))
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * mean_k3.item(), abs=1e-5)
    assert metrics["kl"].item() == pytest.approx(mean_k3.item(), rel=1e-4)


def test_seq_mean_aggregates_the_entropy_bonus_and_kl_term_as_the_policy_loss_with_the_chosen_estimator(
        actor, scripted_batch):
    """--loss-agg seq-mean: the entropy bonus and the KL term are reduced as the policy loss is (each
    response's token-mean, summed over responses / the normaliser: the number of responses in the
    mini-batch, of which this micro-batch is half), and the KL term is --kl-estimator's: here
    k1 = log r with r = pi / pi_ref, not the default k3."""
    now, logits = full_forward_logprobs(actor, scripted_batch, 0.7)
    mask = scripted_batch.response_mask
    rows = 2.0 * len(mask)
    gen = torch.Generator().manual_seed(0)
    per_token = {"old_logprobs": now, "advantages": torch.randn(mask.shape, generator=gen) * mask,
                 "ref_logprobs": (now + 0.3 * torch.randn(mask.shape, generator=gen)) * mask}
    settings = {"loss_agg": "seq-mean", "kl_estimator": "k1"}
    base, _ = train.actor_loss(actor, scripted_batch, per_token, rows, actor_config(**settings))

    def seq_mean(x):
        return ((x * mask).sum(1) / mask.sum(1)).sum() / rows

    p = torch.softmax(logits / 0.7, -1)
    entropy = -(p * p.log()).sum(-1)
    with_entropy, _ = train.actor_loss(actor, scripted_batch, per_token, rows,
                                       actor_config(**settings, entropy_coef=0.1))
    assert with_entropy.item() == pytest.approx(base.item() - 0.1 * seq_mean(entropy).item(), abs=1e-5)

    log_r = now - per_token["ref_logprobs"]
    k3 = (-log_r).exp() - 1 + log_r
    assert abs(seq_mean(log_r) - seq_mean(k3)) > 0.01  # the default estimator cannot pass for it
    with_kl, metrics = train.actor_loss(actor, scripted_batch, per_token, rows, actor_config(**settings, kl_coef=0.1))
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * seq_mean(log_r).item(), abs=1e-5)
    assert metrics["kl"].item() == pytest.approx(((log_r * mask).sum() / mask.sum()).item(), abs=1e-6)


def test_the_entropy_is_logged_without_a_graph_unless_the_loss_uses_it(actor, scripted_batch):
    """With --entropy-coef 0 the entropy is a metric only: computed without autograd (no graph keeps
    its [B, T, V] softmax), with the same value; with a coefficient its gradient reaches the actor."""
    mask = scripted_batch.response_mask
    logprobs, entropy = train.policy_forward(actor, scripted_batch, 0.7, with_entropy=True, entropy_grad=False)
    _, tracked = train.policy_forward(actor, scripted_batch, 0.7, with_entropy=True)
    assert logprobs.requires_grad and not entropy.requires_grad and tracked.requires_grad
    torch.testing.assert_close(entropy, tracked.detach())
    per_token = {"old_logprobs": logprobs.detach(), "advantages": mask.clone()}
    weight = actor.get_output_embeddings().weight
    grads = {}
    for coef in (0.0, 0.1):
        loss, metrics = train.actor_loss(actor, scripted_batch, per_token, float(mask.sum()), actor_config(entropy_coef=coef))
        grads[coef] = torch.autograd.grad(loss, weight)[0]
        assert metrics["entropy"].item() == pytest.approx(((tracked * mask).sum() / mask.sum()).item(), rel=1e-5)
    assert not torch.allclose(grads[0.0], grads[0.1])


class _OpsSeen(TorchDispatchMode):
    """The aten operators run inside it, each with the last dimension of its first argument."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.seen.add((func.overloadpacket.__name__, first.shape[-1] if first is not None and first.dim() else None))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk_tokens", [None, 7])
def test_a_logged_entropy_costs_no_softmax_backward(actor, scripted_batch, chunk_tokens):
    """--entropy-coef 0, from whole logits or from hidden states (--logprob-chunk-tokens): the
    backward pass runs no softmax backward over the vocabulary for the entropy, which is only logged; with a
    coefficient it does, and both log the same entropy."""
    mask = scripted_batch.response_mask
    per_token = {"old_logprobs": train.policy_forward(actor, scripted_batch, 0.7)[0].detach(),
                 "advantages": mask.clone()}
    weight = actor.get_output_embeddings().weight
    logged = {}
    for coef in (0.0, 0.1):
        cfg = actor_config(entropy_coef=coef, logprob_chunk_tokens=chunk_tokens)
        loss, metrics = train.actor_loss(actor, scripted_batch, per_token, float(mask.sum()), cfg)
        with _OpsSeen() as ops:
            torch.autograd.grad(loss, weight)
        vocab = weight.shape[0]  # an attention path's own softmax backward is over keys, not the vocabulary
        assert (("_softmax_backward_data", vocab) in ops.seen) == bool(coef)
        logged[coef] = metrics["entropy"].item()
    assert logged[0.0] == pytest.approx(logged[0.1], rel=1e-6)


def test_with_logprob_chunks_the_old_logprobs_too_come_from_the_hidden_states_in_chunks(
        actor, scripted_batch, monkeypatch):
    """--logprob-chunk-tokens bounds the memory of every log-prob forward, the one before the update
    as well: old_outputs takes log pi_old from the output head in chunks (ppo.token_logprobs_and_entropy),
    never whole [B, T, V] logits, with the values of the whole logits."""
    cfg = make_config(logprob_chunk_tokens=5, temperature=0.7)
    chunked, statistics = [], train.token_logprobs_and_entropy
    monkeypatch.setattr(train, "token_logprobs_and_entropy",
                        lambda *args, **kwargs: chunked.append(args[4]) or statistics(*args, **kwargs))
    per_token = train.old_outputs(cfg, scripted_batch, actor, None, None)
    assert chunked and set(chunked) == {5}
    expected, _ = full_forward_logprobs(actor, scripted_batch, cfg.temperature)
    torch.testing.assert_close(per_token["old_logprobs"], expected, atol=1e-5, rtol=1e-5)


def test_logprob_chunks_refuse_a_model_whose_logits_are_not_its_heads_output(actor, scripted_batch):
    """--logprob-chunk-tokens computes the log-probs inside the output head: Gemma 2 soft-caps what the head
    returns (Cohere and Granite scale it), which would silently bend the log-probs. Such a model stops at
    start in one line; a plain head (the tiny Qwen2) passes and gives the whole logits' log-probs."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from support.config import ConfigError

    capped = Gemma2ForCausalLM(Gemma2Config(vocab_size=actor.config.vocab_size, hidden_size=64, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                            head_dim=64, final_logit_softcapping=1.0)).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="--logprob-chunk-tokens: Gemma2ForCausalLM changes"):
        train.policy_forward(capped, scripted_batch, 1.0, chunk_tokens=4)
    with pytest.raises(ConfigError, match="--logprob-chunk-tokens: Gemma2ForCausalLM changes its output head's"):
        train.check_logprob_chunks(capped, torch.device("cpu"))
    train.check_logprob_chunks(actor, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(train.policy_forward(actor, scripted_batch, 1.0, chunk_tokens=4)[0],
                                   train.policy_forward(actor, scripted_batch, 1.0)[0], atol=1e-5, rtol=1e-5)


# --- value pretraining (§3.2) ----------------------------------------------------------------


def test_value_pretraining_regresses_unclipped_on_discounted_monte_carlo_returns(
        tokenizer, records, tmp_path, monkeypatch):
    """§3.2: targets are GAE with lambda = 1, i.e. the Monte-Carlo return gamma^(L-1-t) * score
    (whatever the critic says); the loss is the plain 0.5 (V - R)^2 (no clip: the critic moves
    freely); the logged explained variance is 1 - Var(R - V) / Var(R) of the values before the update."""
    cfg = make_config(gamma=0.8, value_pretrain_steps=1)
    critic = TokenValueCritic(len(tokenizer), seed=4)
    calls = {}
    monkeypatch.setattr(value_pretrain, "update_model", record_update_model(calls, {"critic/vf_loss": 0.0}))
    monkeypatch.setattr(value_pretrain, "export_hf_checkpoint", lambda *args, **kwargs: None)
    engine = ScriptedRollout(tokenizer)
    history = value_pretrain.pretrain_value(cfg, critic, None, Sampler(cfg, engine, tokenizer, ScriptedGrader()),
                                            records, str(tmp_path))
    batch, update = engine.batch, calls["critic"]
    mask, scores = batch.response_mask, expected_scores()
    returns = torch.zeros_like(mask)
    for b, length in enumerate(batch.lengths.tolist()):
        for t in range(length):
            returns[b, t] = cfg.gamma ** (length - 1 - t) * scores[b]
    values = critic_values(critic, batch)
    torch.testing.assert_close(update.per_token["returns"], returns, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(update.per_token["old_values"], values)

    valid = mask.bool()
    explained = 1 - (returns - values)[valid].var(unbiased=False) / returns[valid].var(unbiased=False)
    assert history[0]["explained_variance"] == pytest.approx(explained.item(), rel=1e-5)

    with torch.no_grad():
        critic.table += 2.0  # far from the old values: a clip of any usual size would bite
    moved = critic_values(critic, batch)
    tokens = float(mask.sum())
    loss, _ = update.loss_fn(critic, batch, update.per_token, tokens, cfg)
    assert loss.item() == pytest.approx((0.5 * (moved - returns)[valid] ** 2).sum().item() / tokens, rel=1e-5)


NAN = float("nan")


def history(losses, evs):
    return [{"value_loss": loss, "explained_variance": ev} for loss, ev in zip(losses, evs)]


@pytest.mark.parametrize("losses, evs, expected", [
    ([1.0] * 6, [0.5] * 6, True),  # both flat
    ([1.0] * 3 + [0.99] * 3, [0.5] * 3 + [0.505] * 3, True),  # both move less than the tolerances
    ([1.0] * 5, [0.5] * 5, False),  # fewer than two windows
    ([1.0] * 3 + [0.9] * 3, [0.5] * 6, False),  # loss still falls by 10% (> 2%)
    ([1.0] * 6, [0.5] * 3 + [0.6] * 3, False),  # EV still rises by 0.1 (> 0.01)
    ([5.0] * 3 + [1.0] * 3 + [0.99] * 3, [0.0] * 3 + [0.5] * 6, True),  # only the last two windows count
    ([1.0] * 6, [0.5] * 5 + [NAN], True),  # a batch of equal returns has no EV: the others decide
    ([1.0] * 6, [0.5] * 3 + [NAN] * 3, True),  # a window without any: the loss alone decides
    ([1.0] * 3 + [0.9] * 3, [0.5] * 3 + [NAN] * 3, False),  # ... and it still falls
    ([1.0] * 6, [0.5] * 4 + [0.7, NAN], False),  # the defined EVs still rise
    ([0.1] * 3 + [0.09] * 3, [0.5] * 6, False),  # rel_tol is relative: a 10% fall of a small loss...
    ([100.0] * 3 + [99.0] * 3, [0.5] * 6, True),  # ... and a 1% fall of a large one
    # Means as flat as the first case's, but the steps' own spread (fresh batches of mixed outcomes)
    # is far larger than the tolerance: the windows cannot tell a plateau from a chance dip.
    ([1.2, 0.8, 1.0, 1.1, 0.9, 0.99], [0.5] * 6, False),
    ([1.0] * 6, [0.4, 0.6, 0.5, 0.45, 0.55, 0.5], False),
    ([1.001, 0.999, 1.0, 0.991, 0.989, 0.99], [0.5] * 6, True),  # a spread well within the tolerance
    ([1.0] * 6, [0.3, NAN, NAN, 0.5, 0.5, 0.5], True),  # one EV in a window shows no noise: the loss decides
])
def test_plateaued_needs_both_loss_and_explained_variance_flat_over_two_windows(losses, evs, expected):
    """value_pretrain's documented stop: over two consecutive windows the mean loss falls by less
    than rel_tol (relative) AND the mean explained variance rises by less than ev_tol, each by two
    standard errors of the change (the steps' spread within each window)."""
    assert value_pretrain.plateaued(history(losses, evs), window=3, rel_tol=0.02, ev_tol=0.01) is expected


def test_a_plateau_window_of_one_step_never_stops_pretraining():
    """One step a window shows nothing of the steps' noise: the margin was 0, and a chance dip of one
    batch's loss stopped pretraining, as the rule without a margin did."""
    assert not value_pretrain.plateaued(history([1.3, 1.29], [0.5, 0.5]), window=1, rel_tol=0.02, ev_tol=0.01)
    assert not value_pretrain.plateaued(history([1.0] * 6, [0.5] * 6), window=1, rel_tol=0.02, ev_tol=0.01)


def test_the_paper_math_imports_no_distributed_plumbing():
    """gae.py (Eq. 5 and 8) and ppo.py (Eq. 1-2) read on their own: neither the trainer's process groups
    (fsdp_utils), sharded tensors (DTensor) nor checkpoints are in their import chain."""
    import os
    import subprocess
    import sys

    code = ("import sys, gae, ppo; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('fsdp_utils', 'checkpoints', 'rollout', 'train', 'ppo_update') or m.startswith('torch.distributed.tensor')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
