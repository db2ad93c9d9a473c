"""data.py: loading JSONL / JSON / Parquet prompt files in the layouts users bring, error reporting, chat
templates, gold answers, the split."""

import json
import random
from pathlib import Path

import pandas as pd
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from support.data import DataError, LoadStats, encode_prompt, load_records, sample_prompts, stream_seed, train_eval_split

TEMPLATE = ("{% for m in messages %}<u>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")


def char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character."""
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    out.chat_template = chat_template
    return out


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


GOOD = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "half of 1?", "answer": 0.5}, {"prompt": "3*3", "answer": 9}]


def test_jsonl_records_hold_prompt_answer_and_ids(tmp_path):
    tok = char_tokenizer()
    records, stats = load_records(write_jsonl(tmp_path / "d.jsonl", GOOD + [""]), tok)
    assert [r["prompt"] for r in records] == [g["prompt"] for g in GOOD]
    assert [r["answer"] for r in records] == ["2", "0.5", "9"]  # numbers become text
    assert records[0]["prompt_ids"] == tok("1+1=")["input_ids"]
    assert stats == LoadStats(loaded=3, skipped_malformed=0, dropped_too_long=0)


def test_chat_template_is_applied_with_generation_prompt(tmp_path):
    tok = char_tokenizer(TEMPLATE)
    records, _ = load_records(write_jsonl(tmp_path / "d.jsonl", GOOD[:1]), tok)
    assert tok.decode(records[0]["prompt_ids"]) == "<u>1+1=<a>"
    assert encode_prompt(char_tokenizer(), "1+1=") == char_tokenizer()("1+1=")["input_ids"]


def test_prompt_format_raw_leaves_the_chat_template_out_and_chat_insists_on_one(tmp_path):
    """--prompt-format raw: the text as it is, even where the tokenizer has a template (a base model
    prompted in a format of the run's own, which may hold the template's marks); chat: a tokenizer
    without a template is refused; message lists need the template."""
    tok = char_tokenizer(TEMPLATE)
    assert encode_prompt(tok, "1+1=", "raw") == tok("1+1=")["input_ids"]
    assert tok.decode(encode_prompt(tok, "1+1=", "chat")) == tok.decode(encode_prompt(tok, "1+1=")) == "<u>1+1=<a>"
    with pytest.raises(DataError, match=r"--prompt-format chat: the model's tokenizer has no chat template"):
        encode_prompt(char_tokenizer(), "1+1=", "chat")
    with pytest.raises(DataError, match=r"chat-message prompts need the chat template, which --prompt-format raw"):
        encode_prompt(tok, [{"role": "user", "content": "1+1="}], "raw")
    marked = char_tokenizer(TEMPLATE)
    marked.add_special_tokens({"additional_special_tokens": ["<u>"]})
    own_format = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<u>1+1=<a>", "answer": "2"}])
    with pytest.raises(DataError, match=r"the prompt already holds '<u>'"):  # templated twice, by default
        load_records(own_format, marked)
    records, _ = load_records(own_format, marked, prompt_format="raw")
    assert marked.decode(records[0]["prompt_ids"]) == "<u>1+1=<a>"


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "x", "answer": ', "malformed JSON"),
    ({"answer": "1"}, "missing field 'prompt'"),
    ({"prompt": "x"}, "missing field 'answer' \\(its fields: 'prompt'\\)"),  # a misspelt key shows the right one
    ({"prompt": "x", "answer": None}, "missing field 'answer'$"),  # there but null: its fields would mislead
    ({"prompt": "   ", "answer": "1"}, "empty or non-text prompt"),
    ({"prompt": "x", "answer": ""}, "empty answer in field 'answer'"),
    ({"prompt": "x", "answer": " \t "}, "empty answer in field 'answer'"),  # blank is empty too: no gold to grade by
    ({"prompt": "x", "answer": True}, "the answer in field 'answer' is a bool, not text or a number"),  # not the text "True"
    ({"prompt": "x", "answer": [{"role": "assistant", "content": "2"}]},
     "the answer in field 'answer' is a list, not text or a number \\(chat messages"),
    ([1, 2], "expected an object"),
    # JSON's escapes spell a lone surrogate, which the tokenizer refused with a TypeError from deep inside it.
    ('{"prompt": "a\\ud800b", "answer": "1"}', "field 'prompt' is not valid Unicode text \\(a lone surrogate, "
                                               "\\\\ud800, at character 1\\)"),
    ({"prompt": [{"role": "user", "content": "x\udfff"}], "answer": "1"}, "field 'prompt' is not valid Unicode"),
    ({"prompt": "x", "answer": "\ud800"}, "field 'answer' is not valid Unicode"),
    # Golds that no response can match, which scored every response -1.
    ({"prompt": "x", "answer": "$$"}, "no response can match this answer: it is empty inside its math delimiters"),
    ({"prompt": "x", "answer": "\\boxed{}"}, "no response can match this answer: its last \\\\boxed{} is empty"),
    ({"prompt": "x", "answer": "so \\boxed{\\frac{1}{2}"}, "no response can match this answer: its last \\\\boxed{} is "
     "empty or never closes"),
    ({"prompt": "x", "answer": "\\frac{1}{"}, "no response can match this answer: a brace opens and never closes"),
    ({"prompt": "x", "answer": "}{"}, "no response can match this answer: a brace opens and never closes"),
])
def test_bad_line_error_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD[:2] + [bad_line] + GOOD[2:])
    with pytest.raises(ValueError, match=rf"d\.jsonl:3: {message}"):
        load_records(path, char_tokenizer())


def test_skip_mode_counts_malformed_lines(tmp_path):
    lines = GOOD[:1] + ["{not json", {"prompt": "", "answer": "1"}, {"question": "x"}] + GOOD[1:]
    records, stats = load_records(write_jsonl(tmp_path / "d.jsonl", lines), char_tokenizer(), on_error="skip")
    assert [r["prompt"] for r in records] == [g["prompt"] for g in GOOD]
    assert stats == LoadStats(loaded=3, skipped_malformed=3, dropped_too_long=0)


def test_prompts_over_the_token_limit_are_dropped_and_counted(tmp_path):
    lines = GOOD + [{"prompt": "x" * 50, "answer": "1"}]
    records, stats = load_records(write_jsonl(tmp_path / "d.jsonl", lines), char_tokenizer(), max_prompt_tokens=10)
    assert len(records) == 3 and all(len(r["prompt_ids"]) <= 10 for r in records)
    assert stats.dropped_too_long == 1
    # The limit counts template tokens too: "<u>" and "<a>" add 6 characters.
    _, templated = load_records(tmp_path / "d.jsonl", char_tokenizer(TEMPLATE), max_prompt_tokens=10)
    assert templated.dropped_too_long == 2  # "half of 1?" is 10 characters, 16 with the template


def test_parquet_and_custom_field_names(tmp_path):
    path = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["1+1=", "2+2="], "solution": ["2", "4"], "extra": [1, 2]}).to_parquet(path)
    records, stats = load_records(path, char_tokenizer(), prompt_key="question", answer_key="solution")
    assert [(r["prompt"], r["answer"]) for r in records] == [("1+1=", "2"), ("2+2=", "4")]
    assert stats.loaded == 2
    with pytest.raises(ValueError, match=r"d\.parquet: no column 'prompt'"):
        load_records(path, char_tokenizer())


def test_parquet_bad_row_is_named(tmp_path):
    path = tmp_path / "d.parquet"
    pd.DataFrame({"prompt": ["1+1=", None, "3+3="], "answer": ["2", "4", "6"]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"d\.parquet: row 2: missing field 'prompt'"):
        load_records(path, char_tokenizer())
    _, stats = load_records(path, char_tokenizer(), on_error="skip")
    assert stats == LoadStats(loaded=2, skipped_malformed=1, dropped_too_long=0)


def test_a_line_that_is_not_utf8_is_one_bad_record(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b'{"prompt": "\xff", "answer": "1"}\n' + b"".join(lines[1:]))
    with pytest.raises(DataError, match=r"d\.jsonl:2: not UTF-8"):
        load_records(path, char_tokenizer())
    _, stats = load_records(path, char_tokenizer(), on_error="skip")
    assert stats == LoadStats(loaded=3, skipped_malformed=1, dropped_too_long=0)


def test_unreadable_parquet_and_empty_splits_are_data_errors(tmp_path):
    from types import SimpleNamespace

    from support.data import prepare_data

    (tmp_path / "d.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"d\.parquet: not a readable Parquet file"):
        load_records(tmp_path / "d.parquet", char_tokenizer())
    cfg = SimpleNamespace(data=str(write_jsonl(tmp_path / "d.jsonl", GOOD)), prompt_key="prompt",
                          answer_key="answer", max_prompt_tokens=64, skip_bad_records=False, eval_fraction=0.1,
                          val_data=None, prompt_template=None, answer_format=None, prompt_format=None)
    with pytest.raises(DataError, match="3 records leave 3 for training and 0 held out"):
        prepare_data(cfg, char_tokenizer())  # round(3 * 0.1) = 0 held out


def test_records_all_skipped_say_why_the_first_was(tmp_path, capsys):
    """--skip-bad-records with a wrong --prompt-key skips every line: the run stopped with "no usable
    records" alone, and never named the missing field."""
    from types import SimpleNamespace

    from support.data import prepare_data

    rows = [{"question": g["prompt"], "answer": g["answer"]} for g in GOOD]
    cfg = SimpleNamespace(data=str(write_jsonl(tmp_path / "d.jsonl", rows)), prompt_key="prompt",
                          answer_key="answer", max_prompt_tokens=64, skip_bad_records=True, eval_fraction=0.5,
                          val_data=None, prompt_template=None, answer_format=None, prompt_format=None)
    with pytest.raises(DataError, match=r"d\.jsonl: no usable records \(3 malformed skipped, 0 over "
                                        r"--max-prompt-tokens 64; the first skipped: .*d\.jsonl:1: missing field 'prompt' "
                                        r"\(its fields: 'question', 'answer'\)\)"):
        prepare_data(cfg, char_tokenizer())
    write_jsonl(tmp_path / "d.jsonl", GOOD + rows[:1])
    prepare_data(cfg, char_tokenizer())
    assert "3 records from" in (out := capsys.readouterr().out) and "d.jsonl:4: missing field 'prompt'" in out


