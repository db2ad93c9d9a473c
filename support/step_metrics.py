"""What each PPO step logs (train.py), beside its losses: lengths, outcomes and timings, and the
paper's diagnostics of the critic.

- The mean advantage per quarter of the response budget (token positions, early to late; §3.1,
  Fig. 2): with an exact critic it is 0 at every position; a critic that starts off biased tilts
  the early tokens.
- The critic's error against the batch's Monte-Carlo return G_t (Eq. 5 at lambda = 1), over all
  tokens and over the budget's first quarter: at step 0, the critic's initial error, which value
  pretraining (§3.2) removes.
- The mean advantage of each response's last token, which alone sees r - V(s_{L-1}), against the
  other tokens' (§3.3: what lambda_actor < 1 passes back from it).

Every metric is reduced over ranks (fsdp_utils.reduce_metrics); those that are means over tokens
weigh each rank by its token count.
"""

from __future__ import annotations

import torch

import fsdp_utils
from gae import compute_gae
from ppo import explained_variance
from sampling import ScoredBatch
from support.masked import masked_mean

POSITION_BINS = 4  # advantage mean per quarter of the response budget, early to late (paper Fig. 2)


def position_bins(mask, horizon: int, bins: int = POSITION_BINS) -> list:
    """The mask of each bin of token positions, early -> late: `bins` equal parts of `horizon`, the
    most tokens a response may hold (--max-new-tokens). Fixed positions, not shares of each
    response's own length: whether a response reaches position t is part of s_t, so an exact
    critic's advantages average 0 over any set of positions, while the first quarter of a
    response's own length is chosen by the length still to come, on which the outcome depends
    (its mean is not 0 even for an exact critic)."""
    position = torch.arange(mask.shape[1], device=mask.device)
    bin_of = (position * bins // max(horizon, 1)).clamp(max=bins - 1)
    return [mask * (bin_of == b) for b in range(bins)]


class TokenMeans(dict):
    """Metrics that are means over tokens, with how many tokens each had on this rank: reduced over
    ranks as a mean over every rank's tokens (fsdp_utils.reduce_metrics), NaN over none."""

    def __init__(self):
        super().__init__()
        self.tokens = {}

    def add(self, name: str, x, mask) -> None:
        self[name], self.tokens[name] = masked_mean(x, mask).item(), mask.sum().item()


def critic_error_metrics(scored: ScoredBatch, values, advantages, gamma: float, horizon: int,
                         means: TokenMeans) -> dict:
    """How far the critic is from this batch's Monte-Carlo return G_t, and what that does to the
    advantages (§3.1): the mean of V(s_t) - G_t over all response tokens and over the first quarter
    of the positions a response may reach, `horizon` (at step 0, the critic's initial error), and
    the mean advantage (before whitening) of the last token, which alone sees r - V(s_{L-1}),
    against the rest. Returns the explained variance of G_t: `critic/vf_explained_var` scores V
    against the run's own targets, which at lambda_critic < 1 are built from V itself, so only this
    one compares critics across runs."""
    mask = scored.batch.response_mask
    _, mc_return = compute_gae(scored.token_rewards, values, mask, gamma, lam=1.0)  # Eq. 5 at lambda = 1: G_t
    last = torch.zeros_like(mask)
    last[torch.arange(len(mask), device=mask.device), scored.batch.lengths - 1] = 1.0
    error = values - mc_return
    means.add("critic/value_error/all", error, mask)
    means.add("critic/value_error/first_quarter", error, position_bins(mask, horizon)[0])
    means.add("advantage/last_token", advantages, last)
    means.add("advantage/other_tokens", advantages, mask - last)
    ev = explained_variance(values, mc_return, mask, total=fsdp_utils.all_reduce)
    return {"critic/value_error/explained_var": ev.item()}


def rollout_metrics(scored: ScoredBatch, per_token: dict, advantages, timings: dict, gamma: float,
                    horizon: int) -> dict:
    """Lengths, outcomes, advantages (before whitening, which centres them), the critic's values
    before the update, and timings; reduced over ranks (update_model's metrics already are).
    `horizon`: the most tokens a response may hold (`position_bins`)."""
    batch, mask = scored.batch, scored.batch.response_mask
    lengths = batch.lengths.float()
    metrics = {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": sum(batch.truncated) / len(batch),
        "prompt_length/mean": batch.prompt_mask.sum(-1).float().mean().item(),
        "reward/mean": scored.outcomes.mean().item(),
        "reward/accuracy": (scored.outcomes > 0).float().mean().item(),
        "reward/grader_timeouts": scored.grader_timeouts,
        "reward/missing_box": scored.missing_box,
    }
    means = TokenMeans()
    means.add("advantage/mean", advantages, mask)
    if "old_values" in per_token:
        values = per_token["old_values"]
        means.add("critic/values_mean", values, mask)
        means.add("critic/returns/mean", per_token["returns"], mask)
        # Over every rank's tokens: a rank whose returns were all equal (undefined there) must not make it NaN.
        metrics["critic/vf_explained_var"] = explained_variance(values, per_token["returns"], mask,
                                                                total=fsdp_utils.all_reduce).item()
        metrics |= critic_error_metrics(scored, values, advantages, gamma, horizon, means)
    for b, in_bin in enumerate(position_bins(mask, horizon)):
        means.add(f"advantage/pos_bin{b}", advantages, in_bin)
    # What the bins are (token positions per bin): runs logged before held quarters of each response.
    metrics["advantage/pos_bin_tokens"] = horizon / POSITION_BINS
    metrics |= {f"timing_s/{k}": v for k, v in timings.items()}
    metrics["timing_s/step"] = sum(timings.values())
    metrics["perf/throughput"] = (batch.prompt_mask.sum() + mask.sum()).item() / metrics["timing_s/step"]  # per GPU
    return fsdp_utils.reduce_metrics(metrics | means, maxes=("response_length/max",),
                                     sums=("reward/grader_timeouts", "reward/missing_box"), tokens=means.tokens)
