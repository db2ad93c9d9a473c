"""SFT cold start: the pi_SFT that VC-PPO starts from (paper §4 setup: "a short Long-CoT SFT").

Trains a tiny Qwen2 from scratch on the built-in task's traces (`task.sft_response`: mostly full
chains of thought, some merged lines, some shortcuts), with the loss on response tokens only,
then writes a Hugging Face checkpoint (model + tokenizer) that `train.py` loads as the policy
(`prepare_sft`, its SFT stage, trains it once and caches it). Its settings go in with it
(settings.json), and train.py reuses a cached pi_SFT only if they are the ones it asks for.

    python -m support.sft --out-dir runs/_shared/sft    # ~3 min on 2 CPU cores, then a report
    python -m support.sft --steps 40 --eval-problems 32 --out-dir runs/sft-smoke   # smoke run

The report samples held-out problems at temperature 1 and gives accuracy and length by
difficulty, the share and accuracy of each strategy, and per-line accuracy of the arithmetic.
"""

from __future__ import annotations

import json
import math
import random
import time
import zipfile
from collections import defaultdict
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from support import task
from support.config import positions_needed
from fsdp_utils import is_main
from rollout import HFRollout, decode_responses
from support.rundir import STAGE_SETTINGS, build_once, write_json
from reward import Grader


