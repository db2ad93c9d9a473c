"""Grader overhead: `Grader.grade` on N responses vs math-verify on them serially, in this process.

    python bench/grader_bench.py --n 1000 --workers 2 --repeats 3

The responses need math-verify (fractions vs decimals, roots, sets, wrong answers), so neither side
takes the string fast path. Timings alternate serial / pool and the median ratio is printed; the
pool is started once and warm before timing, as in training. Prints `ratio grader/serial: X.XX`.
The serial side has no timeout (that is the cost it saves): safe only on these generated cases.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import tyro

import reward
from reward import Grader


@dataclass
class Args:
    n: int = 1000
    """responses per batch"""
    workers: int = 2
    """grader worker processes"""
    repeats: int = 3
    """timed serial / pool pairs"""
    timeout_s: float = 5.0
    """per-item grader timeout"""


def make_cases(n: int, offset: int = 0) -> tuple[list[str], list[str]]:
    """n (response, ground truth) pairs; about half correct, none settled by string comparison.

    `offset` shifts the numbers so that each repeat grades new strings (no parse-cache hits).
    """
    responses, answers = [], []
    for i in range(offset, offset + n):
        a, b = i % 97 + 1, i // 97 + 2
        kind = i % 4
        if kind == 0:  # fraction vs decimal
            gold, pred = f"\\frac{{{a}}}{{{b}}}", f"{a / b:.6f}" if i % 2 else f"{a / b + 1:.6f}"
        elif kind == 1:  # root, simplified or not
            gold, pred = f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}" if i % 2 else f"\\sqrt{{{a}}}"
        elif kind == 2:  # set in another order
            gold, pred = f"\\{{{a}, {b}\\}}", f"\\{{{b},{a}\\}}" if i % 2 else f"\\{{{a},{b + 1}\\}}"
        else:  # algebraic expression
            gold, pred = f"{a}x + {b}", f"{b} + {a} x" if i % 2 else f"{a}x - {b}"
        responses.append(f"Step {i}: some reasoning ... so the answer is $\\boxed{{{pred}}}$.")
        answers.append(gold)
    return responses, answers


def serial_outcomes(responses: list[str], answers: list[str]) -> list[float]:
    """What a grader worker computes, item by item here: box, fast path, then math-verify."""
    outcomes = []
    for response, answer in zip(responses, answers):
        boxed, gold = reward.last_boxed(response), reward._gold_text(answer)
        verdict = boxed is not None and reward._fast_verdict(boxed, gold)
        if verdict is None:
            verdict = reward._math_equal(boxed, gold)
        outcomes.append(1.0 if verdict else -1.0)
    return outcomes


def main(args: Args) -> None:
    reward._math_equal("0.5", "\\frac12")  # build math-verify's grammar before timing
    with Grader(num_workers=args.workers, timeout_s=args.timeout_s) as grader:
        t0 = time.perf_counter()
        grader.grade(["\\boxed{0.5}"] * 4, ["\\frac12"] * 4)  # waits for the workers to start
        print(f"pool start + first call: {time.perf_counter() - t0:.2f} s ({args.workers} workers)")
        ratios = []
        for r in range(args.repeats):
            responses, answers = make_cases(args.n, offset=r * args.n)
            t0 = time.perf_counter()
            serial = serial_outcomes(responses, answers)
            t_serial = time.perf_counter() - t0
            t0 = time.perf_counter()
            result = grader.grade(responses, answers)
            t_pool = time.perf_counter() - t0
            if result.outcomes != serial:
                raise SystemExit("grader and serial math-verify disagree")
            ratios.append(t_pool / t_serial)
            print(f"repeat {r}: serial {t_serial:.2f} s, grader {t_pool:.2f} s, "
                  f"accuracy {serial.count(1.0) / len(serial):.2f}, timeouts {result.num_timeouts}")
    print(f"ratio grader/serial: {statistics.median(ratios):.2f} (median of {args.repeats}, "
          f"n={args.n}, workers={args.workers}, cpus={os.cpu_count()})")


if __name__ == "__main__":
    main(tyro.cli(Args))
