"""The ablation grid on the built-in task (paper Fig. 1 and Table 2).

Runs `train.py` once per (variant, seed), or reads the runs that already finished, then draws
response length and accuracy over PPO steps (mean and +-1 std over seeds) and tabulates the held-out
pass@1, pass@k and response length after PPO (mean +- std over seeds) beside the paper's AIME numbers.

| variant | what changes (train.py flags) |
|---|---|
| ppo | plain PPO: critic from the outcome reward model, no value pretraining, lambda 0.95 for both (*) |
| vc-ppo-no-vp | VC-PPO without value pretraining: critic from the ORM (as the paper's critic before §3.2) |
| vc-ppo-no-dgae | VC-PPO without decoupled GAE: lambda_critic = lambda_actor = 0.95 (*) |
| vc-ppo | VC-PPO, train.py's defaults: pi_SFT + fresh head, value pretraining, lambda 0.95 / 1.0 |
| grpo | group-normalised outcome advantage, no critic |
| lam-actor-0.9, -0.99, -1.0 | VC-PPO with that lambda_actor (0.95 is vc-ppo itself) |
| length-adaptive | VC-PPO with VAPO's lambda_actor = 1 - 1/(0.05 l) per response |

(*) The variants set lambda_critic only; lambda_actor is the preset's: 0.95 on the built-in task
(`tiny`), which is what the paper's numbers beside these rows used, and 0.99 with a qwen2.5 preset
(where vc-ppo is then lambda 0.99 / 1.0, and lam-actor-0.99 the same run).

Runs go to <out-dir>/ablation__<variant>__seed<seed>/, each with its log in train.log. pi_SFT,
the ORM and the value-pretrained critic are shared through <out-dir>/_shared, like every train.py
run's: the variants of one seed that pretrain the critic (all but ppo, vc-ppo-no-vp and grpo)
pretrain it once. A run with a summary.json is read, not rerun, and one that stopped is resumed
from its checkpoint. Flags after `--` go to every train.py run.

    python analysis/ablation.py                  # the full grid: 9 variants x 3 seeds (see RESULTS.md for its time)
    python analysis/ablation.py --quick          # plain PPO vs VC-PPO x 2 seeds, 10 steps: <= 10 min on 2 cores
    python analysis/ablation.py --variants ppo vc-ppo --seeds 0 -- --steps 10
"""
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from support import preemption, rundir
from analysis import run_cli
from support.config import Config, check_settings, core_share, parse_config
from critic import orm_path
from support.sft import prepare_sft, sft_cache_path

TRAIN = Path(__file__).resolve().parents[1] / "train.py"
CACHE_POLL_S = 10  # how often run_grid looks for the shared stages the waiting runs read

VARIANTS = {  # name -> (train.py flags, AIME 2024 pass@1 the paper reports at 8k context)
    "ppo": (["--critic-init", "rm", "--value-pretrain-steps", "0", "--lam-critic", "0.95"], 5.6),
    "vc-ppo-no-vp": (["--critic-init", "rm", "--value-pretrain-steps", "0"], None),
    "vc-ppo-no-dgae": (["--lam-critic", "0.95"], 29.4),
    "vc-ppo": ([], 41.3),
    "grpo": (["--estimator", "grpo"], 35.8),
    "lam-actor-0.9": (["--lam-actor", "0.9"], 34.3),
    "lam-actor-0.99": (["--lam-actor", "0.99"], 41.9),
    "lam-actor-1.0": (["--lam-actor", "1.0"], 29.4),
    "length-adaptive": (["--length-adaptive-alpha", "0.05"], None),
}
MAIN = ("ppo", "vc-ppo-no-vp", "vc-ppo-no-dgae", "vc-ppo", "grpo")  # first row of the figure
SWEEP = ("lam-actor-0.9", "vc-ppo", "lam-actor-0.99", "lam-actor-1.0", "length-adaptive")  # second row
QUICK = {  # --quick: the paper's main contrast only, short runs and a smaller ORM, in their own out-dir
    "variants": ("ppo", "vc-ppo"), "seeds": (0, 1), "out_dir": "runs/ablation-quick",
    "train_flags": ["--steps", "10", "--value-pretrain-steps", "5", "--orm-batches", "2", "--orm-steps", "20",
                    "--task-eval-size", "32"],
}
CURVES = (("response_length/mean", "mean response length (tokens)"), ("reward/accuracy", "training accuracy"))


