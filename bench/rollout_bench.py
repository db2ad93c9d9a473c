"""Rollout throughput on CPU: the fast HF path (`FastHFRollout`, fast_rollout.py) beside Hugging
Face `generate` (`HFRollout`) and vLLM (`VLLMRollout`), in one run.

    python bench/rollout_bench.py                 # tiny (2 layers, hidden 128) and mid (8 layers, hidden 512)
    python bench/rollout_bench.py --prompts 64 --new-tokens 128 --threads 2
    python bench/rollout_bench.py --models tiny --backends hf --new-tokens 600 --profile   # where HF's time goes
    python bench/rollout_bench.py --checkpoint runs/long/_shared/sft-long --task-length long --new-tokens 600
    python bench/rollout_bench.py --models sft --backends hf hf-fast --no-eos --new-tokens 600   # 64 x 600 exactly
    python bench/rollout_bench.py --device cuda --models sft mid --backends hf hf-fast --no-eos --new-tokens 600

Random weights end a response at a random EOS within tens of tokens; --checkpoint times a trained
pi_SFT instead (the long task's: responses of ~500 tokens), on its task's prompts. --no-eos times
a fixed length: the engines are told an EOS id outside the vocabulary, so every row runs all
--new-tokens (the model's own EOS is then just another token); for timing only, and for the
Hugging Face backends only (vLLM refuses such a stop id).

The two Hugging Face backends share one child process and take turns, call by call, on the same
model and prompts, so that their ratio is measured under the same load (on a shared machine the
absolute numbers move, the ratio much less); vLLM runs in a child of its own (it changes process-wide
thread settings). Sampling is at temperature 1. Tokens/s counts generated tokens (EOS included)
over the wall time of one `generate` call, median of --repeats calls after one warm-up call;
engine start-up is reported separately. "cpu s" is the CPU time the process spent in the call
(median): on a machine shared with other work it is much less than the wall time, and closer to
what the call takes alone. --profile adds, for each Hugging Face backend, the torch
operators that took the most of one more call's time.

The floor. A call's work is counted from the model's shape and the responses it produced: per row,
N = prompt tokens + response tokens - 1 positions go through the model (the last token is sampled,
never fed back), each costing 2 x (the layers' projection parameters) FLOPs, plus 2 x vocab x hidden
for the head at each of the row's sampled tokens; position i attends over i + 1 keys at
4 x layers x hidden FLOPs a key (QK^T and PV), so sum_i (i + 1) = N (N + 1) / 2 of them. The
machine's matmul throughput is measured here, on the same threads: every projection of the model
(and the head) as a `torch.nn.functional.linear` of --prompts rows, the fastest of 3 timings of 50
each, FLOPs over time summed across the shapes. floor seconds = the call's FLOPs / that throughput,
and floor_fraction = floor seconds / the fast path's seconds: the share of the machine's matmul
rate the rollout reaches. (Attention is counted at the matmul rate, so the floor ignores that it
reads the whole K/V cache at every step: it is a bound no engine reaches.)

The memory floor. A decoding step reads, for each row, every key and value written so far: per row,
layers x 2 x kv_heads x head_dim x 4 bytes (fp32) for each of the sum_i (i + 1) keys above. Once
the cache outgrows the CPU's caches (64 rows x 600 positions of the tiny model: ~60 MB) those reads
come from DRAM; their bytes over the machine's copy bandwidth (a 256 MB `copy_`, reads plus writes,
fastest of 4, measured here) is the "mem s" column: a second floor, which an engine that keeps the
K/V in fp32 cannot beat however few operators it runs.

--device cuda runs the Hugging Face backends on the GPU in bf16, the precision a mixed-precision
run samples in, with SDPA kept off cuDNN as train.py keeps it (`fsdp_utils.attention_without_cudnn`);
the matmul rate and copy bandwidth are then the GPU's (in bf16, and with the GPU synchronised around
every timing), the K/V counted at 2 bytes. "cpu s" is no guide there: a synchronisation waits by
spinning on the host, so it equals the wall time. --profile then also prints how busy the GPU was
(its kernels' time over the profiled call's wall time), the kernels that took the most of it; on
either device it lists the attention operators that ran (which SDPA backend served the call).
The last line, where both `hf` and `hf-fast` ran:
    rollout new_tokens_per_s=<a> hf_generate_tokens_per_s=<b> speedup=<a/b> floor_fraction=<f>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = {  # head_dim 64 throughout: vLLM's CPU attention needs it
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=384),
    "sft": dict(num_layers=3, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=384),  # pi_SFT's shape
    "mid": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1536),
}
HF_BACKENDS = ("hf", "hf-fast")  # these share a child process and take turns


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work, so that a timing covers it (nothing to wait for on CPU)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def matmul_flops_per_s(config, rows: int, device: str = "cpu", dtype=None) -> float:
    """The machine's matmul rate on this model's projections (and head) at `rows` rows (module docstring)."""
    import torch
    import torch.nn.functional as F

    d, ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, ff), (d, ff), (ff, d), (d, vocab)]  # (in, out)
    flops = seconds = 0.0
    for n_in, n_out in shapes:
        x, w = torch.randn(rows, n_in, device=device, dtype=dtype), torch.randn(n_out, n_in, device=device, dtype=dtype)
        F.linear(x, w)
        timings = []
        for _ in range(3):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(50):
                F.linear(x, w)
            synchronize(device)
            timings.append((time.perf_counter() - start) / 50)
        flops, seconds = flops + 2 * rows * n_in * n_out, seconds + min(timings)
    return flops / seconds


def call_flops(config, prompt_lengths: list[int], response_lengths: list[int]) -> float:
    """FLOPs of one rollout call's forward passes (module docstring)."""
    from mfu_bench import matmul_parameters

    head = config.vocab_size * config.hidden_size
    projections = matmul_parameters(config.to_dict()) - head
    total = 0.0
    for p, r in zip(prompt_lengths, response_lengths):
        n = p + r - 1
        total += 2 * projections * n + 2 * head * r + 4 * config.num_hidden_layers * config.hidden_size * n * (n + 1) / 2
    return total


