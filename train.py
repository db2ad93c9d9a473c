"""VC-PPO, Algorithm 1 of Yuan et al. 2025 (arXiv 2503.01491), end to end.

    python train.py                                   # the built-in task, on a laptop CPU
    python train.py --critic-init rm --value-pretrain-steps 0 --lam-critic 0.95   # plain PPO
    torchrun --nproc_per_node 8 train.py --preset qwen2.5-7b --model PATH --data PATH
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        train.py --preset qwen2.5-32b --model PATH --data PATH

Stages, each skipped when its output exists: SFT (built-in task only) -> outcome reward model (when
the critic starts from it) -> value pretraining (§3.2) -> PPO with decoupled GAE (§3.3) -> evaluation.
One PPO step: rollout -> reward -> values and log-probs -> decoupled GAE -> PPO epochs -> metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from support import checkpoints
import fsdp_utils
from support import memory_plan
from support import preemption
from support import rundir
from support.config import Config, ConfigError, cpu_threads, parse_config, positions_needed
from critic import check_orm, critic_loss, fresh_head_seed, load_value_model, prepare_orm, response_values
from support.data import DataError, prepare_data, sample_prompts, stream_seed
from evaluate import eval_sampler, evaluate, evaluate_once, score_columns, val_metrics
from support.fast_rollout import FastHFRollout
from gae import decoupled_gae, grpo_advantages, length_adaptive_lambda
from support.masked import check_masked_inputs, masked_mean
from support.step_metrics import rollout_metrics
from ppo import aggregate_loss, entropy_from_logits, kl_penalty, policy_loss
from ppo import response_logprobs, token_logprobs_and_entropy
from ppo_update import assert_finite, masked_whiten, micro_batched_forward, update_model
from rollout import HFRollout, RolloutBatch, stop_and_pad_ids
from sampling import Sampler
from support.sft import ModelError, check_vocabulary, prepare_sft
from support.vllm_rollout import VLLMRollout, vllm_missing
from value_pretrain import check_rerun, prepare_value_critic
from reward import Grader


def policy_forward(actor, batch, temperature: float, with_entropy: bool = False, chunk_tokens: int | None = None,
                   entropy_grad: bool = True):
    """log pi(y_t | s_t) for every response token (and the entropy), recomputed by the trained model.
    chunk_tokens: from the hidden states, that many positions at a time (ppo.token_logprobs_and_entropy).
    entropy_grad=False: the entropy is only logged, so no graph keeps its [B, T, V] softmax.
    No KV cache is built: nothing generates after this forward (and a compiled layer would
    recompile for each state of one)."""
    T = batch.response_ids.shape[1]
    # Only the outputs that predict response tokens are needed: the last T + 1 minus the final one.
    inputs = batch.model_inputs() | {"logits_to_keep": T + 1, "use_cache": False}
    if chunk_tokens is not None:
        with head_gives_token_statistics(actor, batch.response_ids, temperature, chunk_tokens, with_entropy,
                                         entropy_grad) as returned:
            statistics = actor(**inputs).logits
        # A model that reworks the head's output into its logits (Gemma 2's soft-capping, Cohere's and
        # Granite's scaling) would apply that to the log-probs, silently: only the head's own result will do.
        if statistics is not returned[-1]:
            raise ValueError(f"--logprob-chunk-tokens: {type(actor).__name__.removeprefix('FSDP')} changes its output "
                             f"head's result into its logits (a scale or soft-cap), which the log-probs computed "
                             f"in the head would go through; unset it")
        return statistics[..., 0] * batch.response_mask, statistics[..., 1] if with_entropy else None
    logits = actor(**inputs).logits[:, :-1]
    logprobs = response_logprobs(logits, batch.response_ids, temperature) * batch.response_mask
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        entropy = entropy_from_logits(logits, temperature) if with_entropy else None
    return logprobs, entropy


@contextlib.contextmanager
def head_gives_token_statistics(actor, response_ids, temperature, chunk_tokens, with_entropy, entropy_grad):
    """Inside, the actor's output head returns [B, T, 2] (each response token's log-prob, the
    entropy) from the hidden states it is given, instead of logits. It runs inside the model's
    forward, where FSDP2 has gathered the head's weight (tied to the embedding) for it. Yields the
    list of what the head returned, for the caller to check that the model's logits are that tensor."""
    head = actor.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("--logprob-chunk-tokens: the output head has a bias; only a plain projection is supported")
    returned = []

    def statistics(hidden):  # hidden [B, T + 1, d]: the positions that predict response tokens, and the last
        returned.append(token_logprobs_and_entropy(hidden[:, :-1], head.weight, response_ids, temperature,
                                                   chunk_tokens, with_entropy, entropy_grad))
        return returned[-1]

    head.forward = statistics
    try:
        yield returned
    finally:
        del head.forward


