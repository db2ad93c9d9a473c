"""Sample and score (Algorithm 1: "collect trajectories", "compute rewards"): the one path from
prompts to graded responses, used by PPO, value pretraining, the outcome reward model's data,
evaluation and the analyses.

    sampler = Sampler(cfg, engine, tokenizer, grader)
    scored = sampler.sample_and_score(prompts, seed)     # a ScoredBatch

The outcome of a response is +1 (its final answer verifies) or -1 (reward.py); a response cut at
max_new_tokens gets `cfg.truncation_reward` instead, when that is set. The only reward is terminal:
`token_rewards[b, t]` holds the outcome on response b's last token t = L_b - 1 and 0 elsewhere.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from tqdm import tqdm

from fsdp_utils import is_main, wait_patiently
from rollout import RolloutBatch, decode_responses
from reward import Grader, last_boxed, response_outcomes, terminal_rewards


@dataclasses.dataclass
class ScoredBatch:
    batch: RolloutBatch  # the sampled responses ([B, T] tensors, README "Tensor layout")
    texts: list[str]  # decoded responses (the text the verifier graded)
    outcomes: torch.Tensor  # [B] float32: +1 / -1, or the truncation reward of a cut response
    token_rewards: torch.Tensor  # [B, T]: the outcome on each response's last token, 0 elsewhere
    grader_timeouts: int  # responses whose grading timed out (scored -1, or the truncation reward if cut)
    missing_box: int  # responses without a final boxed answer (likewise)
    seconds: dict  # {"rollout": generation time, "reward": decoding and grading time}


@dataclasses.dataclass
class Sampler:
    """What turns prompts into scored responses: the rollout engine (`rollout.py`), the tokenizer that
    decodes its responses, the grader, and the run's sampling settings (max_new_tokens, temperature,
    top_p, truncation_reward of `config.Config`)."""

    cfg: object
    engine: object
    tokenizer: object
    grader: Grader
    # Notes said once a run, shared with the copies `dataclasses.replace` makes (evaluate.eval_sampler).
    notes_given: set = dataclasses.field(default_factory=set)

    def sample_and_score(self, prompts: list[dict], seed: int) -> ScoredBatch:
        """One response per prompt record (`prompt_ids`, `answer`), sampled with `seed`, and graded."""
        cfg, start = self.cfg, time.perf_counter()
        batch = self.engine.generate([p["prompt_ids"] for p in prompts], cfg.max_new_tokens, cfg.temperature,
                                     cfg.top_p, seed=seed)
        generated = time.perf_counter()
        texts = decode_responses(self.tokenizer, batch)
        graded = self.grader.grade(texts, [p["answer"] for p in prompts])
        wait_patiently()  # for the rank whose grading timed out most, before the collectives that follow
        # on the engine's device, as the batch is: so is all built from it
        verdicts = torch.tensor(graded.outcomes, dtype=torch.float32, device=batch.device)
        outcomes = response_outcomes(verdicts, batch.truncated, cfg.truncation_reward)
        token_rewards = terminal_rewards(outcomes, batch.response_mask)
        seconds = {"rollout": generated - start, "reward": time.perf_counter() - generated}
        if getattr(cfg, "data", None) and "missing_box" not in self.notes_given:
            self._note_missing_box(texts, batch.truncated, graded.num_missing_box)
        return ScoredBatch(batch, texts, outcomes, token_rewards, graded.num_timeouts, graded.num_missing_box,
                           seconds)

    def _note_missing_box(self, texts: list[str], truncated: list[bool], missing_in_all: int) -> None:
        """Once a run, where 90% of a batch's complete responses (8 at least) hold no boxed answer: a
        user's prompts that ask for '#### answer' (verl's GSM8K) or for nothing, every reward -1. A
        response cut at max_new_tokens is left out: it holds none for want of room, not of asking.
        `missing_in_all`: the grader's count over every response, an upper bound on the complete ones'."""
        complete = [text for text, cut in zip(texts, truncated) if not cut]
        if len(complete) < 8 or missing_in_all < 0.9 * len(complete):  # the usual batch: no box searched again
            return
        missing = sum(last_boxed(text) is None for text in complete)
        if missing >= 0.9 * len(complete):
            self.notes_given.add("missing_box")
            if is_main():
                tqdm.write(f"note: {missing} of {len(complete)} complete responses hold no \\boxed{{...}}, the only "
                           f"answer the grader reads (scored -1): ask for one in the prompt (--prompt-template "
                           f"'{{prompt}} ... put your final answer within \\boxed{{}}.')")
