"""Distributed plumbing: process groups, collectives and FSDP2 sharding.

One process is the ordinary case. On the CPU, without torchrun's environment, nothing is
initialised and every collective below is the identity. On a GPU one process joins a process group
of one rank, as `torchrun --nproc_per_node 1` would start it, so that a single GPU trains through
FSDP2 with the same bf16 mixed precision and activation checkpointing as many. Weights in and out of
the shards (Hugging Face checkpoints, DCP checkpoints, the stream to vLLM) are checkpoints.py's.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device


# Set by init_distributed when the process group is gloo's, whose threads outlive it (exit_now_if_gloo).
_gloo_threads = False
# A gloo group of every rank whose waits have no practical time limit (wait_patiently); init_distributed makes it.
_patient_group = None
PATIENT_TIMEOUT = timedelta(days=7)


def init_distributed(cpu_collectives: bool = False) -> DistInfo:
    """Join torchrun's process group (nccl on GPU, gloo on CPU). Without torchrun: on a GPU, a
    group of this one process (`launch_as_one_rank`); on the CPU, the single process, no group.
    cpu_collectives (--cpu-offload): on GPUs, gloo too for tensors on the CPU, such as the partial
    gradient norms of offloaded shards that clip_grad_norm_ all-reduces (NCCL has no CPU backend).
    On a GPU it also keeps cuDNN out of the process's SDPA (`attention_without_cudnn`)."""
    global _gloo_threads, _patient_group
    if "RANK" not in os.environ and torch.cuda.is_available():
        launch_as_one_rank()
    if "RANK" not in os.environ:
        return DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        attention_without_cudnn()
        device, backend = torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    _gloo_threads = "gloo" in dist.get_backend()  # cpu:gloo,cuda:nccl (--cpu-offload) runs gloo too
    if _patient_group is None:  # made by every rank at the same point, as new_group must be
        _patient_group = dist.new_group(backend="gloo", timeout=PATIENT_TIMEOUT)
    return DistInfo(dist.get_rank(), dist.get_world_size(), device)


def attention_without_cudnn() -> None:
    """Keep cuDNN out of this process's SDPA (FlashAttention, memory-efficient or math serve it).
    cuDNN builds a plan on the host for each new shape, and a run's shapes are new at every
    micro-batch and decoding step: on an H200 that cost more than it saved (README, "What was
    tested where")."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def launch_as_one_rank() -> None:
    """Give this process the environment `torchrun --nproc_per_node 1` gives its rank (rank 0 of
    1, a free local port for the rendezvous): init_distributed then takes the torchrun path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def check_gpu_options(mixed_precision: bool, cpu_offload: bool) -> None:
    """FSDP2's bf16 mixed precision and CPU offload are GPU options: on a machine without one,
    raise ValueError naming the flag rather than train in fp32 as if it had been honoured."""
    if torch.cuda.is_available():
        return
    for flag, on in (("--mixed-precision", mixed_precision), ("--cpu-offload", cpu_offload)):
        if on:
            raise ValueError(f"{flag} needs a GPU (an FSDP2 option on CUDA); this machine has none: pass "
                             f"--no-{flag[2:]} (the qwen2.5 presets set it; the CPU trains in fp32 with the "
                             f"parameters in memory)")


def distributed() -> bool:
    """Whether this process trains as a rank of a process group: torchrun's, or a GPU's group of
    one (`init_distributed`). Not in one CPU process, even once vLLM has started a group of one
    there: that group is its engine's (vLLM closes it), and the trainer's models stay unsharded."""
    return "RANK" in os.environ and dist.is_initialized()


def close_distributed() -> None:
    """Leave torchrun's process group once every rank is done (a no-op in one process): a rank
    that exits with the group still up can abort while the others still talk to it."""
    global _patient_group
    if distributed():
        barrier()
        dist.destroy_process_group()
        _patient_group = None