def check_logprob_chunks(actor, device) -> None:
    """--logprob-chunk-tokens with an actor it cannot serve (a biased head, logits scaled or soft-capped
    after the head) stops at start in one line, not at PPO's first step after hours of value
    pretraining: one forward of one token, by every rank (a collective under FSDP)."""
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            policy_forward(actor, RolloutBatch(one, one, one, one.float(), one.float(), ["length"]), 1.0,
                           chunk_tokens=1)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def actor_loss(actor, micro, per_token, normalizer, cfg):
    """Clipped surrogate (Eq. 1) of one micro-batch, plus the optional entropy bonus and KL term."""
    logprobs, entropy = policy_forward(actor, micro, cfg.temperature, with_entropy=True,
                                       chunk_tokens=cfg.logprob_chunk_tokens, entropy_grad=bool(cfg.entropy_coef))
    mask = micro.response_mask
    loss, metrics = policy_loss(
        logprobs, per_token["old_logprobs"], per_token["advantages"], mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        mode=cfg.loss_agg, normalizer=normalizer,
    )
    metrics["entropy"] = masked_mean(entropy.detach(), mask)
    if cfg.entropy_coef:  # aggregated like the policy loss (token- or sequence-mean)
        loss = loss - cfg.entropy_coef * aggregate_loss(entropy, mask, cfg.loss_agg, normalizer)
    if cfg.kl_coef:  # off by default: VC-PPO removes the KL term
        kl = kl_penalty(logprobs, per_token["ref_logprobs"], cfg.kl_estimator)
        loss = loss + cfg.kl_coef * aggregate_loss(kl, mask, cfg.loss_agg, normalizer)
        metrics["kl"] = masked_mean(kl.detach(), mask)
    return loss, metrics


def ppo_step(cfg, step: int, sampler: Sampler, records: list[dict], models: dict, optimizers: dict,
             reference=None) -> dict:
    """One iteration of Algorithm 1. models: "actor" and, unless GRPO, "critic"; optimizers alike;
    `reference`: pi_SFT, only with a KL term. Returns the step's metrics (over all ranks)."""
    actor, critic, timings = models["actor"], models.get("critic"), {}

    # Collect trajectories and compute rewards: +-1 on each response's last token.
    scored = sampler.sample_and_score(sample_prompts(records, cfg, step, stream="ppo"),
                                      seed=stream_seed(cfg.seed, "ppo/sampling", step))
    sampler.engine.sleep()  # colocated vLLM frees its GPU memory for training; woken by sync_weights
    batch, mask = scored.batch, scored.batch.response_mask

    # log pi_old(y_t | s_t), log pi_ref, V(s_t): recomputed by the models being trained.
    with timed(timings, "forward"):
        per_token = old_outputs(cfg, batch, actor, critic, reference)
    assert_finite(per_token.items(), "forward before the update")

    # Advantages: decoupled GAE (§3.3), or GRPO's group-normalised outcome without a critic.
    if critic is None:
        advantages = grpo_advantages(scored.outcomes, mask, cfg.samples_per_prompt)
    else:
        lam_actor = cfg.lam_actor
        if cfg.length_adaptive_alpha is not None:  # VAPO: lambda = 1 - 1/(alpha * l) per response
            lam_actor = length_adaptive_lambda(batch.lengths, cfg.length_adaptive_alpha)
        advantages, per_token["returns"] = decoupled_gae(
            scored.token_rewards, per_token["old_values"], mask, cfg.gamma, lam_actor=lam_actor,
            lam_critic=cfg.lam_critic,
        )
    per_token["advantages"] = masked_whiten(advantages, mask) if cfg.whiten_advantages else advantages
    check_masked_inputs(mask, right_padded=True, **per_token)  # once here, not in every micro-batch's loss

    # PPO epochs: the actor on the clipped surrogate, the critic on the clipped value loss.
    with timed(timings, "update"):
        shuffle = stream_seed(cfg.seed, "ppo/shuffle", step)
        metrics = update_model(cfg, actor, optimizers["actor"], batch, per_token, actor_loss, seed=shuffle,
                               prefix="actor")
        if critic is not None:
            clipped_critic_loss = functools.partial(critic_loss, clip=cfg.value_clip)
            metrics |= update_model(cfg, critic, optimizers["critic"], batch, per_token, clipped_critic_loss,
                                    seed=shuffle, prefix="critic")
    return metrics | rollout_metrics(scored, per_token, advantages, scored.seconds | timings, cfg.gamma,
                                     cfg.max_new_tokens)


