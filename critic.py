"""The critic and the outcome reward model: a causal-LM backbone with a scalar head (paper §2, §3.1).

Both are a Hugging Face `AutoModelForTokenClassification` with one label and no dropout, so they
save and load in Hugging Face format like any other checkpoint. The two differ only in how they
are trained and read:
- the outcome reward model (ORM, `train_orm` / `orm_scores`) is trained on the +-1 outcome at the
  last token (EOS) only, as a reward model is: regressed onto it, or (`--orm-loss bradley-terry`)
  ranked by it, correct responses above wrong ones;
- the critic reads V(s_t) at the position whose next token is response token t: for a prompt
  left-padded to P, sequence position P - 1 + t (`RolloutBatch.response_slice`), and is trained
  with the value loss of Eq. (2) (`critic_loss`).
Plain PPO initialises the critic from the ORM, whose prefix values are out of distribution
(§3.1); VC-PPO initialises it from pi_SFT with a fresh head, then pretrains it (§3.2).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForTokenClassification

from support.data import sample_prompts, stream_seed
from fsdp_utils import all_reduce, any_rank, is_main, reduce_metrics, shard_options, world_size
from support.checkpoints import copy_local_rows, export_hf_checkpoint, load_pretrained
from support.config import ConfigError, one_key_as_text
from ppo import value_loss
from rollout import RolloutBatch
from support.rundir import build_once, check_stage, input_files, write_json
from sampling import Sampler


def fresh_head_seed(run_seed: int) -> int:
    """The seed of a run's fresh value head on pi_SFT: the critic a run with `--seed run_seed` starts from."""
    return stream_seed(run_seed, "critic/head", 0)


VALUE_HEADS = ("score", "classifier")  # the token-classification head's name: Qwen2's, Llama's; GPT-2's, GPT-NeoX's


def value_head_name(model) -> str:
    """The name of a value model's scalar head, the one of VALUE_HEADS its family gives it."""
    return next(name for name in VALUE_HEADS if hasattr(model, name))


def load_value_model(path: str, head_init_std: float = 0.02, seed: int = 0, device=None, **shard_options):
    """A backbone + scalar head from `path`, in fp32 (`checkpoints.load_pretrained`: sharded by
    `shard_model(model, **shard_options)` under torchrun, without a whole model on any rank).

    If `path` holds a value model (critic or reward model), its head is loaded as saved.
    If it holds a causal LM (pi_SFT), the head is new: weights ~ N(0, head_init_std) drawn from
    `seed` (the same head on every rank and at every world size), bias 0, so the critic starts
    within a few tenths of V = 0 rather than from Hugging Face's default initialisation: V(s_t) is
    the head's weights times the hidden state, of spread head_init_std x |h_t| (|h_t| ~ 15 on the
    built-in task's pi_SFT: values around -0.2 to 0 on its responses).
    """
    config = AutoConfig.from_pretrained(path)
    has_head = any("TokenClassification" in a for a in (config.architectures or []))
    config.num_labels = 1
    config.classifier_dropout = 0.0  # absent, the head's dropout defaults to 0.1 (the rest: without_dropout)
    fresh = () if has_head else tuple(f"{name}.{p}" for name in VALUE_HEADS for p in ("weight", "bias"))
    model = load_pretrained(AutoModelForTokenClassification, path, config, fresh=fresh, device=device,
                            **shard_options)
    if not has_head:
        name = value_head_name(model)
        if is_main():  # expected, and said in one line (transformers' report is held back)
            tqdm.write(f"critic: a fresh value head ({name}.weight, {name}.bias) on the backbone of {path}")
        head = getattr(model, name)
        weight = torch.empty(head.weight.shape).normal_(0.0, head_init_std, generator=torch.Generator().manual_seed(seed))
        copy_local_rows(head.weight, weight)
        copy_local_rows(head.bias, torch.zeros(head.bias.shape))
    return model


@torch.no_grad()
def shift_values(model, offset: float):
    """Add `offset` to the value head's bias, so that every V(s_t) moves by exactly `offset`:
    `--critic-init-offset`, the critic's initial error set by hand (§3.1). Each rank adds it to its
    own rows of the (possibly sharded) bias. Returns `model`."""
    if offset:
        bias = getattr(model, value_head_name(model)).bias
        (bias.to_local() if hasattr(bias, "to_local") else bias).add_(offset)
    return model


