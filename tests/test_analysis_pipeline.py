"""analysis/advantage_bias.py (paper Fig. 2) and analysis/value_pretrain_curves.py (§3.2) on a
throwaway run directory: a tiny random pi_SFT, critics saved beside it, a fake curve.jsonl."""
import dataclasses
import json
import math
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from support import rundir
from support import task
from analysis import advantage_bias, strategies, value_pretrain_curves
from support.config import parse_config
from critic import load_value_model, orm_settings, roc_auc

RUN = "tinyrun"
# train.py's flags of that run (a micro one)
FLAGS = ["--run-name", RUN, "--task-train-size", "16", "--task-eval-size", "4", "--max-new-tokens", "20",
         "--grader-workers", "1"]


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    """<root>/_shared/{sft,orm,orm-bt} and <root>/tinyrun/value_pretrain/{critic/,curve.jsonl}, as train.py lays them out."""
    root = tmp_path_factory.mktemp("runs")
    cfg = parse_config(["--out-dir", str(root), *FLAGS])
    rundir.prepare(cfg)  # the run's config.json
    (root / RUN / "checkpoint").mkdir()  # a finished run's: analysis reads it, it does not resume it
    tokenizer = task.build_tokenizer()
    sft = root / "_shared" / "sft"
    task.make_tiny_model(tokenizer, num_layers=2, intermediate_size=256).save_pretrained(sft)
    tokenizer.save_pretrained(sft)
    for where, bias in ((root / "_shared" / "orm", 0.5), (root / "_shared" / "orm-bt", 1.5),
                        (root / RUN / "value_pretrain" / "critic", -0.2)):
        torch.manual_seed(1)
        critic = load_value_model(str(sft))
        with torch.no_grad():
            critic.score.bias.fill_(bias)  # distinct heads, so the four curves differ
        critic.save_pretrained(where)
    for name, loss in (("orm", "mse"), ("orm-bt", "bradley-terry")):  # as prepare_orm does
        settings = orm_settings(dataclasses.replace(cfg, orm_loss=loss))
        (root / "_shared" / name / rundir.STAGE_SETTINGS).write_text(json.dumps(settings))
    return root


def run_bias(root, out, **kw):
    """advantage_bias.main with train.py flags of a micro run under `root`."""
    args = advantage_bias.Args(**{"out": out, "rollouts": 6, "batch_size": 4, "bin_size": 4, **kw})
    return advantage_bias.main(args, ["--out-dir", str(root), *FLAGS])


