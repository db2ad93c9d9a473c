"""Held-out evaluation: pass@1 and pass@k (paper §4: AIME pass@1 averaged over samples, pass@32).

Each held-out prompt is sampled `eval_samples` times (at --eval-temperature, up to
--eval-max-new-tokens: `eval_sampler`); pass@k uses the unbiased estimator `pass_at_k`. Records that
carry a `difficulty` (the built-in task) get accuracy and length per difficulty as well; records of
users' data, scores per data source (`val_metrics`: the `val/<data source>/...` metrics).

train.py evaluates pi_SFT and the trained policy. A model alone (a run's actor_hf/, a snapshot, any
Hugging Face checkpoint) is evaluated on the held-out set that train.py evaluates with the same flags,
with the same draws at the same world size (each rank samples its share):

    python evaluate.py --model runs/<run>/actor_hf                # the built-in task's held-out set
    python evaluate.py --model PATH --data train.jsonl --val-data aime.jsonl math500.jsonl --eval-samples 32

It takes train.py's flags (those of the data, of sampling and of evaluation count; the rest change
nothing), prints the scores per held-out set and writes them, with the first samples' texts, to
<out-dir>/eval/<the model's path under --out-dir, '/' as '__'>.json (runs/eval/<run>__actor_hf.json).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections import defaultdict

import torch.distributed as dist
from tqdm import tqdm

from support.data import stream_seed
import fsdp_utils
from fsdp_utils import any_rank, distributed, is_main, rank, world_size
from support.config import ConfigError, parse_config
from support.rundir import read_json, write_json
from reward import Grader
from sampling import Sampler

SHOWN_SAMPLES = 8  # the summary keeps the texts of the first samples, all from the first records
HELD_OUT_DIGEST = "held_out_digest"  # in evaluate_once's file: the records its scores are of


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    Product form 1 - prod_{i=n-c+1}^{n} (1 - k / i): no huge binomials.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def evaluate(sampler: Sampler, records: list[dict], tag: str) -> dict:
    """Sample, grade and summarise; `tag` only labels the progress bar. Under torchrun each rank
    samples its share of the prompts and the results are gathered: the same summary on every rank."""
    cfg = sampler.cfg
    n = cfg.eval_samples
    mine, counts = share_of_records(len(records), rank(), world_size())
    todo = [(i, c) for i, c in zip(mine, counts) for _ in range(n)]  # each prompt n times, side by side
    rows = cfg.prompts_per_step // world_size() * cfg.samples_per_prompt  # a training rollout's, on this rank
    chunk = max(n, rows // n * n)
    samples = []  # (record index, correct, length, truncated, text) of every sample that counts
    for start in tqdm(range(0, len(todo), chunk), desc=f"eval {tag}", dynamic_ncols=True, leave=False,
                      disable=not is_main()):
        part = todo[start : start + chunk]
        scored = sampler.sample_and_score([records[i] for i, _ in part], stream_seed(cfg.seed, "eval/sampling", start))
        batch = scored.batch
        for j, (i, count) in enumerate(part):
            if count:  # only the shown samples' texts travel between ranks
                samples.append((i, scored.outcomes[j].item() > 0, batch.lengths[j].item(),
                                batch.truncated[j], scored.texts[j] if i < SHOWN_SAMPLES else ""))
    if distributed():
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, samples)
        samples = sorted((s for part in gathered for s in part), key=lambda s: s[0])  # stable
    return summarize(records, samples, n)


def summarize(records: list[dict], samples: list[tuple], n: int) -> dict:
    """pass@1, pass@n, mean length, truncated share (and per difficulty, and per data source when
    the records name theirs) of (record index, correct, length, truncated, text) samples, n
    consecutive ones per record."""
    flat = [records[s[0]] for s in samples]
    correct, lengths, truncated, texts = ([s[j] for s in samples] for j in range(1, 5))
    result = _scores(correct, lengths, truncated, n)
    if "difficulty" in records[0]:
        groups = defaultdict(lambda: [0, 0, 0])  # correct, length, count
        for rec, ok, length in zip(flat, correct, lengths):
            g = groups[rec["difficulty"]]
            g[0], g[1], g[2] = g[0] + ok, g[1] + length, g[2] + 1
        result["by_difficulty"] = {
            d: {"accuracy": c / k, "mean_length": s / k} for d, (c, s, k) in sorted(groups.items())
        }
    if "data_source" in records[0]:  # users' data: one score per held-out set (MATH-500, AIME, ...)
        sources = defaultdict(list)  # sample indices, n consecutive ones per record as in `samples`
        for i, rec in enumerate(flat):
            sources[rec["data_source"]].append(i)
        result["by_source"] = {
            source: _scores(*([column[i] for i in idx] for column in (correct, lengths, truncated)), n)
            for source, idx in sorted(sources.items())
        }
    result["samples"] = [
        {"prompt": r["prompt"], "answer": r["answer"], "response": t, "correct": ok}
        for r, t, ok in zip(flat[:SHOWN_SAMPLES], texts[:SHOWN_SAMPLES], correct[:SHOWN_SAMPLES])
    ]
    return result


def _scores(correct: list, lengths: list, truncated: list, n: int) -> dict:
    """pass@1, pass@n, mean length and truncated share of samples, n consecutive ones per prompt."""
    per_prompt = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
    result = {
        "pass@1": sum(per_prompt) / (n * len(per_prompt)),
        "mean_length": sum(lengths) / len(lengths),
        "truncated": sum(truncated) / len(truncated),
    }
    if n > 1:
        result[f"pass@{n}"] = sum(pass_at_k(n, c, n) for c in per_prompt) / len(per_prompt)
    return result


def scores_by_source(result: dict) -> dict:
    """{held-out set: {pass@1, pass@k, mean_length, truncated}}; the built-in task's set is "held_out"."""
    return result.get("by_source") or {"held_out": {k: v for k, v in result.items() if isinstance(v, float)}}


