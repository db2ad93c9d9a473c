"""Weight sync into vLLM (`VLLMRollout.sync_weights`): seconds per GB of parameters, against a
plain `copy_` of the same tensors (same count, same bytes) into preallocated buffers.

    python bench/sync_bench.py                    # one process: unsharded model, one engine
    python bench/sync_bench.py --nproc 2          # torchrun: FSDP2-sharded model, tensor parallel 2

Under torchrun the sync includes the all-gathers of `iter_full_weights` and each rank loading
its tensor-parallel half. CPU, fp32, median of --repeats syncs after one warm-up sync.
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

MODELS = {  # head_dim 64 (vLLM's CPU attention)
    "mid": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=1536),
    "large": dict(num_layers=12, hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=3072),
}


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args) -> None:
    """One rank (or the single process): build, sync, copy; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from fsdp_utils import init_distributed, is_main, shard_model
    from support.checkpoints import export_hf_checkpoint
    from support.vllm_rollout import VLLMRollout
    from support.task import build_tokenizer, make_tiny_model

    torch.set_num_threads(args.threads)
    info = init_distributed()
    tokenizer = build_tokenizer()
    model = make_tiny_model(tokenizer, seed=0, **MODELS[args.model])
    path = os.path.join(args.tmp, "model")
    export_hf_checkpoint(model, tokenizer, path)
    engine = VLLMRollout(path, tokenizer, tensor_parallel_size=info.world_size, max_model_len=256)
    sharded = shard_model(model)
    nbytes = sum(p.numel() * p.element_size() for p in make_tiny_model(tokenizer, **MODELS[args.model]).parameters())
    sync_s = timed(lambda: engine.sync_weights(sharded), args.repeats)

    # The baseline: the same tensors copied into buffers of the same shapes, in this process.
    sources = [p.detach().clone() for p in make_tiny_model(tokenizer, **MODELS[args.model]).parameters()]
    targets = [torch.empty_like(t) for t in sources]
    copy_s = timed(lambda: [t.copy_(s) for t, s in zip(targets, sources)], 10 * args.repeats)  # cheap: more samples
    if is_main():
        print(json.dumps({"model": args.model, "ranks": info.world_size, "gb": nbytes / 1e9,
                          "sync_s": sync_s, "copy_s": copy_s}))
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun when > 1; tensor parallel = ranks)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--repeats", type=int, default=3)
    # One thread: on a shared 2-core machine a second OpenMP thread turns every small op into a
    # wait for a descheduled thread (measured: plain copies 50x slower), which is noise, not sync cost.
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)  # worker mode
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model:
        worker(args)
        return
    from support.vllm_rollout import vllm_missing

    if missing := vllm_missing("bench/sync_bench.py"):
        p.error(missing)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": ""}
    print(f"{'model':<7}{'ranks':>6}{'GB':>7}{'sync s':>9}{'sync s/GB':>11}{'copy s/GB':>11}{'sync/copy':>11}")
    for model in args.models:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)] if args.nproc > 1 else []
        cmd = [sys.executable, *launcher, __file__, "--model", model, "--tmp", tempfile.mkdtemp(),
               "--repeats", str(args.repeats), "--threads", str(args.threads)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not lines:
            raise SystemExit(f"{model} failed:\n{out.stderr[-3000:]}")
        r = json.loads(lines[-1])
        print(f"{model:<7}{r['ranks']:>6}{r['gb']:>7.3f}{r['sync_s']:>9.3f}{r['sync_s'] / r['gb']:>11.2f}"
              f"{r['copy_s'] / r['gb']:>11.3f}{r['sync_s'] / r['copy_s']:>11.1f}")


if __name__ == "__main__":
    main()
