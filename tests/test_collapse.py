"""analysis/collapse.py (Fig. 1 by intervention): the arms it plans, the ratios and recovery it reads,
the summary line from finished runs, and (slow) a micro grid through train.py."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support import config
from analysis import collapse

from test_train import MICRO

ROOT = Path(__file__).resolve().parents[1]
SHARE = r"(\d+\.\d{3}|nan|n/a)"
LINE = re.compile(rf"collapse offset=[+-]\d+ ppo_length_ratio={SHARE} vcppo_length_ratio={SHARE} "
                  rf"ppo_acc_ratio={SHARE} vcppo_acc_ratio={SHARE} ppo_final_acc={SHARE} vcppo_final_acc={SHARE} "
                  rf"sft_acc={SHARE}")


def test_length_ratio_and_recovery_read_the_moving_average():
    lengths = [100, 100, 100, 100, 100, 50, 50, 50, 50, 50, 90, 100, 100, 100, 100]
    assert collapse.length_ratio(lengths) == pytest.approx(0.5)
    # moving averages from step 0: 100, 90, 80, 70, 60, 50, 58, 68, 78, 88, 98: trough at 5, >= 90 at 10
    assert collapse.recovery_steps(lengths) == 5
    assert collapse.recovery_steps([100, 95, 96, 94, 97, 99]) == 0  # never below 0.9
    assert collapse.recovery_steps([100, 50, 50, 50, 50, 50, 50]) is None  # not back within the run
    assert collapse.length_ratio([200, 100], window=5) == pytest.approx(0.75)  # shorter than the window
    with pytest.raises(ValueError):
        collapse.length_ratio([])


def test_a_run_logged_before_the_advantage_by_quarter_was_is_read_without_it():
    """A first row without `advantage/pos_bin*` (a run older than that metric) stopped collapse.py
    with a KeyError traceback; the figure's panel now has nothing of that run to draw."""
    rows = [{"step": i, "response_length/mean": 100.0, "reward/accuracy": 0.2} for i in range(3)]
    run = collapse.measure_run({"seed": 0, "wall_s": None, "metrics": rows,
                                "summary": {"sft": {"pass@1": 0.2}, "ppo": {"pass@1": 0.3}}})
    assert run["first_step_advantage_by_quarter"] == [None] * 4 and run["final_acc"] == 0.3


def test_recovery_counts_steps_from_the_trough_and_calibration_the_first_small_error():
    assert collapse.recovery_steps([100, 40, 100, 100, 100, 100, 100]) == 2  # moving averages 88, 88, 100
    assert collapse.calibration_steps([-1.4, -0.9, -0.3, -0.19, 0.5]) == 3
    assert collapse.calibration_steps([0.1, -1.0]) == 0 and collapse.calibration_steps([None, None]) is None
    assert collapse.calibration_steps([-1.4, -0.9]) is None


def test_the_arms_carry_their_offset_in_flags_and_run_name_and_dose_adds_the_other_offsets(tmp_path):
    args = collapse.Args(out_dir=str(tmp_path), arms=("ppo", "vc-ppo", "grpo", "dose"), seeds=(0, 1), offset=-3)
    runs = collapse.plan(args, ["--steps", "7"])
    assert list(runs) == ["ppo", "vc-ppo", "grpo", "ppo-offset-2", "ppo-offset-1", "ppo-offset+0", "ppo-offset+1"]
    ppo, vc, grpo = runs["ppo"][1].config, runs["vc-ppo"][0].config, runs["grpo"][0].config
    assert (ppo.critic_init_offset, ppo.value_pretrain_steps, ppo.lam_critic, ppo.seed) == (-3.0, 0, 0.95, 1)
    assert (vc.critic_init_offset, vc.value_pretrain_steps, vc.lam_critic) == (-3.0, 20, 1.0)
    assert (grpo.estimator, grpo.critic_init_offset, ppo.steps) == ("grpo", 0.0, 7)  # flags after -- win
    assert runs["ppo"][0].dir.name == "collapse__ppo__offset-3__seed0"
    assert runs["ppo-offset+1"][0].dir.name == "collapse__ppo__offset+1__seed0"
    assert runs["ppo-offset+1"][0].config.critic_init_offset == 1.0
    with pytest.raises(ValueError, match="unknown arm"):
        collapse.plan(dataclasses.replace(args, arms=("ppo2",)), [])
    # A finished run of another length is not averaged with the others (it was, in silence).
    fake_run(runs["ppo"][0], [100.0] * 7, [0.5] * 7, None, 0.5)
    with pytest.raises(config.ConfigError, match=r"collapse__ppo__offset-3__seed0 was made with other settings "
                                                 r"\(--steps 7 -> 30\)"):
        collapse.plan(args, [])


