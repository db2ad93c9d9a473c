"""Tests for ppo.py: micro-batch invariance of the losses, clipping at its boundaries, masked
statistics, log-probs/entropy with temperature, KL estimators, explained variance, input checks."""

import math

import pytest
import torch

from support.masked import check_masked_inputs, masked_mean
from ppo import aggregate_loss, entropy_from_logits, explained_variance, kl_penalty, policy_loss
from ppo import response_logprobs, token_logprobs_and_entropy, value_loss
from ppo_update import masked_whiten

torch.set_num_threads(1)


def ragged_mask(batch, length, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    return (torch.arange(length)[None] < lengths[:, None]).float()


def policy_batch(batch=8, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(batch, length, seed)
    old = -torch.rand(batch, length, generator=gen) * 3
    new = old + 0.4 * torch.randn(batch, length, generator=gen)  # ratios well past both clips
    adv = torch.randn(batch, length, generator=gen) * mask
    return new, old, adv, mask


def grads_whole_vs_split(loss_fn, leaf, others, mask, splits, normalizer):
    """Gradient of the whole-batch loss and the summed gradients of micro-batch losses."""
    whole = leaf.clone().requires_grad_(True)
    loss_fn(whole, *others, mask, normalizer).backward()
    split_leaf = leaf.clone().requires_grad_(True)
    start = 0
    for size in splits:
        rows = slice(start, start + size)
        loss_fn(split_leaf[rows], *(x[rows] for x in others), mask[rows], normalizer).backward()
        start += size
    return whole.grad, split_leaf.grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_gradient_is_identical_for_whole_batch_and_micro_batches(mode, dual_clip):
    new, old, adv, mask = policy_batch()
    normalizer = float(mask.sum()) if mode == "token-mean" else float(mask.shape[0])

    def loss_fn(lp, old_lp, a, m, norm):
        return policy_loss(lp, old_lp, a, m, 0.2, 0.28, dual_clip, mode, norm)[0]

    whole, split = grads_whole_vs_split(loss_fn, new, (old, adv), mask, [3, 1, 4], normalizer)
    assert whole.abs().sum() > 0
    assert (whole - split).abs().max() <= 1e-6


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean"])
def test_value_gradient_is_identical_for_whole_batch_and_micro_batches(mode):
    gen = torch.Generator().manual_seed(1)
    mask = ragged_mask(8, 12, 1)
    old_values, returns = torch.randn(8, 12, generator=gen), torch.randn(8, 12, generator=gen)
    values = old_values + torch.randn(8, 12, generator=gen)
    normalizer = float(mask.sum()) if mode == "token-mean" else 8.0

    def loss_fn(v, v_old, r, m, norm):
        return value_loss(v, v_old, r, m, 0.5, mode, norm)[0]

    whole, split = grads_whole_vs_split(loss_fn, values, (old_values, returns), mask, [5, 3], normalizer)
    assert whole.abs().sum() > 0
    assert (whole - split).abs().max() <= 1e-6


def one_token_policy_grad(ratio, advantage, **kwargs):
    """(loss, d loss / d log pi, metrics) for a single token with the given ratio."""
    log_prob = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(log_prob, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), **kwargs)
    loss.backward()
    return loss.item(), log_prob.grad.item(), metrics


@pytest.mark.parametrize(
    "ratio, advantage, clipped, which",
    [
        (1.28 + 1e-3, 1.0, True, "pg_clipfrac_high"),  # A > 0: gain capped at 1 + eps_high
        (1.28 - 1e-3, 1.0, False, None),
        (1.2 + 1e-3, 1.0, False, None),  # clip-higher: eps_high is 0.28, not eps_low
        (0.8 - 1e-3, -1.0, True, "pg_clipfrac_low"),  # A < 0: gain capped at 1 - eps_low
        (0.8 + 1e-3, -1.0, False, None),
        (0.5, 1.0, False, None),  # pessimistic side stays unclipped
        (2.0, -1.0, False, None),
        # ...however far: the guard on the log-ratio (exp overflow, |log rho| <= 20) takes no gradient here
        (math.exp(3.0), -1.0, False, None),
        (math.exp(-3.0), 1.0, False, None),
    ],
)
def test_policy_clip_removes_the_gradient_exactly_outside_its_range(ratio, advantage, clipped, which):
    loss, grad, metrics = one_token_policy_grad(ratio, advantage, clip_low=0.2, clip_high=0.28)
    if clipped:
        assert grad == 0.0
        bound = 1.28 if advantage > 0 else 0.8
        assert loss == pytest.approx(-advantage * bound)
        assert metrics[which].item() == 1.0
    else:
        assert grad == pytest.approx(-advantage * ratio)  # d(-A rho)/d log pi = -A rho
        assert loss == pytest.approx(-advantage * ratio)
    assert metrics["pg_clipfrac_low"] + metrics["pg_clipfrac_high"] == (1.0 if clipped else 0.0)


def test_dual_clip_caps_negative_advantage_loss_at_c():
    loss, grad, metrics = one_token_policy_grad(3.5, -2.0, dual_clip=3.0)
    assert loss == pytest.approx(2.0 * 3.0) and grad == 0.0
    assert metrics["pg_clipfrac_dual"].item() == 1.0
    loss, grad, metrics = one_token_policy_grad(2.5, -2.0, dual_clip=3.0)
    assert loss == pytest.approx(2.0 * 2.5) and grad == pytest.approx(2.0 * 2.5)
    assert metrics["pg_clipfrac_dual"].item() == 0.0
    loss, _, _ = one_token_policy_grad(3.5, 2.0, dual_clip=3.0)  # A > 0: dual clip not involved
    assert loss == pytest.approx(-2.0 * 1.2)


def test_policy_loss_ignores_padding_and_survives_absurd_ratios():
    new, old, adv, mask = policy_batch(seed=2)
    base, _ = policy_loss(new, old, adv, mask)
    garbage_new = torch.where(mask.bool(), new, torch.full_like(new, 500.0))
    garbage_adv = torch.where(mask.bool(), adv, torch.full_like(adv, -5.0))  # nonzero: -A rho would count
    loss, metrics = policy_loss(garbage_new, old, garbage_adv, mask)
    assert loss.item() == pytest.approx(base.item())
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize(
    "value, clipped",
    [(0.5 - 0.2 - 1e-3, True), (0.5 - 0.2 + 1e-3, False), (0.5 + 0.2 + 1e-3, False)],
)
def test_value_clip_removes_the_gradient_only_when_the_clipped_error_is_larger(value, clipped):
    # V_old = 0.5, R = 0: a step towards R past V_old - c is clipped (the clipped error is larger);
    # a step away from R keeps the larger, unclipped error and its gradient.
    v = torch.tensor([[value]], requires_grad=True)
    loss, metrics = value_loss(v, torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.ones(1, 1), clip=0.2)
    loss.backward()
    if clipped:
        assert v.grad.item() == 0.0 and loss.item() == pytest.approx(0.5 * 0.3**2)
        assert metrics["vf_clipfrac"].item() == 1.0
    else:
        assert v.grad.item() == pytest.approx(value) and loss.item() == pytest.approx(0.5 * value**2)
        assert metrics["vf_clipfrac"].item() == 0.0


def test_value_loss_without_clip_is_half_squared_error():
    v, r = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 0.0]])
    loss, _ = value_loss(v, torch.zeros(1, 2), r, torch.tensor([[1.0, 0.0]]), clip=None)
    assert loss.item() == pytest.approx(0.5)


