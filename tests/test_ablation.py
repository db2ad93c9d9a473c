"""analysis/ablation.py: reading and aggregating a grid of runs, refusing mismatched runs, and (slow)
running a micro grid through train.py."""
import dataclasses
import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from support import config, preemption
from analysis import ablation, run_cli

from test_train import MICRO


def fake_run(out_dir: Path, variant: str, seed: int, pass1: float, lengths: list[float]) -> None:
    """A finished run as train.py leaves it: config.json, metrics.jsonl, summary.json."""
    flags = ["--out-dir", str(out_dir), "--run-name", f"ablation__{variant}__seed{seed}", "--seed", str(seed),
             *ablation.VARIANTS[variant][0]]
    run = out_dir / f"ablation__{variant}__seed{seed}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(config.parse_config(flags))))
    rows = [{"step": i, "response_length/mean": n, "reward/accuracy": 0.1 * i, "critic/value_error/explained_var": -seed}
            for i, n in enumerate(lengths)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = {"sft": {"pass@1": 0.3 + 0.01 * seed, "pass@4": 0.6, "mean_length": 130.0},
             "ppo": {"pass@1": pass1, "pass@4": 2 * pass1, "mean_length": lengths[-1]}}
    (run / "summary.json").write_text(json.dumps(evals))


def test_reads_a_grid_and_reports_mean_and_sample_std(tmp_path):
    fake_run(tmp_path, "ppo", 0, 0.2, [100, 50, 60])
    fake_run(tmp_path, "ppo", 1, 0.4, [100, 80, 90])
    fake_run(tmp_path, "vc-ppo", 0, 0.6, [100, 120, 140])
    args = ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path), variants=("ppo", "vc-ppo"), seeds=(0, 1),
                         read_only=True)
    agg = ablation.main(args, [])
    ppo = agg["table"]["ppo"]
    assert ppo["seeds"] == 2
    assert ppo["pass@1"] == pytest.approx((0.3, math.sqrt(0.02)))  # sample std of 0.2 and 0.4
    assert ppo["pass@k"] == ("pass@4", pytest.approx(0.6), pytest.approx(math.sqrt(0.08)))
    assert ppo["min_train_length"] == pytest.approx((65.0, math.sqrt(450)))  # min of each seed: 50 and 80
    assert ppo["first_ev"] == pytest.approx((-0.5, math.sqrt(0.5)))
    assert agg["table"]["vc-ppo"]["seeds"] == 1 and math.isnan(agg["table"]["vc-ppo"]["pass@1"][1])
    assert agg["table"]["pi_SFT"]["pass@1"] == pytest.approx((0.305, math.sqrt(5e-5)))  # once per seed
    assert agg["curves"]["ppo"]["response_length/mean"].tolist() == [[100, 50, 60], [100, 80, 90]]
    md = (tmp_path / "out" / "ablation.md").read_text()
    assert "| ppo | 2 | 0.300 ± 0.141 |" in md and "| 5.6 |" in md
    assert "Seeds differ between rows, each row's mean is over its own: ppo 0, 1; vc-ppo 0." in md
    assert (tmp_path / "out" / "ablation.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "ablation.json").read_text())["table"]["ppo"]["seeds"] == 2


def test_a_run_whose_rows_are_not_every_step_in_order_is_refused_not_drawn_at_the_wrong_steps(tmp_path):
    """The grids take a row's place for its PPO step. A resumed run whose log lost rows before its
    checkpoint goes on past the gap (it is said, not refused), and its later steps were read as earlier ones."""
    fake_run(tmp_path, "ppo", 0, 0.2, [100, 50, 60, 70])
    metrics = tmp_path / "ablation__ppo__seed0" / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    args = ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path), variants=("ppo",), seeds=(0,), read_only=True)
    metrics.write_text("\n".join(rows[:2] + rows[3:]) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: its rows are not steps 0 to 2 in order \(missing: \[2\]\)"):
        ablation.main(args, [])
    metrics.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")
    with pytest.raises(ValueError, match=r"not steps 0 to 3 in order \(missing: none\)"):
        ablation.main(args, [])
    metrics.write_text("\n".join(rows) + "\n")
    assert ablation.main(args, [])["curves"]["ppo"]["response_length/mean"].tolist() == [[100, 50, 60, 70]]


@pytest.mark.parametrize("log, says", [
    ("", "metrics.jsonl: no rows"),
    ('{"step": 0, "response_length/mean": 100, "reward/accuracy": 0}\n{"step": 1, "resp', "its last line is cut short"),
    ('{"step": 0, "response_length/mean": null, "reward/accuracy": 0}\n', "step 0 has response_length/mean None, not"),
    ('{"step": 0, "response_length/mean": NaN, "reward/accuracy": 0}\n', "step 0 has response_length/mean nan, not"),
    ('{"step": 0, "response_length/mean": 100}\n', "step 0 has reward/accuracy None, not a number"),
    ('{"step": 0, "resp\n', "metrics.jsonl:1: not a metrics row"),
])
def test_a_damaged_metrics_log_is_named_in_one_line_not_a_traceback_nor_a_mean_over_fewer_seeds(tmp_path, log, says):
    """An empty log gave `min() arg is an empty sequence`, a cut line a JSON error naming no file, a
    null length a TypeError traceback, and a NaN one a mean over the other seeds, in silence."""
    fake_run(tmp_path, "ppo", 0, 0.2, [100, 50])
    (tmp_path / "ablation__ppo__seed0" / "metrics.jsonl").write_text(log)
    args = ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path), variants=("ppo",), seeds=(0,), read_only=True)
    with pytest.raises(ValueError, match=re.escape(says)):
        ablation.main(args, [])


