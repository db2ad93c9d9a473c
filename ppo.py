"""PPO losses (paper §2): clipped surrogate, clipped value loss, KL estimators, entropy, metrics.

Every loss is a pure function of tensors plus a response mask, in the layout of the README
("Tensor layout"): [B, T] float32, right-padded, mask = 1 on every generated token. The PPO epochs
that run them over mini- and micro-batches of a model are in ppo_update.py.

The losses check types and shapes only. The contents (finite values, a binary right-padded mask)
are checked once, where a rollout's per-token tensors are assembled (`masked.check_masked_inputs`
in train.ppo_step and value pretraining): a check per micro-batch loss would cost a device-to-host
sync each time.

Eq. (1), clipped surrogate with clip-higher (DAPO, Yu et al., 2025; VAPO takes it up) and an
optional dual clip (Ye et al., 2020):
    rho_t = pi(a_t|s_t) / pi_old(a_t|s_t)
    L_t   = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
    L_t   = min(L_t, -c A_t)                       only where A_t < 0 (dual clip)
Eq. (2), clipped value loss:
    L^V_t = 0.5 max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2)

Losses are summed over tokens and divided by a *global* normaliser (tokens or sequences of the
whole step, across micro-batches and ranks), so the gradient does not depend on how the batch
is split (the critic-loss scaling bug of verl PR #6957).
"""

import torch
import torch.utils.checkpoint

from support.masked import check_masked_inputs, masked_mean, masked_sum

# exp(log-ratio) overflows float32 near 88; a ratio of e^20 is already meaningless, and the clamp
# keeps A = 0 tokens from turning into 0 * inf = NaN.
_MAX_LOG_RATIO = 20.0
_LOSS_MODES = ("token-mean", "seq-mean")
_KL_KINDS = ("k1", "k2", "k3")


# --- Eq. (1) and Eq. (2) ------------------------------------------------------------------------


