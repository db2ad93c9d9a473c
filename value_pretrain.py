"""Value pretraining (paper §3.2, Algorithm 1 lines 1-4).

Freeze the policy at pi_SFT, sample responses from it, compute critic targets with GAE at
lambda = 1.0 (the Monte-Carlo return: with one terminal reward every token's target is the final
+-1), and regress the critic on them. The paper reports a fast "range alignment" phase, then a slower
"knowledge injection" phase, and finds ~100 steps best (overfitting beyond ~150).

Convergence (documented criterion): every step logs value loss and explained variance (the loss
its update computed, averaged over its optimizer steps; the explained variance of the values
before that update, on the step's fresh batch, against its returns); pretraining
stops at `value_pretrain_steps`, or earlier once both plateau: over two consecutive windows of
`plateau_window` steps, the mean value loss falls by less than `plateau_rel_tol` (relative) and the
mean explained variance rises by less than `plateau_ev_tol` (absolute), each by a margin of two
standard errors of the difference of the two means (from the steps' spread within each window).
Each step's loss is on a fresh batch, and mostly follows how mixed that batch's outcomes are, so a
window's mean can dip by chance while the critic still learns; where the batches are too small for
the windows to tell, pretraining runs all its steps. A step whose returns are all equal (every
response right, or every one wrong) has no explained variance (NaN): the means skip it, and a window
with fewer than two is judged on the value loss alone. A window of one step cannot show its noise,
so `plateau_window` 1 never stops early.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os

import torch
from tqdm import tqdm

from support import preemption
from support.config import ConfigError, one_key_as_text
from critic import critic_loss, response_values, shift_values
from support.data import sample_prompts, stream_seed
from fsdp_utils import all_reduce, any_rank, from_main, is_main, reduce_metrics, world_size
from support.checkpoints import (export_hf_checkpoint, remove_checkpoint, restore_latest, save_checkpoint,
                                 saved_checkpoints)
from gae import compute_gae
from support.masked import check_masked_inputs
from ppo import explained_variance
from ppo_update import assert_finite, micro_batched_forward, update_model
from support.rundir import (MAY_CHANGE, STAGE_SETTINGS, build_shared, check_link, check_stage, input_files,
                            json_safe, read_json, shared_path, staging_path)
from sampling import Sampler

# Settings that act only after value pretraining (PPO's own, and the run's name).
# Runs that differ only in these pretrain the same critic bit for bit (the lambda sweep's runs of one
# seed, or vc-ppo-no-dgae's), so they share it.
PPO_ONLY = ("run_name", "plan", "lam_actor", "lam_critic", "length_adaptive_alpha", "actor_lr", "lr_warmup_steps",
            "clip_low", "clip_high", "dual_clip", "whiten_advantages", "kl_coef", "kl_estimator", "entropy_coef",
            "eval_temperature", "eval_max_new_tokens")
# Never read by pretraining either (it regresses on the returns unclipped, and evaluates nothing),
# but keyed until 2026-12-05: a critic pretrained before is still found (`pretrain_stage`).
KEYED_BEFORE = ("value_clip", "eval_samples", "task_eval_size")
ORM_SETTINGS = ("orm_batches", "orm_steps", "orm_lr", "orm_loss")  # keyed only where the critic starts from the ORM
# Data settings added after critics had been pretrained and shared: left out of the key while unset,
# so that those critics are still found.
KEYED_WHEN_SET = ("val_data", "val_prompt_key", "val_answer_key", "prompt_template", "answer_format", "prompt_format")


def pretrain_settings(cfg) -> dict:
    """What the pretrained critic depends on: every setting but PPO_ONLY, KEYED_BEFORE, the ORM's
    unless the critic starts from it, and rundir.MAY_CHANGE (how a run runs, which a --resume may
    change), and the world size (each rank samples its own share)."""
    unread = PPO_ONLY + MAY_CHANGE + KEYED_BEFORE + (ORM_SETTINGS if cfg.critic_init != "rm" else ())
    settings = one_key_as_text({k: v for k, v in dataclasses.asdict(cfg).items()
                                if k not in unread and not (k in KEYED_WHEN_SET and v is None)})
    settings["world_size"] = world_size()
    if files := input_files(cfg):  # --model and --data by their contents' stamps, not their paths alone
        settings["input_files"] = files
    if cfg.critic_init == "rm" and cfg.model is not None:  # then each run trains its own ORM (critic.orm_path)
        settings["run_name"] = cfg.run_name
    return settings


def pretrain_stage(cfg) -> tuple[str, dict]:
    """(where the critic of these settings is pretrained and shared, <out_dir>/_shared/value_pretrain/
    <key>, and its `pretrain_settings`): at its key; else, where the key of before (with KEYED_BEFORE
    and ORM_SETTINGS) puts it, if built or begun by this run (a stopped pretraining goes on there);
    else a stage built under another key of before, one that differs only in those settings. No
    critic pretrained before is pretrained again, and no stopped pretraining starts over."""
    settings, config = pretrain_settings(cfg), dataclasses.asdict(cfg)
    stage = shared_path(cfg, "value_pretrain", settings)
    before = shared_path(cfg, "value_pretrain", settings | {k: config[k] for k in KEYED_BEFORE + ORM_SETTINGS})

    def begun(path):
        return os.path.exists(path) or os.path.exists(staging_path(path, cfg.run_name))

    for path in (stage, before):
        if any_rank(begun(path)):
            return path, settings
    built = sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(stage)), "*"))) if is_main() else []
    return from_main(next((p for p in built if _built_before_with(p, settings)), stage)), settings


def _built_before_with(path: str, settings: dict) -> bool:
    """Whether `path` holds a stage built with `settings` and other values of KEYED_BEFORE and
    ORM_SETTINGS only: a setting it records beyond those (a --val-data, which the key leaves out
    while unset) makes it another critic."""
    recorded = os.path.join(path, STAGE_SETTINGS)
    if ".partial-" in os.path.basename(path) or not os.path.isfile(recorded):
        return False
    try:
        if set(read_json(recorded, "")) - set(settings) - set(KEYED_BEFORE + ORM_SETTINGS):
            return False
        check_stage(path, settings)
    except ConfigError:
        return False
    return True


def plateaued(history: list[dict], window: int, rel_tol: float, ev_tol: float) -> bool:
    """True when value loss and explained variance stopped improving (module docstring)."""
    if len(history) < 2 * window:
        return False
    prev, last = history[-2 * window : -window], history[-window:]

    def mean_and_variance(rows, key):  # over the steps where it is defined; NaN where fewer than two
        values = [r[key] for r in rows if math.isfinite(r[key])]  # are: one step cannot show its noise
        if len(values) < 2:
            return math.nan, math.nan
        mean = sum(values) / len(values)
        return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)  # the mean's variance

    def change(key):  # the last window's mean less the one before, and two standard errors of that
        (before, var_before), (after, var_after) = mean_and_variance(prev, key), mean_and_variance(last, key)
        return after - before, 2 * math.sqrt(var_before + var_after), before

    loss_change, loss_margin, loss_prev = change("value_loss")
    ev_change, ev_margin, _ = change("explained_variance")
    ev_flat = math.isnan(ev_change) or ev_change + ev_margin < ev_tol
    return -loss_change + loss_margin < rel_tol * loss_prev and ev_flat


def pretrain_step(cfg, step: int, critic, critic_optimizer, sampler: Sampler, records: list[dict]) -> dict:
    """One step of §3.2: sample from the frozen policy, regress the critic on the lambda = 1 return."""
    prompts = sample_prompts(records, cfg, step, stream="value_pretrain")
    scored = sampler.sample_and_score(prompts, stream_seed(cfg.seed, "value_pretrain/sampling", step))
    batch, mask = scored.batch, scored.batch.response_mask
    values = micro_batched_forward(functools.partial(response_values, critic), batch, cfg.micro_batch_size,
                                   cfg.micro_batch_tokens)
    assert_finite([("values", values)], "forward before the update")
    # Critic targets with lambda = 1: the Monte-Carlo return, no lambda^(T-t) decay (§3.3).
    _, returns = compute_gae(scored.token_rewards, values, mask, cfg.gamma, lam=1.0)
    per_token = {"returns": returns, "old_values": values}
    check_masked_inputs(mask, right_padded=True, **per_token)  # once here, not in every micro-batch's loss
    metrics = update_model(cfg, critic, critic_optimizer, batch, per_token, critic_loss,
                           seed=stream_seed(cfg.seed, "value_pretrain/shuffle", step), prefix="critic")
    assert_finite(critic.named_parameters(), "critic after the update")
    # Over all ranks (vf_loss already is), so that every rank takes the same stopping decision.
    return {"step": step, "value_loss": metrics["critic/vf_loss"]} | reduce_metrics({
        "explained_variance": explained_variance(values, returns, mask, total=all_reduce).item(),  # every rank's tokens
        "reward_mean": scored.outcomes.mean().item(),
        "response_length": batch.lengths.float().mean().item(),
    })


def pretrain_value(cfg, critic, critic_optimizer, sampler: Sampler, records: list[dict], out_dir: str) -> list[dict]:
    """Train `critic` against the frozen policy behind `sampler`; save it and its curve to `out_dir`
    (critic/, curve.jsonl). Returns the per-step history (value_loss, explained_variance, ...)."""
    os.makedirs(out_dir, exist_ok=True)
    # Checkpointed every `save_every` steps like PPO (100 steps at 32B take hours); a resumed run
    # replays the same draws (data.stream_seed), so it ends as if never stopped.
    ckpt, history = os.path.join(out_dir, "checkpoint"), []
    if cfg.resume and (restored := restore_latest(ckpt, {"critic": critic}, {"critic": critic_optimizer})):
        found, history = restored[0], restored[1]["history"]
        if is_main():
            tqdm.write(f"value pretraining: resumed from {found} at step {len(history)}")
    bar = tqdm(range(len(history), cfg.value_pretrain_steps), desc="value pretraining", dynamic_ncols=True,
               initial=len(history), total=cfg.value_pretrain_steps, disable=not is_main())
    with preemption.deferred():  # a signal ends the step, saves and stops (preemption.py)
        for step in bar:
            try:
                history.append(row := pretrain_step(cfg, step, critic, critic_optimizer, sampler, records))
            except FloatingPointError as err:  # a diverged critic: say when
                raise FloatingPointError(f"value pretraining step {step}: {err}") from None
            bar.set_postfix(loss=f"{row['value_loss']:.4f}", ev=f"{row['explained_variance']:.3f}")
            if plateaued(history, cfg.plateau_window, cfg.plateau_rel_tol, cfg.plateau_ev_tol):  # over all ranks' rows
                if is_main():
                    tqdm.write(f"value pretraining: converged at step {step} (loss and EV plateaued)")
                break
            preempted = preemption.requested()
            if preempted or (step + 1) % cfg.save_every == 0:
                save_checkpoint(ckpt, {"critic": critic}, {"critic": critic_optimizer}, {"history": history})
            if preempted:
                raise preemption.stop(f"preempted at value pretraining step {step}: saved {ckpt}")
    export_hf_checkpoint(critic, None, os.path.join(out_dir, "critic"))  # collective under torchrun
    if is_main():
        with open(os.path.join(out_dir, "curve.jsonl"), "w") as f:
            f.writelines(json.dumps(json_safe(r), allow_nan=False) + "\n" for r in history)  # NaN -> null
    remove_checkpoint(ckpt)  # the exported critic supersedes it
    return history


def check_rerun(cfg) -> None:
    """Stop a rerun without --resume or --overwrite of a run stopped in value pretraining, as
    rundir.check stops one stopped in PPO: it would pretrain again from step 0, and its saves would
    replace the checkpoint (hours of pretraining at 32B); and any run whose link to its pretrained
    critic points to none, or to one of other settings (`rundir.check_link`, as `build_shared` checks it
    later). Checked before the run directory is written, so a refused command leaves it as it was."""
    if cfg.estimator != "gae" or not cfg.value_pretrain_steps:
        return
    link = os.path.join(cfg.out_dir, cfg.run_name, "value_pretrain")
    if any_rank(os.path.lexists(link)):  # the settings read --model's and --data's files: only when linked
        check_link(link, pretrain_settings(cfg))
    if cfg.resume or cfg.overwrite:
        return
    leftovers = staging_path(os.path.join(glob.escape(cfg.out_dir), "_shared", "value_pretrain", "*"),
                             glob.escape(cfg.run_name))
    if not any_rank(bool(glob.glob(leftovers))):  # the usual case, told without reading --model and --data
        return
    shared, _ = pretrain_stage(cfg)
    found = saved_checkpoints(os.path.join(staging_path(shared, cfg.run_name), "checkpoint"))
    stopped_in = found[0] if found and not os.path.exists(shared) else ""  # a built stage's leftovers go unused
    if any_rank(bool(stopped_in)):  # every rank stops, even where another filesystem view differs
        raise ConfigError(f"{stopped_in or 'a checkpoint another rank sees'} holds this run's value pretraining: "
                          f"--resume to continue from it, --overwrite to pretrain the critic over, or another --run-name")


def prepare_value_critic(cfg, run_dir: str, init_path: str, sampler: Sampler, records: list[dict], load):
    """The critic PPO starts from, and the last row of its pretraining curve (None without
    pretraining). `init_path`: pi_SFT (a fresh head) or the ORM, shifted by --critic-init-offset before
    any pretraining; `load(path)` loads a critic onto this rank's device (sharded under torchrun:
    `train.load_critic`). Pretraining is a stage shared by
    the runs with the same `pretrain_settings` (<run_dir>/value_pretrain links to it,
    `rundir.build_shared`), resumable from its checkpoint."""
    initial = lambda: shift_values(load(init_path), cfg.critic_init_offset)  # noqa: E731
    if cfg.value_pretrain_steps == 0:
        return initial(), None
    path, critic = os.path.join(run_dir, "value_pretrain"), None

    def build(staging: str) -> None:
        nonlocal critic
        critic = initial()
        optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
        pretrain_value(cfg, critic, optimizer, sampler, records, staging)

    stage, settings = pretrain_stage(cfg)
    if not build_shared(cfg, path, settings, build, shared=stage):
        critic = load(os.path.join(path, "critic"))  # pretrained by an earlier run
    elif preemption.requested():  # a signal in the step after which it converged: the stage is complete, stop
        raise preemption.stop(f"preempted as value pretraining converged: its critic is saved in {path}")
    curve = os.path.join(path, "curve.jsonl")
    if not os.path.exists(curve):
        return critic, None
    try:
        with open(curve, "rb") as f:
            return critic, json.loads(f.read().splitlines()[-1])
    except (IndexError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{curve} is damaged ({type(err).__name__}: {str(err)[:100]}); delete "
                          f"{os.path.realpath(path)} and {path} to pretrain it again") from None
