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
caching allocator do anyway). `--threads` sets torch's threads (the copy), which the loop's
rows also run on (gae_fast.compiled_gae gives numba torch's count). The last line reports the
second, B=64 T=8192 run:
    gae speedup_vs_loop=<x> over_copy_bound=<y>          (goal: >= 100 and <= 3)

With `--device cuda` it times the GPU instead, at B=64 and B=512, T=8192: `decoupled_gae` on CUDA
inputs (the Triton kernel where Triton imports, else the chunked scan), with a scalar and a
per-response lambda, against a copy bound (clone the three inputs, write two outputs) and the
chunked scan; each result must match the CPU loop to 1e-5. Last line, for B=64 and B=512:
    gae_gpu over_copy_bound=<x>,<y> per_row_lambda=<x>,<y>      (goal: <= 3)

    .venv/bin/python bench/gae_bench.py [--threads 1] [--chunk 16] [--repeats 20] [--device cuda]
"""

import argparse
import ctypes
import functools
import os
import statistics
import sys
import time

import torch

import gae
from support import gae_fast

SHAPES = ((64, 8192), (16, 32768))
GPU_SHAPES = ((64, 8192), (512, 8192))


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


def time_on(device, fn, repeats):
    """Median seconds of fn on `device` (synchronised around each call), after one warm-up call."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpu_main(repeats, device="cuda", shapes=GPU_SHAPES):
    """GPU timings (module docstring); asserts each result against the CPU loop. device="cpu"
    (--dry-run) only checks that this code runs: CPU inputs take the compiled loop."""
    kernel = gae_fast.triton_kernel() is not None and device == "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU dry run"
    print(f"torch {torch.__version__}, {name}, decoupled_gae path: "
          f"{'Triton kernel' if kernel else 'chunked scan (no Triton)' if device == 'cuda' else 'compiled loop'}", flush=True)
    time_cuda = functools.partial(time_on, device)
    over, per_row = [], []
    for shape in shapes:
        cpu = make_batch(*shape)
        rewards, values, mask = (x.to(device) for x in cpu)
        lam_rows = torch.linspace(0.9, 1.0, shape[0], dtype=torch.float64)
        lam_on_device = lam_rows.to(device)  # where train.py makes them, from the lengths on the device
        runs = {
            "scalar": (lambda: gae.decoupled_gae(rewards, values, mask, 1.0, 0.95, 1.0), 0.95),
            "per-row": (lambda: gae.decoupled_gae(rewards, values, mask, 1.0, lam_on_device, 1.0), lam_rows),
        }
        times = {}
        for name, (fn, lam) in runs.items():
            want = gae.decoupled_gae(*cpu, 1.0, lam, 1.0)
            error = max((g.cpu() - w).abs().max().item() for g, w in zip(fn(), want))
            assert error <= 1e-5, f"{name} lambda: max |GPU - CPU| = {error:.1e}"
            times[name] = (time_cuda(fn, repeats), error)
        copy = time_cuda(lambda: [x.clone() for x in (rewards, values, mask, rewards, values)], repeats)
        scan = time_cuda(lambda: chunked_scan(rewards, values, mask), repeats)
        over.append(times["scalar"][0] / copy)
        per_row.append(times["per-row"][0] / copy)
        print(f"B={shape[0]:3d} T={shape[1]}: decoupled_gae {times['scalar'][0] * 1e3:.3f} ms "
              f"(per-row lambda {times['per-row'][0] * 1e3:.3f} ms) | copy bound {copy * 1e3:.3f} ms | "
              f"over copy {over[-1]:.2f} (per-row {per_row[-1]:.2f}) | chunked scan {scan * 1e3:.3f} ms | "
              f"max |GPU - CPU| {times['scalar'][1]:.1e} (per-row {times['per-row'][1]:.1e})", flush=True)
    print(f"gae_gpu over_copy_bound={over[0]:.2f},{over[1]:.2f} per_row_lambda={per_row[0]:.2f},{per_row[1]:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: robust to a shared CPU)")
    parser.add_argument("--chunk", type=int, default=gae_fast.CHUNK, help="chunk size of the chunked scan (gae_fast.CHUNK)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: time the GPU paths")
    parser.add_argument("--dry-run", action="store_true", help="with --device cuda: run its code on the CPU, small")
    args = parser.parse_args()
    gae_fast.CHUNK = args.chunk
    if args.device == "cuda" and args.dry_run:
        return gpu_main(2, "cpu", shapes=((8, 1024), (64, 1024)))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: --device cuda: torch sees no CUDA device (--dry-run runs this mode's code on the CPU)")
        return gpu_main(args.repeats)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads={args.threads} (torch and numba), cpus={os.cpu_count()}, "
          f"chunk={gae_fast.CHUNK}", flush=True)

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