def test_bad_arguments_give_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no file"):
        load_records(tmp_path / "absent.jsonl", char_tokenizer())
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unknown format"):
        load_records(tmp_path / "d.csv", char_tokenizer())
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    with pytest.raises(ValueError, match="on_error"):
        load_records(path, char_tokenizer(), on_error="ignore")
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        load_records(path, char_tokenizer(), max_prompt_tokens=0)


def _records(n):
    return [{"prompt": f"problem {i}", "answer": str(i), "prompt_ids": [i]} for i in range(n)]


def test_split_is_seeded_and_independent_of_file_order():
    records = _records(200)
    train, held_out = train_eval_split(records, eval_fraction=0.1, seed=3)
    assert len(held_out) == 20 and len(train) == 180
    assert held_out == [r for r in records if r in held_out]  # input order kept
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    _, held_out_shuffled = train_eval_split(shuffled, eval_fraction=0.1, seed=3)
    assert sorted(r["prompt"] for r in held_out_shuffled) == sorted(r["prompt"] for r in held_out)
    _, other_seed = train_eval_split(records, eval_fraction=0.1, seed=4)
    assert other_seed != held_out


def test_split_keeps_duplicates_on_one_side_and_checks_fraction():
    records = _records(50)
    records = records + [dict(r) for r in records[:25]]  # half the prompts appear twice
    train, held_out = train_eval_split(records, eval_fraction=0.2, seed=0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len(train) + len(held_out) == len(records)
    assert train_eval_split(records, eval_fraction=0.0)[1] == []
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="eval_fraction"):
            train_eval_split(records, eval_fraction=bad)


def test_sample_prompts_and_stream_seeds_depend_only_on_seed_stream_and_step():
    """A resumed run draws the same prompts and sampling seeds; other streams and steps differ."""
    from types import SimpleNamespace

    records = [{"id": i} for i in range(1000)]
    cfg = SimpleNamespace(seed=3, prompts_per_step=8, samples_per_prompt=2)
    batch = sample_prompts(records, cfg, step=5, stream="ppo")
    assert [r["id"] for r in batch[::2]] == [r["id"] for r in batch[1::2]]  # each prompt twice, side by side
    assert batch == sample_prompts(records, cfg, step=5, stream="ppo")
    assert batch != sample_prompts(records, cfg, step=6, stream="ppo")
    assert batch != sample_prompts(records, cfg, step=5, stream="value_pretrain")
    seeds = {stream_seed(s, name, t) for s in (0, 1) for name in ("ppo/sampling", "eval/sampling") for t in range(50)}
    assert len(seeds) == 200 and stream_seed(0, "ppo/sampling", 7) == stream_seed(0, "ppo/sampling", 7)
    assert all(0 <= s < 2**60 for s in seeds)  # fits torch.manual_seed and numpy's SeedSequence


