"""Fig. 1 by intervention (paper §3.1): set the critic's initial error by hand, and watch the
collapse follow its sign.

The paper's causal story: a critic that scores prefixes too low gives early tokens a positive
advantage bias, and with lambda < 1 the terminal reward reaches them too weakly (reward signal
decay) to correct it, so the policy learns to stop early: length and accuracy fall. This script
tests that story on the built-in task by setting the critic's initial error with
`train.py --critic-init-offset C` (added to a fresh value head's bias: every V(s_t) starts at C
plus the fresh head's own few tenths, hence the measured initial error below, while pi_SFT's
returns average about -0.6 and never go below -1), everything else the paper's.
It tests the sign, not the paper's route: a constant offset cancels in every TD error but the last,
so its bias reaches the tokens by lambda^(L-1-t) from the last one (r - V(s_{L-1})), largest at the
end of the response, not accumulated on early tokens as the paper's reward-model critic does.

| arm | train.py flags (after those for every run) |
|---|---|
| ppo | plain PPO: `--critic-init sft --value-pretrain-steps 0 --lam-critic 0.95 --critic-init-offset C` |
| ppo-offset<c> | the same at each offset of the dose-response, -3 -2 -1 0 +1 (`dose` selects them all) |
| decoupled-gae | ppo with `--lam-critic 1.0`: §3.3 alone |
| value-pretrain | ppo with value pretraining (train.py's 20 steps, from the offset critic): §3.2 alone |
| vc-ppo | both (train.py's defaults), from the offset critic |
| ppo-orm | plain PPO from the MSE outcome reward model (`--critic-init rm`), this task's own bias |
| ppo-bt | plain PPO from a Bradley-Terry reward model (`--orm-loss bradley-terry`) |
| grpo | no critic (`--estimator grpo`): the reference |

For each run it reads metrics.jsonl and summary.json and reports: the measured initial error
(the mean of V(s_t) - G_t over the first batch's response tokens, `critic/value_error/all`); the
length ratio (lowest 5-step moving average of the batch-mean length over the first step's); the
accuracy ratio (lowest 5-step moving average of training accuracy over pi_SFT's held-out pass@1;
both also over the same seed's GRPO run's lowest, which cancels the first batch's draw);
the recovery (steps from the trough of that moving average back to 0.9 of the first step's
length); Fig. 2 from the same runs (each critic's mean advantage over each quarter of the token
positions up to --max-new-tokens in the first batch, before whitening); and held-out pass@1 after
PPO. With several seeds, mean ± std. Fig. 2 is also drawn by analysis/advantage_bias.py, by token position, for the critics the
arms start from (the offset critic, the MSE ORM, the Bradley-Terry RM and the vc-ppo run's
value-pretrained critic, on 128 fresh pi_SFT responses of the first seed; advantage_bias.* in
--out), once the vc-ppo run has finished. It writes collapse.png (length, training accuracy and the
critic's error by step, the dose-response, both Fig. 2s), collapse.md and collapse.json to --out,
and prints as its last line

    collapse offset=<C> ppo_length_ratio=<x> vcppo_length_ratio=<y> ppo_acc_ratio=<p> vcppo_acc_ratio=<q> ppo_final_acc=<a> vcppo_final_acc=<b> sft_acc=<c>

(means over the seeds). pi_SFT and the reward models are shared (<out-dir>/_shared); a finished run
is read, not rerun, and a stopped one resumes. Flags after `--` go to every train.py run.

    python analysis/collapse.py                                   # all arms, seed 0, the tiny preset
    python analysis/collapse.py --seeds 0 1 2 --out results/collapse
    python analysis/collapse.py --arms ppo vc-ppo --offset -3
    python analysis/collapse.py --arms ppo decoupled-gae --out-dir runs/collapse-long --out runs/analysis/collapse-long -- --preset tiny-long   # reward signal decay
"""
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from analysis import ablation, advantage_bias, run_cli
from support import rundir

