"""Per-GPU and per-node host memory plan for colocated FSDP2 training and vLLM rollouts
(`train.py --plan`, `print_plan`).

An estimate from the model's shapes, not a measurement. A colocated step has two phases on the GPU:
- rollout: vLLM is awake and takes `gpu_memory_utilization` of the GPU (its bf16 weights split
  by tensor parallelism, the rest KV cache); the trainer's sharded parameters and optimizer
  states stay resident (gradients are freed, and torch's cache is emptied before vLLM wakes:
  `VLLMRollout.sync_weights`), unless offloaded to CPU;
- training: vLLM sleeps at level 2 (holds nothing); actor and critic states are resident, plus
  the gradients, the layers FSDP gathers, and the activations of one micro-batch.
Host memory per node is counted at loading (`checkpoints.load_pretrained`: each rank reads its own
rows, so only a small read buffer per rank; one process reads the whole model), during training
(CPU-offloaded states) and at checkpoint saves (DCP stages one tensor per rank; a Hugging Face
export holds one file's bucket on rank 0). The processes' own memory (libraries, CUDA context) is
not counted.

    python -m support.memory_plan               # Qwen2.5-32B actor + critic, 2 x 8 x H200
    python -m support.memory_plan --world-size 8 --micro-batch-tokens 36864
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from support.config import Config, launch_world_size

GIB = 1024**3
# The actor's output head, per (token x vocab) element, at its peak (the forward; measured on the CPU
# by a TorchDispatchMode count of live tensors): bf16 logits 2, their fp32 copy that logsumexp keeps
# 4, and the entropy metric's own fp32 copy, softmax and product 12. With an entropy bonus
# (--entropy-coef > 0) the entropy's graph is kept and its backward peaks at 24.
LOGITS_BYTES, LOGITS_BYTES_WITH_ENTROPY = 18, 24
# Host-side constants of the code this plans for: checkpoints.READ_BYTES (each rank's read buffer,
# held twice: the copy and the file pages it maps) and export_hf_checkpoint's default file size.
# Copied, not imported: importing support.checkpoints loads torch and torch.distributed.checkpoint
# (2.7 s, against this module's 0.1 s without torch); tests/test_distributed.py checks they agree.
READ_BYTES = 64 << 20
EXPORT_SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Qwen2-style decoder that decide its memory."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int
    tied: bool = False  # lm_head shares the embedding

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a Hugging Face config (e.g. `AutoConfig.from_pretrained(path)`)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                   config.num_key_value_heads, config.intermediate_size, config.vocab_size, head_dim,
                   bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single tensor (the embedding, or an MLP matrix)."""
        return max(self.vocab, self.intermediate) * self.hidden

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + q + 2 * (self.hidden * kv + kv) + q * self.hidden  # q, k, v biased
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # SwiGLU MLP, 2 norms

    def params(self, value_head: bool = False) -> int:
        """Actor (causal LM) or critic (same backbone, scalar head instead of lm_head)."""
        backbone = self.vocab * self.hidden + self.layers * self.layer_params + self.hidden
        if value_head:
            return backbone + self.hidden + 1
        return backbone + (0 if self.tied else self.vocab * self.hidden)

    def activation_elements_per_token(self) -> int:
        """Tensors one decoder layer saves for backward, per token (memory-efficient attention:
        no seq x seq scores): each norm's input, scale and output, q and k after rotary, v, the
        attention's output and log-sum-exp, and the MLP's gate, up, activation and product; 3 kv
        bounds k, v and the few scalars (tests/test_distributed.py counts them). With a padding
        mask transformers repeats K and V to the query heads before SDPA: 2 (heads - kv_heads)
        head_dim more, ~5% at Qwen2.5-32B's shape, not counted."""
        kv = self.kv_heads * self.head_dim
        return 8 * self.hidden + 3 * kv + 4 * self.intermediate


QWEN25_32B = ModelShape(hidden=5120, layers=64, heads=40, kv_heads=8, intermediate=27648, vocab=152064, head_dim=128)
QWEN25_7B = ModelShape(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064, head_dim=128)
QWEN25_1_5B = ModelShape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, head_dim=128,
                         tied=True)

