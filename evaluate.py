"""Held-out evaluation: pass@1 and pass@k (paper §4: AIME pass@1 averaged over samples, pass@32).

Each held-out prompt is sampled `eval_samples` times at the rollout temperature; pass@k uses the
unbiased estimator of `reward.pass_at_k`. Records that carry a `difficulty` (the built-in task) get
accuracy and length per difficulty as well.
"""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist
from tqdm import tqdm

from data import stream_seed
from fsdp_utils import rank, world_size
from reward import pass_at_k, score_rollout
from rollout import decode_responses


def evaluate(cfg, engine, tokenizer, records, grader, tag: str) -> dict:
    """Sample, grade and summarise; `tag` only labels the progress bar. Under torchrun each rank
    samples its share of the prompts and the results are gathered: the same summary on every rank."""
    n = cfg.eval_samples
    mine, counts = share_of_records(len(records), rank(), world_size())
    todo = [(i, c) for i, c in zip(mine, counts) for _ in range(n)]  # each prompt n times, side by side
    chunk = max(n, (cfg.prompts_per_step * cfg.samples_per_prompt) // n * n)
    rows = []  # (record index, correct, length, truncated, text) of every sample that counts
    for start in tqdm(range(0, len(todo), chunk), desc=f"eval {tag}", dynamic_ncols=True, leave=False):
        part = todo[start : start + chunk]
        prompts = [records[i] for i, _ in part]
        batch = engine.generate(
            [r["prompt_ids"] for r in prompts], cfg.max_new_tokens, cfg.temperature, cfg.top_p,
            seed=stream_seed(cfg.seed, "eval/sampling", start),
        )
        texts = decode_responses(tokenizer, batch)
        scores, _, _ = score_rollout(batch, texts, prompts, grader, cfg)
        for j, (i, count) in enumerate(part):
            if count:  # the summary shows the first 8 samples, all from records 0-7: no other text travels
                rows.append((i, scores[j].item() > 0, batch.lengths[j].item(), batch.finish_reasons[j] == "length",
                             texts[j] if i < 8 else ""))
    if dist.is_initialized():
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, rows)
        rows = sorted((row for part in gathered for row in part), key=lambda row: row[0])  # stable
    flat = [records[row[0]] for row in rows]
    correct, lengths, truncated, texts = ([row[j] for row in rows] for j in range(1, 5))

    per_prompt = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
    result = {
        "pass@1": sum(per_prompt) / (n * len(per_prompt)),
        "mean_length": sum(lengths) / len(lengths),
        "truncated": sum(truncated) / len(truncated),
    }
    if n > 1:
        result[f"pass@{n}"] = sum(pass_at_k(n, c, n) for c in per_prompt) / len(per_prompt)
    if "difficulty" in records[0]:
        groups = defaultdict(lambda: [0, 0, 0])  # correct, length, count
        for rec, ok, length in zip(flat, correct, lengths):
            g = groups[rec["difficulty"]]
            g[0], g[1], g[2] = g[0] + ok, g[1] + length, g[2] + 1
        result["by_difficulty"] = {
            d: {"accuracy": c / k, "mean_length": s / k} for d, (c, s, k) in sorted(groups.items())
        }
    result["samples"] = [
        {"prompt": r["prompt"], "answer": r["answer"], "response": t, "correct": ok}
        for r, t, ok in zip(flat[:8], texts[:8], correct[:8])
    ]
    return result


def share_of_records(n_records: int, rank: int, world: int) -> tuple[list[int], list[bool]]:
    """A rank's record indices (every world-th) and whether each counts. Shares are padded to equal
    length with record 0, whose results there are dropped: every rank must make the same number of
    generate calls, which are collectives under torchrun."""
    mine = list(range(rank, n_records, world))
    padding = -(-n_records // world) - len(mine)
    return mine + [0] * padding, [True] * len(mine) + [False] * padding