@dataclass
class Args:
    out: Path = Path("runs/analysis")
    """folder that receives ablation.png, ablation.md and ablation.json"""
    out_dir: str = "runs"
    """train.py's --out-dir for the grid's runs (its _shared/ pi_SFT and ORM are reused)"""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """variants to run or read (see the table above)"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """seeds of every variant"""
    jobs: int = 2
    """train.py processes at once (each gets an equal share of the cores unless --threads is given)"""
    quick: bool = False
    """a <= 10 minute version: ppo and vc-ppo x 2 seeds, 10 PPO steps, a smaller ORM, in runs/ablation-quick
    (--variants, --seeds and --out-dir given beside it are kept)"""
    read_only: bool = False
    """only read finished runs; never start train.py"""


@dataclass
class Run:
    variant: str
    seed: int
    flags: list[str]  # train.py's argv
    config: Config  # what train.py makes of those flags

    @property
    def dir(self) -> Path:
        return Path(self.config.out_dir, self.config.run_name)

    @property
    def done(self) -> bool:
        return rundir.finished(self.dir)


def plan_runs(args: Args, train_flags: list[str]) -> list[Run]:
    """One Run per (variant, seed); a finished run whose config differs from the requested one is an error."""
    check_nonempty(variants=args.variants, seeds=args.seeds)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    runs = []
    for variant in args.variants:
        for seed in args.seeds:
            name = f"ablation__{variant}__seed{seed}"
            # The variant's own flags come last, so flags for every run cannot undo what the variant tests.
            flags = ["--out-dir", args.out_dir, "--run-name", name, "--seed", str(seed), *train_flags,
                     *VARIANTS[variant][0]]
            runs.append(planned_run(variant, seed, flags))
    return runs


def check_nonempty(**choices) -> None:
    """A flag given with no value (`--seeds` alone) plans no run: say so, rather than report on nothing."""
    empty = [name for name, chosen in choices.items() if not chosen]
    if empty:
        raise ValueError(f"--{empty[0]} is empty: give at least one")


def check_jobs(jobs: int) -> None:
    """--jobs, checked by each grid before anything trains (a missing pi_SFT takes minutes)."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")


def planned_run(variant: str, seed: int, flags: list[str]) -> Run:
    """The Run of train.py's `flags`; a run directory already there must hold a run of those
    settings: reused as finished, its length must match too (the rest of how it ran need not). Every
    report reads the PPO steps, so a run of none (train.py takes --steps 0) is refused before it trains."""
    run = Run(variant, seed, flags, parse_config(flags))
    if run.config.steps < 1:
        raise ValueError(f"--steps must be >= 1 (a run of no PPO step has no curve to read), got {run.config.steps}")
    saved = run.dir / "config.json"
    if saved.is_file():
        check_settings(str(run.dir), json.loads(saved.read_text()), dataclasses.asdict(run.config),
                       ignore=[k for k in rundir.MAY_CHANGE if k != "steps"], remedy="remove it or choose another --out-dir")
    return run


class Children:
    """The train.py processes a grid has under way. A signal to the grid alone (a scheduler's
    SIGTERM; Ctrl-C reaches them too) is passed on to each, and no run starts after it."""

    def __init__(self):
        self.lock, self.running, self.stopped_by = threading.Lock(), set(), None

    def start(self, argv: list[str], **popen_kwargs) -> subprocess.Popen | None:
        with self.lock:
            if self.stopped_by is not None:
                return None
            child = subprocess.Popen(argv, **popen_kwargs)
            self.running.add(child)
            return child

    def stop(self, signum: int) -> None:
        with self.lock:
            self.stopped_by = signum
            for child in self.running:  # a repeat of the same signal within seconds: train.py takes it once
                child.send_signal(signum)