H200_GIB = 140.4  # what an H200 "141 GB" reports: 143,771 MiB
GPU80_GIB = 79.6  # what an 80 GB H100 reports (81,559 MiB; an A100 80 GB reports a little more)


@dataclass(frozen=True)
class Target:
    """The hardware a preset of config.PRESETS is sized for, and the model it plans when no --model
    is given: what `train.py --preset NAME --plan` checks it against."""

    gpus: int  # nodes of 8
    gpu_gib: float
    model: ModelShape
    name: str


TARGETS = {
    "qwen2.5-1.5b": Target(1, GPU80_GIB, QWEN25_1_5B, "one 80 GB GPU"),
    "qwen2.5-7b": Target(8, GPU80_GIB, QWEN25_7B, "one node of 8 x 80 GB GPUs"),
    "qwen2.5-32b": Target(16, H200_GIB, QWEN25_32B, "2 nodes of 8 x H200"),
}


def target(preset: str) -> Target:
    """The preset's target hardware; the CPU presets plan the paper's (Qwen2.5-32B, 2 x 8 H200)."""
    return TARGETS.get(preset, TARGETS["qwen2.5-32b"])


HOST_PHASES = ("loading", "training", "DCP save", "HF export")


@dataclass
class MemoryPlan:
    rows: list[tuple[str, float, float]]  # (component, rollout GiB, training GiB) per GPU
    capacity_gib: float
    notes: list[str]
    host_rows: list[tuple] = field(default_factory=list)  # (component, GiB per node in each of HOST_PHASES)
    ranks_per_node: int = 8

    @property
    def peak_gib(self) -> float:
        return max(sum(r[1] for r in self.rows), sum(r[2] for r in self.rows))

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.capacity_gib

    @property
    def host_peak_gib(self) -> float:
        """Host memory per node at its fullest phase."""
        return max(sum(r[i + 1] for r in self.host_rows) for i in range(len(HOST_PHASES))) if self.host_rows else 0.0

    def __str__(self) -> str:
        lines = [f"{'per GPU (GiB)':<52}{'rollout':>10}{'training':>10}"]
        lines += [f"{name:<52}{a:>10.1f}{b:>10.1f}" for name, a, b in self.rows]
        totals = [sum(r[i] for r in self.rows) for i in (1, 2)]
        lines.append(f"{'total':<52}{totals[0]:>10.1f}{totals[1]:>10.1f}")
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"peak {self.peak_gib:.1f} GiB of {self.capacity_gib:.1f} GiB usable: {verdict}")
        header = f"host per node, {self.ranks_per_node} ranks (GiB)"
        lines.append(f"\n{header:<52}" + "".join(f"{phase:>10}" for phase in HOST_PHASES))
        lines += [f"{name:<52}" + "".join(f"{v:>10.1f}" for v in values) for name, *values in self.host_rows]
        lines.append(f"host peak {self.host_peak_gib:.1f} GiB per node")
        return "\n".join(lines + self.notes)