def score_columns(scores: dict) -> list[str]:
    """The order a table shows one set's scores in: pass@1, pass@k, mean_length, truncated."""
    return ["pass@1", *(k for k in scores if k.startswith("pass@") and k != "pass@1"), "mean_length", "truncated"]


def val_metrics(result: dict) -> dict:
    """An evaluation as metrics rows take it: `val/<data source>/pass@1`, `/pass@k`, `/mean_length`,
    `/truncated` (the built-in task's held-out set is `val/held_out/...`)."""
    return {f"val/{source}/{name}": value for source, scores in scores_by_source(result).items()
            for name, value in scores.items()}


def eval_sampler(sampler: Sampler) -> Sampler:
    """The sampler of held-out evaluation: --eval-temperature and --eval-max-new-tokens where set."""
    cfg = sampler.cfg
    return dataclasses.replace(sampler, cfg=dataclasses.replace(
        cfg, temperature=cfg.eval_temperature or cfg.temperature,
        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens))


def evaluate_once(sampler: Sampler, records: list[dict], tag: str, path: str) -> dict:
    """`evaluate`, computed once and kept at `path` (pi_SFT's scores: a resumed 32B run would
    otherwise sample the whole held-out set again); deterministic, like every draw here. The file
    holds a digest of the held-out records it scored: where they changed since (a --val-data file
    edited before a rerun without value pretraining; with it, the critic's stage, keyed on the data
    files, refuses the rerun first), they are scored again, so that pi_SFT and the trained policy
    are always compared on one set. A file written before the digest was kept is read as it is."""
    digest = hashlib.sha256(json.dumps(records, sort_keys=True, default=str).encode()).hexdigest()[:16]
    if not any_rank(not os.path.exists(path)):  # every rank sees it (a shared filesystem may lag): all read
        kept = read_json(path, "delete it to evaluate pi_SFT again")
        if not any_rank(kept.pop(HELD_OUT_DIGEST, digest) != digest):
            return kept
        if is_main():
            print(f"note: the held-out records differ from those {path} scored: pi_SFT is evaluated again")
    result = json.loads(json.dumps(evaluate(sampler, records, tag)))  # as it will be read back
    if rank() == 0:
        write_json(path, {HELD_OUT_DIGEST: digest} | result)
    return result


def share_of_records(n_records: int, rank: int, world: int) -> tuple[list[int], list[bool]]:
    """A rank's record indices (every world-th) and whether each counts. Shares are padded to equal
    length with record 0, whose results there are dropped: every rank must make the same number of
    generate calls, which are collectives under torchrun."""
    mine = list(range(rank, n_records, world))
    padding = -(-n_records // world) - len(mine)
    return mine + [0] * padding, [True] * len(mine) + [False] * padding


def main(cfg) -> dict:
    """Evaluate --model alone (module docstring); returns what `evaluate` returns."""
    import train  # it imports this module: here, not at the top

    if cfg.model is None:
        raise ConfigError("evaluate.py needs --model: a Hugging Face checkpoint, such as a run's actor_hf/")
    dist_info = train.start(cfg)
    path, tokenizer, (_, held_out), actor = train.policy_and_data(cfg, dist_info, critic=False)  # sampled only
    with Grader(num_workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s) as grader:
        sampler = eval_sampler(Sampler(cfg, train.build_engine(cfg, actor, path, tokenizer), tokenizer, grader))
        result = evaluate(sampler, held_out, "model")
    model_dir = os.path.realpath(cfg.model)
    # Named by its path under --out-dir (runs/a/actor_hf_steps/step_10: a__actor_hf_steps__step_10), else whole.
    inside = os.path.relpath(model_dir, os.path.realpath(cfg.out_dir))
    name = model_dir.strip(os.sep) if inside.startswith("..") else inside
    out = os.path.join(cfg.out_dir, "eval", name.replace(os.sep, "__") + ".json")
    if is_main():
        settings = {"model": model_dir, "data": cfg.data, "val_data": cfg.val_data, "samples": cfg.eval_samples,
                    "temperature": sampler.cfg.temperature, "max_new_tokens": sampler.cfg.max_new_tokens,
                    "seed": cfg.seed}
        os.makedirs(os.path.dirname(out), exist_ok=True)
        write_json(out, {"settings": settings, **result})
        columns = score_columns(result)
        print(f"\n{'held-out set':<24}" + "".join(f"{c:>13}" for c in columns))
        for source, scores in scores_by_source(result).items():
            print(f"{source:<24}" + "".join(f"{scores[c]:>13.3f}" for c in columns))
        print(f"\n{len(held_out)} problems x {cfg.eval_samples} samples of {cfg.model}; wrote {out}")
    train.finish(sampler.engine)
    return result


if __name__ == "__main__":
    from train import USER_ERRORS

    try:
        main(parse_config(sys.argv[1:], description=__doc__))
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")
    fsdp_utils.exit_now_if_gloo()  # torchrun on CPU: see there why