def fake_run(run: "collapse.ablation.Run", lengths: list[float], accuracy: list[float], error: float | None,
             final: float, sft: float = 0.25) -> None:
    """A finished run as train.py leaves it: config.json, metrics.jsonl, summary.json."""
    run.dir.mkdir(parents=True)
    (run.dir / "config.json").write_text(json.dumps(dataclasses.asdict(run.config)))
    rows = [{"step": i, "response_length/mean": n, "reward/accuracy": a, "advantage/pos_bin0": 0.3,
             "advantage/pos_bin1": 0.2, "advantage/pos_bin2": 0.1, "advantage/pos_bin3": 0.0}
            for i, (n, a) in enumerate(zip(lengths, accuracy))]
    if error is not None:
        rows[0] |= {"critic/value_error/all": error, "critic/value_error/first_quarter": error - 0.1,
                    "advantage/last_token": 1.0, "advantage/other_tokens": 0.2}
    (run.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run.dir / "summary.json").write_text(json.dumps({"sft": {"pass@1": sft}, "ppo": {"pass@1": final}}))


def test_reads_the_runs_checks_the_goals_and_prints_the_summary_line_last(tmp_path, capsys):
    args = collapse.Args(out=tmp_path / "out", out_dir=str(tmp_path), arms=("ppo", "vc-ppo", "grpo", "dose"),
                         seeds=(0, 1), steps=6, read_only=True)
    runs = collapse.plan(args, [])
    collapsed, kept = [600, 500, 300, 200, 200, 200], [600, 620, 640, 650, 660, 670]
    for i, run in enumerate(runs["ppo"]):  # accuracy ratio: 5 x 0.05 / 5 / 0.25 = 0.2
        fake_run(run, collapsed, [0.2, 0.05, 0.05, 0.05, 0.05, 0.05], error=-1.4, final=0.1 + 0.1 * i)
    for run in runs["vc-ppo"]:
        fake_run(run, kept, [0.25] * 6, error=-0.1, final=0.3)
    for run in runs["grpo"]:
        fake_run(run, kept, [0.25] * 6, error=None, final=0.3)
    for arm, ratio_length in (("ppo-offset-3", 100), ("ppo-offset-1", 500), ("ppo-offset+0", 600), ("ppo-offset+1", 620)):
        for seed, run in enumerate(runs[arm]):  # seed 1 does not rise from -1 to 0
            fake_run(run, [600] + [ratio_length - 200 * (seed and arm == "ppo-offset+0")] * 5, [0.25] * 6,
                     error=collapse.arm_flags(-2.0)[arm][1] + 0.6, final=0.2)
    m = collapse.main(args, [])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert LINE.fullmatch(last), last
    assert last == ("collapse offset=-2 ppo_length_ratio=0.467 vcppo_length_ratio=1.057 ppo_acc_ratio=0.200 "
                    "vcppo_acc_ratio=1.000 ppo_final_acc=0.150 vcppo_final_acc=0.300 sft_acc=0.250")
    assert m["runs"]["ppo"][0]["recovery_steps"] is None and m["runs"]["vc-ppo"][0]["recovery_steps"] == 0
    assert m["goals"][:2] == [
        "plain PPO at offset -2 collapses (length ratio <= 0.6 and accuracy ratio <= 0.5): 2 of 2 seeds",
        "VC-PPO from the same offset holds (length ratio >= 0.85, accuracy ratio >= 0.8, final pass@1 >= pi_SFT's): "
        "2 of 2 seeds"]
    assert m["goals"][2].startswith("seed 0: length ratio by offset -3 -2 -1 +0 +1: 0.17 0.47 0.83 1.00 1.03 (rises")
    assert "0.83 0.67 1.03 (does NOT rise" in m["goals"][3]
    md = (tmp_path / "out" / "collapse.md").read_text()
    assert "| ppo (offset -2) | 0,1 | -1.400 ± 0.000 | -1.500 ± 0.000 | +1.000 ± 0.000 | +0.200 ± 0.000 | -, - | 0.467 ± 0.000 " in md
    assert "| grpo | 0,1 | - | - | - | - | -, - | 1.057 ± 0.000 |" in md
    assert "Fig. 2 from the same runs: mean advantage (lambda 0.95, before whitening)" in md  # the runs' lambda_actor
    assert math.isclose(json.loads((tmp_path / "out" / "collapse.json").read_text())["sft_acc"], 0.25)
    assert (tmp_path / "out" / "collapse.png").stat().st_size > 0


