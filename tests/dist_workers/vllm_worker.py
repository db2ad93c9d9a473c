"""Worker for tests/test_vllm.py: colocated vLLM on 2 CPU ranks (torchrun, gloo, external_launcher)
or in one plain process.

argv: out_dir, tensor_parallel_size (under torchrun, 2: one tensor group; 1: two data-parallel engines).
1. Greedy tokens, log-probs and finish reasons of vLLM equal those of Hugging Face `generate` on
   the same weights; each rank passes its own prompts and gets exactly those back.
2. After an FSDP2 optimizer update and `sleep()` / `wake_up(actor)` (weight sync), vLLM's greedy
   output equals Hugging Face's on the updated weights (and differs from the old output).
3. Sampling: reproducible from a seed, EOS inside the mask, log-probs = log-softmax(logits / T).
4. Bad requests raise ValueError with a message (recorded here, asserted by the test).
Each rank writes rank<r>.json into out_dir.
"""

import os
import sys

import torch
import torch.nn.functional as F

import gae  # noqa: F401  (as in train.py: numba's llvmlite is loaded when vLLM's CPU worker starts)
from common import PROMPTS, tiny_actor, write_result
from fsdp_utils import init_distributed, shard_model
from support.checkpoints import export_hf_checkpoint, iter_full_weights
from rollout import HFRollout
from support.vllm_rollout import VLLMRollout

out_dir, tp = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
info = init_distributed()
tokenizer, model = tiny_actor(seed=0)
path = os.path.join(out_dir, "actor")
export_hf_checkpoint(model, tokenizer, path)  # rank 0 writes, every rank waits
# One process: start from random ("dummy") weights, so the first sync_weights is what loads them.
load_format = "dummy" if info.world_size == 1 else "auto"
engine = VLLMRollout(path, tokenizer, tensor_parallel_size=tp, max_model_len=128, load_format=load_format)
# Ranks hold different prompts (and counts): rank 0 the first three, rank 1 the last two.
split = {1: [PROMPTS], 2: [PROMPTS[:3], PROMPTS[3:]]}[info.world_size]
mine = [tokenizer(p).input_ids for p in split[info.rank]]


def compare(hf_model):
    ref = HFRollout(hf_model, tokenizer).generate(mine, 24, temperature=0)
    got = engine.generate(mine, 24, temperature=0)
    return got, {
        "same_prompts": torch.equal(ref.prompt_ids, got.prompt_ids),
        "same_tokens": torch.equal(ref.response_ids, got.response_ids),
        "same_mask": torch.equal(ref.response_mask, got.response_mask),
        "logprob_max_diff": (ref.logprobs - got.logprobs).abs().max().item(),
        "finish_reasons": [ref.finish_reasons, got.finish_reasons],
    }


result = {"generate_before_weights_refused": None}
if load_format == "dummy":
    try:
        engine.generate(mine, 4)
    except RuntimeError as err:
        result["generate_before_weights_refused"] = str(err)
    engine.sync_weights(model)
before, result["initial"] = compare(model)

# An update that moves the outputs: one AdamW step towards a random continuation.
actor = shard_model(tiny_actor(seed=0)[1])
opt = torch.optim.AdamW(actor.parameters(), lr=3e-2)
g = torch.Generator().manual_seed(info.rank)
ids = torch.randint(3, len(tokenizer), (2, 16), generator=g)
loss = actor(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
engine.sleep()  # a no-op on CPU; on GPU it frees memory for the update above
engine.wake_up(actor)  # weights -> load -> KV cache, then reset the prefix cache
updated = tiny_actor(seed=0)[1]
updated.load_state_dict({n: t for bucket in iter_full_weights(actor) for n, t in bucket}, strict=False)
after, result["synced"] = compare(updated)
result["synced"]["changed_logprob_max"] = (before.logprobs - after.logprobs).abs().max().item()

# Sampling: a seed reproduces the rollout; the stopping EOS is inside the mask.
s1 = engine.generate(mine, 24, temperature=1.0, seed=5)
s2 = engine.generate(mine, 24, temperature=1.0, seed=5)
last = s1.response_ids.gather(1, (s1.lengths - 1).unsqueeze(1)).squeeze(1)
result["sampled"] = {
    "reproducible": torch.equal(s1.response_ids, s2.response_ids) and torch.equal(s1.logprobs, s2.logprobs),
    "eos_last_when_stop": all((tok == tokenizer.eos_token_id) == (r == "stop") for tok, r in zip(last.tolist(), s1.finish_reasons)),
    "padding_zero": bool(((s1.logprobs != 0) <= (s1.response_mask == 1)).all()),
    "rows": len(s1),
}
warm = engine.generate(mine, 24, temperature=0.7, seed=3)
with torch.no_grad():
    logits = warm.response_slice(updated(**warm.model_inputs()).logits) / 0.7
expected = torch.gather(F.log_softmax(logits, -1), -1, warm.response_ids.unsqueeze(-1)).squeeze(-1)
result["sampled"]["tempered_logprob_max_diff"] = (expected * warm.response_mask - warm.logprobs).abs().max().item()
result["sampled"]["dtypes"] = [str(warm.logprobs.dtype), str(warm.response_mask.dtype)]

bad_requests = {
    "empty_prompt": lambda: engine.generate([[]], 4),
    "too_long": lambda: engine.generate(mine, 200),
    "out_of_vocab": lambda: engine.generate([[len(tokenizer) + 100]], 4),
    "tp_not_dividing_world": lambda: VLLMRollout(path, tokenizer, tensor_parallel_size=3),
}
result["errors"] = {}
for name, call in bad_requests.items():
    try:
        call()
        result["errors"][name] = None
    except ValueError as err:
        result["errors"][name] = str(err)
write_result(out_dir, info.rank, result)
