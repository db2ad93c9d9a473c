"""The critic (and the outcome reward model): a causal-LM backbone with a scalar head (paper §2, §3.1).

Both are a Hugging Face `AutoModelForTokenClassification` with one label and no dropout, so they
save and load in Hugging Face format like any other checkpoint. The two differ only in how they
are trained and read:
- the outcome reward model (`reward.py`) is trained on the output at the last token (EOS) only;
- the critic reads V(s_t) at the position whose next token is response token t (DESIGN.md).
Plain PPO initialises the critic from the reward model, whose prefix values are out of
distribution (§3.1); VC-PPO initialises it from pi_SFT with a fresh head, then pretrains it (§3.2).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForTokenClassification

from fsdp_utils import copy_local_rows, load_pretrained, reduce_metrics
from rollout import RolloutBatch


def load_value_model(path: str, head_init_std: float | None = None, seed: int = 0, device=None, **shard_options):
    """A backbone + scalar head from `path`, in fp32 (`fsdp_utils.load_pretrained`: sharded by
    `shard_model(model, **shard_options)` under torchrun, without a whole model on any rank).

    If `path` holds a value model (critic or reward model), its head is loaded as saved.
    If it holds a causal LM (pi_SFT), the head is new: weights ~ N(0, head_init_std) drawn from
    `seed` (the same head on every rank and at every world size), bias 0, so the critic starts
    near V = 0 rather than from Hugging Face's default initialisation.
    """
    config = AutoConfig.from_pretrained(path)
    has_head = any("TokenClassification" in a for a in (config.architectures or []))
    config.num_labels = 1
    config.classifier_dropout = 0.0  # a regression head; dropout would only add noise to V
    head = ("score.weight", "score.bias")
    model = load_pretrained(AutoModelForTokenClassification, path, config, fresh=() if has_head else head,
                            device=device, **shard_options)
    if not has_head or head_init_std is not None:
        std = 0.02 if head_init_std is None else head_init_std
        weight = torch.empty(model.score.weight.shape).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
        copy_local_rows(model.score.weight, weight)
        copy_local_rows(model.score.bias, torch.zeros(model.score.bias.shape))
    return model


def value_outputs(model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Scalar output at every position: [B, S] float32."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.logits.squeeze(-1).float()


def response_values(model, batch: RolloutBatch) -> torch.Tensor:
    """values[b, t] = V(s_t) for every response token, exactly 0 on padding: [B, T]."""
    values = batch.response_slice(value_outputs(model, **batch.model_inputs()))
    return values * batch.response_mask


def assert_finite(named_tensors, what: str) -> None:
    """Stop with a clear message, naming the first bad tensor, when any of (name, tensor) holds
    NaN or inf: a diverged model's parameters or outputs. Under torchrun every rank stops (a rank
    sees only its shards, and one rank leaving alone would hang the others)."""
    local = [(n, t.to_local() if isinstance(t, DTensor) else t) for n, t in named_tensors]
    bad = [n for n, t in local if not torch.isfinite(t.detach()).all()]
    if reduce_metrics({"bad": len(bad)}, sums=("bad",))["bad"] > 0:
        raise FloatingPointError(f"{what}: {bad[0] if bad else 'a tensor on another rank'} holds NaN or inf")
