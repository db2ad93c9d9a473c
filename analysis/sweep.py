"""Where does plain PPO collapse? A small sweep on the long built-in task (paper §3.1, Fig. 1).

The paper's collapse (response length, then accuracy, falling early in PPO) did not happen on the
long task at its defaults (results/long/README.md). So this script varies
one setting at a time and runs plain PPO against VC-PPO in each cell, with the same seeds:

| cell | train.py flags, after `--preset tiny-long` |
|---|---|
| default | `--steps 50`: plain PPO and VC-PPO at the preset's settings, in the base --out-dir itself |
| actor-lr-1e-4, actor-lr-2e-4 | `--steps 20 --actor-lr ...` (the default is 5e-5) |
| lam-actor-0.99 | `--steps 20 --lam-actor 0.99` (plain PPO's critic keeps lambda 0.95) |
| max-new-tokens-560 | `--steps 20 --max-new-tokens 560`: a limit that truncates more of pi_SFT's responses |
| steps-100 | `--steps 100`: the default cell, twice as long |
| k-46-52, k-28-40 | `--steps 50 --task-difficulty 46 52 --max-new-tokens 620` (and `28 40`, `460`): task length |

The limit of 560 tokens cuts 28% of the SFT mix's responses (37% of its worked chains), where the
preset's 600 cuts 10% (14%); 480 would cut 68% (88%), leaving little for PPO to learn from
(4,000 problems of the long task, seed 1).

The task-length cells keep pi_SFT (trained on k = 1 to 52) and draw the RL and held-out problems
from another range of k: 46-52, the longest chains the task's 52 labels allow (median SFT-mix
response 569 tokens, 28 GAE horizons, against the preset's 519, 26), and 28-40 (386 tokens, 19
horizons). Each has its own ORM (trained on its own problems) and a limit that cuts about the
preset's share of the SFT mix's responses: 620 cuts 10.5% (46-52), 460 cuts 12.7% (28-40).

Each cell's two runs are the ablation grid's `ppo` (critic from the ORM) and `vc-ppo` cells, in
<root>/<cell>/. A cell reuses the base --out-dir's pi_SFT (trained first when missing), and its ORM
when the base --out-dir holds one whose settings are the cell's too (linked into
<root>/<cell>/_shared/); otherwise the cell's first run builds its own ORM. Every
run that can share the cached models is started in one pool, `--jobs` at a time.

The table gives, per cell and seed: the length ratio (lowest 5-step moving
average of the batch-mean length over the first step's), held-out pass@1 after PPO (pi_SFT's
beside it), and the training accuracy over the first and last 5 steps; a cell with more than one
finished seed gets a row of means (± sample std) over them. The last two columns apply the search's
goal to each seed: plain PPO collapses (ratio <= 0.7, pass@1 below pi_SFT's) and
VC-PPO holds (ratio >= 0.9, pass@1 at least pi_SFT's). Cells that have not finished, or not
started, are listed as such. Flags after `--` go to every run.

    python analysis/sweep.py --cells actor-lr-2e-4 actor-lr-1e-4     # runs what is missing, then the table
    python analysis/sweep.py --read-only --out results/sweep         # the table of what has finished
"""
import os
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from analysis import ablation
from support import rundir
from analysis.collapse import WINDOW, length_ratio
from support.config import parse_config
from critic import orm_path, orm_settings
from support.sft import sft_cache_path, sft_config, sft_settings

CELLS = {  # name -> train.py flags after --preset tiny-long
    "default": ["--steps", "50"],
    "actor-lr-1e-4": ["--steps", "20", "--actor-lr", "1e-4"],
    "actor-lr-2e-4": ["--steps", "20", "--actor-lr", "2e-4"],
    "lam-actor-0.99": ["--steps", "20", "--lam-actor", "0.99"],
    "max-new-tokens-560": ["--steps", "20", "--max-new-tokens", "560"],
    "steps-100": ["--steps", "100"],
    "k-46-52": ["--steps", "50", "--task-difficulty", "46", "52", "--max-new-tokens", "620"],
    "k-28-40": ["--steps", "50", "--task-difficulty", "28", "40", "--max-new-tokens", "460"],
}
RUNS = ("ppo", "vc-ppo")  # each cell's two runs, cells of the ablation grid


@dataclass
class Args:
    cells: tuple[str, ...] = tuple(CELLS)
    """cells to run or read (see the table above)"""
    seeds: tuple[int, ...] = (0,)
    """seeds of both runs in every cell"""
    out_dir: str = "runs/long"
    """the base train.py --out-dir: the default cell's runs, and the pi_SFT and ORM that cells reuse"""
    root: str = "runs/sweep"
    """the other cells go to <root>/<cell>/"""
    out: Path = Path("runs/analysis")
    """folder that receives sweep.png, sweep.md and sweep.json"""
    jobs: int = 2
    """train.py processes at once"""
    read_only: bool = False
    """only read finished runs; never start train.py"""


def cell_dir(args: Args, cell: str) -> str:
    return args.out_dir if cell == "default" else os.path.join(args.root, cell)


