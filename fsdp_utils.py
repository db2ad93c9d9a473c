"""Distributed plumbing: process groups, FSDP2 sharding, distributed checkpoints.

One process is the ordinary case: without torchrun's environment nothing is initialised, every
collective below is the identity, and checkpoints are written by the same
torch.distributed.checkpoint (DCP) code that writes sharded ones under torchrun.
"""

from __future__ import annotations

import os
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# DCP warns on every save/load in a single process; that is this project's everyday case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join torchrun's process group (nccl on GPU, gloo on CPU), or run as the single process."""
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place); identity in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def save_checkpoint(path: str, models: dict, optimizers: dict, extra: dict) -> None:
    """Models + optimizers (sharded or not) + plain extras (step, RNG, config) into `path`.

    Written to `path.tmp` and renamed, so a run killed while saving keeps the previous checkpoint.
    """
    state = {}
    for name, model in models.items():
        model_sd, optim_sd = get_state_dict(model, optimizers[name])
        state[name] = {"model": model_sd, "optim": optim_sd}
    tmp = path + ".tmp"
    dcp.save(state, checkpoint_id=tmp)
    if _rank() == 0:
        torch.save(extra, os.path.join(tmp, "extra.pt"))
        if os.path.exists(path):
            os.replace(path, path + ".old")
        os.replace(tmp, path)
        shutil.rmtree(path + ".old", ignore_errors=True)
    _barrier()


def load_checkpoint(path: str, models: dict, optimizers: dict) -> dict:
    """Restore what `save_checkpoint` wrote, in place; returns the extras."""
    state = {}
    for name, model in models.items():
        model_sd, optim_sd = get_state_dict(model, optimizers[name])
        state[name] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    for name, model in models.items():
        set_state_dict(
            model,
            optimizers[name],
            model_state_dict=state[name]["model"],
            optim_state_dict=state[name]["optim"],
        )
    return torch.load(os.path.join(path, "extra.pt"), weights_only=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