def policy_loss(
    log_probs,
    old_log_probs,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    mode="token-mean",
    normalizer=None,
):
    """Clipped surrogate, Eq. (1). Returns (loss, metrics) with metrics as detached 0-dim tensors:
    pg_loss, pg_clipfrac_low / pg_clipfrac_high (share of tokens whose gradient the lower / upper
    clip removes), pg_clipfrac_dual, ppo_kl (the k3 estimate of KL(pi_old || pi), never negative;
    verl logs k1 under that name, the mean log-ratio, which can be)."""
    check_masked_inputs(mask, contents=False, log_probs=log_probs, old_log_probs=old_log_probs,
                        advantages=advantages)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    mask = mask.to(log_probs.dtype)

    log_ratio = (log_probs - old_log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # pessimistic bound
    # The clip removes the gradient exactly where the clipped term is the larger one.
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        # Dual clip: for A < 0 the loss -A*rho grows without bound in rho; cap it at -A*c.
        dual_active = (advantages < 0) & (loss > -advantages * dual_clip)
        loss = torch.where(dual_active, -advantages * dual_clip, loss)

    agg = aggregate_loss(loss, mask, mode, normalizer)
    with torch.no_grad():
        metrics = {
            "pg_loss": agg.detach(),
            "pg_clipfrac_low": masked_mean((clip_active & (advantages < 0)).to(mask.dtype), mask),
            "pg_clipfrac_high": masked_mean((clip_active & (advantages > 0)).to(mask.dtype), mask),
            "pg_clipfrac_dual": masked_mean(dual_active.to(mask.dtype), mask),
            "ppo_kl": masked_mean(kl_penalty(old_log_probs, log_probs, "k3"), mask),
        }
    return agg, metrics


def value_loss(values, old_values, returns, mask, clip=0.5, mode="token-mean", normalizer=None):
    """Clipped value loss, Eq. (2); clip=None gives the plain 0.5 (V - R)^2. Returns (loss,
    metrics): vf_loss, vf_clipfrac (share of tokens where the clipped branch is the larger one)."""
    check_masked_inputs(mask, contents=False, values=values, old_values=old_values, returns=returns)
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 (or None), got {clip}")
    mask = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token, clip_active = 0.5 * unclipped, torch.zeros_like(mask, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    agg = aggregate_loss(per_token, mask, mode, normalizer)
    metrics = {"vf_loss": agg.detach(), "vf_clipfrac": masked_mean(clip_active.to(mask.dtype), mask)}
    return agg, metrics


# --- aggregation, KL, explained variance ---------------------------------------------------------


def aggregate_loss(per_token_loss, mask, mode="token-mean", normalizer=None):
    """Reduce a [B, T] loss to a scalar.

    token-mean: sum over valid tokens / normalizer (global token count of the step);
    seq-mean:   sum over sequences of each sequence's token-mean / normalizer (global number of
                sequences). normalizer=None uses this batch's own count (single-batch use).
    """
    if mode not in _LOSS_MODES:
        raise ValueError(f"mode must be one of {_LOSS_MODES}, got {mode!r}")
    check_masked_inputs(mask, contents=False, per_token_loss=per_token_loss)  # a [B, 1] loss would broadcast
    mask = mask.to(per_token_loss.dtype)
    if mode == "token-mean":
        total = masked_sum(per_token_loss, mask)
        default = mask.sum()
    else:
        total = masked_mean(per_token_loss, mask, dim=1).sum()
        default = mask.shape[0]
    if normalizer is None:
        normalizer = float(default)
    if not normalizer > 0:  # also rejects NaN
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return total / normalizer


def kl_penalty(log_probs, ref_log_probs, kind="k3"):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020): k1 = log r, k2 = (log r)^2 / 2, k3 = (1/r - 1) + log r with r = pi/pi_ref.
    k3 is unbiased and non-negative. Off by default in VC-PPO (no KL term).
    Differentiated as a loss term on pi's own samples, their gradients differ from their values:
    k1's is 0 in expectation (the score function's mean), k2's is the gradient of KL(pi || pi_ref),
    k3's that of the reverse KL(pi_ref || pi) (GRPO's choice); so the trainer refuses k1 as a loss."""
    if kind not in _KL_KINDS:
        raise ValueError(f"kind must be one of {_KL_KINDS}, got {kind!r}")
    if log_probs.shape != ref_log_probs.shape:  # [B, T] against [B, 1] would broadcast, in silence
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} "
                         f"differ in shape")
    log_r = log_probs - ref_log_probs
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(-log_r) - 1 + log_r


def explained_variance(values, returns, mask, total=lambda sums: sums):
    """1 - Var(R - V) / Var(R) over valid tokens (1 = perfect critic, 0 = no better than the
    mean). NaN when the returns are constant (Var(R) at rounding level), where it is undefined.
    `total`: a sum over the tokens of every rank (`fsdp_utils.all_reduce` under torchrun), so that
    the statistic is the whole batch's; the identity in one process."""
    check_masked_inputs(mask, values=values, returns=returns)
    mask = mask.to(values.dtype)
    count = total(mask.sum()).clamp_min(1)

    def mean(x):
        return total(masked_sum(x, mask)) / count

    def variance(x):  # not Bessel-corrected
        return total(masked_sum((x - mean(x)) ** 2, mask)) / count

    var_r = variance(returns)
    # A constant that is not a binary fraction (0.1) leaves a variance of order (eps * R)^2.
    if var_r <= 100 * torch.finfo(var_r.dtype).eps ** 2 * mean(returns**2):
        return torch.tensor(float("nan"), dtype=values.dtype, device=values.device)
    return 1 - variance(returns - values) / var_r


# --- log-probs and entropy of the policy ---------------------------------------------------------