def test_read_only_leaves_out_what_did_not_finish_and_stops_when_nothing_did(tmp_path, capsys):
    args = collapse.Args(out=tmp_path / "out", out_dir=str(tmp_path), arms=("ppo", "vc-ppo"), seeds=(0, 1),
                         read_only=True)
    with pytest.raises(SystemExit, match="did not finish"):
        collapse.main(args, [])
    runs = collapse.plan(args, [])
    fake_run(runs["ppo"][0], [600, 300], [0.2, 0.1], error=-1.0, final=0.1)
    fake_run(runs["ppo"][1], [600, 150], [0.2, 0.1], error=-1.0, final=0.3)  # ratios 450 / 600 and 375 / 600
    fake_run(runs["vc-ppo"][1], [600, 600], [0.2, 0.2], error=0.0, final=0.3)
    m = collapse.main(args, [])
    out = capsys.readouterr().out
    assert f"left out (not finished or not started): {runs['vc-ppo'][0].dir}" in out
    assert [r["seed"] for r in m["runs"]["vc-ppo"]] == [1] and m["seeds"] == [0, 1]
    assert out.strip().splitlines()[-1].startswith("collapse offset=-2 ppo_length_ratio=0.688 vcppo_length_ratio=1.000")


def test_no_seed_or_no_arm_is_an_error_not_an_empty_report(tmp_path):
    """`--seeds` or `--arms` alone wrote collapse.md with no row and a summary line of n/a and nan."""
    for empty in ({"seeds": ()}, {"arms": ()}):
        args = collapse.Args(out=tmp_path / "out", out_dir=str(tmp_path), **empty)
        with pytest.raises(ValueError, match=f"--{next(iter(empty))} is empty"):
            collapse.main(args, [])
    assert not (tmp_path / "out").exists()


