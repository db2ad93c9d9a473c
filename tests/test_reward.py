"""reward.py: the verifier's verdicts on Math-Verify's own cases, the grader pool and its timeout."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import reward
from reward import Grader, last_boxed, terminal_rewards

# Shipped with the tests (its README: source and license). Read at import: a missing file fails
# the collection of this module instead of skipping its tests.
CASES_FILE = Path(__file__).parent / "data" / "verifier_cases" / "math_verify_cases.jsonl"
CASES = [json.loads(line) for line in CASES_FILE.read_text().splitlines()]
HANG = "\\boxed{9^{9^{9^{9}}}}"  # real math-verify hang: sympy evaluates the power tower in C


@pytest.fixture(scope="module")
def grader():
    with Grader(num_workers=1) as g:
        yield g


def outcome(grader: Grader, response, gold) -> float:
    """One response's outcome, graded as training grades its batches."""
    return grader.grade([response], [gold]).outcomes[0]


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['kind']}" for i, c in enumerate(CASES)])
def test_the_verifier_agrees_with_math_verify_suite(case, grader):
    # The README's framing: the gold is wrapped as `$...$`; the Grader does that itself.
    assert outcome(grader, case["response"], case["gold"]) == (1.0 if case["equal"] else -1.0)


@pytest.mark.parametrize("response, gold", [
    ("so $\\boxed{\\frac{1}{2}}$", "0.5"),
    ("\\boxed{\\dfrac{3}{4}}", "3/4"),
    ("\\boxed{1,234,567}", "1234567"),
    ("\\boxed{ 2 \\sqrt{ 2 } }", "\\sqrt{8}"),
    ("\\boxed{x=3}", "3"),
    ("so the answer is $\\boxed 42$.", "42"),  # TeX's box without braces
    ("\\boxed 0.5.", "\\frac12"),
    ("\\boxed{1\\,000}", "1000"),  # thin spaces between digit groups
    ("\\boxed{1\\;000\\;000}", "1,000,000"),
    ("\\boxed{2500}", "2\\,500"),
    ("\\boxed{1 000}", "1000"), ("\\boxed{12 345 678}", "12345678"),  # TeX sets `1 000` as 1000
    ("\\boxed{1000}", "1\u00a0000"), ("\\boxed{1\u2009000}", "1000"), ("\\boxed{1\u202f000.5}", "1000.5"),
])
def test_equivalent_forms_score_plus_one(response, gold, grader):
    assert outcome(grader, response, gold) == 1.0


def test_last_box_wins_over_earlier_boxes(grader):
    assert outcome(grader, "first \\boxed{3}, no wait: \\boxed{4}", "4") == 1.0
    assert outcome(grader, "first \\boxed{4}, no wait: \\boxed{3}", "4") == -1.0


def test_box_in_prompt_only_is_not_scored(grader):
    prompt = "Example: 2+2 = \\boxed{4}. Now compute 2+2."
    response = "The answer is 4."
    assert outcome(grader, response, "4") == -1.0  # callers pass the response alone
    assert outcome(grader, prompt + response, "4") == 1.0  # the reason they must


def test_missing_unclosed_or_empty_box_scores_minus_one(grader):
    assert outcome(grader, "the answer is 4", "4") == -1.0
    assert outcome(grader, "\\boxed{4} then truncated \\boxed{4", "4") == -1.0
    assert outcome(grader, "\\boxed{}", "4") == -1.0
    # TeX's unbraced box followed by math, not a number: an empty last box, not a crash of the grader
    for response in ["\\boxed $5$", "$\\boxed $", "\\boxed\n$5$", "\\boxed{5} then \\boxed $5$"]:
        assert last_boxed(response) is None
        assert outcome(grader, response, "5") == -1.0
    assert grader.grade(["\\boxed $5$", "\\boxed{5}"], ["5", "5"]).outcomes == [-1.0, 1.0]


def test_the_last_box_is_the_answer_even_without_braces_or_content(grader):
    """A box written without braces right after the command (`\\boxed6`) or left bare at the end was
    passed over, and an earlier box graded in its place: a response that changed its mind from 5 to 6
    scored +1 against the gold 5."""
    assert last_boxed("\\boxed{5} wait, recheck: the answer is \\boxed6") == "6"
    assert last_boxed("\\boxed42 is it") == "42" and last_boxed("\\boxedfoo{3}") is None  # another command
    revised = ["\\boxed{5} wait, recheck: \\boxed6", "\\boxed{5} wait, recheck: \\boxed",
               "\\boxed{5} or \\fbox", "\\boxed{5} or \\boxed 6"]
    for response in revised:
        assert outcome(grader, response, "5") == -1.0, response
    graded = grader.grade(revised, ["6", "5", "5", "6"])
    assert graded.outcomes == [1.0, -1.0, -1.0, 1.0] and graded.num_missing_box == 2