def test_aggregate_loss_token_and_sequence_means():
    loss = torch.tensor([[1.0, 3.0, 100.0], [2.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(loss, mask).item() == pytest.approx(6.0 / 3)
    assert aggregate_loss(loss, mask, normalizer=6.0).item() == pytest.approx(1.0)
    assert aggregate_loss(loss, mask, "seq-mean").item() == pytest.approx((2.0 + 2.0) / 2)
    assert aggregate_loss(loss, mask, "seq-mean", normalizer=4.0).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError, match="normalizer"):
        aggregate_loss(loss, mask, normalizer=0.0)


def test_whitening_ignores_padding():
    gen = torch.Generator().manual_seed(3)
    mask = ragged_mask(6, 10, 3)
    x = torch.randn(6, 10, generator=gen) * 3 + 2
    garbage = torch.where(mask.bool(), x, torch.full_like(x, 1e4))
    white = masked_whiten(garbage, mask)
    assert torch.equal(white, masked_whiten(x * mask, mask))
    assert torch.equal(white[~mask.bool()], torch.zeros_like(white[~mask.bool()]))
    assert masked_mean(white, mask).abs() < 1e-5
    assert white[mask.bool()].var().item() == pytest.approx(1.0, abs=1e-4)


def test_masked_statistics_match_torch_on_valid_entries_and_empty_mask_gives_zero():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    valid = torch.tensor([1.0, 2.0, 4.0])
    assert masked_mean(x, mask).item() == pytest.approx(valid.mean().item())
    assert torch.allclose(masked_mean(x, mask, dim=1), torch.tensor([1.5, 4.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_response_logprobs_divide_logits_by_temperature():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    ids = torch.randint(0, 11, (3, 5), generator=gen)
    for temperature in (1.0, 0.7):
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
        assert torch.allclose(response_logprobs(logits, ids, temperature), expected, atol=1e-6)
    assert torch.allclose(response_logprobs(logits.bfloat16(), ids).exp().sum(), response_logprobs(logits, ids).exp().sum(), rtol=0.05)


def test_entropy_from_logits_matches_definition_and_uniform_gives_log_vocab():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 9, generator=gen) * 3
    for temperature in (1.0, 1.5):
        p = torch.softmax(logits / temperature, -1)
        assert torch.allclose(entropy_from_logits(logits, temperature), -(p * p.log()).sum(-1), atol=1e-5)
    assert torch.allclose(entropy_from_logits(torch.zeros(1, 1, 9)), torch.tensor([[math.log(9)]]))


def test_kl_estimators_are_zero_at_equality_and_k1_k3_are_unbiased():
    # Samples from pi; E[k1] = E[k3] = KL(pi || ref); k3 >= 0 per sample; k2 ~ KL for close policies.
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.4, 0.4, 0.2])
    true_kl = (pi * (pi / ref).log()).sum().item()
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(6))
    lp, lref = pi.log()[samples][None], ref.log()[samples][None]
    k1, k2, k3 = (kl_penalty(lp, lref, kind) for kind in ("k1", "k2", "k3"))
    assert k1.mean().item() == pytest.approx(true_kl, abs=2e-3)
    assert k3.mean().item() == pytest.approx(true_kl, abs=2e-3)
    assert k2.mean().item() == pytest.approx(true_kl, rel=0.1)
    assert (k3 >= 0).all()
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(lp, lp, kind), torch.zeros_like(lp))
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(lp, lref, "k4")


