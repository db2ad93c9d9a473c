"""PPO losses (paper §2): clipped surrogate, clipped value loss, KL estimators, entropy, metrics.

Every loss is a pure function of tensors plus a response mask, in the layout of the README
("Tensor layout"): [B, T] float32, right-padded, mask = 1 on every generated token. Only
`update_model`, at the end, touches a model: it runs a loss over mini- and micro-batches (PPO
epochs) and steps the optimizer.

The losses check types and shapes only. The contents (finite values, a binary right-padded mask)
are checked once, where a rollout's per-token tensors are assembled (`check_masked_inputs` in
train.ppo_step and value pretraining): a check per micro-batch loss would cost a device-to-host
sync each time.

Eq. (1), clipped surrogate with clip-higher (VAPO) and optional dual clip (Ye et al., 2020):
    rho_t = pi(a_t|s_t) / pi_old(a_t|s_t)
    L_t   = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
    L_t   = min(L_t, -c A_t)                       only where A_t < 0 (dual clip)
Eq. (2), clipped value loss:
    L^V_t = 0.5 max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2)

Losses are summed over tokens and divided by a *global* normaliser (tokens or sequences of the
whole step, across micro-batches and ranks), so the gradient does not depend on how the batch
is split (the critic-loss scaling bug of verl PR #6957).
"""

import math

import torch
import torch.utils.checkpoint
from torch.distributed.tensor import DTensor

from fsdp_utils import all_reduce, reduce_metrics

# exp(log-ratio) overflows float32 near 88; a ratio of e^20 is already meaningless, and the clamp
# keeps A = 0 tokens from turning into 0 * inf = NaN.
_MAX_LOG_RATIO = 20.0
_LOSS_MODES = ("token-mean", "seq-mean")
_KL_KINDS = ("k1", "k2", "k3")


# --- input checks and masked statistics (the one home of these helpers) ------------------------


class NonFiniteError(ValueError, FloatingPointError):
    """A tensor holds NaN or inf: a bad input (ValueError) and, mid-training, the sign of a diverged
    model (FloatingPointError, which train.py reports with the checkpoint to resume from)."""