OFFSETS = (-3.0, -2.0, -1.0, 0.0, 1.0)  # the dose-response
WINDOW = 5  # steps of the moving averages
RECOVERED = 0.9  # share of the first step's length that counts as recovered
CALIBRATED = 0.2  # |mean V(s_t) - G_t| at or below which the critic counts as calibrated
PLAIN = ["--critic-init", "sft", "--value-pretrain-steps", "0", "--lam-critic", "0.95"]
ARMS = ("ppo", "decoupled-gae", "value-pretrain", "vc-ppo", "grpo", "ppo-orm", "ppo-bt", "dose")
FAMILY = ("ppo", "decoupled-gae", "value-pretrain", "vc-ppo", "grpo")  # the first two panels
FIG2 = ("ppo", "ppo-orm", "ppo-bt", "vc-ppo")  # critics whose step-0 advantages the fourth panel draws


@dataclass
class Args:
    offset: float = -2.0
    """critic's initial offset of the ppo, decoupled-gae, value-pretrain and vc-ppo arms"""
    arms: tuple[str, ...] = ARMS
    """arms to run or read (see the table above; `dose` = ppo at every offset of -3 -2 -1 0 +1)"""
    seeds: tuple[int, ...] = (0,)
    """seeds of every arm"""
    steps: int = 30
    """PPO steps of each run"""
    out: Path = Path("runs/analysis/collapse")
    """folder that receives collapse.png, collapse.md and collapse.json"""
    out_dir: str = "runs/collapse"
    """train.py's --out-dir for the runs (its _shared/ holds pi_SFT and the reward models)"""
    jobs: int = 2
    """train.py processes at once (each gets an equal share of the cores unless --threads is given after --)"""
    read_only: bool = False
    """only read finished runs, never start train.py; an arm reports the seeds that finished"""


def offset_name(offset: float) -> str:
    return f"ppo-offset{offset:+g}"


def arm_flags(offset: float) -> dict[str, tuple[list[str], float | None]]:
    """Arm -> (its train.py flags, the critic offset it starts from; None: no offset set)."""
    at = lambda c: ["--critic-init-offset", str(c)]  # noqa: E731
    arms = {
        "ppo": ([*PLAIN, *at(offset)], offset),
        "decoupled-gae": ([*PLAIN, *at(offset), "--lam-critic", "1.0"], offset),
        "value-pretrain": (["--critic-init", "sft", "--lam-critic", "0.95", *at(offset)], offset),
        "vc-ppo": (["--critic-init", "sft", "--lam-critic", "1.0", *at(offset)], offset),
        "grpo": (["--estimator", "grpo"], None),
        "ppo-orm": (["--critic-init", "rm", "--value-pretrain-steps", "0", "--lam-critic", "0.95"], None),
        "ppo-bt": (["--critic-init", "rm", "--value-pretrain-steps", "0", "--lam-critic", "0.95",
                    "--orm-loss", "bradley-terry"], None),
    }
    return arms | {offset_name(c): ([*PLAIN, *at(c)], c) for c in OFFSETS if c != offset}


def chosen_arms(args: Args) -> list[str]:
    ablation.check_nonempty(arms=args.arms, seeds=args.seeds)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    names = [a for a in args.arms if a != "dose"]
    if "dose" in args.arms:
        names += [n for n in ["ppo", *(offset_name(c) for c in OFFSETS if c != args.offset)] if n not in names]
    return names


def plan(args: Args, train_flags: list[str]) -> dict[str, list[ablation.Run]]:
    """Arm -> its Run per seed. A run's name carries its offset, so runs at other offsets never mix."""
    flags_of, runs = arm_flags(args.offset), {}
    for arm in chosen_arms(args):
        flags, offset = flags_of[arm]
        kind = "ppo" if arm.startswith("ppo-offset") else arm
        tag = "" if offset is None else f"__offset{offset:+g}"
        for seed in args.seeds:
            argv = ["--out-dir", args.out_dir, "--run-name", f"collapse__{kind}{tag}__seed{seed}", "--seed", str(seed),
                    "--steps", str(args.steps), *train_flags, *flags]
            runs.setdefault(arm, []).append(ablation.planned_run(arm, seed, argv))
    return runs