def link_caches(base_flags: list[str], cell_flags: list[str]) -> None:
    """Link the base out-dir's pi_SFT (same SFT settings) and ORM (same ORM settings, which
    include the generation limit) into the cell's _shared/, unless the cell already has its own."""
    base, cell = parse_config(base_flags), parse_config(cell_flags)
    same_sft = (base.model, sft_settings(sft_config(base))) == (cell.model, sft_settings(sft_config(cell)))
    links = [(sft_cache_path(base), sft_cache_path(cell))] if same_sft else []
    if same_sft and orm_settings(base) == orm_settings(cell):
        links.append((orm_path(base), orm_path(cell)))
    for source, target in links:
        if os.path.isdir(source) and not os.path.lexists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.path.abspath(source), target)


def plan(args: Args, train_flags: list[str]) -> dict[str, list[ablation.Run]]:
    ablation.check_nonempty(cells=args.cells, seeds=args.seeds)  # before the base pi_SFT trains
    if not args.read_only:
        ablation.check_jobs(args.jobs)
    unknown = [c for c in args.cells if c not in CELLS]
    if unknown:
        raise ValueError(f"unknown cell(s) {unknown}; choose from {list(CELLS)}")
    runs = {}
    base_flags = ["--out-dir", args.out_dir, "--preset", "tiny-long", *train_flags]
    if not args.read_only:  # the base pi_SFT first, so that every cell links it rather than training its own
        ablation.build_missing_sft([parse_config(base_flags)])
    for cell in args.cells:
        out_dir = cell_dir(args, cell)
        flags = ["--preset", "tiny-long", *CELLS[cell], *train_flags]
        if not args.read_only:
            link_caches(base_flags, ["--out-dir", out_dir, *flags])
        grid = ablation.Args(out_dir=out_dir, variants=RUNS, seeds=args.seeds)
        runs[cell] = ablation.plan_runs(grid, flags)
    return runs


def run_missing(runs: dict[str, list[ablation.Run]], jobs: int) -> None:
    """Runs whose pi_SFT and ORM both exist (or are links to the same ones) share one pool; a cell that
    must build its own goes after, on its own."""
    groups: dict[tuple, list[ablation.Run]] = {}
    for cell_runs in runs.values():
        first = cell_runs[0].config
        caches = (sft_cache_path(first), orm_path(first))
        key = tuple(os.path.realpath(p) for p in caches) if all(os.path.isdir(p) for p in caches) else caches
        groups.setdefault(key, []).extend(cell_runs)
    for group in groups.values():
        ablation.run_grid(group, jobs)


def first_last_accuracy(rows: list[dict]) -> tuple[float, float]:
    acc = [r["reward/accuracy"] for r in rows]
    return float(np.mean(acc[:WINDOW])), float(np.mean(acc[-WINDOW:]))


def measure_pair(loaded: dict) -> dict:
    """pi_SFT's held-out pass@1 and, per run, the length ratio, the final held-out pass@1 and the curves."""
    out = {"sft_acc": loaded["ppo"]["summary"]["sft"]["pass@1"], "runs": {}}
    for name in RUNS:
        rows, summary = loaded[name]["metrics"], loaded[name]["summary"]
        curves = {key: [r[key] for r in rows] for key in ("response_length/mean", "reward/accuracy")}
        out["runs"][name] = {"length_ratio": length_ratio(curves["response_length/mean"]),
                             "final_acc": summary["ppo"]["pass@1"], "steps": len(rows), "curves": curves}
    return out


def measure(runs: dict[str, list[ablation.Run]]) -> dict:
    """Per cell and seed: measure_pair of its two runs, or "not finished" / "not started"."""
    out = {}
    for cell, cell_runs in runs.items():
        out[cell] = {"flags": CELLS[cell], "seeds": {}}
        for seed in sorted({r.seed for r in cell_runs}):
            pair = [r for r in cell_runs if r.seed == seed]
            if not all(r.done for r in pair):
                out[cell]["seeds"][seed] = "not finished" if any(r.dir.exists() for r in pair) else "not started"
                continue
            loaded = {r.variant: ablation.load(r) for r in pair}
            m = measure_pair(loaded)
            for name in RUNS:
                m["runs"][name]["train_acc_first_last"] = first_last_accuracy(loaded[name]["metrics"])
                m["runs"][name]["dir"] = str(next(r.dir for r in pair if r.variant == name))
            out[cell]["seeds"][seed] = m
    return out


def finished(seeds: dict) -> dict:
    return {seed: m for seed, m in seeds.items() if isinstance(m, dict)}


def collapsed(m: dict) -> bool:
    """The issue's criterion for plain PPO: length ratio <= 0.7 and held-out pass@1 below pi_SFT's."""
    ppo = m["runs"]["ppo"]
    return ppo["length_ratio"] <= 0.7 and ppo["final_acc"] < m["sft_acc"]


def held(m: dict) -> bool:
    """The issue's criterion for VC-PPO: length ratio >= 0.9 and held-out pass@1 at least pi_SFT's."""
    vc = m["runs"]["vc-ppo"]
    return vc["length_ratio"] >= 0.9 and vc["final_acc"] >= m["sft_acc"]


