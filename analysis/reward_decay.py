"""Reward signal decay in the critic's GAE target (paper §3.1, the second cause of the collapse).

With a single terminal reward r and lambda < 1, the critic target of a token d positions before the
last one receives only lambda^d * r (the paper writes lambda^(T-t), T the last token's index). The
script plots that weight against distance from the end for several lambdas twice: from the formula,
and measured through gae.compute_gae (returns for a unit terminal reward with zero values, gamma = 1),
so the figure checks the code as well as the formula.

    python analysis/reward_decay.py                   # writes runs/analysis/reward_decay.{png,md}
    python analysis/reward_decay.py --lambdas 0.9 0.99 --max-distance 2000 --out /tmp/decay
"""
import time
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from analysis import run_cli
from gae import compute_gae


@dataclass
class Args:
    out: Path = Path("runs/analysis")
    """folder that receives reward_decay.png and reward_decay.md"""
    lambdas: tuple[float, ...] = (0.9, 0.95, 0.99, 1.0)
    """GAE lambdas to plot"""
    max_distance: int = 5000
    """longest distance from the last token (the response has max_distance + 1 tokens)"""
    table_distances: tuple[int, ...] | None = None
    """distances listed in the markdown table; None: those of 10, 100, 1000, 5000 within --max-distance,
    and --max-distance"""


@dataclass
class DecayCurves:
    lambdas: list[float]
    distance: np.ndarray  # [D] 0 .. max_distance; distance d is token t = L - 1 - d
    formula: np.ndarray  # [n_lambdas, D] lambda^d in float64
    code: np.ndarray  # [n_lambdas, D] returns from gae.compute_gae, read back by distance
    code_dtype: torch.dtype

    def max_abs_deviation(self) -> float:
        return float(np.abs(self.code - self.formula).max())

    def tiny(self) -> float:
        """Smallest normal number of the code's dtype: below it the code cannot be precise."""
        return torch.finfo(self.code_dtype).tiny

    def max_rel_deviation(self) -> float:
        ok = self.formula >= self.tiny()
        return float((np.abs(self.code - self.formula)[ok] / self.formula[ok]).max())


def decay_curves(lambdas: tuple[float, ...], max_distance: int) -> DecayCurves:
    """lambda^d from the formula and from gae.compute_gae, for d = 0 .. max_distance."""
    if not lambdas or any(not 0.0 <= lam <= 1.0 for lam in lambdas):
        raise ValueError(f"lambdas must be a non-empty list of values in [0, 1], got {lambdas}")
    if max_distance < 0:
        raise ValueError(f"max_distance must be >= 0, got {max_distance}")
    length = max_distance + 1
    distance = np.arange(length)
    formula = np.array([lam ** distance.astype(np.float64) for lam in lambdas])
    rewards = torch.zeros(1, length)
    rewards[0, -1] = 1.0  # unit outcome reward on the last token
    values, mask = torch.zeros(1, length), torch.ones(1, length)  # zero critic: the target is the pure signal
    code, dtype = [], None
    for lam in tqdm(lambdas, desc="compute_gae per lambda", leave=False):
        _, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=lam)
        code.append(returns[0].flip(0).double().numpy())  # flip: index = distance from the last token
        dtype = returns.dtype
    return DecayCurves(list(lambdas), distance, formula, np.array(code), dtype)


def plot(c: DecayCurves, path: Path) -> None:
    fig, (near, far) = plt.subplots(1, 2, figsize=(11, 4))
    for i, lam in enumerate(c.lambdas):
        color = f"C{i}"
        for ax, lim in ((near, min(300, len(c.distance))), (far, len(c.distance))):
            d, mark = c.distance[:lim], slice(0, lim, max(1, lim // 40))  # sparse circles: line stays visible
            ax.plot(d, c.formula[i, :lim], color=color, label=f"λ={lam:g}: λ^d")
            ax.plot(d[mark], c.code[i, :lim][mark], "o", ms=3.5, mfc="none", color=color,
                    label=f"λ={lam:g}: gae.compute_gae" if ax is near else None)
    near.set(xlabel="distance d from the last token", ylabel="weight of the terminal reward in the critic target",
             title="first 300 tokens (linear)")
    far.set(xlabel="distance d from the last token", yscale="log", ylim=(1e-45, 3), title="full range (log)")
    near.legend(fontsize=7, ncol=2, loc="upper right", bbox_to_anchor=(1, 0.94))  # below the λ=1 line
    fig.suptitle(f"Reward signal decay λ^d (lines) vs gae.compute_gae returns (circles); "
                 f"max |code − formula| = {c.max_abs_deviation():.1e}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(c: DecayCurves, table_distances: tuple[int, ...], seconds: float) -> str:
    head = "| distance d | " + " | ".join(f"lambda={lam:g}" for lam in c.lambdas) + " |"
    rows = [f"| {d} | " + " | ".join(f"{c.formula[i, d]:.3g} ({c.code[i, d]:.3g})" for i in range(len(c.lambdas)))
            + " |" for d in table_distances]
    underflow = (c.code == 0) & (c.formula > 0)
    subnormal = (c.code > 0) & (c.code < c.tiny())
    horizon = ", ".join(f"{1 / (1 - lam):.0f} (lambda={lam:g})" for lam in c.lambdas if lam < 1)
    return "\n".join([
        "# Reward signal decay (paper §3.1)", "",
        "Weight lambda^d of a unit terminal reward in the critic target of the token d positions before the "
        "last one (gamma = 1, zero values). Each cell: formula in float64 (gae.compute_gae returns in "
        f"{c.code_dtype}).", "", head, "|---|" + "---|" * len(c.lambdas), *rows, "",
        f"- Max |code - formula| over d = 0..{c.distance[-1]} and all lambdas: {c.max_abs_deviation():.2e}.",
        f"- Max relative deviation where the weight is at least {c.tiny():.2g} (the smallest normal "
        f"{c.code_dtype}): {c.max_rel_deviation():.2e}.",
        f"- Weights under that limit (float underflow): the code returns exactly 0 at {int(underflow.sum())} and a "
        f"subnormal number at {int(subnormal.sum())} of the {c.code.size} points.",
        f"- Effective horizon 1/(1-lambda): {horizon or 'none (lambda = 1 does not decay)'} tokens.",
        f"- Runtime {seconds:.2f} s.", "",
    ])


def main(args: Args) -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.table_distances is None:
        args = replace(args, table_distances=tuple(sorted({d for d in (10, 100, 1000, 5000) if d <= args.max_distance}
                                                          | {args.max_distance})))
    if any(not 0 <= d <= args.max_distance for d in args.table_distances):
        raise ValueError(f"table_distances {args.table_distances} must lie in [0, max_distance={args.max_distance}]")
    start = time.perf_counter()
    curves = decay_curves(args.lambdas, args.max_distance)
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    png, md = args.out / "reward_decay.png", args.out / "reward_decay.md"
    plot(curves, png)
    md.write_text(markdown(curves, args.table_distances, seconds))
    print(md.read_text())
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    run_cli(main, Args, __doc__)