def moving_average(x: list[float], window: int = WINDOW) -> np.ndarray:
    """Means over `window` consecutive steps (fewer if the run is shorter)."""
    if not x:
        raise ValueError("moving_average: no PPO steps")
    w = min(window, len(x))
    return np.convolve(np.asarray(x, dtype=float), np.ones(w) / w, mode="valid")


def length_ratio(lengths: list[float], window: int = WINDOW) -> float:
    """Lowest moving average of the batch-mean response length over the first step's batch mean.
    Both are noisy: the first step is one batch, which every arm of a seed shares, and the lowest of
    the moving averages sits below their level (`no_trend_band`: what it reads by chance)."""
    return float(moving_average(lengths, window).min() / lengths[0])


def no_trend_band(curves: list[list[float]], window: int = WINDOW, draws: int = 20000) -> dict:
    """What `length_ratio` reads by chance alone: its 5th, 50th and 95th percentiles over runs with
    no trend in length, each step's batch mean drawn around one level, the runs' start (the median
    of their first `window` batch means), with the spread `curves` (the runs' batch-mean lengths) show
    from step to step (the std of their step-to-step changes over sqrt 2, which a slow trend barely
    moves; median over runs), for as many steps as the median run ran. NaN below 3 steps, which show
    no spread."""
    steps = int(np.median([len(c) for c in curves]))
    if steps < 3:
        nan = float("nan")
        return {"low": nan, "median": nan, "high": nan, "spread": nan, "level": nan, "steps": steps}
    spread = float(np.median([np.std(np.diff(c)) / np.sqrt(2) for c in curves]))
    level = float(np.median([np.mean(c[:window]) for c in curves]))
    runs = level + spread * np.random.default_rng(0).standard_normal((draws, steps))
    low, median, high = np.percentile([length_ratio(run.tolist(), window) for run in runs], [5, 50, 95])
    return {"low": float(low), "median": float(median), "high": float(high), "spread": spread, "level": level,
            "steps": steps}


def against_grpo(runs: dict[str, list[dict]]) -> None:
    """Each run's lowest moving average of the length, and of the training accuracy, over that of the
    same seed's GRPO run, written to its "length_vs_grpo" and "acc_vs_grpo" (None without one): the
    arms of a seed share the first batch and the prompts, so the first batch's draw, and much of the
    trough's, cancel; GRPO has no critic to err."""
    for curve, key in (("response_length/mean", "length_vs_grpo"), ("reward/accuracy", "acc_vs_grpo")):
        grpo = {r["seed"]: r["curves"][curve] for r in runs.get("grpo", [])}
        for rows in runs.values():
            for r in rows:
                if r["seed"] not in grpo:
                    r[key] = None
                    continue
                steps = min(len(r["curves"][curve]), len(grpo[r["seed"]]))  # over the steps both ran
                low, reference = (moving_average(c[:steps]).min() for c in (r["curves"][curve], grpo[r["seed"]]))
                r[key] = float(low / reference) if reference > 0 else None


def recovery_steps(lengths: list[float], window: int = WINDOW) -> int | None:
    """Steps from the trough of the moving average of the length back to RECOVERED x the first
    step's length: 0 if it never fell below that, None if it did not come back within the run."""
    moving, target = moving_average(lengths, window), RECOVERED * lengths[0]
    trough = int(moving.argmin())
    if moving[trough] >= target:
        return 0
    back = np.nonzero(moving[trough:] >= target)[0]
    return int(back[0]) if len(back) else None


def calibration_steps(errors: list) -> int | None:
    """The first step whose batch has |mean V(s_t) - G_t| <= CALIBRATED (None: never; no critic)."""
    return next((step for step, e in enumerate(errors) if e is not None and abs(e) <= CALIBRATED), None)