def memory_bytes_per_s(device: str = "cpu") -> float:
    """The machine's copy bandwidth (module docstring): bytes read plus written per second."""
    import torch

    src = torch.ones(64 * 2**20, device=device)  # 256 MB of fp32
    dst = torch.empty_like(src)
    timings = []
    for _ in range(4):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        timings.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / min(timings)


def call_kv_bytes(config, prompt_lengths: list[int], response_lengths: list[int], element_bytes: int = 4) -> float:
    """Bytes of K/V one rollout call reads (module docstring): every position reads the keys and values before it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_key = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_bytes
    return sum(per_key * (p + r - 1) * (p + r) / 2 for p, r in zip(prompt_lengths, response_lengths))


def top_operators(events, attribute: str, clock: str, count: int = 6) -> list[tuple[str, float, int, str]]:
    """The `count` events with the most of `attribute` (a profiler total), as (name, share, calls, clock)."""
    ops = sorted(events, key=lambda e: getattr(e, attribute), reverse=True)
    total = sum(getattr(e, attribute) for e in ops) or 1.0
    return [(e.key[:100], getattr(e, attribute) / total, e.count, clock) for e in ops[:count]]


def measure(args) -> list[dict]:
    """In the child: build the model, time generation with each of --backends, return their numbers."""
    import types

    import torch

    from support.task import SHAPES, build_tokenizer, make_problems, make_tiny_model

    torch.set_num_threads(args.threads)
    if args.checkpoint:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):  # not a hub name: nothing downloads
            raise SystemExit(f"--checkpoint {args.checkpoint}: no Hugging Face checkpoint there (no config.json)")

        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    else:
        tokenizer = build_tokenizer()
        model = make_tiny_model(tokenizer, seed=0, **MODELS[args.model]).eval()
    # On a GPU in bf16, as a mixed-precision run samples (FSDP2 computes in bf16, one rank or many).
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = model.to(args.device, dtype)
    if args.device == "cuda":
        from fsdp_utils import attention_without_cudnn

        attention_without_cudnn()
    shape = SHAPES[args.task_length]
    problems = make_problems(args.prompts, seed=0, min_difficulty=shape.difficulty[0],
                             max_difficulty=shape.difficulty[1], width=shape.width)
    prompts = [tokenizer(p["prompt"]).input_ids for p in problems]
    # What the engines stop on: with --no-eos an id no token has, so every row runs to the limit.
    stops = types.SimpleNamespace(eos_token_id=len(tokenizer), pad_token_id=tokenizer.pad_token_id) \
        if args.no_eos else tokenizer
    if args.no_eos:  # the engines also stop on the end tokens the model's generation config lists
        model.generation_config.eos_token_id = None
    engines, startup = {}, {}
    for backend in args.backend.split(","):
        start = time.perf_counter()
        if backend == "vllm":
            from support.checkpoints import export_hf_checkpoint
            from support.vllm_rollout import VLLMRollout

            path = args.checkpoint
            if not path:
                path = os.path.join(tempfile.mkdtemp(), "model")
                export_hf_checkpoint(model, tokenizer, path)
            engines[backend] = VLLMRollout(path, stops, max_model_len=max(map(len, prompts)) + args.new_tokens)
        elif backend == "hf":
            from rollout import HFRollout

            engines[backend] = HFRollout(model, stops)
        else:
            from support.fast_rollout import FastHFRollout

            engines[backend] = FastHFRollout(model, stops)
        startup[backend] = time.perf_counter() - start
    times, cpu_times, batches = {b: [] for b in engines}, {b: [] for b in engines}, {}
    for i in range(args.repeats + 1):
        for backend, engine in engines.items():  # in turns: the same load for each
            synchronize(args.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            batches[backend] = engine.generate(prompts, args.new_tokens, temperature=1.0, seed=i)
            synchronize(args.device)
            if i:  # the first call warms caches and kernels
                times[backend].append(time.perf_counter() - start)
                cpu_times[backend].append(time.process_time() - cpu_start)
    rate = matmul_flops_per_s(model.config, args.prompts, args.device, dtype)
    bandwidth = memory_bytes_per_s(args.device)
    out = []
    for backend, engine in engines.items():
        seconds, batch = statistics.median(times[backend]), batches[backend]
        prompt_lengths, response_lengths = [len(p) for p in prompts], batch.lengths.tolist()
        floor = call_flops(model.config, prompt_lengths, response_lengths) / rate
        memory_floor = call_kv_bytes(model.config, prompt_lengths, response_lengths, dtype.itemsize) / bandwidth
        r = {"backend": backend, "model": args.model, "startup_s": startup[backend], "generate_s": seconds,
             "cpu_s": statistics.median(cpu_times[backend]),
             "tokens": int(batch.lengths.sum()), "tokens_per_s": int(batch.lengths.sum()) / seconds,
             "floor_s": floor, "matmul_gflops": rate / 1e9, "memory_floor_s": memory_floor,
             "copy_gb_per_s": bandwidth / 1e9,
             "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
        if args.profile and backend in HF_BACKENDS:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if args.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                start = time.perf_counter()
                engine.generate(prompts, args.new_tokens, temperature=1.0, seed=0)
                synchronize(args.device)
                wall_us = (time.perf_counter() - start) * 1e6
            events = prof.key_averages()
            # Host time: on a GPU it includes the waits of every synchronisation (.item(), nonzero, ...).
            r["top_ops"] = top_operators(events, "self_cpu_time_total", "host")
            if args.device == "cuda":
                # The GPU's own entries (kernels, copies) only: an operator's entry repeats its kernels' time.
                kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
                r["gpu_busy"] = sum(e.self_device_time_total for e in kernels) / wall_us
                r["top_ops"] += top_operators(kernels, "self_device_time_total", "GPU kernel")
            r["attention_ops"] = [(e.key, e.count) for e in events if "attention" in e.key.lower()
                                  and e.device_type == torch.autograd.DeviceType.CPU]  # operators, not kernels
        out.append(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    # One thread by default: on a shared 2-core machine a second OpenMP thread makes each of HF's
    # many small ops wait for a descheduled thread (measured: HF 2.5x slower, vLLM barely).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", nargs="+", default=["tiny", "mid"], choices=list(MODELS))
    p.add_argument("--checkpoint", help="a trained model (Hugging Face format) instead of --models' random ones")
    p.add_argument("--task-length", default="short", choices=["short", "long"], help="the built-in task's prompts")
    p.add_argument("--backends", nargs="+", choices=["hf", "hf-fast", "vllm"],
                   help="default: all three, vLLM where it is installed (Linux)")
    p.add_argument("--no-eos", action="store_true", help="every row runs all --new-tokens (timing only)")
    p.add_argument("--profile", action="store_true", help="HF backends: the operators that take the most time")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the Hugging Face backends on the GPU, in bf16 (vLLM: CPU only here)")
    p.add_argument("--backend", help=argparse.SUPPRESS)  # child mode: comma-separated backends
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    from support.vllm_rollout import vllm_missing

    if args.backends is None:  # as explicit --backends would be, with vLLM only where it is installed
        args.backends = ["hf", "hf-fast"] + ["vllm"] * (not vllm_missing())
    elif "vllm" in args.backends and not args.backend and (missing := vllm_missing("--backends vllm")):
        p.error(missing)
    if args.no_eos and "vllm" in args.backends and not args.backend:
        p.error("--no-eos times the Hugging Face backends only (vLLM refuses a stop id outside the vocabulary)")
    if args.device == "cuda" and "vllm" in args.backends and not args.backend:
        p.error("--device cuda times the Hugging Face backends only (vLLM on a GPU: bench/gpu_smoke.sh part 4)")
    if args.backend:
        print(json.dumps(measure(args)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(f"{args.prompts} prompts x up to {args.new_tokens} new tokens{' (EOS disabled)' * args.no_eos}, "
          f"temperature 1, {args.threads} threads, median of {args.repeats}"
          f"{', on the GPU in bf16' * (args.device == 'cuda')}")
    print(f"{'model':<6}{'params':>8}{'backend':>9}{'start s':>9}{'gen s':>8}{'cpu s':>8}{'tokens':>8}{'tok/s':>9}"
          f"{'x hf':>7}{'floor s':>9}{'mem s':>7}")
    hf_group = [b for b in args.backends if b in HF_BACKENDS]
    children = [",".join(hf_group)] * bool(hf_group) + ["vllm"] * ("vllm" in args.backends)
    for model in ["ckpt"] if args.checkpoint else args.models:
        results = {}
        for backends in children:
            child = [sys.executable, __file__, "--backend", backends, "--model", model,
                     "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
                     "--repeats", str(args.repeats), "--threads", str(args.threads), *(["--profile"] * args.profile),
                     "--device", args.device,
                     *(["--no-eos"] * args.no_eos), "--task-length", args.task_length,
                     *(["--checkpoint", args.checkpoint] * bool(args.checkpoint))]
            out = subprocess.run(child, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{backends}/{model} failed:\n{out.stderr[-3000:]}")
            for r in json.loads(out.stdout.strip().splitlines()[-1]):
                results[r["backend"]] = r
                ratio = f"{r['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}" if "hf" in results else "-"
                print(f"{model:<6}{r['params_m']:>7.1f}M{r['backend']:>9}{r['startup_s']:>9.1f}{r['generate_s']:>8.2f}"
                      f"{r['cpu_s']:>8.2f}{r['tokens']:>8}{r['tokens_per_s']:>9.0f}{ratio:>7}{r['floor_s']:>9.2f}"
                      f"{r['memory_floor_s']:>7.2f}")
                if "gpu_busy" in r:
                    print(f"      the GPU ran kernels {r['gpu_busy']:.0%} of the profiled call's wall time")
                for name, share, count, clock in r.get("top_ops", []):
                    print(f"      {share:6.1%} of the call's {clock} time: {name} ({count} calls)")
                for name, count in r.get("attention_ops", []):
                    print(f"      attention operator: {name} ({count} calls)")
    if {"hf", "hf-fast"} <= set(results):  # the last model's: the one line a script reads
        new, old = results["hf-fast"], results["hf"]
        print(f"machine: matmul {new['matmul_gflops']:.0f} GFLOP/s, copy {new['copy_gb_per_s']:.1f} GB/s; the fast path "
              f"reaches {new['floor_s'] / new['generate_s']:.0%} of the matmul floor and "
              f"{new['memory_floor_s'] / new['generate_s']:.0%} of the K/V memory floor")
        print(f"rollout new_tokens_per_s={new['tokens_per_s']:.0f} hf_generate_tokens_per_s={old['tokens_per_s']:.0f} "
              f"speedup={new['tokens_per_s'] / old['tokens_per_s']:.2f} floor_fraction={new['floor_s'] / new['generate_s']:.3f}")


if __name__ == "__main__":
    main()
