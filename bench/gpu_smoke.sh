#!/usr/bin/env bash
# GPU smoke test of the scale path: decoupled GAE's GPU path, vLLM on GPU (bf16, sleep mode), weight
# sync, FSDP2 with mixed precision / activation checkpointing / CPU offload under torchrun. About
# 2-4 minutes.
#
#   PYTHON=/path/to/python bench/gpu_smoke.sh        # needs CUDA torch 2.13 and vllm==0.32.0 (GPU wheel)
#
# UNTESTED: written on a machine without a GPU. The CPU versions of every check pass in
# tests/test_vllm.py and tests/test_distributed.py; this script is their GPU counterpart.
# Part 1 needs one GPU; part 2 runs only with two or more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# The project, and the helpers its checks share with bench/ and the multi-process tests.
export PYTHONPATH=$PWD:$PWD/bench:$PWD/tests/dist_workers VLLM_ENABLE_V1_MULTIPROCESSING=0
unset PYTORCH_CUDA_ALLOC_CONF  # expandable_segments breaks vLLM sleep mode (vLLM #14189)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

nvidia-smi --query-gpu=name,memory.total --format=csv
"$PY" - <<'EOF'
import torch, vllm
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__}, vllm {vllm.__version__}, {torch.cuda.device_count()} GPU(s)")
EOF

echo "== part 0: decoupled GAE on the GPU (the chunked scan) against the CPU's compiled loop"
"$PY" - <<'EOF'
import time
import torch
import gae
from gae_bench import make_batch
for shape in ((64, 8192), (16, 32768)):
    cpu = make_batch(*shape)
    want = gae.decoupled_gae(*cpu, 1.0, 0.95, 1.0)
    gpu = [x.cuda() for x in cpu]
    got = gae.decoupled_gae(*gpu, 1.0, 0.95, 1.0)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        got = gae.decoupled_gae(*gpu, 1.0, 0.95, 1.0)
    torch.cuda.synchronize()
    error = max((g.cpu() - w).abs().max().item() for g, w in zip(got, want))
    print(f"B={shape[0]} T={shape[1]}: GPU scan {(time.perf_counter() - start) / 20 * 1e3:.2f} ms, max |GPU - CPU| {error:.1e}")
    assert error <= 1e-5
EOF

cat > "$WORK/smoke.py" <<'EOF'
"""One process per GPU. The reference is Hugging Face in fp32 on CPU; vLLM runs in bf16, so greedy
agreement is measured, not required to be exact (a random model has near-ties, and a response
diverges for good after its first different token). Weights that failed to load give ~0."""
import os, sys, time
import torch
from common import PROMPTS, tiny_actor
from fsdp_utils import export_hf_checkpoint, init_distributed, iter_full_weights, shard_model
from rollout import HFRollout, VLLMRollout

work, offload = sys.argv[1], sys.argv[2] == "offload"
info = init_distributed()
tokenizer, model = tiny_actor()
path = os.path.join(work, "actor")
export_hf_checkpoint(model, tokenizer, path)
engine = VLLMRollout(path, tokenizer, tensor_parallel_size=info.world_size, max_model_len=128,
                     gpu_memory_utilization=0.3)
prompts = [tokenizer(p).input_ids for p in PROMPTS]

def same_fraction(a, b):
    """Share of equal token positions; responses of different widths are padded with -1."""
    width = max(a.shape[1], b.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)
    return (pad(a) == pad(b)).float().mean().item()

def agreement(hf_model):
    ref = HFRollout(hf_model, tokenizer).generate(prompts, 24, temperature=0)
    got = engine.generate(prompts, 24, temperature=0)
    return same_fraction(ref.response_ids, got.response_ids), got

same, before = agreement(tiny_actor()[1])
print(f"[rank {info.rank}] initial greedy token agreement vLLM vs HF (bf16): {same:.3f}")
assert same >= 0.75, "vLLM and HF disagree on most tokens: weights not loaded as expected"

actor = shard_model(tiny_actor()[1].to(info.device), mixed_precision=True,
                    activation_checkpointing=True, cpu_offload=offload)
opt = torch.optim.AdamW(actor.parameters(), lr=3e-2)
ids = torch.randint(3, len(tokenizer), (2, 16), device=info.device)
actor(input_ids=ids, labels=ids).loss.backward()
opt.step()

free_awake = torch.cuda.mem_get_info()[0]
engine.sleep()
torch.cuda.synchronize()
free_asleep = torch.cuda.mem_get_info()[0]
print(f"[rank {info.rank}] sleep freed {(free_asleep - free_awake) / 2**30:.1f} GiB")
assert free_asleep - free_awake > 0.5 * 2**30, "sleep() freed almost nothing"
start = time.perf_counter()
engine.wake_up(actor)  # weights -> load -> KV cache
print(f"[rank {info.rank}] wake_up + sync {time.perf_counter() - start:.2f} s")

updated = tiny_actor()[1]
updated.load_state_dict({n: t.float().cpu() for b in iter_full_weights(actor) for n, t in b}, strict=False)
same, after = agreement(updated)
changed = 1.0 - same_fraction(before.response_ids, after.response_ids)
print(f"[rank {info.rank}] after sync: agreement {same:.3f}, tokens changed by the update {changed:.3f}")
assert same >= 0.75 and changed > 0.0
print(f"[rank {info.rank}] OK")
EOF

echo "== part 1: one GPU, single process"
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$PY" "$WORK/smoke.py" "$WORK/p1" none

if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  echo "== part 2: torchrun on 2 GPUs, FSDP2 + tensor parallel 2, with and without CPU offload"
  "$PY" -m torch.distributed.run --nproc_per_node 2 "$WORK/smoke.py" "$WORK/p2" none
  "$PY" -m torch.distributed.run --nproc_per_node 2 "$WORK/smoke.py" "$WORK/p3" offload
else
  echo "== part 2 skipped: fewer than 2 GPUs"
fi
echo "== memory plan for the 32B preset"
"$PY" memory_plan.py
echo "gpu_smoke: all checks passed"
