"""Model FLOPs utilisation of the PPO actor update on one GPU (a CUDA benchmark).

The update is `ppo_update.update_model` with `train.actor_loss` on a Qwen2.5-1.5B-shaped model with
random weights (built on the GPU), prepared as `train.py` prepares it (`fsdp_utils.shard_model`: FSDP2 over a
group of one rank, bf16 compute with float32 parameters and reduction, activation checkpointing;
SDPA without cuDNN, as `fsdp_utils.init_distributed` sets it for every GPU process).
The batch: --rows responses of --prompt-tokens prompt tokens and ragged response lengths, drawn
uniformly from [3/4, 1] x --response-tokens. It is timed against a bare step on the same
micro-batches: the same forward (log-probs of the response tokens, through the same head),
summed, backward, one AdamW step; ratio = PPO / bare is PPO's own overhead.

FLOPs are counted as verl counts them: 6 N per token (N = the matmul parameters, the tied head
once) plus causal attention, 6 x layers x hidden x sum of squared sequence lengths (real tokens,
prompt + response; padding does not count). MFU = FLOPs / time / 989e12 (H200 dense bf16 peak).
The last line:
    mfu ppo=<x> bare=<y> ratio=<ppo/bare> peak_gib=<z>

The throughput levers are train.py's flags: --micro-batch-tokens, --logprob-chunk-tokens,
--compile-layers, --checkpoint-fraction. --profile prints the operators of one more update by the
time they take (on the GPU, kernel time). The timed steps repeat one batch, so their shapes were
met before; --fresh-batches draws a batch of new lengths for every step instead, as each step of a
run does, so that what a new shape costs (a kernel library's plan for it, a recompile) is timed
too. Either way MFU is the timed steps' FLOPs over their time (with one batch, its FLOPs over the
mean time). `--dry-run` runs the same code on the CPU with a tiny
shape, in float32 (the MFU it prints is of no meaning there).

    python bench/mfu_bench.py --micro-batch-tokens 32768 --logprob-chunk-tokens 4096 --compile-layers
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

import fsdp_utils
import train
from support.config import Config
from ppo_update import update_model
from rollout import RolloutBatch

PEAK_FLOPS = 989e12  # H200 (and H100 SXM) dense bf16
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                   max_position_embeddings=32768)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=512)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8, help="responses in the batch (one mini-batch)")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--response-tokens", type=int, default=7168, help="longest response")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="rows per micro-batch (no token budget)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="padded tokens per micro-batch")
    parser.add_argument("--logprob-chunk-tokens", type=int, default=None, help="log-probs from hidden states")
    parser.add_argument("--compile-layers", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    parser.add_argument("--checkpoint-fraction", type=float, default=1.0, help="share of layers recomputed")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates of each kind, after one warm-up")
    parser.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU: checks this script runs")
    parser.add_argument("--profile", action="store_true",
                        help="then one more PPO update under torch.profiler: the kernels that take the most time")
    parser.add_argument("--fresh-batches", action="store_true",
                        help="a batch of new lengths (so new shapes) for every update and bare step, as training meets")
    return parser.parse_args(argv)


def matmul_parameters(shape: dict) -> int:
    """Parameters that take part in a matmul per token: every layer's projections and the head
    (tied to the embedding: counted once, as the head; the embedding lookup is no matmul)."""
    d, ff, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * d // shape["num_attention_heads"]
    return layers * (2 * d * d + 2 * d * kv + 3 * d * ff) + shape["vocab_size"] * d


def model_flops(shape: dict, sequence_lengths: list[int]) -> float:
    """Forward + backward FLOPs of one pass over the sequences (module docstring)."""
    attention = 6 * shape["num_hidden_layers"] * shape["hidden_size"] * sum(s * s for s in sequence_lengths)
    return 6 * matmul_parameters(shape) * sum(sequence_lengths) + attention


def ragged_batch(vocab, rows, prompt_tokens, response_tokens, device, seed=0):
    """A rollout batch of random tokens with response lengths in [3/4, 1] x response_tokens, and
    the per-row tensors the actor loss reads (old log-probs, advantages)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response_tokens * 3 // 4, response_tokens + 1, (rows,), generator=g)
    mask = (torch.arange(response_tokens) < lengths[:, None]).float()
    batch = RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (rows, prompt_tokens), generator=g),
        prompt_mask=torch.ones(rows, prompt_tokens, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (rows, response_tokens), generator=g) * mask.long(),
        response_mask=mask, logprobs=torch.zeros(rows, response_tokens), finish_reasons=["stop"] * rows,
    ).to(device)
    rows_in = {"old_logprobs": (-torch.rand(rows, response_tokens, generator=g) * mask).to(device),
               "advantages": (torch.randn(rows, response_tokens, generator=g) * mask).to(device)}
    return batch, rows_in


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: mfu_bench needs a CUDA device (--dry-run runs it on the CPU, tiny)")
    shape = TINY if args.dry_run else QWEN25_1_5B
    if args.dry_run:
        torch.set_num_threads(1)  # a tiny model on a shared CPU: one thread is fastest
    prompt_tokens, response_tokens = (16, 48) if args.dry_run else (args.prompt_tokens, args.response_tokens)
    info = fsdp_utils.init_distributed()  # one GPU: a group of one rank, so shard_model takes FSDP2
    cfg = Config(ppo_epochs=1, num_minibatches=1, micro_batch_size=args.micro_batch_size,
                 micro_batch_tokens=args.micro_batch_tokens, logprob_chunk_tokens=args.logprob_chunk_tokens,
                 mixed_precision=info.device.type == "cuda", activation_checkpointing=args.activation_checkpointing,
                 checkpoint_fraction=args.checkpoint_fraction, compile_layers=args.compile_layers,
                 prompts_per_step=args.rows, samples_per_prompt=1)
    model_config = Qwen2Config(**shape)
    model_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(info.device):
        model = Qwen2ForCausalLM(model_config)
    model = fsdp_utils.shard_model(model, **fsdp_utils.shard_options(cfg))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    batch, rows = ragged_batch(shape["vocab_size"], args.rows, prompt_tokens, response_tokens, info.device)

    def bare(batch, rows):  # in training mode, as update_model sets it (eval mode would skip the recompute)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        every_row = torch.arange(len(batch), device=batch.device)
        for _, micro in batch.micro_batches(every_row, cfg.micro_batch_size, cfg.micro_batch_tokens):
            logprobs, _ = train.policy_forward(model, micro, 1.0, chunk_tokens=cfg.logprob_chunk_tokens)
            (-logprobs.sum() / micro.response_mask.sum()).backward()
        optimizer.step()

    def ppo(batch, rows):
        update_model(cfg, model, optimizer, batch, rows, train.actor_loss, seed=0, prefix="actor")

    def timed(fn, *args):
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def flops_of(batch) -> float:
        return model_flops(shape, (batch.prompt_mask.sum(-1) + batch.lengths).tolist())

    times, step_flops = {"bare": [], "ppo": []}, {"bare": [], "ppo": []}
    for i in tqdm(range(1 + args.repeats), desc="mfu_bench (warm-up, then timed)", disable=info.rank != 0):
        for j, (name, fn) in enumerate((("bare", bare), ("ppo", ppo))):
            step_batch, step_rows = (batch, rows) if not args.fresh_batches else ragged_batch(
                shape["vocab_size"], args.rows, prompt_tokens, response_tokens, info.device, seed=1 + 2 * i + j)
            seconds = timed(fn, step_batch, step_rows)
            if i > 0:  # the first round compiles and warms the allocator
                times[name].append(seconds)
                step_flops[name].append(flops_of(step_batch))
    if args.profile:  # where the update's time goes, for the next lever
        cuda = info.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
        with torch.profiler.profile(activities=activities) as prof:
            timed(ppo, batch, rows)
        if info.rank == 0:
            print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                            row_limit=20), flush=True)
    bare_s, ppo_s = statistics.median(times["bare"]), statistics.median(times["ppo"])
    peak = torch.cuda.max_memory_allocated() / 2**30 if info.device.type == "cuda" else 0.0
    ppo_mfu, bare_mfu = (sum(step_flops[k]) / sum(times[k]) / PEAK_FLOPS for k in ("ppo", "bare"))
    result = {"ppo": ppo_mfu, "bare": bare_mfu, "ratio": bare_mfu / ppo_mfu, "peak_gib": peak}
    if info.rank == 0:
        if args.fresh_batches:
            flops = statistics.mean(step_flops["ppo"])
            batches = f"{len(batch)} rows, a batch of new lengths for every step; {flops / 1e12:.1f} TFLOP per pass (mean)"
        else:
            micro = list(batch.micro_batches(torch.arange(len(batch), device=batch.device), cfg.micro_batch_size,
                                             cfg.micro_batch_tokens))
            batches = (f"{len(batch)} rows, {int(batch.lengths.sum())} response + {int(batch.prompt_mask.sum())} "
                       f"prompt tokens in {len(micro)} micro-batches; {flops_of(batch) / 1e12:.1f} TFLOP per pass")
        print(f"{'dry run (CPU, tiny)' if args.dry_run else 'Qwen2.5-1.5B shape'}: {batches}; update {ppo_s:.2f} s, "
              f"bare {bare_s:.2f} s (medians of {args.repeats}); {ppo_mfu * PEAK_FLOPS / 1e12:.0f} model TFLOP/s",
              flush=True)
        print(f"mfu ppo={result['ppo']:.3f} bare={result['bare']:.3f} ratio={result['ratio']:.2f} "
              f"peak_gib={result['peak_gib']:.1f}", flush=True)
    fsdp_utils.close_distributed()
    return result


if __name__ == "__main__":
    main()