def test_ppo_kl_metric_is_zero_for_unchanged_policy_and_positive_otherwise():
    new, old, adv, mask = policy_batch(seed=7)
    assert policy_loss(old, old, adv, mask)[1]["ppo_kl"].item() == 0.0
    assert policy_loss(new, old, adv, mask)[1]["ppo_kl"].item() > 0.0


def test_explained_variance_perfect_mean_only_padding_and_constant_returns():
    gen = torch.Generator().manual_seed(8)
    mask = ragged_mask(5, 9, 8)
    returns = torch.randn(5, 9, generator=gen)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    mean = masked_mean(returns, mask)
    assert explained_variance(torch.full_like(returns, mean.item()), returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    garbage = torch.where(mask.bool(), returns, torch.full_like(returns, 1e3))
    assert explained_variance(garbage, garbage * 0 + returns, mask).item() == pytest.approx(1.0)
    biased = 0.5 * returns + 0.3  # a residual with a nonzero mean: 1 - Var(R - V) / Var(R), not 1 - MSE / Var(R)
    valid = mask.bool()
    expected = 1 - (returns - biased)[valid].var(unbiased=False) / returns[valid].var(unbiased=False)
    assert explained_variance(biased, returns, mask).item() == pytest.approx(expected.item(), rel=1e-5)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask).item())
    assert math.isnan(explained_variance(returns, torch.full_like(returns, 0.1), mask).item())
    assert math.isnan(explained_variance(returns, torch.zeros_like(returns), mask).item())
    # Nearly constant returns are not constant: a batch of 99 right answers and one wrong is defined.
    skewed = torch.ones(1, 100)
    skewed[0, 0] = -1.0
    assert explained_variance(0.5 * skewed, skewed, torch.ones(1, 100)).item() == pytest.approx(0.75)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda n, o, a, m: policy_loss(n, o, a[:, :3], m), "advantages has shape"),
        # The losses check shapes; contents are checked once per batch, where it is assembled.
        (lambda n, o, a, m: check_masked_inputs(m, old_log_probs=o * float("nan")), "old_log_probs contains NaN"),
        (lambda n, o, a, m: check_masked_inputs(m * 0.5, log_probs=n), "mask must be binary"),
        (lambda n, o, a, m: policy_loss(n, o, a, m, clip_low=1.0), "clip_low"),
        (lambda n, o, a, m: policy_loss(n, o, a, m, dual_clip=0.5), "dual_clip"),
        (lambda n, o, a, m: policy_loss(n, o, a, m, mode="mean"), "mode"),
        (lambda n, o, a, m: value_loss(n, o, a, m, clip=-1.0), "clip"),
        (lambda n, o, a, m: value_loss(n, o, a.long(), m), "returns must be a floating-point"),
        (lambda n, o, a, m: response_logprobs(n[..., None], torch.ones_like(m).long() * 3), "response_ids must lie"),
        (lambda n, o, a, m: response_logprobs(n[..., None], m), "integer"),
        (lambda n, o, a, m: response_logprobs(n[..., None], (m * 0).long(), temperature=0.0), "temperature"),
        (lambda n, o, a, m: entropy_from_logits(n[..., None], temperature=-1.0), "temperature"),
        # Shapes that torch would broadcast, in silence: a [B, 1] column against a [B, T] mask.
        (lambda n, o, a, m: aggregate_loss(n[:, :1], m), "per_token_loss has shape"),
        (lambda n, o, a, m: masked_whiten(a[:, :1], m), "x has shape"),
        (lambda n, o, a, m: kl_penalty(n, o[:, :1]), "differ in shape"),
        (lambda n, o, a, m: token_logprobs_and_entropy(n[..., None], torch.ones(5, 1), m[:, :3].long()), "targets"),
        (lambda n, o, a, m: token_logprobs_and_entropy(n[..., None], torch.ones(5, 1), m), "integer ids"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(*policy_batch(seed=9))


def test_check_masked_inputs_accepts_bool_masks_and_non_prefix_masks_unless_right_padded():
    mask = torch.tensor([[True, False, True]])
    check_masked_inputs(mask, x=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="right-padded"):
        check_masked_inputs(mask, right_padded=True)
    check_masked_inputs(torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), right_padded=True)