def measure_run(loaded: dict) -> dict:
    rows, summary = loaded["metrics"], loaded["summary"]
    lengths, accuracy = [r["response_length/mean"] for r in rows], [r["reward/accuracy"] for r in rows]
    first, sft_acc = rows[0], summary["sft"]["pass@1"]
    return {
        "seed": loaded["seed"], "steps": len(rows), "wall_s": loaded["wall_s"],
        "initial_error": first.get("critic/value_error/all"),
        "initial_error_first_quarter": first.get("critic/value_error/first_quarter"),
        "first_step_advantage_by_quarter": [first.get(f"advantage/pos_bin{b}") for b in range(4)],  # None: not logged
        "fixed_position_bins": "advantage/pos_bin_tokens" in first,  # else quarters of each response's own length
        "first_step_advantage_last_token": first.get("advantage/last_token"),
        "first_step_advantage_other_tokens": first.get("advantage/other_tokens"),
        "length_ratio": length_ratio(lengths),
        # pi_SFT's held-out pass@1 is the level the policy starts at (training accuracy is noisier)
        "acc_ratio": float(moving_average(accuracy).min() / sft_acc) if sft_acc > 0 else float("nan"),
        "recovery_steps": recovery_steps(lengths),
        "calibration_steps": calibration_steps([r.get("critic/value_error/all") for r in rows]),
        "final_acc": summary["ppo"]["pass@1"], "sft_acc": sft_acc,
        "curves": {"response_length/mean": lengths, "reward/accuracy": accuracy,
                   "critic/value_error/all": [r.get("critic/value_error/all") for r in rows]},
    }


def reward_model_quality(runs: dict[str, list[ablation.Run]]) -> dict:
    """The held-out AUC and sign accuracy that prepare_orm left beside each reward model (quality.json)."""
    from critic import orm_path

    out = {}
    for arm in ("ppo-orm", "ppo-bt"):
        if arm in runs:
            q = Path(orm_path(runs[arm][0].config)) / "quality.json"
            if q.is_file():
                out[arm] = json.loads(q.read_text())
    return out


def goals(m: dict, offset: float) -> list[str]:
    """The goal, checked seed by seed (the table says each number)."""
    runs, lines = m["runs"], []
    if "ppo" in runs:
        ok = [r["length_ratio"] <= 0.6 and r["acc_ratio"] <= 0.5 for r in runs["ppo"]]
        lines.append(f"plain PPO at offset {offset:+g} collapses (length ratio <= 0.6 and accuracy ratio <= 0.5): "
                     f"{sum(ok)} of {len(ok)} seeds")
    if "vc-ppo" in runs:
        ok = [r["length_ratio"] >= 0.85 and r["acc_ratio"] >= 0.8 and r["final_acc"] >= r["sft_acc"]
              for r in runs["vc-ppo"]]
        lines.append(f"VC-PPO from the same offset holds (length ratio >= 0.85, accuracy ratio >= 0.8, final pass@1 >= "
                     f"pi_SFT's): {sum(ok)} of {len(ok)} seeds")
    dose = sorted((a for a in runs if a == "ppo" or a.startswith("ppo-offset")), key=lambda a: m["offsets"][a])
    for seed in m["seeds"]:
        ratio = {a: r["length_ratio"] for a in dose for r in runs[a] if r["seed"] == seed}
        if len(ratio) == len(dose) > 1:
            ratios = list(ratio.values())
            rising = all(a <= b for a, b in zip(ratios, ratios[1:]))
            offsets = " ".join(f"{m['offsets'][a]:+g}" for a in dose)
            lines.append(f"seed {seed}: length ratio by offset {offsets}: "
                         f"{' '.join(f'{x:.2f}' for x in ratios)} ({'rises' if rising else 'does NOT rise'} with the offset)")
    return lines


