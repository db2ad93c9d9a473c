"""Equation 8 checked by exact enumeration (paper §3.3, Eq. 8).

A small token MDP is enumerated completely: every response up to `horizon` tokens, a tabular softmax
policy over prefixes, a terminal +-1 reward. Expectations are then exact sums over responses, so the
policy gradient and the expected GAE gradient E[sum_t A_t grad log pi(a_t|s_t)] can be compared with
no sampling noise, for several lambdas and critics V'. The script shows three facts (gae.py's docstring):
  1. Eq. 8 is an algebraic identity: gae.compute_gae == gae.eq8_advantages on every response;
  2. the baseline term has zero mean: E[sum_t V'(s_t) grad log pi(a_t|s_t)] = 0 for any V';
  3. lambda = 1 is unbiased for every V'; lambda < 1 is unbiased only for V' = V^pi.

    python analysis/eq8_check.py                      # writes runs/analysis/eq8_check.{png,md}
    python analysis/eq8_check.py --horizon 8 --n-tokens 3 --out /tmp/eq8
"""
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from analysis import run_cli
from gae import compute_gae, eq8_advantages

MAX_RESPONSES = 200_000  # the enumeration is exact, so it must stay small


@dataclass
class Args:
    out: Path = Path("runs/analysis")
    """folder that receives eq8_check.png and eq8_check.md"""
    n_tokens: int = 2
    """content tokens in the vocabulary (an EOS token is added when `eos` is set)"""
    horizon: int = 6
    """maximum response length; a response that reaches it without EOS is cut and scores -1"""
    eos: bool = True
    """add an EOS token, so response lengths vary from 1 to `horizon`"""
    lambdas: tuple[float, ...] = (0.0, 0.5, 0.95, 1.0)
    """GAE lambdas to check (gamma is 1, as in the paper)"""
    seed: int = 0
    """seeds the policy logits, the rewards and the random critic"""


@dataclass
class TokenMDP:
    """Every response of the MDP, right-padded to `horizon` (the project's [B, T] conventions)."""

    prefixes: list[tuple[int, ...]]  # state index -> prefix s_t (the non-terminal states)
    states: torch.Tensor  # [N, H] long: index of s_t for response token t (0 on padding)
    actions: torch.Tensor  # [N, H] long: token a_t (0 on padding)
    mask: torch.Tensor  # [N, H] float64: 1 on response tokens
    rewards: torch.Tensor  # [N, H] float64: +-1 on the last token
    logits: torch.Tensor  # [S, V] float64 leaf: the policy pi(.|s) = softmax(logits[s])
    terminal_reward: dict[tuple[int, ...], float]  # complete response -> its reward


