"""Value pretraining (paper §3.2, Algorithm 1 lines 1-4).

Freeze the policy at pi_SFT, sample responses from it, compute critic targets with GAE at
lambda = 1.0 (the Monte-Carlo return: with one terminal reward every token's target is the final
+-1), and regress the critic on them. The paper reports a fast "range alignment" phase, then a slower
"knowledge injection" phase, and finds ~100 steps best (overfitting beyond ~150).

Convergence (documented criterion): every step logs value loss and explained variance; pretraining
stops at `value_pretrain_steps`, or earlier once both plateau: over two consecutive windows of
`plateau_window` steps, the mean value loss falls by less than `plateau_rel_tol` (relative) and the
mean explained variance rises by less than `plateau_ev_tol` (absolute).
"""

from __future__ import annotations

import functools
import json
import os

from tqdm import tqdm

from critic import assert_finite, response_values
from data import sample_prompts, stream_seed
from fsdp_utils import (export_hf_checkpoint, latest_checkpoint, load_checkpoint, rank, reduce_metrics,
                        remove_checkpoint, save_checkpoint)
from gae import compute_gae
from ppo import explained_variance, micro_batched_forward, update_model, value_loss
from reward import score_rollout
from rollout import decode_responses


def plateaued(history: list[dict], window: int, rel_tol: float, ev_tol: float) -> bool:
    """True when value loss and explained variance stopped improving (module docstring)."""
    if len(history) < 2 * window:
        return False
    prev, last = history[-2 * window : -window], history[-window:]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    loss_prev, loss_last = mean(prev, "value_loss"), mean(last, "value_loss")
    ev_prev, ev_last = mean(prev, "explained_variance"), mean(last, "explained_variance")
    return loss_prev - loss_last < rel_tol * loss_prev and ev_last - ev_prev < ev_tol


def pretrain_value(cfg, critic, critic_optimizer, engine, tokenizer, records, grader, out_dir: str):
    """Train `critic` against the frozen policy behind `engine`; save it and its curve to `out_dir`.

    Returns the per-step history (value_loss, explained_variance, reward_mean, ...).
    """
    os.makedirs(out_dir, exist_ok=True)
    # Checkpointed every `save_every` steps like PPO (100 steps at 32B take hours); a resumed run
    # replays the same draws (data.stream_seed), so it ends as if never stopped.
    ckpt, history = os.path.join(out_dir, "checkpoint"), []
    if cfg.resume and (found := latest_checkpoint(ckpt)):
        history = load_checkpoint(found, {"critic": critic}, {"critic": critic_optimizer})["history"]
        tqdm.write(f"value pretraining: resumed from {found} at step {len(history)}")
    bar = tqdm(range(len(history), cfg.value_pretrain_steps), desc="value pretraining", dynamic_ncols=True,
               initial=len(history), total=cfg.value_pretrain_steps)
    for step in bar:
        prompts = sample_prompts(records, cfg, step, stream="value_pretrain")
        batch = engine.generate(
            [r["prompt_ids"] for r in prompts],
            cfg.max_new_tokens,
            cfg.temperature,
            cfg.top_p,
            seed=stream_seed(cfg.seed, "value_pretrain/sampling", step),
        )
        texts = decode_responses(tokenizer, batch)
        scores, token_rewards, _ = score_rollout(batch, texts, prompts, grader, cfg)
        values = micro_batched_forward(functools.partial(response_values, critic), batch, cfg.micro_batch_size,
                                       cfg.micro_batch_tokens)
        assert_finite([("values", values)], f"value pretraining step {step}")
        # Critic targets with lambda = 1: the Monte-Carlo return, no lambda^(T-t) decay (§3.3).
        _, returns = compute_gae(token_rewards, values, batch.response_mask, cfg.gamma, lam=1.0)
        rows = {"returns": returns, "old_values": values}
        metrics = update_model(cfg, critic, critic_optimizer, batch, rows, critic_loss,
                               seed=stream_seed(cfg.seed, "value_pretrain/shuffle", step), prefix="critic")
        assert_finite(critic.named_parameters(), f"value pretraining step {step}, critic after the update")
        # Over all ranks (vf_loss already is), so that every rank takes the same stopping decision.
        row = {"step": step, "value_loss": metrics["critic/vf_loss"]} | reduce_metrics({
            "explained_variance": explained_variance(values, returns, batch.response_mask).item(),
            "reward_mean": scores.mean().item(),
            "response_length": batch.lengths.float().mean().item(),
        })
        history.append(row)
        bar.set_postfix(loss=f"{row['value_loss']:.4f}", ev=f"{row['explained_variance']:.3f}")
        if plateaued(history, cfg.plateau_window, cfg.plateau_rel_tol, cfg.plateau_ev_tol):
            tqdm.write(f"value pretraining: converged at step {step} (loss and EV plateaued)")
            break
        if (step + 1) % cfg.save_every == 0:
            save_checkpoint(ckpt, {"critic": critic}, {"critic": critic_optimizer}, {"history": history})
    export_hf_checkpoint(critic, None, os.path.join(out_dir, "critic"))  # collective under torchrun
    if rank() == 0:
        with open(os.path.join(out_dir, "curve.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
    remove_checkpoint(ckpt)  # the exported critic supersedes it
    return history


def critic_loss(critic, micro, rows, normalizer, cfg, clip=None):
    """Value loss (Eq. 2) of one micro-batch, for `ppo.update_model`. PPO clips around the old
    values (`cfg.value_clip`); pretraining does not, so the critic moves freely to the MC return."""
    values = response_values(critic, micro)
    return value_loss(
        values, rows["old_values"], rows["returns"], micro.response_mask,
        clip=clip, mode=cfg.loss_agg, normalizer=normalizer,
    )
