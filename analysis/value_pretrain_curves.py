"""Value pretraining curves: value loss and explained variance per step (paper §3.2).

The paper watches both while the critic is regressed on lambda = 1 targets of the frozen pi_SFT: a
fast "range alignment" phase, then slower "knowledge injection"; it stops near 100 steps. This
script reads `<run>/value_pretrain/curve.jsonl` (written by value_pretrain.pretrain_value) from
one or more runs and draws both against the step, with a first/last/best table.

    python analysis/value_pretrain_curves.py                    # every run under runs/ with a curve
    python analysis/value_pretrain_curves.py --runs runs/a runs/b --out /tmp/curves
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from analysis import run_cli

CURVE = Path("value_pretrain", "curve.jsonl")
KEYS = ("step", "value_loss", "explained_variance")


@dataclass
class Args:
    out: Path = Path("runs/analysis")
    """folder that receives value_pretrain_curves.png and value_pretrain_curves.md"""
    runs: tuple[Path, ...] = ()
    """run directories, each holding value_pretrain/curve.jsonl; none: every such run under --root"""
    root: Path = Path("runs")
    """where to look for runs when --runs is not given (train.py's --out-dir)"""
    log_loss: bool = True
    """log scale for the value-loss axis"""


@dataclass
class Curve:
    label: str  # the run directory's name
    path: Path
    step: np.ndarray  # [N] int
    value_loss: np.ndarray  # [N] float
    explained_variance: np.ndarray  # [N] float; NaN where the returns were constant


def read_curve(run: Path) -> Curve:
    """One run's curve; a clear ValueError (file:line) for a missing file or a bad row."""
    path = run / CURVE
    if not path.is_file():
        raise ValueError(f"{run}: no value pretraining curve at {path} (run train.py with --value-pretrain-steps > 0)")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append([math.nan if row[k] is None else float(row[k]) for k in KEYS])  # null: undefined
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{lineno}: not a curve row with {', '.join(KEYS)} ({err})") from None
    if not rows:
        raise ValueError(f"{path}: empty curve")
    data = np.array(rows)
    return Curve(run.name, path, data[:, 0].astype(int), data[:, 1], data[:, 2])


def find_runs(root: Path) -> list[Path]:
    """Every run under `root`, at any depth; runs that share one value-pretraining stage (their
    `value_pretrain` links to one cached critic) count once, under the first run's name."""
    shared = {}
    for curve in sorted(root.rglob(CURVE.as_posix())):
        shared.setdefault(curve.resolve(), curve.parents[1])
    runs = sorted(shared.values())
    if not runs:
        raise ValueError(f"no run under {root} has {CURVE}; pass --runs or run train.py first")
    return runs


def extreme(x: np.ndarray, steps: np.ndarray, best) -> tuple[float, int | None]:
    """(best value, its step) ignoring NaN; (NaN, None) when every value is NaN."""
    if np.isnan(x).all():
        return math.nan, None
    i = int(best(x))
    return float(x[i]), int(steps[i])


def plot(curves: list[Curve], path: Path, log_loss: bool) -> None:
    fig, (loss_ax, ev_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for c in curves:
        loss_ax.plot(c.step, c.value_loss, marker="o", ms=2.5, label=c.label)
        ev_ax.plot(c.step, c.explained_variance, marker="o", ms=2.5, label=c.label)
    if log_loss and all((c.value_loss > 0).all() for c in curves):
        loss_ax.set_yscale("log")
    loss_ax.set(xlabel="value pretraining step", ylabel="value loss", title="value loss")
    ev_ax.set(xlabel="value pretraining step", ylabel="explained variance", title="explained variance (1 = perfect)")
    ev_ax.axhline(0, color="grey", lw=0.8)
    for ax in (loss_ax, ev_ax):
        ax.legend(fontsize=7)
    fig.suptitle("Value pretraining against the frozen pi_SFT (paper §3.2)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(curves: list[Curve]) -> str:
    rows = []
    for c in curves:
        lo, lo_step = extreme(c.value_loss, c.step, np.nanargmin)
        hi, hi_step = extreme(c.explained_variance, c.step, np.nanargmax)
        rows.append(f"| {c.label} | {len(c.step)} | {c.value_loss[0]:.4g} | {c.value_loss[-1]:.4g} | {lo:.4g} ({lo_step}) "
                    f"| {c.explained_variance[0]:.3f} | {c.explained_variance[-1]:.3f} | {hi:.3f} ({hi_step}) |")
    return "\n".join([
        "# Value pretraining curves (paper §3.2)", "",
        "Value loss and explained variance of the critic against the frozen pi_SFT, per pretraining step "
        "(`value_pretrain/curve.jsonl`). Explained variance is measured on each step's fresh rollouts before "
        "the update (NaN where all returns were equal); the value loss is the mean of the loss over that "
        "step's optimizer updates (`critic/vf_loss`), so it moves during the step. Each step's batch is "
        "fresh, and its loss follows how mixed that batch's outcomes are: the minimum loss and the maximum "
        "explained variance mark the luckiest batch as much as the best critic.", "",
        "| run | steps | loss first | loss last | loss min (step) | EV first | EV last | EV max (step) |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        *[f"- {c.label}: {c.path}" for c in curves], "",
    ])


def main(args: Args) -> list[Curve]:
    runs = list(args.runs) or find_runs(args.root)
    curves = [read_curve(run) for run in tqdm(runs, desc="curves", leave=False)]
    if len({c.label for c in curves}) < len(curves):  # same name under two roots: label by path
        for c in curves:
            c.label = str(c.path.parents[1])
    args.out.mkdir(parents=True, exist_ok=True)
    png, md = args.out / "value_pretrain_curves.png", args.out / "value_pretrain_curves.md"
    plot(curves, png, args.log_loss)
    md.write_text(markdown(curves))
    print(md.read_text())
    print(f"wrote {png} and {md}")
    return curves


if __name__ == "__main__":
    run_cli(main, Args, __doc__)
