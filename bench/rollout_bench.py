"""Rollout throughput on CPU: vLLM (`VLLMRollout`) against Hugging Face `generate` (`HFRollout`).

    python bench/rollout_bench.py                 # tiny (2 layers, hidden 128) and mid (8 layers, hidden 512)
    python bench/rollout_bench.py --prompts 64 --new-tokens 128 --threads 2
    python bench/rollout_bench.py --models tiny --backends hf --new-tokens 600 --profile   # where HF's time goes
    python bench/rollout_bench.py --checkpoint runs/long/_shared/sft-long --task-length long --new-tokens 600

Random weights end a response at a random EOS within tens of tokens; --checkpoint times a trained
pi_SFT instead (the long task's: responses of ~500 tokens), on its task's prompts.

Every (backend, model) pair runs in its own child process (vLLM changes process-wide thread
settings), on the same randomly initialised weights and prompts, sampling at temperature 1.
Tokens/s counts generated tokens (EOS included) over the wall time of one `generate` call,
median of --repeats calls after one warm-up call; engine start-up is reported separately.
--profile adds, for Hugging Face, the torch operators that took the most of one more call's time.
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
    "mid": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1536),
}


def measure(args) -> dict:
    """In the child: build the model, time generation with one backend, return the numbers."""
    import torch

    from support.task import SHAPES, build_tokenizer, make_problems, make_tiny_model

    torch.set_num_threads(args.threads)
    if args.checkpoint:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    else:
        tokenizer = build_tokenizer()
        model = make_tiny_model(tokenizer, seed=0, **MODELS[args.model]).eval()
    shape = SHAPES[args.task_length]
    problems = make_problems(args.prompts, seed=0, min_difficulty=shape.difficulty[0],
                             max_difficulty=shape.difficulty[1], width=shape.width)
    prompts = [tokenizer(p["prompt"]).input_ids for p in problems]
    start = time.perf_counter()
    if args.backend == "vllm":
        from support.checkpoints import export_hf_checkpoint
        from rollout import VLLMRollout

        path = args.checkpoint
        if not path:
            path = os.path.join(tempfile.mkdtemp(), "model")
            export_hf_checkpoint(model, tokenizer, path)
        engine = VLLMRollout(path, tokenizer, max_model_len=max(map(len, prompts)) + args.new_tokens)
    else:
        from rollout import HFRollout

        engine = HFRollout(model, tokenizer)
    startup = time.perf_counter() - start
    times, tokens = [], 0
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        batch = engine.generate(prompts, args.new_tokens, temperature=1.0, seed=i)
        if i:  # the first call warms caches and kernels
            times.append(time.perf_counter() - start)
            tokens = int(batch.lengths.sum())
    seconds = statistics.median(times)
    out = {"backend": args.backend, "model": args.model, "startup_s": startup, "generate_s": seconds,
           "tokens": tokens, "tokens_per_s": tokens / seconds,
           "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    if args.profile and args.backend == "hf":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, args.new_tokens, temperature=1.0, seed=0)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        out["top_ops"] = [(e.key, e.self_cpu_time_total / total, e.count) for e in ops[:6]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    # One thread by default: on a shared 2-core machine a second OpenMP thread makes each of HF's
    # many small ops wait for a descheduled thread (measured: HF 2.5x slower, vLLM barely).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--checkpoint", help="a trained model (Hugging Face format) instead of --models' random ones")
    p.add_argument("--task-length", default="short", choices=["short", "long"], help="the built-in task's prompts")
    p.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--profile", action="store_true", help="HF: the operators that take the most time")
    p.add_argument("--backend", choices=["hf", "vllm"], help=argparse.SUPPRESS)  # child mode
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.backend:
        print(json.dumps(measure(args)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": ""}
    print(f"{args.prompts} prompts x up to {args.new_tokens} new tokens, temperature 1, "
          f"{args.threads} threads, median of {args.repeats}")
    print(f"{'model':<6}{'params':>8}{'backend':>9}{'start s':>9}{'gen s':>8}{'tokens':>8}{'tok/s':>9}{'vllm/hf':>9}")
    for model in ["ckpt"] if args.checkpoint else args.models:
        results = {}
        for backend in args.backends:
            child = [sys.executable, __file__, "--backend", backend, "--model", model,
                     "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
                     "--repeats", str(args.repeats), "--threads", str(args.threads), *(["--profile"] * args.profile),
                     "--task-length", args.task_length, *(["--checkpoint", args.checkpoint] * bool(args.checkpoint))]
            out = subprocess.run(child, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{backend}/{model} failed:\n{out.stderr[-3000:]}")
            r = results[backend] = json.loads(out.stdout.strip().splitlines()[-1])
            ratio = f"{r['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}" if "hf" in results else "-"
            print(f"{model:<6}{r['params_m']:>7.1f}M{backend:>9}{r['startup_s']:>9.1f}{r['generate_s']:>8.2f}"
                  f"{r['tokens']:>8}{r['tokens_per_s']:>9.0f}{ratio:>9}")
            for name, share, count in r.get("top_ops", []):
                print(f"      {share:6.1%} of the call's operator time: {name} ({count} calls)")


if __name__ == "__main__":
    main()
