"""Users' prompt data (paper §4 setup: maths prompts with a verifiable final answer).

The built-in task lives in `task.py`; this module loads a user's file instead:

    records, stats = load_records("train.jsonl", tokenizer, max_prompt_tokens=1024)
    train, held_out = train_eval_split(records, eval_fraction=0.05, seed=0)

A record is `{"prompt": str, "answer": str, "prompt_ids": list[int]}`. JSONL (one object a line)
and Parquet are read; the field names are configurable. A malformed line, a missing field or an
empty prompt stops loading with the file and line named, or with `on_error="skip"` is skipped and
counted. Prompts longer than `max_prompt_tokens` are dropped and counted: a cut prompt would be a
different question.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal


@dataclass
class LoadStats:
    loaded: int = 0  # records returned
    skipped_malformed: int = 0  # bad lines skipped under on_error="skip"
    dropped_too_long: int = 0  # prompts over max_prompt_tokens


class DataError(ValueError):
    """A data file, or a record in it, that cannot be used; the message says where and why."""


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Prompt token ids; through the tokenizer's chat template when it has one.

    With a template the text is one user turn plus the assistant header (add_generation_prompt),
    and the template supplies any BOS itself, hence add_special_tokens=False.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    with path.open("rb") as f:  # decoded line by line: one bad line is one bad record
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})")
                continue
            line = line.rstrip("\r\n")  # else an error at the line's end reads "column 1" of the next
            if not line.strip():
                continue  # blank lines (a trailing newline) are not records
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                at = f"column {e.pos + 1} of {len(line)}"
                if e.pos >= len(line):
                    at = f"the line ends at column {len(line)}, cut short?"
                elif e.msg.startswith("Unterminated string"):
                    at += ", cut short?"
                yield where, DataError(f"{where}: malformed JSON ({e.msg}: {at})")


def _parquet_rows(path: Path, keys: tuple[str, str]) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    missing = [k for k in keys if k not in table.column_names]
    if missing:  # a whole-file problem: nothing to skip line by line
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {table.column_names})")
    for row, record in enumerate(table.select(list(keys)).to_pylist(), start=1):
        yield f"{path}: row {row}", record


def _check(where: str, record: object, prompt_key: str, answer_key: str) -> tuple[str, str]:
    """(prompt, answer) of one raw record, or DataError naming `where` and the fault."""
    if isinstance(record, DataError):
        raise record
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    for key in (prompt_key, answer_key):
        if record.get(key) is None:
            raise DataError(f"{where}: missing field {key!r}")
    prompt, answer = record[prompt_key], record[answer_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: empty or non-text prompt in field {prompt_key!r}")
    # Numeric answers are common in maths data (42, 0.5); they are graded as text anyway.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DataError(f"{where}: empty or non-text answer in field {answer_key!r}")
    return prompt, str(answer)


def load_records(
    path: str | Path,
    tokenizer,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_prompt_tokens: int | None = None,
    on_error: Literal["raise", "skip"] = "raise",
) -> tuple[list[dict], LoadStats]:
    """Records of a `.jsonl` or `.parquet` file, tokenized, plus what was skipped or dropped."""
    path = Path(path)
    if on_error not in ("raise", "skip"):
        raise ValueError(f"load_records: on_error must be 'raise' or 'skip', got {on_error!r}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"load_records: max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if not path.is_file():
        raise DataError(f"load_records: no file {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path, (prompt_key, answer_key))
    else:
        raise DataError(f"load_records: {path}: unknown format {suffix!r} (use .jsonl or .parquet)")

    records, stats = [], LoadStats()
    for where, raw in rows:
        try:
            prompt, answer = _check(where, raw, prompt_key, answer_key)
        except DataError:
            if on_error == "raise":
                raise
            stats.skipped_malformed += 1
            continue
        prompt_ids = encode_prompt(tokenizer, prompt)
        if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
            stats.dropped_too_long += 1
            continue
        records.append({"prompt": prompt, "answer": answer, "prompt_ids": prompt_ids})
    stats.loaded = len(records)
    return records, stats


def train_eval_split(records: list[dict], eval_fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval), each in input order; the same for any order of the input records.

    A record's side depends only on a hash of (seed, prompt, answer): the round(n * eval_fraction)
    smallest hashes go to eval. Identical records hash alike and never straddle the split, so
    duplicated prompts cannot leak from train into eval.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"train_eval_split: eval_fraction must be in [0, 1), got {eval_fraction}")

    def key(record: dict) -> str:
        text = f"{seed}\0{record['prompt']}\0{record['answer']}"
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    keys = [key(r) for r in records]
    n_eval = round(len(records) * eval_fraction)
    eval_keys: set[str] = set()
    taken = 0
    for i in sorted(range(len(records)), key=keys.__getitem__):
        if taken >= n_eval and keys[i] not in eval_keys:
            break  # duplicates sit next to each other in hash order: whole groups stay together
        eval_keys.add(keys[i])
        taken += 1
    train = [r for r, k in zip(records, keys) if k not in eval_keys]
    held_out = [r for r, k in zip(records, keys) if k in eval_keys]
    return train, held_out


# --- what a run trains and evaluates on ---------------------------------------------------------


def task_difficulty(cfg) -> tuple[int, int]:
    """The range of k of the built-in task's RL and held-out problems: --task-difficulty, or its
    task length's."""
    import task

    return tuple(cfg.task_difficulty or task.SHAPES[cfg.task_length].difficulty)


