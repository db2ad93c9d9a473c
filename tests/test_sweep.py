"""analysis/sweep.py: which cached models a cell reuses, and the table from finished runs."""
import dataclasses
import json
from pathlib import Path

import pytest

from support import config
from analysis import ablation, sweep


def fake_run(out_dir: Path, variant: str, steps: int, lengths: list[float], acc: float,
             extra: tuple[str, ...] = (), seed: int = 0) -> None:
    """A finished cell as train.py leaves it, with the long task's flags (and `extra` ones after them)."""
    flags = ["--out-dir", str(out_dir), "--run-name", f"ablation__{variant}__seed{seed}", "--seed", str(seed),
             "--preset", "tiny-long", "--steps", str(steps), *extra, *ablation.VARIANTS[variant][0]]
    run = out_dir / f"ablation__{variant}__seed{seed}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(config.parse_config(flags))))
    rows = [{"step": i, "response_length/mean": n, "reward/accuracy": 0.2,
             "advantage/pos_bin0": 0.3, "advantage/pos_bin1": 0.2, "advantage/pos_bin2": 0.1,
             "advantage/pos_bin3": 0.0} for i, n in enumerate(lengths)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"sft": {"pass@1": 0.25, "mean_length": 550.0},
                                                  "ppo": {"pass@1": acc, "mean_length": lengths[-1]}}))


def make_caches(base: Path) -> None:
    for name in ("sft-long", "orm-long"):
        (base / "_shared" / name).mkdir(parents=True)


def test_a_cell_links_pi_sft_and_links_the_orm_only_when_its_settings_are_the_cells(tmp_path):
    base = tmp_path / "base"
    make_caches(base)
    base_flags = ["--out-dir", str(base), "--preset", "tiny-long"]
    for cell, orm_shared in (("actor-lr-2e-4", True), ("max-new-tokens-560", False)):
        out = tmp_path / "sweep" / cell
        sweep.link_caches(base_flags, ["--out-dir", str(out), "--preset", "tiny-long", *sweep.CELLS[cell]])
        assert (out / "_shared" / "sft-long").resolve() == (base / "_shared" / "sft-long").resolve()
        assert (out / "_shared" / "orm-long").exists() == orm_shared  # the generation limit is an ORM setting
    other_task = tmp_path / "short"
    sweep.link_caches(base_flags, ["--out-dir", str(other_task), "--preset", "tiny-long",
                                                    "--task-length", "short"])
    assert not (other_task / "_shared").exists()


def test_a_fresh_sweep_trains_the_base_pi_sft_once_and_every_cell_links_it(tmp_path, monkeypatch):
    """The links were made before any pi_SFT existed, so each cell trained its own long pi_SFT (~30
    minutes of a core each) although the docstring promised the base one. SFT itself is faked here."""
    trained = []

    def fake_sft(cfg):
        trained.append(cfg.out_dir)
        Path(ablation.sft_cache_path(cfg)).mkdir(parents=True)

    monkeypatch.setattr(ablation, "prepare_sft", fake_sft)
    args = sweep.Args(cells=("actor-lr-2e-4", "lam-actor-0.99"), out_dir=str(tmp_path / "base"),
                      root=str(tmp_path / "sweep"))
    sweep.plan(args, [])
    assert trained == [str(tmp_path / "base")]
    for cell in args.cells:
        assert (tmp_path / "sweep" / cell / "_shared" / "sft-long").resolve() == tmp_path / "base" / "_shared" / "sft-long"


