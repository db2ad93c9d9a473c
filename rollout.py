"""Rollout: sample responses from the policy (Algorithm 1, line "collect trajectories").

A rollout returns everything the PPO step needs about the sampled tokens, in the README's tensor
layout: prompts left-padded to P, responses right-padded to T, and the model output at sequence
position P - 1 + t belongs to response token t.

Backends share one interface, `generate(prompt_ids, max_new_tokens, temperature, top_p, seed)`,
and return the batch on the device of the models that consume it (the trained actor's: `HFRollout`
samples with it, `VLLMRollout` runs on this rank's GPU beside it); from there on every stage builds
its tensors on `batch.device`:
- `HFRollout` (here): Hugging Face `generate`; the reference in tests.
- `FastHFRollout` (support/fast_rollout.py, the default): the same model through a decode loop of
  its own forward with a preallocated cache, grouped-query SDPA and finished rows dropped;
  `generate`'s sampling.
- `VLLMRollout` (support/vllm_rollout.py, the GPU presets): vLLM colocated with training on the
  same ranks (torchrun), weights synced from the (FSDP-sharded) actor after each update, sleeping
  while the trainer needs the GPU memory.
The sampling log-probs are log-softmax(logits / temperature) of the unmodified model (top-p only
truncates what is sampled), the same quantity `ppo.response_logprobs` recomputes for training;
vLLM's, with top_p < 1, are renormalised over the nucleus instead. PPO reads neither: it
recomputes pi_old with the trained actor (train.old_outputs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import GenerationConfig

from fsdp_utils import all_reduce, rank


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long, 1 on prompt tokens
    response_ids: torch.Tensor  # [B, T] long, right-padded
    response_mask: torch.Tensor  # [B, T] float32, 1 on generated tokens (EOS included)
    logprobs: torch.Tensor  # [B, T] float32, sampling log-probs (module docstring), 0 on padding
    finish_reasons: list[str]  # "stop" (ended with EOS) or "length" (hit max_new_tokens)

    @property
    def device(self) -> torch.device:
        return self.response_mask.device

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    @property
    def truncated(self) -> list[bool]:
        """Per response: cut off at max_new_tokens (no EOS)."""
        return [f == "length" for f in self.finish_reasons]

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """input_ids / attention_mask / position_ids of the whole [B, P + T] sequence. Without left
        padding the mask is None: every pad then comes after the real tokens, so the causal mask
        alone gives those tokens the same outputs, and SDPA skips the masked half of the scores
        instead of computing it (a fifth of the time of a forward and backward over
        640 tokens on a CPU). The SFT stage keeps its mask, so that its pi_SFT stays bit-identical to
        the one every result was measured from: on this task a change of rounding in SFT moves
        pi_SFT's pass@1 far more than the rounding itself would suggest."""
        attention_mask = torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)
        # Positions count real tokens only, so a left-padded prompt starts at position 0,
        # exactly as in `generate`.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        left_padded = bool((self.prompt_mask == 0).any())
        return {"input_ids": input_ids, "attention_mask": attention_mask if left_padded else None,
                "position_ids": position_ids}

    def response_slice(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-position model outputs [B, P+T, ...] -> the ones that predict response tokens [B, T, ...]."""
        P, T = self.prompt_ids.shape[1], self.response_ids.shape[1]
        return outputs[:, P - 1 : P - 1 + T]

    def trim(self) -> "RolloutBatch":
        """Drop the padding columns no row uses (left of the longest prompt, right of the longest
        response): a micro-batch of short responses then costs what they do, not what the longest
        response of the whole batch does. Positions count real tokens, so outputs do not change."""
        P, T = int(self.prompt_mask.sum(-1).max()), int(self.lengths.max())
        return RolloutBatch(self.prompt_ids[:, -P:], self.prompt_mask[:, -P:], self.response_ids[:, :T],
                            self.response_mask[:, :T], self.logprobs[:, :T], self.finish_reasons)

    def micro_batches(self, index: torch.Tensor, size: int, max_tokens: int | None = None):
        """Yield (row numbers, trimmed sub-batch) for the rows `index` split into micro-batches of
        `size` rows, or, with max_tokens, of as many rows as fit that many padded tokens; sorted by
        response length, so that each is padded only to its own longest response. The row numbers
        come back on the batch's device (an index drawn on the CPU is moved)."""
        index = torch.as_tensor(index).to(self.device)
        by_length = index[self.lengths[index].argsort(stable=True)]
        for micro_index in by_length.split(size) if max_tokens is None else self._token_groups(by_length, max_tokens):
            yield micro_index, self.select(micro_index).trim()

    def _token_groups(self, rows: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
        """Consecutive runs of `rows` (sorted by response length) whose padded size, rows x (longest
        prompt + longest response), stays within max_tokens; a row longer than that goes alone.
        Under torchrun every rank gets as many runs (FSDP's collectives pair up across ranks): a
        rank with fewer splits its runs of most rows in two until it has as many."""
        prompt, response = self.prompt_mask[rows].sum(-1).tolist(), self.lengths[rows].tolist()
        bounds, start, widest_prompt = [], 0, 0
        for i in range(len(rows)):
            widest_prompt = max(widest_prompt, prompt[i])
            if i > start and (i - start + 1) * (widest_prompt + response[i]) > max_tokens:
                bounds.append((start, i))
                start, widest_prompt = i, prompt[i]
        bounds.append((start, len(rows)))
        wanted = int(all_reduce(torch.tensor(float(len(bounds))), op=dist.ReduceOp.MAX))
        while len(bounds) < wanted:  # every rank holds as many rows (config.validate): always possible
            k = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
            (lo, hi), mid = bounds[k], (bounds[k][0] + bounds[k][1]) // 2
            bounds[k : k + 1] = [(lo, mid), (mid, hi)]
        return [rows[lo:hi] for lo, hi in bounds]

    def to(self, device) -> "RolloutBatch":
        """The same batch with its tensors on `device` (where the trained models are)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "finish_reasons"}
        return RolloutBatch(**moved, finish_reasons=self.finish_reasons)

    def select(self, index) -> "RolloutBatch":
        """Rows `index` (a slice, list or tensor of row numbers); padding widths are kept."""
        if isinstance(index, slice):
            picks = list(range(len(self)))[index]
        else:
            picks = torch.as_tensor(index).tolist()
        picked = {
            f.name: getattr(self, f.name)[picks] for f in fields(self) if f.name != "finish_reasons"
        }
        return RolloutBatch(**picked, finish_reasons=[self.finish_reasons[i] for i in picks])


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, P], mask [B, P]), padded on the left."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """Response texts, without padding and special tokens."""
    return [
        tokenizer.decode(ids[: int(n)].tolist(), skip_special_tokens=True)
        for ids, n in zip(batch.response_ids, batch.lengths)
    ]


def rank_seed(seed: int | None) -> int:
    """The seed of this rank's rollout: seed + rank, so that ranks draw apart and a resumed run replays
    its batches; without one, a draw from torch's RNG (torch.manual_seed still makes runs repeatable,
    and two calls sample differently)."""
    return int(torch.randint(0, 2**62, ())) if seed is None else seed + rank()


def stop_and_pad_ids(tokenizer, generation_config: GenerationConfig | None) -> tuple[list[int], int]:
    """(the tokens that end a response, the padding token): the tokenizer's EOS and every end token
    the checkpoint's generation_config.json lists (chat models list several: Qwen2.5-Instruct
    <|im_end|> and <|endoftext|>), which vLLM, TRL and verl stop on too. ValueError naming the
    fix when the tokenizer has no EOS or no pad token."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token, the token that ends a response: set it in the model's "
                         "tokenizer_config.json")
    if pad is None:
        raise ValueError("the tokenizer has no pad_token (Llama's has none): set it in the model's "
                         "tokenizer_config.json, to a special token the model never generates")
    listed = getattr(generation_config, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return [eos, *(t for t in dict.fromkeys(listed) if t != eos)], pad


def check_sampling(temperature: float, top_p: float) -> None:
    """The sampling settings `generate` accepts: temperature >= 0 (0: greedy), top_p in (0, 1]."""
    if not temperature >= 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1]; got {temperature}, {top_p}")


