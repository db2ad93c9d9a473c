"""The collapse of paper Fig. 1 on the long built-in task: plain PPO against VC-PPO, one seed.

The paper (§3.1) sees plain PPO's response length fall sharply early in training, and accuracy
with it, while VC-PPO keeps both. This script runs the two with the same seed on the long task
(`train.py --preset tiny-long`: ~520-token responses, 26 GAE horizons at lambda 0.95, and a
limit that cuts pi_SFT's longest responses):

| run | train.py flags |
|---|---|
| ppo | `--critic-init rm --value-pretrain-steps 0 --lam-critic 0.95`: critic from the outcome RM |
| vc-ppo | train.py's defaults: value pretraining (§3.2), lambda 0.95 / 1.0 (§3.3) |

and prints, as its last line,

    collapse ppo_length_ratio=<x> vcppo_length_ratio=<y> ppo_final_acc=<a> vcppo_final_acc=<b> sft_acc=<c>

where a length ratio is the lowest 5-step moving average of the batch-mean response length over
the first step's batch mean (a collapse shows as a ratio well below 1), the accuracies are
held-out pass@1 after PPO, and sft_acc is pi_SFT's on the same problems. Before it comes Fig. 2
on the same setting (analysis/advantage_bias.py on fresh pi_SFT responses): the mean advantage at
lambda 0.95 over the first quarter of each response under the ORM critic and under this seed's
value-pretrained one, with the ORM's quality as a reward model beside it:

    fig2 orm_first_quarter=<m> (<z> SE) pretrained_first_quarter=<m> (<z> SE) orm_auc=<a> orm_sign_acc=<s> base_rate=<b>

The runs are the
ablation grid's `ppo` and `vc-ppo` cells (analysis/ablation.py runs, resumes and reads them), so
`ablation.py --out-dir runs/long -- --preset tiny-long` reuses them. Flags after `--` go to both
train.py runs, after the preset.

    python analysis/collapse.py --seed 0 --steps 100       # runs/long/ablation__{ppo,vc-ppo}__seed0
    python analysis/collapse.py --seed 1 --steps 100 --out results/collapse
"""
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from analysis import ablation, advantage_bias

RUNS = ("ppo", "vc-ppo")
# Runs finished before the metric took verl's name (issue 30) are read under the name they logged.
OLD_NAMES = {"response_length/clip_ratio": "response_length/truncated_frac"}
WINDOW = 5  # steps of the moving average in the length ratio
FIG2_LAMBDA = 0.95  # plain PPO's lambda, the paper's Fig. 2


@dataclass
class Args:
    seed: int = 0
    """seed of both runs (prompts, samples, mini-batch order; pi_SFT and the ORM are shared)"""
    steps: int = 100
    """PPO steps of each run"""
    out: Path = Path("runs/analysis")
    """folder that receives collapse_seed<seed>.png, .md and .json"""
    out_dir: str = "runs/long"
    """train.py's --out-dir for the two runs (its _shared/ holds the long task's pi_SFT and ORM)"""
    jobs: int = 2
    """train.py processes at once (each uses --threads torch threads)"""
    read_only: bool = False
    """only read finished runs; never start train.py"""
    fig2_rollouts: int = 128
    """pi_SFT responses that Fig. 2 reads (advantage_bias.py, written to <out>/fig2_seed<seed>/); 0: skip it"""


def length_ratio(lengths: list[float], window: int = WINDOW) -> float:
    """Lowest moving average (over `window` steps, fewer if the run is shorter) of the batch-mean
    response length, over the first step's batch mean."""
    if not lengths:
        raise ValueError("length_ratio: no PPO steps")
    w = min(window, len(lengths))
    moving = np.convolve(np.asarray(lengths, dtype=float), np.ones(w) / w, mode="valid")
    return float(moving.min() / lengths[0])


def measure(loaded: dict) -> dict:
    """The summary line's numbers, and the curves and first-step critic numbers behind them."""
    out = {"sft_acc": loaded["ppo"]["summary"]["sft"]["pass@1"], "runs": {}}
    for name in RUNS:
        rows, summary = loaded[name]["metrics"], loaded[name]["summary"]
        lengths = [r["response_length/mean"] for r in rows]
        out["runs"][name] = {
            "length_ratio": length_ratio(lengths), "final_acc": summary["ppo"]["pass@1"],
            "sft_acc": summary["sft"]["pass@1"], "final_mean_length": summary["ppo"]["mean_length"],
            "final_truncated": summary["ppo"].get("truncated"), "steps": len(rows), "wall_s": loaded[name]["wall_s"],
            # Fig. 2 on the first PPO batch: mean advantage (before whitening) over each quarter of the responses.
            "first_step_advantage_by_quarter": [rows[0].get(f"advantage/pos_bin{b}") for b in range(4)],
            "first_step_critic_ev": rows[0].get("critic/vf_explained_var"),
            "curves": {key: [r.get(key, r.get(OLD_NAMES.get(key))) for r in rows] for key in
                       ("response_length/mean", "response_length/clip_ratio", "reward/accuracy")},
        }
    return out


def fig2(args: Args, vc_ppo: ablation.Run) -> dict:
    """Fig. 2 on the runs' setting: the ORM and this seed's value-pretrained critic on fresh pi_SFT
    responses (advantage_bias.main with the VC-PPO run's own flags, which name and check its critic;
    it also judges the ORM as a reward model)."""
    bias_args = advantage_bias.Args(out=args.out / f"fig2_seed{args.seed}", rollouts=args.fig2_rollouts, seed=args.seed,
                                    lambdas=(FIG2_LAMBDA, 1.0))
    r = advantage_bias.main(bias_args, vc_ppo.flags)
    quarter = {name: dict(zip(("mean", "se"), fq[FIG2_LAMBDA])) for name, fq in r.first_quarter.items()}
    return {"first_quarter_advantage": quarter, "orm_quality": r.orm_quality.get("complete"),
            "rollouts": r.rollout, "dir": str(bias_args.out)}