@pytest.fixture(scope="module")
def bias(run_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis")
    return run_bias(run_root, out), out


def test_advantage_bias_writes_png_markdown_and_json(bias):
    result, out = bias
    for ext in ("png", "md", "json"):
        assert (out / f"advantage_bias.{ext}").stat().st_size > 0
    saved = json.loads((out / "advantage_bias.json").read_text())
    assert saved["tokens"] == result.tokens.tolist() and set(saved["pearson"]) == {"orm", "orm-bt", "sft", "pretrained"}
    assert "Pearson" in (out / "advantage_bias.md").read_text()


def test_bins_cover_every_valid_token_position(bias):
    result, _ = bias
    total = result.rollout["responses"] * result.rollout["mean_length"]
    assert result.tokens.sum() == pytest.approx(total)
    assert result.bin_start[0] == 0 and np.all(np.diff(result.bin_start) == 4)
    assert result.bin_start[-1] < result.rollout["max_length"] <= result.bin_start[-1] + 4
    assert (result.tokens > 0).all()  # the longest response passes through every bin


def test_every_critic_and_lambda_has_a_curve_and_the_saved_correlations(bias):
    result, out = bias
    assert not result.skipped
    saved = json.loads((out / "advantage_bias.json").read_text())["pearson"]
    for name in advantage_bias.CRITICS:
        assert set(result.advantages[name]) == {0.95, 1.0}
        assert saved[name] == pytest.approx({str(lam): r for lam, r in result.pearson[name].items()})
        # Token-level correlations with position differ between lambdas: the sums behind them do.
        assert result.pearson[name][0.95] != result.pearson[name][1.0]
    assert not np.allclose(result.values["orm"], result.values["pretrained"])
    assert not np.allclose(result.values["orm"], result.values["orm-bt"])


def test_offset_moves_the_fresh_head_critic_by_exactly_the_offset(run_root, bias, tmp_path):
    """--offset is train.py's --critic-init-offset on the SFT + fresh-head critic: its values fall by 2 at
    every position, so at lambda = 1 its advantages rise by 2; the other critics do not move."""
    result, _ = bias
    shifted = run_bias(run_root, tmp_path, offset=-2.0)
    np.testing.assert_allclose(shifted.values["sft"], result.values["sft"] - 2.0, atol=1e-5)
    np.testing.assert_allclose(shifted.advantages["sft"][1.0], result.advantages["sft"][1.0] + 2.0, atol=1e-5)
    for name in ("orm", "orm-bt", "pretrained"):
        np.testing.assert_allclose(shifted.values[name], result.values[name], atol=1e-6)
    assert "moved by -2" in (tmp_path / "advantage_bias.md").read_text()


def test_lambda_one_advantage_plus_value_is_the_monte_carlo_return_in_every_bin(bias):
    result, _ = bias
    for name in advantage_bias.CRITICS:  # A_t(lambda = 1) = R_t - V(s_t), averaged over the same tokens
        np.testing.assert_allclose(result.advantages[name][1.0] + result.values[name], result.mc_return, atol=1e-5)


def test_pearson_from_position_sums_equals_numpy_corrcoef():
    rng = np.random.default_rng(0)
    positions = rng.integers(0, 12, size=200)
    adv = 0.1 * positions + rng.normal(size=200)
    count, adv_sum = np.bincount(positions, minlength=12), np.bincount(positions, adv, minlength=12)
    r = advantage_bias.pearson_with_position(count.astype(float), adv_sum, float((adv**2).sum()))
    assert r == pytest.approx(np.corrcoef(positions, adv)[0, 1], abs=1e-10)
    assert math.isnan(advantage_bias.pearson_with_position(count.astype(float), 0.5 * count, 0.25 * 200))


def test_a_critic_train_py_has_not_made_is_skipped_and_named_in_the_report(run_root, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(run_root, root)
    shutil.rmtree(root / RUN / "value_pretrain" / "critic")  # the run's own path, no flag: not trained yet
    result = run_bias(root, tmp_path, rollouts=2)
    assert set(result.skipped) == {"pretrained"} and set(result.values) == {"orm", "orm-bt", "sft"}
    report = (tmp_path / "advantage_bias.md").read_text()
    assert f"no checkpoint at {root / RUN / 'value_pretrain' / 'critic'}" in report
    assert f"skipped (no {root / RUN / 'value_pretrain' / 'critic'})" in report  # not listed among those measured


def test_missing_sft_and_bad_sizes_raise_value_error(run_root, tmp_path):
    with pytest.raises(ValueError, match="no pi_SFT checkpoint"):
        run_bias(tmp_path, tmp_path)
    with pytest.raises(ValueError, match="--bin-size"):
        advantage_bias.main(advantage_bias.Args(out=tmp_path, bin_size=0))


def write_curve(run_dir, rows):
    path = run_dir / "value_pretrain" / "curve.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_an_orm_trained_with_other_settings_is_refused_before_sampling(run_root, tmp_path):
    args = advantage_bias.Args(out=tmp_path, critic=str(run_root / RUN / "value_pretrain" / "critic"))
    with pytest.raises(rundir.ConfigError, match="other settings .--max-new-tokens 20 -> 24"):
        advantage_bias.main(args, ["--out-dir", str(run_root), *FLAGS, "--max-new-tokens", "24"])
    assert not any(tmp_path.iterdir())


def test_value_pretrain_curves_reads_values_back_exactly_and_writes_both_files(tmp_path):
    rows_a = [{"step": s, "value_loss": 1.0 / (s + 1), "explained_variance": s / 10 - 0.05, "reward_mean": -0.5}
              for s in range(6)]
    rows_b = [{"step": 0, "value_loss": 0.7, "explained_variance": None},  # undefined, as pretrain_value writes it
              {"step": 1, "value_loss": 0.9, "explained_variance": 0.2}]
    write_curve(tmp_path / "runs" / "a", rows_a)
    write_curve(tmp_path / "runs" / "b", rows_b)
    out = tmp_path / "out"
    curves = value_pretrain_curves.main(value_pretrain_curves.Args(out=out, root=tmp_path / "runs"))
    assert [c.label for c in curves] == ["a", "b"]
    assert curves[0].value_loss.tolist() == [r["value_loss"] for r in rows_a]
    assert curves[0].explained_variance.tolist() == [r["explained_variance"] for r in rows_a]
    assert curves[0].step.tolist() == list(range(6)) and math.isnan(curves[1].explained_variance[0])
    md = (out / "value_pretrain_curves.md").read_text()
    assert "| a | 6 | 1 | 0.1667 | 0.1667 (5) | -0.050 | 0.450 | 0.450 (5) |" in md
    assert "| b | 2 | 0.7 | 0.9 | 0.7 (0) | nan | 0.200 | 0.200 (1) |" in md
    assert (out / "value_pretrain_curves.png").stat().st_size > 0


def test_value_pretrain_curves_finds_runs_at_any_depth_and_a_shared_stage_once(tmp_path):
    """The grids keep their runs two levels down, and their runs link one cached stage: a glob one
    level deep found none of them, and six variants sharing a stage drew one curve six times."""
    stage = tmp_path / "runs" / "_shared" / "value_pretrain" / "key"
    stage.mkdir(parents=True)
    (stage / "curve.jsonl").write_text("")
    for run in ("grid/a", "grid/b"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "value_pretrain").symlink_to(stage)
    own = tmp_path / "runs" / "sweep" / "cell" / "c" / "value_pretrain"
    own.mkdir(parents=True)
    (own / "curve.jsonl").write_text("")
    found = value_pretrain_curves.find_runs(tmp_path / "runs")
    assert found == [tmp_path / "runs" / "grid" / "a", tmp_path / "runs" / "sweep" / "cell" / "c"]


def test_value_pretrain_curves_names_the_bad_file_and_line(tmp_path):
    write_curve(tmp_path / "run", [{"step": 0, "value_loss": 1.0, "explained_variance": 0.0}])
    with open(tmp_path / "run" / "value_pretrain" / "curve.jsonl", "a") as f:
        f.write('{"step": 1, "value_loss": 0.5}\n')
    with pytest.raises(ValueError, match=r"curve.jsonl:2"):
        value_pretrain_curves.main(value_pretrain_curves.Args(out=tmp_path / "out", runs=(tmp_path / "run",)))
    with pytest.raises(ValueError, match="no value pretraining curve"):
        value_pretrain_curves.main(value_pretrain_curves.Args(out=tmp_path / "out", runs=(tmp_path / "none",)))
    with pytest.raises(ValueError, match="no run under"):
        value_pretrain_curves.main(value_pretrain_curves.Args(out=tmp_path / "out", root=tmp_path / "empty"))


def test_roc_auc_counts_ordered_pairs_and_ties_half():
    scores = np.array([0.9, 0.1, 0.5, 0.5, -0.3])
    positive = np.array([True, False, True, False, False])
    pairs = [(p, n) for p in scores[positive] for n in scores[~positive]]
    brute = np.mean([1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs])
    assert roc_auc(scores, positive) == pytest.approx(brute) == pytest.approx(5.5 / 6)
    assert math.isnan(roc_auc(scores, np.zeros(5, dtype=bool)))


def two_boxed_rollouts(texts: list[str], finish_reasons: list[str], missing_box: int):
    """One rollout of the built-in tokenizer's tokens of `texts`, EOS after each that stopped, outcomes
    +1 and -1; (tokenizer, the rollouts as advantage_bias reads them, the batch's width)."""
    from rollout import RolloutBatch
    from sampling import ScoredBatch

    tokenizer = task.build_tokenizer()
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * (reason == "stop")
           for t, reason in zip(texts, finish_reasons)]
    width = max(map(len, ids))
    response = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1.0] * len(i) + [0.0] * (width - len(i)) for i in ids])
    batch = RolloutBatch(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), response, mask,
                         torch.zeros(2, width), finish_reasons)
    scored = ScoredBatch(batch, texts, torch.tensor([1.0, -1.0]), torch.zeros(2, width), 0, missing_box, {})
    return tokenizer, [scored], width


