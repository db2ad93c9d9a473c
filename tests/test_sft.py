"""SFT cold start (sft.py): response-only loss, token-mean accumulation, a smoke run, the report."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from support import sft
from support.config import Config
from support import task


def _tiny(tokenizer):
    return task.make_tiny_model(tokenizer, num_layers=1, hidden_size=64, num_heads=1, intermediate_size=128)


def test_loss_targets_are_the_response_and_eos_only():
    tokenizer = task.build_tokenizer()
    cfg = sft.SFTConfig(shortcut_prob=0.0, merge_prob=0.0)
    problems = task.make_problems(5, seed=0, min_difficulty=1, max_difficulty=4)
    for p, (ids, labels) in zip(problems, sft.make_batch(tokenizer, problems, random.Random(0), cfg)):
        n_prompt = len(p["prompt"])
        assert labels[:n_prompt] == [-100] * n_prompt
        assert labels[n_prompt:] == ids[n_prompt:]
        assert tokenizer.decode(ids[n_prompt:-1]) == task.full_response(p)
        assert ids[-1] == tokenizer.eos_token_id


def test_micro_batching_leaves_the_gradient_unchanged():
    torch.manual_seed(0)
    tokenizer = task.build_tokenizer()
    model = _tiny(tokenizer)
    problems = task.make_problems(6, seed=1, min_difficulty=1, max_difficulty=6)
    batch = sft.make_batch(tokenizer, problems, random.Random(0), sft.SFTConfig())
    grads = []
    for micro in (6, 2, 1):
        model.zero_grad()
        loss = sft.accumulate_gradients(model, batch, micro, tokenizer.pad_token_id)
        grads.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
    for loss, g in grads[1:]:
        assert loss == pytest.approx(grads[0][0], rel=1e-5)
        torch.testing.assert_close(g, grads[0][1], rtol=1e-4, atol=1e-6)


def test_smoke_run_lowers_the_loss_and_writes_a_loadable_checkpoint(tmp_path):
    cfg = sft.SFTConfig(out_dir=str(tmp_path / "sft"), steps=30, batch_size=8, micro_batch_size=8, lr=3e-3,
                        warmup_steps=5, max_difficulty=3, num_layers=1, hidden_size=64, intermediate_size=128)
    summary = sft.train_sft(cfg)
    assert summary["final_loss"] < 0.6 * summary["first_loss"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    text = task.make_problems(1, seed=0)[0]["prompt"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert model.config.num_hidden_layers == 1 and model.config.eos_token_id == tokenizer.eos_token_id


def test_a_diverged_sft_stops_at_its_first_non_finite_gradient_and_saves_nothing(tmp_path):
    """An infinite learning rate sends the weights to inf at step 0, so step 1's loss and gradient are
    NaN: the run stops there, and no pi_SFT (which train.py would cache as a stage) is written."""
    cfg = sft.SFTConfig(out_dir=str(tmp_path / "sft"), steps=5, batch_size=2, micro_batch_size=2, lr=float("inf"),
                        warmup_steps=1, max_difficulty=2, num_layers=1, hidden_size=64, intermediate_size=128)
    with pytest.raises(FloatingPointError, match="SFT step 1: gradient norm is nan"):
        sft.train_sft(cfg)
    assert not (tmp_path / "sft").exists()


def test_bad_config_raises_value_error(tmp_path):
    with pytest.raises(ValueError):
        sft.train_sft(sft.SFTConfig(out_dir=str(tmp_path), steps=0))


def test_report_counts_strategies_and_line_accuracy():
    p = task.make_problems(1, seed=2, min_difficulty=3, max_difficulty=3)[0]
    full = task.full_response(p)
    lines = full.split("\n")
    u = lines[0].index(":") + 1
    lines[0] = lines[0][:u] + str((int(lines[0][u]) + 1) % 10) + lines[0][u + 1 :]  # slip in line 1 only
    slipped, shortcut = "\n".join(lines), "\\boxed{1}"
    rows = [(p, task.parse_response(p["prompt"], r), task.parse_response(p["prompt"], r).boxed == p["answer"], len(r),
             False) for r in (full, slipped, shortcut, "garbage")]
    report = sft.summarize(rows)
    assert report["accuracy"] == 0.5  # the slip only changed a digit of line 1, not the box
    assert report["by_strategy"]["full"]["share"] == 0.5 and report["by_strategy"]["full"]["accuracy"] == 1.0
    assert report["by_strategy"]["shortcut"]["accuracy"] == 0.0
    assert report["line_accuracy"]["single"] == (4 / 6, 6)  # slipped: lines 1 and 2 disagree
    assert report["merged_doubling_share"] == 0.0
    assert report["by_difficulty"]["1-4"]["shortcut_share"] == 0.25
    assert report["by_difficulty"]["1-4"]["worked_accuracy"] == 1.0
    assert "| 1-4 | 4 | 0.50 |" in sft.format_report(report)
    cut = "\n".join(full.split("\n")[:3])  # two right lines, cut off in the third
    report = sft.summarize([(p, task.parse_response(p["prompt"], cut), False, len(cut), True)])
    assert list(report["by_strategy"]) == ["truncated"] and report["line_accuracy"]["single"] == (1.0, 2)
    merged = task.parse_response(p["prompt"], task.sft_response(p, random.Random(0), shortcut_prob=0.0, merge_prob=1.0))
    steps = merged.line_steps  # as many two-doubling lines as fit, then single ones
    report = sft.summarize([(p, merged, True, 10, False), (p, task.parse_response(p["prompt"], full), True, 10, False)])
    assert report["merged_doubling_share"] == sum(n for n in steps if n > 1) / (sum(steps) + 3) and max(steps) == 2


def test_evaluate_task_samples_and_parses_an_untrained_model():
    tokenizer = task.build_tokenizer()
    problems = task.make_problems(4, seed=3, min_difficulty=1, max_difficulty=2)
    report = sft.evaluate_task(_tiny(tokenizer), tokenizer, problems, max_new_tokens=8, seed=0)
    assert report["n"] == 4 and sum(v["share"] for v in report["by_strategy"].values()) == pytest.approx(1.0)
    assert 0 < report["mean_length"] <= 8


def test_prepare_sft_trains_once_then_reuses_the_cache(tmp_path, monkeypatch, capsys):
    cfg = Config(model=None, out_dir=str(tmp_path), sft_steps=2, task_length="short")
    path = sft.prepare_sft(cfg)
    logged = capsys.readouterr().out
    assert f"SFT: saved to {path}" in logged and "sft.partial" not in logged  # where it is, not where it was
    assert path == str(tmp_path / "_shared" / "sft") and (tmp_path / "_shared" / "sft" / "sft_summary.json").exists()
    assert not list((tmp_path / "_shared").glob("sft.partial*"))
    monkeypatch.setattr(sft, "train_sft", lambda *a, **k: pytest.fail("the cached pi_SFT was retrained"))
    assert sft.prepare_sft(cfg) == path
    assert sft.prepare_sft(Config(model=path, out_dir="elsewhere", sft_steps=2)) == path
    with pytest.raises(sft.ModelError, match="no Hugging Face checkpoint there"):
        sft.prepare_sft(Config(model=str(tmp_path), out_dir=str(tmp_path), sft_steps=2))


def test_the_long_task_has_its_own_pi_sft_cache_with_wide_lines(tmp_path):
    cfg = Config(model=None, out_dir=str(tmp_path), sft_steps=1, task_length="long")
    path = sft.prepare_sft(cfg)
    assert path == str(tmp_path / "_shared" / "sft-long") == sft.sft_cache_path(cfg)
    saved = json.loads((tmp_path / "_shared" / "sft-long" / "sft_summary.json").read_text())["config"]
    shape = task.SHAPES["long"]
    assert (saved["width"], saved["min_difficulty"], saved["max_difficulty"]) == (shape.width, *shape.sft_difficulty)
    assert not (tmp_path / "_shared" / "sft").exists()  # the short task's cache is left alone


def test_a_cached_pi_sft_is_reused_only_with_the_settings_it_records(tmp_path):
    """`python -m support.sft` writes the cache train.py reuses: its settings decide, and a cache without
    them (a killed or older sft.py) is refused, never taken as it is."""
    from support.config import ConfigError

    cache = tmp_path / "_shared" / "sft"
    # As `python -m support.sft` does: its report flags (eval_problems, threads, ...) are not the model's settings.
    sft.train_sft(sft.Args(out_dir=str(cache), steps=2, micro_batch_size=2, eval_problems=0, threads=2))
    assert "threads" not in json.loads((cache / "settings.json").read_text())
    assert sft.prepare_sft(Config(model=None, out_dir=str(tmp_path), sft_steps=2, task_length="short")) == str(cache)
    with pytest.raises(ConfigError, match=r"sft was made with other settings \(--sft-steps 2 -> 3\)"):
        sft.prepare_sft(Config(model=None, out_dir=str(tmp_path), sft_steps=3, task_length="short"))
    settings = json.loads((cache / "settings.json").read_text())
    (cache / "settings.json").write_text(json.dumps({**settings, "lr": 1e-2, "num_layers": 2}))
    with pytest.raises(ConfigError, match=r"\(--lr 0.01 -> 0.003, --num-layers 2 -> 3\)"):
        sft.prepare_sft(Config(model=None, out_dir=str(tmp_path), sft_steps=2, task_length="short"))
    (cache / "settings.json").unlink()
    with pytest.raises(ConfigError, match="holds no settings.json"):
        sft.prepare_sft(Config(model=None, out_dir=str(tmp_path), sft_steps=2, task_length="short"))


def test_the_context_length_scales_the_original_length_not_an_extended_one():
    """Llama 3.1 gives its extended 131k as max_position_embeddings beside factor 8 over 8k: it
    was scaled again, to 1M positions; Qwen2.5's YaRN recipe (32k, factor 4) still gives 128k."""
    from support.sft import _context_length

    llama = {"max_position_embeddings": 131072,
             "rope_scaling": {"factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    qwen_yarn = {"max_position_embeddings": 32768, "rope_scaling": {"factor": 4.0, "type": "yarn"}}
    assert _context_length(llama) == 131072
    assert _context_length(qwen_yarn) == 131072
    assert _context_length({"max_position_embeddings": 4096}) == 4096 and _context_length({}) is None


def test_the_returned_loss_is_the_mean_cross_entropy_over_response_tokens():
    """accumulate_gradients returns (and backpropagates) the mean next-token cross-entropy over the
    batch's response and EOS tokens: the prompt tokens count neither in the sum nor in the count."""
    tokenizer = task.build_tokenizer()
    model = _tiny(tokenizer)
    problems = task.make_problems(3, seed=4, min_difficulty=1, max_difficulty=3)
    batch = sft.make_batch(tokenizer, problems, random.Random(0), sft.SFTConfig())
    losses = []
    with torch.no_grad():
        for ids, labels in batch:
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
            for t, label in enumerate(labels[1:]):
                if label != -100:
                    losses.append(-logprobs[t, label].item())
    prompt_tokens = sum(len(p["prompt"]) for p in problems)
    assert len(losses) == sum(len(ids) for ids, _ in batch) - prompt_tokens  # the response and EOS, each once
    loss = sft.accumulate_gradients(model, batch, 2, tokenizer.pad_token_id)
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_the_learning_rate_warms_up_linearly_then_falls_by_a_cosine_to_a_tenth():
    cfg = sft.SFTConfig(steps=110, warmup_steps=10)
    factors = [sft._lr_factor(step, cfg) for step in range(cfg.steps)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # the first step already moves
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert sft._lr_factor(cfg.steps, cfg) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_training_problems_cover_the_difficulty_range_favouring_short_ones():
    """sample_problems draws k in [min, max], both ends included, with weight k^-length_bias."""
    cfg = sft.SFTConfig(batch_size=6000, min_difficulty=2, max_difficulty=5, length_bias=1.0)
    ks = [p["difficulty"] for p in sft.sample_problems(random.Random(0), cfg)]
    weights = {k: 1 / k for k in range(2, 6)}
    for k, w in weights.items():
        assert ks.count(k) / len(ks) == pytest.approx(w / sum(weights.values()), abs=0.02), k
    assert set(ks) == set(weights)


def test_each_sft_step_starts_from_no_gradient_clips_at_max_grad_norm_and_draws_from_the_seed(tmp_path, monkeypatch):
    """train_sft: every step's gradient is its own batch's (none left from the step before), clipped
    at cfg.max_grad_norm; the training problems come from cfg.seed."""
    tokenizer = task.build_tokenizer()
    seen, norms = [], []
    accumulate, clip = sft.accumulate_gradients, torch.nn.utils.clip_grad_norm_

    def accumulate_spy(model, batch, micro_batch_size, pad_id):
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        seen.append([ids for ids, _ in batch])
        return accumulate(model, batch, micro_batch_size, pad_id)

    monkeypatch.setattr(sft, "accumulate_gradients", accumulate_spy)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda params, max_norm: norms.append(max_norm) or clip(params, max_norm))
    batches = {}
    for seed in (0, 1):
        seen.clear()
        cfg = sft.SFTConfig(out_dir=str(tmp_path / str(seed)), seed=seed, steps=2, batch_size=2, micro_batch_size=2,
                            max_difficulty=2, max_grad_norm=0.25)
        sft.train_sft(cfg, model=_tiny(tokenizer), tokenizer=tokenizer)
        batches[seed] = list(seen)
    assert len(batches[0]) == 2 and batches[0] != batches[1]
    assert norms == [0.25] * 4


def test_the_report_groups_difficulties_in_buckets_of_four_from_one():
    """by_difficulty: k = 1..4 in "1-4", 5..8 in "5-8" (k = 4 and k = 5 on either side of the edge)."""
    rows = []
    for k in (4, 5):
        p = task.make_problems(1, seed=k, min_difficulty=k, max_difficulty=k)[0]
        full = task.full_response(p)
        rows.append((p, task.parse_response(p["prompt"], full), True, len(full), False))
    report = sft.summarize(rows)
    assert {d: v["n"] for d, v in report["by_difficulty"].items()} == {"1-4": 1, "5-8": 1}


def test_every_setting_of_the_sft_model_is_in_its_cache_key_and_a_retrained_one_drops_the_old_key(tmp_path,
                                                                                                 monkeypatch):
    """sft_settings holds every SFTConfig field but where it is written and how batches are split
    (SFT_MAY_CHANGE): a pi_SFT of another seed or mix is not reused. Training into a directory drops
    its old settings.json first: killed before the new one is written, it holds none, never the old."""
    from dataclasses import fields, replace

    base = sft.SFTConfig()
    for f in fields(sft.SFTConfig):
        if f.name not in sft.SFT_MAY_CHANGE:  # every other field is a number
            other = replace(base, **{f.name: getattr(base, f.name) + 1})
            assert sft.sft_settings(other) != sft.sft_settings(base), f.name
    assert sft.SFT_MAY_CHANGE == ("out_dir", "micro_batch_size")
    assert sft.sft_settings(replace(base, out_dir="elsewhere", micro_batch_size=1)) == sft.sft_settings(base)

    class Killed(Exception):
        pass

    def killed(*args):
        raise Killed

    (tmp_path / "settings.json").write_text(json.dumps(sft.sft_settings(base)))
    monkeypatch.setattr(sft, "write_json", killed)
    cfg = sft.SFTConfig(out_dir=str(tmp_path), steps=1, batch_size=1, micro_batch_size=1, max_difficulty=1)
    with pytest.raises(Killed):
        sft.train_sft(cfg, model=_tiny(task.build_tokenizer()))
    assert (tmp_path / "config.json").exists() and not (tmp_path / "settings.json").exists()
