"""Benchmark of decoupled GAE (paper §3.3) at long-CoT lengths.

For B=64, T=8192 (half the rows padded to random lengths) and B=16, T=32768 it times the
reference loop over tokens (`gae.gae_reference`, once per lambda, as decoupled GAE needs both),
`gae.decoupled_gae` (on CPU inputs: the compiled one-pass loop), and a memory bound: cloning the
three inputs and the two outputs once. For comparison it also times the chunked scan that GPU
inputs take, forced here on the CPU (`--chunk` sets its chunk size).

CPU timings of fresh [B, T] buffers depend on the allocator: by default glibc hands freed memory
back to the OS, so every new 2 MB buffer page-faults, which costs more than the arithmetic and
swamps both the scan and the copy bound. The benchmark therefore runs twice: with the default
allocator, then with glibc told to keep freed memory (mallopt; what jemalloc/tcmalloc or CUDA's
caching allocator do anyway). The last line reports the second, B=64 T=8192 run:
    gae speedup_vs_loop=<x> over_copy_bound=<y>          (goal: >= 100 and <= 3)

    .venv/bin/python bench/gae_bench.py [--threads 1] [--chunk 16] [--repeats 20]
"""

import argparse
import ctypes
import os
import statistics
import time

import torch

import gae
import gae_fast

SHAPES = ((64, 8192), (16, 32768))


def make_batch(batch, length, seed=0):
    """Outcome reward +-1 on the last token, values in [-1, 1]; half the rows padded."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.full((batch,), length)
    half = batch // 2
    lengths[half:] = torch.randint(1, length + 1, (batch - half,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = torch.randint(0, 2, (batch,), generator=gen).float() * 2 - 1
    values = (torch.rand(batch, length, generator=gen) * 2 - 1) * mask
    return rewards, values, mask


def time_loop(batch, repeats):
    """Median seconds of the reference loop for both lambdas (it does not allocate [B, T]
    buffers per step, so the allocator mode does not matter for it)."""
    rewards, values, mask = batch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gae.gae_reference(rewards, values, mask, 1.0, 0.95)
        gae.gae_reference(rewards, values, mask, 1.0, 1.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chunked_scan(rewards, values, mask):
    """decoupled_gae through the chunked scan, as GPU inputs run it."""
    compiled_loop_applies = gae_fast.compiled_loop_applies
    gae_fast.compiled_loop_applies = lambda *tensors: False
    try:
        return gae.decoupled_gae(rewards, values, mask, 1.0, 0.95, 1.0)
    finally:
        gae_fast.compiled_loop_applies = compiled_loop_applies


def time_fast_and_copy(batch, repeats):
    """Median and min seconds of decoupled_gae and of the copy bound, alternated so both meet
    the same allocator and cache state, after one warm-up call each; then, timed on its own so
    that it does not disturb the two, the median of the chunked scan."""
    rewards, values, mask = batch
    fast = lambda: gae.decoupled_gae(rewards, values, mask, 1.0, 0.95, 1.0)  # noqa: E731
    copy = lambda: [x.clone() for x in (rewards, values, mask, rewards, values)]  # noqa: E731
    fast(), copy()
    times = {fast: [], copy: []}
    for _ in range(repeats):
        for fn in (copy, fast):
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    chunked_scan(rewards, values, mask)
    scan = []
    for _ in range(repeats):
        start = time.perf_counter()
        chunked_scan(rewards, values, mask)
        scan.append(time.perf_counter() - start)
    return [(statistics.median(times[fn]), min(times[fn])) for fn in (fast, copy)] + [(statistics.median(scan), min(scan))]


def keep_freed_memory():
    """Tell glibc not to return freed memory to the OS (no-op elsewhere). Irreversible."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    return bool(libc.mallopt(m_trim_threshold, 1 << 30)) and bool(libc.mallopt(m_mmap_threshold, 1 << 25))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: robust to a shared CPU)")
    parser.add_argument("--chunk", type=int, default=gae_fast.CHUNK, help="chunk size of the chunked scan (gae_fast.CHUNK)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gae_fast.CHUNK = args.chunk
    print(f"torch {torch.__version__}, threads={args.threads}, cpus={os.cpu_count()}, chunk={gae_fast.CHUNK}", flush=True)

    batches = {shape: make_batch(*shape) for shape in SHAPES}
    loop = {}
    for shape, batch in batches.items():
        repeats = 3 if shape[1] <= 8192 else 1  # the 32k loop takes seconds: timed once
        loop[shape] = time_loop(batch, repeats)
        print(f"B={shape[0]:3d} T={shape[1]:6d}: reference loop {loop[shape] * 1e3:8.1f} ms (median of {repeats})", flush=True)

    results = {}
    for mode in ("default", "keep-freed"):
        if mode == "keep-freed" and not keep_freed_memory():
            print("mallopt unavailable: skipping the keep-freed allocator run")
            break
        for shape, batch in batches.items():
            (fast, fast_min), (copy, copy_min), (scan, _) = time_fast_and_copy(batch, args.repeats)
            results[mode, shape] = (loop[shape] / fast, fast / copy)
            print(
                f"[{mode:10s}] B={shape[0]:3d} T={shape[1]:6d}: decoupled_gae {fast * 1e3:6.2f} ms (min "
                f"{fast_min * 1e3:.2f}) | copy bound {copy * 1e3:5.2f} ms (min {copy_min * 1e3:.2f}) | "
                f"speedup {loop[shape] / fast:5.0f}x | over copy {fast / copy:5.2f} | "
                f"chunked scan {scan * 1e3:5.2f} ms ({scan / copy:.2f} over copy)",
                flush=True,
            )

    print("summary (medians; speedup = loop / decoupled_gae, over copy = decoupled_gae / copy bound):")
    for (mode, shape), (speedup, over) in results.items():
        goals = "both goals met" if speedup >= 100 and over <= 3 else "goal missed"
        print(f"  {mode:10s} B={shape[0]} T={shape[1]}: speedup {speedup:.0f}x, over copy bound {over:.2f}"
              f"{f' ({goals})' if shape == SHAPES[0] else ''}")
    speedup, over = results.get(("keep-freed", SHAPES[0]), results[("default", SHAPES[0])])
    print(f"gae speedup_vs_loop={speedup:.0f} over_copy_bound={over:.2f}")


if __name__ == "__main__":
    main()