@dataclass
class SFTConfig:
    out_dir: str = "runs/_shared/sft"
    """where the checkpoint (model + tokenizer) is written"""
    seed: int = 0
    """seeds the model init and the training problems"""
    steps: int = 800
    """optimizer steps"""
    batch_size: int = 16
    """sequences per optimizer step"""
    micro_batch_size: int = 4
    """sequences per forward pass; a step's sequences are sorted by length first, so each micro-batch
    pads only to its own longest (4 is ~2x faster than 16 on the default mix)"""
    lr: float = 3e-3
    """peak AdamW learning rate (linear warm-up, then cosine to 10%)"""
    warmup_steps: int = 20
    """linear warm-up steps"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    width: int = task.WIDTH
    """digits of x (task.SHAPES: 4 for the short task, 10 for the long one)"""
    min_difficulty: int = task.DEFAULT_DIFFICULTY[0]
    """smallest k (doublings) of a training problem"""
    max_difficulty: int = task.DEFAULT_DIFFICULTY[1]
    """largest k of a training problem"""
    length_bias: float = 0.5
    """difficulty k is drawn with weight k**-length_bias: short problems are cheaper and teach the
    same per-line skills; 0 draws k uniformly (as the RL prompts are)"""
    shortcut_prob: float = 0.25
    """share of training traces that stop early and guess the answer (see task.sft_response)"""
    merge_prob: float = 0.15
    """per line: chance of two doublings at once"""
    num_layers: int = 3
    """decoder layers of the tiny model"""
    hidden_size: int = 128
    """model width (head_dim is 64, so hidden_size / 64 heads)"""
    intermediate_size: int = 384
    """MLP width"""


def _lr_factor(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def sample_problems(rng: random.Random, cfg: SFTConfig) -> list[dict]:
    """Fresh training problems (never a fixed set, so nothing is memorised), short ones favoured."""
    ks = list(range(cfg.min_difficulty, cfg.max_difficulty + 1))
    picks = rng.choices(ks, weights=[k**-cfg.length_bias for k in ks], k=cfg.batch_size)
    # Seeds from this rng are far from the small seeds of held-out sets (data.py uses 1 and 2).
    return [task.make_problems(1, rng.randrange(10**6, 2**62), k, k, cfg.width)[0] for k in picks]


def make_batch(tokenizer, problems: list[dict], rng: random.Random, cfg: SFTConfig) -> list[tuple[list, list]]:
    """(input_ids, labels) per problem: prompt + trace + EOS, labels -100 on the prompt."""
    out = []
    for p in problems:
        prompt = tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(task.sft_response(p, rng, cfg.shortcut_prob, cfg.merge_prob),
                             add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + response, [-100] * len(prompt) + response))
    return out


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def sft_loss_sum(model, examples: list[tuple[list, list]], pad_id: int) -> torch.Tensor:
    """Summed next-token cross-entropy over response tokens (sequences right-padded)."""
    ids = _pad([e[0] for e in examples], pad_id)
    labels = _pad([e[1] for e in examples], -100)
    mask = _pad([[1] * len(e[0]) for e in examples], 0)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]  # no KV cache to build
    target = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           ignore_index=-100, reduction="sum")


def accumulate_gradients(model, batch: list[tuple[list, list]], micro_batch_size: int, pad_id: int) -> float:
    """Backward of the token-mean loss over the whole batch, in micro-batches; returns that loss."""
    n_target = sum(sum(1 for x in labels if x != -100) for _, labels in batch)
    total = 0.0
    for i in range(0, len(batch), micro_batch_size):
        loss_sum = sft_loss_sum(model, batch[i : i + micro_batch_size], pad_id)
        # Divide by the whole batch's target count: every token weighs the same in any split.
        (loss_sum / n_target).backward()
        total += loss_sum.item()
    return total / n_target


def train_sft(cfg: SFTConfig, model=None, tokenizer=None) -> dict:
    """Train pi_SFT and save it to cfg.out_dir; returns a summary (losses, time, path)."""
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.micro_batch_size < 1:
        raise ValueError("steps, batch_size and micro_batch_size must be >= 1")
    tokenizer = tokenizer or task.build_tokenizer()
    if model is None:
        model = task.make_tiny_model(tokenizer, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                                     num_heads=cfg.hidden_size // 64, intermediate_size=cfg.intermediate_size,
                                     seed=cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    rng = random.Random(cfg.seed)
    losses, tokens, start = [], 0, time.time()
    bar = tqdm(range(cfg.steps), desc="sft", dynamic_ncols=True)
    for step in bar:
        batch = sorted(make_batch(tokenizer, sample_problems(rng, cfg), rng, cfg), key=lambda e: len(e[0]))
        losses.append(accumulate_gradients(model, batch, cfg.micro_batch_size, tokenizer.pad_token_id))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        if not torch.isfinite(grad_norm):  # a diverged pi_SFT would be saved and cached as a stage
            raise FloatingPointError(f"SFT step {step}: gradient norm is {grad_norm.item()} (loss {losses[-1]}); "
                                     f"pi_SFT diverged and nothing was saved")
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += sum(len(e[0]) for e in batch)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}")
    seconds = time.time() - start
    out = Path(cfg.out_dir)
    (out / STAGE_SETTINGS).unlink(missing_ok=True)  # an older model's settings must not outlive it
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {
        "out_dir": str(out), "steps": cfg.steps, "seconds": round(seconds, 1), "tokens": tokens,
        "first_loss": losses[0], "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "parameters": sum(p.numel() for p in model.parameters()), "config": asdict(cfg),
    }
    # Written last, as in any cached stage (rundir.build_once): train.py reuses a pi_SFT that
    # `python -m support.sft` wrote only if these are the settings it asks for.
    write_json(str(out / STAGE_SETTINGS), sft_settings(cfg))
    print(f"SFT: {cfg.steps} steps, {tokens} tokens in {seconds:.0f} s; loss {summary['first_loss']:.3f} -> "
          f"{summary['final_loss']:.3f}; {summary['parameters']} parameters")
    return summary


def sft_cache_path(cfg) -> str:
    """Where the built-in task's pi_SFT is cached: <out_dir>/_shared/sft (sft-long for the long task)."""
    return str(Path(cfg.out_dir) / "_shared" / ("sft" if cfg.task_length == "short" else f"sft-{cfg.task_length}"))


class ModelError(ValueError):
    """A --model directory that is not a loadable Hugging Face checkpoint; the message says why."""


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# Where a tokenizer's vocabulary is (fast, BPE, WordPiece, SentencePiece): from tokenizer_config.json
# alone transformers builds a tokenizer of its special tokens only, every prompt then one token.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                    "sentencepiece.bpe.model")
# Read by transformers as the tokenizer and the generation settings load: a cut one stopped the run
# with a JSONDecodeError inside transformers, or (generation_config.json) was dropped in silence,
# and with it the end tokens it lists.
JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "generation_config.json")