def test_the_json_is_strict_an_undefined_number_written_as_null(tmp_path):
    """ablation.json held a bare NaN (pi_SFT's row always does), which jq and JSON.parse reject."""
    fake_run(tmp_path, "ppo", 0, 0.2, [100, 50, 60])
    ablation.main(ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path), variants=("ppo",), seeds=(0,),
                                read_only=True), [])
    saved = json.loads((tmp_path / "out" / "ablation.json").read_text(), parse_constant=pytest.fail)
    assert saved["table"]["pi_SFT"]["min_train_length"] == [None, None]
    assert saved["table"]["ppo"]["pass@1"] == [0.2, None]  # one seed: no std


def test_quick_keeps_the_variants_seeds_and_out_dir_given_beside_it(tmp_path, monkeypatch):
    """--quick replaced them in silence: `--quick --out-dir X` trained in runs/ablation-quick."""
    planned = []
    monkeypatch.setattr(ablation, "plan_runs", lambda args, flags: planned.append((args, flags)) or [])
    with pytest.raises(ValueError):  # nothing planned, nothing to read
        ablation.main(ablation.Args(quick=True, out_dir=str(tmp_path), seeds=(5,), read_only=True), ["--steps", "3"])
    args, flags = planned[0]
    assert (args.out_dir, args.seeds, args.variants) == (str(tmp_path), (5,), ("ppo", "vc-ppo"))
    assert flags[:2] == ["--steps", "10"] and flags[-2:] == ["--steps", "3"]


def test_runs_evaluated_with_one_sample_report_no_pass_at_k_instead_of_crashing():
    """`--eval-samples 1` writes no pass@k: the table stopped with a bare StopIteration."""
    row = ablation.evaluation_row([{"pass@1": 0.25, "mean_length": 80.0}, {"pass@1": 0.75, "mean_length": 90.0}], None)
    assert row["pass@1"] == pytest.approx((0.5, math.sqrt(0.125)))
    assert row["pass@k"][0] == "pass@k" and all(math.isnan(x) for x in row["pass@k"][1:])


def test_a_seed_with_an_undefined_value_leaves_the_others_mean_instead_of_blanking_the_cell():
    """The critic EV of a batch with equal returns is undefined (null): one such seed turned the
    ablation's whole cell into "-", where collapse.py's own mean skipped it."""
    mean, std = ablation.mean_std([0.2, None, 0.4, float("nan")])
    assert (mean, std) == pytest.approx((0.3, math.sqrt(0.02)))
    assert ablation.mean_std([0.5, None])[0] == 0.5 and math.isnan(ablation.mean_std([0.5, None])[1])
    assert all(math.isnan(x) for x in ablation.mean_std([None, float("nan")]))


def test_a_finished_run_with_other_settings_is_refused(tmp_path):
    fake_run(tmp_path, "ppo", 0, 0.2, [100, 90])
    args = ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path), variants=("ppo",), seeds=(0,), read_only=True)
    with pytest.raises(config.ConfigError, match="ablation__ppo__seed0 was made with other settings .*steps"):
        ablation.main(args, ["--steps", "3"])