@contextlib.contextmanager
def own_sampling_only(model):
    """`generate` without the checkpoint's sampling defaults (its generation_config.json: Qwen2.5-Instruct's
    repetition penalty and top-k 20, for one), which it would otherwise apply to every setting left
    unset: the samples must come from the distribution whose log-probs PPO computes, as vLLM's
    generation_config="vllm" does there."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextlib.contextmanager
def probabilities_checked():
    """torch.multinomial's error on a diverged model's outputs, said as what it means."""
    try:
        yield
    except RuntimeError as err:
        if "probability tensor contains" not in str(err):
            raise
        raise FloatingPointError("generate: the model's next-token probabilities hold NaN or inf") from None


class HFRollout:
    """Sampling with Hugging Face `generate` (KV cache, one process)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids, self.pad_id = stop_and_pad_ids(tokenizer, getattr(model, "generation_config", None))

    def padded_prompts(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded, and their mask, on the model's device."""
        device = next(self.model.parameters()).device
        return tuple(x.to(device) for x in left_pad(prompt_ids, self.pad_id))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt; temperature 0 means greedy. The batch is on the model's device."""
        check_sampling(temperature, top_p)
        ids, mask = self.padded_prompts(prompt_ids)
        greedy = temperature == 0
        was_training = self.model.training
        self.model.eval()
        # A seed makes the rollout a function of (seed, weights, prompts): resumed runs replay exactly.
        seed = rank_seed(seed)  # drawn before the fork when there is none, so that calls differ
        # The RNG states it seeds (the CPU's, and the GPU's where it samples) are restored after it.
        with torch.random.fork_rng(devices=[ids.device] if ids.is_cuda else []), own_sampling_only(self.model):
            torch.manual_seed(seed)
            with probabilities_checked():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=not greedy,
                    temperature=None if greedy else temperature,
                    top_p=None if greedy else top_p,
                    top_k=None,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=self.stop_ids,
                    pad_token_id=self.pad_id,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
        self.model.train(was_training)
        response = out.sequences[:, ids.shape[1] :]
        # Tokens up to and including the first end token are the response; `generate` pads after it.
        is_eos = torch.isin(response, torch.tensor(self.stop_ids, device=response.device))
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        response_mask = (~after_eos).float()
        scale = 1.0 if greedy else temperature
        # Step by step: a [B, T, V] stack in fp32 (and its log-softmax) would be ~5 GB a row at 8k
        # tokens of a 152k vocabulary, beside the logits `generate` already keeps.
        logprobs = torch.stack([F.log_softmax(step.float() / scale, -1).gather(-1, response[:, t, None]).squeeze(-1)
                                for t, step in enumerate(out.logits)], dim=1)
        finish = ["stop" if row.any() else "length" for row in is_eos]
        return RolloutBatch(
            prompt_ids=ids,
            prompt_mask=mask,
            response_ids=response.masked_fill(after_eos, self.pad_id),
            response_mask=response_mask,
            logprobs=logprobs * response_mask,
            finish_reasons=finish,
        )

    def sleep(self) -> None:
        """Nothing to free: this backend generates with the trained model itself."""

    def sync_weights(self, model) -> None:
        """Nothing to copy: this backend generates with the trained model itself."""

    def close(self) -> None:
        """Nothing to release."""