def exit_now_if_gloo(status: int = 0) -> None:
    """After close_distributed, in a process that ran gloo collectives (torchrun on CPU): exit with
    `status` at once, skipping interpreter shutdown; elsewhere return. Gloo's worker threads outlive
    destroy_process_group and may still be dropping the last collective's tensors, which takes the
    GIL; a thread that asks for it once shutdown has begun exits (Python < 3.14) through a C++
    noexcept destructor, and the rank, its work all saved, aborts with "terminate called without an
    active exception" (CPython gh-87135; PyTorch PR #179291, not merged). Call it once everything
    is written and closed: atexit handlers do not run. Not where vLLM ran: its CPU shared-memory
    segments go at a normal exit only, and one left behind fails the next engine (errno 17)."""
    if _gloo_threads and "vllm" not in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def all_reduce(value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or `op`) over ranks, in place; identity in a single process. NCCL reduces GPU tensors
    only: a CPU tensor (vLLM's rollout masks, metrics) goes through this rank's GPU and back."""
    if world_size() > 1:
        on_wire = value
        if dist.get_backend() == "nccl" and value.device.type != "cuda":
            on_wire = value.to(local_device())
        dist.all_reduce(on_wire, op=op)
        if on_wire is not value:
            value.copy_(on_wire)
    return value


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any: a decision that every rank must take alike (to
    save and stop, to build a stage or reuse it) made once all have looked; `flag` itself in one process."""
    return bool(all_reduce(torch.tensor([float(flag)]), op=dist.ReduceOp.MAX).item())


def from_main(obj):
    """Rank 0's `obj` (picklable) on every rank; `obj` itself in one process."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_metrics(metrics: dict, sums=(), maxes=(), tokens: dict | None = None) -> dict:
    """The whole step's metrics from each rank's share: keys in `sums` add up over ranks (counts),
    keys in `maxes` take the largest, keys in `tokens` are means over tokens[key] tokens
    of this rank and become the mean over every rank's tokens (NaN when there are none), every other
    key is averaged (exact for means over rows: each rank holds as many rows, config.validate). Every
    rank gets the same numbers, so decisions taken on them (stop, raise) agree."""
    tokens = tokens or {}
    if world_size() == 1:
        return {k: math.nan if k in tokens and not tokens[k] else v for k, v in metrics.items()}
    weighted = {k: metrics[k] * n if n else 0.0 for k, n in tokens.items()}  # a NaN over no tokens weighs nothing
    keys = sorted(metrics)  # the same order on every rank
    values = torch.tensor([float(weighted.get(k, metrics[k])) for k in keys] + [float(tokens.get(k, 0)) for k in keys],
                          dtype=torch.float64)
    is_max = torch.tensor([k in maxes for k in keys] * 2)
    summed = all_reduce(torch.where(is_max, 0.0, values))
    largest = all_reduce(torch.where(is_max, values, -torch.inf), op=dist.ReduceOp.MAX)
    count = summed[len(keys):]

    def reduced(i: int, k: str) -> float:
        if k in tokens:
            return (summed[i] / count[i]).item() if count[i] else math.nan
        return (largest[i] if k in maxes else summed[i] if k in sums else summed[i] / world_size()).item()

    return {k: reduced(i, k) for i, k in enumerate(keys)}


def shard_model(
    model: torch.nn.Module,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    checkpoint_fraction: float = 1.0,
    compile_layers: bool = False,
) -> torch.nn.Module:
    """FSDP2: `fully_shard` each decoder layer, then the root (embeddings, final norm, head).

    Works for the actor (`Qwen2ForCausalLM`) and the critic (`AutoModelForTokenClassification`):
    the decoder layers are the classes the model lists in `_no_split_modules`.
    Gradients are SUMMED over ranks, not averaged: a loss normalised by the global token count
    (`all_reduce` of the local counts) then gives exactly the single-process gradient.
    mixed_precision (bf16 compute, fp32 sharded parameters and reduction) and cpu_offload are GPU
    options: without a GPU they raise ValueError (check_gpu_options). Under torchrun pass the
    model on the meta device (`checkpoints.load_pretrained` then gives each rank memory for its shards only), or
    on CPU: FSDP2 moves each layer to the GPU as it shards it, so a large model never sits
    whole on one GPU (offloaded shards go back to CPU).
    checkpoint_fraction < 1 recomputes only that share of the layers (spread evenly): less
    recompute for more memory. compile_layers: torch.compile each decoder layer, in place (the
    parameter names stay), before it is sharded.
    Without a process group (one process on the CPU) the model comes back unsharded, where it
    was, with activation checkpointing and compilation set if asked.
    """
    check_gpu_options(mixed_precision, cpu_offload)
    if not 0 < checkpoint_fraction <= 1:
        raise ValueError(f"checkpoint_fraction must be in (0, 1], got {checkpoint_fraction}")
    layers = _decoder_layers(model) if distributed() or compile_layers or checkpoint_fraction < 1 else []
    if activation_checkpointing:
        # Hugging Face's per-layer checkpointing keeps parameter names as they are; torch's
        # checkpoint_wrapper would prefix them, and vLLM and exports need Hugging Face names.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        count = max(1, round(checkpoint_fraction * len(layers)))
        recomputed = {j * len(layers) // count for j in range(count)}  # evenly spread
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i in recomputed
    if compile_layers:
        for layer in layers:
            layer.compile()
    if not distributed():
        return model
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    options: dict = {"mesh": init_device_mesh(device_type, (dist.get_world_size(),))}
    if mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **options)
    # The root too reshards after forward (FSDP2 keeps its parameters gathered by default): after
    # a no-grad forward (generate, evaluation, old log-probs) the module would otherwise hold
    # plain unsharded tensors, and an optimizer built then would train copies (embeddings, tied
    # head, final norm) that the next backward never reaches.
    fully_shard(model, reshard_after_forward=True, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the classes the model lists in `_no_split_modules`."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"shard_model: no decoder layers found in {type(model).__name__}")
    return layers


def shard_options(cfg) -> dict:
    """`shard_model`'s settings from a run's config."""
    return {"mixed_precision": cfg.mixed_precision, "activation_checkpointing": cfg.activation_checkpointing,
            "cpu_offload": cfg.cpu_offload, "checkpoint_fraction": cfg.checkpoint_fraction,
            "compile_layers": cfg.compile_layers}


def rank() -> int:
    """This process's rank under torchrun; 0 in one process."""
    return dist.get_rank() if distributed() else 0


def is_main() -> bool:
    """Rank 0 (the one process without torchrun): the rank that writes shared files and prints."""
    return rank() == 0


def world_size() -> int:
    """torchrun's number of ranks; 1 in one process."""
    return dist.get_world_size() if distributed() else 1


def local_device() -> torch.device:
    """This rank's GPU (the one init_distributed selected), or the CPU where there is none."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def wait_patiently() -> None:
    """`barrier` where ranks wait for one that works on alone, for long, through a gloo group without
    the process group's time limit (30 min on gloo, 10 on NCCL), which ended such a wait with a
    timeout on every other rank: rank 0 training the built-in task's pi_SFT (`rundir.build_once`),
    20-30 min for the long task's on all of a CPU's cores, longer on its share of them under torchrun;
    a rank grading responses that math-verify cannot finish (`sampling.Sampler`: --grader-timeout-s
    each, 512 rows a rank and 2 workers at 32B: up to 20 min and more). A rank that fails still ends
    it at once: its connections close, and torchrun stops the rest."""
    if distributed():
        dist.barrier(group=_patient_group)


def barrier() -> None:
    """Wait for every rank (a no-op in one process). Under NCCL on this rank's GPU, named rather than
    guessed from the global rank. (Not by binding it at init_process_group's device_id: then every
    later new_group is an NCCL split that ranks outside a gloo subgroup join alone, pytorch#145376.)"""
    if distributed():
        nccl = torch.cuda.is_available() and "nccl" in dist.get_backend()
        dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)