def test_box_alignment_reads_the_values_around_the_final_box():
    texts = ["a:1234\n\\boxed{1234}", "a:1234\na:1"]  # the second has no box: left out
    tokenizer, rollouts, width = two_boxed_rollouts(texts, ["stop", "stop"], missing_box=1)
    mask = rollouts[0].batch.response_mask
    starts = advantage_bias.box_starts(tokenizer, rollouts)
    assert starts == [[(7, 14), (-1, -1)]]  # "a:1234\n" is 7 tokens, and so is "\\boxed{" here
    values = torch.where(torch.arange(width) < 7, -1.0, 0.5).expand(2, width) * mask  # -1 until the box opens
    box = advantage_bias.box_alignment(rollouts, [values], starts)
    assert box["responses"] == 1 and box["value_before"] == pytest.approx(-1.0)
    assert (box["value_at_open"], box["value_after_open"], box["jump"]) == pytest.approx((0.5, 0.5, 0.0))
    values = torch.where(torch.arange(width) <= 7, -1.0, 0.5).expand(2, width) * mask  # the jump inside the box
    assert advantage_bias.box_alignment(rollouts, [values], starts)["jump"] == pytest.approx(1.5)


def test_box_alignment_leaves_out_a_response_cut_right_after_its_box_opens():
    """A response cut just after `\\boxed{` has no token at s_e (its box's content never started):
    it is left out, not read at the padding after its last token (whose value is 0)."""
    texts = ["a:1234\n\\boxed{1234}", "a:1234\n\\boxed{"]  # the second cut at max_new_tokens
    tokenizer, rollouts, width = two_boxed_rollouts(texts, ["stop", "length"], missing_box=0)
    mask = rollouts[0].batch.response_mask
    starts = advantage_bias.box_starts(tokenizer, rollouts)
    assert starts == [[(7, 14), (7, 14)]] and int(rollouts[0].batch.lengths[1]) == 14
    values = torch.where(torch.arange(width) < 7, -1.0, 0.5).expand(2, width) * mask
    box = advantage_bias.box_alignment(rollouts, [values], starts)
    assert box["responses"] == 1
    assert (box["value_at_open"], box["value_after_open"], box["jump"]) == pytest.approx((0.5, 0.5, 0.0))


