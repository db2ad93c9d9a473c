"""VC-PPO, Algorithm 1 of Yuan et al. 2025 (arXiv 2503.01491), end to end.

    python train.py                                   # the built-in task, on a laptop CPU
    python train.py --critic-init rm --value-pretrain-steps 0 --lam-critic 0.95   # plain PPO
    torchrun --nproc_per_node 8 train.py --preset qwen2.5-32b --model PATH --data PATH
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        train.py --preset qwen2.5-32b --model PATH --data PATH

Stages, each skipped when its output exists: SFT (built-in task only) -> outcome reward model (when
the critic starts from it) -> value pretraining (§3.2) -> PPO with decoupled GAE (§3.3) -> evaluation.
One PPO step: rollout -> reward -> values and log-probs -> decoupled GAE -> PPO epochs -> metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time

from typing import Literal

import torch
import tyro
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import fsdp_utils
from critic import assert_finite, load_value_model, response_values
from data import prepare_data, sample_prompts
from evaluate import evaluate
from gae import decoupled_gae, grpo_advantages, length_adaptive_lambda
from ppo import entropy_from_logits, explained_variance, kl_penalty, masked_mean, masked_whiten
from ppo import policy_loss, response_logprobs, update_model
from reward import Grader, prepare_orm, score_rollout
from rollout import HFRollout, VLLMRollout, decode_responses
from sft import prepare_sft
from value_pretrain import critic_loss, pretrain_value

@dataclasses.dataclass
class Config:
    """VC-PPO. Every field is a command-line flag (`--lam-actor 0.99`); `--preset` picks the defaults."""

    # --- general
    preset: Literal["tiny", "qwen2.5-32b"] = "tiny"
    """defaults: `tiny` (built-in task, CPU, minutes) or `qwen2.5-32b` (the paper's settings)"""
    run_name: str | None = None
    """outputs go to <out_dir>/<run_name>/; None: <preset>__<critic_init>__seed<seed>"""
    out_dir: str = "runs"
    """root of all outputs; built-in-task SFT and reward models are cached in <out_dir>/_shared/"""
    seed: int = 0
    """seeds rollouts, prompt order and mini-batch order (a resumed run replays them exactly)"""
    resume: bool = False
    """continue from <run_dir>/checkpoint if it exists"""
    plan: bool = False
    """print the per-GPU memory plan for this config and world size, then exit"""
    threads: int = 1
    """torch CPU threads per process (tiny models run fastest on one; more contend with the grader)"""

    # --- model and data
    model: str | None = None
    """pi_SFT checkpoint (Hugging Face format); None: build one with the built-in task's SFT stage"""
    data: str | None = None
    """prompts + answers (JSONL or Parquet); None: the built-in task"""
    prompt_key: str = "prompt"
    """field holding the prompt in --data"""
    answer_key: str = "answer"
    """field holding the ground-truth answer in --data"""
    skip_bad_records: bool = False
    """skip (and count) malformed records of --data instead of stopping with an error"""
    max_prompt_tokens: int = 512
    """longer prompts are dropped (and counted)"""
    eval_fraction: float = 0.1
    """held-out share of --data (the built-in task has its own held-out set)"""
    sft_steps: int | None = None
    """built-in task: SFT steps of the cold start (None: sft.py's default)"""
    task_train_size: int = 20000
    """built-in task: number of training problems"""
    task_eval_size: int = 64
    """built-in task: number of held-out problems"""

    # --- VC-PPO switches (each one is an ablation of the paper)
    critic_init: Literal["rm", "sft"] = "sft"
    """critic initialisation: `rm` (outcome reward model, plain PPO) or `sft` (pi_SFT + fresh head)"""
    value_pretrain_steps: int = 20
    """value pretraining steps against the frozen pi_SFT (§3.2); 0 disables"""
    lam_actor: float = 0.95
    """GAE lambda for the policy's advantages (§3.3)"""
    lam_critic: float = 1.0
    """GAE lambda for the critic's targets (§3.3); 1.0 = Monte-Carlo return"""
    length_adaptive_alpha: float | None = None
    """VAPO length-adaptive GAE: lambda_actor = 1 - 1/(alpha * length) per response (e.g. 0.05)"""
    estimator: Literal["gae", "grpo"] = "gae"
    """advantage estimator: `gae` (PPO with a critic) or `grpo` (group-normalised, no critic)"""
    gamma: float = 1.0
    """discount (the paper uses 1.0)"""

    # --- PPO
    steps: int = 30
    """PPO steps"""
    prompts_per_step: int = 32
    """prompts per rollout batch"""
    samples_per_prompt: int = 2
    """responses per prompt (GRPO needs >= 2)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    num_minibatches: int = 2
    """optimizer steps per epoch"""
    micro_batch_size: int = 16
    """rows per forward/backward (gradient accumulation; does not change the result)"""
    actor_lr: float = 5e-5
    """actor learning rate (AdamW)"""
    critic_lr: float = 3e-4
    """critic learning rate (AdamW), also used for value pretraining"""
    lr_warmup_steps: int = 0
    """linear warm-up steps, then constant"""
    clip_low: float = 0.2
    """policy ratio clip below 1 (eps_low)"""
    clip_high: float = 0.2
    """policy ratio clip above 1 (eps_high; VAPO's clip-higher uses 0.28)"""
    dual_clip: float | None = None
    """dual-clip constant c > 1 for negative advantages; None disables"""
    value_clip: float | None = 0.5
    """value clip range around the old values; None disables"""
    max_grad_norm: float = 1.0
    """gradient clipping for actor and critic"""
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    """loss aggregation, normalised by the global token (or sequence) count of a mini-batch"""
    whiten_advantages: bool = True
    """normalise advantages over the batch's valid tokens"""
    kl_coef: float = 0.0
    """KL penalty to pi_SFT in the loss (VC-PPO: none)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator when kl_coef > 0"""
    entropy_coef: float = 0.0
    """entropy bonus"""
    truncation_reward: float | None = -1.0
    """reward of a response cut at max_new_tokens (terminal either way); None: graded like the others"""

    # --- rollout
    rollout: Literal["hf", "vllm"] = "hf"
    """generation backend"""
    max_new_tokens: int = 400
    """response length limit"""
    temperature: float = 1.0
    """sampling temperature (log-probs are recomputed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling"""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism (each TP group sees the same prompts)"""
    gpu_memory_utilization: float = 0.5
    """vLLM's share of GPU memory when colocated with training"""

    # --- reward model and value pretraining details
    orm_batches: int = 4
    """rollout batches of pi_SFT, graded, that the outcome reward model is trained on (critic_init = rm)"""
    orm_steps: int = 60
    """outcome reward model training steps, cycling through those batches"""
    orm_lr: float = 3e-4
    """outcome reward model learning rate"""
    plateau_window: int = 10
    """value pretraining stops early when loss and EV plateau over two such windows"""
    plateau_rel_tol: float = 0.02
    """...the mean value loss fell by less than this share"""
    plateau_ev_tol: float = 0.01
    """...and the mean explained variance rose by less than this"""
    grader_workers: int = 1
    """grader processes (each has a hard timeout)"""
    grader_timeout_s: float = 5.0
    """a response whose grading takes longer is scored -1 and counted"""

    # --- evaluation and checkpoints
    eval_samples: int = 4
    """samples per held-out prompt; reports pass@1 and pass@k for k = eval_samples"""
    save_every: int = 10
    """checkpoint every N PPO steps (and at the end)"""

    # --- scale (FSDP2)
    mixed_precision: bool = False
    """bf16 parameters, fp32 reduction (GPU)"""
    activation_checkpointing: bool = False
    """recompute activations in the backward pass"""
    cpu_offload: bool = False
    """offload sharded parameters and optimizer states to CPU"""

    def validate(self) -> None:
        """Fail at start, naming the field."""
        checks = {
            "lam_actor": 0.0 <= self.lam_actor <= 1.0,
            "lam_critic": 0.0 <= self.lam_critic <= 1.0,
            "gamma": 0.0 <= self.gamma <= 1.0,
            "length_adaptive_alpha": self.length_adaptive_alpha is None or self.length_adaptive_alpha > 0,
            "steps": self.steps >= 0,
            "value_pretrain_steps": self.value_pretrain_steps >= 0,
            "prompts_per_step": self.prompts_per_step >= 1,
            "samples_per_prompt": self.samples_per_prompt >= (2 if self.estimator == "grpo" else 1),
            "ppo_epochs": self.ppo_epochs >= 1,
            "num_minibatches": 1 <= self.num_minibatches <= self.prompts_per_step * self.samples_per_prompt,
            "micro_batch_size": self.micro_batch_size >= 1,
            "actor_lr": self.actor_lr > 0,
            "critic_lr": self.critic_lr > 0,
            "clip_low": 0.0 <= self.clip_low < 1.0,
            "clip_high": self.clip_high >= 0.0,
            "dual_clip": self.dual_clip is None or self.dual_clip > 1.0,
            "value_clip": self.value_clip is None or self.value_clip > 0,
            "max_grad_norm": self.max_grad_norm > 0,
            "kl_coef": self.kl_coef >= 0,
            "max_new_tokens": self.max_new_tokens >= 1,
            "temperature": self.temperature > 0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "eval_samples": self.eval_samples >= 1,
            "eval_fraction": 0.0 < self.eval_fraction < 1.0,
            "save_every": self.save_every >= 1,
            "threads": self.threads >= 1,
            "sft_steps": self.sft_steps is None or self.sft_steps >= 1,
            "grader_timeout_s": self.grader_timeout_s > 0,
            "run_name": self.run_name is None or (bool(self.run_name) and os.sep not in self.run_name),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            name = bad[0]
            raise ValueError(f"invalid config: --{name.replace('_', '-')} = {getattr(self, name)!r}")


PRESETS = {
    "tiny": Config(),
    "qwen2.5-32b": Config(  # PAPER.md §5 (VAPO's PPO settings; no KL, lambda_critic = 1)
        preset="qwen2.5-32b", value_pretrain_steps=100,
        lam_actor=0.99, steps=1000, prompts_per_step=8192, samples_per_prompt=1,
        num_minibatches=16, micro_batch_size=1, actor_lr=1e-6, critic_lr=2e-6,
        lr_warmup_steps=10, rollout="vllm", max_new_tokens=8192, max_prompt_tokens=1024,
        tensor_parallel_size=4, eval_samples=32, save_every=20, grader_workers=2,
        mixed_precision=True, activation_checkpointing=True,
    ),
}


def parse_config(argv: list[str]) -> Config:
    """`--preset NAME` chooses the defaults; every other flag overrides one field."""
    preset = "tiny"
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            preset = argv[i + 1]
        elif arg.startswith("--preset="):
            preset = arg.split("=", 1)[1]
    if preset not in PRESETS:
        raise SystemExit(f"error: --preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = tyro.cli(Config, default=PRESETS[preset], args=argv, description=__doc__)
    try:
        cfg.validate()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if cfg.run_name is None:
        cfg = dataclasses.replace(cfg, run_name=f"{cfg.preset}__{cfg.critic_init}__seed{cfg.seed}")
    return cfg


POSITION_BINS = 4  # advantage mean per quarter of each response, early to late (paper Fig. 2)


def policy_forward(actor, batch, temperature: float, with_entropy: bool = False):
    """log pi(y_t | s_t) for every response token (and the entropy), recomputed by the trained model."""
    T = batch.response_ids.shape[1]
    # Only the logits that predict response tokens are needed: the last T + 1 minus the final one.
    logits = actor(**batch.model_inputs(), logits_to_keep=T + 1).logits[:, :-1]
    logprobs = response_logprobs(logits, batch.response_ids, temperature) * batch.response_mask
    entropy = entropy_from_logits(logits, temperature) if with_entropy else None
    return logprobs, entropy


def actor_loss(actor, micro, rows, normalizer, cfg):
    logprobs, entropy = policy_forward(actor, micro, cfg.temperature, with_entropy=True)
    mask = micro.response_mask
    loss, metrics = policy_loss(
        logprobs, rows["old_logprobs"], rows["advantages"], mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        mode=cfg.loss_agg, normalizer=normalizer,
    )
    metrics["entropy"] = masked_mean(entropy.detach(), mask)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (entropy * mask).sum() / normalizer
    if cfg.kl_coef:  # off by default: VC-PPO removes the KL term
        kl = kl_penalty(logprobs, rows["ref_logprobs"], cfg.kl_estimator) * mask
        loss = loss + cfg.kl_coef * kl.sum() / normalizer
        metrics["kl"] = kl.sum().detach() / mask.sum().clamp(min=1)
    return loss, metrics


def advantage_by_position(advantages, mask, bins: int = POSITION_BINS) -> list[float]:
    """Mean advantage over tokens in each relative-position bin of their response (early -> late)."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    position = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    bin_of = (position * bins // lengths).clamp(max=bins - 1)
    return [masked_mean(advantages, mask * (bin_of == b)).item() for b in range(bins)]


def ppo_step(cfg, step, actor, critic, optimizers, engine, tokenizer, records, grader, ref_actor):
    timings, t0 = {}, time.perf_counter()
    prompts = sample_prompts(records, cfg, step, stream="ppo")
    batch = engine.generate(
        [r["prompt_ids"] for r in prompts], cfg.max_new_tokens, cfg.temperature, cfg.top_p,
        seed=cfg.seed * 1_000_003 + step,
    )
    engine.sleep()  # colocated vLLM frees its GPU memory for training; woken by sync_weights
    timings["rollout"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    texts = decode_responses(tokenizer, batch)
    scores, token_rewards, reward_stats = score_rollout(batch, texts, prompts, grader, cfg)
    timings["reward"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    mask = batch.response_mask
    with torch.no_grad():
        old_logprobs, _ = policy_forward(actor, batch, cfg.temperature)
        values = response_values(critic, batch)
        rows = {"old_logprobs": old_logprobs, "old_values": values}
        if cfg.kl_coef:
            rows["ref_logprobs"] = policy_forward(ref_actor, batch, cfg.temperature)[0]
    timings["forward"] = time.perf_counter() - t0

    # Decoupled GAE (§3.3): advantages with lambda_actor, critic targets with lambda_critic.
    lam_actor = cfg.lam_actor
    if cfg.length_adaptive_alpha is not None:  # VAPO: lambda = 1 - 1/(alpha * l) per response
        lam_actor = length_adaptive_lambda(batch.lengths, cfg.length_adaptive_alpha)
    advantages, returns = decoupled_gae(
        token_rewards, values, mask, cfg.gamma, lam_actor=lam_actor, lam_critic=cfg.lam_critic
    )
    if cfg.estimator == "grpo":
        advantages = grpo_advantages(scores, mask, cfg.samples_per_prompt)
    position_adv = advantage_by_position(advantages, mask)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    rows.update(advantages=advantages, returns=returns)

    t0 = time.perf_counter()
    actor_opt, critic_opt = optimizers
    metrics = update_model(cfg, actor, actor_opt, batch, rows, actor_loss, seed=step, prefix="actor")
    if cfg.estimator == "gae":
        clipped_critic_loss = functools.partial(critic_loss, clip=cfg.value_clip)
        metrics |= update_model(cfg, critic, critic_opt, batch, rows, clipped_critic_loss, seed=step,
                                prefix="critic")
    timings["update"] = time.perf_counter() - t0

    lengths = batch.lengths.float()
    metrics |= {
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/truncated_frac": sum(f == "length" for f in batch.finish_reasons) / len(batch),
        "reward/mean": scores.mean().item(),
        "reward/accuracy": (scores > 0).float().mean().item(),
        "reward/grader_timeouts": reward_stats["timeouts"],
        "reward/missing_box": reward_stats["missing_box"],
        "critic/values_mean": masked_mean(values, mask).item(),
        "critic/vf_explained_var": explained_variance(values, returns, mask).item(),
        "advantage/mean": masked_mean(advantages, mask).item(),
    }
    metrics |= {f"advantage/pos_bin{b}": v for b, v in enumerate(position_adv)}
    metrics |= {f"time/{k}": v for k, v in timings.items()}
    metrics["time/step"] = sum(timings.values())
    metrics["perf/tokens_per_s"] = mask.sum().item() / metrics["time/step"]
    for key in ("actor/pg_loss", "critic/vf_loss"):
        if key in metrics and not math.isfinite(metrics[key]):
            raise FloatingPointError(f"step {step}: {key} is {metrics[key]}")
    return metrics


def shard(cfg, model, dist_info):
    """FSDP2 under torchrun (which places each shard on this rank's device itself); one process
    keeps the model whole and only moves it to the device."""
    if dist_info.world_size == 1:
        return model.to(dist_info.device)
    return fsdp_utils.shard_model(model, cfg.mixed_precision, cfg.activation_checkpointing, cfg.cpu_offload)


def load_actor(cfg, path: str, dist_info):
    """pi_SFT as a causal LM."""
    return shard(cfg, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), dist_info)


def build_engine(cfg, actor, path: str, tokenizer):
    """The rollout backend: HF `generate` on the actor itself, or a colocated vLLM engine."""
    if cfg.rollout == "hf":
        return HFRollout(actor, tokenizer)
    return VLLMRollout(path, tokenizer, tensor_parallel_size=cfg.tensor_parallel_size,
                       max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens,
                       gpu_memory_utilization=cfg.gpu_memory_utilization, seed=cfg.seed)


class MetricsLog:
    """metrics.jsonl + TensorBoard; a resumed run first drops the rows after its checkpoint."""

    def __init__(self, run_dir: str, keep_up_to_step: int, enabled: bool):
        self.path, self.enabled = os.path.join(run_dir, "metrics.jsonl"), enabled
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        rows = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                rows = [line for line in f if json.loads(line)["step"] <= keep_up_to_step]
        with open(self.path, "w") as f:
            f.writelines(rows)
        self.tb = SummaryWriter(run_dir)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            self.tb.add_scalar(key, value, step)
        self.tb.flush()


def save(cfg, run_dir, step, actor, critic, optimizers, schedulers):
    fsdp_utils.save_checkpoint(
        os.path.join(run_dir, "checkpoint"),
        {"actor": actor, "critic": critic},
        {"actor": optimizers[0], "critic": optimizers[1]},
        {"step": step, "schedulers": [s.state_dict() for s in schedulers],
         "config": dataclasses.asdict(cfg)},
    )


def print_plan(cfg: Config) -> None:
    """--plan: per-GPU memory of this config at torchrun's world size (16 when not under torchrun)."""
    import memory_plan

    shape = memory_plan.QWEN25_32B  # --plan without --model: the paper's model
    if cfg.model is not None:
        shape = memory_plan.ModelShape.from_config(AutoConfig.from_pretrained(cfg.model))
    print(memory_plan.plan(
        shape, int(os.environ.get("WORLD_SIZE", 16)),
        tensor_parallel_size=cfg.tensor_parallel_size,
        micro_batch_tokens=cfg.micro_batch_size * (cfg.max_prompt_tokens + cfg.max_new_tokens),
        gpu_memory_utilization=cfg.gpu_memory_utilization, mixed_precision=cfg.mixed_precision,
        activation_checkpointing=cfg.activation_checkpointing, cpu_offload=cfg.cpu_offload,
    ))


def main(cfg: Config) -> dict:
    if cfg.plan:
        print_plan(cfg)
        return {}
    dist_info = fsdp_utils.init_distributed()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    os.makedirs(run_dir, exist_ok=True)
    if dist_info.is_main:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)

    # Stages before PPO: each writes a directory and is skipped when it exists.
    sft_path = prepare_sft(cfg)
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    train_records, eval_records = prepare_data(cfg, tokenizer)
    grader = Grader(num_workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s)
    actor = load_actor(cfg, sft_path, dist_info)
    engine = build_engine(cfg, actor, sft_path, tokenizer)
    summary = {"sft": evaluate(cfg, engine, tokenizer, eval_records, grader, "sft")}

    critic_init = prepare_orm(cfg, sft_path, engine, tokenizer, train_records, grader)
    vp_dir = os.path.join(run_dir, "value_pretrain")
    pretrained = cfg.value_pretrain_steps > 0 and os.path.exists(os.path.join(vp_dir, "critic"))
    critic = shard(cfg, load_value_model(os.path.join(vp_dir, "critic") if pretrained else critic_init),
                   dist_info)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
    if cfg.value_pretrain_steps > 0 and cfg.estimator == "gae":
        if not pretrained:
            history = pretrain_value(cfg, critic, critic_opt, engine, tokenizer, train_records, grader, vp_dir)
            summary["value_pretrain"] = history[-1]
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)

    actor_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.actor_lr, weight_decay=0.0)
    optimizers = (actor_opt, critic_opt)
    warmup = lambda s: min(1.0, (s + 1) / max(1, cfg.lr_warmup_steps))  # warm-up, then constant
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in optimizers]
    ref_actor = load_actor(cfg, sft_path, dist_info) if cfg.kl_coef else None

    start = 0
    ckpt = os.path.join(run_dir, "checkpoint")
    if cfg.resume and os.path.exists(ckpt):
        extra = fsdp_utils.load_checkpoint(ckpt, {"actor": actor, "critic": critic},
                                           {"actor": actor_opt, "critic": critic_opt})
        for s, state in zip(schedulers, extra["schedulers"]):
            s.load_state_dict(state)
        start = extra["step"] + 1
        engine.sync_weights(actor)
        tqdm.write(f"resumed from {ckpt} at step {start}")
    log = MetricsLog(run_dir, keep_up_to_step=start - 1, enabled=dist_info.is_main)

    bar = tqdm(range(start, cfg.steps), desc="PPO", dynamic_ncols=True, disable=not dist_info.is_main)
    for step in bar:
        try:
            metrics = ppo_step(cfg, step, actor, critic, optimizers, engine, tokenizer,
                               train_records, grader, ref_actor)
        except FloatingPointError as err:
            sys.exit(f"error: {err}; stopped. Last good checkpoint: {ckpt} (resume with --resume)")
        for s in schedulers:
            s.step()
        assert_finite(actor, "actor")
        engine.sync_weights(actor)
        log.write(step, metrics)
        bar.set_postfix(acc=f"{metrics['reward/accuracy']:.2f}",
                        len=f"{metrics['response_length/mean']:.0f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save(cfg, run_dir, step, actor, critic, optimizers, schedulers)

    summary["ppo"] = evaluate(cfg, engine, tokenizer, eval_records, grader, "ppo")
    grader.close()
    if dist_info.is_main:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print_summary(summary, run_dir)
    return summary


def print_summary(summary: dict, run_dir: str) -> None:
    k = [key for key in summary["sft"] if key.startswith("pass@") and key != "pass@1"]
    cols = ["pass@1", *k, "mean_length", "truncated"]
    print(f"\n{'stage':<16}" + "".join(f"{c:>13}" for c in cols))
    for stage in ("sft", "ppo"):
        print(f"{stage:<16}" + "".join(f"{summary[stage].get(c, float('nan')):>13.3f}" for c in cols))
    if "value_pretrain" in summary:
        vp = summary["value_pretrain"]
        print(f"value pretraining: final value loss {vp['value_loss']:.4f}, "
              f"explained variance {vp['explained_variance']:.3f} after {vp['step'] + 1} steps")
    print(f"\nwrote {run_dir}/: config.json, metrics.jsonl, TensorBoard events, checkpoint/, summary.json")


if __name__ == "__main__":
    main(parse_config(sys.argv[1:]))
