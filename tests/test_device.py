"""Placement: every tensor a stage builds is on the device of the model that consumes it.

The models sit on a second device (tests/second_device.py: CPU data under CUDA's placement rules),
so a tensor built on the CPU where the model's device was meant fails here as it would on a GPU:
rollout, scoring, the old log-probs and values, decoupled GAE (its GPU path), the PPO and critic
updates, GRPO, value pretraining, the outcome reward model and evaluation.
"""

import copy
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForTokenClassification

sys.path.insert(0, str(Path(__file__).parent / "dist_workers"))
from support import config  # noqa: E402
import train  # noqa: E402
from common import PROMPTS, tiny_actor  # noqa: E402
from support.data import prepare_data  # noqa: E402
from evaluate import evaluate  # noqa: E402
from critic import ORM_HELDOUT_BATCHES, load_value_model, prepare_orm  # noqa: E402
from rollout import HFRollout, RolloutBatch  # noqa: E402
from sampling import Sampler  # noqa: E402
from second_device import DEVICE, second_device  # noqa: E402
from value_pretrain import pretrain_value  # noqa: E402
from reward import Grader  # noqa: E402

MICRO = ["--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "6",
         "--micro-batch-size", "3", "--num-minibatches", "2", "--eval-samples", "2",
         "--task-train-size", "16", "--task-eval-size", "2", "--value-pretrain-steps", "1"]


def tensors_of(batch: RolloutBatch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "finish_reasons"}


def value_model_like(actor):
    """A critic with the actor's backbone shape and a scalar head."""
    cfg = copy.deepcopy(actor.config)
    cfg.num_labels, cfg.classifier_dropout = 1, 0.0
    torch.manual_seed(0)
    return AutoModelForTokenClassification.from_config(cfg)


@pytest.fixture(scope="module")
def grader():
    with Grader(num_workers=1, timeout_s=5.0) as g:
        yield g


def test_the_second_device_catches_a_cpu_tensor_meeting_a_model_tensor():
    """The check itself can fail: what HFRollout used to do (prompt ids on the CPU)."""
    tokenizer, actor = tiny_actor()
    with second_device():
        actor = actor.to(DEVICE)
        with pytest.raises(RuntimeError, match="same device"):
            actor(input_ids=torch.tensor([[3, 4, 5]]))
        assert actor(input_ids=torch.tensor([[3, 4, 5]], device=DEVICE)).logits.device == DEVICE
        with pytest.raises(RuntimeError, match="same device"):  # CPU values indexed by device rows
            torch.zeros(3)[torch.tensor([0, 2], device=DEVICE)]


@pytest.mark.parametrize("on_second_device", [False, True])
def test_every_tensor_of_an_engine_batch_is_on_the_models_device(on_second_device):
    tokenizer, actor = tiny_actor()
    with second_device() if on_second_device else torch.no_grad():
        if on_second_device:
            actor = actor.to(DEVICE)
        batch = HFRollout(actor, tokenizer).generate([tokenizer(p).input_ids for p in PROMPTS], 6, seed=0)
        device = next(actor.parameters()).device
        assert {name: t.device for name, t in tensors_of(batch).items()} == {name: device for name in tensors_of(batch)}
        assert batch.device == device
        rows = [rows.device for rows, _ in batch.micro_batches(torch.arange(len(batch)), 2)]  # CPU rows in
        assert rows == [device] * len(rows)


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_ppo_step_runs_with_its_models_on_another_device(estimator, grader):
    """ppo_step whole: rollout, reward, old log-probs and values, advantages, both updates, metrics."""
    cfg = config.parse_config([*MICRO, "--estimator", estimator, "--kl-coef", "0.1", "--length-adaptive-alpha", "0.5"])
    tokenizer, actor = tiny_actor()
    records, _ = prepare_data(cfg, tokenizer)
    with second_device():
        models = {"actor": actor.to(DEVICE)}
        if estimator == "gae":
            models["critic"] = value_model_like(actor).to(DEVICE)
        optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
        sampler = Sampler(cfg, HFRollout(models["actor"], tokenizer), tokenizer, grader)
        reference = tiny_actor()[1].to(DEVICE)
        metrics = train.ppo_step(cfg, 0, sampler, records, models, optimizers, reference)
        assert all(p.device == DEVICE for m in models.values() for p in m.parameters())
    assert metrics["actor/grad_norm"] > 0 and ("critic/grad_norm" in metrics) == (estimator == "gae")


def test_advantage_bias_sums_run_with_the_rollouts_and_critic_on_another_device(grader):
    """analysis/advantage_bias.py built each response's first-quarter mask (since replaced by fixed
    positions) on the CPU against lengths on the rollouts' device: on a GPU it would have stopped after every training run of
    analysis/collapse.py. The same sums as on the CPU."""
    from analysis import advantage_bias

    cfg = config.parse_config(MICRO)
    tokenizer, actor = tiny_actor()
    records, _ = prepare_data(cfg, tokenizer)
    sums = {}
    for on_device in (False, True):
        with second_device() if on_device else torch.no_grad():
            device = DEVICE if on_device else torch.device("cpu")
            policy, critic = copy.deepcopy(actor).to(device), value_model_like(actor).to(device)
            scored = Sampler(cfg, HFRollout(policy, tokenizer), tokenizer, grader).sample_and_score(records[:4], seed=0)
            with torch.no_grad():
                s = advantage_bias.position_sums([scored], critic, (0.95,), 1.0, width=8, bin_size=4)
            sums[on_device] = (s["count"], s["adv"][0.95], s["early_adv"][0.95])
    assert sums[True][0].tolist() == sums[False][0].tolist()
    assert np.allclose(sums[True][1], sums[False][1]) and np.allclose(sums[True][2], sums[False][2])


def test_value_pretraining_orm_and_evaluation_run_with_their_models_on_another_device(grader, tmp_path):
    cfg = config.parse_config(MICRO)
    tokenizer, actor = tiny_actor()
    records, eval_records = prepare_data(cfg, tokenizer)
    sft_path = str(tmp_path / "sft")
    actor.save_pretrained(sft_path)
    tokenizer.save_pretrained(sft_path)
    on_cpu = evaluate(Sampler(cfg, HFRollout(copy.deepcopy(actor), tokenizer), tokenizer, grader), eval_records, "cpu")
    with second_device():
        sampler = Sampler(cfg, HFRollout(actor.to(DEVICE), tokenizer), tokenizer, grader)
        critic = value_model_like(actor).to(DEVICE)
        optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
        history = pretrain_value(cfg, critic, optimizer, sampler, records, str(tmp_path / "vp"))
        assert len(history) == 1
        orm_cfg = dataclasses.replace(cfg, critic_init="rm", out_dir=str(tmp_path), orm_batches=1, orm_steps=2)
        orm_dir = Path(prepare_orm(orm_cfg, sft_path, sampler, records))
        on_device = evaluate(sampler, eval_records, "test")
    assert load_value_model(str(orm_dir)).score.bias.item() != 0.0  # trained: a fresh head's bias is 0
    held_out = json.loads((orm_dir / "quality.json").read_text())["all"]  # ORM_HELDOUT_BATCHES fresh batches
    assert held_out["responses"] == ORM_HELDOUT_BATCHES * cfg.prompts_per_step * cfg.samples_per_prompt
    assert on_device == on_cpu  # the same draws and verdicts: the device moved the tensors, nothing else
