"""Worker for tests/test_train.py: vLLM opens the actor that train.py exported (<run>/actor_hf) as it
is, reading its weights from disk, and generates what Hugging Face `generate` does from
`from_pretrained` of the same directory (greedy tokens, and log-probs to kernel precision).

argv: out_dir, the exported actor's directory. Writes rank0.json.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import gae  # noqa: F401  (as in train.py: numba's llvmlite is loaded when vLLM's CPU worker starts)
from common import write_result
from support.data import encode_prompt
from rollout import HFRollout
from support.vllm_rollout import VLLMRollout

out_dir, path = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(path)  # the exported tokenizer, chat template included
prompts = [encode_prompt(tokenizer, question) for question in ("12*2^c=?", "345*2^d=?", "7*2^a=?")]
got = VLLMRollout(path, tokenizer, max_model_len=128).generate(prompts, 16, temperature=0)
ref = HFRollout(AutoModelForCausalLM.from_pretrained(path), tokenizer).generate(prompts, 16, temperature=0)
write_result(out_dir, 0, {
    "same_tokens": torch.equal(ref.response_ids, got.response_ids),
    "generated": int(got.response_mask.sum().item()),
    "logprob_max_diff": (ref.logprobs - got.logprobs).abs().max().item(),
})