def test_no_ppo_step_is_refused_before_anything_trains(tmp_path, monkeypatch):
    """--steps 0 (train.py takes it) trained pi_SFT and every run, then stopped in an IndexError."""
    monkeypatch.setattr(collapse.ablation, "run_grid", lambda runs, jobs: pytest.fail("started train.py"))
    with pytest.raises(ValueError, match="--steps must be >= 1"):
        collapse.main(collapse.Args(out=tmp_path / "out", out_dir=str(tmp_path), steps=0), [])
    with pytest.raises(ValueError, match="--steps must be >= 1"):
        collapse.ablation.main(collapse.ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path)), ["--steps", "0"])
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_micro_grid_through_train_py_ends_with_the_summary_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "analysis" / "collapse.py"), "--steps", "2", "--out", str(tmp_path / "out"),
           "--out-dir", str(tmp_path / "runs"), "--arms", "ppo", "ppo-orm", "--", *MICRO]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert LINE.fullmatch(last) and last.startswith("collapse offset=-2 "), last
    m = json.loads((tmp_path / "out" / "collapse.json").read_text())
    ppo = config.Config(**{**json.loads((tmp_path / "runs" / "collapse__ppo__offset-2__seed0" / "config.json")
                                        .read_text()), "task_difficulty": None})
    assert (ppo.critic_init_offset, ppo.value_pretrain_steps, ppo.lam_critic, ppo.steps) == (-2.0, 0, 0.95, 2)
    # pi_SFT's returns lie in [-1, 1] and a fresh head starts near 0: offset -2 starts every value too low
    assert m["runs"]["ppo"][0]["initial_error"] < -0.5
    assert (tmp_path / "runs" / "_shared" / "orm" / "quality.json").is_file()
    assert (tmp_path / "out" / "collapse.md").read_text().strip().endswith(last)


def test_each_arm_is_also_read_against_the_same_seeds_grpo_run(tmp_path):
    """The length ratio divides by the first step's batch, one draw that every arm of a seed shares:
    a run with no trend reads 0.77-1.13. Against the same seed's GRPO run (the same first batch and
    prompts) that draw cancels: an arm that holds reads 1 on every seed, whatever the first batch."""
    args = collapse.Args(out=tmp_path / "out", out_dir=str(tmp_path), arms=("vc-ppo", "decoupled-gae", "grpo"),
                         seeds=(0, 1), steps=6, read_only=True)
    runs = collapse.plan(args, [])
    for seed, first in ((0, 500), (1, 700)):  # an unlucky short and a lucky long first batch
        level = [first, 600, 600, 600, 600, 600]
        fake_run(runs["grpo"][seed], level, [0.25] * 6, error=None, final=0.3)
        fake_run(runs["vc-ppo"][seed], level, [0.25] * 6, error=-0.1, final=0.3)
        fake_run(runs["decoupled-gae"][seed], [first, 600, 450, 450, 450, 450], [0.25] + [0.2] * 5, error=-1.0,
                 final=0.3)
    m = collapse.measure(collapse.plan(args, []), -2.0)
    # Lowest 5-step means: GRPO and vc-ppo 580 (seed 0) and 600 (seed 1), decoupled-gae 480 on both.
    assert [r["length_ratio"] for r in m["runs"]["vc-ppo"]] == pytest.approx([580 / 500, 600 / 700])  # the draw
    assert [r["length_vs_grpo"] for r in m["runs"]["vc-ppo"]] == pytest.approx([1.0, 1.0])
    assert [r["length_vs_grpo"] for r in m["runs"]["decoupled-gae"]] == pytest.approx([480 / 580, 480 / 600])
    assert [r["acc_vs_grpo"] for r in m["runs"]["decoupled-gae"]] == pytest.approx([0.8, 0.8])  # 0.2 against 0.25
    # A run cut short is read against GRPO's same steps only: GRPO's own later trough does not count.
    curves = lambda lengths: {"response_length/mean": lengths, "reward/accuracy": [0.25] * len(lengths)}  # noqa: E731
    short = {"grpo": [{"seed": 0, "curves": curves([600] * 5 + [300] * 5)}],
             "ppo": [{"seed": 0, "curves": curves([600] * 5)}]}
    collapse.against_grpo(short)
    assert short["ppo"][0]["length_vs_grpo"] == 1.0
    table = collapse.markdown(m, runs)
    assert "| length ratio | length vs GRPO | accuracy ratio | accuracy vs GRPO |" in table
    # These runs logged no advantage/pos_bin_tokens: their quarters are of each response's own length.
    assert "over each quarter of each response's own length (runs logged before" in table
    for rows in m["runs"].values():
        for r in rows:
            r["fixed_position_bins"] = True
    assert "over each quarter of the token positions up to --max-new-tokens" in collapse.markdown(m, runs)
    assert [r["length_vs_grpo"] for r in collapse.measure(collapse.plan(
        dataclasses.replace(args, arms=("vc-ppo",)), []), -2.0)["runs"]["vc-ppo"]] == [None, None]