def build_mdp(n_tokens: int, horizon: int, eos: bool, seed: int) -> TokenMDP:
    """Enumerate all responses; rewards are random +-1 per response (seeded), -1 when cut at `horizon`."""
    if n_tokens < 1 or horizon < 1 or n_tokens + int(eos) < 2:
        raise ValueError(f"need n_tokens >= 1, horizon >= 1 and at least 2 actions; got "
                         f"n_tokens={n_tokens}, horizon={horizon}, eos={eos}")
    n_responses = sum(n_tokens**k for k in range(horizon)) * int(eos) + n_tokens**horizon
    if n_responses > MAX_RESPONSES:
        raise ValueError(f"{n_responses} responses to enumerate (limit {MAX_RESPONSES}): lower horizon or n_tokens")
    eos_id = n_tokens
    gen = torch.Generator().manual_seed(seed)
    prefixes = [p for k in range(horizon) for p in itertools.product(range(n_tokens), repeat=k)]
    index = {p: i for i, p in enumerate(prefixes)}
    responses = [p + (eos_id,) for p in prefixes] if eos else []
    responses += list(itertools.product(range(n_tokens), repeat=horizon))
    coin = torch.randint(0, 2, (len(responses),), generator=gen).tolist()
    terminal_reward = {}
    for r, c in zip(responses, coin):
        cut = eos and r[-1] != eos_id  # reached the horizon without EOS: the project's task scores -1
        terminal_reward[r] = -1.0 if cut else 2.0 * c - 1.0
    n, h = len(responses), horizon
    states, actions = torch.zeros(n, h, dtype=torch.long), torch.zeros(n, h, dtype=torch.long)
    mask, rewards = torch.zeros(n, h, dtype=torch.float64), torch.zeros(n, h, dtype=torch.float64)
    for b, r in enumerate(responses):
        states[b, : len(r)] = torch.tensor([index[r[:t]] for t in range(len(r))])
        actions[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1.0
        rewards[b, len(r) - 1] = terminal_reward[r]
    logits = torch.randn(len(prefixes), n_tokens + int(eos), generator=gen, dtype=torch.float64)
    return TokenMDP(prefixes, states, actions, mask, rewards, logits.requires_grad_(), terminal_reward)


def token_log_probs(mdp: TokenMDP) -> torch.Tensor:
    """[N, H] log pi(a_t | s_t), 0 on padding; differentiable in mdp.logits."""
    logp = torch.log_softmax(mdp.logits, dim=-1)[mdp.states, mdp.actions]
    return logp * mdp.mask


def true_gradient(mdp: TokenMDP) -> torch.Tensor:
    """grad_theta J with J = sum_tau P(tau) R(tau): autograd through the exact objective, no estimator."""
    prob = token_log_probs(mdp).sum(1).exp()
    objective = (prob * mdp.rewards.sum(1)).sum()
    return torch.autograd.grad(objective, mdp.logits)[0]


def expected_score_gradient(mdp: TokenMDP, weights: torch.Tensor) -> torch.Tensor:
    """E[sum_t w_t grad log pi(a_t|s_t)] for per-token weights w [N, H] (advantages, or V'(s_t))."""
    logp = token_log_probs(mdp)
    prob = logp.sum(1).exp().detach()  # the expectation's weights; only the score is differentiated
    surrogate = (prob * (weights.detach().to(logp.dtype) * logp).sum(1)).sum()
    return torch.autograd.grad(surrogate, mdp.logits)[0]


def exact_values(mdp: TokenMDP) -> torch.Tensor:
    """V^pi(s) for every prefix, by backward recursion V(s) = sum_a pi(a|s) [R(s+a) or V(s+a)]."""
    pi = torch.softmax(mdp.logits.detach(), dim=-1)
    index = {p: i for i, p in enumerate(mdp.prefixes)}
    v = torch.zeros(len(mdp.prefixes), dtype=torch.float64)
    for i in sorted(range(len(v)), key=lambda i: -len(mdp.prefixes[i])):  # children before parents
        nxt = [mdp.prefixes[i] + (a,) for a in range(pi.shape[1])]
        v[i] = sum(pi[i, a] * (mdp.terminal_reward[s] if s in mdp.terminal_reward else v[index[s]])
                   for a, s in enumerate(nxt))
    return v


def critics(mdp: TokenMDP, seed: int) -> dict[str, torch.Tensor]:
    """Per-state critics V'(s): the exact one, and three wrong ones."""
    depth = torch.tensor([len(p) for p in mdp.prefixes], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    return {
        "V^pi (exact)": exact_values(mdp),
        "zero": torch.zeros(len(mdp.prefixes), dtype=torch.float64),
        "random N(0,1)": torch.randn(len(mdp.prefixes), generator=gen, dtype=torch.float64),
        # RM-like: blind to content, -1 at the first response position rising to +1 at the last
        "RM-like ramp": -1.0 + 2.0 * depth / max(int(mdp.mask.shape[1]) - 1, 1),
    }


@dataclass
class Eq8Result:
    rel_bias: dict[str, dict[float, float]]  # critic -> lambda -> ||g_GAE - g_true|| / ||g_true||
    baseline_rel: dict[str, float]  # critic -> ||E[sum_t V'(s_t) grad log pi]|| / ||g_true||
    eq8_max_err: float  # max |A_gae - A_eq8| over responses, tokens, critics and lambdas
    gae_dtype: torch.dtype  # the dtype the advantages were computed in
    n_responses: int
    n_states: int


def run_check(n_tokens: int = 2, horizon: int = 6, eos: bool = True,
              lambdas: tuple[float, ...] = (0.0, 0.5, 0.95, 1.0), seed: int = 0) -> Eq8Result:
    """Exact relative bias of the GAE policy gradient for each critic and lambda, plus the Eq. 8 checks."""
    if not lambdas or any(not 0.0 <= lam <= 1.0 for lam in lambdas):
        raise ValueError(f"lambdas must be a non-empty list of values in [0, 1], got {lambdas}")
    mdp = build_mdp(n_tokens, horizon, eos, seed)
    g_true = true_gradient(mdp)
    g_norm = float(g_true.norm())
    if g_norm < 1e-12:
        raise ValueError(f"the policy gradient is zero for seed {seed} (all rewards equal?): pick another seed")
    rel_bias, baseline_rel, eq8_err, dtype = {}, {}, 0.0, None
    crit = critics(mdp, seed)
    jobs = [(name, lam) for name in crit for lam in lambdas]
    for name, lam in tqdm(jobs, desc="critic x lambda", leave=False):
        values = crit[name][mdp.states] * mdp.mask  # values[b, t] = V'(s_t)
        adv, _ = compute_gae(mdp.rewards, values, mdp.mask, gamma=1.0, lam=lam)
        adv_eq8 = eq8_advantages(mdp.rewards, values, mdp.mask, gamma=1.0, lam=lam)
        eq8_err = max(eq8_err, float((adv.double() - adv_eq8.double()).abs().max()))
        dtype = adv.dtype
        g_gae = expected_score_gradient(mdp, adv)
        rel_bias.setdefault(name, {})[lam] = float((g_gae - g_true).norm()) / g_norm
        baseline_rel[name] = float(expected_score_gradient(mdp, values).norm()) / g_norm
    return Eq8Result(rel_bias, baseline_rel, eq8_err, dtype, len(mdp.states), len(mdp.prefixes))


def plot(res: Eq8Result, path: Path) -> None:
    names, lams = list(res.rel_bias), list(next(iter(res.rel_bias.values())))
    grid = np.array([[res.rel_bias[n][lam] for lam in lams] for n in names])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    im = ax.imshow(np.log10(np.maximum(grid, 1e-17)), cmap="viridis", vmin=-17, vmax=1, aspect="auto")
    for i, j in itertools.product(range(len(names)), range(len(lams))):
        ax.text(j, i, f"{grid[i, j]:.1e}", ha="center", va="center", color="w" if grid[i, j] < 1e-3 else "k")
    ax.set(xticks=range(len(lams)), xticklabels=[f"λ={lam:g}" for lam in lams], yticks=range(len(names)),
           yticklabels=names, title="relative bias ‖g_GAE − g_true‖ / ‖g_true‖")
    fig.colorbar(im, ax=ax, label="log10 relative bias")
    base = np.maximum([res.baseline_rel[n] for n in names], 1e-17)
    bx.barh(range(len(names)), base, color="tab:gray")
    for i, b in enumerate(base):
        bx.text(b * 3, i, f"{b:.1e}" if b > 1e-17 else "0", va="center")
    bx.set(xscale="log", xlim=(1e-18, 1), yticks=range(len(names)), yticklabels=[""] * len(names),
           title="baseline term ‖E[Σ V'(s_t) ∇log π]‖ / ‖g_true‖")
    bx.invert_yaxis()  # rows top to bottom, as in the heat map
    fig.suptitle(f"Eq. 8 identity: max |A_gae − A_eq8| = {res.eq8_max_err:.1e} ({res.gae_dtype})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(res: Eq8Result, args: Args, seconds: float) -> str:
    lams = list(next(iter(res.rel_bias.values())))
    rows = [f"| {n} | " + " | ".join(f"{b:.2e}" for b in res.rel_bias[n].values())
            + f" | {res.baseline_rel[n]:.1e} |" for n in res.rel_bias]
    tol = 1e-5
    exact = res.rel_bias["V^pi (exact)"]
    wrong = [b for n, d in res.rel_bias.items() if n != "V^pi (exact)" for lam, b in d.items() if lam < 1]
    lam1 = [d[1.0] for d in res.rel_bias.values() if 1.0 in d]
    facts = [
        f"- Eq. 8 identity: max |A_gae - A_eq8| = {res.eq8_max_err:.1e} over all responses, tokens, critics "
        f"and lambdas ({'holds' if res.eq8_max_err < tol else 'FAILS'} at tolerance {tol:g}).",
        f"- Baseline term: max ||E[sum_t V'(s_t) grad log pi]|| / ||g_true|| = {max(res.baseline_rel.values()):.1e} "
        f"over critics ({'zero' if max(res.baseline_rel.values()) < tol else 'NOT zero'}).",
        f"- lambda = 1: max relative bias over critics = {max(lam1):.1e} "
        f"({'unbiased' if max(lam1) < tol else 'BIASED'} at tolerance {tol:g})." if lam1 else "- lambda = 1 not run.",
        f"- V' = V^pi: max relative bias over lambdas = {max(exact.values()):.1e} "
        f"({'unbiased' if max(exact.values()) < tol else 'BIASED'} at tolerance {tol:g}).",
        f"- lambda < 1 with a wrong critic: relative bias {min(wrong):.1e} to {max(wrong):.1e} "
        f"({'biased, every one' if min(wrong) >= tol else 'NOT biased for some'} at tolerance {tol:g})." if wrong else "",
    ]
    return "\n".join([
        "# Equation 8 by exact enumeration (paper §3.3)", "",
        f"Token MDP: {args.n_tokens} content tokens{' + EOS' if args.eos else ''}, horizon {args.horizon}, "
        f"{res.n_responses} responses, {res.n_states} states, tabular softmax policy (seed {args.seed}), "
        f"terminal +-1 reward, gamma = 1. Gradients and critics in float64; advantages from gae.py in "
        f"{res.gae_dtype}. Runtime {seconds:.1f} s.", "",
        "Relative bias ||g_GAE - g_true|| / ||g_true|| of E[sum_t A_t grad log pi(a_t|s_t)], and the "
        "baseline term alone:", "",
        "| critic V' | " + " | ".join(f"lambda={lam:g}" for lam in lams) + " | baseline term |",
        "|---|" + "---|" * (len(lams) + 1), *rows, "", *[f for f in facts if f], "",
    ])


def main(args: Args) -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    start = time.perf_counter()
    res = run_check(args.n_tokens, args.horizon, args.eos, args.lambdas, args.seed)
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    png, md = args.out / "eq8_check.png", args.out / "eq8_check.md"
    plot(res, png)
    md.write_text(markdown(res, args, seconds))
    print(md.read_text())
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    run_cli(main, Args, __doc__)