def test_each_rank_samples_every_world_size_th_prompt_of_the_global_draw(monkeypatch):
    """Under torchrun the ranks split one global draw; a share taken by the wrong slice gave every rank
    the same prompts (its tests ran in one process)."""
    from types import SimpleNamespace

    import fsdp_utils

    records = [{"id": i} for i in range(100)]
    cfg = SimpleNamespace(seed=0, prompts_per_step=8, samples_per_prompt=2)
    prompts = [r["id"] for r in sample_prompts(records, cfg, 3, "ppo")[::2]]  # each prompt once, one process
    monkeypatch.setattr(fsdp_utils, "world_size", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(fsdp_utils, "rank", lambda rank=rank: rank)
        assert [r["id"] for r in sample_prompts(records, cfg, 3, "ppo")[::2]] == prompts[rank::2]


@pytest.mark.parametrize("n_records, world", [(5, 2), (4, 2), (1, 3), (7, 1)])
def test_each_held_out_record_is_evaluated_once_over_equal_rank_shares(n_records, world):
    """Under torchrun every rank makes the same number of generate calls (equal shares, padded),
    and the samples that count cover every record exactly once."""
    from evaluate import share_of_records

    shares = [share_of_records(n_records, rank, world) for rank in range(world)]
    assert len({len(mine) for mine, _ in shares}) == 1
    counted = sorted(i for mine, counts in shares for i, c in zip(mine, counts) if c)
    assert counted == list(range(n_records))
    assert shares[0] == (list(range(0, n_records, world)), [True] * len(range(0, n_records, world)))


def test_a_line_cut_short_is_reported_at_its_real_column(tmp_path):
    """The newline is not part of the record: an error at the line's end is not "column 1" of the next."""
    cut = json.dumps(GOOD[0])[:-1]  # the closing brace lost
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([json.dumps(GOOD[1]), cut, json.dumps(GOOD[2])]) + "\n")
    with pytest.raises(DataError, match=rf"d\.jsonl:2: malformed JSON \(Expecting ',' delimiter: the line ends at "
                                        rf"column {len(cut)}, cut short\?\)"):
        load_records(path, char_tokenizer())
    path.write_text(json.dumps(GOOD[1]) + "\n" + '{"prompt": "x", "answer": y}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON \(Expecting value: column 27 of 28\)"):
        load_records(path, char_tokenizer())
    path.write_text(json.dumps(GOOD[1]) + "\n" + '{"prompt": "x", "answer": "2\n')  # the closing quote lost
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON \(Unterminated string starting at: column 27 of "
                                        r"28, cut short\?\)"):
        load_records(path, char_tokenizer())


def test_task_difficulty_draws_the_built_in_problems_from_its_range_and_keeps_pi_sft():
    from support.config import parse_config
    from critic import orm_path, orm_settings
    from support.data import prepare_data
    from support.sft import sft_config, sft_settings

    from support import task

    default = parse_config(["--preset", "tiny-long", "--task-train-size", "200", "--task-eval-size", "50"])
    longer = parse_config(["--preset", "tiny-long", "--task-train-size", "200", "--task-eval-size", "50",
                           "--task-difficulty", "46", "52"])
    train, held_out = prepare_data(longer, task.build_tokenizer())
    ks = {p["difficulty"] for p in train + held_out}
    assert min(ks) == 46 and max(ks) == 52
    assert all(len(str(task.prompt_parts(p["prompt"])[0])) == 10 for p in held_out)  # the long task's width
    default_train, _ = prepare_data(default, task.build_tokenizer())
    assert min(p["difficulty"] for p in default_train) == 40  # the preset's own range, 40-52
    assert sft_settings(sft_config(longer)) == sft_settings(sft_config(default))  # one pi_SFT for both
    assert orm_settings(longer) != orm_settings(default)  # the ORM is trained on the run's own problems
    assert orm_path(longer).endswith("orm-long-k46-52") and orm_path(default).endswith("orm-long")  # kept apart


# --- the layouts users bring (tests/data/formats, written by its write_samples.py) ------------------------

FORMATS = Path(__file__).resolve().parent / "data" / "formats"


@pytest.fixture(scope="module")
def grader():
    from reward import Grader

    with Grader(num_workers=1, timeout_s=10.0) as g:
        yield g


@pytest.mark.parametrize("file, keys, golds, sources, graded", [
    # GSM8K: the final number after '####', thousands separator dropped
    ("gsm8k.jsonl", {"prompt_key": "question"}, ["54", "1625", "-5", "84"], {"gsm8k"},
     (1, "so the library has \\boxed{1625} books", "\\boxed{1250}")),
    # verl: chat-message prompts, the nested ground truth, each row's data_source
    ("verl.parquet", {"answer_key": "reward_model.ground_truth"},
     ["54", "1625", "-5", "84", "\\frac{1}{2}", "4", "8", "x^2 + 2x + 1"],
     {"openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval"}, (4, "\\boxed{0.5}", "\\boxed{2}")),
    # MATH as a JSON array: the solution is the gold; the grader reads its last box
    ("math.json", {"prompt_key": "problem", "answer_key": "solution"}, None, {"math"},
     (1, "x = \\boxed{4}", "\\boxed{5}")),
    # TRL's conversational prompts, a system turn first
    ("trl.jsonl", {"answer_key": "solution"}, None, {"trl"}, (3, "\\boxed{1 + 2x + x^2}", "\\boxed{x^2 + 1}")),
])
def test_each_sample_layout_loads_and_grades_a_right_and_a_wrong_response(grader, file, keys, golds, sources,
                                                                          graded):
    records, stats = load_records(FORMATS / file, char_tokenizer(TEMPLATE), **keys)
    assert stats.loaded == len(records) == (8 if golds and len(golds) == 8 else 4) and stats.skipped_malformed == 0
    if golds is not None:
        assert [r["answer"] for r in records] == golds
    assert {r["data_source"] for r in records} == sources
    text = char_tokenizer(TEMPLATE).decode(records[0]["prompt_ids"])
    assert text.startswith("<u>") and text.endswith("<a>")
    i, right, wrong = graded
    assert grader.grade([right, wrong], [records[i]["answer"]] * 2).outcomes == [1.0, -1.0]


def test_gsm8k_answers_are_graded_by_their_final_number():
    from support.data import gold_answer

    assert gold_answer("18 + 54 = <<18+54=72>>72\n#### 72", None) == "72"  # detected
    assert gold_answer("#### 1,000,000", "gsm8k") == "1000000" and gold_answer("#### -3.50", None) == "-3.50"
    assert gold_answer("\\boxed{4}", None) == "\\boxed{4}"  # MATH: as written
    assert gold_answer("#### 72", "math") == "#### 72"  # told otherwise: no detection
    headings = "#### Step 1: add\n2+3 = 5\n#### Step 2: conclude\nThe answer is 5."  # Markdown, not GSM8K's last line
    assert gold_answer(headings, None) == headings
    with pytest.raises(ValueError, match="no number after '####'"):
        gold_answer("so the answer is\n#### many", None)
    with pytest.raises(ValueError, match="no '#### <number>'"):
        gold_answer("72", "gsm8k")


def test_dotted_keys_read_nested_fields_and_name_the_row_that_lacks_one(tmp_path):
    from support.data import field

    assert field({"a": {"b": {"c": 3}}}, "a.b.c") == 3 and field({"a.b": 1, "a": {"b": 2}}, "a.b") == 1
    assert field({"a": {"b": 2}}, "a.c") is None and field({"a": 5}, "a.b") is None
    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}, {"prompt": "2+2=", "reward_model": {}}]
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'reward_model\.ground_truth'"):
        load_records(write_jsonl(tmp_path / "d.jsonl", rows), char_tokenizer(), answer_key="reward_model.ground_truth")
    rows[1]["reward_model"] = {"ground_truth": None}  # a struct column: the field is there, empty
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet: row 2: missing field 'reward_model\.ground_truth'"):
        load_records(tmp_path / "d.parquet", char_tokenizer(), answer_key="reward_model.ground_truth")
    with pytest.raises(DataError, match=r"d\.parquet: no column 'solution\.x'"):
        load_records(tmp_path / "d.parquet", char_tokenizer(), answer_key="solution.x")


