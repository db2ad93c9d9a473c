"""Checkpoints in and out of the sharded trainer: Hugging Face checkpoints loaded into FSDP2
shards, DCP training checkpoints, and full weights streamed out.

Hugging Face checkpoints enter the trainer sharded (`load_pretrained`): under torchrun the model is
built on the meta device, `fully_shard`ed (fsdp_utils.shard_model), and each rank reads only its
own rows of each tensor from the safetensors files, so no rank ever holds a whole model (torchtitan
and verl load the same way); one process loads with `from_pretrained`, as anyone would.

Training checkpoints (`save_checkpoint`, `load_checkpoint`) are torch.distributed.checkpoint (DCP)
directories, written by the same code in one process and under torchrun, and renamed into place so
that a killed save keeps the previous one; the one before the newest is kept too, and a damaged
newest one is passed over (`restore_latest`).

Full (unsharded) weights leave the trainer in two ways, both streamed one bounded bucket at a
time so no rank ever holds the whole model (TRL #7131): into the vLLM engine after each update
(`iter_full_weights`, used by `support.vllm_rollout.VLLMRollout.sync_weights`) and into a Hugging Face
checkpoint (`export_hf_checkpoint`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import os
import re
import shutil
import warnings
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor, Shard
from tqdm import tqdm

from fsdp_utils import any_rank, barrier, from_main, is_main, local_device, rank, shard_model, world_size

# DCP warns on every save/load in a single process; that is this project's everyday case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


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
    initialise, on every rank alike; any other absent tensor is an error. Every dropout of the
    config is set to 0 (`without_dropout`).
    """
    from transformers import AutoConfig, GenerationConfig

    config = without_dropout(config if config is not None else AutoConfig.from_pretrained(path))
    if world_size() == 1:
        with _load_report_held_back():  # its table is checked here instead, as the sharded path checks
            model, loaded = model_class.from_pretrained(path, config=config, dtype=torch.float32,
                                                        output_loading_info=True, ignore_mismatched_sizes=True)
        problems = [f"no tensor {name} in the checkpoint" for name in sorted(set(loaded["missing_keys"]) - set(fresh))]
        problems += [f"{name} has shape {tuple(saved)}, the model wants {tuple(wanted)}"  # as the sharded path says
                     for name, saved, wanted in sorted(loaded["mismatched_keys"])[:3]]
        if len(loaded["mismatched_keys"]) > 3:
            problems.append(f"and {len(loaded['mismatched_keys']) - 3} more tensors of other shapes")
        if problems:
            raise CheckpointError(f"{path}: {'; '.join(problems)} (a {model_class.__name__} needs them)")
        # FSDP2 over a one-rank group on a GPU; on the CPU, the same model with the checkpointing asked for.
        # Offloaded, it stays on the CPU: fully_shard moves one layer at a time through the GPU, as with many ranks.
        on_cpu = device is None or (shard_options.get("cpu_offload") and torch.cuda.is_available())
        return shard_model(model if on_cpu else model.to(device), **shard_options)
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