def test_the_box_opening_is_counted_in_the_tokenizers_tokens_not_in_characters():
    """`\\boxed{` is 7 characters, one token or a few in a BPE vocabulary: with --model, "after the
    box opens" fell inside the answer."""

    class OneTokenBox:  # "\\boxed{" is one token, every other character one
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [0 for _ in re.findall(r"\\boxed\{|.", text, re.S)]}

    scored = types.SimpleNamespace(texts=["a:12\n\\boxed{12}", "no box"])
    assert advantage_bias.box_starts(OneTokenBox(), [scored]) == [[(5, 6), (-1, -1)]]


def test_orm_quality_and_early_against_later_positions_are_reported(bias):
    result, out = bias
    assert set(result.orm_quality) == {"orm", "orm-bt"}  # both reward models, judged on the same rollouts
    q = result.orm_quality["orm"]["all"]
    share_correct = q["correct"] / q["responses"]
    assert q["responses"] == 6 and q["base_rate"] == pytest.approx(max(share_correct, 1 - share_correct))
    assert q["correct"] == round(result.rollout["accuracy"] * 6)  # the ORM is judged on these rollouts' verdicts
    assert set(result.early_vs_later) == set(advantage_bias.CRITICS)
    for name, by_lambda in result.advantages.items():  # the first bin's mean less the token mean of every later bin
        for lam, adv in by_lambda.items():
            later = (adv[1:] * result.tokens[1:]).sum() / result.tokens[1:].sum()
            assert result.early_vs_later[name][lam][0] == pytest.approx(adv[0] - later, abs=1e-9)
            assert 0 < result.early_vs_later[name][lam][1] < np.inf and 0 < result.first_bin_se[name][lam] < np.inf
    md = (out / "advantage_bias.md").read_text()
    assert "base rate" in md and "first bin less the later positions" in md
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[6].strip()
            for line in md.splitlines() if line.startswith(("| ORM-initialised | all", "| Bradley-Terry RM | all"))}
    assert rows[("Bradley-Terry RM", "all")] == "-"  # no meaningful zero: no sign accuracy
    assert float(rows[("ORM-initialised", "all")]) == pytest.approx(result.orm_quality["orm"]["all"]["sign_accuracy"], abs=1e-3)