def test_prompt_template_rewrites_text_and_the_last_user_turn(tmp_path):
    from support.data import apply_template

    template = "{prompt} Put the answer in \\boxed{}."
    assert apply_template("1+1=", template) == "1+1= Put the answer in \\boxed{}."
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert [m["content"] for m in apply_template(chat, template)] == ["s", "q1", "a", "q2 Put the answer in \\boxed{}."]
    records, _ = load_records(write_jsonl(tmp_path / "d.jsonl", [{"prompt": chat, "answer": "2"}]),
                              char_tokenizer(TEMPLATE), prompt_template=template)
    assert char_tokenizer().decode(records[0]["prompt_ids"]) == "<u>s<u>q1<u>a<u>q2 Put the answer in \\boxed{}.<a>"


def test_chat_messages_need_a_user_turn_and_a_chat_template(tmp_path):
    no_user = {"prompt": [{"role": "system", "content": "be brief"}], "answer": "1"}
    path = write_jsonl(tmp_path / "d.jsonl", GOOD[:1] + [no_user])
    with pytest.raises(DataError, match=r"d\.jsonl:2: the chat messages in field 'prompt' have no user turn "
                                        r"\(roles: system\)"):
        load_records(path, char_tokenizer(TEMPLATE))
    assert load_records(path, char_tokenizer(TEMPLATE), on_error="skip")[1].skipped_malformed == 1
    for prompt in ([{"role": "user", "text": "x"}], []):  # an empty list is no messages either
        write_jsonl(path, [{"prompt": prompt, "answer": "1"}])
        with pytest.raises(DataError, match="neither text nor a list of chat messages"):
            load_records(path, char_tokenizer(TEMPLATE))
    write_jsonl(path, [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: chat-message prompts need a tokenizer with a chat template"):
        load_records(path, char_tokenizer(), on_error="skip")  # the tokenizer's fault: never skipped


def test_several_files_a_folder_a_glob_and_json_arrays(tmp_path):
    from support.data import data_files

    write_jsonl(tmp_path / "a-00000-of-00002.jsonl", GOOD[:2])  # a Hugging Face shard: data source "a"
    (tmp_path / "b.json").write_text(json.dumps(GOOD[2:]))  # an array
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.json", GOOD[:1])  # JSON lines under .json, as `datasets` writes them
    assert data_files(tmp_path) == [tmp_path / "a-00000-of-00002.jsonl", tmp_path / "b.json"]
    assert data_files(f"{tmp_path}/**/*.json") == [tmp_path / "b.json", tmp_path / "sub" / "c.json"]
    records, stats = load_records(tmp_path, char_tokenizer())
    assert [(r["prompt"], r["data_source"]) for r in records] == [("1+1=", "a"), ("half of 1?", "a"), ("3*3", "b")]
    assert [r["prompt"] for r in load_records(tmp_path / "sub" / "c.json", char_tokenizer())[0]] == ["1+1="]
    with pytest.raises(DataError, match=r"\*\.parquet: the pattern matches no \.jsonl, \.json, \.parquet file$"):
        data_files(f"{tmp_path}/*.parquet")
    assert data_files(f"{tmp_path}/*") == data_files(tmp_path)  # notes.txt is not taken for data
    with pytest.raises(DataError, match=r"\*\.txt: the pattern matches no .* file \(it matches 1 other files\)"):
        data_files(f"{tmp_path}/*.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty: a folder with no .jsonl, .json, .parquet file"):
        data_files(tmp_path / "empty")
    (tmp_path / "b.json").write_text('[{"prompt": "x", "answer": 1}, {"prompt": ]')
    with pytest.raises(DataError, match=r"b\.json: malformed JSON array \(Expecting value at line 1 column 43\)"):
        load_records(tmp_path / "b.json", char_tokenizer())


@pytest.mark.parametrize("answer, gold", [
    ("#### 72", "72"), ("#### 1,000", "1000"), ("#### 1 000 000", "1000000"), ("#### 1\u202f000", "1000"),
    ("#### .5", "0.5"), ("#### -.25", "-0.25"), ("#### 3/4", "3/4"), ("#### \u22125", "-5"),
    ("#### $1,200 a month", "1200"), ("#### -$5", "-5"), ("#### $-5", "-5"), ("#### 18 dollars per 2 hours", "18"), ("x\n#### 3\n#### 4", "4"),
    ("#### 1\u00a0000", "1000"), ("#### 1,00,000", "100000"), ("#### 42.", "42"), ("#### 5 apples and 3 pears", "5"),
])
def test_a_gsm8k_gold_is_the_whole_number_after_the_mark(answer, gold):
    """It took the last run of digits: .5 -> 5, 3/4 -> 4, 1 000 000 -> 000, a Unicode minus dropped."""
    from support.data import gold_answer

    assert gold_answer(answer, "gsm8k") == gold


@pytest.mark.parametrize("after_mark", ["2,5", "12,34", "1,00", "1e5", "12:30", "3 1/2", "\\frac{1}{2}", "x^2", "5 - 3 = 2"])
def test_a_gsm8k_answer_that_is_not_one_number_is_a_bad_record_not_its_first_digits(tmp_path, after_mark):
    """`#### 2,5` gave the gold 25, `#### 1e5` 1, `#### \\frac{1}{2}` 1, `#### 12:30` 12: a wrong gold
    against which every right response scored -1, in silence."""
    rows = [{"prompt": "x", "answer": "#### 7"}, {"prompt": "y", "answer": f"Work.\n#### {after_mark}"}]
    with pytest.raises(DataError, match=r"d\.jsonl:2: the answer after '####' is not one number .*field 'answer'"):
        load_records(write_jsonl(tmp_path / "d.jsonl", rows), char_tokenizer())
    records, stats = load_records(tmp_path / "d.jsonl", char_tokenizer(), on_error="skip")
    assert [r["answer"] for r in records] == ["7"] and stats.skipped_malformed == 1


def test_a_markdown_heading_is_no_gsm8k_mark_and_numeric_answers_read_as_written(tmp_path):
    from support.data import gold_answer

    solution = "#### Step 1\nAdd 2 and 3.\n#### Step 2\nSo the answer is $\\boxed{5}$."
    assert gold_answer(solution, None) == solution  # MATH: graded by its \boxed{5}, not by the heading's 1
    rows = [{"prompt": "tiny?", "answer": 1e-05}, {"prompt": "big?", "answer": 1e20}, {"prompt": "x", "answer": 2.5}]
    records, _ = load_records(write_jsonl(tmp_path / "d.jsonl", rows), char_tokenizer())
    assert [r["answer"] for r in records] == ["0.00001", "100000000000000000000", "2.5"]  # not 1e-05, 1e+20
    (tmp_path / "d.json").write_text('[{"prompt": "x", "answer": NaN}]')
    with pytest.raises(DataError, match=r"d\.json: record 1: the answer in field 'answer' is nan"):
        load_records(tmp_path / "d.json", char_tokenizer())


def test_one_json_value_over_several_lines_is_named_not_taken_for_a_line_cut_short(tmp_path):
    """`json.dump(..., indent=2)` of an object (`{"data": [...]}`) in a .json file, or of an array in a
    .jsonl file, was refused as "malformed JSON (...: the line ends at column 1, cut short?)"."""
    (tmp_path / "d.json").write_text(json.dumps({"version": 1, "data": GOOD}, indent=2))
    with pytest.raises(DataError, match=r"d\.json: one JSON object over several lines \(keys: version, data\), "
                                        r"not an array of records or JSON lines"):
        load_records(tmp_path / "d.json", char_tokenizer())
    (tmp_path / "d.jsonl").write_text(json.dumps(GOOD, indent=2))
    with pytest.raises(DataError, match=r"d\.jsonl: a JSON array, not JSON lines .*: name the file \.json"):
        load_records(tmp_path / "d.jsonl", char_tokenizer())
    (tmp_path / "d.jsonl").rename(tmp_path / "e.json")
    assert len(load_records(tmp_path / "e.json", char_tokenizer())[0]) == len(GOOD)
    (tmp_path / "d.jsonl").write_text('{\n"prompt": "x", "answer": \n')  # malformed: still named by its line
    with pytest.raises(DataError, match=r"d\.jsonl:1: malformed JSON"):
        load_records(tmp_path / "d.jsonl", char_tokenizer())
    # Windows tools write a byte-order mark first: the file is still one object, not a line cut short.
    (tmp_path / "d.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"data": GOOD}, indent=2).encode())
    with pytest.raises(DataError, match=r"d\.json: one JSON object over several lines \(keys: data\)"):
        load_records(tmp_path / "d.json", char_tokenizer())


def test_records_written_over_several_lines_are_named_so_not_taken_for_lines_cut_short(tmp_path):
    """Several `json.dumps(record, indent=2)` one after another: no one JSON value, so the first line,
    `{`, was "malformed JSON (...: the line ends at column 1, cut short?)"."""
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r, indent=2) + "\n" for r in GOOD))
    with pytest.raises(DataError, match=r"d\.jsonl:1: malformed JSON \(.*: a line of only a bracket: records written "
                                        r"over several lines\? JSON lines hold one a line\)"):
        load_records(tmp_path / "d.jsonl", char_tokenizer())


