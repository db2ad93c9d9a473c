"""Advantage and value by token position on pi_SFT's rollouts (paper §3.1, Fig. 2: value initialisation bias).

At the start of PPO the policy is pi_SFT. Its rollouts are scored (+-1 on the last token) and four
critics read V(s_t) on them: the outcome reward model (plain PPO's critic initialisation, MSE on the
outcome), the Bradley-Terry reward model (`--orm-loss bradley-terry`), pi_SFT with a fresh head
(moved by `--offset`, train.py's `--critic-init-offset`), and the value-pretrained critic (§3.2). GAE with lambda 0.95 and 1.0 turns each
into advantages. With an exact critic E[A_t] = 0 at every position, so the mean advantage by position
shows each critic's bias; the mean Monte-Carlo return (the lambda = 1 target, the same for every
critic) is what V(s_t) should be on average. The paper's Fig. 2 has early tokens biased UP; report
the sign measured here (a prototype before this project measured it negative), in two parts: the level
(the first bin's mean advantage, which holds the error the critic makes at every position: it moves
every token alike, and advantage whitening removes it), and the position (the first bin's mean against
the mean over every later position: the bias of early tokens over later ones). Both are means over
fixed token positions, 0 in expectation for an exact critic; a response's own mean, or a share of its
own length, is not (its length is still to come, and the outcome depends on it). Standard errors are
over responses, the independent draws (`pooled_mean`).

Flags after a `--` are train.py's own (`config.parse_config`): give the run's flags, so that paths,
task, sampling, reward and the stages --build runs are the run's.

    python analysis/advantage_bias.py                 # critics of runs/: writes runs/analysis/advantage_bias.*
    python analysis/advantage_bias.py --build         # first runs train.py's missing stages (SFT, ORM, §3.2)
    python analysis/advantage_bias.py --rollouts 64 --critic PATH -- --out-dir runs --run-name myrun
    python analysis/advantage_bias.py --offset -2 -- --out-dir runs/collapse --run-name collapse__vc-ppo__offset-2__seed0 \
        --critic-init sft --lam-critic 1.0 --critic-init-offset -2   # the critics of analysis/collapse.py (its vc-ppo run's flags)
"""
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from support import rundir
from analysis import run_cli
from support.config import parse_config
from critic import check_orm, fresh_head_seed, load_value_model, orm_path, orm_quality, prepare_orm, response_values, shift_values
from support.data import prepare_data, sample_prompts, stream_seed
from fsdp_utils import local_device
from gae import compute_gae
from support.masked import masked_sum
from rollout import HFRollout
from sampling import Sampler
from support.sft import prepare_sft, sft_cache_path
from value_pretrain import prepare_value_critic
from reward import Grader

CRITICS = ("orm", "orm-bt", "sft", "pretrained")
LABELS = {"orm": "ORM-initialised", "orm-bt": "Bradley-Terry RM", "sft": "SFT + fresh head",
          "pretrained": "value-pretrained (§3.2)"}
REWARD_MODELS = {"orm": "mse", "orm-bt": "bradley-terry"}  # critic -> train.py's --orm-loss; judged as reward models too


@dataclass
class Args:
    out: Path = Path("runs/analysis")
    """folder that receives advantage_bias.png, .md and .json"""
    sft: str | None = None
    """pi_SFT checkpoint; None: train.py's (--model, else <out_dir>/_shared/sft)"""
    orm: str | None = None
    """outcome reward model; None: train.py's cache (<out_dir>/_shared/orm, or orm-<run_name> with --model)"""
    orm_bt: str | None = None
    """Bradley-Terry reward model; None: train.py's cache for --orm-loss bradley-terry (<out_dir>/_shared/orm-bt)"""
    offset: float = 0.0
    """added to every V(s_t) of the SFT + fresh-head critic, as train.py's --critic-init-offset does"""
    critic: str | None = None
    """value-pretrained critic; None: <out_dir>/<run_name>/value_pretrain/critic"""
    build: bool = False
    """run train.py's missing stages first (SFT, ORM, value pretraining), at train.py's own paths only"""
    rollouts: int = 128
    """responses sampled from pi_SFT (one per prompt)"""
    batch_size: int = 32
    """responses per generate call and per critic forward"""
    bin_size: int = 16
    """token positions per bin"""
    lambdas: tuple[float, ...] = (0.95, 1.0)
    """GAE lambdas (gamma: train.py's --gamma)"""
    seed: int = 0
    """seeds the prompts and the samples; the fresh critic head is train.py's for this --seed"""


