"""Algorithm 1's PPO epochs on one model, actor or critic, sharded or not: mini-batches, micro-batches
whose losses are normalised by the global token count (so neither the split nor the number of
ranks changes the gradient), the no-grad forward over the same micro-batches, and the two
statistics of a step taken over every rank (advantage whitening, the finiteness check)."""

import math

import torch
from torch.distributed.tensor import DTensor

from fsdp_utils import all_reduce, reduce_metrics
from support.masked import check_masked_inputs, masked_sum


def masked_whiten(x, mask, eps=1e-8):
    """(x - mean) / std over the valid tokens only; padding stays 0. Under torchrun the mean and
    (Bessel-corrected) variance are those of every rank's tokens together, as in one process."""
    check_masked_inputs(mask, contents=False, x=x)
    mask = mask.to(x.dtype)
    count, total = all_reduce(torch.stack([mask.sum(), masked_sum(x, mask)]))
    mean = total / count.clamp_min(1)
    var = all_reduce(masked_sum((x - mean) ** 2, mask)) / (count - 1).clamp_min(1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def assert_finite(named_tensors, what: str) -> None:
    """FloatingPointError naming the first bad tensor when any of (name, tensor) holds NaN or inf:
    a diverged model's parameters or outputs. Under torchrun every rank raises (a rank sees only its
    shards, and one rank leaving alone would hang the others)."""
    local = [(n, t.to_local() if isinstance(t, DTensor) else t) for n, t in named_tensors]
    bad = [n for n, t in local if not torch.isfinite(t.detach()).all()]
    if reduce_metrics({"bad": len(bad)}, sums=("bad",))["bad"] > 0:
        raise FloatingPointError(f"{what}: {bad[0] if bad else 'a tensor on another rank'} holds NaN or inf")


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
    # Freed now, not at the next step's first mini-batch: the other model's update, the rollout and
    # vLLM's KV cache would otherwise share the GPU with this model's gradients (memory_plan counts none).
    optimizer.zero_grad(set_to_none=True)
    model.eval()  # as loaded, for the no-grad forwards and the generation that follow
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
