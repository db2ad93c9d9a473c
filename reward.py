"""The reward (paper §4 setup, §3.1): a rule-based verifier's +-1, the only training reward, placed
on the last token of the response.

- `Grader`: the outcome of each response of a batch: +1 if the last `\\boxed{}` / `\\fbox{}` of the
  response is mathematically equivalent to the ground truth (math-verify), else -1. Digits are ASCII:
  `\\boxed{١٢٣٤}` or full-width `\\boxed{１２３４}` is not 1234 (math-verify reads neither as a number),
  and matches only a ground truth written the same way. math-verify runs in worker processes with a
  hard per-item timeout, because it can hang (its own timeout is signal-based, main-thread only, and
  cannot interrupt C-level big-integer arithmetic such as `9^{9^{9^{9}}}`).
- `response_outcomes` and `terminal_rewards`: the outcome of each response (a cut one may get a
  reward of its own) and its place in the token-level MDP of §3.1: on the last response token,
  0 elsewhere, so that the return from every token is the outcome (gamma = 1).

No torch import here: each grader worker runs this file as its own program and stays light; the
placement works with the methods of the tensors it is given.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from functools import lru_cache
from multiprocessing.connection import Connection, Pipe, wait

from math_verify import parse, verify

# math-verify warns once that its timeout is disabled; the Grader's process timeout replaces it.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# What a user or a scheduler sends a whole job to stop it (Ctrl-C reaches every process of the
# terminal's group, SLURM signals every process of the step): the trainer finishes its step and saves
# (preemption.py), so its grader workers ignore them and grade that step to the end. They stop when
# the trainer closes their pipe, or kills them.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# A grader worker's start (an interpreter, then math-verify and sympy imported and warmed up): 1-3 s
# on a busy CPU; far more is an import hung on a shared filesystem, which grading would wait on for good.
STARTUP_TIMEOUT_S = 120.0

# A box opens its group (`\\boxed{42}`, `\\boxed {42}`) or, without braces, boxes what follows it
# (`\\boxed 42`, `\\boxed42`: the whole number, which is what a model writing it means, not TeX's
# single token). Every box counts, a bare one too (`\\boxed` at the end): the last one is the answer.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])(?:\s*\{)?")
_UNBRACED = re.compile(r"\s*([^\s$]+)")
# Thin and other spaces between digit groups (`1\,000`, `1\;000`, `1~000`; `1 000`, which TeX sets
# as 1000; a no-break or thin space): math-verify reads `1\,000` as no number and `1 000` as another;
# they go, as the thousands commas it already reads do.
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;:!]|\\ |~|[ \u00a0\u2009\u202f])\s*(?=\d{3}(?!\d))")
# ASCII digits only: math-verify reads Arabic-Indic (١٢٣٤) or full-width (１２３４) digits as no
# number at all, and the fast path must not decide otherwise than math-verify would.
_PLAIN_INT = re.compile(r"-?[0-9]{1,50}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces allowed), or None;
    `\\boxed 42` or `\\boxed42` without braces boxes the text up to the next space or `$` (a final full
    stop dropped).

    A last box that never closes (a truncated response) or is empty counts as no answer: an earlier
    box was not the final answer either.
    """
    opens = list(_BOX_OPEN.finditer(text))
    if not opens:
        return None
    start = k = opens[-1].end()
    if not opens[-1].group().endswith("{"):
        unbraced = _UNBRACED.match(text, start)  # none at the end, or before a `$`: an empty box
        return (unbraced.group(1).rstrip(".,;:") or None) if unbraced else None
    depth = 1
    while k < len(text):
        if text[k] == "\\":  # an escape: \{ and \} are literal braces (sets), \\ a line break
            k += 2
            continue
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                content = text[start:k].strip()
                return content or None
        k += 1
    return None


_MATH_DELIMITERS = (("$", "$"), ("\\[", "\\]"), ("\\(", "\\)"))


def _gold_text(ground_truth: str) -> str:
    """The ground truth as bare LaTeX: the content of its last box if it has one, without the math
    delimiters around it (`$...$`, `$$...$$`, `\\[...\\]`, `\\(...\\)`)."""
    gold = (last_boxed(ground_truth) or ground_truth).strip()
    unwrapped = True
    while unwrapped:
        unwrapped = False
        for left, right in _MATH_DELIMITERS:
            if len(gold) >= len(left + right) and gold.startswith(left) and gold.endswith(right):
                gold, unwrapped = gold[len(left):-len(right)].strip(), True
    return gold