def test_flags_for_every_run_do_not_override_what_a_variant_sets(tmp_path):
    args = ablation.Args(out_dir=str(tmp_path), variants=("ppo", "vc-ppo"), seeds=(0,))
    runs = ablation.plan_runs(args, ["--value-pretrain-steps", "5", "--lam-critic", "0.9"])
    ppo, vc = (config.parse_config(r.flags) for r in runs)
    assert (ppo.value_pretrain_steps, ppo.lam_critic, ppo.critic_init) == (0, 0.95, "rm")
    assert (vc.value_pretrain_steps, vc.lam_critic) == (5, 0.9)


def test_unknown_variant_and_nothing_to_read_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown variant"):
        ablation.main(ablation.Args(out_dir=str(tmp_path), variants=("ppo2",)), [])
    with pytest.raises(ValueError, match="no finished run"):
        ablation.main(ablation.Args(out_dir=str(tmp_path), variants=("ppo",), read_only=True), [])
    with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):  # it was a ZeroDivisionError, after SFT
        ablation.main(ablation.Args(out_dir=str(tmp_path), variants=("ppo",), jobs=0), [])
    assert not (tmp_path / "_shared").exists()


def test_no_seed_or_no_variant_says_so(tmp_path):
    """`--seeds` alone was reported as 'no finished run to read', as if runs had failed."""
    for empty in ({"seeds": ()}, {"variants": ()}):
        with pytest.raises(ValueError, match=f"--{next(iter(empty))} is empty: give at least one"):
            ablation.main(ablation.Args(out_dir=str(tmp_path), out=tmp_path / "out", **empty), [])


@pytest.mark.slow
def test_micro_grid_runs_train_py_and_reuses_finished_runs(tmp_path):
    args = ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path), variants=("ppo", "grpo"), seeds=(0,))
    flags = [*MICRO, "--steps", "2"]
    agg = ablation.main(args, flags)
    for variant in ("ppo", "grpo"):
        run = tmp_path / f"ablation__{variant}__seed0"
        assert json.loads((run / "ablation_run.json").read_text())["returncode"] == 0, (run / "train.log").read_text()
        assert agg["curves"][variant]["reward/accuracy"].shape == (1, 2)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert agg["curves"][variant]["reward/accuracy"].tolist() == [[r["reward/accuracy"] for r in rows]]
        final = json.loads((run / "summary.json").read_text())["ppo"]
        assert agg["table"][variant]["pass@1"][0] == final["pass@1"]  # one seed: its own number
    assert (tmp_path / "_shared" / "orm").is_dir()  # the first run built the ORM the ppo variant needs
    stamp = (tmp_path / "ablation__ppo__seed0" / "summary.json").stat().st_mtime
    again = ablation.main(args, flags)  # everything finished: read, not rerun
    assert (tmp_path / "ablation__ppo__seed0" / "summary.json").stat().st_mtime == stamp
    assert again["table"]["ppo"]["mean_length"][0] == agg["table"]["ppo"]["mean_length"][0]


def test_the_figure_draws_vc_ppo_once_unless_the_lambda_sweep_is_there():
    assert ablation.figure_rows({"ppo", "vc-ppo"}) == [["ppo", "vc-ppo"]]
    assert ablation.figure_rows({"vc-ppo", "lam-actor-0.9"}) == [["vc-ppo"], ["lam-actor-0.9", "vc-ppo"]]
    assert ablation.figure_rows({"lam-actor-1.0"}) == [["lam-actor-1.0"]]


def test_the_report_names_the_task_it_ran_on(tmp_path):
    fake_run(tmp_path, "ppo", 0, 0.2, [100, 50, 60])
    args = ablation.Args(out=tmp_path / "out", out_dir=str(tmp_path), variants=("ppo",), seeds=(0,), read_only=True)
    ablation.main(args, [])
    assert (tmp_path / "out" / "ablation.md").read_text().startswith(
        "# Ablation on the built-in task (short, max_new_tokens 400)")