def test_nested_braces_and_fbox_are_extracted(grader):
    assert last_boxed("x \\boxed{\\frac{1}{\\sqrt{2}}} y") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("\\boxed{a \\\\}") == "a \\\\"  # a line break \\ before the closing brace
    assert last_boxed("\\boxed{\\\\{x}}") == "\\\\{x}"  # \\ then a group, not \\{
    assert last_boxed("\\boxed{1} and \\fbox{2}") == "2"
    assert outcome(grader, "\\fbox{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}") == 1.0


def test_escaped_braces_inside_a_box_are_literal_not_grouping():
    """`\\{` and `\\}` are set braces: they neither open nor close the box's group."""
    assert last_boxed("\\boxed{\\left\\{ x > 0 \\right.} done") == "\\left\\{ x > 0 \\right."
    assert last_boxed("so \\boxed{\\}}") == "\\}"


def test_boxed_ground_truth_is_unwrapped(grader):
    assert outcome(grader, "\\boxed{0.25}", "$\\boxed{\\frac14}$") == 1.0


@pytest.mark.parametrize("gold", ["$\\frac14$", "$$\\frac14$$", "\\[ \\frac14 \\]", "\\(\\frac14\\)", "$\\[\\frac14\\]$"])
def test_a_ground_truth_in_math_delimiters_is_unwrapped(gold, grader):
    """A gold written `\\[ ... \\]` was parsed as `$\\[ ... \\]$` and matched no response."""
    assert reward._gold_text(gold) == "\\frac14"
    assert outcome(grader, "\\boxed{0.25}", gold) == 1.0 and outcome(grader, "\\boxed{0.3}", gold) == -1.0


def test_fast_path_decides_without_math_verify():
    assert reward._fast_verdict("1 2 3", "1 2   3") is True
    assert reward._fast_verdict("0042", "42") is True
    assert reward._fast_verdict("-41", "42") is False
    assert reward._fast_verdict("\\frac12", "0.5") is None  # left to math-verify


def test_the_verifier_never_raises_on_garbage(grader):
    """Any response is graded, garbage included; a ground truth that is not one is the caller's error."""
    for response in [None, 12, "\\boxed{\\frac{", "\\boxed{" + "{" * 5000, "\\boxed{\\begin{x}}", "\\boxed{)(}"]:
        assert outcome(grader, response, "1") == -1.0
    with pytest.raises(ValueError, match="answers\\[0\\] is None, not a ground truth"):
        outcome(grader, "\\boxed{None}", None)  # graded as the text "None", it scored +1


def test_grader_rejects_mismatched_lengths_and_bad_settings():
    with pytest.raises(ValueError):
        Grader(num_workers=0)
    with Grader(num_workers=1) as grader:
        with pytest.raises(ValueError):
            grader.grade(["\\boxed{1}"], [])
        # A ground truth that is no text or number was graded as its text: None matched \boxed{None}.
        for gold in (None, float("nan"), True, [1, 2], {"x": 1}):
            with pytest.raises(ValueError, match=r"grade: answers\[1\] is .*, not a ground truth \(text or a number\)"):
                grader.grade(["\\boxed{1}", f"\\boxed{{{gold}}}"], ["1", gold])
        import numpy as np

        golds = [2, 0.5, np.int64(7)]  # numbers are golds, numpy's (a pandas column's) too
        assert grader.grade(["\\boxed{2}", "\\boxed{0.5}", "\\boxed{7}"], golds).outcomes == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_grader_agrees_with_suite_and_reuses_its_workers():
    cases = CASES[::4]  # every kind of answer is checked one by one above; this checks the pool
    responses = [c["response"] for c in cases] + ["no box here"]
    golds = [c["gold"] for c in cases] + ["1"]
    with Grader(num_workers=2, timeout_s=10.0) as grader:
        pids = [w.proc.pid for w in grader.workers]
        first = grader.grade(responses, golds)
        second = grader.grade(responses[:10][::-1], golds[:10][::-1])
        assert [w.proc.pid for w in grader.workers] == pids  # no restart between calls
    assert first.outcomes == [1.0 if c["equal"] else -1.0 for c in cases] + [-1.0]
    assert second.outcomes == first.outcomes[:10][::-1]
    assert first.num_missing_box == 1 and first.num_timeouts == 0