def position_sums_of_two_responses(monkeypatch, lengths: list[int]) -> dict:
    """advantage_bias.position_sums over two responses of these lengths, outcomes +1 and -1, bins of
    4 tokens; values 0.1 * t and gamma = lambda = 1, so A_t = outcome - 0.1 t."""
    from rollout import RolloutBatch
    from reward import terminal_rewards
    from sampling import ScoredBatch

    outcomes, width = torch.tensor([1.0, -1.0]), max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    batch = RolloutBatch(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                         torch.ones(2, width, dtype=torch.long), mask, torch.zeros(2, width), ["stop", "stop"])
    scored = ScoredBatch(batch, ["", ""], outcomes, terminal_rewards(outcomes, mask), 0, 0, {})
    monkeypatch.setattr(advantage_bias, "response_values",
                        lambda critic, b: 0.1 * torch.arange(width).float() * b.response_mask)
    return advantage_bias.position_sums([scored], object(), (1.0,), 1.0, width, bin_size=4)


def test_first_bin_sums_of_a_short_response_count_its_own_tokens_only(monkeypatch):
    """Each response's tokens and summed A_t in the first bin and after it (behind the standard
    errors) are over its valid tokens; a response shorter than the bin must not count its padding as
    advantages of 0."""
    sums = position_sums_of_two_responses(monkeypatch, [8, 2])
    # A_t = outcome - 0.1 t. First: t = 0..3 and 4..7; second (2 tokens): t = 0, 1 only.
    assert sums["early_count"] == [4, 2] and sums["later_count"] == [4, 0]
    assert sums["early_adv"][1.0] == pytest.approx([4 - 0.6, -2 - 0.1])
    assert sums["later_adv"][1.0] == pytest.approx([4 - 2.2, 0.0])
    assert sums["count"].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]


def test_early_tokens_are_judged_against_later_positions_not_against_their_own_response(monkeypatch):
    """Fig. 2's position verdict compares means over fixed token positions, which are 0 in expectation
    for an exact critic. It compared each response's first bin with its own mean over all its tokens,
    which is not: where the outcome decides the length, the exact critic (here: the second token
    decides, "a" ends at 3 tokens with +1, "b" at 12 with -1; V = 0, 0, then the outcome) read
    -0.24 at lambda 0.95 and bins of 1 token: "early tokens penalised" for an exact critic."""
    from rollout import RolloutBatch
    from sampling import ScoredBatch

    lengths, outcomes = [3, 12], torch.tensor([1.0, -1.0])
    mask = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(2, 12)
    rewards[0, 2], rewards[1, 11] = outcomes
    batch = RolloutBatch(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                         torch.ones(2, 12, dtype=torch.long), mask, torch.zeros(2, 12), ["stop", "stop"])
    scored = ScoredBatch(batch, ["", ""], outcomes, rewards, 0, 0, {})
    exact = torch.tensor([[0.0, 0.0] + [1.0] * 10, [0.0, 0.0] + [-1.0] * 10])
    monkeypatch.setattr(advantage_bias, "response_values", lambda critic, b: exact * b.response_mask)
    for bin_size in (1, 2, 4):
        sums = advantage_bias.position_sums([scored], object(), (0.95, 1.0), 1.0, 12, bin_size=bin_size)
        for lam in (0.95, 1.0):
            first, _ = advantage_bias.pooled_mean(sums["early_adv"][lam], sums["early_count"])
            later, _ = advantage_bias.pooled_mean(sums["later_adv"][lam], sums["later_count"])
            assert (first, later) == pytest.approx((0.0, 0.0), abs=1e-12)
    # The standard error of a pooled mean is over responses: two responses of sums 3 and -1 over 1 and
    # 3 tokens have the mean 0.5 and influences (3 - 0.5) / 4, (-1 - 1.5) / 4: SE sqrt(2 * 2 * 0.625^2).
    mean, influence = advantage_bias.pooled_mean([3.0, -1.0], [1, 3])
    assert mean == 0.5 and advantage_bias.standard_error(influence) == pytest.approx(2 * 0.625)
    # Positions no response reaches have no mean (not 0), and no verdict is drawn from them.
    mean, influence = advantage_bias.pooled_mean([0.0, 0.0], [0, 0])
    assert np.isnan(mean) and np.isnan(advantage_bias.standard_error(influence))
    assert advantage_bias.sign_sentence(0.3, 0.05, mean, np.nan).endswith("undefined (no token there)")
    assert advantage_bias.sign_sentence(0.3, np.nan, 0.1, np.nan) == "level not judged (one response); not judged (one response)"
    sentence = advantage_bias.sign_sentence
    assert sentence(-0.6, 0.05, 0.01, 0.02) == "level below 0; early tokens no different from later ones (within 2 SE)"
    assert sentence(0.3, 0.05, -0.2, 0.05).startswith("level above 0; early tokens penalised against later ones")
    assert sentence(0.05, 0.05, 0.2, 0.05).startswith("level within 2 SE of 0; early tokens favoured over later ones")