def test_finite_values_whose_sum_overflows_are_not_taken_for_nan_or_inf():
    """The content check sums each tensor first (NaN and inf survive a sum) and looks at every
    element only when the sum is not finite: values near float32's maximum overflow the sum to inf
    yet are all finite, so they pass; a single inf among them still does not."""
    big = torch.full((2, 3), torch.finfo(torch.float32).max / 2)
    assert not torch.isfinite(big.sum())
    check_masked_inputs(torch.ones(2, 3), values=big)
    big[1, 2] = float("inf")
    with pytest.raises(ValueError, match="values contains NaN or inf"):
        check_masked_inputs(torch.ones(2, 3), values=big)


def test_check_masked_inputs_without_contents_checks_shapes_and_types_but_not_values():
    """contents=False (the losses, on every micro-batch; gae.py's compiled loop) leaves the values
    to a check made once elsewhere: NaN and a non-binary mask pass, a wrong shape or an integer
    tensor still raise."""
    mask = torch.tensor([[1.0, 0.5, 0.0]])
    check_masked_inputs(mask, contents=False, x=torch.full((1, 3), float("nan")))
    with pytest.raises(ValueError, match="x has shape"):
        check_masked_inputs(mask, contents=False, x=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="x must be a floating-point"):
        check_masked_inputs(mask, contents=False, x=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("outside", [2.0, -1.0])
def test_a_mask_whose_entries_outside_0_1_cancel_the_others_is_not_binary(outside):
    """The binary test sums m (1 - m), which is > 0 strictly inside (0, 1) but < 0 outside [0, 1]:
    a 2 (or a -1) gives -2, eight 0.5s give +2, and the sum is 0. Only the range check rejects it."""
    mask = torch.tensor([[outside] + [0.5] * 8])
    with pytest.raises(ValueError, match="mask must be binary"):
        check_masked_inputs(mask)


def ragged_rollout(seed=0):
    """A tiny random policy and a RolloutBatch of ragged prompts and responses (random tokens)."""
    from support import task
    from rollout import RolloutBatch, left_pad

    tokenizer = task.build_tokenizer()
    model = task.make_tiny_model(tokenizer, num_layers=2, intermediate_size=256, seed=seed)
    texts = ["+21=\n", "+73+58+21+49+11=\n", "+10+10=\n", "+5=\n", "+99+1+7=\n", "+3+3+3+3+3+3+3=\n", "+8=\n"]
    prompt_ids, prompt_mask = left_pad([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id)
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(len(texts), 24, seed)
    response_ids = torch.randint(5, 20, mask.shape, generator=gen) * mask.long()
    batch = RolloutBatch(prompt_ids, prompt_mask, response_ids, mask, torch.zeros_like(mask), ["stop"] * len(texts))
    with torch.no_grad():
        logits = batch.response_slice(model(**batch.model_inputs()).logits)
    batch.logprobs = response_logprobs(logits, response_ids, 1.0) * mask
    return model, batch


def test_update_model_step_does_not_depend_on_micro_batches_or_their_trimmed_padding():
    """A whole mini-batch in one forward vs micro-batches of 3 rows, or filled to a budget of
    padded tokens, each sorted by length and trimmed to its own longest response, and vs
    log-probs and entropy from the hidden states in chunks: the same parameters after one SGD step."""
    import copy
    from types import SimpleNamespace

    import train
    from ppo_update import update_model

    model, batch = ragged_rollout()
    assert len(set(batch.lengths.tolist())) > 2  # ragged, so trimming has something to drop
    gen = torch.Generator().manual_seed(0)
    rows = {"old_logprobs": batch.logprobs - 0.1 * torch.rand(batch.logprobs.shape, generator=gen) * batch.response_mask,
            "advantages": torch.randn(batch.logprobs.shape, generator=gen) * batch.response_mask}
    params, widest = [], int(batch.prompt_mask.sum(-1).max() + batch.lengths.max())
    splits = [(len(batch), None, None), (3, None, None), (1, 2 * widest, None), (len(batch), None, 7)]
    for micro_batch_size, micro_batch_tokens, chunk_tokens in splits:
        cfg = SimpleNamespace(ppo_epochs=1, num_minibatches=1, micro_batch_size=micro_batch_size,
                              micro_batch_tokens=micro_batch_tokens, logprob_chunk_tokens=chunk_tokens,
                              loss_agg="token-mean", max_grad_norm=1e9, temperature=0.7, clip_low=0.2,
                              clip_high=0.2, dual_clip=None, entropy_coef=0.01, kl_coef=0.0)
        trained = copy.deepcopy(model)
        update_model(cfg, trained, torch.optim.SGD(trained.parameters(), lr=1.0), batch, rows,
                     train.actor_loss, seed=0, prefix="actor")
        params.append(torch.cat([p.detach().flatten() for p in trained.parameters()]))
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (params[0] - before).abs().max() > 1e-4  # the step moved the weights
    for other in params[1:]:
        assert torch.allclose(params[0], other, atol=1e-6)


def test_trim_drops_unused_padding_and_keeps_the_outputs():
    model, batch = ragged_rollout()
    short = batch.select([int(batch.lengths.argmin()), 0])
    trimmed = short.trim()
    assert trimmed.response_ids.shape[1] == int(short.lengths.max()) < batch.response_ids.shape[1]
    assert trimmed.prompt_ids.shape[1] == int(short.prompt_mask.sum(-1).max()) < batch.prompt_ids.shape[1]
    with torch.no_grad():
        full = short.response_slice(model(**short.model_inputs()).logits)[:, : trimmed.response_ids.shape[1]]
        cut = trimmed.response_slice(model(**trimmed.model_inputs()).logits)
    assert torch.allclose(full, cut, atol=1e-5)


def test_micro_batched_forward_equals_the_whole_batch_forward_in_bounded_micro_batches():
    """The no-grad forward before the update (old log-probs, values) runs in length-sorted,
    trimmed micro-batches of at most micro_batch_size rows, and reassembles the whole-batch result."""
    import train
    from ppo_update import micro_batched_forward

    model, batch = ragged_rollout()
    with torch.no_grad():
        whole, _ = train.policy_forward(model, batch, temperature=0.7)
    seen = []

    def logprobs(micro):
        seen.append((len(micro), micro.response_ids.shape[1], int(micro.lengths.max())))
        return train.policy_forward(model, micro, temperature=0.7)[0]

    out = micro_batched_forward(logprobs, batch, micro_batch_size=3)
    assert out.shape == whole.shape and not out.requires_grad
    assert torch.allclose(out, whole, atol=1e-5)
    assert (out[batch.response_mask == 0] == 0).all()
    assert sum(rows for rows, _, _ in seen) == len(batch) and max(rows for rows, _, _ in seen) <= 3
    assert all(width == longest for _, width, longest in seen)  # each trimmed to its own longest
    assert min(width for _, width, _ in seen) < batch.response_ids.shape[1]


def test_micro_batched_forward_fills_a_token_budget_when_given_one():
    """With micro_batch_tokens (train.py and value_pretrain.py pass it) the no-grad forward cuts the
    length-sorted rows into runs of up to that many padded tokens, as update_model does, not into
    micro_batch_size rows each. Responses 1..6 (rows 0, 2, 4, 1, 5, 3 by length) after 2-token
    prompts in 16 tokens: 3 x (2 + 3) = 15, then 2 x (2 + 5) = 14, then row 3 alone (8)."""
    from ppo_update import micro_batched_forward

    batch = synthetic_rollout([1, 4, 2, 6, 3, 5])
    sizes = []

    def rows_in_micro_batch(micro):
        sizes.append(len(micro) * (micro.prompt_ids.shape[1] + micro.response_ids.shape[1]))
        return micro.response_mask * len(micro)

    out = micro_batched_forward(rows_in_micro_batch, batch, micro_batch_size=1, micro_batch_tokens=16)
    assert sizes == [15, 14, 8]
    assert torch.equal(out, batch.response_mask * torch.tensor([3.0, 2.0, 3.0, 1.0, 3.0, 2.0])[:, None])

# --- padding, exact KL expectations, update_model's loop --------------------------------------


def test_policy_loss_and_metrics_equal_those_of_the_valid_tokens_packed_in_one_row():
    """Whatever padding holds (log-probs, old log-probs, advantages), the loss and every metric of
    a ragged batch equal those of its valid tokens alone, packed into one unpadded row."""
    new, old, adv, mask = policy_batch(seed=11)
    valid = mask.bool()
    assert not valid.all()

    def garbage(x, value):
        return torch.where(valid, x, torch.full_like(x, value))

    clips = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss, metrics = policy_loss(garbage(new, -4.0), garbage(old, 3.0), garbage(adv, -5.0), mask, **clips)
    packed = [x[valid][None] for x in (new, old, adv)]
    ref_loss, ref_metrics = policy_loss(*packed, torch.ones_like(packed[0]), **clips)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert ref_metrics["pg_clipfrac_low"] > 0 and ref_metrics["pg_clipfrac_high"] > 0
    for name, value in ref_metrics.items():
        assert metrics[name].item() == pytest.approx(value.item(), rel=1e-6, abs=1e-7), name


def test_kl_estimators_k1_and_k3_have_the_exact_kl_as_expectation():
    """E_{y ~ pi}[k(log pi(y), log pi_ref(y))] = KL(pi || pi_ref) for k1 and k3, computed exactly
    by enumerating a 3-token vocabulary. The distributions are far apart, so k3 with the ratio
    inverted (pi/ref - 1 - log(pi/ref), whose expectation is chi^2 - KL) misses by about 0.3."""
    pi = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    kl = (pi * (pi / ref).log()).sum().item()
    for kind in ("k1", "k3"):
        per_token = kl_penalty(pi.log()[None], ref.log()[None], kind)
        assert (pi * per_token[0]).sum().item() == pytest.approx(kl, rel=1e-9), kind
    assert (kl_penalty(pi.log()[None], ref.log()[None], "k3") >= 0).all()


def test_kl_estimators_as_loss_terms_have_the_gradients_the_docstring_names():
    """Added to the loss on samples drawn from pi (the first mini-batch, where pi = pi_old), an
    estimator's gradient with respect to pi's logits is, in expectation, sum_y pi(y) grad k(y): the
    samples are fixed, so no score-function term. Computed exactly over a 3-token vocabulary: 0 for k1,
    grad KL(pi || ref) for k2, grad KL(ref || pi) for k3."""
    ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    logits = torch.tensor([1.2, -0.3, 0.1], dtype=torch.float64)

    def expected_grad(kind):
        z = logits.clone().requires_grad_()
        log_pi = z.log_softmax(-1)
        per_token = kl_penalty(log_pi[None], ref.log()[None], kind)[0]
        surrogate = (log_pi.exp().detach() * per_token).sum()  # each token weighted by how often it is drawn
        return torch.autograd.grad(surrogate, z)[0]

    def grad_of(divergence):
        z = logits.clone().requires_grad_()
        return torch.autograd.grad(divergence(z.softmax(-1)), z)[0]

    forward_kl = grad_of(lambda pi: (pi * (pi / ref).log()).sum())
    reverse_kl = grad_of(lambda pi: (ref * (ref / pi).log()).sum())
    assert torch.allclose(expected_grad("k1"), torch.zeros(3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(expected_grad("k2"), forward_kl, atol=1e-12)
    assert torch.allclose(expected_grad("k3"), reverse_kl, atol=1e-12)
    assert not torch.allclose(forward_kl, reverse_kl, atol=1e-3)  # the two are told apart here


def test_ppo_kl_metric_estimates_kl_from_old_to_new_policy_on_old_samples():
    """policy_loss's ppo_kl is the k3 estimate of KL(pi_old || pi) over tokens sampled from
    pi_old: four tokens drawn in exact proportion to pi_old = (1/2, 1/4, 1/4) give it exactly."""
    old_p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    new_p = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    tokens = torch.tensor([[0, 0, 1, 2]])
    _, metrics = policy_loss(new_p.log()[tokens], old_p.log()[tokens], torch.zeros(1, 4, dtype=torch.float64),
                             torch.ones(1, 4, dtype=torch.float64))
    kl_old_new = (old_p * (old_p / new_p).log()).sum().item()
    assert metrics["ppo_kl"].item() == pytest.approx(kl_old_new, rel=1e-9)


def synthetic_rollout(lengths, prompt_len=2):
    """A RolloutBatch of right-padded responses of the given lengths (no model needed)."""
    from rollout import RolloutBatch

    lengths = torch.tensor(lengths)
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).float()
    B, T = mask.shape
    return RolloutBatch(torch.full((B, prompt_len), 5), torch.ones(B, prompt_len, dtype=torch.long),
                        3 * mask.long(), mask, torch.zeros(B, T), ["stop"] * B)


class StepLog(torch.optim.SGD):
    """SGD that groups the loss_fn calls it sees by the optimizer step they were summed into."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.minibatches = [[]]

    def step(self, closure=None):
        super().step(closure)
        self.minibatches.append([])


def recording_loss(model, micro, micro_rows, normalizer, cfg):
    """loss = w * token-mean of x (w a scalar parameter), with a `_loss` and a token-mean metric;
    logs (rows, tokens, normalizer) of each call in the model's optimizer."""
    rows = micro_rows["row"][:, 0].long().tolist()
    model.log.minibatches[-1].append((rows, micro.response_mask.sum().item(), normalizer))
    loss = aggregate_loss(model.weight[0, 0] * micro_rows["x"], micro.response_mask, cfg.loss_agg, normalizer)
    return loss, {"x_loss": loss.detach(), "x_mean": masked_mean(micro_rows["x"], micro.response_mask)}


def run_update(lengths, lr=0.0, seed=0, **settings):
    from types import SimpleNamespace

    from ppo_update import update_model

    batch = synthetic_rollout(lengths)
    B, T = batch.response_mask.shape
    gen = torch.Generator().manual_seed(0)
    rows = {"row": torch.arange(B, dtype=torch.float32)[:, None].expand(B, T).clone(),
            "x": torch.randn(B, T, generator=gen) * batch.response_mask}
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    model.log = StepLog(model.parameters(), lr=lr)
    cfg = SimpleNamespace(**{"ppo_epochs": 1, "num_minibatches": 1, "micro_batch_size": 2, "micro_batch_tokens": None,
                             "loss_agg": "token-mean", "max_grad_norm": 1e9} | settings)
    metrics = update_model(cfg, model, model.log, batch, rows, recording_loss, seed=seed, prefix="m")
    return batch, rows, model, metrics, model.log.minibatches[:-1]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean"])
def test_update_model_runs_every_epoch_over_every_row_normalised_per_mini_batch(loss_agg):
    """ppo_epochs passes, each a permutation of the rows cut into num_minibatches optimizer steps;
    each step's losses are divided by that mini-batch's own token (or sequence) count."""
    lengths = [1, 4, 2, 6, 3, 5]
    batch, _, _, _, steps = run_update(lengths, ppo_epochs=3, num_minibatches=2, loss_agg=loss_agg)
    assert len(steps) == 3 * 2
    for epoch in range(3):
        seen = [r for step in steps[2 * epoch : 2 * epoch + 2] for rows, _, _ in step for r in rows]
        assert sorted(seen) == list(range(len(lengths)))
    for step in steps:
        rows = [r for micro_rows, _, _ in step for r in micro_rows]
        assert len(rows) == 3 and len(step) == 2  # micro-batches of at most 2 rows
        expected = sum(lengths[r] for r in rows) if loss_agg == "token-mean" else len(rows)
        assert {normalizer for _, _, normalizer in step} == {expected}


def test_update_model_metrics_are_mini_batch_token_means_averaged_over_steps():
    """`*_loss` metrics add up over a step's micro-batches; the others (token means) are weighted
    by each micro-batch's share of the step's tokens: both give the mini-batch's token mean of x
    here (w = 1, lr = 0), averaged over the optimizer steps."""
    lengths = [1, 4, 2, 6, 3, 5, 7, 2]
    _, rows, _, metrics, steps = run_update(lengths, ppo_epochs=2, num_minibatches=2)
    x, mask = rows["x"], synthetic_rollout(lengths).response_mask
    per_step = []
    for step in steps:
        picked = [r for micro_rows, _, _ in step for r in micro_rows]
        per_step.append((x[picked] * mask[picked]).sum().item() / mask[picked].sum().item())
    expected = sum(per_step) / len(per_step)
    assert metrics["m/x_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["m/x_mean"] == pytest.approx(expected, rel=1e-5)


def constant_gradient_update(lengths, ppo_epochs=1, num_minibatches=1, max_grad_norm=1e9):
    """update_model with loss = w * 100 (token mean of x = 100), whose gradient is 100 whatever w is,
    SGD at lr 1 from w = 0: returns the model and the metrics."""
    from types import SimpleNamespace

    from ppo_update import update_model

    batch = synthetic_rollout(lengths)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    rows = {"x": 100.0 * batch.response_mask}

    def loss_fn(model, micro, micro_rows, normalizer, cfg):
        return aggregate_loss(model.weight[0, 0] * micro_rows["x"], micro.response_mask, normalizer=normalizer), {}

    cfg = SimpleNamespace(ppo_epochs=ppo_epochs, num_minibatches=num_minibatches, micro_batch_size=1,
                          micro_batch_tokens=None, loss_agg="token-mean", max_grad_norm=max_grad_norm)
    metrics = update_model(cfg, model, torch.optim.SGD(model.parameters(), lr=1.0), batch, rows, loss_fn,
                           seed=0, prefix="m")
    return model, metrics


@pytest.mark.parametrize("max_grad_norm, expected_step", [(0.5, 0.5), (1e9, 100.0)])
def test_update_model_clips_the_gradient_norm_to_max_grad_norm(max_grad_norm, expected_step):
    """|dL/dw| = 100: the step is the gradient clipped to norm max_grad_norm; grad_norm reports the
    norm before clipping."""
    model, metrics = constant_gradient_update([3, 2], max_grad_norm=max_grad_norm)
    assert metrics["m/grad_norm"] == pytest.approx(100.0, rel=1e-5)
    assert model.weight.item() == pytest.approx(-expected_step, rel=1e-5)
    assert model.weight.grad is None  # freed: the rollout and the other model's update need the memory


def test_update_model_starts_every_optimizer_step_from_a_zero_gradient():
    """2 epochs x 2 mini-batches take four steps of exactly 100 each. A gradient left over from the
    previous mini-batch would add up to steps of 100, 200, 300, 400 (and a mean grad_norm of 250)."""
    model, metrics = constant_gradient_update([3, 2, 4, 1], ppo_epochs=2, num_minibatches=2)
    assert metrics["m/grad_norm"] == pytest.approx(100.0, rel=1e-5)
    assert model.weight.item() == pytest.approx(-400.0, rel=1e-5)


def test_update_model_draws_its_mini_batches_from_a_permutation_seeded_by_seed():
    """Each epoch cuts a random permutation of the rows into mini-batches, drawn from `seed` (train.py
    passes one per step, so a resumed run replays its steps): the same seed gives the same mini-batches,
    and other seeds other ones (an epoch's ordered split of 8 rows into halves repeats with probability 1/70)."""
    lengths = [1, 4, 2, 6, 3, 5, 7, 2]

    def minibatches(seed):
        steps = run_update(lengths, ppo_epochs=2, num_minibatches=2, seed=seed)[-1]
        return [sorted(r for rows, _, _ in step for r in rows) for step in steps]

    first = minibatches(0)
    assert minibatches(0) == first
    assert all(minibatches(seed) != first for seed in (1, 2, 3))