def value_outputs(model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Scalar output at every position: [B, S] float32. No KV cache: nothing generates after it."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits.squeeze(-1).float()


def response_values(model, batch: RolloutBatch) -> torch.Tensor:
    """values[b, t] = V(s_t) for every response token, exactly 0 on padding: [B, T]."""
    values = batch.response_slice(value_outputs(model, **batch.model_inputs()))
    return values * batch.response_mask


def critic_loss(critic, micro, per_token, normalizer, cfg, clip=None):
    """Value loss (Eq. 2) of one micro-batch, for `ppo_update.update_model`. PPO clips around the old
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


def preference_pairs(outcomes: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(winners, losers): row indices of every pair of responses to the same prompt (rows come in
    groups of `group` side by side, `data.sample_prompts`) where the first is right and the second wrong."""
    pairs = [(w, l) for start in range(0, len(outcomes), group)
             for w in range(start, min(start + group, len(outcomes)))
             for l in range(start, min(start + group, len(outcomes))) if outcomes[w] > 0 >= outcomes[l]]
    winners, losers = zip(*pairs) if pairs else ((), ())
    return torch.tensor(winners, dtype=torch.long), torch.tensor(losers, dtype=torch.long)


def train_orm(model, batches: list[RolloutBatch], outcomes: list[torch.Tensor], steps: int, lr: float,
              loss: str = "mse", group: int = 2, max_grad_norm: float = 1.0) -> list[dict]:
    """Train the ORM on its last-token score, as a reward model is. `loss`:
    - "mse": (score - outcome)^2, the score regressed onto the +-1 outcome; logs the sign accuracy;
    - "bradley-terry": -log sigmoid(score_w - score_l) over every (right, wrong) pair of responses to
      one prompt (`preference_pairs`, prompts in groups of `group` rows); only score differences are
      trained, so the offset and scale are what training leaves them; logs the share of pairs ordered right.

    `outcomes[i]` is a float tensor [B_i] of +-1 (e.g. a `reward.Grader`'s; a cut response may have its
    --truncation-reward, <= 0) for `batches[i]`.
    Steps cycle through the batches (with Bradley-Terry, those that hold a pair). Returns per-step
    metrics. Under torchrun `model` is sharded and each rank holds its share of every batch: the
    per-row (per-pair) losses are divided by the global count and FSDP sums the gradients, so the step
    is the single-process one.
    """
    if loss not in ("mse", "bradley-terry"):
        raise ValueError(f"train_orm: loss must be 'mse' or 'bradley-terry', got {loss!r}")
    if len(batches) != len(outcomes) or not batches:
        raise ValueError(f"train_orm: need as many outcome tensors as batches (>0); got "
                         f"{len(batches)} batches, {len(outcomes)} outcome tensors")
    for i, (batch, outcome) in enumerate(zip(batches, outcomes)):
        if tuple(outcome.shape) != (len(batch),):
            raise ValueError(f"train_orm: outcomes[{i}] has shape {tuple(outcome.shape)}, want ({len(batch)},)")
        if bool((batch.lengths < 1).any()):
            raise ValueError(f"train_orm: batches[{i}] holds an empty response (no last token)")
    pairs = [preference_pairs(o.cpu(), group) for o in outcomes]
    counts = [all_reduce(torch.tensor(float(len(batch) if loss == "mse" else len(w)))).item()
              for batch, (w, _) in zip(batches, pairs)]  # global rows (pairs) of each batch
    usable = [i for i, n in enumerate(counts) if n > 0]
    if not usable:
        raise ConfigError(f"Bradley-Terry reward model: no prompt among its {len(batches)} batches of pi_SFT samples has "
                          f"both a right and a wrong response, so there is no pair to rank; raise --orm-batches or "
                          f"--samples-per-prompt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    history = []
    bar = tqdm(range(steps), desc="ORM training", dynamic_ncols=True, leave=False, disable=not is_main())
    for step in bar:
        i = usable[step % len(usable)]
        batch, outcome, (winners, losers), count = batches[i], outcomes[i].float(), pairs[i], counts[i]
        scores = _last_token_outputs(model, batch)
        if loss == "mse":
            summed = ((scores - outcome) ** 2).sum()  # MSE at the last token only, over every rank's rows
            # Right where the score's sign is the outcome's: a cut response's --truncation-reward 0 is a wrong one.
            correct = ((scores.detach() > 0) == (outcome > 0)).float().sum()
        else:
            margin = scores[winners.to(scores.device)] - scores[losers.to(scores.device)]
            summed = -torch.nn.functional.logsigmoid(margin).sum()
            correct = (margin.detach() > 0).float().sum()
        optimizer.zero_grad(set_to_none=True)
        (summed / count).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        # A NaN loss would step every weight to NaN, and the diverged ORM be cached as a stage. As in
        # update_model: a global norm, so every rank stops here together.
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"ORM training step {step}: gradient norm is {grad_norm}")
        optimizer.step()
        totals = reduce_metrics({"loss": summed.item(), "correct": correct.item()}, sums=("loss", "correct"))
        accuracy = "orm/sign_accuracy" if loss == "mse" else "orm/pair_accuracy"
        history.append({"step": step, "orm/loss": totals["loss"] / count, accuracy: totals["correct"] / count,
                        "orm/grad_norm": grad_norm})
        bar.set_postfix(loss=f"{history[-1]['orm/loss']:.3f}")
    optimizer.zero_grad(set_to_none=True)  # the trained ORM keeps no gradients (ppo_update.update_model)
    model.eval()
    return history


@torch.no_grad()
def orm_scores(model, batch: RolloutBatch) -> torch.Tensor:
    """ORM score of each complete response (output at its last token): [B] float32."""
    return _last_token_outputs(model, batch)


def roc_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """P(a positive scores above a negative), ties counting half: the ROC AUC (NaN without both classes)."""
    pos, neg = scores[positive], scores[~positive]
    if not len(pos) or not len(neg):
        return float("nan")
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


def auc_text(auc: float) -> str:
    """An AUC for a log line: NaN, when the outcomes are all equal and there is no pair to rank, in words."""
    return "undefined (all outcomes equal)" if math.isnan(auc) else f"{auc:.3f}"


def orm_quality(model, scored: list) -> dict:
    """The ORM judged as a reward model (what it was trained for): its score at the last token of each
    response (`ScoredBatch`es) against the verified outcome, on complete responses (ended with EOS) and
    on all of them. AUC is the measure for either loss (a Bradley-Terry score has no meaningful zero);
    sign accuracy is set beside the base rate, the accuracy of always answering the majority outcome."""
    scores = torch.cat([orm_scores(model, s.batch).cpu() for s in scored]).numpy()
    correct = torch.cat([s.outcomes.cpu() for s in scored]).numpy() > 0
    complete = np.array([f == "stop" for s in scored for f in s.batch.finish_reasons])
    out = {}
    for name, keep in (("complete", complete), ("all", np.ones_like(complete))):
        sc, ok = scores[keep], correct[keep]
        if not len(sc):
            continue
        out[name] = {"responses": int(len(sc)), "correct": int(ok.sum()), "auc": roc_auc(sc, ok),
                     "sign_accuracy": float(((sc > 0) == ok).mean()), "base_rate": float(max(ok.mean(), 1 - ok.mean())),
                     "mean_score_correct": float(sc[ok].mean()) if ok.any() else float("nan"),
                     "mean_score_wrong": float(sc[~ok].mean()) if (~ok).any() else float("nan")}
    return out


# What the cached ORM depends on. It is shared by runs of every seed, so it samples with seed 0
# whichever run trains it: the same ORM whatever order the runs come in.
ORM_SETTINGS = ("orm_batches", "orm_steps", "orm_lr", "orm_loss", "prompts_per_step", "samples_per_prompt",
                "max_new_tokens", "temperature", "top_p", "truncation_reward", "model", "data",
                "task_train_size", "task_difficulty", "max_prompt_tokens", "eval_fraction", "val_data",
                "val_prompt_key", "val_answer_key", "prompt_template", "answer_format", "prompt_format")


def orm_path(cfg) -> str:
    """Where the ORM of a run is cached: shared by every run of the built-in task (orm, or orm-long
    for its long version; orm-long-k46-52 with --task-difficulty 46 52; a -bt suffix for a Bradley-Terry
    one), one per run with --model."""
    loss = "-bt" if cfg.orm_loss == "bradley-terry" else ""
    if cfg.model is not None:
        return os.path.join(cfg.out_dir, "_shared", f"orm{loss}-{cfg.run_name}")
    name = "orm" if cfg.task_length == "short" else f"orm-{cfg.task_length}"
    if cfg.task_difficulty is not None:  # its own problems: beside the task length's ORM, not in its place
        name += "-k{}-{}".format(*cfg.task_difficulty)
    return os.path.join(cfg.out_dir, "_shared", name + loss)


def orm_settings(cfg) -> dict:
    """What a cached ORM is checked against (its settings.json); with --model or --data, their
    files' stamps too (`rundir.input_files`)."""
    files = input_files(cfg)
    return one_key_as_text({k: getattr(cfg, k) for k in ORM_SETTINGS}) | ({"input_files": files} if files else {})


def check_orm(cfg) -> None:
    """Before anything is written: a cached ORM was trained with this run's settings."""
    path, settings = orm_path(cfg), orm_settings(cfg)  # every rank: orm_settings broadcasts
    if any_rank(os.path.exists(path)):  # every rank decides alike, as another run may finish it meanwhile
        check_stage(path, settings, remedy="delete it to train a new one")


ORM_HELDOUT_BATCHES = 2  # fresh pi_SFT batches, not trained on, that judge the ORM (quality.json)


def prepare_orm(cfg, sft_path: str, sampler: Sampler, records: list[dict]) -> str:
    """The ORM that plain PPO's critic starts from (`--critic-init rm`), trained once on pi_SFT's
    graded samples (a cached stage, `rundir.build_once`, which checks a cached one's settings); its path.
    Beside the model, quality.json: its AUC and sign accuracy on ORM_HELDOUT_BATCHES fresh batches
    (rank 0's share under torchrun)."""
    path = orm_path(cfg)

    def build(staging: str) -> None:
        orm_cfg = dataclasses.replace(cfg, seed=0)
        draw = lambda stream, i: sampler.sample_and_score(  # noqa: E731
            sample_prompts(records, orm_cfg, i, stream=stream), stream_seed(0, f"{stream}/sampling", i))
        scored = [draw("orm", i) for i in tqdm(range(cfg.orm_batches), desc="ORM data", dynamic_ncols=True, leave=False,
                                                   disable=not is_main())]
        # Sharded under torchrun like the critic, each rank training on its own samples, on the
        # device the engine put them on.
        model = load_value_model(sft_path, seed=stream_seed(0, "orm/head", 0), device=scored[0].batch.device,
                                 **shard_options(cfg))
        history = train_orm(model, [s.batch for s in scored], [s.outcomes for s in scored], steps=cfg.orm_steps,
                            lr=cfg.orm_lr, loss=cfg.orm_loss, group=cfg.samples_per_prompt)
        export_hf_checkpoint(model, sampler.tokenizer, staging)  # streamed from the shards: collective
        quality = orm_quality(model, [draw("orm-heldout", i) for i in range(ORM_HELDOUT_BATCHES)])
        if is_main():
            write_json(os.path.join(staging, "quality.json"), {"loss": cfg.orm_loss, "final_step": history[-1], **quality})
            # On complete responses: a cut one is a wrong one by its reward and ends without EOS, easy to rank.
            held_out = quality.get("complete", {})
            tqdm.write(f"ORM ({cfg.orm_loss}): {cfg.orm_steps} steps on {sum(len(s.batch) for s in scored) * world_size()} "
                       f"graded samples, loss {history[-1]['orm/loss']:.3f}; held-out AUC "
                       f"{auc_text(held_out.get('auc', float('nan')))} on {held_out.get('responses', 0)} complete "
                       f"responses -> {path}")

    build_once(path, orm_settings(cfg), build, owner=cfg.run_name, remedy="delete it to train a new one")
    return path