def test_reads_finished_cells_and_lists_the_others(tmp_path):
    base, root = tmp_path / "base", tmp_path / "sweep"
    fake_run(base, "ppo", 50, [600, 500, 300, 200, 200, 200], 0.1)  # default cell (6 of 50 steps): PPO collapses
    fake_run(base, "vc-ppo", 50, [600, 620, 640, 650, 660, 670], 0.4)
    lr, cell = ("--actor-lr", "2e-4"), root / "actor-lr-2e-4"
    fake_run(cell, "ppo", 20, [600, 610, 620, 630, 640, 650], 0.3, extra=lr)
    fake_run(cell, "vc-ppo", 20, [600, 500, 450, 450, 450, 450], 0.3, extra=lr)  # shortens: ratio 0.767
    fake_run(cell, "ppo", 20, [600, 400, 300, 300, 300, 300], 0.2, extra=lr, seed=1)  # collapses on seed 1
    fake_run(cell, "vc-ppo", 20, [600, 600, 600, 600, 600, 600], 0.3, extra=lr, seed=1)
    (cell / "ablation__ppo__seed2").mkdir()  # seed 2 was started, and stopped
    args = sweep.Args(cells=("default", "actor-lr-2e-4", "lam-actor-0.99"), seeds=(0, 1, 2), out_dir=str(base),
                      root=str(root), out=tmp_path / "out", read_only=True)
    results = sweep.main(args, [])
    assert sweep.collapsed(results["default"]["seeds"][0]) and sweep.held(results["default"]["seeds"][0])
    assert not sweep.collapsed(results["actor-lr-2e-4"]["seeds"][0])  # accuracy 0.3 is above pi_SFT's 0.25
    assert not sweep.held(results["actor-lr-2e-4"]["seeds"][0])
    assert results["default"]["seeds"][1] == "not started"
    assert results["actor-lr-2e-4"]["seeds"][2] == "not finished"
    rows = [r for r in (tmp_path / "out" / "sweep.md").read_text().splitlines() if r.startswith("| ")][1:]
    assert rows[0].startswith("| default | `--steps 50` | 0 | 6 | 0.250 | 0.467 | 0.100 |")
    assert rows[0].endswith("| yes | yes |")
    assert "| 1.033 | 0.300 |" in rows[3] and rows[3].endswith("| no | no |")
    assert rows[4].endswith("| yes | yes |")
    assert "| 2 | not finished |" in rows[5]
    # Seeds 0 and 1 of the cell: ppo's ratios 1.033 and 0.533, pass@1 0.3 and 0.2 (sample std 0.071).
    assert rows[6].startswith("| actor-lr-2e-4 | `--steps 20 --actor-lr 2e-4` | **mean of 2** | 6 | 0.250 ± 0.000 | "
                              "0.783 ± 0.354 | 0.250 ± 0.071 | 0.20 -> 0.20 |")
    assert rows[6].endswith("| 1 of 2 | 1 of 2 |")
    assert all("not started" in r for r in rows[7:]) and len(rows) == 10
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["default"]["seeds"]["0"]["sft_acc"] == 0.25
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 0


def test_the_table_says_the_flags_after_the_dashes_that_may_override_a_cells(tmp_path):
    """`-- --steps 2` ran every cell 2 steps while the flags column still read `--steps 50`, and the
    report said nothing of it."""
    fake_run(tmp_path / "base", "ppo", 2, [600, 500], 0.1)
    fake_run(tmp_path / "base", "vc-ppo", 2, [600, 620], 0.4)
    args = sweep.Args(cells=("default",), out_dir=str(tmp_path / "base"), root=str(tmp_path / "sweep"),
                      out=tmp_path / "out", read_only=True)
    sweep.main(args, ["--steps", "2"])
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "then the flags after `--`: --steps 2." in md and "| default | `--steps 50` | 0 | 2 |" in md


def test_with_nothing_finished_it_writes_nothing_over_the_results_there(tmp_path, capsys):
    """`--read-only --out results/sweep` in a clone without the runs replaced the committed table with an
    empty one and removed its figure."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("sweep.md", "sweep.json", "sweep.png"):
        (out / name).write_text(f"an earlier {name}")
    args = sweep.Args(cells=("default",), out_dir=str(tmp_path / "base"), root=str(tmp_path / "sweep"), out=out,
                      read_only=True)
    sweep.main(args, [])
    assert [(out / name).read_text() for name in ("sweep.md", "sweep.json", "sweep.png")] == [
        "an earlier sweep.md", "an earlier sweep.json", "an earlier sweep.png"]
    assert capsys.readouterr().out.strip().endswith(f"nothing written, {out} left as it is")


def test_no_seed_or_no_cell_is_an_error_before_anything_trains(tmp_path, monkeypatch):
    """`--seeds` alone wrote an empty table (and, without --read-only, trained the base pi_SFT first)."""
    monkeypatch.setattr(ablation, "build_missing_sft", lambda configs: pytest.fail("trained pi_SFT"))
    for empty in ({"seeds": ()}, {"cells": ()}):
        args = sweep.Args(out_dir=str(tmp_path / "base"), root=str(tmp_path / "sweep"), out=tmp_path / "out", **empty)
        with pytest.raises(ValueError, match=f"--{next(iter(empty))} is empty"):
            sweep.main(args, [])
    assert not (tmp_path / "out").exists()


def test_a_bad_jobs_is_an_error_before_the_base_pi_sft_trains(tmp_path, monkeypatch):
    """--jobs 0 stopped in run_grid, after the long task's pi_SFT (about 30 minutes of a core) had trained."""
    monkeypatch.setattr(ablation, "build_missing_sft", lambda configs: pytest.fail("trained pi_SFT"))
    args = sweep.Args(out_dir=str(tmp_path / "base"), root=str(tmp_path / "sweep"), out=tmp_path / "out", jobs=0)
    with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):
        sweep.main(args, [])