def test_each_band_has_its_lines_colour(tmp_path, monkeypatch):
    """A variant with one seed draws a line and no band; the next variant's band keeps its own line's colour."""
    import matplotlib.colors

    figures = []
    monkeypatch.setattr(ablation.plt, "close", figures.append)
    seeds = lambda n: {key: np.arange(3 * n, dtype=float).reshape(n, 3) for key, _ in ablation.CURVES}
    ablation.plot({"ppo": seeds(2), "vc-ppo-no-vp": seeds(1), "vc-ppo": seeds(2)}, tmp_path / "f.png", "a task")
    for ax in figures[0].axes:
        lines, bands = ax.get_lines(), ax.collections
        assert len(lines) == 3 and len(bands) == 2
        for line, band in zip((lines[0], lines[2]), bands):
            assert matplotlib.colors.to_hex(band.get_facecolor()[0]) == matplotlib.colors.to_hex(line.get_color())


def test_runs_waiting_for_the_shared_stages_start_once_what_they_read_is_built(tmp_path, monkeypatch):
    """pi_SFT is trained first, in the grid's process on every core; then the ORM builder (a
    critic-from-ORM run) and the runs from pi_SFT start at once, and the other critic-from-ORM run
    once the ORM is built, before the builder ends."""
    runs = ablation.plan_runs(ablation.Args(out_dir=str(tmp_path), variants=("ppo", "vc-ppo"), seeds=(0, 1)), [])
    sft, orm = Path(ablation.sft_cache_path(runs[0].config)), Path(ablation.orm_path(runs[0].config))
    events, lock = [], threading.Lock()

    def log(what):
        with lock:
            events.append(what)

    def fake_prepare_sft(cfg):
        log(f"built {sft.name} on {torch.get_num_threads()} threads")
        sft.mkdir(parents=True)

    def fake_execute(run, threads, children):
        log(f"start {run.dir.name}")
        if run.dir.name == "ablation__ppo__seed0":
            # The runs from pi_SFT must not wait for the ORM: it is built once they have started (or
            # after 10 s, when the assertions below fail), not after a fixed sleep a loaded machine outlasts.
            deadline = time.time() + 10
            while not all(f"start ablation__vc-ppo__seed{s}" in events for s in (0, 1)) and time.time() < deadline:
                time.sleep(0.01)
            log(f"built {orm.name}")
            orm.mkdir(parents=True, exist_ok=True)
            deadline = time.time() + 10
            while sum(e.startswith("start") for e in events) < len(runs) and time.time() < deadline:
                time.sleep(0.01)  # trains until the others have started
        log(f"end {run.dir.name}")
        return run, 0.0, 0

    monkeypatch.setattr(ablation, "prepare_sft", fake_prepare_sft)
    monkeypatch.setattr(config, "usable_cores", lambda: 3)
    monkeypatch.setattr(ablation, "execute", fake_execute)
    monkeypatch.setattr(ablation, "CACHE_POLL_S", 0.01)
    threads_before = torch.get_num_threads()
    _, failed = ablation.run_grid(runs, jobs=len(runs))
    assert not failed and torch.get_num_threads() == threads_before
    at = {e: i for i, e in enumerate(events)}
    assert at[f"built {sft.name} on 3 threads"] == 0 and at["start ablation__ppo__seed0"] == 1
    for seed in (0, 1):
        assert at[f"start ablation__vc-ppo__seed{seed}"] < at[f"built {orm.name}"]
    assert at[f"built {orm.name}"] < at["start ablation__ppo__seed1"] < at["end ablation__ppo__seed0"]
    ablation.run_grid(runs, jobs=len(runs))  # pi_SFT there: not trained again
    assert sum(e.startswith(f"built {sft.name}") for e in events) == 1


class FinishedChild:
    """A train.py child that has finished well."""

    def wait(self) -> int:
        return 0


def test_runs_side_by_side_share_the_cores_unless_their_flags_set_threads(tmp_path, monkeypatch):
    """Each run of a grid gets cores // jobs torch threads (two runs on two cores must not spin four
    threads against each other); one whose flags give --threads keeps its own."""
    calls = []
    monkeypatch.setattr(ablation.subprocess, "Popen", lambda argv, **kw: calls.append(argv) or FinishedChild())
    monkeypatch.setattr(config, "usable_cores", lambda: 4)
    monkeypatch.setattr(ablation, "CACHE_POLL_S", 0.1)  # seed 1 waits for seed 0's ORM
    args = ablation.Args(out_dir=str(tmp_path), variants=("ppo",), seeds=(0,))
    (Path(tmp_path) / "_shared" / "sft").mkdir(parents=True)  # no builder: the runs start at once
    runs = ablation.plan_runs(args, []) + ablation.plan_runs(dataclasses.replace(args, seeds=(1,)), ["--threads", "3"])
    ablation.run_grid(runs, jobs=2)
    by_seed = {argv[argv.index("--seed") + 1]: argv for argv in calls}
    assert by_seed["0"][by_seed["0"].index("--threads") + 1] == "2"
    assert by_seed["1"].count("--threads") == 1 and by_seed["1"][by_seed["1"].index("--threads") + 1] == "3"


