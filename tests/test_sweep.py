"""analysis/sweep.py: which cached models a cell reuses, and the table from finished runs."""
import json
from pathlib import Path

from analysis import sweep

from test_collapse import fake_run


def make_caches(base: Path) -> None:
    for name in ("sft-long", "orm-long"):
        (base / "_shared" / name).mkdir(parents=True)


def test_a_cell_links_pi_sft_and_links_the_orm_only_when_its_settings_are_the_cells(tmp_path):
    base = tmp_path / "base"
    make_caches(base)
    base_flags = ["--out-dir", str(base), "--preset", "tiny-long"]
    for cell, orm_shared in (("actor-lr-2e-4", True), ("max-new-tokens-480", False)):
        out = tmp_path / "sweep" / cell
        sweep.link_caches(str(out), base_flags, ["--out-dir", str(out), "--preset", "tiny-long", *sweep.CELLS[cell]])
        assert (out / "_shared" / "sft-long").resolve() == (base / "_shared" / "sft-long").resolve()
        assert (out / "_shared" / "orm-long").exists() == orm_shared  # the generation limit is an ORM setting
    other_task = tmp_path / "short"
    sweep.link_caches(str(other_task), base_flags, ["--out-dir", str(other_task), "--preset", "tiny-long",
                                                    "--task-length", "short"])
    assert not (other_task / "_shared").exists()


def test_reads_finished_cells_and_lists_the_others(tmp_path):
    base, root = tmp_path / "base", tmp_path / "sweep"
    fake_run(base, "ppo", 50, [600, 500, 300, 200, 200, 200], 0.1)  # default cell (6 of 50 steps): PPO collapses
    fake_run(base, "vc-ppo", 50, [600, 620, 640, 650, 660, 670], 0.4)
    lr = ("--actor-lr", "2e-4")
    fake_run(root / "actor-lr-2e-4", "ppo", 20, [600, 610, 620, 630, 640, 650], 0.3, extra=lr)
    fake_run(root / "actor-lr-2e-4", "vc-ppo", 20, [600, 590, 580, 570, 560, 550], 0.3, extra=lr)
    args = sweep.Args(cells=("default", "actor-lr-2e-4", "lam-actor-0.99"), out_dir=str(base), root=str(root),
                      out=tmp_path / "out", read_only=True)
    results = sweep.main(args, [])
    assert sweep.collapsed(results["default"]["seeds"][0])
    assert not sweep.collapsed(results["actor-lr-2e-4"]["seeds"][0])  # accuracy 0.3 is above pi_SFT's 0.25
    assert results["lam-actor-0.99"]["seeds"][0] is None
    rows = [r for r in (tmp_path / "out" / "sweep.md").read_text().splitlines() if r.startswith("| ")][1:]
    assert rows[0].startswith("| default | `--steps 50` | 0 | 6 | 0.250 | 0.467 | 0.100 |") and rows[0].endswith("| yes |")
    assert rows[1].endswith("| no |") and "| 1.033 | 0.300 |" in rows[1]
    assert "not finished" in rows[2]
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["default"]["seeds"]["0"]["sft_acc"] == 0.25
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 0
