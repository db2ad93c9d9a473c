"""The built-in task: tokenizer, traces, strategies, difficulty (task.py)."""
import random

import pytest
from transformers import AutoTokenizer

from support import task
from reward import Grader


@pytest.fixture(scope="module")
def tokenizer():
    return task.build_tokenizer()


@pytest.fixture(scope="module")
def problems():
    return task.make_problems(40, seed=3, min_difficulty=1, max_difficulty=task.MAX_DIFFICULTY)


def test_tokenizer_round_trips_through_a_qwen2_checkpoint_dir(tokenizer, problems, tmp_path):
    # Saved beside a Qwen2 config, AutoTokenizer rebuilds the tokenizer from the vocabulary:
    # the reload must still keep every character (newlines included) and decode exactly.
    task.make_tiny_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    rng = random.Random(0)
    for p in problems:
        for text in (p["prompt"], p["prompt"] + task.sft_response(p, rng)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
            assert len(ids) == len(text)  # one token per character
            assert reloaded.decode(ids + [reloaded.eos_token_id], skip_special_tokens=True) == text
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_full_traces_are_correct_under_the_task_arithmetic(problems):
    for p in problems:
        trace = task.parse_response(p["prompt"], task.full_response(p))
        x, k, _ = task.prompt_parts(p["prompt"])
        assert trace.strategy == "full"
        assert all(trace.line_ok) and len(trace.line_ok) == k == p["difficulty"]
        assert trace.boxed == p["answer"] == str(x * 2**k % 10**task.WIDTH)


def test_full_traces_are_graded_plus_one_and_wrong_boxes_minus_one(problems):
    right = [task.full_response(p) for p in problems]
    wrong = [r.replace("{" + p["answer"], "{1" + p["answer"]) for r, p in zip(right, problems)]
    answers = [p["answer"] for p in problems]
    with Grader(num_workers=1) as grader:
        assert grader.grade(right + wrong, answers * 2).outcomes == [1.0] * len(right) + [-1.0] * len(wrong)


def test_sft_traces_are_classified_by_strategy(problems):
    rng = random.Random(1)
    for p in problems:
        full = task.sft_response(p, rng, shortcut_prob=0.0, merge_prob=0.0)
        merged = task.sft_response(p, rng, shortcut_prob=0.0, merge_prob=1.0)
        shortcut = task.sft_response(p, rng, shortcut_prob=1.0, merge_prob=0.0)
        assert task.parse_response(p["prompt"], full).strategy == "full"
        assert task.parse_response(p["prompt"], merged).strategy == ("merged" if p["difficulty"] > 1 else "full")
        assert task.parse_response(p["prompt"], shortcut).strategy == "shortcut"
        for text in (merged, shortcut):  # every SFT target is right, only shorter
            trace = task.parse_response(p["prompt"], text)
            assert all(trace.line_ok) and trace.boxed == p["answer"]
            assert len(text) < len(full) or p["difficulty"] == 1


def test_sft_mix_has_the_requested_shortcut_share():
    problems = task.make_problems(2000, seed=5)
    rng = random.Random(2)
    strategies = [task.parse_response(p["prompt"], task.sft_response(p, rng, 0.3, 0.1)).strategy for p in problems]
    assert 0.26 < strategies.count("shortcut") / len(strategies) < 0.34
    assert strategies.count("invalid") == 0


def test_difficulty_sets_the_length_of_the_full_trace_monotonically(tokenizer):
    lengths = []
    for k in range(1, task.MAX_DIFFICULTY + 1):
        ps = task.make_problems(5, seed=k, min_difficulty=k, max_difficulty=k)
        lengths.append(max(len(tokenizer(task.full_response(p))["input_ids"]) for p in ps))
    assert all(a < b for a, b in zip(lengths, lengths[1:]))
    assert lengths[0] <= 20 and lengths[task.DEFAULT_DIFFICULTY[1] - 1] >= 300


def test_problems_are_deterministic_given_the_seed_and_respect_the_difficulty_range():
    a = task.make_problems(50, seed=7, min_difficulty=3, max_difficulty=9)
    assert a == task.make_problems(50, seed=7, min_difficulty=3, max_difficulty=9)
    assert a != task.make_problems(50, seed=8, min_difficulty=3, max_difficulty=9)
    assert {p["difficulty"] for p in a} <= set(range(3, 10))
    assert all(task.prompt_parts(p["prompt"])[1] == p["difficulty"] for p in a)
    rng_a, rng_b = random.Random(4), random.Random(4)
    assert [task.sft_response(p, rng_a) for p in a] == [task.sft_response(p, rng_b) for p in a]


def test_lines_are_judged_against_the_value_written_above():
    p = task.make_problems(1, seed=0, min_difficulty=4, max_difficulty=4)[0]
    lines = task.full_response(p).split("\n")
    u = lines[1].index(":") + 1
    lines[1] = lines[1][:u] + str((int(lines[1][u]) + 1) % 10) + lines[1][u + 1 :]  # slip: line 2, units
    # Line 3 still doubles the true value, so it disagrees with the slipped one above it;
    # line 4 agrees with line 3 as written.
    assert task.parse_response(p["prompt"], "\n".join(lines)).line_ok == [True, False, False, True]
    written = int(lines[1][u:])
    lines[2] = task.step_line(written, 1, 2).rstrip("\n")  # 2 doublings left before line 3
    assert task.parse_response(p["prompt"], "\n".join(lines)).line_ok == [True, False, True, False]


@pytest.mark.parametrize("edit", ["drop_box", "skip_label", "repeat_line", "past_the_end", "triple_merge",
                                  "labels_up", "trailing_text", "garbage"])
def test_malformed_responses_are_invalid(edit):
    p = task.make_problems(1, seed=1, min_difficulty=5, max_difficulty=5)[0]
    x, *_ = task.prompt_parts(p["prompt"])
    lines = task.full_response(p).split("\n")
    text = {
        "drop_box": "\n".join(lines[:-1]) + "\n",
        "skip_label": "\n".join(lines[:1] + lines[2:]),
        "repeat_line": "\n".join(lines[:2] + lines[1:]),
        "past_the_end": "\n".join(lines[:-1] + ["a" + lines[0][1:], lines[-1]]),
        "triple_merge": "edc" + task.step_line(x, 1, 5)[1:] + "\n".join(lines[3:]),
        "labels_up": "\n".join("abcde"[i] + line[1:] for i, line in enumerate(lines[:-1])) + "\n" + lines[-1],
        "trailing_text": "\n".join(lines) + "\n0",
        "garbage": "hello",
    }[edit]
    assert task.parse_response(p["prompt"], text).strategy == "invalid"


def test_bad_inputs_raise_value_errors(tokenizer):
    with pytest.raises(ValueError):
        task.make_problems(3, seed=0, min_difficulty=1, max_difficulty=task.MAX_DIFFICULTY + 1)
    with pytest.raises(ValueError):
        task.make_problems(3, seed=0, min_difficulty=5, max_difficulty=4)
    with pytest.raises(ValueError):
        task.prompt_parts("What is 2+2?")
    with pytest.raises(ValueError):
        task.parse_response("14370*2^d=\n", "a:2874")  # x has exactly WIDTH digits
    with pytest.raises(ValueError):
        task.step_line(1437, 3, 5)  # at most MAX_MERGE doublings per line
    with pytest.raises(ValueError):
        task.step_line(1437, 2, 1)  # more doublings than are left
    with pytest.raises(ValueError):
        task.sft_response({"prompt": "1437*2^d=\n", "answer": "2992"}, random.Random(0), shortcut_prob=1.5)
    with pytest.raises(ValueError):
        task.make_tiny_model(tokenizer, hidden_size=96, num_heads=2)


def test_tiny_model_matches_the_tokenizer(tokenizer):
    model = task.make_tiny_model(tokenizer, num_layers=1)
    c = model.config
    assert c.vocab_size == len(tokenizer) and c.head_dim == 64 and c.tie_word_embeddings
    assert (c.eos_token_id, c.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_long_shape_has_wide_lines_and_long_traces_graded_like_the_short_ones(tokenizer):
    shape = task.SHAPES["long"]
    problems = task.make_problems(30, 4, *shape.difficulty, shape.width)
    rng = random.Random(3)
    for p in problems:
        x, k, _ = task.prompt_parts(p["prompt"])
        assert len(str(x)) == shape.width and shape.difficulty[0] <= k <= shape.difficulty[1]
        full = task.full_response(p)
        trace = task.parse_response(p["prompt"], full)
        assert trace.strategy == "full" and all(trace.line_ok) and trace.boxed == p["answer"]
        assert len(full.split("\n")[0]) == shape.width + 2  # label, ":", the digits
        mixed = task.sft_response(p, rng)
        assert task.parse_response(p["prompt"], mixed).strategy != "invalid"
    fulls = [task.full_response(p) for p in problems]
    with Grader(num_workers=1) as grader:
        assert grader.grade(fulls, [p["answer"] for p in problems]).outcomes == [1.0] * len(problems)
    lengths = sorted(len(tokenizer(full)["input_ids"]) for full in fulls)
    assert lengths[0] >= 250 and lengths[len(lengths) // 2] >= 500  # many GAE horizons of 20 tokens
    # A line with the short task's width is malformed in a long problem, and the default is unchanged.
    line = task.full_response(problems[0]).split("\n")[0]
    short_line = line[: line.index(":") + 1] + line[-4:]
    assert task.parse_response(problems[0]["prompt"], short_line + "\n\\boxed{1}").strategy == "invalid"
    assert task.make_problems(5, seed=0) == task.make_problems(5, 0, 1, 48, width=4)
    with pytest.raises(ValueError):
        task.make_problems(1, seed=0, width=7)


@pytest.mark.parametrize("length", ["short", "long"])
def test_every_line_holds_the_last_width_digits_of_x_times_a_power_of_two(length):
    """support/task.py step_line: parse_response judges lines with step_line itself and the box is
    computed apart, so `% 10**WIDTH` for `% 10**width` (long lines wrong) passed test_task. Lines are
    checked here against x * 2^i mod 10^width computed independently, single and merged."""
    shape = task.SHAPES[length]
    for p in task.make_problems(20, 6, *shape.difficulty, shape.width):
        x, k, _ = task.prompt_parts(p["prompt"])
        for merge in (0.0, 1.0):
            lines = task.sft_response(p, random.Random(0), shortcut_prob=0.0, merge_prob=merge).split("\n")[:-1]
            done = 0
            for line in lines:
                labels, digits = line.split(":")
                done += len(labels)
                assert digits == str(x * 2**done % 10**shape.width).zfill(shape.width), (p, line)
            assert done == k and int(digits) == int(p["answer"])


def test_x_is_drawn_from_every_number_of_width_digits_and_no_other():
    """make_problems draws x uniformly from 10^(w-1) .. 10^w - 1: over 20,000 problems both ends
    come up, and no x of w + 1 digits (10^w), whose prompt is no task prompt."""
    xs = [task.prompt_parts(p["prompt"])[0] for p in task.make_problems(20000, seed=0)]
    assert min(xs) == 10 ** (task.WIDTH - 1) and max(xs) == 10**task.WIDTH - 1


@pytest.mark.parametrize("edit", ["merge_past_the_end", "line_after_the_last"])
def test_a_line_doing_more_doublings_than_are_left_is_invalid(edit):
    """The labels count down to "a"; a line past it has no label to take: not a merged last line of
    two doublings with one left ("aZ", Z the label below "a" when counting wraps round), nor a line
    after the last one ("Z")."""
    p = task.make_problems(1, seed=1, min_difficulty=3, max_difficulty=3)[0]
    x, *_ = task.prompt_parts(p["prompt"])
    lines = task.full_response(p).split("\n")  # c:, b:, a:, \boxed{}
    value = int(lines[1].split(":")[1])
    text = {
        "merge_past_the_end": "\n".join(lines[:2] + ["aZ:" + str(value * 4 % 10**task.WIDTH).zfill(task.WIDTH),
                                                      "\\boxed{" + str(value * 4 % 10**task.WIDTH) + "}"]),
        "line_after_the_last": "\n".join(lines[:3] + ["Z:" + str(x * 16 % 10**task.WIDTH).zfill(task.WIDTH),
                                                       lines[-1]]),
    }[edit]
    assert task.parse_response(p["prompt"], text).strategy == "invalid"


def test_the_tiny_model_is_drawn_from_its_own_seed_and_has_the_positions_asked_for(tokenizer):
    """make_tiny_model(seed=s): the same weights for the same seed whatever the global RNG's state,
    which it leaves untouched; other weights for another seed. max_position_embeddings is the
    context it is given."""
    import torch
    from torch.nn.utils import parameters_to_vector

    def weights(model):
        return parameters_to_vector(model.parameters()).detach()

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = task.make_tiny_model(tokenizer, num_layers=1, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(456)
    assert torch.equal(weights(task.make_tiny_model(tokenizer, num_layers=1, seed=3)), weights(first))
    assert not torch.equal(weights(task.make_tiny_model(tokenizer, num_layers=1, seed=4)), weights(first))
    assert first.config.max_position_embeddings == task.CONTEXT
    assert task.make_tiny_model(tokenizer, num_layers=1, max_position_embeddings=64).config.max_position_embeddings == 64