def ungradable_gold(ground_truth: str) -> str | None:
    """Why no response can ever match `ground_truth`, or None: its last box is empty or never closes,
    nothing is left once its delimiters are taken off (`$$`), or a brace opens and never closes
    (`\\frac{1}{`). A stray closing brace is not a reason: math-verify reads `12}` as 12."""
    if _BOX_OPEN.search(ground_truth) and last_boxed(ground_truth) is None:
        return "its last \\boxed{} is empty or never closes"
    gold = _gold_text(ground_truth)
    if not gold:
        return "it is empty inside its math delimiters"
    unclosed, k = 0, 0
    while k < len(gold):
        if gold[k] == "\\":  # \{ and \} are literal braces, as in last_boxed
            k += 2
            continue
        unclosed = unclosed + 1 if gold[k] == "{" else max(0, unclosed - 1) if gold[k] == "}" else unclosed
        k += 1
    return "a brace opens and never closes" if unclosed else None


def _fast_verdict(answer: str, gold: str) -> bool | None:
    """Decide without math-verify when the strings settle it; None when they do not."""
    if " ".join(answer.split()) == " ".join(gold.split()):
        return True
    if _PLAIN_INT.fullmatch(answer) and _PLAIN_INT.fullmatch(gold):
        return int(answer) == int(gold)  # two integer literals are equal iff their values are
    return None


@lru_cache(maxsize=4096)
def _parse(latex: str) -> list:
    """math-verify parse of `$latex$` (cached: one gold is graded against many samples)."""
    # Timeouts disabled: signal-based, they fail outside the main thread; callers bound the time.
    return parse(f"${latex}$", parsing_timeout=None)


def _math_equal(answer: str, gold: str) -> bool:
    """math-verify equivalence of two bare LaTeX strings; any internal error is a mismatch."""
    try:
        return bool(verify(_parse(gold), _parse(answer), timeout_seconds=None))
    except Exception:  # math-verify raises on some inputs despite raise_on_error=False
        return False


@dataclasses.dataclass
class GradeResult:
    outcomes: list[float]  # +1 / -1 per response, in input order
    num_timeouts: int  # items whose worker was killed at the timeout (or died) -> scored -1
    num_missing_box: int  # responses without a (closed, non-empty) box -> scored -1