def check_model(path: str, weights: bool = True, positions: int | None = None, critic: bool = False) -> None:
    """Stop with one line naming `path` and its fault, before anything loads it, unless it holds a
    config.json of a causal LM that transformers knows (not a value or reward model: its head would
    be dropped in silence), also as a token-classification model when the run trains a `critic` on
    its backbone, with room for `positions` (prompt + response) in its context, and (`weights`)
    safetensors whose headers cover the files, and a tokenizer (without one, transformers 5 makes an
    empty one, silently)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES)

    where, root = f"--model {path}", Path(path)

    def read_json(name: str):
        try:
            return json.loads((root / name).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{where}: {name} is not JSON ({e})") from None

    if not (root / "config.json").is_file():
        # A hub name (Qwen/Qwen2.5-0.5B-Instruct) reads as a local folder that is not there: say so.
        hub = not root.parent.exists() and path.count("/") == 1 and not path.startswith((".", "/"))
        raise ModelError(f"{where}: no Hugging Face checkpoint there (no config.json)" + (
            f"; hub names are not downloaded: download it first (hf download {path} --local-dir DIR) "
            f"and pass the directory" if hub else ""))
    config = read_json("config.json")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type is None:
        raise ModelError(f"{where}: config.json has no model_type")
    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"{where}: config.json's model_type {model_type!r} is not a causal LM that this "
                         f"transformers knows")
    if critic and model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:  # OPT, OLMo, Gemma 3, ...
        raise ModelError(f"{where}: transformers has no token-classification model for model_type {model_type!r}, "
                         f"which the critic and the outcome reward model are built as (critic.py); --estimator grpo "
                         f"trains no critic")
    scalar_heads = [a for a in config.get("architectures") or [] if str(a).endswith(SCALAR_HEADS)]
    if scalar_heads:
        raise ModelError(f"{where}: a {scalar_heads[0]} (a value or reward model's scalar head), not a policy; "
                         f"--model takes the causal LM that PPO trains")
    context = _context_length(config)
    if positions is not None and context is not None and positions > context:
        raise ModelError(f"{where}: its context holds {context} positions (max_position_embeddings), and "
                         f"--max-prompt-tokens + --max-new-tokens (or --eval-max-new-tokens) ask for {positions}")
    if not weights:
        return
    found = [name for name in WEIGHT_FILES if (root / name).is_file()]
    if not found:
        raise ModelError(f"{where}: no weights (none of {', '.join(WEIGHT_FILES)})")
    shards = [root / found[0]]
    if found[0].endswith(".index.json"):
        try:
            shards = [root / name for name in sorted(set(json.loads((root / found[0]).read_text())["weight_map"].values()))]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise ModelError(f"{where}: {found[0]} is not a weight map") from None
    from safetensors import SafetensorError, safe_open

    for shard in shards:
        if shard.suffix == ".bin":  # torch.save's zip archive: a cut file has lost its central directory
            if not zipfile.is_zipfile(shard):
                raise ModelError(f"{where}: {shard.name} is unreadable, truncated? (not a complete torch.save archive)")
            continue
        try:
            with safe_open(str(shard), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{where}: {shard.name} is unreadable, truncated? ({e})") from None
    for name in JSON_FILES:
        if (root / name).is_file():
            read_json(name)
    if not any((root / name).is_file() for name in VOCABULARY_FILES) and not any(root.glob("*.tiktoken")):
        raise ModelError(f"{where}: no tokenizer vocabulary (none of {', '.join(VOCABULARY_FILES)}, nor a "
                         f"*.tiktoken file)")


def check_vocabulary(path: str, tokenizer) -> None:
    """ModelError when the tokenizer has ids past the model's embedding rows: the first prompt that
    holds one stopped the run with an IndexError inside torch. (More rows than tokens is usual:
    Qwen2.5 pads its embedding.)"""
    from transformers import AutoConfig

    rows = getattr(AutoConfig.from_pretrained(path).get_text_config(), "vocab_size", None)
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise ModelError(f"--model {path}: the tokenizer has {len(tokenizer)} tokens and the model's embedding "
                         f"{rows} rows (vocab_size): is it the model's own tokenizer?")


SCALAR_HEADS = ("ForTokenClassification", "ForSequenceClassification")  # what critics and reward models are saved as


def _context_length(config: dict) -> int | None:
    """max_position_embeddings, or the RoPE-scaled length where the config sets a factor (YaRN) over
    the original length; None without max_position_embeddings. Some configs (Llama 3.1) already give
    the extended length as max_position_embeddings: it is not scaled again."""
    length = config.get("max_position_embeddings")
    if not isinstance(length, int):
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if not (isinstance(factor, (int, float)) and factor > 1):
        return length
    original = rope.get("original_max_position_embeddings", length)
    return max(length, int(original * factor))


# What `python -m support.sft` may change without changing pi_SFT: where it goes, how batches are split.
SFT_MAY_CHANGE = ("out_dir", "micro_batch_size")


def sft_settings(cfg: SFTConfig) -> dict:
    """What a cached pi_SFT is checked against: every other SFTConfig field, `steps` under
    train.py's name for it (--sft-steps). Only SFTConfig's: `python -m support.sft`'s report flags are not
    part of the model it writes."""
    return {("sft_steps" if f.name == "steps" else f.name): getattr(cfg, f.name) for f in fields(SFTConfig)
            if f.name not in SFT_MAY_CHANGE}


def sft_config(cfg) -> SFTConfig:
    """The cold start a train.py run of the built-in task asks for: its task's shape, `cfg.sft_steps`
    steps (None: the default)."""
    shape = task.SHAPES[cfg.task_length]
    return SFTConfig(steps=cfg.sft_steps or SFTConfig.steps, width=shape.width,
                     min_difficulty=shape.sft_difficulty[0], max_difficulty=shape.sft_difficulty[1])


def prepare_sft(cfg, critic: bool = True) -> str:
    """The pi_SFT of a run (`train.py`'s first stage): `cfg.model` when given (checked, and as a
    critic's backbone too where the run has one and `critic`), else the
    built-in task's cold start (of `cfg.task_length`), trained once into `sft_cache_path`
    (`cfg.sft_steps` steps, None: the default) and reused by every later run whose settings it was made with (a cached
    stage, `rundir.build_once`)."""
    if cfg.model is not None:
        check_model(cfg.model, positions=positions_needed(cfg), critic=critic and cfg.estimator == "gae")
        return cfg.model
    path = Path(sft_cache_path(cfg))
    wanted = sft_config(cfg)

    def build(staging: str) -> None:
        if is_main():  # under torchrun rank 0 trains it once; the others wait for it
            summary = train_sft(replace(wanted, out_dir=staging))
            (Path(staging) / "sft_summary.json").write_text(json.dumps({**summary, "out_dir": str(path)}, indent=2))

    built = build_once(str(path), sft_settings(wanted), build, owner=cfg.run_name, remedy="delete it to train a new one")
    if is_main():
        print(f"SFT: {'saved to' if built else 'reusing'} {path}")  # the final name, not the staging one
    return str(path)


def evaluate_task(model, tokenizer, problems: list[dict], max_new_tokens: int = 400, batch_size: int = 64,
                  temperature: float = 1.0, seed: int = 0, grader_timeout_s: float = 5.0) -> dict:
    """Sample one response per problem and report what pi_SFT does, graded by a `reward.Grader`
    (a sample it cannot grade within `grader_timeout_s` counts as wrong)."""
    engine = HFRollout(model, tokenizer)
    rows = []
    with Grader(num_workers=1, timeout_s=grader_timeout_s) as grader:
        for i in range(0, len(problems), batch_size):
            chunk = problems[i : i + batch_size]
            ids = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in chunk]
            batch = engine.generate(ids, max_new_tokens, temperature=temperature, seed=seed + i)
            texts = decode_responses(tokenizer, batch)
            outcomes = grader.grade(texts, [p["answer"] for p in chunk]).outcomes
            for p, text, outcome, n, cut in zip(chunk, texts, outcomes, batch.lengths.tolist(), batch.truncated):
                rows.append((p, task.parse_response(p["prompt"], text), outcome > 0, n, cut))
    return summarize(rows)


def _stats(rows: list[tuple]) -> dict:
    n = max(1, len(rows))
    return {"n": len(rows), "accuracy": sum(r[2] for r in rows) / n, "mean_length": sum(r[3] for r in rows) / n}


def summarize(rows: list[tuple], bucket: int = 4) -> dict:
    """rows of (problem, Trace, correct, length, truncated) -> accuracy and length overall, by strategy, by
    difficulty (grouped by `bucket`, with the shortcut share and both strategies' accuracy), and
    per-line accuracy of single and merged lines, and the share of the worked doublings that merged
    lines did (how much the reasoning was compressed). A response cut off at the token limit is its
    own strategy, "truncated", rather than "invalid" (it has no box); its worked lines still count."""
    by_strategy, by_bucket, line_ok = defaultdict(list), defaultdict(list), {"single": [], "merged": []}
    for r in rows:
        by_strategy["truncated" if r[4] else r[1].strategy].append(r)
        by_bucket[(r[0]["difficulty"] - 1) // bucket].append(r)
        for ok, steps in zip(r[1].line_ok, r[1].line_steps):
            line_ok["single" if steps == 1 else "merged"].append(ok)
    out = _stats(rows)
    out["by_strategy"] = {s: {**_stats(v), "share": len(v) / len(rows)} for s, v in sorted(by_strategy.items())}
    out["by_difficulty"] = {}
    for b, v in sorted(by_bucket.items()):
        short = [r for r in v if r[1].strategy == "shortcut"]
        worked = [r for r in v if r[1].strategy in ("full", "merged")]
        out["by_difficulty"][f"{b * bucket + 1}-{b * bucket + bucket}"] = {
            **_stats(v), "shortcut_share": len(short) / len(v),
            "shortcut_accuracy": _stats(short)["accuracy"] if short else None,
            "worked_accuracy": _stats(worked)["accuracy"] if worked else None}
    out["line_accuracy"] = {kind: (sum(v) / len(v) if v else None, len(v)) for kind, v in line_ok.items()}
    doublings = [n for r in rows for n in r[1].line_steps]
    out["merged_doubling_share"] = sum(n for n in doublings if n > 1) / sum(doublings) if doublings else None
    return out


def format_report(report: dict) -> str:
    """Markdown tables of a `summarize` result."""
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    lines = [f"accuracy {report['accuracy']:.3f}, mean length {report['mean_length']:.1f} tokens, n={report['n']}",
             "", "| difficulty | n | accuracy | mean length | shortcut share | shortcut acc. | full+merged acc. |",
             "|---|---|---|---|---|---|---|"]
    for d, v in report["by_difficulty"].items():
        lines.append(f"| {d} | {v['n']} | {v['accuracy']:.2f} | {v['mean_length']:.0f} | {v['shortcut_share']:.2f} "
                     f"| {f(v['shortcut_accuracy'])} | {f(v['worked_accuracy'])} |")
    lines += ["", "| strategy | share | accuracy | mean length |", "|---|---|---|---|"]
    for s, v in report["by_strategy"].items():
        lines.append(f"| {s} | {v['share']:.2f} | {v['accuracy']:.2f} | {v['mean_length']:.0f} |")
    lines.append("")
    for kind, (acc, n) in report["line_accuracy"].items():
        lines.append(f"per-line accuracy, {kind} lines: {f(acc)} over {n} lines")
    return "\n".join(lines)


@dataclass
class Args(SFTConfig):
    eval_problems: int = 256
    """held-out problems sampled (temperature 1) for the report after training; 0 skips it"""
    eval_seed: int = 1234
    """seed of the held-out problems and of sampling"""
    eval_max_new_tokens: int = 400
    """response limit of the report's samples (the long task needs train.py's 600)"""
    threads: int | None = None
    """torch CPU threads; None: every core this process may use (on a machine shared with other
    jobs, 1 can be many times faster than contending for busy cores)"""
    grader_timeout_s: float = 5.0
    """a sample of the report whose grading takes longer counts as wrong"""


if __name__ == "__main__":
    import tyro

    from support.config import usable_cores

    args = tyro.cli(Args)
    torch.set_num_threads(args.threads or usable_cores())
    train_sft(args)
    print(f"SFT: saved to {args.out_dir}")
    if args.eval_problems:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.out_dir)
        policy = AutoModelForCausalLM.from_pretrained(args.out_dir)
        held_out = task.make_problems(args.eval_problems, args.eval_seed, args.min_difficulty, args.max_difficulty,
                                      args.width)
        t0 = time.time()
        report = evaluate_task(policy, tok, held_out, max_new_tokens=args.eval_max_new_tokens, seed=args.eval_seed,
                               grader_timeout_s=args.grader_timeout_s)
        print(format_report(report))
        print(f"(evaluation took {time.time() - t0:.0f} s)")