def test_golds_a_response_can_match_are_kept_stray_closing_brace_and_literal_braces_included(tmp_path, grader):
    """Only a gold no response can match is a bad record: math-verify reads `12}` as 12, and `\\{1,2\\}`,
    `\\left\\{...\\right.` and an escaped dollar hold braces and dollars that are not delimiters."""
    golds = ["12}", "\\{1,2\\}", "\\left\\{ x \\right.", "\\$18.90", "$\\frac{1}{2}$", "\\fbox{3}"]
    records, _ = load_records(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": g} for g in golds]),
                              char_tokenizer())
    assert [r["answer"] for r in records] == golds
    assert grader.grade(["\\boxed{12}", "\\boxed{\\frac{1}{2}}"], ["12}", "$\\frac{1}{2}$"]).outcomes == [1.0, 1.0]


def test_a_parquet_decimal_answer_is_a_number(tmp_path):
    """Parquet's decimal128 column reads as Python's Decimal, which was refused as "not text or a number".
    It is written out at the column's scale (2.00), which the grader takes for 2."""
    from decimal import Decimal

    path = tmp_path / "d.parquet"
    pd.DataFrame({"prompt": ["1+1=", "3/2="], "answer": [Decimal("2"), Decimal("1.50")]}).to_parquet(path)
    records, _ = load_records(path, char_tokenizer())
    assert [r["answer"] for r in records] == ["2.00", "1.50"]


def test_an_existing_path_with_glob_characters_is_itself_and_files_not_read_are_said(tmp_path, capsys):
    """A file or folder named `set[1]` was taken for a pattern that matched nothing and refused; files of
    other kinds in a folder or a glob (`.jsonl.gz` shards, a `.csv`) were passed over without a word."""
    from support.config import Config
    from support.data import data_files, prepare_data

    named = write_jsonl(tmp_path / "set[1].jsonl", GOOD)
    assert data_files(named) == [named]
    (tmp_path / "run[a]").mkdir()
    write_jsonl(tmp_path / "run[a]" / "t.jsonl", GOOD)
    for name in ("part1.jsonl.gz", "part2.jsonl.gz", "extra.csv", ".gitattributes"):
        (tmp_path / "run[a]" / name).write_text("x")
    assert data_files(tmp_path / "run[a]") == [tmp_path / "run[a]" / "t.jsonl"]
    cfg = Config(data=str(tmp_path / "run[a]"), model="m", max_prompt_tokens=64, eval_fraction=0.34)
    prepare_data(cfg, char_tokenizer())
    out = capsys.readouterr().out
    assert f"note: {tmp_path}/run[a]: 3 other files not read (.csv, .jsonl.gz); only .jsonl, .json, .parquet " \
           "files are data" in out
    cfg.data = str(named)  # a file alone: nothing else named
    prepare_data(cfg, char_tokenizer())
    assert "not read" not in capsys.readouterr().out
    # A symbolic link to nothing (a Hugging Face cache's snapshot after a download cut short) is said, not passed over.
    (tmp_path / "run[a]" / "part0.jsonl").symlink_to(tmp_path / "blobs" / "missing")
    for spec in (tmp_path / "run[a]", f"{tmp_path}/run?a?/*.jsonl", tmp_path / "run[a]" / "part0.jsonl"):
        with pytest.raises(DataError, match=r"part0\.jsonl: a symbolic link to .*blobs/missing, which does not exist"):
            data_files(spec)


