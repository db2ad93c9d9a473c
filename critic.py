"""The critic and the outcome reward model: a causal-LM backbone with a scalar head (paper §2, §3.1).

Both are a Hugging Face `AutoModelForTokenClassification` with one label and no dropout, so they
save and load in Hugging Face format like any other checkpoint. The two differ only in how they
are trained and read:
- the outcome reward model (ORM, `train_orm` / `orm_scores`) is regressed onto the +-1 outcome at
  the last token (EOS) only, as a reward model is;
- the critic reads V(s_t) at the position whose next token is response token t: for a prompt
  left-padded to P, sequence position P - 1 + t (`RolloutBatch.response_slice`), and is trained
  with the value loss of Eq. (2) (`critic_loss`).
Plain PPO initialises the critic from the ORM, whose prefix values are out of distribution
(§3.1); VC-PPO initialises it from pi_SFT with a fresh head, then pretrains it (§3.2).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForTokenClassification

from data import sample_prompts, stream_seed
from fsdp_utils import all_reduce, is_main, reduce_metrics, shard_options, world_size
from checkpoints import copy_local_rows, export_hf_checkpoint, load_pretrained
from ppo import value_loss
from rollout import RolloutBatch
from rundir import build_once, check_stage
from sampling import Sampler


def load_value_model(path: str, head_init_std: float | None = None, seed: int = 0, device=None, **shard_options):
    """A backbone + scalar head from `path`, in fp32 (`checkpoints.load_pretrained`: sharded by
    `shard_model(model, **shard_options)` under torchrun, without a whole model on any rank).

    If `path` holds a value model (critic or reward model), its head is loaded as saved.
    If it holds a causal LM (pi_SFT), the head is new: weights ~ N(0, head_init_std) drawn from
    `seed` (the same head on every rank and at every world size), bias 0, so the critic starts
    near V = 0 rather than from Hugging Face's default initialisation.
    """
    config = AutoConfig.from_pretrained(path)
    has_head = any("TokenClassification" in a for a in (config.architectures or []))
    config.num_labels = 1
    config.classifier_dropout = 0.0  # a regression head; dropout would only add noise to V
    head = ("score.weight", "score.bias")
    model = load_pretrained(AutoModelForTokenClassification, path, config, fresh=() if has_head else head,
                            device=device, **shard_options)
    if not has_head and is_main():  # expected, and said in one line (transformers' report is held back)
        tqdm.write(f"critic: a fresh value head (score.weight, score.bias) on the backbone of {path}")
    if not has_head or head_init_std is not None:
        std = 0.02 if head_init_std is None else head_init_std
        weight = torch.empty(model.score.weight.shape).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
        copy_local_rows(model.score.weight, weight)
        copy_local_rows(model.score.bias, torch.zeros(model.score.bias.shape))
    return model


def value_outputs(model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Scalar output at every position: [B, S] float32."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.logits.squeeze(-1).float()


def response_values(model, batch: RolloutBatch) -> torch.Tensor:
    """values[b, t] = V(s_t) for every response token, exactly 0 on padding: [B, T]."""
    values = batch.response_slice(value_outputs(model, **batch.model_inputs()))
    return values * batch.response_mask


def critic_loss(critic, micro, per_token, normalizer, cfg, clip=None):
    """Value loss (Eq. 2) of one micro-batch, for `ppo.update_model`. PPO clips around the old
    values (`cfg.value_clip`); pretraining does not, so the critic moves freely to the MC return."""
    values = response_values(critic, micro)
    return value_loss(
        values, per_token["old_values"], per_token["returns"], micro.response_mask,
        clip=clip, mode=cfg.loss_agg, normalizer=normalizer,
    )


# --- the outcome reward model (§3.1): the critic initialisation of plain PPO -------------------


def _last_token_outputs(model, batch: RolloutBatch) -> torch.Tensor:
    """The model's scalar output after reading each whole response: position P + L_b - 1, [B]."""
    outputs = value_outputs(model, **batch.model_inputs())  # [B, P + T]
    last = batch.prompt_ids.shape[1] + batch.lengths - 1
    return outputs.gather(1, last.unsqueeze(1)).squeeze(1).to(torch.float32)