def test_the_fresh_head_critic_is_the_one_a_run_of_that_seed_starts_from(run_root, tmp_path, monkeypatch):
    """pi_SFT's fresh head was drawn from the global RNG after torch.manual_seed(--seed), while
    load_value_model draws it from its own seed argument: every --seed read one head, and not the one
    train.py's run of that seed starts from (critic.fresh_head_seed)."""
    from critic import fresh_head_seed

    seeds = {}
    real = advantage_bias.load_value_model

    def recording(path, **kwargs):
        seeds[Path(path).name] = kwargs.get("seed")
        return real(path, **kwargs)

    monkeypatch.setattr(advantage_bias, "load_value_model", recording)
    run_bias(run_root, tmp_path, seed=3)
    assert seeds["sft"] == fresh_head_seed(3) != fresh_head_seed(0)


def test_strategies_refuses_no_problem_rather_than_report_a_pass_at_1_of_0(run_root, tmp_path):
    """--problems 0 wrote a table of pass@1 0.000 for pi_SFT and every run."""
    with pytest.raises(ValueError, match="--problems must be >= 1, got 0"):
        strategies.main(strategies.Args(runs=(run_root / RUN,), problems=0, out=tmp_path))
    assert not (tmp_path / "strategies.md").exists()


def test_strategies_refuses_runs_that_sample_with_other_limits_rather_than_sample_them_all_with_the_first(
        run_root, tmp_path):
    """Every policy was sampled at the first run's --max-new-tokens and --temperature, said nowhere:
    a run trained at 30 tokens was evaluated at 40."""
    runs = []
    for name, tokens in (("a", 20), ("b", 30)):
        run = tmp_path / name
        run.mkdir()
        saved = json.loads((run_root / RUN / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({**saved, "max_new_tokens": tokens}))
        (run / "summary.json").write_text("{}")
        runs.append(run)
    with pytest.raises(ValueError, match=f"other --max-new-tokens or --temperature \\({runs[0]}: 20 tokens at "
                                         f"temperature 1; {runs[1]}: 30 tokens"):
        strategies.main(strategies.Args(runs=tuple(runs), problems=2, out=tmp_path / "out"))


def test_a_critic_named_by_a_flag_that_is_not_there_is_refused_not_skipped(run_root, tmp_path):
    """`--orm-bt PATH` with a typo in PATH skipped that critic after sampling, with a hint to run
    train.py or pass --build, though the path was the user's own."""
    with pytest.raises(ValueError, match=f"--orm-bt {tmp_path / 'typo'}: no checkpoint there"):
        run_bias(run_root, tmp_path / "out", orm_bt=str(tmp_path / "typo"))
    assert not (tmp_path / "out").exists()