def test_held_out_problems_that_are_also_training_problems_are_said_for_a_users_data(tmp_path, capsys):
    """--val-data naming the --data file (or one that repeats its problems) held out nothing, in silence;
    the built-in task says it, and so does a user's data now: said, counted by prompt, not refused."""
    from support.config import Config
    from support.data import prepare_data

    train = write_jsonl(tmp_path / "train.jsonl", GOOD)
    other = write_jsonl(tmp_path / "val.jsonl", [GOOD[1], {"prompt": "4-4=", "answer": "0"}])
    cfg = Config(data=str(train), model="m", max_prompt_tokens=64, val_data=(str(train), str(other)))
    prepare_data(cfg, char_tokenizer())
    out = capsys.readouterr().out
    assert f"note: 3 of the 3 held-out problems of {train} are also training problems of --data {train}" in out
    assert f"note: 1 of the 2 held-out problems of {other} are also training problems" in out
    cfg.val_data = (str(tmp_path / "val.jsonl"),)
    write_jsonl(tmp_path / "val.jsonl", [{"prompt": "4-4=", "answer": "0"}])
    prepare_data(cfg, char_tokenizer())
    assert "also training problems" not in capsys.readouterr().out


def test_a_prompt_of_no_tokens_is_a_bad_record_not_a_failed_rollout(tmp_path):
    """The built-in character tokenizer drops what it lacks: a prompt of other characters had no
    token, and the run stopped at its first rollout in a ValueError of rollout.left_pad."""
    from support.task import build_tokenizer

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12*2^a=\n", "answer": "24"}, {"prompt": "日本語", "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: the prompt has no token in the model's tokenizer"):
        load_records(path, build_tokenizer())
    records, stats = load_records(path, build_tokenizer(), on_error="skip")
    assert len(records) == 1 and stats.skipped_malformed == 1 and "d.jsonl:2" in stats.first_skipped


def test_a_byte_order_mark_a_home_folder_and_a_whole_conversation(tmp_path, monkeypatch):
    """Files saved by Windows tools start with a UTF-8 byte-order mark: line 1 and a .json array were
    refused as malformed. `~` in a quoted glob was not expanded. A message list ending with the
    assistant's turn (TRL's `messages`, not its `prompt`) was taken as a prompt holding its answer."""
    from support.data import data_files

    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in GOOD).encode())
    (tmp_path / "d.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode())
    for name in ("d.jsonl", "d.json"):
        assert [r["prompt"] for r in load_records(tmp_path / name, char_tokenizer())[0]] == [g["prompt"] for g in GOOD]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert data_files("~/*.json*") == [tmp_path / "d.json", tmp_path / "d.jsonl"]
    assert data_files("~/d.json") == [tmp_path / "d.json"]
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "\\boxed{2}"}]
    with pytest.raises(DataError, match=r"d\.jsonl:1: the chat messages in field 'messages' end with an assistant "
                                        r"turn; .*the 'prompt' field, not 'messages'"):
        load_records(write_jsonl(tmp_path / "d.jsonl", [{"messages": chat, "answer": "2"}]), char_tokenizer(TEMPLATE),
                     prompt_key="messages")


def test_held_out_sets_named_alike_are_reported_apart_each_with_its_own_answer_format(tmp_path, capsys):
    """Two --val-data files named test (GSM8K's test.jsonl, MATH-500's test-00000-of-00001.parquet)
    were merged into one `test` set; --answer-format gsm8k (for GSM8K training data) was applied to
    MATH-500's answers too, and stopped the run. Each set reads its own prompt field (GSM8K's
    `question`, MATH-500's `problem`): one --val-prompt-key per --val-data value."""
    from support.config import Config
    from support.data import prepare_data

    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "math500").mkdir()
    train = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": "1+1?", "answer": "1+1=2\n#### 2"}])
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    pd.DataFrame([{"problem": "5/10?", "answer": "\\frac{1}{2}"}]).to_parquet(
        tmp_path / "math500" / "test-00000-of-00001.parquet")
    cfg = Config(data=str(train), prompt_key="question", max_prompt_tokens=64, answer_format="gsm8k",
                 val_data=(str(tmp_path / "gsm8k" / "test.jsonl"), str(tmp_path / "math500")),
                 val_prompt_key=("question", "problem"))
    train_records, held_out = prepare_data(cfg, char_tokenizer())
    assert [r["answer"] for r in train_records] == ["2"]
    assert [(r["data_source"], r["answer"]) for r in held_out] == [("gsm8k/test", "4"), ("math500/test", "\\frac{1}{2}")]
    assert "reported apart: test -> gsm8k/test, test -> math500/test" in capsys.readouterr().out
    cfg.val_data, cfg.val_prompt_key = (str(tmp_path / "gsm8k" / "test.jsonl"),) * 2, ("question",)  # one folder, one key
    assert [r["data_source"] for r in prepare_data(cfg, char_tokenizer())[1]] == ["test#1", "test#2"]
    # Named alike but not side by side in --val-data: the first and the third value.
    (tmp_path / "extra").mkdir()
    write_jsonl(tmp_path / "extra" / "hard.jsonl", [{"question": "3+3?", "answer": "#### 6"}])
    cfg.val_data = (str(tmp_path / "gsm8k" / "test.jsonl"), str(tmp_path / "extra" / "hard.jsonl"), str(tmp_path / "math500"))
    cfg.val_prompt_key = ("question", "question", "problem")
    assert [r["data_source"] for r in prepare_data(cfg, char_tokenizer())[1]] == ["gsm8k/test", "hard", "math500/test"]