def check_masked_inputs(mask, right_padded=False, contents=True, **tensors):
    """Raise ValueError naming the argument if a tensor's shape differs from mask's, the mask is
    not binary (or, with right_padded, not ones-then-zeros in every row), or a tensor holds
    NaN/inf: reductions over the inputs, with one [B, T] temporary (1 - mask). contents=False
    checks types and shapes only, for a caller that checks the values in its own pass over them
    (gae.py's compiled loop)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a 2-D [B, T] tensor, got {getattr(mask, 'shape', type(mask))}")
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, mask has {tuple(mask.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if not contents:
            continue
        # NaN and inf propagate through a sum, so one scalar tells; only a finite-but-overflowing
        # sum needs the elementwise look.
        if not torch.isfinite(x.detach().sum()) and not torch.isfinite(x).all():
            raise NonFiniteError(f"{name} contains NaN or inf")
    if not contents or mask.numel() == 0:
        return
    m = mask.double() if mask.dtype == torch.float64 else mask.float()  # exact integer sums
    # With 0 <= m <= 1 every m (1 - m) is >= 0, and 0 only where m is 0 or 1: a sum of them is 0
    # exactly when the mask is binary (a sum of positive terms cannot round to 0, unlike a test of
    # sum(m) = sum(m^2), which a 0.99999994 or a 1e-40 slips through).
    lo, hi = torch.aminmax(m)
    if lo < 0 or hi > 1 or torch.linalg.vecdot(m, 1 - m).any():
        raise ValueError("mask must be binary (0/1 or bool)")
    length = m.sum(1)  # for a binary mask every partial sum is an integer <= T: exact (T < 2^24)
    # A binary row is ones-then-zeros iff it starts with a one (or is empty) and its L ones
    # form L - 1 adjacent (1, 1) pairs.
    if right_padded:
        pairs = torch.linalg.vecdot(m[:, :-1], m[:, 1:])
        starts = (m[:, 0] == 1) | (length == 0)
        if not (starts.all() and torch.equal(pairs, (length - 1).clamp_min(0))):
            raise ValueError("mask must be right-padded: ones then zeros in every row")


def assert_finite(named_tensors, what: str) -> None:
    """FloatingPointError naming the first bad tensor when any of (name, tensor) holds NaN or inf:
    a diverged model's parameters or outputs. Under torchrun every rank raises (a rank sees only its
    shards, and one rank leaving alone would hang the others)."""
    local = [(n, t.to_local() if isinstance(t, DTensor) else t) for n, t in named_tensors]
    bad = [n for n, t in local if not torch.isfinite(t.detach()).all()]
    if reduce_metrics({"bad": len(bad)}, sums=("bad",))["bad"] > 0:
        raise FloatingPointError(f"{what}: {bad[0] if bad else 'a tensor on another rank'} holds NaN or inf")


def masked_sum(x, mask, dim=None):
    """Sum of x over positions where mask is 1."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over mask; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_var(x, mask, dim=None, unbiased=True):
    """Variance of x over mask (Bessel-corrected if unbiased); 0 for fewer than two tokens."""
    mean = masked_mean(x, mask, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    sq_dev = masked_sum((x - mean) ** 2, mask, dim)
    return sq_dev / ((count - 1) if unbiased else count).clamp_min(1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the valid tokens only; padding stays 0. With shift_mean=False the
    mean is added back (only the scale is normalised). Under torchrun the mean and (Bessel-
    corrected) variance are those of every rank's tokens together, as in one process."""
    mask = mask.to(x.dtype)
    count, total = all_reduce(torch.stack([mask.sum(), masked_sum(x, mask)]))
    mean = total / count.clamp_min(1)
    var = all_reduce(masked_sum((x - mean) ** 2, mask)) / (count - 1).clamp_min(1)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


# --- aggregation ------------------------------------------------------------------------------


def aggregate_loss(per_token_loss, mask, mode="token-mean", normalizer=None):
    """Reduce a [B, T] loss to a scalar.

    token-mean: sum over valid tokens / normalizer (global token count of the step);
    seq-mean:   sum over sequences of each sequence's token-mean / normalizer (global number of
                sequences). normalizer=None uses this batch's own count (single-batch use).
    """
    if mode not in _LOSS_MODES:
        raise ValueError(f"mode must be one of {_LOSS_MODES}, got {mode!r}")
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


# --- policy ------------------------------------------------------------------------------------


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
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    picked = z.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits, temperature=1.0):
    """Per-position entropy [B, T] of softmax(logits / temperature):
    H = logsumexp(z) - sum softmax(z) z."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def token_logprobs_and_entropy(hidden, weight, targets, temperature=1.0, chunk_tokens=4096, with_entropy=True):
    """[B, T, 2]: log pi(y_t | s_t) and the entropy at each position, from the final hidden states
    [B, T, d] and the output embedding [V, d]: `response_logprobs` and `entropy_from_logits` of
    hidden @ weight.T, chunk_tokens positions at a time. Each chunk's float32 logits are reduced
    and dropped, and rebuilt in the backward pass (checkpoint): no [B T, V] tensor is ever held
    (at V = 152k, 8k tokens of float32 logits are 5 GB). Entropy is 0 unless with_entropy."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    flat_hidden, flat_targets = hidden.flatten(0, 1), targets.flatten()
    chunks = [
        torch.utils.checkpoint.checkpoint(_chunk_statistics, flat_hidden[i : i + chunk_tokens], weight,
                                          flat_targets[i : i + chunk_tokens], temperature, with_entropy,
                                          use_reentrant=False)
        for i in range(0, flat_hidden.shape[0], chunk_tokens)
    ]
    return torch.cat(chunks).view(*targets.shape, 2)


def _chunk_statistics(hidden, weight, targets, temperature, with_entropy):
    z = (hidden @ weight.T).float()  # the head's matmul in the model's dtype, as the logits are made
    if temperature != 1.0:
        z = z / temperature
    normalizer = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    entropy = normalizer - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else torch.zeros_like(logprobs)
    return torch.stack([logprobs, entropy], dim=-1)


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
    clip removes), pg_clipfrac_dual, ppo_kl (k3 estimate of KL(pi_old || pi); verl's name)."""
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


def kl_penalty(log_probs, ref_log_probs, kind="k3"):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020): k1 = log r, k2 = (log r)^2 / 2, k3 = (1/r - 1) + log r with r = pi/pi_ref.
    k3 is unbiased and non-negative. Off by default in VC-PPO (no KL term)."""
    if kind not in _KL_KINDS:
        raise ValueError(f"kind must be one of {_KL_KINDS}, got {kind!r}")
    log_r = log_probs - ref_log_probs
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(-log_r) - 1 + log_r


# --- critic ------------------------------------------------------------------------------------


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


def explained_variance(values, returns, mask):
    """1 - Var(R - V) / Var(R) over valid tokens (1 = perfect critic, 0 = no better than the
    mean). NaN when the returns are constant (Var(R) at rounding level), where it is undefined."""
    check_masked_inputs(mask, values=values, returns=returns)
    mask = mask.to(values.dtype)
    var_r = masked_var(returns, mask, unbiased=False)
    # A constant that is not a binary fraction (0.1) leaves a variance of order (eps * R)^2.
    if var_r <= 100 * torch.finfo(var_r.dtype).eps ** 2 * masked_mean(returns**2, mask):
        return torch.tensor(float("nan"), dtype=values.dtype, device=values.device)
    return 1 - masked_var(returns - values, mask, unbiased=False) / var_r


# --- one model's PPO epochs ----------------------------------------------------------------------


def update_model(cfg, model, optimizer, batch, per_token, loss_fn, seed, prefix):
    """PPO epochs over one rollout batch for one model (actor or critic).

    `cfg.ppo_epochs` passes; each pass is split into `cfg.num_minibatches` optimizer steps; each
    mini-batch is accumulated over micro-batches of `cfg.micro_batch_size` rows whose losses are
    normalised by the mini-batch's global token (or sequence) count, summed over ranks, so neither
    the micro-batch split nor the number of ranks changes the gradient (verl PR #6957).
    `loss_fn(model, micro_batch, micro_per_token, normalizer, cfg) -> (loss, metrics)`; `per_token`
    maps names to the [B, T] tensors the loss needs (old log-probs, advantages, returns, ...). Metrics named `*_loss` add up over micro-batches; the
    others are token means, each micro-batch weighted by its share of the mini-batch's tokens on
    all ranks; both are then summed over ranks: the whole batch's values, the same on every rank.
    Returns `<prefix>/<name>` means over the optimizer steps.
    """
    generator = torch.Generator().manual_seed(seed)
    totals, grad_norms = {}, []
    model.train()  # Hugging Face recomputes activations (--activation-checkpointing) in training mode only
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator).to(batch.device)  # CPU draws: same on any device
        for minibatch in order.chunk(cfg.num_minibatches):
            mask = batch.response_mask[minibatch]
            local = torch.stack([mask.sum(), mask.new_tensor(len(minibatch))]).double()
            tokens, sequences = all_reduce(local).tolist()
            normalizer = tokens if cfg.loss_agg == "token-mean" else sequences
            optimizer.zero_grad(set_to_none=True)
            for index, micro in batch.micro_batches(minibatch, cfg.micro_batch_size, cfg.micro_batch_tokens):
                width = micro.response_ids.shape[1]
                loss, metrics = loss_fn(model, micro, {k: v[index, :width] for k, v in per_token.items()},
                                        normalizer, cfg)
                loss.backward()
                share = micro.response_mask.sum().item() / max(tokens, 1.0)
                for name, value in metrics.items():
                    weight = 1.0 if name.endswith("_loss") else share
                    totals[name] = totals.get(name, 0.0) + weight * float(value)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if not math.isfinite(grad_norm):  # a global norm: every rank stops here together
                raise FloatingPointError(f"{prefix}: gradient norm is {grad_norm}")
            grad_norms.append(grad_norm)
            optimizer.step()
    model.eval()  # as loaded: the no-grad forwards and generation keep their KV cache
    totals = reduce_metrics(totals, sums=totals.keys()) | {"grad_norm": sum(grad_norms)}
    return {f"{prefix}/{name}": value / len(grad_norms) for name, value in totals.items()}


@torch.no_grad()
def micro_batched_forward(per_token_fn, batch, micro_batch_size, micro_batch_tokens=None):
    """per_token_fn(micro_batch) -> [b, width] (log-probs, values) for the whole rollout batch,
    without gradients, over the micro-batches `update_model` uses: memory is bounded by
    micro_batch_size rows (or micro_batch_tokens tokens), not by the rollout batch. Returns
    [B, T], 0 past each micro-batch's width (on padding)."""
    out = batch.response_mask.new_zeros(batch.response_mask.shape)
    every_row = torch.arange(len(batch), device=batch.device)
    for index, micro in batch.micro_batches(every_row, micro_batch_size, micro_batch_tokens):
        out[index, : micro.response_ids.shape[1]] = per_token_fn(micro)
    return out