def old_outputs(cfg, batch, actor, critic, reference) -> dict:
    """The per-token tensors of the models before the update, without gradients: old_logprobs,
    ref_logprobs (with a KL term), old_values (with a critic); [B, T], 0 on padding."""
    forward = functools.partial(micro_batched_forward, batch=batch, micro_batch_size=cfg.micro_batch_size,
                                micro_batch_tokens=cfg.micro_batch_tokens)
    logprobs = lambda model, micro: policy_forward(model, micro, cfg.temperature,  # noqa: E731
                                                   chunk_tokens=cfg.logprob_chunk_tokens)[0]
    per_token = {"old_logprobs": forward(functools.partial(logprobs, actor))}
    if cfg.kl_coef:
        per_token["ref_logprobs"] = forward(functools.partial(logprobs, reference))
    if critic is not None:
        per_token["old_values"] = forward(functools.partial(response_values, critic))
    return per_token


@contextlib.contextmanager
def timed(timings: dict, name: str):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


def check_diverged(metrics: dict, models: dict) -> None:
    """FloatingPointError when a loss or a parameter is no longer finite."""
    for key in ("actor/pg_loss", "critic/vf_loss"):
        if key in metrics and not math.isfinite(metrics[key]):
            raise FloatingPointError(f"{key} is {metrics[key]}")
    for name, model in models.items():
        assert_finite(model.named_parameters(), f"{name} after the update")


def load_actor(cfg, path: str, dist_info):
    """pi_SFT as a causal LM (the actor, and the frozen reference policy of --kl-coef): sharded
    under torchrun without a whole model on any rank; one process keeps it whole on its device."""
    return checkpoints.load_pretrained(AutoModelForCausalLM, path, device=dist_info.device,
                                      **fsdp_utils.shard_options(cfg))


def load_critic(cfg, path: str, dist_info):
    """The critic from pi_SFT (with a fresh head), the outcome reward model or a value-pretrained
    critic, loaded as the actor is; a fresh head is drawn from the run's seed."""
    return load_value_model(path, seed=fresh_head_seed(cfg.seed), device=dist_info.device,
                            **fsdp_utils.shard_options(cfg))


def refusal(cfg, path: str, err: ValueError) -> ConfigError:
    """A model or tokenizer the run cannot use, said at start in one line that names --model when given."""
    return ConfigError(f"--model {path}: {err}" if cfg.model else str(err))


def build_engine(cfg, actor, path: str, tokenizer):
    """The rollout backend: HF `generate` or the fast decode loop on the actor itself, or a colocated vLLM engine."""
    try:  # a model or tokenizer it cannot sample with: said at start, in one line
        if cfg.rollout == "hf":
            return HFRollout(actor, tokenizer)
        if cfg.rollout == "hf-fast":
            return FastHFRollout(actor, tokenizer)
        return VLLMRollout(path, tokenizer, tensor_parallel_size=cfg.tensor_parallel_size,
                           max_model_len=positions_needed(cfg), gpu_memory_utilization=cfg.gpu_memory_utilization,
                           seed=cfg.seed)
    except ValueError as err:
        raise refusal(cfg, path, err) from None


def main(cfg: Config) -> dict:
    if cfg.plan:
        memory_plan.print_plan(cfg)
        return {}
    dist_info = start(cfg)
    with rundir.locked(cfg) as run_dir, preemption.handled(lambda: left_behind(run_dir)):
        try:
            return run(cfg, dist_info)
        except OSError as err:  # a full disk or a lost mount under rank 0's logs, summary or stage files
            if isinstance(err, FileNotFoundError):  # a missing input: its own message says which
                raise
            raise OSError(f"{err}. {left_behind(run_dir)}") from None


def start(cfg: Config):
    """The process group (one process: none) and torch's threads and seed; a GPU-only flag on a CPU
    machine, or vLLM where it is missing, stops here, before any stage runs."""
    try:
        fsdp_utils.check_gpu_options(cfg.mixed_precision, cfg.cpu_offload)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.rollout == "vllm" and (missing := vllm_missing()):
        raise ConfigError(missing)
    dist_info = fsdp_utils.init_distributed(cpu_collectives=cfg.cpu_offload)
    torch.set_num_threads(cpu_threads(cfg))
    torch.manual_seed(cfg.seed)
    return dist_info