def prepare_data(cfg, tokenizer) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records: the user's `--data` file, or the built-in task (`task.py`),
    whose problems depend only on fixed seeds so that every run sees the same data."""
    if cfg.data is None:
        import task

        records, width = {}, task.SHAPES[cfg.task_length].width
        for split, n, seed in (("train", cfg.task_train_size, 1), ("eval", cfg.task_eval_size, 2)):
            problems = task.make_problems(n, seed, *task_difficulty(cfg), width)
            records[split] = [{**p, "prompt_ids": encode_prompt(tokenizer, p["prompt"])} for p in problems]
        return records["train"], records["eval"]
    records, stats = load_records(cfg.data, tokenizer, cfg.prompt_key, cfg.answer_key,
                                  cfg.max_prompt_tokens, "skip" if cfg.skip_bad_records else "raise")
    print(f"data: {stats.loaded} records from {cfg.data} ({stats.skipped_malformed} malformed skipped, "
          f"{stats.dropped_too_long} over {cfg.max_prompt_tokens} tokens dropped)")
    if not records:
        raise DataError(f"--data {cfg.data}: no usable records")
    train, held_out = train_eval_split(records, cfg.eval_fraction, seed=0)
    if not train or not held_out:
        raise DataError(f"--data {cfg.data}: {len(records)} records leave {len(train)} for training and "
                        f"{len(held_out)} held out at --eval-fraction {cfg.eval_fraction}; both need at least one")
    return train, held_out


def stream_seed(seed: int, stream: str, step: int) -> int:
    """A seed that depends only on (run seed, stream, step). Every random draw of a run has its
    own named stream (prompts, sampling, shuffles of each stage), so a resumed run replays it
    exactly and no stage shifts another's draws."""
    return int(hashlib.sha256(f"{seed}/{stream}/{step}".encode()).hexdigest()[:15], 16)


def sample_prompts(records: list[dict], cfg, step: int, stream: str) -> list[dict]:
    """This rank's prompts for one step, each repeated `samples_per_prompt` times side by side.

    A function of (seed, stream, step) only, so a resumed run draws the same prompts. Under
    torchrun the global batch of `prompts_per_step` prompts is split evenly across ranks.
    """
    import torch

    from fsdp_utils import rank, world_size

    generator = torch.Generator().manual_seed(stream_seed(cfg.seed, stream, step))
    picked = torch.randint(len(records), (cfg.prompts_per_step,), generator=generator).tolist()
    picked = picked[rank() :: world_size()]
    return [records[i] for i in picked for _ in range(cfg.samples_per_prompt)]