def test_held_out_problems_of_the_built_in_task_that_are_also_training_problems_are_said(capsys):
    """Both sets are drawn from one pool: a narrow --task-difficulty on the short task made most of the
    held-out set training problems, in silence. Said, with the count (the sets are left as they are:
    every result so far was measured on them)."""
    from support.config import parse_config
    from support.data import prepare_data
    from support import task

    train, held_out = prepare_data(parse_config(["--task-difficulty", "46", "48"]), task.build_tokenizer())
    seen = sum(r["prompt"] in {t["prompt"] for t in train} for r in held_out)
    assert seen > 10
    assert (f"note: {seen} of the 64 held-out problems are also RL training problems (both drawn from the 27,000 "
            f"problems of k in [46, 48])") in capsys.readouterr().out


def test_what_the_data_says_is_said_once_under_torchrun_by_rank_0(capsys, monkeypatch):
    """Every rank loads the data: its notes came once per rank (16 times on 2 x 8 GPUs)."""
    from support.config import parse_config
    from support.data import prepare_data
    from support import task

    cfg, tokenizer = parse_config(["--task-difficulty", "46", "48"]), task.build_tokenizer()
    monkeypatch.setenv("RANK", "1")
    prepare_data(cfg, tokenizer)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    prepare_data(cfg, tokenizer)
    assert "held-out problems are also RL training problems" in capsys.readouterr().out


def test_a_prompt_limit_below_the_built_in_tasks_prompts_is_refused():
    """It was ignored: hf sampled them anyway, and vLLM, sized by it, stopped at the first rollout
    with a traceback."""
    from support.config import parse_config
    from support.data import prepare_data
    from support import task

    with pytest.raises(DataError, match=r"the built-in task's prompts take up to 10 tokens, over --max-prompt-tokens 6"):
        prepare_data(parse_config(["--max-prompt-tokens", "6"]), task.build_tokenizer())
    prepare_data(parse_config(["--max-prompt-tokens", "10"]), task.build_tokenizer())  # exactly fits: no error


def test_responses_past_the_built_in_models_positions_are_refused():
    """The built-in model has 1,024 positions; a longer response ran on into untrained ones in silence."""
    from support.config import parse_config
    from support.data import prepare_data
    from support import task

    tokenizer = task.build_tokenizer()
    prepare_data(parse_config(["--max-new-tokens", "1014"]), tokenizer)  # + the longest prompt's 10 tokens: 1,024
    for flag, asked in (("--max-new-tokens", 1025), ("--eval-max-new-tokens", 1110)):
        with pytest.raises(DataError, match=rf"the built-in model holds 1024 positions, .* ask for {asked}; at most "
                                            rf"1014 new tokens"):
            prepare_data(parse_config([flag, str(asked - 10)]), tokenizer)
    # A --model of its own on the built-in task: its positions are its config's, not the built-in model's.
    prepare_data(parse_config(["--model", "m", "--max-new-tokens", "1015"]), tokenizer)


def test_a_chat_template_that_refuses_the_messages_and_an_empty_user_turn_stop_in_one_line(tmp_path):
    """Gemma's template raises on a system turn, deep in jinja2; the record is named instead. A last
    user turn of whitespace is no prompt (an empty text prompt was refused already)."""
    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                 "supported') }}{% endif %}<u>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": chat, "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: the model's chat template refuses these messages "
                                        r"\(roles: system, user\): System role not supported"):
        load_records(path, char_tokenizer(no_system))
    # A template that does not parse is the model's fault, and said to be, not the record's.
    broken = "{% for m in messages %}<u>{{ m['content'] }}"  # no endfor
    with pytest.raises(DataError, match=r"d\.jsonl:1: the model's chat template is not valid Jinja \(its line 1: "
                                        r"Unexpected end of template.*\); see chat_template"):
        load_records(path, char_tokenizer(broken))
    blank = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  "}]
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": blank, "answer": "2"}])
    with pytest.raises(DataError, match=r"e\.jsonl:1: the last user turn of the chat messages in field 'prompt' is empty"):
        load_records(path, char_tokenizer(TEMPLATE))


def test_files_of_one_name_in_different_folders_are_sets_apart_and_shards_of_one_set_are_not(tmp_path):
    """A glob over aime/test.jsonl and math500/test-00000-of-00001.parquet merged both into `test`."""
    for folder in ("aime", "math500"):
        (tmp_path / folder).mkdir()
    write_jsonl(tmp_path / "aime" / "test.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    pd.DataFrame([{"prompt": "2+2=", "answer": "4"}]).to_parquet(tmp_path / "math500" / "test-00000-of-00002.parquet")
    pd.DataFrame([{"prompt": "3+3=", "answer": "6"}]).to_parquet(tmp_path / "math500" / "test-00001-of-00002.parquet")
    records, _ = load_records(str(tmp_path / "*" / "test*"), char_tokenizer())
    assert [r["data_source"] for r in records] == ["aime/test", "math500/test", "math500/test"]
    records, _ = load_records(tmp_path / "math500", char_tokenizer())
    assert [r["data_source"] for r in records] == ["test", "test"]  # one folder: its shards are one set
    for folder in ("aime24", "math500"):  # Hugging Face's layout: <set>/data/test-00000-of-00001.parquet
        (tmp_path / "hub" / folder / "data").mkdir(parents=True)
        pd.DataFrame([{"prompt": "1+1=", "answer": "2"}]).to_parquet(tmp_path / "hub" / folder / "data" / "test-00000-of-00001.parquet")
    records, _ = load_records(str(tmp_path / "hub" / "*" / "data" / "*.parquet"), char_tokenizer())
    assert [r["data_source"] for r in records] == ["aime24/data/test", "math500/data/test"]


def test_held_out_keys_are_one_for_every_set_or_one_per_set():
    from support.config import ConfigError, parse_config

    base = ["--model", "m", "--preset", "tiny", "--data", __file__, "--val-data", __file__, __file__]
    assert parse_config([*base, "--val-prompt-key", "question"]).val_keys(1) == ("question", "answer")
    cfg = parse_config([*base, "--val-prompt-key", "question", "problem", "--val-answer-key", "a", "b"])
    assert cfg.val_keys(0) == ("question", "a") and cfg.val_keys(1) == ("problem", "b")
    with pytest.raises(ConfigError, match=r"--val-prompt-key = \('a', 'b', 'c'\) \(must be one key, or one per --val-data value \(2\)\)"):
        parse_config([*base, "--val-prompt-key", "a", "b", "c"])
    with pytest.raises(ConfigError, match=r"--val-answer-key = \('a',\) \(must be unset without --val-data\)"):
        parse_config(["--val-answer-key", "a"])


def _bos_tokenizer(chat_template):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>", "<s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  bos_token="<s>")
    out.chat_template = chat_template
    return out