def measure(runs: dict[str, list[ablation.Run]], offset: float) -> dict:
    """Every finished run's numbers, by arm (an arm with no finished run is left out)."""
    runs = {arm: [r for r in rs if r.done] for arm, rs in runs.items()}
    runs = {arm: rs for arm, rs in runs.items() if rs}
    m = {"offset": offset, "seeds": sorted({r.seed for rs in runs.values() for r in rs}),
         "offsets": {arm: arm_flags(offset)[arm][1] for arm in runs},
         "runs": {arm: [measure_run(ablation.load(r)) for r in rs] for arm, rs in runs.items()},
         "reward_models": reward_model_quality(runs)}
    # The advantages of Fig. 2 are at the runs' lambda_actor: the preset's, or one passed after `--`.
    lams = {r.config.lam_actor for rs in runs.values() for r in rs if r.config.estimator == "gae"}
    m["lambda_actor"] = f"lambda {lams.pop():g}" if len(lams) == 1 else "lambda_actor"
    sft = {r["seed"]: r["sft_acc"] for rows in m["runs"].values() for r in rows}  # one pi_SFT score per seed
    m["sft_acc"] = ablation.mean_std(list(sft.values()))[0]
    against_grpo(m["runs"])
    m["no_trend_band"] = no_trend_band([r["curves"]["response_length/mean"] for rows in m["runs"].values() for r in rows])
    m["goals"] = goals(m, offset)
    return m


def fig2_by_position(args: Args, runs: dict[str, list[ablation.Run]]) -> dict | None:
    """analysis/advantage_bias.py on the critics the arms start from, with the first finished vc-ppo run's
    settings (its pi_SFT, reward models and value-pretrained critic); None (and why, printed) without them."""
    vc = next((r for r in runs.get("vc-ppo", []) if r.done), None)
    if vc is None:
        print("Fig. 2 by position: skipped, no finished vc-ppo run")
        return None
    bias_args = advantage_bias.Args(out=args.out, offset=args.offset, seed=vc.seed)
    paths = advantage_bias.default_paths(bias_args, vc.config)
    missing = [paths[k] for k in ("sft", "pretrained") if not Path(paths[k], "config.json").is_file()]
    if missing:
        print(f"Fig. 2 by position: skipped, no checkpoint at {', '.join(missing)}")
        return None
    r = advantage_bias.main(bias_args, vc.flags)
    out = {}
    for name, adv in r.advantages.items():
        error = float(((r.values[name] - r.mc_return) * r.tokens).sum() / r.tokens.sum())  # mean V(s_t) - G_t
        out[name] = {"label": advantage_bias.critic_label(name, args.offset), "error": error,
                     "bin_centre": r.bin_centre.tolist(), "advantage": adv[0.95].tolist() if 0.95 in adv else None,
                     "early_vs_later": {str(lam): list(ms) for lam, ms in r.early_vs_later[name].items()}}
    return {"seed": vc.seed, "responses": r.rollout["responses"], "critics": out,
            "tokens": r.tokens.tolist(), "skipped": r.skipped}


def quarters_of(m: dict) -> str:
    """What the runs' Fig. 2 quarters are of: train.py bins token positions since it logs
    advantage/pos_bin_tokens; before, quarters of each response's own length (not 0 for an exact critic)."""
    fixed = {r["fixed_position_bins"] for rows in m["runs"].values() for r in rows}
    if fixed == {True}:
        return "of the token positions up to --max-new-tokens"
    return ("of each response's own length (runs logged before train.py binned token positions: not 0 even "
            "for an exact critic)" if fixed == {False} else "(mixed: runs logged by two versions of train.py)")