def plan(
    model,
    world_size: int,
    critic=None,
    tensor_parallel_size: int = 4,
    micro_batch_tokens: int = 9216,
    gpu_memory_utilization: float = 0.5,
    mixed_precision: bool = True,
    activation_checkpointing: bool = True,
    cpu_offload: bool = False,
    gpu_gib: float = H200_GIB,
    reserved_gib: float = 5.0,
    gpus_per_node: int = 8,
    reference_policy: bool = False,
    with_critic: bool = True,
    vllm: bool = True,
    checkpoint_fraction: float = 1.0,
    logits_chunk_tokens: int | None = None,
    entropy_bonus: bool = False,
) -> MemoryPlan:
    """Per-GPU memory of actor + critic training (FSDP2 over `world_size`) and vLLM rollouts, and
    host memory per node of `gpus_per_node` ranks.

    model / critic: a `ModelShape` or a Hugging Face config (the critic defaults to the actor's
    backbone). micro_batch_tokens: prompt + response tokens in one forward/backward per GPU.
    gpu_gib: what the GPU reports (H200 "141 GB": 143,771 MiB = 140.4 GiB); reserved_gib: CUDA
    context, NCCL buffers and fragmentation, not available to either phase. reference_policy:
    a frozen copy of the actor is loaded too (--kl-coef). with_critic=False: no critic (--estimator
    grpo). vllm=False: `generate` samples from the actor itself (--rollout hf or hf-fast), whose KV
    cache is not counted. checkpoint_fraction: the share of layers recomputed under activation
    checkpointing. logits_chunk_tokens (--logprob-chunk-tokens): the actor's logits are built that
    many tokens at a time. entropy_bonus (--entropy-coef > 0): the entropy's graph is kept too.
    """
    actor = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    critic = actor if critic is None else critic if isinstance(critic, ModelShape) else ModelShape.from_config(critic)
    if world_size < 1 or tensor_parallel_size < 1 or world_size % tensor_parallel_size:
        raise ValueError(f"world_size {world_size} must be a positive multiple of tensor_parallel_size {tensor_parallel_size}")
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be positive, got {gpus_per_node}")
    if not 0 < gpu_memory_utilization < 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1), got {gpu_memory_utilization}")
    n_actor, n_critic = actor.params(), critic.params(value_head=True) if with_critic else 0
    compute_bytes = 2 if mixed_precision else 4  # bf16 or fp32 for gathered layers and activations
    on_gpu = 0.0 if cpu_offload else 1.0
    shard = lambda n, nbytes: on_gpu * n * nbytes / world_size / GIB  # fp32 sharded state
    rows = [
        ("actor parameters (fp32, sharded)", shard(n_actor, 4), shard(n_actor, 4)),
        ("actor AdamW states (2 x fp32, sharded)", shard(n_actor, 8), shard(n_actor, 8)),
        *([("critic parameters (fp32, sharded)", shard(n_critic, 4), shard(n_critic, 4)),
           ("critic AdamW states (2 x fp32, sharded)", shard(n_critic, 8), shard(n_critic, 8))] if with_critic else []),
        *([("reference policy parameters (fp32, sharded)", shard(n_actor, 4), shard(n_actor, 4))]
          if reference_policy else []),
        # Actor and critic are updated one after the other; gradients are freed in between.
        ("gradients of one model (fp32, sharded)", 0.0, shard(max(n_actor, n_critic), 4)),
        # FSDP holds the running layer and prefetches the next one, unsharded.
        ("gathered layers (2 decoder layers)", 0.0, 2 * actor.layer_params * compute_bytes / GIB),
    ]
    checkpointed = checkpoint_fraction if activation_checkpointing else 0.0
    logits_tokens = min(micro_batch_tokens, logits_chunk_tokens or micro_batch_tokens)
    logits_bytes = LOGITS_BYTES_WITH_ENTROPY if entropy_bonus else LOGITS_BYTES
    activations = {"actor": _activations(actor, micro_batch_tokens, compute_bytes, checkpointed)
                   + logits_tokens * actor.vocab * logits_bytes / GIB}
    if with_critic:
        activations["critic"] = _activations(critic, micro_batch_tokens, compute_bytes, checkpointed)
    rows.append(("activations of one micro-batch (actor/critic max)", 0.0, max(activations.values())))
    vllm_total = gpu_memory_utilization * gpu_gib if vllm else 0.0
    vllm_weights = n_actor * 2 / tensor_parallel_size / GIB if vllm else 0.0
    if vllm:
        rows.append(("vLLM weights (bf16 / tensor parallel)", vllm_weights, 0.0))
        rows.append(("vLLM KV cache and buffers (rest of its share)", vllm_total - vllm_weights, 0.0))

    # KV per token on one GPU: K and V, every layer, this GPU's KV heads (replicated when fewer than TP).
    kv_heads_here = max(actor.kv_heads // tensor_parallel_size, 1)
    kv_per_token = 2 * actor.layers * kv_heads_here * actor.head_dim * 2
    kv_tokens = max(vllm_total - vllm_weights - 2.0, 0.0) * GIB / kv_per_token  # ~2 GiB of vLLM buffers
    notes = [
        f"actor {n_actor / 1e9:.2f}B parameters, " + (f"critic {n_critic / 1e9:.2f}B" if with_critic else "no critic")
        + f"; world size {world_size}, "
        + (f"vLLM tensor parallel {tensor_parallel_size} ({world_size // tensor_parallel_size} engines)" if vllm
           else "no vLLM: the actor samples, and its KV cache is not counted"),
        f"activations per micro-batch of {micro_batch_tokens} tokens: actor {activations['actor']:.1f} GiB "
        f"(logits {logits_tokens * actor.vocab * logits_bytes / GIB:.1f})"
        + (f", critic {activations['critic']:.1f} GiB" if with_critic else ""),
    ]
    if vllm:
        notes.append(f"vLLM KV cache holds ~{kv_tokens / 1e3:.0f}k tokens per engine "
                     f"({kv_per_token // 1024} KiB per token per GPU)")
    if vllm_weights > vllm_total:
        notes.append("vLLM's share cannot even hold its weights: raise gpu_memory_utilization or tensor parallelism")
    ranks = min(gpus_per_node, world_size)
    host_rows = _host_rows(actor, critic, world_size, ranks, n_actor + n_critic + (n_actor if reference_policy else 0),
                           n_actor + n_critic, cpu_offload)
    notes.append("host: vLLM 0.32 keeps no CPU swap (its V1 engine recomputes preempted requests) and sleep "
                 "level 2 keeps no CPU copy of its weights; a multi-node run reads the checkpoint on every node")
    return MemoryPlan(rows, gpu_gib - reserved_gib, notes, host_rows, ranks)


def _host_rows(actor: ModelShape, critic: ModelShape, world_size: int, ranks: int, n_loaded: int, n_trained: int,
               cpu_offload: bool) -> list[tuple]:
    """Host GiB per node of `ranks` ranks, in each of HOST_PHASES."""
    node = lambda per_rank_bytes: ranks * per_rank_bytes / GIB
    largest = max(actor.largest_tensor, critic.largest_tensor) * 4  # fp32 bytes
    rows = []
    if world_size == 1:  # from_pretrained: one whole fp32 model at a time, plus the bf16 file pages it maps
        whole = max(actor.params(), critic.params(value_head=True))
        rows.append(("loading: one whole model (fp32 + bf16 file pages)", whole * 6 / GIB, 0.0, 0.0, 0.0))
    else:
        rows.append(("loading: each rank's read buffer (2 x 64 MiB)", node(2 * READ_BYTES), 0.0, 0.0, 0.0))
    if cpu_offload:  # parameters at loading; then gradients and AdamW states too (16 bytes)
        resident = node((n_loaded * 4 + n_trained * 12) / world_size)
        rows.append(("CPU-offloaded params, grads, AdamW (fp32, sharded)", node(n_loaded * 4 / world_size),
                     resident, resident, resident))
    else:  # DCP copies one tensor (+10 MB ahead) per rank off the GPU as it writes
        rows.append(("DCP save: one tensor per rank staged from the GPU", 0.0, 0.0, node(largest / world_size + 10e6),
                     0.0))
    # Value pretraining and the ORM export a Hugging Face checkpoint: rank 0 holds one file's bucket,
    # the whole model where it is smaller than a file (fp32 bytes: an upper bound for a bf16 export).
    bucket = min(EXPORT_SHARD_BYTES, max(actor.params(), critic.params(value_head=True)) * 4)
    rows.append((f"HF export on rank 0: one file's {bucket / GIB:.3g} GiB + one tensor", 0.0, 0.0, 0.0,
                 (bucket + largest) / GIB))
    rows.append(("vLLM CPU swap", 0.0, 0.0, 0.0, 0.0))
    return rows


def needs(model, world_sizes=(8, 16), **options) -> list[str]:
    """One line per world size: the GPU peak and verdict, and host memory per node."""
    lines = []
    for world_size in world_sizes:
        p = plan(model, world_size, **options)
        nodes = -(-world_size // p.ranks_per_node)
        lines.append(f"at {world_size} GPUs ({nodes} node{'s' if nodes > 1 else ''} of {p.ranks_per_node}): "
                     f"{p.peak_gib:.1f} GiB per GPU of {p.capacity_gib:.1f} "
                     f"({'fits' if p.fits else 'does NOT fit'}), host {p.host_peak_gib:.1f} GiB per node")
    return lines


def _activations(shape: ModelShape, tokens: int, nbytes: int, checkpoint_fraction: float) -> float:
    """GiB the decoder layers hold for one forward + backward of `tokens` tokens, with that share of
    them checkpointed (0: none; fsdp_utils.shard_model rounds it to a count of layers)."""
    per_layer = shape.activation_elements_per_token() * tokens * nbytes
    recomputed = max(1, round(checkpoint_fraction * shape.layers)) if checkpoint_fraction else 0
    # A checkpointed layer keeps its input; the one being recomputed holds its activations and their gradients.
    total = recomputed * shape.hidden * tokens * nbytes + (shape.layers - recomputed) * per_layer
    return (total + (2 * per_layer if recomputed else 0)) / GIB


def print_plan(cfg: Config) -> None:
    """`train.py --plan`: per-GPU and per-node host memory of this config at torchrun's world size
    (without torchrun, the preset's target: TARGETS; nodes of LOCAL_WORLD_SIZE or 8 GPUs), then what
    it needs at the target's, 8 and 16 GPUs."""
    machine = target(cfg.preset)
    shape = machine.model  # --plan without --model: the preset's model (the paper's for the CPU presets)
    if cfg.model is not None:  # only its config.json is read: no weights needed to plan
        from transformers import AutoConfig

        from support.sft import check_model

        check_model(cfg.model, weights=False)
        shape = ModelShape.from_config(AutoConfig.from_pretrained(cfg.model))
    options = dict(
        tensor_parallel_size=cfg.tensor_parallel_size,
        micro_batch_tokens=cfg.micro_batch_tokens or cfg.micro_batch_size * (cfg.max_prompt_tokens + cfg.max_new_tokens),
        gpu_memory_utilization=cfg.gpu_memory_utilization, mixed_precision=cfg.mixed_precision,
        activation_checkpointing=cfg.activation_checkpointing, cpu_offload=cfg.cpu_offload,
        gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 8)), gpu_gib=machine.gpu_gib,
        reference_policy=bool(cfg.kl_coef), with_critic=cfg.estimator == "gae", vllm=cfg.rollout == "vllm",
        checkpoint_fraction=cfg.checkpoint_fraction, logits_chunk_tokens=cfg.logprob_chunk_tokens,
        entropy_bonus=bool(cfg.entropy_coef),
    )
    print(f"target of --preset {cfg.preset}: {machine.name} ({machine.gpu_gib} GiB a GPU)")
    print(plan(shape, launch_world_size(cfg), **options))
    print("\n".join(needs(shape, world_sizes=sorted({machine.gpus, 8, 16}), **options)))


def main(argv: list[str] | None = None) -> MemoryPlan:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face model directory (config.json); default Qwen2.5-32B numbers")
    p.add_argument("--world-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=4)
    p.add_argument("--micro-batch-tokens", type=int, default=9216, help="prompt + response tokens per micro-batch")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--gpu-gib", type=float, default=140.4, help="memory the GPU reports (H200: 140.4)")
    p.add_argument("--reserved-gib", type=float, default=5.0)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_false")
    p.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    p.add_argument("--cpu-offload", action="store_true")
    args = p.parse_args(argv)
    if args.model:
        from transformers import AutoConfig

        shape = ModelShape.from_config(AutoConfig.from_pretrained(args.model))
    else:
        shape = QWEN25_32B
    options = {k: v for k, v in vars(args).items() if k != "model"}
    try:
        result = plan(shape, **options)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(result)
    print("\n".join(needs(shape, **{k: v for k, v in options.items() if k != "world_size"})))
    return result


if __name__ == "__main__":
    main()