@pytest.mark.slow
def test_hanging_item_is_killed_scored_minus_one_and_worker_replaced():
    timeout_s = 1.0
    with Grader(num_workers=2, timeout_s=timeout_s) as grader:
        grader.grade(["\\boxed{0.5}"] * 4, ["1/2"] * 4)  # workers up
        responses = ["\\boxed{\\frac{1}{3}}", HANG, "\\boxed{0.75}", "\\boxed{2}"] * 3
        golds = ["0.3333333", "5", "3/4", "\\sqrt{4}"] * 3
        t0 = time.monotonic()
        result = grader.grade(responses, golds)
        elapsed = time.monotonic() - t0
        assert result.num_timeouts == 3
        assert result.outcomes == [1.0, -1.0, 1.0, 1.0] * 3
        # Each hang costs ~timeout_s plus a replacement's start-up (1-3 s on 2 busy cores); without
        # the kill the power tower would never finish.
        assert elapsed < 3 * timeout_s + 12.0
        again = grader.grade(["\\boxed{\\frac{2}{4}}"], ["0.5"])  # the pool still works
        assert again.outcomes == [1.0] and again.num_timeouts == 0


@pytest.mark.slow
def test_grader_workers_do_not_load_torch():
    with Grader(num_workers=1) as grader:
        grader.grade(["\\boxed{0.5}"], ["1/2"])  # the worker has run reward.py and graded
        maps = Path(f"/proc/{grader.workers[0].proc.pid}/maps")
        if not maps.exists():
            pytest.skip("needs /proc")
        assert "libtorch" not in maps.read_text()
    out = subprocess.run([sys.executable, "-c", "import reward, sys; print('torch' in sys.modules)"],
                         cwd=os.path.dirname(reward.__file__), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_busy_worker_dies_with_a_trainer_killed_outright():
    """A worker stuck in the power tower ignores the stop signals and reads no pipe: a trainer killed
    by SIGKILL (or the OOM killer) left it running for good, re-parented to init."""
    code = """
import sys
import reward
grader = reward.Grader(num_workers=1, timeout_s=600.0)
grader.grade(["\\\\boxed{0.5}"], ["1/2"])
print(grader.workers[0].proc.pid, flush=True)
grader.grade([sys.argv[1]], ["1"])
"""
    trainer = subprocess.Popen([sys.executable, "-c", code, HANG], cwd=Path(reward.__file__).parent,
                               stdout=subprocess.PIPE, text=True)
    worker = int(trainer.stdout.readline())
    time.sleep(1.0)  # grading the tower by now
    assert Path(f"/proc/{worker}/stat").read_text().split()[2] == "R"
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = not Path(f"/proc/{worker}").exists()
    if not gone:
        os.kill(worker, 9)
    assert gone


def test_the_math_verify_cases_are_all_there():
    assert len(CASES) == 80 and all({"gold", "response", "equal"} <= set(c) for c in CASES)


def test_the_grader_bounds_its_own_time_on_answers_that_hang_math_verify():
    """Each of these ran past 30 s in math-verify; the Grader scores each -1 after its timeout.
    In a subprocess, so that an unbounded Grader fails the test instead of hanging it."""
    code = """
import sys, time
import reward
hostile = ["\\\\boxed{9^{9^{9}}}", "\\\\boxed{9^{9^{9^{9}}}}", "\\\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
           "\\\\boxed{" + "+".join(["1"] * 500_000) + "}", "\\\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}"]
grader = reward.Grader(num_workers=1, timeout_s=1.0)
assert grader.grade(["\\\\boxed{\\\\frac12}"], ["0.5"]).outcomes == [1.0]  # its worker is up
for answer in hostile:
    t0 = time.monotonic()
    assert grader.grade([answer], ["1"]).outcomes == [-1.0]
    print(time.monotonic() - t0)
grader.close()
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(reward.__file__).parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # The 1 s timeout, plus the start of the worker that replaces a killed one (~2 s on a busy CPU).
    assert all(float(s) < 10.0 for s in done.stdout.split()), done.stdout


def test_the_sft_report_grades_through_a_grader_with_a_timeout(monkeypatch):
    from support import sft
    from support import task

    tokenizer = task.build_tokenizer()
    model = task.make_tiny_model(tokenizer, num_layers=1, intermediate_size=64, seed=0)
    monkeypatch.setattr(sft, "decode_responses", lambda tokenizer, batch: [HANG, "\\boxed{5}"][: len(batch)])
    problems = [{**task.make_problems(1, seed=3)[0], "answer": "5"} for _ in range(2)]
    t0 = time.monotonic()
    report = sft.evaluate_task(model, tokenizer, problems, max_new_tokens=2, grader_timeout_s=1.0)
    assert report["accuracy"] == 0.5 and time.monotonic() - t0 < 15  # the hang scored -1, the 5 +1


def test_unicode_digits_are_left_to_math_verify_which_reads_no_number(grader):
    """Decided: digits are ASCII. The fast path must not grade `١٢٣٤` (Arabic-Indic) or `１２３４`
    (full-width) equal to 1234 when math-verify, which decides everything else, does not."""
    for answer in ("١٢٣٤", "１２３４"):
        assert reward._fast_verdict(answer, "1234") is None and not reward._math_equal(answer, "1234")
        assert outcome(grader, f"\\boxed{{{answer}}}", "1234") == -1.0
        assert outcome(grader, f"\\boxed{{{answer}}}", answer) == 1.0  # written as the ground truth is


def test_the_grader_refuses_an_infinite_timeout():
    """wait(timeout=inf) raises OverflowError at the first item that needs math-verify."""
    for bad in (math.inf, math.nan, 0.0):
        with pytest.raises(ValueError, match="timeout_s"):
            Grader(num_workers=1, timeout_s=bad)


def test_items_queued_behind_a_hung_item_in_its_chunk_are_graded_not_dropped():
    """reward.Grader._replace: without `todo.extendleft(reversed(w.pending))` the rest of the hung
    item's chunk silently scores -1. One worker, 8 items -> chunks of 2: [HANG, 0.75] first."""
    with Grader(num_workers=1, timeout_s=1.0) as grader:
        grader.grade(["\\boxed{0.5}"], ["1/2"])  # worker up
        result = grader.grade([HANG] + ["\\boxed{0.75}"] * 7, ["5"] + ["3/4"] * 7)
    assert result.num_timeouts == 1
    assert result.outcomes == [-1.0] + [1.0] * 7


def test_an_answer_left_by_an_interrupted_call_does_not_land_in_the_next_one(monkeypatch):
    """reward.Grader.grade: no test covered the `if w.pending:` clean-up (removing it passed all of
    test_reward.py). A call interrupted while its item is with the worker (a KeyboardInterrupt, as
    in test_train's killed runs) leaves that answer in the pipe; the next call must not read it."""
    with Grader(num_workers=1, timeout_s=10.0) as grader:
        grader.grade(["\\boxed{0.5}"], ["1/2"])  # worker up
        real_wait = reward.wait

        def interrupted(conns, timeout=None):
            if grader.workers[0].pending:
                raise KeyboardInterrupt
            return real_wait(conns, timeout=timeout)

        monkeypatch.setattr(reward, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            grader.grade(["\\boxed{\\frac12}"], ["0.5"])  # sent to the worker, its True never read
        monkeypatch.undo()
        result = grader.grade(["no box here"], ["1"])  # decided without the worker: -1
        assert result.outcomes == [-1.0] and result.num_missing_box == 1
        assert grader.grade(["\\boxed{\\frac14}"], ["0.25"]).outcomes == [1.0]  # and the pool still grades


def test_terminal_rewards_put_each_outcome_on_its_last_token_and_nothing_on_padding():
    import torch

    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # the last response is empty
    rewards = terminal_rewards(torch.tensor([1.0, -1.0, 1.0]), mask)
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == [[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="one value per response"):
        terminal_rewards(torch.tensor([1.0, -1.0]), mask)


def test_a_worker_that_never_starts_stops_grading_with_an_error_instead_of_a_hang(monkeypatch):
    """Grading waited without a time limit for a worker to say "ready": an import hung on a shared
    filesystem would have stalled the run (and, under torchrun, every other rank in its next collective)."""
    real_popen = subprocess.Popen
    monkeypatch.setattr(reward, "STARTUP_TIMEOUT_S", 1.0)
    monkeypatch.setattr(reward.subprocess, "Popen", lambda args, **kwargs: real_popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
    with Grader(num_workers=1) as grader:
        assert grader.grade(["\\boxed{3}"], ["3"]).outcomes == [1.0]  # the fast path needs no worker
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="did not start within 1 s"):
            grader.grade(["\\boxed{\\frac{1}{2}}"], ["0.5"])
        assert time.monotonic() - start < 10