def fig2_line(f: dict) -> str:
    def quarter(name):
        q = f["first_quarter_advantage"].get(name)
        if q is None:
            return "n/a"
        return f"{q['mean']:+.3f} ({q['mean'] / q['se'] if q['se'] else float('nan'):+.1f} SE)"

    q = f["orm_quality"] or {}
    return (f"fig2 orm_first_quarter={quarter('orm')} pretrained_first_quarter={quarter('pretrained')} "
            f"orm_auc={q.get('auc', float('nan')):.3f} orm_sign_acc={q.get('sign_accuracy', float('nan')):.3f} "
            f"base_rate={q.get('base_rate', float('nan')):.3f}")


def summary_line(m: dict) -> str:
    ppo, vc = m["runs"]["ppo"], m["runs"]["vc-ppo"]
    return (f"collapse ppo_length_ratio={ppo['length_ratio']:.3f} vcppo_length_ratio={vc['length_ratio']:.3f} "
            f"ppo_final_acc={ppo['final_acc']:.3f} vcppo_final_acc={vc['final_acc']:.3f} sft_acc={m['sft_acc']:.3f}")


def plot(m: dict, seed: int, path: Path) -> None:
    keys = (("response_length/mean", "mean response length (tokens)"),
            ("response_length/clip_ratio", "share truncated (scored -1)"), ("reward/accuracy", "training accuracy"))
    fig, axes = plt.subplots(1, len(keys), figsize=(15, 4))
    for ax, (key, label) in zip(axes, keys):
        for name in RUNS:
            ax.plot(m["runs"][name]["curves"][key], label=name)
        ax.set(xlabel="PPO step", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"Fig. 1 on the long built-in task, seed {seed}; held-out pass@1: pi_SFT {m['sft_acc']:.3f}, "
                 f"ppo {m['runs']['ppo']['final_acc']:.3f}, vc-ppo {m['runs']['vc-ppo']['final_acc']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(m: dict, seed: int, run_dirs: list[str]) -> str:
    def f(x, digits=3):
        return "-" if x is None else f"{x:+.{digits}f}"

    lines = [f"# Plain PPO against VC-PPO on the long built-in task, seed {seed} (paper Fig. 1)", "",
             f"Length ratio: lowest {WINDOW}-step moving average of the batch-mean response length over the first "
             f"step's. Accuracies: held-out pass@1 (pi_SFT: {m['sft_acc']:.3f}). First-step advantage: mean advantage "
             "(before whitening) over each quarter of the first batch's responses, early to late (Fig. 2).", "",
             "| run | steps | length ratio | first -> last batch length | final pass@1 | final mean length "
             "| first-step advantage by quarter | critic EV, step 0 | wall time |", "|---|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        r = m["runs"][name]
        lengths = r["curves"]["response_length/mean"]
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']:.0f} s"
        lines.append(f"| {name} | {r['steps']} | {r['length_ratio']:.3f} | {lengths[0]:.0f} -> {lengths[-1]:.0f} | "
                     f"{r['final_acc']:.3f} | {r['final_mean_length']:.0f} | "
                     f"{' / '.join(f(a) for a in r['first_step_advantage_by_quarter'])} | "
                     f"{f(r['first_step_critic_ev'], 2)} | {wall} |")
    if "fig2" in m:
        f = m["fig2"]
        lines += ["", f"Fig. 2 on the same setting ({f['rollouts']['responses']} fresh pi_SFT responses, mean length "
                  f"{f['rollouts']['mean_length']:.0f}, accuracy {f['rollouts']['accuracy']:.3f}; {f['dir']}): mean "
                  f"advantage at lambda {FIG2_LAMBDA} over the first quarter of each response (mean / SE over responses) "
                  "under the ORM critic and this seed's value-pretrained one, and the ORM as a reward model on the "
                  "complete responses (AUC, sign accuracy, and the base rate that always answering the majority "
                  "outcome gets):", "", fig2_line(f)]
    lines += ["", "Runs: " + ", ".join(run_dirs), "", summary_line(m), ""]
    return "\n".join(lines)


def main(args: Args, train_flags: list[str]) -> dict:
    grid = ablation.Args(out_dir=args.out_dir, variants=RUNS, seeds=(args.seed,), jobs=args.jobs,
                         read_only=args.read_only)
    runs = ablation.plan_runs(grid, ["--preset", "tiny-long", "--steps", str(args.steps), *train_flags])
    if not args.read_only:
        ablation.run_grid(runs, args.jobs, args.out_dir)
    missing = [str(r.dir / "train.log") for r in runs if not r.done]
    if missing:
        raise SystemExit(f"error: run(s) did not finish, see {', '.join(missing)}")
    m = measure({r.variant: ablation.load(r) for r in runs})
    if args.fig2_rollouts:
        m["fig2"] = fig2(args, next(r for r in runs if r.variant == "vc-ppo"))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"collapse_seed{args.seed}"
    plot(m, args.seed, stem.with_suffix(".png"))
    stem.with_suffix(".md").write_text(markdown(m, args.seed, [str(r.dir) for r in runs]))
    stem.with_suffix(".json").write_text(json.dumps(m, indent=1))
    print(stem.with_suffix(".md").read_text())
    print(f"wrote {stem}.png, .md and .json")
    if "fig2" in m:
        print(fig2_line(m["fig2"]))
    print(summary_line(m))
    return m


if __name__ == "__main__":
    from analysis import run_cli

    run_cli(main, Args, __doc__, with_train_flags=True)
