"""What a new shape costs SDPA: the first call of each (rows, keys) shape against a call it has seen.

A run meets new attention shapes all the time: every micro-batch has its own padded length, every
decoding step its own key length, and `--rollout hf-fast` its own number of rows as rows stop. A
kernel library that builds a plan per shape (cuDNN does, on the host) pays for each one. This times
one decoding step's SDPA in pi_SFT's shape (2 query heads over 1 key/value head of 64, the float key
mask the decode loops pass, `enable_gqa`), --shapes shapes with rows shrinking from 64 and a new key
length each time, under each set of SDPA backends: torch's default choice, the backends train.py
leaves SDPA on a GPU (all but cuDNN: `fsdp_utils.attention_without_cudnn`), and on CUDA cuDNN alone.
Each set loads its kernels on a shape outside the timed ones first, then meets key lengths (~300)
no other set met; a set this machine cannot run is reported and skipped. On the GPU in bf16,
synchronised around every call; on the CPU (--device cpu, a check of the code) in fp32, where
cuDNN does not exist.
The last line:
    sdpa_new_shape first_ms=<default>,<without cuDNN> again_ms=<default>,<without cuDNN>

    python bench/sdpa_shapes_bench.py                 # on a GPU
    python bench/sdpa_shapes_bench.py --device cpu --shapes 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rollout_bench import synchronize

BACKENDS = {
    "default": None,  # torch's own choice
    "without cuDNN": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cuDNN only": [SDPBackend.CUDNN_ATTENTION],  # CUDA only
}
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 64


def decoding_attention(rows: int, keys: int, device: str, dtype: torch.dtype):
    """One decoding step's SDPA call in pi_SFT's shape, ready to run."""
    q = torch.randn(rows, HEADS, 1, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(rows, KV_HEADS, keys, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.zeros(rows, 1, 1, keys, device=device, dtype=dtype)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def timed_ms(call, device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", type=int, default=64, help="new (rows, keys) shapes per backend set, rows 64 down")
    args = p.parse_args(argv)
    if args.shapes < 1:
        raise SystemExit("error: --shapes must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here (--device cpu runs the code on the CPU)")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    names = [n for n in BACKENDS if args.device == "cuda" or n != "cuDNN only"]
    results = {}
    for i, name in enumerate(names):
        first, again = [], []
        with sdpa_kernel(BACKENDS[name]) if BACKENDS[name] else nullcontext():
            try:  # this set's kernels loaded, on a shape outside the timed ones
                decoding_attention(8, 8, args.device, dtype)()
            except RuntimeError as e:  # e.g. no cuDNN attention on this GPU
                print(f"{name:>13}: unavailable here ({str(e).splitlines()[0]})")
                continue
            for j in range(args.shapes):
                rows, keys = max(64 - j, 1), 300 + 3 * j + i  # interleaved: lengths no other set meets
                call = decoding_attention(rows, keys, args.device, dtype)
                first.append(timed_ms(call, args.device))
                again.append(timed_ms(call, args.device))
        results[name] = {"first_ms": statistics.median(first), "first_max_ms": max(first),
                         "again_ms": statistics.median(again), "total_first_ms": sum(first)}
        r = results[name]
        print(f"{name:>13}: a new shape {r['first_ms']:.2f} ms (median; max {r['first_max_ms']:.2f}), "
              f"the same shape again {r['again_ms']:.2f} ms; {args.shapes} new shapes {r['total_first_ms']:.0f} ms")
    d, w = results["default"], results["without cuDNN"]
    print(f"sdpa_new_shape first_ms={d['first_ms']:.3f},{w['first_ms']:.3f} again_ms={d['again_ms']:.3f},{w['again_ms']:.3f}")
    return results


if __name__ == "__main__":
    main()