def test_a_chat_template_that_writes_the_bos_gets_exactly_one():
    """support/data.py encode_prompt: the template supplies the BOS, hence add_special_tokens=False;
    test_data's char tokenizer adds no BOS, so dropping that argument passed there."""
    template = "{{ bos_token }}{% for m in messages %}<u>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    tok = _bos_tokenizer(template)
    bos = tok.bos_token_id
    ids = encode_prompt(tok, "1+1=")
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.decode(ids[1:]) == "<u>1+1=<a>"
    plain = encode_prompt(_bos_tokenizer(None), "1+1=")  # no template: the tokenizer's own BOS, once
    assert plain[0] == bos and plain.count(bos) == 1


def test_a_prompt_templated_already_is_refused_or_counted_not_templated_twice(tmp_path):
    """A prompt field holding `<|im_start|>system...<|im_start|>assistant\n` went through the chat
    template again, wrapped in a second user turn, in silence."""
    tok = char_tokenizer("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    templated = {"prompt": "<|im_start|>1+1=<a>", "answer": "2"}
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, templated])
    with pytest.raises(DataError, match=r"d\.jsonl:2: the prompt already holds '<\|im_start\|>', which the model's "
                                        r"chat template writes itself"):
        load_records(path, tok)
    records, stats = load_records(path, tok, on_error="skip")
    assert len(records) == 1 and stats.skipped_malformed == 1
    assert len(load_records(path, char_tokenizer())[0]) == 2  # without a template nothing is templated twice
    bos_first = _bos_tokenizer("{{ bos_token }}{% for m in messages %}[INST]{{ m['content'] }}{% endfor %}")
    html = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "In <s>old</s> new, what is 1+1?", "answer": "2"}])
    assert len(load_records(html, bos_first)[0]) == 1  # the BOS a template writes is no mark: `<s>` is HTML too
    tools = char_tokenizer(TEMPLATE)
    tools.add_special_tokens({"additional_special_tokens": ["<tool>"]})  # a special token the template never writes
    mention = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What does <tool> do? 1+1=", "answer": "2"}])
    assert len(load_records(mention, tools)[0]) == 1  # no mark of the template: not templated already


def test_file_suffixes_in_capitals_are_data_and_a_folder_named_like_a_file_is_not(tmp_path):
    """Windows tools write TRAIN.JSONL and Data.Parquet: a folder of them was "a folder with no .jsonl,
    .json, .parquet file" although load_records reads any case. A folder named `old.jsonl` that a glob
    matches is not a file to read."""
    from support.data import data_files

    write_jsonl(tmp_path / "A.JSONL", GOOD[:2])
    pd.DataFrame(GOOD[2:3]).to_parquet(tmp_path / "B.Parquet")
    (tmp_path / "old.jsonl").mkdir()
    files = [tmp_path / "A.JSONL", tmp_path / "B.Parquet"]
    assert data_files(tmp_path) == files and data_files(f"{tmp_path}/*") == files
    records, _ = load_records(f"{tmp_path}/*", char_tokenizer())
    assert [(r["prompt"], r["data_source"]) for r in records] == [("1+1=", "A"), ("half of 1?", "A"), ("3*3", "B")]


def test_a_math_solution_ending_in_a_heading_with_its_boxed_answer_is_graded_by_the_box():
    """GSM8K's mark is `####` on the last line, but so is a Markdown heading: a last line
    `#### Answer: $\\boxed{5}$` is a MATH solution (it has a box), kept as written for the grader,
    not a GSM8K answer whose number `5` sits inside braces."""
    from support.data import gold_answer

    solution = "Add 2 and 3.\n#### Answer: $\\boxed{5}$"
    assert gold_answer(solution, None) == solution


def test_a_json_array_after_blank_space_and_a_flattened_dotted_column_load(tmp_path):
    """A .json array that starts with a newline or spaces was read as JSON lines ("expected an object,
    got list"). pandas' json_normalize writes verl's nested ground truth as one column named
    `reward_model.ground_truth`: the dotted key names that column, not a struct `reward_model`."""
    (tmp_path / "d.json").write_text("\n  " + json.dumps(GOOD, indent=2))
    assert [r["prompt"] for r in load_records(tmp_path / "d.json", char_tokenizer())[0]] == [g["prompt"] for g in GOOD]
    flat = pd.json_normalize([{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}])
    assert list(flat.columns) == ["prompt", "reward_model.ground_truth"]
    flat.to_parquet(tmp_path / "d.parquet")
    records, _ = load_records(tmp_path / "d.parquet", char_tokenizer(), answer_key="reward_model.ground_truth")
    assert [(r["prompt"], r["answer"]) for r in records] == [("1+1=", "2")]


def test_the_last_user_turn_must_hold_the_question_and_no_turn_may_hold_a_template_mark(tmp_path):
    """The policy answers the last user turn: an earlier user turn with text does not make a blank
    last one a prompt. A chat template's mark in any turn (a system turn, not only the last) means the
    messages were templated already."""
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": " "}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": chat, "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: the last user turn of the chat messages in field 'prompt' is empty"):
        load_records(path, char_tokenizer(TEMPLATE))
    tok = char_tokenizer("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    marked = [{"role": "system", "content": "<|im_start|>Be brief."}, {"role": "user", "content": "1+1="}]
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": marked, "answer": "2"}])
    with pytest.raises(DataError, match=r"e\.jsonl:1: the prompt already holds '<\|im_start\|>'"):
        load_records(path, tok)


def test_a_data_source_that_is_not_text_falls_back_to_the_files_name(tmp_path):
    """Held-out metrics are keyed by data source: a number (or an empty name) in the field is no set
    name, so the record's set is its file's, as for a record without the field."""
    rows = [{**GOOD[0], "data_source": 7}, {**GOOD[1], "data_source": ""}, {**GOOD[2], "data_source": "gsm8k"}]
    records, _ = load_records(write_jsonl(tmp_path / "d.jsonl", rows), char_tokenizer())
    assert [r["data_source"] for r in records] == ["d", "d", "gsm8k"]


def test_the_held_out_count_is_rounded_not_cut_down():
    """round(n * eval_fraction) records are held out (the docstring's rule): 7 records at 0.1 hold out
    one (0.7 rounds to 1), where cutting down to 0 would leave a small set no held-out record."""
    for n, fraction, want in ((7, 0.1, 1), (19, 0.1, 2), (10, 0.25, 2)):  # 0.7 -> 1, 1.9 -> 2, 2.5 -> 2 (half to even)
        train, held_out = train_eval_split(_records(n), eval_fraction=fraction, seed=0)
        assert len(held_out) == want and len(train) == n - want
