"""One process without torchrun, on the path one GPU takes (tests/test_distributed.py): it joins a
process group of its one rank (fsdp_utils.launch_as_one_rank; gloo here, nccl on a GPU) and
train.load_actor (checkpoints.load_pretrained) wraps the actor in FSDP2. The PPO actor update of that model, with and without
activation checkpointing, against the same update of the plain model before the group existed.
Writes rank0.json into argv[1]."""

import sys

import torch
from torch.distributed.tensor import DTensor

from support import checkpoints
import fsdp_utils
import train
from common import PROMPTS, tiny_actor, write_result
from support.config import Config
from ppo_update import update_model
from rollout import HFRollout

out_dir = sys.argv[1]
torch.set_num_threads(1)
tokenizer, _ = tiny_actor()
cfg = Config(num_minibatches=2, micro_batch_size=1, prompts_per_step=4, samples_per_prompt=1)
batch = HFRollout(tiny_actor()[1], tokenizer).generate([tokenizer(p).input_ids for p in PROMPTS[:4]], 8, seed=0)
advantages = torch.randn(batch.logprobs.shape, generator=torch.Generator().manual_seed(0)) * batch.response_mask
rows = {"old_logprobs": batch.logprobs, "advantages": advantages}


def update(model):
    """Two AdamW steps of the actor; its metrics and full weights after them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = update_model(cfg, model, optimizer, batch, rows, train.actor_loss, seed=0, prefix="actor")
    return metrics, {n: t.clone() for bucket in checkpoints.iter_full_weights(model) for n, t in bucket}


plain_metrics, plain_weights = update(tiny_actor()[1])
grouped_before = torch.distributed.is_initialized()
fsdp_utils.launch_as_one_rank()
info = fsdp_utils.init_distributed()
result = {"grouped_before": grouped_before, "world_size": info.world_size, "backend": torch.distributed.get_backend()}
checkpoint = f"{out_dir}/actor"
tiny_actor()[1].save_pretrained(checkpoint)
for checkpointing in (False, True):
    model = train.load_actor(Config(activation_checkpointing=checkpointing), checkpoint, info)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    metrics, weights = update(model)
    result[f"checkpointing={checkpointing}"] = {
        "sharded": sharded,
        "weight_max_diff": max((weights[n] - plain_weights[n]).abs().max().item() for n in plain_weights),
        "metric_max_diff": max(abs(metrics[k] - plain_metrics[k]) for k in plain_metrics),
    }
result["weight_change"] = max((plain_weights[n] - w).abs().max().item()
                              for n, w in tiny_actor()[1].state_dict().items() if n in plain_weights)
write_result(out_dir, 0, result)
fsdp_utils.close_distributed()
fsdp_utils.exit_now_if_gloo()