def _worker_main(fd: int, parent: int) -> None:
    """Grader worker: warm up, say "ready", then answer [(idx, answer, gold), ...] item by item."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    _die_with(parent)
    conn = Connection(fd)
    _math_equal("\\frac{1}{2}", "0.5")  # first call builds math-verify's grammar: do it before work
    try:
        conn.send("ready")
        while (chunk := conn.recv()) is not None:
            for idx, answer, gold in chunk:
                conn.send((idx, _math_equal(answer, gold)))
    except (EOFError, OSError):  # the parent is gone (it stopped, or failed): so is this worker,
        return  # quietly, so that the parent's own error stays the last thing printed


def _die_with(parent: int) -> None:
    """On Linux, the kernel kills this worker when the process that started it dies, even by SIGKILL
    or the OOM killer: a worker busy in C-level arithmetic reads no pipe, ignores the stop signals,
    and would otherwise run on for good. (Linux ties it to the thread that started it: a Grader is
    made and used by one thread. Elsewhere the worker stops at its next read of the pipe.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


class _Worker:
    """One grader process: a fresh interpreter that runs this file alone (never torch).

    Not multiprocessing's spawn: that re-imports the parent's `__main__` (train.py, hence torch)
    in every child. Here the child gets one end of a socket pair and nothing else.
    """

    def __init__(self):
        parent_end, child_end = Pipe()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(child_end.fileno()),
                                      str(os.getpid())],
                                     pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL)
        child_end.close()
        self.conn = parent_end
        self.ready = False
        self.pending: deque = deque()  # items sent and not yet answered, in order
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S  # to say "ready", then to answer an item

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class Grader:
    """The verifier (module docstring) over a batch: a pool of worker processes, a hard per-item timeout.

    Box extraction and the string fast path run in the calling process; only the items that need
    math-verify go to workers, in chunks. A worker silent for `timeout_s` on one item is killed and
    replaced; that item scores -1 and is counted, the rest of its chunk goes to another worker.
    The pool lives until `close()` (or the end of a `with` block), so each call pays no start-up.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, max_chunk: int = 32):
        if num_workers < 1 or not 0 < timeout_s < math.inf or max_chunk < 1:
            raise ValueError(f"Grader: need num_workers >= 1, finite timeout_s > 0, max_chunk >= 1; got "
                             f"{num_workers}, {timeout_s}, {max_chunk}")
        self.timeout_s, self.max_chunk = timeout_s, max_chunk
        self.workers = [_Worker() for _ in range(num_workers)]  # they warm up while the caller works

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self.workers:
            try:  # a worker still starting up (or hung) is not worth waiting for
                w.proc.wait(timeout=1 if w.ready and not w.pending else 0.01)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self.workers = []

    def grade(self, responses: list[str], answers: list[str]) -> GradeResult:
        """Outcomes (+1 / -1) of `responses` against `answers` (ground truths). Only the responses are
        graded, so callers pass the response text alone (a box in the prompt must not count). Never
        raises on any response (ValueError for a ground truth that is neither text nor a number)."""
        if len(responses) != len(answers):
            raise ValueError(f"grade: {len(responses)} responses but {len(answers)} answers")
        for i, gold in enumerate(answers):  # None or NaN read as text would match a response boxing "None"
            if isinstance(gold, bool) or not isinstance(gold, (str, numbers.Real)) or gold != gold:
                raise ValueError(f"grade: answers[{i}] is {gold!r}, not a ground truth (text or a number)")
        if not self.workers:
            raise ValueError("grade: this Grader is closed")
        outcomes = [-1.0] * len(responses)
        todo: deque = deque()
        for w in list(self.workers):
            if w.pending:  # left by an interrupted call: its answers must not land in this one
                w.pending.clear()
                self._replace(w, todo, outcomes)
        missing = 0
        for i, (response, ground_truth) in enumerate(zip(responses, answers)):
            answer = last_boxed(str(response))
            if answer is None:
                missing += 1
                continue
            answer, gold = _DIGIT_GROUP_SPACE.sub("", answer), _DIGIT_GROUP_SPACE.sub("", _gold_text(str(ground_truth)))
            verdict = _fast_verdict(answer, gold)
            if verdict is None:
                todo.append((i, answer, gold))
            else:
                outcomes[i] = 1.0 if verdict else -1.0
        # ~4 chunks per worker: few messages, yet the load still balances.
        chunk = max(1, min(self.max_chunk, math.ceil(len(todo) / (4 * len(self.workers)))))
        timeouts = 0
        while todo or any(w.pending for w in self.workers):
            for w in list(self.workers):
                if w.ready and not w.pending and todo:
                    items = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                    try:
                        w.conn.send(items)
                    except OSError:  # died while idle: nothing of this chunk was lost
                        todo.extendleft(reversed(items))
                        self._replace(w, todo, outcomes)
                        continue
                    w.pending.extend(items)
                    w.deadline = time.monotonic() + self.timeout_s
            busy = [w.deadline for w in self.workers if w.pending or not w.ready]
            wait_s = max(0.0, min(busy) - time.monotonic()) if busy else None
            for conn in wait([w.conn for w in self.workers], timeout=wait_s):
                w = next(w for w in self.workers if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the worker died
                    timeouts += self._replace(w, todo, outcomes)
                    continue
                if msg == "ready":
                    w.ready, w.deadline = True, math.inf
                else:
                    idx, equal = msg
                    outcomes[idx] = 1.0 if equal else -1.0
                    w.pending.popleft()
                    w.deadline = time.monotonic() + self.timeout_s
            now = time.monotonic()
            for w in list(self.workers):
                if not w.ready and now > w.deadline:
                    w.kill()
                    raise RuntimeError(f"Grader: a worker did not start within {STARTUP_TIMEOUT_S:.0f} s "
                                       f"(importing math-verify: a slow or hung filesystem?)")
                if w.pending and now > w.deadline:
                    timeouts += self._replace(w, todo, outcomes)
        return GradeResult(outcomes=outcomes, num_timeouts=timeouts, num_missing_box=missing)

    def _replace(self, w: _Worker, todo: deque, outcomes: list[float]) -> int:
        """Kill `w`, score its current item -1, requeue the rest; returns 1 if an item was lost."""
        if not w.ready:
            w.kill()
            raise RuntimeError("Grader: a worker died while starting (see its stderr above)")
        w.kill()
        lost = 0
        if w.pending:
            idx, _, _ = w.pending.popleft()
            outcomes[idx] = -1.0
            lost = 1
            todo.extendleft(reversed(w.pending))
        self.workers[self.workers.index(w)] = _Worker()
        return lost


# --- the outcome as a reward of the token-level MDP (§3.1) ---------------------------------------


def response_outcomes(verdicts, truncated, truncation_reward: float | None):
    """[B] float: each response's verdict (+-1, a float tensor), or `truncation_reward` for a response
    cut at max_new_tokens (`truncated`, a list of bools) when that is set."""
    if truncation_reward is None:
        return verdicts
    return verdicts.masked_fill(verdicts.new_tensor(truncated, dtype=bool), float(truncation_reward))


def terminal_rewards(outcomes, response_mask):
    """[B, T] token rewards: outcomes[b] on response b's last token t = L_b - 1, 0 elsewhere (an
    empty response has no token to reward, so its row stays 0, as padding must)."""
    lengths = response_mask.sum(-1).long()
    if tuple(outcomes.shape) != tuple(lengths.shape):
        raise ValueError(f"outcomes must hold one value per response, shape {tuple(lengths.shape)}; "
                         f"got {tuple(outcomes.shape)}")
    rewards = response_mask.new_zeros(response_mask.shape, dtype=outcomes.dtype)
    rows = (lengths > 0).nonzero().squeeze(-1)
    rewards[rows, lengths[rows] - 1] = outcomes.to(rewards.device)[rows]
    return rewards


if __name__ == "__main__":  # a grader worker (`_Worker`): argv[1] is its end of the socket pair, argv[2] its parent
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