def execute(run: Run, threads: int, children: Children) -> tuple[Run, float, int]:
    """train.py in a child process (log in <run>/train.log) with `threads` torch threads unless its
    flags set them; --resume continues a stopped run. Returns the child's exit code (-1: not
    started, the grid was stopped)."""
    run.dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    share = ["--threads", str(threads)] if run.config.threads is None else []
    with open(run.dir / "train.log", "a") as log:
        child = children.start(
            [sys.executable, str(TRAIN), *run.flags, *share, "--resume"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TQDM_MININTERVAL": "30"})
        if child is None:
            return run, 0.0, -1
        code = child.wait()
    wall = time.time() - start
    record = run.dir / "ablation_run.json"
    before = json.loads(record.read_text()).get("wall_s", 0.0) if record.is_file() else 0.0  # a resumed run's earlier part
    record.write_text(json.dumps({"variant": run.variant, "seed": run.seed, "argv": run.flags,
                                  "wall_s": round(before + wall, 1), "returncode": code}))
    return run, wall, code


def run_grid(runs: list[Run], jobs: int) -> tuple[float, list[Run]]:
    """Runs what is missing, `jobs` at a time; returns the wall time and the runs that failed. A
    missing shared pi_SFT is trained first, here, on every core (every run reads it: they could only
    wait); each missing ORM (MSE, Bradley-Terry) is built by the first run that reads it, and the
    other runs that read it start once it is built, or once its builder has stopped."""
    check_jobs(jobs)  # before a missing pi_SFT trains for minutes
    todo = [r for r in runs if not r.done]
    failed, start = [], time.time()
    if not todo:
        return 0.0, failed
    with preemption.handled(lambda: "pi_SFT was not finished; the same command trains it again"):
        build_missing_sft([r.config for r in todo])
    orm_of = {id(r): Path(orm_path(r.config)) for r in todo if r.config.critic_init == "rm" and r.config.estimator == "gae"}
    todo.sort(key=lambda r: id(r) not in orm_of)  # ORM builders first
    orm_builders = {}  # ORM path -> the run that builds it
    for r in todo:
        if id(r) in orm_of and not orm_of[id(r)].is_dir():
            orm_builders.setdefault(orm_of[id(r)], r)
    futures = {}  # id(run) -> its future
    stopped = lambda run: id(run) in futures and futures[id(run)].done()  # noqa: E731

    def ready(run: Run) -> bool:  # build_once renames a finished stage into place, so a directory is whole
        orm = orm_of.get(id(run))
        return orm is None or orm.is_dir() or orm_builders[orm] is run or stopped(orm_builders[orm])

    threads = core_share(jobs)  # the runs side by side share the cores
    bar = tqdm(total=len(todo), desc="ablation runs", dynamic_ncols=True)
    children = Children()
    with preemption.handled(lambda: "The runs under way save a checkpoint and stop, and no other starts; "
                                    "the same command goes on from there"), \
            ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            waiting = todo
            while waiting:
                ready_now = [r for r in waiting if ready(r)]  # queued in order: a builder first
                futures |= {id(r): pool.submit(execute, r, threads, children) for r in ready_now}
                waiting = [r for r in waiting if r not in ready_now]
                if waiting:
                    time.sleep(CACHE_POLL_S)
            for future in as_completed(futures.values()):
                run, wall, code = future.result()
                failed.extend([run] if code else [])
                bar.update()
                tqdm.write(f"{run.dir.name}: {'done' if code == 0 else f'FAILED (exit {code})'} in {wall:.0f} s")
        except preemption.Preempted as signalled:
            children.stop(signalled.signum)
            pool.shutdown(cancel_futures=True)  # waits for the runs under way to save
            raise
        finally:
            bar.close()
    return time.time() - start, failed


def build_missing_sft(configs: list[Config]) -> None:
    """Train each built-in-task pi_SFT these runs read and that is not cached yet (train.py's own
    stage, `prepare_sft`), in this process on every usable core."""
    missing = {sft_cache_path(c): c for c in configs if c.model is None and not Path(sft_cache_path(c)).is_dir()}
    before, threads = torch.get_num_threads(), core_share(1)
    torch.set_num_threads(threads)
    try:
        for path, cfg in missing.items():
            tqdm.write(f"training the shared pi_SFT ({path}) before the runs, on {threads} threads")
            prepare_sft(cfg)
    finally:
        torch.set_num_threads(before)


def load(run: Run) -> dict:
    """A finished run's summary, metrics rows and wall time. The grids read a curve's step from its
    row's place, so rows that are not steps 0, 1, ... (a resumed run told of a gap goes on past it)
    are refused rather than drawn at the wrong steps, as is a row whose curves hold no number."""
    path, remedy = run.dir / "metrics.jsonl", "rerun it to read it"
    lines, torn = rundir.logged_rows(str(path))  # a damaged line is named
    rows = [json.loads(text) for _, text in lines]
    if torn is not None or not rows:
        raise ValueError(f"{path}: {'its last line is cut short' if torn else 'no rows'}; {remedy}")
    if (steps := [r["step"] for r in rows]) != list(range(len(rows))):
        missing = sorted(set(range(max(steps))) - set(steps))
        raise ValueError(f"{path}: its rows are not steps 0 to {len(rows) - 1} in order "
                         f"(missing: {missing[:10] or 'none'}); {remedy}")
    for row in rows:
        for key, _ in CURVES:
            if not isinstance(value := row.get(key), (int, float)) or not math.isfinite(value):
                raise ValueError(f"{path}: step {row['step']} has {key} {value!r}, not a number; {remedy}")
    summary = rundir.read_json(str(run.dir / "summary.json"), remedy)
    if not all(isinstance(summary.get(stage), dict) for stage in ("sft", "ppo")):
        raise ValueError(f"{run.dir / 'summary.json'}: no held-out evaluation of pi_SFT and PPO in it; {remedy}")
    timing = run.dir / "ablation_run.json"
    return {"seed": run.seed, "summary": summary, "metrics": rows,
            "wall_s": rundir.read_json(str(timing), remedy)["wall_s"] if timing.is_file() else None}


def mean_std(values: list) -> tuple[float, float]:
    """Mean and sample std over seeds of what each has (None or NaN: undefined there, e.g. the explained
    variance of equal returns); NaN where none has it, std NaN where only one has."""
    v = np.array([np.nan if x is None else x for x in values], dtype=float)
    if np.isnan(v).all():
        return float("nan"), float("nan")
    return float(np.nanmean(v)), float(np.nanstd(v, ddof=1)) if np.sum(~np.isnan(v)) > 1 else float("nan")


def evaluation_row(evals: list[dict], paper: float | None) -> dict:
    """Mean and std over seeds of one stage's held-out evaluation (evaluate.evaluate's dicts)."""
    k = next((key for key in evals[0] if key.startswith("pass@") and key != "pass@1"), None)  # none: 1 sample
    pass_at_k = mean_std([e[k] for e in evals]) if k else (float("nan"), float("nan"))
    return {"seeds": len(evals), "pass@1": mean_std([e["pass@1"] for e in evals]),
            "pass@k": (k or "pass@k", *pass_at_k), "mean_length": mean_std([e["mean_length"] for e in evals]),
            "paper": paper}


def aggregate(results: dict[str, list[dict]]) -> dict:
    """Per variant: final-evaluation mean and std over seeds, and the curves stacked over seeds."""
    table, curves = {}, {}
    sft = {s["seed"]: s["summary"]["sft"] for seeds in results.values() for s in seeds}  # same policy, per seed
    table["pi_SFT"] = {**evaluation_row(list(sft.values()), None), "min_train_length": (float("nan"),) * 2,
                       "first_ev": (float("nan"),) * 2}
    for variant, seeds in results.items():
        lowest = [min(r["response_length/mean"] for r in s["metrics"]) for s in seeds]
        # How well the critic starts (§3.1-3.2): its explained variance of the first batch's Monte-Carlo
        # return, not of its own targets (at lambda_critic < 1 built from V itself: not comparable).
        first_ev = [s["metrics"][0].get("critic/value_error/explained_var", float("nan")) for s in seeds]
        table[variant] = {**evaluation_row([s["summary"]["ppo"] for s in seeds], VARIANTS[variant][1]),
                          "min_train_length": mean_std(lowest),
                          "first_ev": mean_std(first_ev) if "grpo" not in VARIANTS[variant][0] else (float("nan"),) * 2}
        steps = min(len(s["metrics"]) for s in seeds)
        curves[variant] = {key: np.array([[r[key] for r in s["metrics"][:steps]] for s in seeds], dtype=float)
                           for key, _ in CURVES}  # dtype=float: a null (undefined) metric reads as NaN
    return {"table": table, "curves": curves}


def figure_rows(variants) -> list[list[str]]:
    """The figure's rows: the main ablation, then the lambda sweep if it has a variant the first row lacks
    (vc-ppo belongs to both)."""
    main, sweep = [v for v in MAIN if v in variants], [v for v in SWEEP if v in variants]
    return [row for row in (main, sweep if set(sweep) - set(main) else []) if row]


def task_name(config: Config) -> str:
    problems = "" if config.task_difficulty is None else ", k {}-{}".format(*config.task_difficulty)
    return f"the built-in task ({config.task_length}{problems}, max_new_tokens {config.max_new_tokens})"


def plot(curves: dict, path: Path, task: str) -> None:
    rows = figure_rows(curves)
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.8 * len(rows)), squeeze=False)
    for ax_row, variants in zip(axes, rows):
        for ax, (key, label) in zip(ax_row, CURVES):
            for variant in variants:
                y = curves[variant][key]
                x, mean = np.arange(y.shape[1]), y.mean(0)
                (line,) = ax.plot(x, mean, label=f"{variant} (n={len(y)})")
                if len(y) > 1:  # in the line's colour: bands draw from a colour cycle of their own
                    std = y.std(0, ddof=1)
                    ax.fill_between(x, mean - std, mean + std, alpha=0.15, color=line.get_color())
            ax.set_xlabel("PPO step")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        ax_row[0].legend(fontsize=8)
    fig.suptitle(f"Fig. 1 on {task}: mean over seeds, band = +-1 std")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(agg: dict, wall: float, ran: int, runs: list[Run], loaded: dict, task: str) -> str:
    def pm(mean_and_std, digits=3):
        mean, std = mean_and_std
        if not np.isfinite(mean):
            return "-"
        return f"{mean:.{digits}f} ± {std:.{digits}f}" if np.isfinite(std) else f"{mean:.{digits}f}"

    k = agg["table"]["pi_SFT"]["pass@k"][0]
    lines = [f"# Ablation on {task} (paper Table 2, Fig. 1)", "",
             f"Held-out evaluation after PPO, mean ± std over seeds (sample std). pass@1 and {k} from "
             f"the same samples; 'min train length' is the lowest batch-mean response length over the PPO "
             f"steps (a length collapse shows here, though with no trend the lowest of a run's batch means "
             f"sits below their level: about 2 of their standard deviations at 30 steps); 'critic EV' is the "
             f"critic's explained variance of the "
             f"Monte-Carlo return G_t on the first PPO batch (how well V follows G_t from prefix to prefix; blind "
             f"to a constant offset, which metrics.jsonl's critic/value_error/all gives; '-' for runs made before "
             f"it was logged); the paper's column is AIME 2024 pass@1 "
             f"(%) at 8k context.", "",
             f"| variant | seeds | pass@1 | {k} | mean length | min train length | critic EV of G_t, step 0 | paper pass@1 |",
             "|---|---|---|---|---|---|---|---|"]
    for variant, row in agg["table"].items():
        paper = "-" if row["paper"] is None else f"{row['paper']}"
        lines.append(f"| {variant} | {row['seeds']} | {pm(row['pass@1'])} | {pm(row['pass@k'][1:])} | "
                     f"{pm(row['mean_length'], 1)} | {pm(row['min_train_length'], 1)} | {pm(row['first_ev'], 2)} | {paper} |")
    walls = [s["wall_s"] for seeds in loaded.values() for s in seeds if s["wall_s"] is not None]
    lines += ["", "pi_SFT: the policy every run starts from, evaluated once per seed (each seed samples differently)."]
    if 29.4 in [row["paper"] for row in agg["table"].values()]:
        lines.append("The paper gives 29.4 both without decoupled GAE and at lambda_actor 1.0 (lambda_critic 1.0): "
                     "perhaps one run, both lambdas at 1.0. vc-ppo-no-dgae here sets both to 0.95, so the paper's "
                     "value beside it is the less certain one.")
    seeds = {variant: sorted(s["seed"] for s in runs_of) for variant, runs_of in loaded.items()}
    if len({tuple(v) for v in seeds.values()}) > 1:  # a grid read before all its runs finished
        lines.append("Seeds differ between rows, each row's mean is over its own: "
                     + "; ".join(f"{v} {', '.join(map(str, s))}" for v, s in seeds.items()) + ".")
    lines.append("")
    if walls:
        lines.append(f"Time per run (train.py, measured when it ran): median {np.median(walls):.0f} s, "
                     f"range {min(walls):.0f}-{max(walls):.0f} s over {len(walls)} runs.")
    if ran:
        lines.append(f"This invocation ran {ran} of the {len(runs)} runs in {wall:.0f} s of wall time.")
    lines += ["", "Runs: " + ", ".join(sorted({str(r.dir.parent) for r in runs})) + "/ablation__<variant>__seed<seed>/", ""]
    return "\n".join(lines)


