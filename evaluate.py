"""Held-out evaluation: pass@1 and pass@k (paper §4: AIME pass@1 averaged over samples, pass@32).

Each held-out prompt is sampled `eval_samples` times at the rollout temperature; pass@k uses the
unbiased estimator of `reward.pass_at_k`. Records that carry a `difficulty` (the built-in task) get
accuracy and length per difficulty as well.
"""

from __future__ import annotations

from collections import defaultdict

from tqdm import tqdm

from data import stream_seed
from reward import pass_at_k, score_rollout
from rollout import decode_responses


def evaluate(cfg, engine, tokenizer, records, grader, tag: str) -> dict:
    """Sample, grade and summarise; `tag` only labels the progress bar."""
    n = cfg.eval_samples
    flat = [r for r in records for _ in range(n)]  # each prompt n times, side by side
    chunk = max(n, (cfg.prompts_per_step * cfg.samples_per_prompt) // n * n)
    correct, lengths, truncated, texts = [], [], [], []
    for start in tqdm(range(0, len(flat), chunk), desc=f"eval {tag}", dynamic_ncols=True, leave=False):
        prompts = flat[start : start + chunk]
        batch = engine.generate(
            [r["prompt_ids"] for r in prompts], cfg.max_new_tokens, cfg.temperature, cfg.top_p,
            seed=stream_seed(cfg.seed, "eval/sampling", start),
        )
        chunk_texts = decode_responses(tokenizer, batch)
        scores, _, _ = score_rollout(batch, chunk_texts, prompts, grader, cfg)
        correct += (scores > 0).tolist()
        lengths += batch.lengths.tolist()
        truncated += [f == "length" for f in batch.finish_reasons]
        texts += chunk_texts

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