def train_orm(model, batches: list[RolloutBatch], outcomes: list[torch.Tensor], steps: int, lr: float,
              weight_decay: float = 0.0, max_grad_norm: float = 1.0) -> list[dict]:
    """Train the ORM: MSE between the last-token output and the +-1 outcome, as a reward model is.

    `outcomes[i]` is a float tensor [B_i] of +-1 (e.g. `verifier.rule_reward`) for `batches[i]`.
    Steps cycle through the batches. Returns per-step metrics (loss, sign accuracy). Under torchrun
    `model` is sharded and each rank holds its share of every batch: the squared errors are divided
    by the global row count and FSDP sums the gradients, so the step is the single-process one.
    """
    if len(batches) != len(outcomes) or not batches:
        raise ValueError(f"train_orm: need as many outcome tensors as batches (>0); got "
                         f"{len(batches)} batches, {len(outcomes)} outcome tensors")
    for i, (batch, outcome) in enumerate(zip(batches, outcomes)):
        if tuple(outcome.shape) != (len(batch),):
            raise ValueError(f"train_orm: outcomes[{i}] has shape {tuple(outcome.shape)}, want ({len(batch)},)")
        if bool((batch.lengths < 1).any()):
            raise ValueError(f"train_orm: batches[{i}] holds an empty response (no last token)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    history = []
    bar = tqdm(range(steps), desc="ORM training", dynamic_ncols=True, leave=False, disable=not is_main())
    for step in bar:
        batch, outcome = batches[step % len(batches)], outcomes[step % len(batches)].float()
        rows = all_reduce(torch.tensor(float(len(batch)))).item()  # the global batch
        scores = _last_token_outputs(model, batch)
        squared_errors = ((scores - outcome) ** 2).sum()
        loss = squared_errors / rows  # MSE at the last token only, over every rank's rows
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        optimizer.step()
        correct = (torch.sign(scores.detach()) == torch.sign(outcome)).float().sum()
        totals = reduce_metrics({"loss": squared_errors.item(), "correct": correct.item()}, sums=("loss", "correct"))
        history.append({"step": step, "orm/loss": totals["loss"] / rows,
                        "orm/sign_accuracy": totals["correct"] / rows, "orm/grad_norm": grad_norm})
        bar.set_postfix(loss=f"{history[-1]['orm/loss']:.3f}")
    model.eval()
    return history


@torch.no_grad()
def orm_scores(model, batch: RolloutBatch) -> torch.Tensor:
    """ORM score of each complete response (output at its last token): [B] float32."""
    return _last_token_outputs(model, batch)


# What the cached ORM depends on. It is shared by runs of every seed, so it samples with seed 0
# whichever run trains it: the same ORM whatever order the runs come in.
ORM_SETTINGS = ("orm_batches", "orm_steps", "orm_lr", "prompts_per_step", "samples_per_prompt",
                "max_new_tokens", "temperature", "top_p", "truncation_reward", "model", "data",
                "task_train_size", "task_difficulty", "max_prompt_tokens", "eval_fraction", "val_data",
                "val_prompt_key", "val_answer_key", "prompt_template", "answer_format")


def orm_path(cfg) -> str:
    """Where the ORM of a run is cached: shared by every run of the built-in task (orm, or orm-long
    for its long version; orm-long-k46-52 with --task-difficulty 46 52), one per run with --model."""
    if cfg.model is not None:
        return os.path.join(cfg.out_dir, "_shared", f"orm-{cfg.run_name}")
    name = "orm" if cfg.task_length == "short" else f"orm-{cfg.task_length}"
    if cfg.task_difficulty is not None:  # its own problems: beside the task length's ORM, not in its place
        name += "-k{}-{}".format(*cfg.task_difficulty)
    return os.path.join(cfg.out_dir, "_shared", name)


def orm_settings(cfg) -> dict:
    """What a cached ORM is checked against (its settings.json)."""
    return {k: getattr(cfg, k) for k in ORM_SETTINGS}


def check_orm(cfg) -> None:
    """Before anything is written: a cached ORM was trained with this run's settings."""
    path = orm_path(cfg)
    if os.path.exists(path):
        check_stage(path, orm_settings(cfg), remedy="delete it to train a new one")


def prepare_orm(cfg, sft_path: str, sampler: Sampler, records: list[dict]) -> str:
    """The ORM that plain PPO's critic starts from (`--critic-init rm`), trained once on pi_SFT's
    graded samples (a cached stage, `rundir.build_once`, which checks a cached one's settings); its path."""
    path = orm_path(cfg)

    def build(staging: str) -> None:
        orm_cfg = dataclasses.replace(cfg, seed=0)
        batches, outcomes = [], []
        for i in tqdm(range(cfg.orm_batches), desc="ORM data", dynamic_ncols=True, leave=False):
            prompts = sample_prompts(records, orm_cfg, i, stream="orm")
            scored = sampler.sample_and_score(prompts, stream_seed(0, "orm/sampling", i))
            batches.append(scored.batch)
            outcomes.append(scored.outcomes)
        # Sharded under torchrun like the critic, each rank training on its own samples, on the
        # device the engine put them on.
        model = load_value_model(sft_path, seed=stream_seed(0, "orm/head", 0), device=batches[0].device,
                                 **shard_options(cfg))
        history = train_orm(model, batches, outcomes, steps=cfg.orm_steps, lr=cfg.orm_lr)
        export_hf_checkpoint(model, sampler.tokenizer, staging)  # streamed from the shards: collective
        last = history[-1]
        if is_main():
            tqdm.write(f"ORM: {cfg.orm_steps} steps on {sum(map(len, batches)) * world_size()} graded samples, "
                       f"loss {last['orm/loss']:.3f}, sign accuracy {last['orm/sign_accuracy']:.2f} -> {path}")

    build_once(path, orm_settings(cfg), build, remedy="delete it to train a new one")
    return path