@dataclass
class BiasResult:
    lambdas: tuple[float, ...]
    bin_size: int
    bin_start: np.ndarray  # [n_bins] first token position of each bin
    tokens: np.ndarray  # [n_bins] valid response tokens per bin
    mc_return: np.ndarray  # [n_bins] mean lambda = 1 return (outcome): what V(s_t) should be on average
    values: dict[str, np.ndarray]  # critic -> [n_bins] mean V(s_t)
    advantages: dict[str, dict[float, np.ndarray]]  # critic -> lambda -> [n_bins] mean A_t
    pearson: dict[str, dict[float, float]]  # critic -> lambda -> token-level corr(A_t, t)
    first_bin_se: dict[str, dict[float, float]]  # standard error of the first bin's mean, over responses
    # critic -> lambda -> (mean, SE): the first bin's mean advantage less the mean over every later position
    early_vs_later: dict[str, dict[float, tuple[float, float]]]
    skipped: dict[str, str]  # critic -> why it has no curve
    rollout: dict  # responses, mean and max length, accuracy, truncated share
    box: dict[str, dict]  # critic -> V(s_t) just before and just after the final box opens (TD errors there)
    orm_quality: dict  # reward model -> subset -> AUC, sign accuracy, base rate on these (held-out) responses
    offset: float = 0.0  # added to the SFT + fresh-head critic's values

    @property
    def bin_centre(self) -> np.ndarray:
        """[n_bins] the middle token position of each bin, where a plot puts its mean."""
        return self.bin_start + (self.bin_size - 1) / 2


def check_args(args: Args) -> None:
    problems = {
        "rollouts": args.rollouts >= 2, "batch_size": args.batch_size >= 1, "bin_size": args.bin_size >= 1,
        "lambdas": bool(args.lambdas) and all(0.0 <= lam <= 1.0 for lam in args.lambdas),
    }
    bad = [name for name, ok in problems.items() if not ok]
    if bad:
        raise ValueError(f"--{bad[0].replace('_', '-')} = {getattr(args, bad[0])!r} is invalid "
                         "(rollouts >= 2, batch size and bin size >= 1, lambdas in [0, 1])")


def default_paths(args: Args, cfg) -> dict[str, str]:
    """Where train.py writes (or wrote) pi_SFT and each critic, unless a flag names another path."""
    return {
        "sft": args.sft or cfg.model or sft_cache_path(cfg),
        **{name: given or orm_path(reward_model_settings(cfg, name)) for name, given in given_reward_models(args).items()},
        "pretrained": args.critic or os.path.join(cfg.out_dir, cfg.run_name, "value_pretrain", "critic"),
    }


def given_reward_models(args: Args) -> dict[str, str | None]:
    """Reward model -> the path a flag gave it (None: train.py's cache)."""
    return {"orm": args.orm, "orm-bt": args.orm_bt}


def reward_model_settings(cfg, name: str):
    """The run's settings with the --orm-loss of reward model `name`: where train.py caches it, what it checks."""
    return dataclasses.replace(cfg, orm_loss=REWARD_MODELS[name])


def critic_label(name: str, offset: float) -> str:
    """A critic's name in figures and tables; the fresh-head critic's carries the offset it was moved by."""
    return LABELS[name] + (f" (offset {offset:+g})" if name == "sft" and offset else "")