def main(args: Args, train_flags: list[str]) -> dict:
    if args.quick:  # its settings replace the defaults only: a flag given beside --quick is kept
        default = Args()
        args = dataclasses.replace(args, **{k: QUICK[k] for k in ("variants", "seeds", "out_dir")
                                            if getattr(args, k) == getattr(default, k)})
        train_flags = [*QUICK["train_flags"], *train_flags]
    runs = plan_runs(args, train_flags)
    ran, wall, failed = 0, 0.0, []
    if not args.read_only:
        ran = sum(not r.done for r in runs)
        wall, failed = run_grid(runs, args.jobs)
    missing = [r for r in runs if not r.done]
    if len(missing) == len(runs):
        raise ValueError(f"no finished run to read under {args.out_dir}/ (see each run's train.log)")
    loaded = {}
    for r in runs:
        if r.done:
            loaded.setdefault(r.variant, []).append(load(r))
    agg = aggregate(loaded)
    args.out.mkdir(parents=True, exist_ok=True)
    png, md, js = args.out / "ablation.png", args.out / "ablation.md", args.out / "ablation.json"
    task = task_name(runs[0].config)  # plan_runs gives every run the same settings but the variant's
    plot(agg["curves"], png, task)
    md.write_text(markdown(agg, wall, ran, runs, loaded, task))
    rundir.write_json(str(js), {"table": agg["table"], "curves": {v: {k: c.tolist() for k, c in cs.items()}
                                                                  for v, cs in agg["curves"].items()}})  # NaN as null
    print(md.read_text())
    for r in missing:
        why = ("failed, see " + str(r.dir / "train.log") if r in failed
               else "unfinished: a checkpoint, no summary.json" if (r.dir / "checkpoint").is_dir() else "not run")
        print(f"missing: {r.dir} ({why})")
    print(f"wrote {png}, {md} and {js}")
    return agg


if __name__ == "__main__":
    run_cli(main, Args, __doc__, with_train_flags=True)