def over_seeds(cell: str, flags: str, ms: list[dict]) -> str:
    """The row of means (± sample std) over a cell's finished seeds."""
    def stat(values):
        mean, std = ablation.mean_std(values)
        return f"{mean:.3f} ± {std:.3f}"

    def run_cols(run):
        rs = [m["runs"][run] for m in ms]
        first, last = (np.mean([r["train_acc_first_last"][i] for r in rs]) for i in (0, 1))
        return (f"{stat([r['length_ratio'] for r in rs])} | {stat([r['final_acc'] for r in rs])} | "
                f"{first:.2f} -> {last:.2f}")

    cols = [run_cols(run) for run in RUNS]
    return (f"| {cell} | `{flags}` | **mean of {len(ms)}** | {ms[0]['runs']['ppo']['steps']} | "
            f"{stat([m['sft_acc'] for m in ms])} | "
            f"{cols[0]} | {cols[1]} | {sum(map(collapsed, ms))} of {len(ms)} | {sum(map(held, ms))} of {len(ms)} |")


def markdown(results: dict, train_flags: list[str]) -> str:
    """The table; `train_flags` (after `--`) follow each cell's own flags, so they are said: one of them
    can override what the flags column shows."""
    flags = " ".join(train_flags) or "none"
    lines = ["# Where does plain PPO collapse? The sweep on the long built-in task", "",
             f"Every run: `--preset tiny-long`, the cell's flags, then the flags after `--`: {flags}.", "",
             f"Length ratio: lowest {WINDOW}-step moving average of the batch-mean response length over the first "
             f"step's. pass@1: held-out, after PPO. Training accuracy: mean over the first and last {WINDOW} steps. "
             "Collapses: plain PPO's ratio <= 0.7 and its pass@1 below pi_SFT's. Holds: VC-PPO's ratio >= 0.9 and its "
             "pass@1 at least pi_SFT's.", "",
             "| cell | flags | seed | steps | pi_SFT pass@1 | ppo: length ratio | ppo: pass@1 | ppo: training acc | "
             "vc-ppo: length ratio | vc-ppo: pass@1 | vc-ppo: training acc | plain PPO collapses | VC-PPO holds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell, r in results.items():
        flags = " ".join(r["flags"])
        for seed, m in r["seeds"].items():
            if not isinstance(m, dict):
                lines.append(f"| {cell} | `{flags}` | {seed} | {m} | | | | | | | | | |")
                continue
            ppo, vc = m["runs"]["ppo"], m["runs"]["vc-ppo"]
            cols = [f"{x['length_ratio']:.3f} | {x['final_acc']:.3f} | "
                    f"{x['train_acc_first_last'][0]:.2f} -> {x['train_acc_first_last'][1]:.2f}" for x in (ppo, vc)]
            lines.append(f"| {cell} | `{flags}` | {seed} | {ppo['steps']} | {m['sft_acc']:.3f} | {cols[0]} | {cols[1]} | "
                         f"{'yes' if collapsed(m) else 'no'} | {'yes' if held(m) else 'no'} |")
        if len(done := finished(r["seeds"])) > 1:
            lines.append(over_seeds(cell, flags, list(done.values())))
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    """The curves of every finished cell-seed; False, and no figure (an earlier one removed: it would
    show runs the table no longer does), when none has finished."""
    done = [(cell, seed, m) for cell, r in results.items() for seed, m in finished(r["seeds"]).items()]
    if not done:
        path.unlink(missing_ok=True)
        return False
    keys = (("response_length/mean", "batch mean length"), ("reward/accuracy", "training accuracy"))
    fig, axes = plt.subplots(len(done), 2, figsize=(11, 3 * len(done)), squeeze=False)
    for row, (cell, seed, m) in zip(axes, done):
        for ax, (key, label) in zip(row, keys):
            for name in RUNS:
                ax.plot(m["runs"][name]["curves"][key], label=name)
            ax.set(xlabel="PPO step", ylabel=label, title=f"{cell}, seed {seed}")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args: Args, train_flags: list[str]) -> dict:
    runs = plan(args, train_flags)
    if not args.read_only:
        run_missing(runs, args.jobs)
    results = measure(runs)
    total = sum(len(r["seeds"]) for r in results.values())
    if not any(finished(r["seeds"]) for r in results.values()):  # a table of nothing would replace one of runs
        print(f"0 of {total} cell-seeds finished under {args.root} (and {args.out_dir}): nothing written, "
              f"{args.out} left as it is")
        return results
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text(markdown(results, train_flags))
    rundir.write_json(str(args.out / "sweep.json"), results)  # NaN as null
    drawn = plot(results, args.out / "sweep.png")
    print((args.out / "sweep.md").read_text())
    count = sum(len(finished(r["seeds"])) for r in results.values())
    print(f"{count} of {total} cell-seeds finished; "
          f"wrote {args.out}/sweep.md, .json{' and .png' if drawn else ' (no .png: nothing to draw)'}")
    return results


if __name__ == "__main__":
    from analysis import run_cli

    run_cli(main, Args, __doc__, with_train_flags=True)