def summary_line(m: dict) -> str:
    def mean(arm, key):
        return f"{ablation.mean_std([r[key] for r in m['runs'][arm]])[0]:.3f}" if arm in m["runs"] else "n/a"

    return (f"collapse offset={m['offset']:+g} ppo_length_ratio={mean('ppo', 'length_ratio')} "
            f"vcppo_length_ratio={mean('vc-ppo', 'length_ratio')} ppo_acc_ratio={mean('ppo', 'acc_ratio')} "
            f"vcppo_acc_ratio={mean('vc-ppo', 'acc_ratio')} ppo_final_acc={mean('ppo', 'final_acc')} "
            f"vcppo_final_acc={mean('vc-ppo', 'final_acc')} sft_acc={m['sft_acc']:.3f}")


def label(m: dict, arm: str) -> str:
    offset = m["offsets"].get(arm)
    return arm if offset is None or arm.startswith("ppo-offset") else f"{arm} (offset {offset:+g})"


def plot(m: dict, path: Path) -> None:
    fig, grid = plt.subplots(2, 3, figsize=(18, 9.5))
    axes = grid.flatten()
    for ax, key, name in ((axes[0], "response_length/mean", "batch-mean response length"),
                          (axes[1], "reward/accuracy", "training accuracy"),
                          (axes[2], "critic/value_error/all", "critic's error: mean V(s_t) - G_t")):
        for arm in (a for a in FAMILY if a in m["runs"] and not (key.startswith("critic/") and a == "grpo")):
            y = np.array([r["curves"][key] for r in m["runs"][arm]], dtype=float)  # None (no critic) -> NaN
            (line,) = ax.plot(y.mean(0), label=f"{label(m, arm)} (n={len(y)})")
            if len(y) > 1:
                std = y.std(0, ddof=1)
                ax.fill_between(np.arange(y.shape[1]), y.mean(0) - std, y.mean(0) + std, alpha=0.15,
                                color=line.get_color())
        ax.set(xlabel="PPO step", ylabel=name)
        ax.grid(alpha=0.3)
    axes[1].axhline(m["sft_acc"], color="grey", ls=":", label="pi_SFT held-out pass@1")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    axes[2].axhline(0, color="black", lw=0.5)
    ax = axes[3]  # the dose-response: one point per arm and seed
    for arm, rows in m["runs"].items():
        if arm == "grpo":
            ax.axhline(ablation.mean_std([r["length_ratio"] for r in rows])[0], color="grey", ls="--", label="grpo (no critic)")
            continue
        ax.scatter([r["initial_error"] for r in rows], [r["length_ratio"] for r in rows], label=label(m, arm), s=25)
    ax.axvline(0, color="black", lw=0.5)
    ax.set(xlabel="measured initial error: mean V(s_t) - G_t, step 0", ylabel="length ratio (lowest 5-step mean / first)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax = axes[4]  # Fig. 2 from the same runs
    for arm in (a for a in FIG2 if a in m["runs"]):
        q = np.array([r["first_step_advantage_by_quarter"] for r in m["runs"][arm]], dtype=float)
        ax.errorbar(np.arange(4) + 1, q.mean(0), yerr=q.std(0, ddof=1) if len(q) > 1 else None, marker="o",
                    capsize=3, label=label(m, arm))
    ax.axhline(0, color="black", lw=0.5)
    ax.set(xlabel=f"quarter {quarters_of(m)} (early -> late)", ylabel=f"mean advantage at step 0 ({m['lambda_actor']})",
           xticks=[1, 2, 3, 4])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[5]  # Fig. 2 by position (analysis/advantage_bias.py)
    if m.get("fig2"):
        f2 = m["fig2"]
        for c in f2["critics"].values():
            if c["advantage"] is not None:
                ax.plot(np.array(c["bin_centre"]), c["advantage"], marker="o", ms=2,
                        label=f"{c['label']}, error {c['error']:+.2f}")
        ax.axhline(0, color="black", lw=0.5)
        ax.set(xlabel="response token position t", ylabel="mean advantage, lambda 0.95",
               title=f"Fig. 2 by position: {f2['responses']} pi_SFT responses (advantage_bias.py)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    fig.suptitle(f"Fig. 1 by intervention: the critic's initial offset set by hand (seeds {m['seeds']}; "
                 f"pi_SFT held-out pass@1 {m['sft_acc']:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(m: dict, runs: dict[str, list[ablation.Run]]) -> str:
    def pm(arm, key, digits=3, signed=False):
        mean, std = ablation.mean_std([r[key] for r in m["runs"][arm]])
        if np.isnan(mean):
            return "-"
        text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
        return text + (f" ± {std:.{digits}f}" if np.isfinite(std) else "")

    def per_seed(arm, key):
        return ", ".join("-" if r[key] is None else str(r[key]) for r in m["runs"][arm])

    flags = " ".join(m.get("train_flags", [])) or "none (the tiny preset)"
    band = m["no_trend_band"]
    lines = ["# Fig. 1 by intervention on the built-in task: the critic's initial error set by hand", "",
             f"train.py flags after `--` for every run: {flags}. Seeds {m['seeds']}, mean ± sample std over seeds (not a standard error). Initial error: mean V(s_t) - G_t over the first batch's "
             f"tokens (all / the first quarter of the positions up to --max-new-tokens). Advantage at step 0: mean (before whitening) over the last token "
             f"and over the others. Length ratio: lowest {WINDOW}-step mean of the batch-mean length over the first "
             f"step's (by chance alone, a run with no trend in length reads {band['low']:.2f}-{band['high']:.2f}, 5-95%, "
             f"median {band['median']:.2f}, at these runs' step-to-step spread of {band['spread']:.0f} tokens around "
             f"{band['level']:.0f} over {band['steps']} steps: the first step is one batch); length vs "
             f"GRPO: the lowest {WINDOW}-step mean over the same seed's GRPO run's (the same first batch and prompts), "
             f"and accuracy vs GRPO the same for training accuracy; "
             f"accuracy ratio: lowest {WINDOW}-step mean of training accuracy over pi_SFT's held-out pass@1 "
             f"({m['sft_acc']:.3f}). Calibrated: the first step whose |mean V(s_t) - G_t| <= {CALIBRATED}, per seed. "
             f"Recovery: steps from the trough back to {RECOVERED} of the first length, per seed (0: never fell below "
             f"it; -: not within the run).", "",
             "| arm | seeds | initial error (all) | (first quarter) | step-0 advantage, last token | (other tokens) "
             "| calibrated at step | length ratio | length vs GRPO | accuracy ratio | accuracy vs GRPO | recovery (steps) "
             "| final pass@1 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(m["runs"], key=lambda a: (a.startswith("ppo-offset"), m["offsets"].get(a) or 0))
    for arm in order:
        seeds = ",".join(str(r["seed"]) for r in m["runs"][arm])
        lines.append(f"| {label(m, arm)} | {seeds} | {pm(arm, 'initial_error', signed=True)} | "
                     f"{pm(arm, 'initial_error_first_quarter', signed=True)} | "
                     f"{pm(arm, 'first_step_advantage_last_token', signed=True)} | "
                     f"{pm(arm, 'first_step_advantage_other_tokens', signed=True)} | {per_seed(arm, 'calibration_steps')} | "
                     f"{pm(arm, 'length_ratio')} | {pm(arm, 'length_vs_grpo')} | {pm(arm, 'acc_ratio')} | "
                     f"{pm(arm, 'acc_vs_grpo')} | {per_seed(arm, 'recovery_steps')} | "
                     f"{pm(arm, 'final_acc')} |")
    lines += ["", f"Fig. 2 from the same runs: mean advantage ({m['lambda_actor']}, before whitening) over each quarter "
              f"{quarters_of(m)} in the first batch, early to late:", "", "| arm | 1st | 2nd | 3rd | 4th |", "|---|---|---|---|---|"]
    for arm in (a for a in FIG2 if a in m["runs"]):
        q = np.array([r["first_step_advantage_by_quarter"] for r in m["runs"][arm]], dtype=float).mean(0)
        lines.append(f"| {label(m, arm)} | " + " | ".join(f"{x:+.3f}" for x in q) + " |")
    if m["reward_models"]:
        lines += ["", "The reward models as reward models, on held-out pi_SFT responses that ended with EOS (a cut "
                  "one is wrong by its reward, and easy to rank; quality.json beside each has all of them too):", "",
                  "| arm | loss | complete responses | AUC | sign accuracy | base rate |", "|---|---|---|---|---|---|"]
        for arm, q in m["reward_models"].items():
            a = q.get("complete", {})
            share = lambda key: "-" if a.get(key) is None else f"{a[key]:.3f}"  # noqa: E731  (null: undefined)
            lines.append(f"| {arm} | {q['loss']} | {a.get('responses', 0)} | {share('auc')} | "
                         f"{advantage_bias.sign_accuracy(a, q['loss'])} | {share('base_rate')} |")
    if m.get("fig2"):
        f2 = m["fig2"]
        lines += ["", f"Fig. 2 by position (analysis/advantage_bias.py, advantage_bias.md beside this file): the "
                  f"critics the arms start from, on {f2['responses']} fresh pi_SFT responses (seed {f2['seed']}). Error: "
                  "mean V(s_t) - G_t over all tokens; mean advantage over the first bin of positions less that over "
                  "every later position ± SE over responses:", "",
                  "| critic | error | early less later, lambda 0.95 | early less later, lambda 1.0 |", "|---|---|---|---|"]
        for c in f2["critics"].values():
            fq = {lam: f"{mean:+.3f} ± {se:.3f}" for lam, (mean, se) in c["early_vs_later"].items()}
            lines.append(f"| {c['label']} | {c['error']:+.3f} | {fq.get('0.95', '-')} | {fq.get('1.0', '-')} |")
        lines += [f"- {advantage_bias.LABELS[n]}: skipped, {why}" for n, why in f2["skipped"].items()]
    walls = [r["wall_s"] for rows in m["runs"].values() for r in rows if r["wall_s"] is not None]
    lines += ["", "Goal checks:", "", *[f"- {g}" for g in m["goals"]], ""]
    if walls:
        lines.append(f"train.py wall time per run, as each ran (`--jobs` at a time, beside whatever else the machine "
                     f"ran): median {np.median(walls):.0f} s, {min(walls):.0f}-{max(walls):.0f} s over {len(walls)} runs.")
    lines += ["", "Runs: " + ", ".join(str(r.dir) for rs in runs.values() for r in rs if r.done), "", summary_line(m), ""]
    return "\n".join(lines)


def main(args: Args, train_flags: list[str]) -> dict:
    runs = plan(args, train_flags)
    wall = 0.0
    if not args.read_only:
        wall, _ = ablation.run_grid([r for rs in runs.values() for r in rs], args.jobs)
    missing = [r.dir for rs in runs.values() for r in rs if not r.done]
    if missing and (not args.read_only or len(missing) == sum(map(len, runs.values()))):
        raise SystemExit(f"error: run(s) did not finish, see {', '.join(str(d / 'train.log') for d in missing)}")
    m = measure(runs, args.offset)
    m["wall_s"], m["train_flags"] = wall, list(train_flags)
    m["fig2"] = fig2_by_position(args, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(m, args.out / "collapse.png")
    (args.out / "collapse.md").write_text(markdown(m, runs))
    rundir.write_json(str(args.out / "collapse.json"), m)  # NaN as null
    print((args.out / "collapse.md").read_text())
    for run_dir in missing:
        print(f"left out (not finished or not started): {run_dir}")
    if wall:
        print(f"ran the missing runs in {wall:.0f} s of wall time")
    print(f"wrote {args.out}/collapse.png, collapse.md and collapse.json")
    print(summary_line(m))
    return m


if __name__ == "__main__":
    run_cli(main, Args, __doc__, with_train_flags=True)
