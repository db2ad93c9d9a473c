"""What PPO did to the chain of thought (paper §3.1: the collapse is the policy cutting its
reasoning short, and its accuracy falls with it).

On the built-in task a response is a full chain (one doubling a line), a merged one (several
doublings on some lines) or a shortcut (an answer boxed before the chain is done, which at the
long task's lengths is never right); a response that is none of these is invalid (malformed, or no
box), or truncated (cut off at the run's max_new_tokens). This script samples pi_SFT and the actor
of each finished train.py run, from its last checkpoint, on the same fresh problems (drawn by
--seed from the task's generator, not held out from training's draws), and
tabulates for each the pass@1, the share and accuracy of every strategy, the per-line accuracy of
the worked lines, and the share of the worked doublings done more than one to a line (`sft.evaluate_task`).
So a fall in accuracy reads as fewer worked chains or worse lines, and a merged share above
pi_SFT's as reasoning compressed into fewer tokens: the shortening that the paper's collapse is
made of, chosen hundreds of tokens before the reward.

    python analysis/strategies.py runs/sweep/actor-lr-2e-4/ablation__ppo__seed0 \\
        runs/sweep/actor-lr-2e-4/ablation__vc-ppo__seed0 --out results/sweep
"""
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer

from support import rundir
from support import task
from support.checkpoints import latest_checkpoint, load_model_weights
from support.config import Config
from support.data import task_difficulty
from support.sft import evaluate_task, sft_cache_path, sft_config, sft_settings

STRATEGIES = ("full", "merged", "shortcut", "invalid", "truncated")


@dataclass
class Args:
    runs: tyro.conf.Positional[tuple[Path, ...]]
    """finished train.py run directories of the built-in task, all with the same pi_SFT"""
    problems: int = 128
    """fresh problems (not held out from training's draws), one sample each"""
    seed: int = 1234
    """seed of the problems and of sampling"""
    out: Path = Path("runs/analysis")
    """folder that receives strategies.md and strategies.json"""


def run_config(run: Path) -> Config:
    saved = run / "config.json"
    if not saved.is_file():
        raise FileNotFoundError(f"{run}: no config.json (not a train.py run directory)")
    fields = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in json.loads(saved.read_text()).items() if k in fields})


def final_actor(run: Path, sft_path: str) -> torch.nn.Module:
    found = latest_checkpoint(str(run / "checkpoint"))
    if found is None:
        raise FileNotFoundError(f"{run}: no checkpoint to read the actor from")
    actor = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32)
    load_model_weights(found, "actor", actor)
    return actor.eval()


def row(name: str, report: dict) -> str:
    cells = []
    for s in STRATEGIES:
        v = report["by_strategy"].get(s)
        cells.append("-" if v is None else f"{v['share']:.2f} ({v['accuracy']:.2f})")
    lines = [f"{acc:.3f}" if acc is not None else "-" for acc, _ in report["line_accuracy"].values()]
    merged = report["merged_doubling_share"]
    return (f"| {name} | {report['accuracy']:.3f} | {report['mean_length']:.0f} | {' | '.join(cells)} | {' | '.join(lines)} | "
            f"{'-' if merged is None else f'{merged:.3f}'} |")


def main(args: Args) -> dict:
    if not args.runs:
        raise ValueError("give at least one run directory")
    if args.problems < 1:  # a pass@1 of no problem is undefined, not 0
        raise ValueError(f"--problems must be >= 1, got {args.problems}")
    configs = [run_config(run) for run in args.runs]
    # A run still training (or stopped) has checkpoints too; its actor is not the one the run ends with.
    unfinished = [str(run) for run in args.runs if not rundir.finished(run)]
    if unfinished:
        raise ValueError(f"not finished (no summary.json): {', '.join(unfinished)}; the actor of a finished run is read")
    base = configs[0]
    if any(c.model or c.data or sft_settings(sft_config(c)) != sft_settings(sft_config(base))
           or task_difficulty(c) != task_difficulty(base) for c in configs):
        raise ValueError("the runs must share the built-in task's pi_SFT and problems "
                         "(same --task-length, --sft-steps and --task-difficulty)")
    if len({(c.max_new_tokens, c.temperature) for c in configs}) > 1:  # one setting samples every policy here
        shown = "; ".join(f"{run}: {c.max_new_tokens} tokens at temperature {c.temperature:g}"
                          for run, c in zip(args.runs, configs))
        raise ValueError(f"the runs sample with other --max-new-tokens or --temperature ({shown}), and every policy "
                         f"here is sampled with one: compare such runs in separate calls")
    sft_path = sft_cache_path(base)
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    low, high = task_difficulty(base)
    problems = task.make_problems(args.problems, args.seed, low, high, task.SHAPES[base.task_length].width)
    policies = {"pi_SFT": lambda: AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.float32).eval()}
    policies.update({str(run): (lambda run=run: final_actor(run, sft_path)) for run in args.runs})
    reports = {}
    for name, load in policies.items():
        reports[name] = evaluate_task(load(), tokenizer, problems, max_new_tokens=base.max_new_tokens,
                                      temperature=base.temperature, seed=args.seed,
                                      grader_timeout_s=base.grader_timeout_s)
        print(f"{name}: pass@1 {reports[name]['accuracy']:.3f}", flush=True)
    lines = [f"# Strategies after PPO: {args.problems} fresh problems of k {low}-{high} (--seed {args.seed}), one sample each "
             f"(temperature {base.temperature}, {base.max_new_tokens} tokens)",
             "", "Each strategy: share of responses (its accuracy). Line accuracy: worked lines that are right. "
             "Doublings merged: the share of all worked doublings that were done more than one to a line.", "",
             "| policy | pass@1 | mean length | " + " | ".join(STRATEGIES) +
             " | line acc., single | line acc., merged | doublings merged |",
             "|---|---|---|" + "---|" * len(STRATEGIES) + "---|---|---|"]
    lines += [row(name, r) for name, r in reports.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "strategies.md").write_text("\n".join(lines) + "\n")
    rundir.write_json(str(args.out / "strategies.json"), reports)  # an undefined accuracy as null, not NaN
    print("\n".join(lines))
    print(f"wrote {args.out}/strategies.md and .json")
    return reports


if __name__ == "__main__":
    from analysis import run_cli

    run_cli(main, Args, __doc__)