def test_the_wall_time_of_a_resumed_run_adds_up_its_parts(tmp_path, monkeypatch):
    """Each call of a stopped run overwrote the record with its own part: a run resumed after 2 s of
    work and finished in 0.5 s was reported as a 0.5 s run."""
    run = ablation.planned_run("ppo", 0, ["--out-dir", str(tmp_path), "--run-name", "r"])
    clock = iter([0.0, 2.0, 10.0, 10.5])
    monkeypatch.setattr(ablation.time, "time", lambda: next(clock))
    monkeypatch.setattr(ablation.subprocess, "Popen", lambda *args, **kwargs: FinishedChild())
    ablation.execute(run, threads=1, children=ablation.Children())
    ablation.execute(run, threads=1, children=ablation.Children())
    assert json.loads((run.dir / "ablation_run.json").read_text())["wall_s"] == 2.5


FAKE_TRAIN = """
import pathlib, signal, sys, time
run = pathlib.Path(sys.argv[sys.argv.index("--out-dir") + 1], sys.argv[sys.argv.index("--run-name") + 1])
signal.signal(signal.SIGTERM, lambda *_: ((run / "saved").touch(), sys.exit(143)))  # as train.py: save, stop
(run / "started").touch()
time.sleep(20)
"""


def test_a_signal_to_the_grid_stops_the_run_under_way_and_starts_no_other(tmp_path, monkeypatch):
    """A scheduler's SIGTERM reaches the grid's process alone. It went to no run: the run under way
    trained on, and the queued runs then started one after another, the grid still running."""
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    monkeypatch.setattr(ablation, "TRAIN", fake)
    (tmp_path / "_shared" / "sft").mkdir(parents=True)  # no pi_SFT to build
    runs = ablation.plan_runs(ablation.Args(out_dir=str(tmp_path), variants=("vc-ppo",), seeds=(0, 1, 2)), [])

    def terminate_once_started():
        deadline = time.time() + 60
        while not (runs[0].dir / "started").exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    # This process's own handler, in case the grid sets none (pytest would die of SIGTERM).
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(RuntimeError("grid took no signal")))
    try:
        threading.Thread(target=terminate_once_started, daemon=True).start()
        start = time.time()
        with pytest.raises(preemption.Preempted):
            ablation.run_grid(runs, jobs=1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (runs[0].dir / "saved").exists()  # the signal was passed on
    assert not any((r.dir / "started").exists() for r in runs[1:])
    assert time.time() - start < 15


def test_a_signal_while_the_grid_trains_pi_sft_stops_it_with_a_line(tmp_path, monkeypatch, capsys):
    """pi_SFT trains in the grid's own process before any run: a scheduler's SIGTERM there ended the
    script without a word."""
    def interrupted_sft(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        pytest.fail("the signal did not stop pi_SFT's training")

    monkeypatch.setattr(ablation, "prepare_sft", interrupted_sft)
    runs = ablation.plan_runs(ablation.Args(out_dir=str(tmp_path), variants=("vc-ppo",), seeds=(0,)), [])
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(RuntimeError("grid took no signal")))
    try:
        with pytest.raises(preemption.Preempted):
            ablation.run_grid(runs, jobs=1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "SIGTERM: stopped. pi_SFT was not finished; the same command trains it again" in capsys.readouterr().out


def test_ctrl_c_in_a_script_ends_with_a_line_and_exit_code_130_not_a_traceback(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["script.py"])
    with pytest.raises((SystemExit, KeyboardInterrupt)) as stop:  # a KeyboardInterrupt would stop pytest
        run_cli(interrupted, ablation.Args, "a script")
    assert stop.type is SystemExit and stop.value.code == 130
    assert "interrupted; the same command reuses what finished" in capsys.readouterr().err
