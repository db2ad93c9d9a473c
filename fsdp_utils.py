"""Distributed plumbing: process groups, FSDP2 sharding, distributed checkpoints, full weights.

One process is the ordinary case. On the CPU, without torchrun's environment, nothing is
initialised, every collective below is the identity, and checkpoints are written by the same
torch.distributed.checkpoint (DCP) code that writes sharded ones under torchrun. On a GPU one
process joins a process group of one rank, as `torchrun --nproc_per_node 1` would start it, so
that a single GPU trains through FSDP2 with the same bf16 mixed precision and activation
checkpointing as many.

Hugging Face checkpoints enter the trainer sharded (`load_pretrained`): under torchrun the model is
built on the meta device, `fully_shard`ed, and each rank reads only its own rows of each tensor
from the safetensors files, so no rank ever holds a whole model (torchtitan and verl load the same
way); one process loads with `from_pretrained`, as anyone would.

Full (unsharded) weights leave the trainer in two ways, both streamed one bounded bucket at a
time so no rank ever holds the whole model (TRL #7131): into the vLLM engine after each update
(`iter_full_weights`, used by `rollout.VLLMRollout.sync_weights`) and into a Hugging Face
checkpoint (`export_hf_checkpoint`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

# DCP warns on every save/load in a single process; that is this project's everyday case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


# Set by init_distributed when the process group is gloo's, whose threads outlive it (exit_now_if_gloo).
_gloo_threads = False


def init_distributed() -> DistInfo:
    """Join torchrun's process group (nccl on GPU, gloo on CPU). Without torchrun: on a GPU, a
    group of this one process (`launch_as_one_rank`); on the CPU, the single process, no group."""
    global _gloo_threads
    if "RANK" not in os.environ and torch.cuda.is_available():
        launch_as_one_rank()
    if "RANK" not in os.environ:
        return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    _gloo_threads = dist.get_backend() == "gloo"
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


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
            raise ValueError(f"{flag} needs a GPU (an FSDP2 option on CUDA); this machine has none: "
                             f"drop the flag (the CPU trains in fp32 with the parameters in memory)")


def close_distributed() -> None:
    """Leave torchrun's process group once every rank is done (a no-op in one process): a rank
    that exits with the group still up can abort while the others still talk to it."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def exit_now_if_gloo() -> None:
    """After close_distributed, in a process that ran gloo collectives (torchrun on CPU): exit with
    status 0 at once, skipping interpreter shutdown; elsewhere return. Gloo's worker threads outlive
    destroy_process_group and may still be dropping the last collective's tensors, which takes the
    GIL; a thread that asks for it once shutdown has begun exits (Python < 3.14) through a C++
    noexcept destructor, and the rank, its work all saved, aborts with "terminate called without an
    active exception" (CPython gh-87135; PyTorch PR #179291, not merged). Call it once everything
    is written and closed: atexit handlers do not run. Not where vLLM ran: its CPU shared-memory
    segments go at a normal exit only, and one left behind fails the next engine (errno 17)."""
    if _gloo_threads and "vllm" not in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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


def reduce_metrics(metrics: dict, sums=(), maxes=()) -> dict:
    """The whole step's metrics from each rank's share: keys in `sums` add up over ranks (counts,
    throughput), keys in `maxes` take the largest, every other key is averaged. The average is exact
    for means over rows (each rank holds as many rows, config.validate); token-weighted means
    (advantage, values, explained variance) become the mean of the ranks' values. Every rank gets
    the same numbers, so decisions taken on them (stop, raise) agree. Identity in one process."""
    if world_size() == 1:
        return dict(metrics)
    keys = sorted(metrics)  # the same order on every rank
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    is_max = torch.tensor([k in maxes for k in keys])
    summed = all_reduce(torch.where(is_max, 0.0, values))
    largest = all_reduce(torch.where(is_max, values, -torch.inf), op=dist.ReduceOp.MAX)
    return {k: (largest[i] if k in maxes else summed[i] if k in sums else summed[i] / world_size()).item()
            for i, k in enumerate(keys)}


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
    model on the meta device (`load_pretrained` then gives each rank memory for its shards only), or
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
    layers = _decoder_layers(model) if dist.is_initialized() or compile_layers or checkpoint_fraction < 1 else []
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
    if not dist.is_initialized():
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