def test_the_no_trend_band_is_what_the_length_ratio_reads_by_chance_at_the_runs_spread():
    """The length ratio of a run with no trend is not 1: its first step is one batch, and the lowest
    moving average sits below the level. `no_trend_band` simulates it at the runs' own spread."""
    rng = np.random.default_rng(1)
    quiet, noisy = ([list(500 + sd * rng.standard_normal(30)) for _ in range(6)] for sd in (2.0, 40.0))
    flat = collapse.no_trend_band([[500.0] * 30] * 3)
    assert (flat["low"], flat["median"], flat["high"]) == (1.0, 1.0, 1.0)
    q, n = collapse.no_trend_band(quiet), collapse.no_trend_band(noisy)
    assert q["spread"] == pytest.approx(2.0, rel=0.4) and n["spread"] == pytest.approx(40.0, rel=0.4)
    assert n["low"] < q["low"] < q["median"] < 1.0 < q["high"] < n["high"]  # the trough sits below the level
    assert math.isnan(collapse.no_trend_band([[500.0, 510.0]] * 3)["low"])  # two steps show no spread
    # One run's own draws of the ratio fall in its band about as often as the band says (90%).
    inside = [n["low"] <= collapse.length_ratio(list(500 + 40 * rng.standard_normal(30))) <= n["high"]
              for _ in range(400)]
    assert 0.8 < np.mean(inside) < 0.97


def test_the_reward_models_are_judged_on_complete_responses(tmp_path):
    """A cut response is a wrong one by its reward and ends without EOS: the easiest to rank. The table
    read quality.json's "all"; it reads "complete", and shows no sign accuracy for Bradley-Terry."""
    args = collapse.Args(out_dir=str(tmp_path), arms=("ppo", "vc-ppo"), seeds=(0,), steps=6, read_only=True)
    runs = collapse.plan(args, [])
    for arm in ("ppo", "vc-ppo"):
        fake_run(runs[arm][0], [600] * 6, [0.25] * 6, error=-1.0, final=0.3)
    m = collapse.measure(runs, -2.0)
    quality = lambda n, auc, sign: {"responses": n, "auc": auc, "sign_accuracy": sign, "base_rate": 0.75}  # noqa: E731
    m["reward_models"] = {"ppo-orm": {"loss": "mse", "all": quality(12, 0.9, 0.9), "complete": quality(10, 0.7, 0.8)},
                          "ppo-bt": {"loss": "bradley-terry", "all": quality(12, 0.8, 0.6), "complete": quality(10, 0.6, 0.5)}}
    rows = [line for line in collapse.markdown(m, runs).splitlines() if line.startswith("| ppo-")]
    assert rows == ["| ppo-orm | mse | 10 | 0.700 | 0.800 | 0.750 |", "| ppo-bt | bradley-terry | 10 | 0.600 | - | 0.750 |"]


def test_fig2_is_labelled_with_the_runs_own_lambda_actor(tmp_path):
    """The Fig. 2 table and panel said "lambda 0.95" whatever lambda_actor the runs were given after `--`."""
    args = collapse.Args(out_dir=str(tmp_path), arms=("ppo", "vc-ppo"), seeds=(0,), steps=6, read_only=True)
    runs = collapse.plan(args, ["--lam-actor", "0.99"])
    for arm in ("ppo", "vc-ppo"):
        fake_run(runs[arm][0], [600] * 6, [0.25] * 6, error=-1.0, final=0.3)
    assert collapse.measure(runs, -2.0)["lambda_actor"] == "lambda 0.99"