def response_logprobs(logits, response_ids, temperature=1.0):
    """log pi(y_t | s_t) for the given ids: logits [B, T, V] aligned with response_ids [B, T]
    (the model output at sequence position P-1+t, README "Tensor layout"). Logits are divided by the rollout
    temperature (OpenRLHF PR #1319). Uses logsumexp + gather: no [B, T, V] softmax is kept."""
    if logits.dim() != 3 or response_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and response_ids [B, T]; got {tuple(logits.shape)} "
            f"and {tuple(response_ids.shape)}"
        )
    if response_ids.is_floating_point():
        raise ValueError(f"response_ids must be an integer tensor, got {response_ids.dtype}")
    if response_ids.numel() and (response_ids.min() < 0 or response_ids.max() >= logits.shape[-1]):
        raise ValueError(f"response_ids must lie in [0, {logits.shape[-1]})")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = _scaled_logits(logits, temperature)
    return _target_logprobs(z, response_ids, torch.logsumexp(z, dim=-1))


def entropy_from_logits(logits, temperature=1.0):
    """Per-position entropy [B, T] of softmax(logits / temperature):
    H = logsumexp(z) - sum softmax(z) z."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = _scaled_logits(logits, temperature)
    return _entropy(z, torch.logsumexp(z, dim=-1))


def token_logprobs_and_entropy(hidden, weight, targets, temperature=1.0, chunk_tokens=4096, with_entropy=True,
                               entropy_grad=True):
    """[B, T, 2]: log pi(y_t | s_t) and the entropy at each position, from the final hidden states
    [B, T, d] and the output embedding [V, d]: `response_logprobs` and `entropy_from_logits` of
    hidden @ weight.T, chunk_tokens positions at a time. Each chunk's float32 logits are reduced
    and dropped, and rebuilt in the backward pass (checkpoint): no [B T, V] tensor is ever held
    (at V = 152k, 8k tokens of float32 logits are 5 GB). Entropy is 0 unless with_entropy;
    entropy_grad=False leaves it out of the graph (only logged: no softmax backward over [T, V])."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2] or targets.is_floating_point():
        raise ValueError(f"hidden must be [B, T, d] and targets integer ids [B, T]; got {tuple(hidden.shape)} "
                         f"and {tuple(targets.shape)} {targets.dtype}")
    flat_hidden, flat_targets = hidden.flatten(0, 1), targets.flatten()
    chunks = [
        torch.utils.checkpoint.checkpoint(_chunk_statistics, flat_hidden[i : i + chunk_tokens], weight,
                                          flat_targets[i : i + chunk_tokens], temperature, with_entropy,
                                          entropy_grad, use_reentrant=False)
        for i in range(0, flat_hidden.shape[0], chunk_tokens)
    ]
    return torch.cat(chunks).view(*targets.shape, 2)


def _chunk_statistics(hidden, weight, targets, temperature, with_entropy, entropy_grad):
    """`response_logprobs` and `entropy_from_logits` of one chunk, sharing its logsumexp."""
    # The head's matmul in the model's dtype, as the logits are made; then float32.
    z = _scaled_logits(hidden @ weight.T, temperature)
    normalizer = torch.logsumexp(z, dim=-1)
    logprobs = _target_logprobs(z, targets, normalizer)
    if not with_entropy:
        return torch.stack([logprobs, torch.zeros_like(logprobs)], dim=-1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        entropy = _entropy(z, normalizer)
    return torch.stack([logprobs, entropy], dim=-1)


def _scaled_logits(logits, temperature):
    """float32 logits / temperature: the distribution the rollout sampled from."""
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def _target_logprobs(z, targets, normalizer):
    """log softmax(z) at the target ids, given logsumexp(z) (`normalizer`)."""
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer


def _entropy(z, normalizer):
    """H = logsumexp(z) - sum softmax(z) z, given logsumexp(z) (`normalizer`)."""
    return normalizer - (torch.softmax(z, dim=-1) * z).sum(-1)