def finish(engine) -> None:
    """`start` undone, with the rollout engine: once every rank is done generating, the engine goes,
    then the process group."""
    fsdp_utils.barrier()
    engine.close()
    fsdp_utils.close_distributed()


def left_behind(run_dir: str) -> str:
    """What a signal outside the training loops leaves (preemption.handled), in a sentence."""
    return f"{rundir.last_checkpoint(run_dir)} Finished stages are kept; resume with the same command and --resume"


def policy_and_data(cfg: Config, dist_info, critic: bool = True) -> tuple:
    """(pi_SFT's path, its tokenizer, the (train, held-out) records, the actor loaded from it): pi_SFT
    is --model (checked, as a critic's backbone too unless `critic` is False) or the built-in task's,
    trained once. What PPO and evaluate.py start from."""
    sft_path = prepare_sft(cfg, critic)
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    try:  # no EOS or pad token: said before the data is read and the actor loaded (minutes at 32B)
        stop_and_pad_ids(tokenizer, None)
    except ValueError as err:
        raise refusal(cfg, sft_path, err) from None
    if cfg.model:
        check_vocabulary(cfg.model, tokenizer)
    records = prepare_data(cfg, tokenizer)
    return sft_path, tokenizer, records, load_actor(cfg, sft_path, dist_info)


def run(cfg: Config, dist_info) -> dict:
    """`main` once it holds the run directory: every stage, then PPO."""
    # Every input is checked (run directory, caches, model, data) before the run directory is
    # written: a refused command leaves it as it was, and its corrected rerun is not blocked.
    rundir.check(cfg)
    check_rerun(cfg)  # value pretraining's checkpoint, as rundir.check does PPO's
    for note in cfg.unused_flags() if fsdp_utils.is_main() else ():
        print(f"note: {note}")
    if cfg.estimator == "gae" and cfg.critic_init == "rm":
        check_orm(cfg)
    # The stages before PPO, each cached (rundir.build_once): pi_SFT, the ORM, value pretraining.
    sft_path, tokenizer, (train_records, eval_records), actor = policy_and_data(cfg, dist_info)
    grader = Grader(num_workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s)
    models = {"actor": actor}
    if cfg.logprob_chunk_tokens is not None:
        check_logprob_chunks(models["actor"], dist_info.device)
    sampler = Sampler(cfg, build_engine(cfg, models["actor"], sft_path, tokenizer), tokenizer, grader)
    run_dir = rundir.prepare(cfg)
    evaluator = eval_sampler(sampler)
    summary = {"sft": evaluate_once(evaluator, eval_records, "sft", os.path.join(run_dir, "eval_sft.json"))}
    if cfg.estimator == "gae":  # GRPO has no critic
        critic_init = sft_path if cfg.critic_init == "sft" else prepare_orm(cfg, sft_path, sampler, train_records)
        models["critic"], pretrained = prepare_value_critic(cfg, run_dir, critic_init, sampler, train_records,
                                                            load=functools.partial(load_critic, cfg, dist_info=dist_info))
        if pretrained is not None:
            summary["value_pretrain"] = pretrained

    lr = {"actor": cfg.actor_lr, "critic": cfg.critic_lr}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=lr[name], weight_decay=0.0) for name, m in models.items()}
    warmup = lambda s: min(1.0, (s + 1) / max(1, cfg.lr_warmup_steps))  # warm-up, then constant
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in optimizers.values()]
    reference = load_actor(cfg, sft_path, dist_info) if cfg.kl_coef else None
    start = rundir.resume(cfg, run_dir, models, optimizers, schedulers)
    if start:
        sampler.engine.sync_weights(models["actor"])  # the rollout engine samples from the restored actor
        # The snapshot of the step resumed from, if its export failed after the checkpoint was saved,
        # or if that step was then the run's last (exported only as actor_hf, which this run replaces).
        snapshot = rundir.snapshot_path(run_dir, start)
        if rundir.snapshot_due(cfg, start) and fsdp_utils.any_rank(not os.path.isdir(snapshot)):
            rundir.export_into_run(cfg, models["actor"], tokenizer, run_dir, snapshot)
    log = rundir.MetricsLog(run_dir, keep_up_to_step=start - 1, wandb_project=cfg.wandb_project,
                            config=dataclasses.asdict(cfg))

    bar = tqdm(range(start, cfg.steps), desc="PPO", dynamic_ncols=True, disable=not fsdp_utils.is_main())
    final = None  # the held-out scores after the last step
    with preemption.deferred():  # a signal ends the step, saves and stops (preemption.py)
        for step in bar:
            try:
                metrics = ppo_step(cfg, step, sampler, train_records, models, optimizers, reference)
                check_diverged(metrics, models)
            except FloatingPointError as err:  # a diverged model: say so, and what is left to resume from
                raise FloatingPointError(f"PPO step {step}: {err}; stopped: the model diverged. "
                                         f"{rundir.last_checkpoint(run_dir)}") from None
            metrics["actor/lr"] = schedulers[0].get_last_lr()[0]  # the rate this step's updates used
            for scheduler in schedulers:
                scheduler.step()
            sampler.engine.sync_weights(models["actor"])
            last = step + 1 == cfg.steps
            if last or cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                result = evaluate(evaluator, eval_records, f"step {step}")
                metrics |= val_metrics(result)
                final = result if last else None
            log.write(step, metrics)
            bar.set_postfix(acc=f"{metrics['reward/accuracy']:.2f}", len=f"{metrics['response_length/mean']:.0f}")
            preempted = preemption.requested()
            saved = preempted or (step + 1) % cfg.save_every == 0 or last
            if saved:
                rundir.save(cfg, run_dir, step, models, optimizers, schedulers)
            if rundir.snapshot_due(cfg, step + 1):
                snapshot = rundir.snapshot_path(run_dir, step + 1)
                rundir.export_into_run(cfg, models["actor"], tokenizer, run_dir, snapshot)
            if not preempted and preemption.requested():  # signalled during the save or the export:
                if not saved:  # stop now, not after one more step
                    rundir.save(cfg, run_dir, step, models, optimizers, schedulers)
                preempted = True
            if preempted:
                raise preemption.stop(f"preempted at step {step}: saved {run_dir}/checkpoint")

    summary["ppo"] = final or evaluate(evaluator, eval_records, "ppo")
    log.close()
    rundir.export_into_run(cfg, models["actor"], tokenizer, run_dir, os.path.join(run_dir, "actor_hf"))
    grader.close()
    if fsdp_utils.is_main():
        rundir.write_json(os.path.join(run_dir, "summary.json"), summary)
        print_summary(summary, run_dir)
    finish(sampler.engine)
    return summary


