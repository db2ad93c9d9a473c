#!/usr/bin/env bash
# GPU smoke test, for a bare GPU machine: python3 with a CUDA build of torch, transformers and
# numba (Triton comes with CUDA torch); no package index. The project's small pure-Python
# dependencies (tyro, math-verify and theirs) are unpacked from bench/wheels/ into a temporary
# folder on PYTHONPATH: run bench/fetch_wheels.sh where PyPI is reachable and bring them along.
# TensorBoard must be installed (train.py logs to it). The parts:
#   0. decoupled GAE on the GPU (the Triton kernel) against the CPU loop, B=64/512 T=8192, timed
#      against its copy bound; the CPU loop's rows in parallel, timed with all cores;
#   1. the tiny pipeline (train.py, every stage) in one process with --rollout hf, bf16 and
#      activation checkpointing (FSDP2 over a group of one rank);
#   2. the same under torchrun --nproc_per_node 1, with the throughput levers on;
#   3. bench/mfu_bench.py: the PPO actor update of a Qwen2.5-1.5B shape, levers off, then on, then
#      levers off with new shapes at every step;
#   4. only where vLLM imports: vLLM on the GPU (bf16, sleep mode), weight sync, FSDP2 with CPU
#      offload (two GPUs: tensor parallel 2 under torchrun);
#   5. the memory plan of the 32B preset;
#   6. bench/sdpa_shapes_bench.py (SDPA's cost of a new shape, with cuDNN and without), then
#      bench/rollout_bench.py on the GPU: `generate` against the fast HF path (bf16, pi_SFT's shape,
#      64 x up to 300 tokens, with EOS and without), and where each spends its host and GPU time;
#   7. train.py with the qwen2.5-1.5b preset's settings (bf16, activation checkpointing, micro-batches
#      of one row, the paper's learning rates) on a random model of Qwen2.5-0.5B's decoder shape and
#      the built-in task's tokenizer (--model), --rollout hf, responses cut to 512 tokens: 2
#      value-pretraining and 2 PPO steps of 64 responses, an evaluation, the bf16 export. (A random
#      model ends most responses at its EOS within ~100 tokens; a batch decodes as long as its longest.)
# GPU time is scarce, so one failed part does not stop the others: each part runs on its own, each
# command in it bounded by the part's time limit, and a summary of every part's result and seconds
# ends the output (exit status 1 if any part failed; a part that does not apply here, such as part 4
# without vLLM, is reported as skipped). GPU_SMOKE_PARTS picks parts and their order;
# GPU_SMOKE_LIMIT_S replaces every part's time limit (seconds).
#
#   PYTHON=python3 bench/gpu_smoke.sh
#   GPU_SMOKE_PARTS="0 3 1" PYTHON=python3 bench/gpu_smoke.sh           # these parts, in this order
#   GPU_SMOKE_DRY_RUN=1 PYTHON=.venv/bin/python bench/gpu_smoke.sh   # on a CPU: each part's code, tiny
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=${GPU_SMOKE_DRY_RUN:-0}
unset PYTORCH_CUDA_ALLOC_CONF  # expandable_segments breaks vLLM sleep mode (vLLM #14189)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if compgen -G "bench/wheels/*.whl" > /dev/null; then  # pure-Python wheels are zip files: unpacked, no pip
  for wheel in bench/wheels/*.whl; do "$PY" -m zipfile -e "$wheel" "$WORK/site"; done
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"  # the caller's own path kept, after the wheels
fi
# The project, and the helpers its checks share with bench/ and the multi-process tests.
export PYTHONPATH="$PWD:$PWD/bench:$PWD/tests/dist_workers${PYTHONPATH:+:$PYTHONPATH}" VLLM_ENABLE_V1_MULTIPROCESSING=0
HAVE_VLLM=$("$PY" - <<'EOF'
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "numba", "tyro", "math_verify", "tensorboard", "tqdm")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"error: missing {', '.join(missing)} (tyro, math_verify: run bench/fetch_wheels.sh where PyPI is reachable)")
print(int(importlib.util.find_spec("vllm") is not None))
EOF
) || exit 1
if [ "$DRY" = 1 ]; then
  echo "== DRY RUN on the CPU: tiny shapes, no GPU figures"
  GPU_FLAGS=(--no-mixed-precision) ; MFU_FLAGS=(--dry-run --rows 4 --repeats 1) ; GAE_FLAGS=(--device cuda --dry-run) ; HAVE_VLLM=0
  ROLLOUT_FLAGS=(--models tiny --prompts 4 --new-tokens 8 --repeats 1) ; SDPA_FLAGS=(--device cpu --shapes 4)
  SHAPE_0P5B=(num_layers=2 hidden_size=128 num_heads=2 num_kv_heads=1 intermediate_size=256)
  PRESET_RUN=(--max-new-tokens 24 --max-prompt-tokens 64 --prompts-per-step 8 --task-eval-size 4)
  PIPELINE=(--sft-steps 4 --task-train-size 64 --task-eval-size 4 --prompts-per-step 4 --samples-per-prompt 2
            --max-new-tokens 24 --micro-batch-size 3 --num-minibatches 2 --eval-samples 2 --value-pretrain-steps 1 --steps 2)
else
  nvidia-smi --query-gpu=name,memory.total --format=csv
  # never empty: "${A[@]}" of an empty array is an unbound variable under set -u before bash 4.4
  GPU_FLAGS=(--mixed-precision) ; MFU_FLAGS=(--repeats 2) ; GAE_FLAGS=(--device cuda)
  ROLLOUT_FLAGS=(--device cuda --models sft --new-tokens 300 --repeats 2) ; SDPA_FLAGS=(--device cuda)
  PIPELINE=(--sft-steps 100 --value-pretrain-steps 3 --steps 3)
  SHAPE_0P5B=(num_layers=24 hidden_size=896 num_heads=14 num_kv_heads=2 intermediate_size=4864)
  PRESET_RUN=(--max-new-tokens 512 --max-prompt-tokens 64 --prompts-per-step 64 --task-eval-size 32)
fi
"$PY" -c 'import torch, transformers, numba; print(f"torch {torch.__version__} (CUDA: {torch.cuda.is_available()}), transformers {transformers.__version__}, numba {numba.__version__}")'

write_smoke_py() {
cat > "$WORK/smoke.py" <<'EOF'
"""One process per GPU. The reference is Hugging Face in fp32 on CPU; vLLM runs in bf16, so greedy
agreement is measured, not required to be exact (a random model has near-ties, and a response
diverges for good after its first different token). Weights that failed to load give ~0."""
import os, sys, time
import torch
from common import PROMPTS, tiny_actor
from fsdp_utils import init_distributed, shard_model
from support.checkpoints import export_hf_checkpoint, iter_full_weights
from rollout import HFRollout
from support.vllm_rollout import VLLMRollout

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
}

# Each command of a part is stopped at the part's limit (LIMIT, seconds): a hang costs one part.
# SIGKILL only 45 s after SIGTERM, past torchrun's 30 s grace for its workers (they run in sessions
# of their own, out of timeout's reach). Without a terminal (the device machine), timeout signals
# the command's whole process group, so that its children (rollout_bench's engine process, the
# graders) stop with it instead of running on the GPU under the next part; at a terminal,
# --foreground lets Ctrl-C reach the command, and signals only the command itself at the limit.
if [ -t 0 ]; then
  bounded() { timeout --foreground --kill-after 45 "$LIMIT" "$@"; }
else
  bounded() { timeout --kill-after 45 "$LIMIT" "$@"; }
fi
# A part that does not apply here says why; the summary reports it as skipped, not as passed.
skip() { echo "== part $part skipped: $1"; echo "$1" > "$WORK/part$part.skipped"; }

part0() {
  echo "== part 0: decoupled GAE on the GPU against the CPU loop (max difference <= 1e-5), and the CPU loop"
  bounded "$PY" bench/gae_bench.py "${GAE_FLAGS[@]}"
  bounded "$PY" bench/gae_bench.py --threads "$(nproc)" --repeats 10 | tail -5
}

part1() {
  echo "== part 1: the tiny pipeline in one process, --rollout hf, bf16 + activation checkpointing"
  bounded "$PY" train.py --out-dir "$WORK/runs" --run-name single --rollout hf "${PIPELINE[@]}" \
    "${GPU_FLAGS[@]}" --activation-checkpointing
  test -f "$WORK/runs/single/summary.json"
}

part2() {
  echo "== part 2: the same under torchrun (one rank), with the throughput levers"
  bounded "$PY" -m torch.distributed.run --nproc_per_node 1 train.py --out-dir "$WORK/runs" --run-name torchrun \
    --rollout hf "${PIPELINE[@]}" "${GPU_FLAGS[@]}" --activation-checkpointing --checkpoint-fraction 0.5 \
    --micro-batch-tokens 2048 --logprob-chunk-tokens 256
  test -f "$WORK/runs/torchrun/summary.json"
}

part3() {
  echo "== part 3: MFU of the PPO actor update (Qwen2.5-1.5B shape, 8 rows of 1k + 5.4k-7.2k tokens)"
  echo "-- levers off (micro-batches of one row, whole logits, every layer recomputed), and its profile"
  bounded "$PY" bench/mfu_bench.py "${MFU_FLAGS[@]}" --profile
  echo "-- token budget + log-probs from hidden states"
  bounded "$PY" bench/mfu_bench.py "${MFU_FLAGS[@]}" --micro-batch-tokens 16384 --logprob-chunk-tokens 4096
  echo "-- and compiled decoder layers, half the layers recomputed"
  bounded "$PY" bench/mfu_bench.py "${MFU_FLAGS[@]}" --micro-batch-tokens 16384 --logprob-chunk-tokens 4096 \
    --compile-layers --checkpoint-fraction 0.5
  echo "-- the same with micro-batches of one row (no padding)"
  bounded "$PY" bench/mfu_bench.py "${MFU_FLAGS[@]}" --logprob-chunk-tokens 4096 --compile-layers --checkpoint-fraction 0.5
  echo "-- levers off, a batch of new lengths for every step (new shapes, as a run meets them)"
  bounded "$PY" bench/mfu_bench.py "${MFU_FLAGS[@]}" --fresh-batches
}

part4() {
  if [ "$DRY" = 1 ]; then skip "the dry run leaves vLLM out (its CPU build is tested by tests/test_vllm.py)"; return; fi
  if [ "$HAVE_VLLM" != 1 ]; then skip "vLLM does not import here"; return; fi
  write_smoke_py
  echo "== part 4: vLLM on one GPU, single process"
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} bounded "$PY" "$WORK/smoke.py" "$WORK/p1" none
  gpus=$(bounded "$PY" -c 'import torch; print(torch.cuda.device_count())')  # a failure ends the part
  if [ "$gpus" -ge 2 ]; then
    echo "== part 4b: torchrun on 2 GPUs, FSDP2 + tensor parallel 2, with and without CPU offload"
    bounded "$PY" -m torch.distributed.run --nproc_per_node 2 "$WORK/smoke.py" "$WORK/p2" none
    bounded "$PY" -m torch.distributed.run --nproc_per_node 2 "$WORK/smoke.py" "$WORK/p3" offload
  else
    echo "== part 4b skipped: fewer than 2 GPUs"  # part 4 itself ran: not a skipped part
  fi
}

part5() {
  echo "== part 5: memory plan for the 32B preset"
  bounded "$PY" -m support.memory_plan
}

part6() {
  echo "== part 6: sampling on the GPU, Hugging Face generate against the fast HF path (bf16)"
  echo "-- what a new (rows, keys) shape costs a decoding step's SDPA, with cuDNN and without"
  bounded "$PY" bench/sdpa_shapes_bench.py "${SDPA_FLAGS[@]}"
  echo "-- rows stop at their EOS (the fast path's batch shrinks), then every row runs to the limit; each profiled"
  bounded "$PY" bench/rollout_bench.py "${ROLLOUT_FLAGS[@]}" --backends hf hf-fast --profile
  bounded "$PY" bench/rollout_bench.py "${ROLLOUT_FLAGS[@]}" --backends hf hf-fast --no-eos --profile
}

part7() {
  echo "== part 7: the qwen2.5-1.5b preset's settings on a random model of Qwen2.5-0.5B's decoder shape, --rollout hf"
  bounded "$PY" - "$WORK/model-0.5b" "${SHAPE_0P5B[@]}" <<'EOF'
import sys
from support.task import build_tokenizer, make_tiny_model
tokenizer = build_tokenizer()
shape = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
model = make_tiny_model(tokenizer, seed=0, max_position_embeddings=4096, **shape)
model.save_pretrained(sys.argv[1])
tokenizer.save_pretrained(sys.argv[1])
print(f"{sys.argv[1]}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {shape}")
EOF
  bounded "$PY" train.py --preset qwen2.5-1.5b --model "$WORK/model-0.5b" --out-dir "$WORK/runs" --run-name preset \
    --rollout hf "${PRESET_RUN[@]}" --value-pretrain-steps 2 --steps 2 --eval-samples 1 "${GPU_FLAGS[@]}"
  test -f "$WORK/runs/preset/summary.json"
  "$PY" -c 'import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows: print({k: round(v, 2) for k, v in r.items() if k.startswith("timing_s/") or k in ("step", "response_length/mean")})' \
    "$WORK/runs/preset/metrics.jsonl"
}

# Limits in seconds, then the parts in the order asked for. A part runs in a subshell with -e, so its
# first failing command ends that part and no other.
# GPU_SMOKE_LIMIT_S sets every part's limit at once.
declare -A LIMITS=([0]=120 [1]=180 [2]=180 [3]=240 [4]=300 [5]=60 [6]=180 [7]=420)
if [ -n "${GPU_SMOKE_LIMIT_S:-}" ]; then
  [[ "$GPU_SMOKE_LIMIT_S" =~ ^[1-9][0-9]*$ ]] || { echo "error: GPU_SMOKE_LIMIT_S: seconds, a whole number > 0"; exit 2; }
  for part in "${!LIMITS[@]}"; do LIMITS[$part]=$GPU_SMOKE_LIMIT_S; done
fi
PARTS=${GPU_SMOKE_PARTS:-0 1 2 3 4 5 6 7}
for part in $PARTS; do  # every name checked before any GPU time is spent
  if [ -z "${LIMITS[$part]:-}" ]; then echo "error: GPU_SMOKE_PARTS: no part $part (parts are 0-7)"; exit 2; fi
done
SUMMARY=() FAILED=0 SKIPPED=""
for part in $PARTS; do
  LIMIT=${LIMITS[$part]} started=$SECONDS
  (set -e; "part$part")
  status=$?
  # timeout exits 124, or 137 where it had to SIGKILL; a 137 within the limit is another kill (memory)
  over=$([ "$status" = 124 ] || { [ "$status" = 137 ] && [ $((SECONDS - started)) -ge "$LIMIT" ]; } && echo ', over its time limit')
  if [ "$status" != 0 ]; then result="FAILED (exit $status$over)"; FAILED=1
  elif [ -f "$WORK/part$part.skipped" ]; then result="skipped ($(cat "$WORK/part$part.skipped"))"; SKIPPED+=" $part"
  else result=ok; fi
  SUMMARY+=("part $part: $result in $((SECONDS - started)) s")
done
echo "== summary$([ "$DRY" = 1 ] && echo ' (dry run on the CPU)')"
printf '  %s\n' "${SUMMARY[@]}"
if [ "$FAILED" = 1 ]; then echo "gpu_smoke: some parts failed"; exit 1; fi
echo "gpu_smoke: all checks passed$([ -n "$SKIPPED" ] && echo ", but for the skipped part(s)$SKIPPED")$([ "$DRY" = 1 ] && echo ' (dry run on the CPU)')"
