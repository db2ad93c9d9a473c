"""Rollout: sample responses from the policy (Algorithm 1, line "collect trajectories").

A rollout returns everything the PPO step needs about the sampled tokens, in the layout of
DESIGN.md ("Tensor conventions"): prompts left-padded to P, responses right-padded to T, and the
model output at sequence position P - 1 + t belongs to response token t.

Backends share one interface, `generate(prompt_ids, max_new_tokens, temperature, top_p, seed)`:
- `HFRollout`: Hugging Face `generate`; the CPU default and the reference in tests.
The sampling log-probs are log-softmax(logits / temperature) of the unmodified model (top-p only
truncates what is sampled), the same quantity `ppo.response_logprobs` recomputes for training.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long, 1 on prompt tokens
    response_ids: torch.Tensor  # [B, T] long, right-padded
    response_mask: torch.Tensor  # [B, T] float32, 1 on generated tokens (EOS included)
    logprobs: torch.Tensor  # [B, T] float32, sampling log-probs, 0 on padding
    finish_reasons: list[str]  # "stop" (ended with EOS) or "length" (hit max_new_tokens)

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """input_ids / attention_mask / position_ids of the whole [B, P + T] sequence."""
        attention_mask = torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)
        # Positions count real tokens only, so a left-padded prompt starts at position 0,
        # exactly as in `generate`.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    def response_slice(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-position model outputs [B, P+T, ...] -> the ones that predict response tokens [B, T, ...]."""
        P, T = self.prompt_ids.shape[1], self.response_ids.shape[1]
        return outputs[:, P - 1 : P - 1 + T]

    def select(self, index) -> "RolloutBatch":
        """Rows `index` (a slice, list or tensor of row numbers); padding widths are kept."""
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        else:
            rows = torch.as_tensor(index).tolist()
        picked = {
            f.name: getattr(self, f.name)[rows] for f in fields(self) if f.name != "finish_reasons"
        }
        return RolloutBatch(**picked, finish_reasons=[self.finish_reasons[i] for i in rows])


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


class HFRollout:
    """Sampling with Hugging Face `generate` (KV cache, one process)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        if self.eos_id is None or self.pad_id is None:
            raise ValueError("tokenizer: needs both an eos_token and a pad_token")

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt; temperature 0 means greedy."""
        ids, mask = left_pad(prompt_ids, self.pad_id)
        greedy = temperature == 0
        was_training = self.model.training
        self.model.eval()
        # A seed makes the rollout a function of (seed, weights, prompts): resumed runs replay exactly.
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=not greedy,
                temperature=None if greedy else temperature,
                top_p=None if greedy else top_p,
                top_k=None,
                max_new_tokens=max_new_tokens,
                eos_token_id=self.eos_id,
                pad_token_id=self.pad_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        self.model.train(was_training)
        response = out.sequences[:, ids.shape[1] :]
        # Tokens up to and including the first EOS are the response; `generate` pads after it.
        is_eos = response == self.eos_id
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        response_mask = (~after_eos).float()
        logits = torch.stack(out.logits, dim=1).float() / (1.0 if greedy else temperature)
        logprobs = torch.gather(F.log_softmax(logits, -1), -1, response.unsqueeze(-1)).squeeze(-1)
        finish = ["stop" if row.any() else "length" for row in is_eos]
        return RolloutBatch(
            prompt_ids=ids,
            prompt_mask=mask,
            response_ids=response.masked_fill(after_eos, self.pad_id),
            response_mask=response_mask,
            logprobs=logprobs * response_mask,
            finish_reasons=finish,
        )