def print_summary(summary: dict, run_dir: str) -> None:
    cols = score_columns(summary["sft"])
    print(f"\n{'stage':<16}" + "".join(f"{c:>13}" for c in cols))
    for stage in ("sft", "ppo"):
        print(f"{stage:<16}" + "".join(f"{summary[stage].get(c, float('nan')):>13.3f}" for c in cols))
    if "value_pretrain" in summary:
        vp = summary["value_pretrain"]
        ev = vp["explained_variance"]  # None (read back) or NaN when every return was equal
        ev = "undefined (all returns equal)" if ev is None or math.isnan(ev) else f"{ev:.3f}"
        print(f"value pretraining: {vp['step'] + 1} steps; at the last, value loss {vp['value_loss']:.4f} "
              f"(its update's) and explained variance {ev} (before it, on its fresh batch)")
    saved = [name for name in ("checkpoint/", "actor_hf_steps/") if os.path.isdir(os.path.join(run_dir, name))]
    print(f"\nwrote {run_dir}/: config.json, metrics.jsonl, TensorBoard events, {''.join(n + ', ' for n in saved)}"
          f"actor_hf/ (the final policy in Hugging Face format), eval_sft.json, summary.json")


# Bad settings or input, a diverged model, an unreadable checkpoint, a file that cannot be written:
# said in one line, whose message says which and where (here and in evaluate.py).
USER_ERRORS = (ConfigError, DataError, ModelError, OSError, FloatingPointError, checkpoints.CheckpointError)

if __name__ == "__main__":
    try:
        main(parse_config(sys.argv[1:], description=__doc__))
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")
    except preemption.Preempted as stopped:  # its line is printed: exit as a signal would end it
        fsdp_utils.exit_now_if_gloo(stopped.exit_code)
        sys.exit(stopped.exit_code)
    fsdp_utils.exit_now_if_gloo()  # torchrun on CPU: see there why