def build_missing(args: Args, cfg, paths: dict, sampler: Sampler, records) -> None:
    """--build: train.py's ORM (both losses) and value-pretraining stages (SFT is built before the engine exists)."""
    for name, given in given_reward_models(args).items():
        if given is None:
            prepare_orm(reward_model_settings(cfg, name), paths["sft"], sampler, records)
    if args.critic is None and not os.path.exists(paths["pretrained"]) and cfg.value_pretrain_steps > 0:
        run_dir = rundir.prepare(cfg)  # the run directory records the settings of what goes in it
        critic_init = paths["sft"] if cfg.critic_init == "sft" else prepare_orm(cfg, paths["sft"], sampler, records)
        prepare_value_critic(cfg, run_dir, critic_init, sampler, records,
                             load=lambda path: load_value_model(path, seed=fresh_head_seed(cfg.seed), device=local_device()))


def sample_rollouts(args: Args, cfg, sampler: Sampler, records) -> list:
    """pi_SFT's scored responses (`sampling.ScoredBatch`), args.rollouts of them, one per prompt."""
    cfg = dataclasses.replace(cfg, prompts_per_step=args.batch_size, samples_per_prompt=1, seed=args.seed)
    out = []
    for i in tqdm(range(-(-args.rollouts // args.batch_size)), desc="pi_SFT rollouts", leave=False):
        prompts = sample_prompts(records, cfg, i, stream="advantage_bias")[: args.rollouts - i * args.batch_size]
        out.append(sampler.sample_and_score(prompts, stream_seed(args.seed, "advantage_bias/sampling", i)))
    return out


BOX_OPEN = "\\boxed{"


def box_starts(tokenizer, rollouts) -> list[list[tuple[int, int]]]:
    """Per rollout batch, per response: the token indices (b, e) where its last `\\boxed{` begins and
    where the box's content begins ((-1, -1): none). The "?" of a guess comes before it, so b is the
    first token of the box itself; e - b is as many tokens as `\\boxed{` takes in this tokenizer."""
    count = lambda prefix: len(tokenizer(prefix, add_special_tokens=False)["input_ids"])  # noqa: E731
    out = []
    for scored in rollouts:
        starts = []
        for text in scored.texts:
            i = text.rfind(BOX_OPEN)
            starts.append((-1, -1) if i < 0 else (count(text[:i]), count(text[: i + len(BOX_OPEN)])))
        out.append(starts)
    return out


def box_alignment(rollouts, values: list, starts: list[list[tuple[int, int]]], before: int = 16) -> dict:
    """V(s_t) around the opening of the final box, over responses whose box opens completely: the mean
    over the `before` tokens before it, at the box's first token (s_b: nothing of it written yet), and
    once `\\boxed{` is written (s_e); their difference is the sum of the TD errors delta_t = V(s_{t+1})
    - V(s_t) over the box-opening tokens (no reward there). A critic that reads every unboxed prefix as
    a truncated (-1) response shows a large positive jump whatever the answer."""
    pre, at, inside, jump = [], [], [], []
    for scored, v, rows in zip(rollouts, values, starts):
        for row, (b, e) in enumerate(rows):
            if b < 1 or e >= int(scored.batch.lengths[row]):
                continue
            pre.append(float(v[row, max(0, b - before) : b].mean()))
            at.append(float(v[row, b]))
            inside.append(float(v[row, e]))
            jump.append(inside[-1] - at[-1])
    if not jump:
        return {"responses": 0}
    se = lambda x: float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")  # noqa: E731
    return {"responses": len(jump), "value_before": float(np.mean(pre)), "value_at_open": float(np.mean(at)),
            "value_after_open": float(np.mean(inside)), "jump": float(np.mean(jump)), "jump_se": se(jump)}


def position_sums(rollouts, critic, lambdas, gamma, width: int, bin_size: int) -> dict:
    """Per-position sums (float64, [width]) over every valid token of every rollout: token count,
    lambda = 1 return, V(s_t) and A_t per lambda; sum A_t^2 per lambda (for the correlation); and
    per response, its tokens and the sum of their A_t in the first bin and after it (for standard
    errors over responses)."""
    z = lambda: np.zeros(width)
    sums = {"count": z(), "ret": z(), "value": z(), "adv": {lam: z() for lam in lambdas},
            "adv_sq": {lam: 0.0 for lam in lambdas}, "values": [], "early_count": [], "later_count": [],
            "early_adv": {lam: [] for lam in lambdas}, "later_adv": {lam: [] for lam in lambdas}}

    def add(key, x, mask, lam=None):
        s = masked_sum(x.double(), mask.double(), dim=0).cpu().numpy()  # over responses: [T]
        target = sums[key] if lam is None else sums[key][lam]
        target[: len(s)] += s

    for scored in rollouts:
        batch, rewards, mask = scored.batch, scored.token_rewards, scored.batch.response_mask
        values = response_values(critic, batch) if critic is not None else torch.zeros_like(mask)
        sums["values"].append(values)
        early = mask.clone()
        early[:, bin_size:] = 0
        later = mask - early
        sums["early_count"] += early.sum(1).tolist()
        sums["later_count"] += later.sum(1).tolist()
        add("count", mask, mask)
        add("value", values, mask)
        add("ret", compute_gae(rewards, values, mask, gamma, lam=1.0)[1], mask)  # R_t at lambda = 1 (Eq. 5)
        for lam in lambdas:
            adv, _ = compute_gae(rewards, values, mask, gamma, lam=lam)  # GAE
            add("adv", adv, mask, lam)
            sums["adv_sq"][lam] += float(masked_sum(adv.double() ** 2, mask.double()))
            sums["early_adv"][lam] += masked_sum(adv.double(), early.double(), dim=1).tolist()
            sums["later_adv"][lam] += masked_sum(adv.double(), later.double(), dim=1).tolist()
    return sums


def pearson_with_position(count, adv_sum, adv_sq_sum) -> float:
    """Token-level Pearson correlation of A_t with t, from per-position sums (NaN if either is constant)."""
    t = np.arange(len(count), dtype=np.float64)
    n, sx, sxx = count.sum(), (t * count).sum(), (t * t * count).sum()
    sy, sxy = adv_sum.sum(), (t * adv_sum).sum()
    cov, var_x, var_y = n * sxy - sx * sy, n * sxx - sx**2, n * adv_sq_sum - sy**2
    if var_x <= 0 or var_y <= 1e-12 * n * adv_sq_sum:  # one position, or A_t the same everywhere
        return float("nan")
    return float(np.clip(cov / np.sqrt(var_x * var_y), -1.0, 1.0))


def bin_sums(per_position: np.ndarray, bin_size: int) -> np.ndarray:
    """Sums of consecutive groups of bin_size positions (the last group may be shorter)."""
    return np.pad(per_position, (0, -len(per_position) % bin_size)).reshape(-1, bin_size).sum(1)


def binned(per_position: np.ndarray, count: np.ndarray, bin_size: int) -> np.ndarray:
    """Masked mean per bin: the bin's summed values over its token count."""
    return bin_sums(per_position, bin_size) / np.maximum(bin_sums(count, bin_size), 1)


def pooled_mean(sums: list[float], counts: list[float]) -> tuple[float, np.ndarray]:
    """The mean over every token of some positions, sum_i s_i / sum_i n_i over responses i (s_i, n_i:
    response i's sum and token count there), and each response's influence on it,
    (s_i - mean n_i) / sum_i n_i: the responses are the independent draws, not the tokens, so a
    standard error is taken over these (`standard_error`), of a difference of means too. NaN (and
    NaN influences) where no response has a token there."""
    s, n = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    if n.sum() == 0:
        return float("nan"), np.full(len(s), np.nan)
    mean = s.sum() / n.sum()
    return float(mean), (s - mean * n) / n.sum()


def standard_error(influence: np.ndarray) -> float:
    """The standard error of a mean over responses from each response's influence on it (the ratio
    estimator's, with the small-sample factor k / (k - 1))."""
    k = len(influence)
    return float(np.sqrt(k / (k - 1) * (influence**2).sum())) if k > 1 else float("nan")


def measure(args: Args, rollouts, paths: dict, gamma: float, starts: list[list[tuple[int, int]]]) -> BiasResult:
    """Binned values and advantages of every critic found at `paths`, on the same rollouts; `starts`:
    where each response's final box opens and its content begins (`box_starts`)."""
    width = max(int(s.batch.lengths.max()) for s in rollouts)
    values, advantages, pearson, first_se, early, skipped, common = {}, {}, {}, {}, {}, {}, None
    box, quality = {}, {}
    for name in CRITICS:
        path = paths[name]
        if not Path(path, "config.json").is_file():
            hint = {"orm": "train.py --critic-init rm", "orm-bt": "train.py --critic-init rm --orm-loss bradley-terry",
                    "sft": "train.py", "pretrained": "train.py --value-pretrain-steps N"}[name]
            skipped[name] = f"no checkpoint at {path} (run `{hint}` first, or pass --build)"
            tqdm.write(f"advantage_bias: {LABELS[name]} critic skipped: {skipped[name]}")
            continue
        # pi_SFT gets train.py's fresh head for this seed (the critic a run starts from); critics keep theirs
        critic = load_value_model(path, seed=fresh_head_seed(args.seed)).to(local_device()).eval()
        if name == "sft":
            shift_values(critic, args.offset)
        with torch.no_grad():
            s = position_sums(rollouts, critic, args.lambdas, gamma, width, args.bin_size)
            if name in REWARD_MODELS:
                quality[name] = orm_quality(critic, rollouts)
        del critic
        first_se[name], early[name] = {}, {}
        for lam in args.lambdas:
            first, first_influence = pooled_mean(s["early_adv"][lam], s["early_count"])
            later, later_influence = pooled_mean(s["later_adv"][lam], s["later_count"])
            first_se[name][lam] = standard_error(first_influence)
            early[name][lam] = (first - later, standard_error(first_influence - later_influence))
        box[name] = box_alignment(rollouts, s["values"], starts)
        common = s
        values[name] = binned(s["value"], s["count"], args.bin_size)
        advantages[name] = {lam: binned(s["adv"][lam], s["count"], args.bin_size) for lam in args.lambdas}
        pearson[name] = {lam: pearson_with_position(s["count"], s["adv"][lam], s["adv_sq"][lam])
                         for lam in args.lambdas}
    if common is None:  # no critic at all: positions and returns only
        common = position_sums(rollouts, None, (), gamma, width, args.bin_size)
    lengths = torch.cat([s.batch.lengths for s in rollouts]).float()
    outcomes = torch.cat([s.outcomes for s in rollouts])
    truncated = [t for s in rollouts for t in s.batch.truncated]
    return BiasResult(
        lambdas=args.lambdas, bin_size=args.bin_size, bin_start=np.arange(0, width, args.bin_size),
        tokens=bin_sums(common["count"], args.bin_size),
        mc_return=binned(common["ret"], common["count"], args.bin_size), values=values,
        advantages=advantages, pearson=pearson, first_bin_se=first_se, early_vs_later=early, skipped=skipped,
        box=box, orm_quality=quality, offset=args.offset,
        rollout={"responses": len(lengths), "mean_length": lengths.mean().item(), "max_length": width,
                 "accuracy": (outcomes > 0).float().mean().item(),
                 "truncated": sum(truncated) / len(truncated)},
    )


def sign_sentence(first_bin: float, first_se: float, early: float, early_se: float) -> str:
    """The verdict on Fig. 2's bias: the first bin's level against 0, then early tokens against every
    later position, each judged at 2 standard errors."""
    def against(mean, se, above, below, neither):
        if not np.isfinite(mean):  # no token at the positions compared
            return "undefined (no token there)"
        if not np.isfinite(se):  # one response: no spread to judge it by
            return "not judged (one response)"
        return neither if abs(mean) <= 2 * se else above if mean > 0 else below

    level = against(first_bin, first_se, "above 0", "below 0", "within 2 SE of 0")
    position = against(early, early_se, "early tokens favoured over later ones (the paper's Fig. 2 direction)",
                       "early tokens penalised against later ones (the paper's Fig. 2 is the other way)",
                       "early tokens no different from later ones (within 2 SE)")
    return f"level {level}; {position}"


def plot(r: BiasResult, path: Path) -> None:
    fig, (adv_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = r.bin_centre
    styles = ["-", "--", ":", "-."]
    for i, name in enumerate(CRITICS):
        if name not in r.values:
            continue
        label = critic_label(name, r.offset)
        for j, (lam, adv) in enumerate(r.advantages[name].items()):
            adv_ax.plot(x, adv, styles[j % 4], color=f"C{i}", marker="o", ms=3, label=f"{label}, λ={lam:g}")
        val_ax.plot(x, r.values[name], color=f"C{i}", marker="o", ms=3, label=label)
    val_ax.plot(x, r.mc_return, "k--", label="mean return (λ=1 target)")
    adv_ax.axhline(0, color="grey", lw=0.8)
    adv_ax.set(xlabel="response token position t", ylabel=f"mean advantage A_t (bins of {r.bin_size})",
               title="advantage by position (0 for an exact critic)")
    val_ax.set(xlabel="response token position t", ylabel="mean V(s_t)", title="value by position")
    adv_ax.legend(fontsize=7, handlelength=3)  # long enough to show the dashes
    val_ax.legend(fontsize=7)
    ro = r.rollout
    fig.suptitle(f"pi_SFT rollouts: {ro['responses']} responses, mean length {ro['mean_length']:.0f}, "
                 f"accuracy {ro['accuracy']:.2f}" + (f"; skipped: {', '.join(r.skipped)}" if r.skipped else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sign_accuracy(quality: dict, loss: str) -> str:
    """A reward model's sign accuracy for a table: '-' for a Bradley-Terry one, whose zero means nothing."""
    return "-" if loss == "bradley-terry" or quality.get("sign_accuracy") is None else f"{quality['sign_accuracy']:.3f}"


def mechanism_lines(r: BiasResult) -> list[str]:
    """The reward models' quality as reward models and the values around the box."""
    lines = ["## The reward models as reward models (held-out responses, score at the last token)", ""]
    if r.orm_quality:
        lines += ["| reward model | responses | n | correct | AUC | sign accuracy | base rate | mean score, correct "
                  "| mean score, wrong |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {LABELS[critic]} | {name} | {q['responses']} | {q['correct']} | {q['auc']:.3f} | "
                  f"{sign_accuracy(q, REWARD_MODELS[critic])} | {q['base_rate']:.3f} | {q['mean_score_correct']:+.3f} | "
                  f"{q['mean_score_wrong']:+.3f} |"
                  for critic, by_subset in r.orm_quality.items() for name, q in by_subset.items()]
        if "orm-bt" in r.orm_quality:
            lines += ["", "A Bradley-Terry score has no meaningful zero (only differences are trained): its sign "
                      "accuracy is not shown, and its AUC is the measure."]
    else:
        lines.append("(no reward model read)")
    lines += ["", "## V(s_t) around the opening of the final box", "",
              "Mean over the 16 tokens before the box, at its first token, after `\\boxed{` is written, and the "
              "jump (the sum of the TD errors over the box-opening tokens; mean ± SE over responses).", "",
              "| critic | responses | V before | V at open | V after open | jump |", "|---|---|---|---|---|---|"]
    for name, b in r.box.items():
        if b["responses"]:
            lines.append(f"| {LABELS[name]} | {b['responses']} | {b['value_before']:+.3f} | {b['value_at_open']:+.3f} | "
                         f"{b['value_after_open']:+.3f} | {b['jump']:+.3f} ± {b['jump_se']:.3f} |")
    return lines + [""]


def markdown(r: BiasResult, paths: dict, gamma: float, seconds: dict) -> str:
    ro, lams = r.rollout, r.lambdas
    summary, signs = [], []
    for name in r.values:
        for lam in lams:
            adv = r.advantages[name][lam]
            all_mean = float((adv * r.tokens).sum() / r.tokens.sum())
            se, (early, early_se) = r.first_bin_se[name][lam], r.early_vs_later[name][lam]
            summary.append(f"| {LABELS[name]} | {lam:g} | {r.pearson[name][lam]:+.3f} | {adv[0]:+.3f} ± {2 * se:.3f} | "
                           f"{early:+.3f} ± {2 * early_se:.3f} | {all_mean:+.3f} | {r.values[name][0]:+.3f} |")
            signs.append(f"- {LABELS[name]}, lambda = {lam:g}: first-bin mean advantage {adv[0]:+.3f} "
                         f"(all tokens {all_mean:+.3f}); first bin less the later positions {early:+.3f}: "
                         f"{sign_sentence(adv[0], se, early, early_se)}.")
    names = list(r.values)
    head = ("| tokens t | n tokens | mean return | " + " | ".join(f"V {name}" for name in names)
            + "".join(f" | A {name} λ={lam:g}" for name in names for lam in lams) + " |")
    rows = [f"| {b}-{b + r.bin_size - 1} | {int(n)} | {ret:+.3f} | " + " | ".join(f"{r.values[m][k]:+.3f}" for m in names)
            + "".join(f" | {r.advantages[m][lam][k]:+.3f}" for m in names for lam in lams) + " |"
            for k, (b, n, ret) in enumerate(zip(r.bin_start, r.tokens, r.mc_return))]
    horizons = ", ".join(f"{ro['mean_length'] * (1 - lam):.1f} at lambda={lam:g}" for lam in lams if lam < 1)
    return "\n".join([
        "# Advantage and value by token position on pi_SFT rollouts (paper §3.1, Fig. 2)", "",
        f"{ro['responses']} responses of pi_SFT ({paths['sft']}): mean length {ro['mean_length']:.1f} tokens, "
        f"accuracy {ro['accuracy']:.3f}, truncated {ro['truncated']:.3f}. GAE with gamma = {gamma:g}; means over "
        f"the valid tokens of each bin of {r.bin_size} positions. Mean length in GAE horizons, length x "
        f"(1 - lambda): {horizons or 'n/a'}.", "",
        "Critics: " + "; ".join(f"{LABELS[n]} = {paths[n]}" if n in r.values else f"{LABELS[n]} skipped (no {paths[n]})"
                                for n in CRITICS) + ". "
        "The SFT critic has a fresh N(0, 0.02) head (critic.load_value_model)"
        + (f", its values moved by {r.offset:+g} (--offset)" if r.offset else "") + ".", "",
        "| critic | lambda | Pearson r(A_t, t), token level | mean A_t, first bin ± 2 SE | first bin less the "
        "later positions ± 2 SE | mean A_t, all tokens | mean V(s_t), first bin |", "|---|---|---|---|---|---|---|",
        *summary, "",
        f"Mean return (lambda = 1 target, same for every critic), first bin: {r.mc_return[0]:+.3f}.", "",
        "Sign measured (means over every token at those positions, SE over responses). The level is the "
        "error the critic makes at every position: it "
        "moves every token's advantage alike, and advantage whitening (train.py's default) removes it; the "
        "paper's Fig. 2 is about the position, early tokens against later ones.", *signs, "",
        *mechanism_lines(r),
        *[f"- {LABELS[n]}: skipped, {why}." for n, why in r.skipped.items()], "",
        "For an exact critic every bin's expected mean advantage is 0 (reaching position t is part of s_t), "
        "and so is that of any set of positions; a deviation is the critic's bias plus sampling noise. Late "
        "bins hold only the long responses, so they are few and noisy (see n tokens).", "",
        "## By position", "", head, "|---|---|---|" + "---|" * (len(names) + len(names) * len(lams)), *rows, "",
        f"Runtime: rollouts {seconds['rollouts']:.1f} s, critics {seconds['critics']:.1f} s "
        f"({torch.get_num_threads()} torch threads).", "",
    ])


def to_json(r: BiasResult) -> dict:
    return {
        "lambdas": list(r.lambdas), "bin_size": r.bin_size, "bin_start": r.bin_start.tolist(), "tokens": r.tokens.tolist(),
        "mc_return": r.mc_return.tolist(), "values": {k: v.tolist() for k, v in r.values.items()},
        "advantages": {k: {str(lam): a.tolist() for lam, a in v.items()} for k, v in r.advantages.items()},
        "pearson": {k: {str(lam): c for lam, c in v.items()} for k, v in r.pearson.items()},
        "first_bin_se": {k: {str(lam): c for lam, c in v.items()} for k, v in r.first_bin_se.items()},
        "early_vs_later": {k: {str(lam): list(c) for lam, c in v.items()} for k, v in r.early_vs_later.items()},
        "skipped": r.skipped, "rollout": r.rollout,
        "box": r.box, "orm_quality": r.orm_quality, "offset": r.offset,
    }


def main(args: Args, train_argv: list[str] = ()) -> BiasResult:
    """`train_argv`: train.py's flags of the run (the command line after `--`)."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    check_args(args)
    cfg = parse_config(list(train_argv))
    if args.critic is None:
        rundir.check_settings_of(cfg)  # the run's value-pretrained critic belongs to the settings in its config.json
    for name, given in given_reward_models(args).items():
        if given is None:
            check_orm(reward_model_settings(cfg, name))  # train.py's cached ones were trained with these flags' settings
    paths = default_paths(args, cfg)
    if args.build and args.sft is None:
        paths["sft"] = prepare_sft(cfg)  # train.py's SFT stage (cached)
    if not Path(paths["sft"], "config.json").is_file():
        raise ValueError(f"no pi_SFT checkpoint at {paths['sft']}: run train.py first, pass --sft PATH, or --build")
    for flag, given in (("--orm", args.orm), ("--orm-bt", args.orm_bt), ("--critic", args.critic)):
        if given is not None and not Path(given, "config.json").is_file():  # only train.py's own paths may be missing
            raise ValueError(f"{flag} {given}: no checkpoint there (no config.json)")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(paths["sft"])
    records, _ = prepare_data(cfg, tokenizer)
    # On this process's GPU when there is one; the rollouts, and so every tensor derived from them, follow it.
    engine = HFRollout(AutoModelForCausalLM.from_pretrained(paths["sft"], dtype=torch.float32).to(local_device()), tokenizer)
    with Grader(num_workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s) as grader:
        sampler = Sampler(cfg, engine, tokenizer, grader)
        if args.build:
            build_missing(args, cfg, paths, sampler, records)
        rollouts = sample_rollouts(args, cfg, sampler, records)
    del engine, sampler
    seconds = {"rollouts": time.perf_counter() - start}
    start = time.perf_counter()
    result = measure(args, rollouts, paths, cfg.gamma, box_starts(tokenizer, rollouts))
    seconds["critics"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    png, md, js = (args.out / f"advantage_bias.{ext}" for ext in ("png", "md", "json"))
    plot(result, png)
    md.write_text(markdown(result, paths, cfg.gamma, seconds))
    rundir.write_json(str(js), to_json(result))  # NaN as null
    print(md.read_text())
    print(f"wrote {png}, {md} and {js}")
    return result


if __name__ == "__main__":
    run_cli(main, Args, __doc__, with_train_flags=True)
