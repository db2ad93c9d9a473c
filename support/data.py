"""Users' prompt data (paper §4 setup: maths prompts with a verifiable final answer).

The built-in task lives in `task.py`; this module loads a user's files instead:

    records, stats = load_records("train.parquet", tokenizer, max_prompt_tokens=1024)
    train, held_out = train_eval_split(records, eval_fraction=0.05, seed=0)

A record is `{"prompt", "answer", "data_source", "prompt_ids"}`. The layouts people already have
are read as they are:
- files: `.jsonl` (one object a line), `.json` (an array of objects, or JSON lines as Hugging Face
  `datasets` writes them) and `.parquet`, UTF-8 with or without a byte-order mark; one file, a
  folder of them, or a glob (`data_files`);
- prompts: text, or a list of chat messages (`[{"role": "user", "content": ...}]`, verl's and TRL's
  conversational layout), which go through the tokenizer's chat template;
- fields: `prompt_key` / `answer_key` may be dotted paths into nested fields
  (`reward_model.ground_truth`, verl's); `data_source` (verl's) names the set a record belongs to,
  else the file's name does (`_set_names`; held-out metrics are reported per data source);
- answers: `answer_format` "gsm8k" takes the number after GSM8K's `#### `, "math" the answer as
  written (the grader reads its last `\\boxed{}` if it has one); None detects a last line `#### ...`
  and no `\\boxed{}`; held-out sets (`--val-data`) are always detected, each set reported apart;
- `prompt_template` (`"{prompt} Please reason step by step, ..."`) rewrites the prompt text (the
  last user turn of a message list); `prompt_format` "raw" leaves the chat template out
  (`encode_prompt`).
A malformed line, a missing field, an empty prompt or answer stops loading with the file and line
named, or with `on_error="skip"` is skipped and counted. Prompts longer than `max_prompt_tokens`
are dropped and counted: a cut prompt would be a different question.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Iterator, Literal

SUFFIXES = (".jsonl", ".json", ".parquet")


def _say(text: str) -> None:
    """Print on rank 0 only (torchrun's RANK: this module loads no torch), not once per rank."""
    if os.environ.get("RANK", "0") == "0":
        print(text)


@dataclass
class LoadStats:
    loaded: int = 0  # records returned
    skipped_malformed: int = 0  # bad lines skipped under on_error="skip"
    dropped_too_long: int = 0  # prompts over max_prompt_tokens
    # The first skipped line, as the error it would have stopped on: a wrong --prompt-key skips every line.
    first_skipped: str = dataclasses.field(default="", compare=False)
    # Files the folder or glob held that are not data (.csv, .jsonl.gz): said, not read.
    not_read: list[Path] = dataclasses.field(default_factory=list, compare=False)


class DataError(ValueError):
    """A data file, or a record in it, that cannot be used; the message says where and why."""


def encode_prompt(tokenizer, prompt: str | list[dict],
                  prompt_format: Literal["chat", "raw"] | None = None) -> list[int]:
    """Prompt token ids; through the tokenizer's chat template when it has one (`prompt_format`
    None), always ("chat") or never ("raw": the text as it is). A text prompt is one user turn; a
    list of chat messages needs the template.

    With a template the text is the messages plus the assistant header (add_generation_prompt),
    and the template supplies any BOS itself, hence add_special_tokens=False.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise DataError("--prompt-format chat: the model's tokenizer has no chat template (set its "
                        "tokenizer_config.json's chat_template), or --prompt-format raw")
    if not isinstance(prompt, str) and prompt_format == "raw":
        raise DataError("chat-message prompts need the chat template, which --prompt-format raw leaves out")
    if has_template and prompt_format != "raw":
        from jinja2 import TemplateError, TemplateSyntaxError

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:  # Gemma's refuses a system turn, Mistral's turns that do not alternate
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateSyntaxError as e:  # the model's fault, not the record's
            raise DataError(f"the model's chat template is not valid Jinja (its line {e.lineno}: {e.message}); "
                            f"see chat_template in its tokenizer_config.json or chat_template.jinja") from None
        except TemplateError as e:
            roles = ", ".join(m.get("role", "?") for m in messages)
            raise DataError(f"the model's chat template refuses these messages (roles: {roles}): {e}") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise DataError("chat-message prompts need a tokenizer with a chat template; the model's tokenizer has none "
                        "(set its tokenizer_config.json's chat_template)")
    return list(tokenizer(prompt)["input_ids"])


def data_files(spec: str | Path) -> list[Path]:
    """The files a `--data` / `--val-data` value names: a file, a folder (its .json, .jsonl and
    .parquet files) or a glob (`data/train-*.parquet`, `**` for subfolders; the .json, .jsonl and
    .parquet files it matches), in sorted order. A leading `~` is the home folder, quoted or not; a
    path that exists is itself, glob characters in its name (`set[1].jsonl`) or not."""
    return _named_files(spec)[0]


def _named_files(spec: str | Path) -> tuple[list[Path], list[Path]]:
    """(`data_files(spec)`, the other files of its folder or glob, which are not read)."""
    spec = os.path.expanduser(str(spec))
    path = Path(spec)
    if glob.has_magic(spec) and not path.is_symlink() and not path.exists():
        matched = [Path(p) for p in glob.glob(spec, recursive=True) if _is_file(Path(p))]
        files = sorted(p for p in matched if p.suffix.lower() in SUFFIXES)
        if not files:
            raise DataError(f"{spec}: the pattern matches no {', '.join(SUFFIXES)} file"
                            + (f" (it matches {len(matched)} other files)" if matched else ""))
        return files, sorted(set(matched) - set(files))
    if path.is_dir():
        listed = [p for p in path.iterdir() if _is_file(p)]
        files = sorted(p for p in listed if p.suffix.lower() in SUFFIXES)
        if not files:
            raise DataError(f"{spec}: a folder with no {', '.join(SUFFIXES)} file")
        return files, sorted(set(listed) - set(files))
    if not _is_file(path):
        raise DataError(f"{spec}: no file or folder of that name")
    return [path], []


def _is_file(path: Path) -> bool:
    """Whether `path` is a file; DataError for a symbolic link to nothing, which would be passed over
    in silence (a Hugging Face cache's snapshot holds links into its blobs: a download cut short)."""
    if path.is_symlink() and not path.exists():
        raise DataError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist (a download cut short?)")
    return path.is_file()


def field(record: dict, key: str):
    """record[key]; a dotted key (`reward_model.ground_truth`) walks into nested fields unless the
    record has a field of that very name. None when absent."""
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


# JSON's escapes can spell half of a surrogate pair alone (\ud800), which no tokenizer or grader takes.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
GSM8K_MARK = "####"
# The answer after the mark: a sign (before or after a dollar sign), digits with thousands
# separators (commas, or spaces, no-break or thin ones, before three digits; India's 1,00,000 too),
# a decimal part or a bare one (.5), and a fraction (3/4).
_NUMBER = re.compile(r"\$?[-\u2212]?\$?(?:\d+(?:,\d{2}(?=,\d)|,\d{3}(?!\d)|[ \u00a0\u2009\u202f]\d{3}(?!\d))*)?"
                     r"(?:\.\d+)?(?:/\d+)?")
# What makes that number a piece of a longer one (2,5 12:30 1e5 3 1/2 \frac{1}{2} 5 - 3): its first
# digits would be a wrong gold, against which every right response scores -1.
_GLUED_BEFORE = re.compile(r"[\w{^_/.\\]$")
_GLUED_AFTER = re.compile(r"\s?[-+*=,.:/^_{}\u2212]*\s?\d|[eE][-+]?\d|[{}^_]")


def gold_answer(answer: str, answer_format: Literal["gsm8k", "math"] | None) -> str:
    """What the grader compares a response's boxed answer with. GSM8K writes a worked solution and
    then `#### 72`: the number that follows the last `####`, thousands separators dropped, a
    Unicode minus read as `-` ("gsm8k"; None detects it: an answer whose last line starts with `####`
    and that holds no `\\boxed{}`, since a Markdown heading is `####` too). Otherwise ("math") the answer as
    written: the grader takes its last `\\boxed{}` if it has one. ValueError for a GSM8K answer
    without a number after `####`, or with a piece of a longer one (`2,5`, `12:30`, `\\frac{1}{2}`)."""
    if answer_format is None:
        last_line = answer.strip().rpartition("\n")[2].strip()
        gsm8k = last_line.startswith(GSM8K_MARK) and "\\boxed" not in answer
        answer_format = "gsm8k" if gsm8k else "math"
    if answer_format == "math":
        return answer
    if GSM8K_MARK not in answer:
        raise ValueError(f"no '{GSM8K_MARK} <number>' in the answer (GSM8K format)")
    tail = answer.rpartition(GSM8K_MARK)[2]
    found = next((m for m in _NUMBER.finditer(tail) if any(c.isdigit() for c in m.group())), None)
    if found is None:
        raise ValueError(f"no number after '{GSM8K_MARK}' in the answer (GSM8K format)")
    if _GLUED_BEFORE.search(tail[:found.start()]) or _GLUED_AFTER.match(tail, found.end()):
        raise ValueError(f"the answer after '{GSM8K_MARK}' is not one number (GSM8K format; write it as one: "
                         f"1000, 2.5, -3/4)")
    number = re.sub(r"[$, \u00a0\u2009\u202f]", "", found.group()).replace("\u2212", "-")
    return re.sub(r"^(-?)\.", r"\g<1>0.", number)  # .5 -> 0.5


def apply_template(prompt: str | list[dict], template: str | None) -> str | list[dict]:
    """`template` with `{prompt}` replaced by the prompt text, or by the content of the last user
    turn of a message list (plain replacement, so `\\boxed{}` in a template needs no escaping)."""
    if template is None:
        return prompt
    if isinstance(prompt, str):
        return template.replace("{prompt}", prompt)
    last = max(i for i, m in enumerate(prompt) if m["role"] == "user")
    return [*prompt[:last], {**prompt[last], "content": template.replace("{prompt}", prompt[last]["content"])},
            *prompt[last + 1:]]


def _whole_file_json(path: Path) -> None:
    """DataError when the file is one JSON value spread over lines (`json.dump(..., indent=2)`): read as
    JSON lines, its first line `{` was reported as a malformed line cut short."""
    with path.open("rb") as f:
        first = f.readline(1 << 16).removeprefix(codecs.BOM_UTF8).strip()
    if first not in (b"{", b"["):
        return
    try:
        whole = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # malformed: its lines say where
    if isinstance(whole, list):
        if path.suffix.lower() == ".jsonl":
            raise DataError(f"{path}: a JSON array, not JSON lines (one record a line): name the file .json")
        return
    keys = ", ".join(map(str, list(whole)[:8])) if isinstance(whole, dict) else type(whole).__name__
    raise DataError(f"{path}: one JSON object over several lines (keys: {keys}), not an array of records or JSON "
                    f"lines (one record a line)")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    _whole_file_json(path)
    with path.open("rb") as f:  # decoded line by line: one bad line is one bad record
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark starts line 1
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
                if line.strip() in ("{", "["):
                    at = "a line of only a bracket: records written over several lines? JSON lines hold one a line"
                elif e.pos >= len(line):
                    at = f"the line ends at column {len(line)}, cut short?"
                elif e.msg.startswith("Unterminated string"):
                    at += ", cut short?"
                yield where, DataError(f"{where}: malformed JSON ({e.msg}: {at})")


def _json_rows(path: Path) -> Iterator[tuple[str, object]]:
    """A `.json` file: an array of objects, or JSON lines (what `datasets`' to_json writes)."""
    with path.open("rb") as f:
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b"["):
        yield from _jsonl_rows(path)
        return
    try:
        records = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: malformed JSON array ({e.msg} at line {e.lineno} column {e.colno})") from None
    for i, record in enumerate(records, start=1):
        yield f"{path}: record {i}", record


def _parquet_rows(path: Path, keys: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    # A dotted key names a field inside a struct column (its first part), unless a column has that name.
    columns = {key: key if key in table.column_names else key.split(".")[0] for key in keys}
    missing = [key for key, column in columns.items() if column not in table.column_names]
    if missing:  # a whole-file problem: nothing to skip line by line
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {table.column_names})")
    wanted = sorted(set(columns.values()) | ({"data_source"} & set(table.column_names)))
    for row, record in enumerate(table.select(wanted).to_pylist(), start=1):
        yield f"{path}: row {row}", record


def _check_messages(where: str, messages: list, key: str) -> None:
    """A chat-message prompt: text roles and contents, and a user turn (for --prompt-template to rewrite
    and for the policy to answer), else DataError naming `where`."""
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise DataError(f"{where}: field {key!r} is neither text nor a list of chat messages with text 'role' "
                        f"and 'content'")
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise DataError(f"{where}: the chat messages in field {key!r} have no user turn "
                        f"(roles: {', '.join(m['role'] for m in messages)})")
    if not users[-1]["content"].strip():
        raise DataError(f"{where}: the last user turn of the chat messages in field {key!r} is empty")
    if messages[-1]["role"] == "assistant":  # a whole conversation: the policy would be shown the answer
        raise DataError(f"{where}: the chat messages in field {key!r} end with an assistant turn; a prompt ends "
                        f"where the policy answers (TRL's conversational layout: the 'prompt' field, not 'messages')")


def _check(where: str, record: object, prompt_key: str, answer_key: str,
           answer_format: Literal["gsm8k", "math"] | None) -> tuple[str | list[dict], str]:
    """(prompt, gold answer) of one raw record, or DataError naming `where` and the fault."""
    if isinstance(record, DataError):
        raise record
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    prompt, answer = field(record, prompt_key), field(record, answer_key)
    for key, value in ((prompt_key, prompt), (answer_key, answer)):
        if value is None:
            # A misspelt --prompt-key/--answer-key: the record's own fields show the right one. (A field that
            # is there but null, or a nested one, is a fault of that record alone: its fields would mislead.)
            absent = key not in record and key.split(".")[0] not in record
            names = ", ".join(map(repr, list(record)[:12])) + (", ..." if len(record) > 12 else "")
            raise DataError(f"{where}: missing field {key!r}" + (f" (its fields: {names or 'none'})" if absent else ""))
    if isinstance(prompt, list):
        _check_messages(where, prompt, prompt_key)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: empty or non-text prompt in field {prompt_key!r}")
    texts = [(prompt_key, m["content"]) for m in prompt] if isinstance(prompt, list) else [(prompt_key, prompt)]
    for key, text in [*texts, (answer_key, answer)]:
        if isinstance(text, str) and (surrogate := _LONE_SURROGATE.search(text)):
            raise DataError(f"{where}: field {key!r} is not valid Unicode text (a lone surrogate, "
                            f"{surrogate.group().encode('unicode_escape').decode()}, at character {surrogate.start()})")
    # Numeric answers are common in maths data (42, 0.5; Parquet's decimals); they are graded as text anyway.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float, Decimal)):
        hint = " (chat messages: the answer is a field of its own, --answer-key)" if isinstance(answer, list) else ""
        raise DataError(f"{where}: the answer in field {answer_key!r} is a {type(answer).__name__}, not text or a "
                        f"number{hint}")
    if not str(answer).strip():
        raise DataError(f"{where}: empty answer in field {answer_key!r}")
    if isinstance(answer, (float, Decimal)):
        if not math.isfinite(answer):
            raise DataError(f"{where}: the answer in field {answer_key!r} is {answer}")
        answer = format(Decimal(repr(answer)) if isinstance(answer, float) else answer, "f")  # 1e-05 -> 0.00001
    from reward import ungradable_gold  # here, not at the top: math-verify takes a second to import

    try:
        gold = gold_answer(str(answer), answer_format)
        if why := ungradable_gold(gold):
            raise ValueError(f"no response can match this answer: {why}")
    except ValueError as e:
        raise DataError(f"{where}: {e}, field {answer_key!r}: {str(answer)[-60:]!r}") from None
    return prompt, gold


def _template_marks(tokenizer) -> list[str]:
    """The special tokens the tokenizer's chat template writes around a user turn (Qwen's
    `<|im_start|>`, Llama's `<|start_header_id|>`): a prompt holding one was templated already."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that needs more than one user turn: checked record by record instead
        return []
    plain = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token}  # `<s>` may be HTML
    return [t for t in tokenizer.all_special_tokens if t and t in text and t not in plain]


def _check_not_templated(where: str, prompt: str | list[dict], marks: list[str]) -> None:
    """DataError naming `where` when the prompt holds one of the chat template's `marks`."""
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    if found := [m for m in marks if any(m in text for text in texts)]:
        raise DataError(f"{where}: the prompt already holds {found[0]!r}, which the model's chat template "
                        f"writes itself: it would be templated twice; give the plain question or chat messages")


def _set_names(files: list[Path]) -> dict[Path, str]:
    """Each file's records' data source when they name none: its name, without a Hugging Face shard
    suffix (`test-00000-of-00001.parquet` -> `test`: shards of one set share it); `<folders>/<name>`
    where files of one name lie in different folders, after the folders below their common one (a
    glob over `aime/test.jsonl` and `math500/test-00000-of-00001.parquet`; `aime24/data/test` and
    `math500/data/test` in Hugging Face's layout)."""
    names = {file: re.sub(r"-\d{5}-of-\d{5}$", "", file.stem) for file in files}
    folders = {}
    for file, name in names.items():
        folders.setdefault(name, set()).add(file.parent.resolve())
    common = {name: Path(os.path.commonpath(list(dirs))) for name, dirs in folders.items() if len(dirs) > 1}
    return {file: f"{file.parent.resolve().relative_to(common[name]).as_posix()}/{name}" if name in common else name
            for file, name in names.items()}


def load_records(
    path: str | Path,
    tokenizer,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_prompt_tokens: int | None = None,
    on_error: Literal["raise", "skip"] = "raise",
    prompt_template: str | None = None,
    answer_format: Literal["gsm8k", "math"] | None = None,
    prompt_format: Literal["chat", "raw"] | None = None,
) -> tuple[list[dict], LoadStats]:
    """Records of the files `path` names (`data_files`), tokenized, plus what was skipped or dropped."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"load_records: on_error must be 'raise' or 'skip', got {on_error!r}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"load_records: max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    records, stats = [], LoadStats()
    template_marks = _template_marks(tokenizer) if prompt_format != "raw" else []  # raw: a format of the run's own
    files, stats.not_read = _named_files(path)
    set_names = _set_names(files)

    def bad_record(error: DataError) -> None:  # stop on it, or count it (the first kept, to name it)
        if on_error == "raise":
            raise error
        stats.skipped_malformed += 1
        stats.first_skipped = stats.first_skipped or str(error)

    for file in files:
        suffix = file.suffix.lower()
        if suffix == ".jsonl":
            rows = _jsonl_rows(file)
        elif suffix == ".json":
            rows = _json_rows(file)
        elif suffix == ".parquet":
            rows = _parquet_rows(file, (prompt_key, answer_key))
        else:
            raise DataError(f"load_records: {file}: unknown format {suffix!r} (use {', '.join(SUFFIXES)})")
        for where, raw in rows:
            try:
                prompt, answer = _check(where, raw, prompt_key, answer_key, answer_format)
                prompt = apply_template(prompt, prompt_template)
                _check_not_templated(where, prompt, template_marks)
            except DataError as e:
                bad_record(e)
                continue
            try:  # not a fault of the record, so never skipped: a tokenizer without a chat template
                prompt_ids = encode_prompt(tokenizer, prompt, prompt_format)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if not prompt_ids:  # a tokenizer that drops the characters it lacks: the rollout needs a token
                bad_record(DataError(f"{where}: the prompt has no token in the model's tokenizer (it drops every "
                                     f"character of {str(prompt)[:40]!r})"))
                continue
            if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
                stats.dropped_too_long += 1
                continue
            source = raw.get("data_source")
            records.append({"prompt": prompt, "answer": answer, "prompt_ids": prompt_ids,
                            "data_source": source if isinstance(source, str) and source else set_names[file]})
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
    from support import task

    return tuple(cfg.task_difficulty or task.SHAPES[cfg.task_length].difficulty)


def prepare_data(cfg, tokenizer) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records: the user's `--data` (held out: `--val-data`, else a hash split of
    `--data`), or the built-in task (`task.py`), whose problems depend only on fixed seeds so that
    every run sees the same data."""
    if cfg.data is None:
        return _built_in_task(cfg, tokenizer)
    records = _load(cfg, cfg.data, tokenizer, cfg.prompt_key, cfg.answer_key, cfg.answer_format)
    if cfg.val_data:  # held-out sets of their own: the training data is not split
        # Their gold answers' format is detected, not --answer-format's: MATH-500 beside GSM8K training.
        sets = [_load(cfg, spec, tokenizer, *cfg.val_keys(i), None) for i, spec in enumerate(cfg.val_data)]
        training = {tuple(r["prompt_ids"]) for r in records}
        for spec, held_out in zip(cfg.val_data, sets):  # said, as the built-in task says it: not refused
            if seen := sum(tuple(r["prompt_ids"]) in training for r in held_out):
                _say(f"note: {seen} of the {len(held_out)} held-out problems of {spec} are also training problems "
                     f"of --data {cfg.data}")
        return records, _sets_apart(sets, cfg.val_data)
    train, held_out = train_eval_split(records, cfg.eval_fraction, seed=0)
    if not train or not held_out:
        raise DataError(f"--data {cfg.data}: {len(records)} records leave {len(train)} for training and "
                        f"{len(held_out)} held out at --eval-fraction {cfg.eval_fraction}; both need at least one")
    return train, held_out


def _built_in_task(cfg, tokenizer) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records of the built-in task (`task.py`), drawn with fixed seeds."""
    from support import task

    records, width, (lo, hi) = {}, task.SHAPES[cfg.task_length].width, task_difficulty(cfg)
    for split, n, seed in (("train", cfg.task_train_size, 1), ("eval", cfg.task_eval_size, 2)):
        problems = task.make_problems(n, seed, lo, hi, width)
        records[split] = [{**p, "prompt_ids": encode_prompt(tokenizer, p["prompt"])} for p in problems]
    longest = max((len(r["prompt_ids"]) for split in records.values() for r in split), default=0)
    if longest > cfg.max_prompt_tokens:  # none may be dropped: the task's sets are fixed by their seeds
        raise DataError(f"the built-in task's prompts take up to {longest} tokens, over --max-prompt-tokens "
                        f"{cfg.max_prompt_tokens}")
    # The built-in model's positions past CONTEXT were never trained (RoPE runs on, without an error).
    new_tokens = max(cfg.max_new_tokens, cfg.eval_max_new_tokens or 0)
    if cfg.model is None and longest + new_tokens > task.CONTEXT:
        raise DataError(f"the built-in model holds {task.CONTEXT} positions, and the task's prompts (up to {longest} "
                        f"tokens) + --max-new-tokens (or --eval-max-new-tokens) {new_tokens} ask for "
                        f"{longest + new_tokens}; at most {task.CONTEXT - longest} new tokens")
    # Both sets are drawn from one pool: said, not hidden (a narrow --task-difficulty shrinks the pool).
    training = {r["prompt"] for r in records["train"]}
    if seen := sum(r["prompt"] in training for r in records["eval"]):
        _say(f"note: {seen} of the {len(records['eval'])} held-out problems are also RL training problems "
              f"(both drawn from the {(hi - lo + 1) * 9 * 10 ** (width - 1):,} problems of k in [{lo}, {hi}])")
    return records["train"], records["eval"]


def _sets_apart(sets: list[list[dict]], specs: tuple[str, ...]) -> list[dict]:
    """The records of several --val-data values, whose data sources are reported apart: a name two
    values share (gsm8k/test.jsonl and math500/test-00000-of-00001.parquet: both `test`) becomes
    `<folder>/<name>` after the folder of the value's files, or `<name>#<i>` after its place in
    --val-data when those folders are named alike too."""
    names = [{r["data_source"] for r in records} for records in sets]
    shared = {n for i, a in enumerate(names) for b in names[i + 1:] for n in a & b}
    folders = [data_files(spec)[0].parent.resolve().name for spec in specs]
    renamed = {}
    for i, (records, folder) in enumerate(zip(sets, folders)):
        for r in records:
            if (old := r["data_source"]) in shared:
                r["data_source"] = f"{folder}/{old}" if folder and folders.count(folder) == 1 else f"{old}#{i + 1}"
                renamed[r["data_source"]] = old
    if renamed:
        _say(f"data: --val-data sets named alike are reported apart: "
              f"{', '.join(f'{old} -> {new}' for new, old in sorted(renamed.items()))}")
    return [r for records in sets for r in records]


def _load(cfg, spec: str, tokenizer, prompt_key: str, answer_key: str, answer_format) -> list[dict]:
    """The records of one --data or --val-data value, with the run's template and this answer format."""
    records, stats = load_records(spec, tokenizer, prompt_key, answer_key, cfg.max_prompt_tokens,
                                  "skip" if cfg.skip_bad_records else "raise", cfg.prompt_template, answer_format,
                                  cfg.prompt_format)
    first = f"; the first skipped: {stats.first_skipped}" if stats.first_skipped else ""
    _say(f"data: {stats.loaded} records from {spec} ({stats.skipped_malformed} malformed skipped, "
          f"{stats.dropped_too_long} over {cfg.max_prompt_tokens} tokens dropped{first})")
    if others := [p for p in stats.not_read if not p.name.startswith(".")]:  # not .gitattributes
        kinds = sorted({"".join(p.suffixes) or p.name for p in others})
        _say(f"note: {spec}: {len(others)} other file{'s' * (len(others) > 1)} not read ({', '.join(kinds)}); only "
             f"{', '.join(SUFFIXES)} files are data")
    if not records:
        raise DataError(f"{spec}: no usable records ({stats.skipped_malformed} malformed skipped, "
                        f"{stats.dropped_too_long} over --max-prompt-tokens {cfg.max_prompt_tokens}{first})")
    return records


def stream_seed(seed: int, stream: str, step: int) -> int:
    """A seed that depends only on (run seed, stream, step). Every random draw of a run has its
    own named stream (prompts, sampling, shuffles of each stage), so a resumed run replays it
    exactly and no stage shifts another's draws."""
    return int(hashlib.sha256(f"{seed}/{stream}/{step}".encode()).hexdigest()[:15], 16)


def sample_prompts(records: list[dict], cfg, step: int, stream: str) -> list[dict]:
    """This rank's prompts for one step, each repeated `samples_per_prompt` times side by side.

    Drawn with replacement, not in shuffled epochs as verl and TRL go (every result table was made
    so): a step may repeat a prompt. A function of (seed, stream, step) only, so a resumed run draws
    the same prompts. Under torchrun the global batch of `prompts_per_step` prompts is split evenly
    across ranks.
    """
    import torch

    from fsdp_utils import rank, world_size

    generator = torch.Generator().manual_seed(stream_seed(cfg.seed, stream, step))
    picked = torch.randint(len(records), (cfg.prompts_per_step,), generator=generator).tolist()
    picked = picked[rank() :: world_size()]
    return [records[i] for i in picked for _ in range(cfg.samples_per_prompt)]