def without_dropout(config):
    """`config` with every dropout probability at 0 (any number named `*drop*`: attention, residual,
    embedding, head, layer drop, drop path), in the configs it nests too (a multimodal model's text
    config), as verl and TRL train. PPO's ratio divides the update's forward (in training
    mode) by the log-probs taken before it (in eval mode), and the critic regresses on targets built
    from its own eval-mode values: with dropout on, neither is 1 or exact before the first step.
    Qwen2 and Llama have none; GPT-2 and OPT have 0.1. The exported actor's config keeps the zeros."""
    from transformers import PretrainedConfig

    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            without_dropout(value)
        elif "drop" in name and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            setattr(config, name, type(value)(0))  # its own type: transformers 5 checks a field's type when set
    return config


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

    Written to `path.tmp` and renamed; the checkpoint it replaces stays as `path.old` until the next
    save is complete, so a run killed while saving, or a damaged newest checkpoint, leaves one to
    resume from (`latest_checkpoint`). A failed write (a full disk) raises CheckpointError naming
    the cause and removes `path.tmp`.
    """
    state = {}
    for name, model in models.items():
        model_sd, optim_sd = get_state_dict(model, optimizers[name])
        state[name] = {"model": model_sd, "optim": optim_sd}
    tmp = path + ".tmp"

    def clear_tmp():
        if not os.path.exists(path) and os.path.exists(os.path.join(tmp, "extra.pt")):
            os.replace(tmp, path)  # a save killed between its renames: tmp is the newest checkpoint, keep it
        shutil.rmtree(tmp, ignore_errors=True)  # an incomplete one must not mix with this save's files

    def rotate():
        if os.path.exists(path):
            shutil.rmtree(path + ".old", ignore_errors=True)  # half deleted by a kill: path is newer
            os.replace(path, path + ".old")
        os.replace(tmp, path)

    _on_main(clear_tmp, f"cannot save a checkpoint to {path}")
    failure = None
    try:
        dcp.save(state, checkpoint_id=tmp)
        if is_main():
            buffer = io.BytesIO()
            torch.save(extra, buffer)
            with open(os.path.join(tmp, "extra.pt"), "wb") as f:  # last: its presence marks tmp complete
                f.write(buffer.getbuffer())
                f.flush()
                os.fsync(f.fileno())  # on disk before the renames, as DCP syncs its own files (sync_files)
    except (Exception, dcp.api.CheckpointException) as err:  # DCP's is a BaseException
        failure = err
    if any_rank(failure is not None):  # every rank stops, not only the one whose write failed
        _give_up_write(f"cannot save a checkpoint to {path}", tmp, failure)
    _on_main(rotate, f"cannot rename the checkpoint saved in {tmp} to {path}")


def _on_main(work, what: str) -> None:
    """work() (renames, removals) on rank 0 alone, then a barrier; an OSError there raises CheckpointError
    on every rank, not on rank 0 alone with the others waiting or crashing on a closed connection. The
    files are left as they are: a resume takes the newest complete checkpoint among them."""
    failure = None
    if is_main():
        try:
            work()
        except OSError as err:
            failure = err
    if any_rank(failure is not None):  # an all-reduce: every rank waits here, as at a barrier
        reason = "it failed on rank 0" if failure is None else _os_reason(failure) or _reason(failure)
        raise CheckpointError(f"{what}: {reason}")


def _give_up_write(what: str, tmp: str, failure: BaseException | None) -> None:
    """Remove the half-written `tmp` (rank 0) and raise CheckpointError on every rank: `what`, the
    cause (the operating system's word where there is one) and the space left."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(tmp))).free
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    reason = "it failed on another rank" if failure is None else _os_reason(failure) or _reason(failure)
    raise CheckpointError(f"{what}: {reason} ({free / 2**20:.0f} MiB free there)")


def _os_reason(err: BaseException) -> str | None:
    """The operating system's word for a failed write ("No space left on device"), wherever it sits
    in `err`: its chain of causes, the per-rank failures a DCP CheckpointException holds, or the
    "(os error N)" of a SafetensorError."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return os.strerror(e.errno)
        if errno_in_text := re.search(r"\(os error (\d+)\)", str(e)):  # safetensors' Rust I/O errors
            return os.strerror(int(errno_in_text.group(1)))
        todo += [e.__cause__, e.__context__, *(failure[0] for failure in getattr(e, "failures", {}).values())]
    return None


def remove_checkpoint(path: str) -> None:
    """Delete what `save_checkpoint(path, ...)` left, a killed save's leftovers included (rank 0)."""
    if is_main():
        for leftover in (path, path + ".tmp", path + ".old"):
            shutil.rmtree(leftover, ignore_errors=True)
            shutil.rmtree(leftover + ".damaged", ignore_errors=True)


def saved_checkpoints(path: str) -> list[str]:
    """What `save_checkpoint(path, ...)` left that should hold a checkpoint, newest first: `path`,
    `path.tmp` if complete (its extra.pt, written last, is there: a save killed between its two
    renames), `path.old` (the one before). An incomplete `path.tmp` is a killed save, not one."""
    return [c for c in (path, path + ".tmp", path + ".old")
            if os.path.isdir(c) and (not c.endswith(".tmp") or os.path.exists(os.path.join(c, "extra.pt")))]


def check_checkpoint(path: str) -> dict:
    """The extras of the checkpoint at `path`, once its extra.pt and DCP metadata read back and
    every file the metadata names is there; CheckpointError naming what is wrong. (A shard cut
    short shows only when it is loaded: `load_checkpoint`.)"""
    extra = checkpoint_extra(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(f"cannot read {path}/.metadata ({_reason(err)})") from None
    files = {item.relative_path for item in metadata.storage_data.values()}
    if missing := sorted(f for f in files if not os.path.exists(os.path.join(path, f))):
        raise CheckpointError(f"{path} lacks {', '.join(missing)}")
    return extra


def latest_checkpoint(path: str) -> str | None:
    """The newest checkpoint that `save_checkpoint(path, ...)` left that reads back
    (`check_checkpoint`); None if none was ever saved. CheckpointError when every one it left is
    damaged: a damaged checkpoint is never taken for no checkpoint."""
    found = _newest(path, check_checkpoint)
    return found and found[0]


def restore_latest(path: str, models: dict, optimizers: dict) -> tuple[str, dict] | None:
    """`load_checkpoint` of the newest checkpoint that `save_checkpoint(path, ...)` left that loads:
    (where, its extras), or None if none was ever saved. Each damaged newer one is said and set
    aside as <name>.damaged, so that the next save keeps the one restored as `path.old`."""
    def load(candidate):
        _on_every_rank(check_checkpoint, candidate)  # before DCP's collectives, which every rank must enter
        return load_checkpoint(candidate, models, optimizers)  # a failed load is undone by the next one's

    return _newest(path, load, set_aside=True)


def _newest(path: str, read, set_aside: bool = False) -> tuple[str, object] | None:
    """(the newest of `saved_checkpoints(path)` that `read` takes without CheckpointError, what it
    returned); None if there is none; CheckpointError naming each one's damage if none reads.
    Every rank takes the same one: the candidates are rank 0's, and one that fails on any rank (a
    node whose view of a shared filesystem lags) is passed over by all, not loaded beside another."""
    damaged = []
    for candidate in from_main(saved_checkpoints(path)):
        try:
            result = _on_every_rank(read, candidate)
        except CheckpointError as err:
            damaged.append((candidate, str(err)))
            continue
        for bad, reason in damaged if set_aside else ():
            if is_main():
                shutil.rmtree(bad + ".damaged", ignore_errors=True)
                os.replace(bad, bad + ".damaged")
                tqdm.write(f"{reason}: moved it to {bad}.damaged; resuming from the checkpoint before it, {candidate}")
        barrier()
        return candidate, result
    if damaged:
        raise CheckpointError(f"{'; '.join(reason for _, reason in damaged)}; no earlier checkpoint to fall back "
                              f"to (run with --overwrite instead of --resume to start again from step 0)")
    return None


def _on_every_rank(read, candidate: str):
    """read(candidate); CheckpointError on every rank when it raised one on any (the others' message:
    that it failed on another rank), so that all ranks go on to the same next candidate."""
    try:
        result, failure = read(candidate), None
    except CheckpointError as err:
        result, failure = None, err
    if any_rank(failure is not None):
        raise CheckpointError(str(failure) if failure else f"{candidate}: did not read back on another rank")
    return result


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored (truncated, or written by another configuration), or a
    Hugging Face checkpoint that cannot be loaded into the model's shards."""


def checkpoint_extra(path: str) -> dict:
    """The plain extras (step, ...) of a checkpoint that `save_checkpoint` wrote, nothing restored."""
    try:
        return torch.load(os.path.join(path, "extra.pt"), weights_only=False)
    except FileNotFoundError:  # a directory renamed into place is complete: this one was damaged since
        raise CheckpointError(f"{path} has no extra.pt (the step, schedulers and settings)") from None
    except Exception as err:  # a truncated or foreign file
        raise CheckpointError(f"cannot read {path}/extra.pt ({_reason(err)})") from None


def _reason(err: BaseException) -> str:
    """A failed load in one line: DCP's exception holds each rank's traceback, whose last line says why."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:200]}"


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
        raise CheckpointError(f"cannot resume from {path} ({_reason(err)})") from None
    for name, model in models.items():
        set_state_dict(
            model,
            optimizers[name],
            model_state_dict=state[name]["model"],
            optim_state_dict=state[name]["optim"],
        )
    return extra


def load_model_weights(path: str, name: str, model: torch.nn.Module) -> None:
    """Only the weights of `name` (e.g. "actor") from what `save_checkpoint` wrote, in place: no
    optimizer, no extras (a finished run's policy, for analysis)."""
    state = {name: {"model": get_model_state_dict(model)}}
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.api.CheckpointException) as err:
        raise CheckpointError(f"cannot read {name} from {path} ({_reason(err)})") from None
    set_model_state_dict(model, state[name]["model"])


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
                # Cast the shard, then gather: half the traffic, and no whole fp32 tensor beside its copy.
                tensor = (tensor if dtype is None else tensor.to(dtype)).full_tensor()
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
    to `path.tmp` and renamed, so a stale shard of an earlier export never survives and `path`, once
    there, is complete. A failed write (a full disk) raises CheckpointError on every rank, as
    `save_checkpoint` does, and removes `path.tmp`.
    """
    state = model.state_dict()
    plan = _bucket_plan(model, state, shard_bytes, dtype)
    files = (
        ["model.safetensors"]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    tmp, failure = path + ".tmp", None
    if is_main():
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            config = copy.deepcopy(model.config)
            config.dtype = dtype or next(iter(state.values())).dtype
            # What save_pretrained records: loaders tell a critic (scalar head) from a causal LM by it.
            config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard renames
            config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                # As it was loaded: save_pretrained refuses what loading only warns about (a temperature
                # beside do_sample false), and the export is at the end of a whole run.
                model.generation_config.to_json_file(os.path.join(tmp, "generation_config.json"))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        except Exception as err:  # every rank must hear of it, whatever it is
            failure = err
    weight_map, total = {}, 0
    for file, bucket in zip(files, iter_full_weights(model, shard_bytes, dtype)):
        # After a failed write rank 0 still gathers every bucket: the other ranks are in the same collectives.
        if is_main() and failure is None:
            tensors = {name: t.cpu().contiguous() for name, t in bucket}
            try:
                save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
            except Exception as err:  # a full disk is a SafetensorError here, not an OSError
                failure = err
            weight_map.update({name: file for name in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        del bucket
    if is_main() and failure is None and len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        try:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        except OSError as err:
            failure = err
    if is_main() and failure is None:
        try:  # a failure here on rank 0 alone would leave the other ranks waiting in the barrier
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        except OSError as err:
            failure = err
    if any_rank(failure is not None):
        _give_up_write(f"cannot export a Hugging Face checkpoint to {path}", tmp, failure)
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
