"""Host memory of loading actor + critic from a Hugging Face checkpoint (`train.load_actor`,
`train.load_critic`), per rank, against that rank's share of the two models' fp32 parameters.

    torchrun --nproc_per_node 2 bench/load_bench.py     # sharded loading (2 CPU ranks, gloo)
    python bench/load_bench.py                          # one process: from_pretrained

The bench writes its own checkpoint once (a ~310M-parameter Qwen2, bf16 as released models are,
untied head as in Qwen2.5-32B) into --out, from a child process so that no rank's heap keeps its
memory. Each rank then resets its peak resident memory (/proc/self/clear_refs), loads the actor
and the critic (pi_SFT + fresh head) as train.py does, and reads the peak back. It prints, last:

    load peak_rss_per_rank_over_shards=<x> seconds=<s>

x = the highest rise of any rank's resident memory during loading / ((actor + critic fp32 bytes)
/ world size): 1 means each rank holds its own shards and nothing else. s = the slowest rank's
loading time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# head_dim 64; 22 layers of 11.0M + two 33.6M embeddings (32k vocabulary, untied): 309M parameters.
SHAPE = dict(hidden_size=1024, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=2, head_dim=64,
             intermediate_size=2816, vocab_size=32768, tie_word_embeddings=False, max_position_embeddings=4096)
GIB = 1024**3


def write_checkpoint(path: str) -> None:
    """A randomly initialised Qwen2 of SHAPE, saved in bf16 (run in a child process)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), dtype=torch.bfloat16)
    model.save_pretrained(path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, bf16")


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/load_bench", help="where the bench's checkpoint is written (once)")
    p.add_argument("--write-checkpoint", metavar="PATH", help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.write_checkpoint:
        return write_checkpoint(args.write_checkpoint)

    import gc

    import torch
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (code, not data: imported before measuring)

    import fsdp_utils
    import train
    from support.config import Config

    torch.set_num_threads(1)
    info = fsdp_utils.init_distributed()
    path = os.path.join(args.out, "qwen2-310m-bf16")
    if fsdp_utils.is_main() and not os.path.exists(path):
        os.makedirs(args.out, exist_ok=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--write-checkpoint", path], check=True)
    fsdp_utils.barrier()

    cfg = Config()
    gc.collect()
    before = status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak (VmHWM) to the current RSS
            f.write("5")
    except OSError as err:
        raise SystemExit(f"error: cannot reset the peak resident memory via /proc/self/clear_refs ({err})")
    start = time.perf_counter()
    actor = train.load_actor(cfg, path, info)
    critic = train.load_critic(cfg, path, info)
    seconds = time.perf_counter() - start
    rise = (status_kib("VmHWM") - before) * 1024
    fp32_bytes = 4 * sum(p.numel() for m in (actor, critic) for p in m.parameters())  # global sizes
    share = fp32_bytes / info.world_size
    mine = {"rank": info.rank, "rise_gib": rise / GIB, "share_gib": share / GIB, "x": rise / share,
            "seconds": seconds}
    ranks = [mine]
    if info.world_size > 1:
        ranks = [None] * info.world_size
        torch.distributed.all_gather_object(ranks, mine)
    if fsdp_utils.is_main():
        print(f"{path}: actor {sum(p.numel() for p in actor.parameters()) / 1e6:.0f}M + critic "
              f"{sum(p.numel() for p in critic.parameters()) / 1e6:.0f}M parameters = {fp32_bytes / GIB:.2f} GiB "
              f"in fp32, world size {info.world_size}")
        for r in ranks:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
        print(f"load peak_rss_per_rank_over_shards={max(r['x'] for r in ranks):.3f} "
              f"seconds={max(r['seconds'] for r in ranks):.1f}")
    fsdp_utils.close_distributed()
    fsdp_utils.exit_now_if_gloo()


if __name__ == "__main__":
    main()
