"""analysis/collapse.py: the length ratio, the summary line from finished runs, and (slow) both runs
through train.py on a micro setting."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import config
from analysis import ablation, collapse

from test_train import MICRO

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"collapse ppo_length_ratio=(\S+) vcppo_length_ratio=(\S+) ppo_final_acc=(\S+) "
                  r"vcppo_final_acc=(\S+) sft_acc=(\S+)")
SIGNED = r"[+-]\d+\.\d{3} \([+-](\d+\.\d|nan) SE\)"
SHARE = r"(\d\.\d{3}|nan)"  # nan: no complete response to judge the ORM on
FIG2 = re.compile(rf"fig2 orm_first_quarter={SIGNED} pretrained_first_quarter={SIGNED} orm_auc={SHARE} "
                  rf"orm_sign_acc={SHARE} base_rate={SHARE}")


def test_length_ratio_is_the_lowest_moving_average_over_the_first_step():
    assert collapse.length_ratio([100, 100, 100, 100, 100, 50, 50, 50, 50, 50, 90]) == pytest.approx(0.5)
    assert collapse.length_ratio([100, 40, 100, 100, 100, 100]) == pytest.approx(0.88)  # one dip is averaged
    assert collapse.length_ratio([200, 100], window=5) == pytest.approx(0.75)  # shorter than the window
    with pytest.raises(ValueError):
        collapse.length_ratio([])


def fake_run(out_dir: Path, variant: str, steps: int, lengths: list[float], acc: float,
             extra: tuple[str, ...] = (), seed: int = 0) -> None:
    """A finished cell as train.py leaves it, with collapse.py's own flags (and `extra` ones after them)."""
    flags = ["--out-dir", str(out_dir), "--run-name", f"ablation__{variant}__seed{seed}", "--seed", str(seed),
             "--preset", "tiny-long", "--steps", str(steps), *extra, *ablation.VARIANTS[variant][0]]
    run = out_dir / f"ablation__{variant}__seed{seed}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(config.parse_config(flags))))
    clip_ratio = "response_length/truncated_frac" if variant == "ppo" else "response_length/clip_ratio"  # an old run
    rows = [{"step": i, "response_length/mean": n, clip_ratio: 0.1, "reward/accuracy": 0.2,
             "advantage/pos_bin0": 0.3, "advantage/pos_bin1": 0.2, "advantage/pos_bin2": 0.1,
             "advantage/pos_bin3": 0.0} for i, n in enumerate(lengths)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"sft": {"pass@1": 0.25, "mean_length": 550.0},
                                                  "ppo": {"pass@1": acc, "mean_length": lengths[-1]}}))


def test_reads_both_runs_and_prints_the_summary_line_last(tmp_path, capsys):
    fake_run(tmp_path, "ppo", 6, [600, 500, 300, 200, 200, 200], 0.1)
    fake_run(tmp_path, "vc-ppo", 6, [600, 620, 640, 650, 660, 670], 0.4)
    args = collapse.Args(steps=6, out=tmp_path / "out", out_dir=str(tmp_path), read_only=True, fig2_rollouts=0)
    m = collapse.main(args, [])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert LINE.fullmatch(last), last
    assert last == ("collapse ppo_length_ratio=0.467 vcppo_length_ratio=1.057 ppo_final_acc=0.100 "
                    "vcppo_final_acc=0.400 sft_acc=0.250")  # ppo: (500+300+200+200+200)/5 / 600
    assert m["runs"]["ppo"]["first_step_advantage_by_quarter"] == [0.3, 0.2, 0.1, 0.0]
    # a run logged before response_length/clip_ratio took verl's name is read under its old name
    assert [m["runs"][run]["curves"]["response_length/clip_ratio"] for run in ("ppo", "vc-ppo")] == [[0.1] * 6] * 2
    assert (tmp_path / "out" / "collapse_seed0.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "collapse_seed0.json").read_text())["sft_acc"] == 0.25


def test_runs_that_did_not_finish_are_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="did not finish"):
        collapse.main(collapse.Args(out_dir=str(tmp_path), read_only=True, fig2_rollouts=0), [])


@pytest.mark.slow
def test_micro_runs_of_both_end_with_the_summary_line(tmp_path):
    # The short task's lines keep this under a minute; the long task's own pi_SFT cache: test_sft.py.
    cmd = [sys.executable, str(ROOT / "analysis" / "collapse.py"), "--steps", "2", "--out", str(tmp_path / "out"),
           "--out-dir", str(tmp_path / "runs"), "--fig2-rollouts", "4", "--", *MICRO, "--value-pretrain-steps", "1", "--task-length", "short"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    *_, fig2, last = done.stdout.strip().splitlines()
    assert LINE.fullmatch(last), last
    assert FIG2.fullmatch(fig2), fig2  # Fig. 2 under both critics, read from this seed's runs
    assert (tmp_path / "out" / "fig2_seed0" / "advantage_bias.md").is_file()
    for run in ("ppo", "vc-ppo"):
        cfg = json.loads((tmp_path / "runs" / f"ablation__{run}__seed0" / "config.json").read_text())
        assert (cfg["preset"], cfg["steps"], cfg["critic_init"]) == ("tiny-long", 2, "rm" if run == "ppo" else "sft")
    assert (tmp_path / "out" / "collapse_seed0.md").read_text().strip().endswith(last)