# Each rank reads its rows of a tensor at most this many bytes at a time: with the bf16 or fp32
# copy in flight and the file pages it maps, loading adds about twice this to the rank's shards.
READ_BYTES = 64 << 20


def load_pretrained(model_class, path: str, config=None, fresh=(), device=None, **shard_options):
    """`model_class.from_pretrained(path)` in fp32; sharded by `shard_model(model, **shard_options)`
    under torchrun.

    One process: `from_pretrained`, moved to `device` if given, then `shard_model` (FSDP2 over a
    group of one rank on a GPU, see `init_distributed`; unsharded on the CPU). Under torchrun: the model is built
    from its config on the meta device (no memory), sharded, given memory for this rank's shards
    only (on its GPU, or on CPU with cpu_offload), and filled from the checkpoint's safetensors
    files, each rank reading only its rows of each tensor, READ_BYTES at a time. bf16 checkpoints
    widen to fp32 exactly; a tied head stays the embedding (one parameter, read once). Names in
    `fresh` (a new value head) may be absent from the checkpoint and are left for the caller to
    initialise, on every rank alike; any other absent tensor is an error.
    """
    if world_size() == 1:
        with _load_report_held_back():  # its table is checked here instead, as the sharded path checks
            model, loaded = model_class.from_pretrained(path, config=config, dtype=torch.float32,
                                                        output_loading_info=True)
        problems = [f"no tensor {name} in the checkpoint" for name in sorted(set(loaded["missing_keys"]) - set(fresh))]
        problems += [f"{mismatch} has the wrong shape" for mismatch in loaded["mismatched_keys"]]
        if problems:
            raise CheckpointError(f"{path}: {'; '.join(problems)} (a {model_class.__name__} needs them)")
        # FSDP2 over a one-rank group on a GPU; on the CPU, the same model with the checkpointing asked for
        return shard_model(model if device is None else model.to(device), **shard_options)
    from tqdm import tqdm
    from transformers import AutoConfig, GenerationConfig

    config = config if config is not None else AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=torch.float32)
    model = shard_model(model, **shard_options)
    offloaded = shard_options.get("cpu_offload") and torch.cuda.is_available()
    model.to_empty(device="cpu" if offloaded else local_device())
    # Buffers outside the state dict (the rotary inverse frequencies) came out of to_empty as
    # garbage: recompute them as from_pretrained does, with the model's own initialiser.
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)
    weights = _safetensors_index(path)
    saved = model.state_dict().keys()  # parameters (a tied one under both names) and persistent buffers
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tqdm(tensors, desc=f"loading {os.path.basename(path)} (shards)", leave=False,
                             disable=rank() != 0, dynamic_ncols=True):
        if name not in saved:
            continue
        if name in weights:
            _read_local_rows(tensor, weights[name], name)
        elif name not in fresh:
            raise CheckpointError(f"{path}: no tensor {name} in the checkpoint (a {type(model).__name__} "
                                  f"needs it)")
    model.eval()  # as from_pretrained leaves it
    if model.can_generate() and os.path.exists(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


@contextlib.contextmanager
def _load_report_held_back():
    """transformers logs a warning table ("... LOAD REPORT ...") for every tensor missing from a
    checkpoint, a fresh value head included; during the block it is dropped."""
    logger = logging.getLogger("transformers.modeling_utils")
    drop = lambda record: "LOAD REPORT" not in record.getMessage()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def shard_options(cfg) -> dict:
    """`shard_model`'s settings from a run's config."""
    return {"mixed_precision": cfg.mixed_precision, "activation_checkpointing": cfg.activation_checkpointing,
            "cpu_offload": cfg.cpu_offload, "checkpoint_fraction": cfg.checkpoint_fraction,
            "compile_layers": cfg.compile_layers}


def copy_local_rows(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's rows of `full` into `tensor` (an FSDP2 parameter or a plain tensor)."""
    local, rows = _local_rows(tensor)
    with torch.no_grad():
        local.copy_(full[rows] if full.dim() else full)


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """This rank's part of `tensor` and the rows of the full tensor it holds. FSDP2 shards dim 0
    in torch.chunk's pieces: ceil(n / world) rows per rank, fewer (or none) on the last ones."""
    if not isinstance(tensor, DTensor):
        return tensor, slice(0, tensor.shape[0] if tensor.dim() else 1)
    if tensor.device_mesh.ndim != 1 or tensor.placements != (Shard(0),):
        raise ValueError(f"expected FSDP2's Shard(0) on a 1-D mesh, got {tensor.placements}")
    n, ranks = tensor.shape[0], tensor.device_mesh.size()
    start = min(tensor.device_mesh.get_local_rank() * -(-n // ranks), n)
    local = tensor.to_local()
    return local, slice(start, start + local.shape[0])


def _read_local_rows(tensor: torch.Tensor, file: str, name: str) -> None:
    """This rank's rows of `name` from a safetensors file into `tensor`, READ_BYTES at a time.
    Each read opens the file anew: the pages it maps are released with it."""
    local, rows = _local_rows(tensor)
    with safe_open(file, framework="pt") as f:
        shape = tuple(f.get_slice(name).get_shape())
    if shape != tuple(tensor.shape):
        raise CheckpointError(f"{file}: {name} has shape {shape}, the model wants {tuple(tensor.shape)}")
    with torch.no_grad():
        if not shape:
            with safe_open(file, framework="pt") as f:
                local.copy_(f.get_tensor(name))
            return
        row_bytes = max(math.prod(shape[1:]) * tensor.element_size(), 1)
        step = max(READ_BYTES // row_bytes, 1)
        for start in range(rows.start, rows.stop, step):
            stop = min(start + step, rows.stop)
            with safe_open(file, framework="pt") as f:
                local[start - rows.start : stop - rows.start].copy_(f.get_slice(name)[start:stop])


def _safetensors_index(path: str) -> dict[str, str]:
    """{tensor name: file} of the Hugging Face checkpoint at `path` (one file or an index)."""
    index, single = os.path.join(path, "model.safetensors.index.json"), os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            return {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
    if os.path.exists(single):
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json (under torchrun the "
                          f"checkpoint is read as safetensors, each rank its own rows)")


def save_checkpoint(path: str, models: dict, optimizers: dict, extra: dict) -> None:
    """Models + optimizers (sharded or not) + plain extras (step, RNG, config) into `path`.

    Written to `path.tmp` and renamed, so a run killed while saving keeps the previous checkpoint
    (`latest_checkpoint` finds it, whichever step the kill came at).
    """
    state = {}
    for name, model in models.items():
        model_sd, optim_sd = get_state_dict(model, optimizers[name])
        state[name] = {"model": model_sd, "optim": optim_sd}
    tmp = path + ".tmp"
    if is_main():  # a complete tmp left by a killed save must not mix with this one's files
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    dcp.save(state, checkpoint_id=tmp)
    if is_main():
        torch.save(extra, os.path.join(tmp, "extra.pt"))
        if os.path.exists(path):
            shutil.rmtree(path + ".old", ignore_errors=True)  # half deleted by a kill: path is newer
            os.replace(path, path + ".old")
        os.replace(tmp, path)
        shutil.rmtree(path + ".old", ignore_errors=True)
    barrier()


def remove_checkpoint(path: str) -> None:
    """Delete what `save_checkpoint(path, ...)` left, a killed save's leftovers included (rank 0)."""
    if is_main():
        for leftover in (path, path + ".tmp", path + ".old"):
            shutil.rmtree(leftover, ignore_errors=True)


def latest_checkpoint(path: str) -> str | None:
    """The newest complete checkpoint that `save_checkpoint(path, ...)` left, or None. A save
    killed between its two renames leaves no `path`, the new one at `path.tmp` (complete once
    extra.pt, written last, is there) and the previous one at `path.old`."""
    for candidate in (path, path + ".tmp", path + ".old"):
        if os.path.exists(os.path.join(candidate, "extra.pt")):
            return candidate
    return None


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored (truncated, or written by another configuration), or a
    Hugging Face checkpoint that cannot be loaded into the model's shards."""


def checkpoint_extra(path: str) -> dict:
    """The plain extras (step, ...) of a checkpoint that `save_checkpoint` wrote, nothing restored."""
    try:
        return torch.load(os.path.join(path, "extra.pt"), weights_only=False)
    except Exception as err:  # a truncated or foreign file
        raise CheckpointError(f"cannot read {path}/extra.pt ({type(err).__name__}: {err})") from None


def load_checkpoint(path: str, models: dict, optimizers: dict) -> dict:
    """Restore what `save_checkpoint` wrote, in place; returns the extras."""
    state = {}
    for name, model in models.items():
        model_sd, optim_sd = get_state_dict(model, optimizers[name])
        state[name] = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=path)
        extra = torch.load(os.path.join(path, "extra.pt"), weights_only=False)
    except (Exception, dcp.api.CheckpointException) as err:  # DCP's is a BaseException
        cause = (str(err).strip().splitlines() or [""])[-1][:200]  # DCP puts each rank's traceback in it
        raise CheckpointError(f"cannot resume from {path} ({type(err).__name__}: {cause})") from None
    for name, model in models.items():
        set_state_dict(
            model,
            optimizers[name],
            model_state_dict=state[name]["model"],
            optim_state_dict=state[name]["optim"],
        )
    return extra


def iter_full_weights(
    model: torch.nn.Module, bucket_bytes: int = 1 << 30, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full weights under their Hugging Face names, one bucket of about `bucket_bytes` at a time.

    Sharded tensors are gathered one by one (`full_tensor()`, a collective: every rank must
    iterate to the end); a bucket is released when the caller moves on, so the peak is one bucket
    plus one tensor. Unsharded models yield their own tensors (detached, no copy unless `dtype`).
    """
    state = model.state_dict()
    for names in _bucket_plan(model, state, bucket_bytes, dtype):
        bucket = []
        for name in names:
            tensor = state[name]
            if isinstance(tensor, DTensor):
                if tensor.device.type != tensor.device_mesh.device_type:  # CPU-offloaded shard
                    tensor = tensor.to(tensor.device_mesh.device_type)
                tensor = tensor.full_tensor()
            tensor = tensor.detach()
            bucket.append((name, tensor if dtype is None else tensor.to(dtype)))
        yield bucket


def export_hf_checkpoint(
    model: torch.nn.Module,
    tokenizer,
    path: str,
    shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
) -> None:
    """A Hugging Face checkpoint (config, safetensors shards + index, tokenizer) in `path`.

    Collective under torchrun. Rank 0 writes each shard as soon as its tensors are gathered, so
    memory stays at one shard. Tied weights are written once, as `save_pretrained` does. Written
    to `path.tmp` and renamed, so a stale shard of an earlier export never survives.
    """
    state = model.state_dict()
    plan = _bucket_plan(model, state, shard_bytes, dtype)
    files = (
        ["model.safetensors"]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    tmp = path + ".tmp"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        config = copy.deepcopy(model.config)
        config.dtype = dtype or next(iter(state.values())).dtype
        # What save_pretrained records: loaders tell a critic (scalar head) from a causal LM by it.
        config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard renames
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    weight_map, total = {}, 0
    for file, bucket in zip(files, iter_full_weights(model, shard_bytes, dtype)):
        if is_main():
            tensors = {name: t.cpu().contiguous() for name, t in bucket}
            save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        del bucket
    if is_main():
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    barrier()


def _bucket_plan(model, state: dict, bucket_bytes: int, dtype) -> list[list[str]]:
    """State-dict names grouped into buckets from their global shapes (no communication).

    Each tensor appears once: a tied head (lm_head = embedding) is skipped under its second name,
    and non-persistent buffers (rotary tables) are not in the state dict at all.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    plan, bucket, size = [], [], 0
    for name, tensor in state.items():
        if name not in own:
            continue
        bucket.append(name)
        size += tensor.numel() * (dtype or tensor.dtype).itemsize
        if size >= bucket_bytes:
            plan, bucket, size = plan + [bucket], [], 0
    return plan + [bucket] if bucket else plan


def rank() -> int:
    """This process's rank under torchrun; 0 in one process."""
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0 (the one process without torchrun): the rank that writes shared files and prints."""
    return rank() == 0


def world_size() -> int:
    """torchrun's number of ranks; 1 in one process."""
    return dist.get_world_size() if dist.is_initialized() else 1


def local_device() -> torch.device:
    """This rank's GPU (the one init_distributed selected), or the CPU where there is none."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()
