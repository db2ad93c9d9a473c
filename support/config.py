"""The configuration of a VC-PPO run: one dataclass whose fields are `train.py`'s flags, its
presets (`tiny`: the built-in task on a CPU; `tiny-long`: its long version; `qwen2.5-1.5b` and
`qwen2.5-7b`: the paper's method on one GPU and on one node; `qwen2.5-32b`: the settings reported
for the paper) and the parser that checks every value at start. The ablation switches of the
paper are grouped under "VC-PPO switches"."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Literal

import tyro


class ConfigError(ValueError):
    """Settings that cannot run: a bad flag value, or settings that differ from what is on disk."""


@dataclasses.dataclass
class Config:
    """VC-PPO. Every field is a command-line flag (`--lam-actor 0.99`); `--preset` picks the defaults."""

    # --- general
    preset: Literal["tiny", "tiny-long", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b"] = "tiny"
    """defaults: `tiny` (built-in task, CPU, minutes), `tiny-long` (its long version, the paper's
    regime: responses of hundreds of tokens), `qwen2.5-1.5b` (one 80 GB GPU), `qwen2.5-7b` (one
    node of 8 x 80 GB GPUs) or `qwen2.5-32b` (the paper's settings, 2 x 8 H200)"""
    run_name: str | None = None
    """outputs go to <out_dir>/<run_name>/; None: <preset>__<critic_init>__seed<seed>"""
    out_dir: str = "runs"
    """root of all outputs; built-in-task SFT and reward models are cached in <out_dir>/_shared/"""
    seed: int = 0
    """seeds rollouts, prompt order and mini-batch order (a resumed run replays them exactly)"""
    resume: bool = False
    """continue from <run_dir>/checkpoint if it exists"""
    overwrite: bool = False
    """start PPO over in a run directory that holds checkpoints, replacing them and its metrics (without
    --resume or this, such a rerun stops: a resubmitted job must not lose its progress)"""
    plan: bool = False
    """print the per-GPU memory plan for this config and world size, then exit"""
    threads: int | None = None
    """torch CPU threads per process; None: the cores this process may run on, shared among the
    processes torchrun starts on this machine (analysis grids that run --jobs at once give each its share)"""

    # --- model and data
    model: str | None = None
    """pi_SFT checkpoint (Hugging Face format); None: build one with the built-in task's SFT stage"""
    data: str | None = None
    """prompts + answers: a .jsonl, .json or .parquet file, a folder of them, or a glob (quote it:
    'data/train-*.parquet'); None: the built-in task. Other layouts name their fields with --prompt-key
    and --answer-key (the README's table): verl's needs --answer-key reward_model.ground_truth, and
    TRL's --answer-key solution (or completion, where that is text)"""
    val_data: tuple[str, ...] | None = None
    """held-out sets of their own (files, folders or globs, as --data; e.g. MATH-500 and AIME), reported
    per data source; then --data is not split. None: --eval-fraction of --data is held out"""
    prompt_key: str = "prompt"
    """field holding the prompt (text, or a list of chat messages); a dotted key reads a nested field"""
    answer_key: str = "answer"
    """field holding the ground-truth answer, e.g. `reward_model.ground_truth` for verl's files"""
    val_prompt_key: tuple[str, ...] | None = None
    """--prompt-key of --val-data, when its layout differs: one for every set, or one per --val-data
    value in order (GSM8K's `question` and MATH-500's `problem`); None: --prompt-key"""
    val_answer_key: tuple[str, ...] | None = None
    """--answer-key of --val-data: one for every set, or one per --val-data value; None: --answer-key"""
    answer_format: Literal["gsm8k", "math"] | None = None
    """gold answers of --data: `gsm8k` (the number after '####'), `math` (as written: its last \\boxed{}
    if any); None: `gsm8k` for answers whose last line starts with '####' and that hold no \\boxed{}, else
    `math` (--val-data's are always detected, so MATH-500 can sit beside GSM8K training). Responses are graded
    by their last \\boxed{}"""
    prompt_template: str | None = None
    """rewrites each --data / --val-data prompt (the last user turn of a message list): '{prompt}' stands for
    it, e.g. '{prompt} Please reason step by step, and put your final answer within \\boxed{}.'"""
    prompt_format: Literal["chat", "raw"] | None = None
    """how a text prompt becomes tokens: chat, one user turn through the tokenizer's chat template; raw,
    the text as it is (with the tokenizer's own BOS, if any): a base model prompted in a format of the
    run's own (--prompt-template), as R1-Zero and DAPO train; None: chat where the tokenizer has a template"""
    skip_bad_records: bool = False
    """skip (and count) malformed records of --data instead of stopping with an error"""
    max_prompt_tokens: int = 512
    """longer prompts are dropped (and counted)"""
    eval_fraction: float = 0.1
    """held-out share of --data (the built-in task has its own held-out set)"""
    sft_steps: int | None = None
    """built-in task: SFT steps of the cold start (None: sft.py's default)"""
    task_length: Literal["short", "long"] = "short"
    """built-in task: `short` (4-digit numbers, ~135-token responses) or `long` (10 digits, 40 to 52
    doublings: ~520-token responses, the paper's regime; task.SHAPES)"""
    task_difficulty: tuple[int, int] | None = None
    """built-in task: the range of k (doublings) of its RL and held-out problems, e.g. `46 52` for
    longer chains than the long task's; None: the task length's (task.SHAPES). pi_SFT is trained on
    the task length's own range, so runs that differ only here share it"""
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
    critic_init_offset: float = 0.0
    """an experiment knob, not a setting of the method: added to the critic's value head bias when it
    is initialised (from pi_SFT or the ORM), before value pretraining, so that every V(s_t) starts
    off by this much. Sets the critic's initial error by hand (analysis/collapse.py, paper §3.1)"""

    # --- PPO
    steps: int = 30
    """PPO steps"""
    prompts_per_step: int = 32
    """prompts per rollout batch, drawn with replacement from the training prompts, seeded by the step,
    not in shuffled epochs as verl and TRL go: a step may repeat a prompt, and a run need not see every one"""
    samples_per_prompt: int = 2
    """responses per prompt (GRPO needs >= 2)"""
    ppo_epochs: int = 1
    """passes over each rollout batch (value pretraining's critic updates make as many)"""
    num_minibatches: int = 2
    """optimizer steps per epoch (in value pretraining too)"""
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
    """normalise advantages over the batch's valid tokens; GRPO's too, after its group normalisation,
    which re-centres them over tokens (a long response weighs more), where DeepSeekMath's GRPO stops
    at the group's: `--no-whiten-advantages` gives theirs"""
    kl_coef: float = 0.0
    """KL penalty to pi_SFT in the loss (VC-PPO: none)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator when kl_coef > 0: k3 (its gradient is that of KL(pi_SFT || pi), as in GRPO) or
    k2 (that of KL(pi || pi_SFT)); k1 is refused, its gradient being 0 in expectation"""
    entropy_coef: float = 0.0
    """entropy bonus"""
    truncation_reward: float | None = -1.0
    """reward of a response cut at max_new_tokens (terminal either way); None: graded like the others"""

    # --- rollout
    rollout: Literal["hf", "hf-fast", "vllm"] = "hf-fast"
    """generation backend: hf-fast, the model itself through fast_rollout.py's decode loop (~2x
    `generate` on a CPU, slower on a GPU); hf, HF `generate` (what the runs of RESULTS.md used, and
    faster on a GPU); vllm, vLLM (the GPU presets)"""
    max_new_tokens: int = 400
    """response length limit (the built-in model's prompt and response fit in its 1,024 positions)"""
    temperature: float = 1.0
    """sampling temperature (log-probs are recomputed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling of the rollouts; below 1 the samples come from the nucleus while PPO's ratio is
    taken on the whole distribution's log-probs, as in verl: slightly off-policy"""
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
    orm_loss: Literal["mse", "bradley-terry"] = "mse"
    """how the outcome reward model is trained: `mse` regresses its last-token score on the +-1
    outcome; `bradley-terry` ranks a right response above a wrong one to the same prompt
    (-log sigmoid(r_w - r_l)), as RLHF reward models are, leaving its offset and scale free"""
    plateau_window: int = 10
    """value pretraining stops early when loss and EV plateau over two such windows, beyond the
    steps' own noise (value_pretrain.plateaued; 1 step shows no noise, and never stops early)"""
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
    eval_every: int | None = None
    """evaluate the held-out set every N PPO steps into metrics.jsonl and TensorBoard (val/<data source>/...);
    None: before PPO (eval_sft.json) and at the end only"""
    eval_temperature: float | None = None
    """sampling temperature of held-out evaluation; None: --temperature"""
    eval_max_new_tokens: int | None = None
    """response length limit of held-out evaluation; None: --max-new-tokens"""
    save_every: int = 10
    """checkpoint every N PPO steps (and at the end)"""
    save_hf_every: int | None = None
    """also export the actor in Hugging Face format every N PPO steps, to <run>/actor_hf_steps/step_<N>/;
    the final actor always goes to <run>/actor_hf/"""

    # --- tracking (metrics.jsonl and TensorBoard always)
    wandb_project: str | None = None
    """also log metrics to Weights & Biases, in this project, as run --run-name (optional: `pip install
    wandb`; WANDB_MODE=offline logs without a network, for `wandb sync` later)"""

    # --- scale (FSDP2)
    mixed_precision: bool = False
    """bf16 parameters, fp32 reduction (GPU)"""
    activation_checkpointing: bool = False
    """recompute activations in the backward pass"""
    cpu_offload: bool = False
    """offload sharded parameters and optimizer states to CPU"""
    checkpoint_fraction: float = 1.0
    """with --activation-checkpointing: share of the decoder layers (spread evenly) whose
    activations are recomputed; the others keep theirs (less recompute, more memory)"""

    # --- throughput levers (off by default: the defaults compute exactly as without them)
    micro_batch_tokens: int | None = None
    """fill each micro-batch with length-sorted rows up to this many padded tokens (rows x
    (longest prompt + longest response)) instead of --micro-batch-size rows; None: rows"""
    logprob_chunk_tokens: int | None = None
    """compute the actor's log-probs and entropy from its final hidden states, this many tokens at
    a time (recomputed in the backward pass), never holding the float32 [tokens, vocab] logits"""
    compile_layers: bool = False
    """torch.compile each decoder layer of actor and critic (meant for GPUs; a CPU needs a C++ compiler)"""

    def unused_flags(self) -> list[str]:
        """Notes on flags set to other values than the preset's that another flag makes meaningless
        (GRPO's missing critic, --data's missing built-in task, ...): said at start, not refused,
        since analysis grids pass one set of flags to every arm and the tests one set to every run."""
        preset = PRESETS[self.preset]
        flag = lambda f: f"--{f.replace('_', '-')} {getattr(self, f)}"  # noqa: E731
        set_here = lambda fields: [flag(f) for f in fields if getattr(self, f) != getattr(preset, f)]  # noqa: E731
        groups = [
            (self.estimator == "grpo", "--estimator grpo trains no critic", set_here(CRITIC_FLAGS)),
            (self.data is not None, "--data replaces the built-in task",
             set_here(("task_length", "task_train_size", "task_eval_size"))),
            (self.data is None, "without --data the run trains on the built-in task",
             set_here(("prompt_key", "answer_key", "answer_format", "prompt_format", "skip_bad_records",
                       "eval_fraction"))),
            (self.model is not None, "--model is pi_SFT", set_here(("sft_steps",))),
            (self.estimator == "gae" and self.length_adaptive_alpha is not None,
             "--length-adaptive-alpha sets lambda_actor per response", set_here(("lam_actor",))),
            (self.rollout != "vllm", f"--rollout {self.rollout} runs no vLLM",
             set_here(("tensor_parallel_size", "gpu_memory_utilization"))),
            (self.estimator == "gae" and self.critic_init != "rm", "without --critic-init rm no reward model is trained",
             set_here(("orm_batches", "orm_steps", "orm_lr", "orm_loss"))),
            (self.estimator == "gae" and self.value_pretrain_steps == 0, "--value-pretrain-steps 0 pretrains nothing",
             set_here(("plateau_window", "plateau_rel_tol", "plateau_ev_tol"))),
            (not self.kl_coef, "without --kl-coef there is no KL term", set_here(("kl_estimator",))),
            (not self.activation_checkpointing, "without --activation-checkpointing nothing is recomputed",
             set_here(("checkpoint_fraction",))),
            (self.micro_batch_tokens is not None, "--micro-batch-tokens sizes the micro-batches",
             set_here(("micro_batch_size",))),
            (self.data is not None and self.val_data is not None, "--val-data is the held-out set",
             set_here(("eval_fraction",))),
        ]
        return [f"{why}: {', '.join(flags)} change{'s' if len(flags) == 1 else ''} nothing"
                for applies, why, flags in groups if applies and flags]

    def _per_val_set(self, field: str) -> tuple[bool, str]:
        """(valid, what valid is) for --val-prompt-key / --val-answer-key: unset without --val-data,
        else one key for every set or one per --val-data value."""
        keys = getattr(self, field)
        if keys is None:
            return True, ""
        sets = len(self.val_data or ())
        return (bool(sets) and len(keys) in (1, sets),
                f"one key, or one per --val-data value ({sets})" if sets else "unset without --val-data")

    def val_keys(self, i: int) -> tuple[str, str]:
        """(prompt key, answer key) of the i-th --val-data value."""
        pick = lambda keys, default: default if keys is None else keys[i if len(keys) > 1 else 0]  # noqa: E731
        return pick(self.val_prompt_key, self.prompt_key), pick(self.val_answer_key, self.answer_key)

    def _task_difficulty_check(self) -> tuple[bool, str]:
        """(valid, what valid is) for --task-difficulty: a range within what pi_SFT was trained on."""
        if self.task_difficulty is None:
            return True, ""
        from support import task  # only here: it loads transformers

        lo, hi = task.SHAPES[self.task_length].sft_difficulty
        low, high = self.task_difficulty
        return (self.data is None and lo <= low <= high <= hi,
                f"two k with {lo} <= min <= max <= {hi}, the {self.task_length} task's SFT range, and no --data")

    def validate(self, world_size: int = 1) -> None:
        """Fail at start, naming every bad field and the values it may take. Under torchrun every
        rank must get the same number of rows and of equal mini-batches: ranks running different
        numbers of micro-batches would call FSDP's collectives out of step (a crash on gloo, a hang
        on NCCL)."""
        rows_per_rank = self.prompts_per_step // world_size * self.samples_per_prompt
        no_data = _why_no_files(self.data, "; here, ")  # each listed once: a glob may match many files
        no_val_data = "".join(_why_no_files(spec, "; here, ") for spec in self.val_data or ())
        checks = {  # field: (valid, what valid is)
            "lam_actor": (0.0 <= self.lam_actor <= 1.0, "in [0, 1]"),
            "lam_critic": (0.0 <= self.lam_critic <= 1.0, "in [0, 1]"),
            "gamma": (0.0 <= self.gamma <= 1.0, "in [0, 1]"),
            "critic_init_offset": (self.critic_init_offset == 0.0 or self.estimator == "gae",
                                   "0 with --estimator grpo, which has no critic"),
            "orm_loss": (self.orm_loss == "mse" or self.samples_per_prompt >= 2,
                         "mse with --samples-per-prompt 1: Bradley-Terry needs two responses to a prompt"),
            "length_adaptive_alpha": (self.length_adaptive_alpha is None or self.length_adaptive_alpha > 0,
                                      "> 0, or unset"),
            "steps": (self.steps >= 0, ">= 0"),
            "value_pretrain_steps": (self.value_pretrain_steps >= 0, ">= 0"),
            "prompts_per_step": (self.prompts_per_step >= 1 and self.prompts_per_step % world_size == 0,
                                 f">= 1 and a multiple of the world size, {world_size}"),
            "samples_per_prompt": (self.samples_per_prompt >= (2 if self.estimator == "grpo" else 1),
                                   ">= 2 with --estimator grpo" if self.estimator == "grpo" else ">= 1"),
            "ppo_epochs": (self.ppo_epochs >= 1, ">= 1"),
            "num_minibatches": (1 <= self.num_minibatches and rows_per_rank % self.num_minibatches == 0,
                                f">= 1 and divide the {rows_per_rank} rows each rank gets a step"),
            "micro_batch_size": (self.micro_batch_size >= 1, ">= 1"),
            "micro_batch_tokens": (self.micro_batch_tokens is None or self.micro_batch_tokens >= 1, ">= 1, or unset"),
            "logprob_chunk_tokens": (self.logprob_chunk_tokens is None or self.logprob_chunk_tokens >= 1,
                                     ">= 1, or unset"),
            "checkpoint_fraction": (0.0 < self.checkpoint_fraction <= 1.0, "in (0, 1]"),
            "actor_lr": (self.actor_lr > 0, "> 0"),
            "critic_lr": (self.critic_lr > 0, "> 0"),
            "orm_lr": (self.orm_lr > 0, "> 0"),
            "lr_warmup_steps": (self.lr_warmup_steps >= 0, ">= 0"),
            "clip_low": (0.0 <= self.clip_low < 1.0, "in [0, 1)"),
            "clip_high": (self.clip_high >= 0.0, ">= 0"),
            "dual_clip": (self.dual_clip is None or self.dual_clip > 1.0, "> 1, or unset"),
            "value_clip": (self.value_clip is None or self.value_clip > 0, "> 0, or unset"),
            "max_grad_norm": (self.max_grad_norm > 0, "> 0"),
            "kl_coef": (self.kl_coef >= 0, ">= 0"),
            "kl_estimator": (self.kl_estimator != "k1" or not self.kl_coef,
                             "k2 or k3 with --kl-coef: as a loss term k1's gradient is 0 in expectation, noise "
                             "only; k2's is that of KL(pi || pi_SFT), k3's that of KL(pi_SFT || pi)"),
            "entropy_coef": (self.entropy_coef >= 0, ">= 0"),
            "max_new_tokens": (self.max_new_tokens >= 1, ">= 1"),
            "temperature": (self.temperature > 0, "> 0"),
            "top_p": (0.0 < self.top_p <= 1.0, "in (0, 1]"),
            "data": (self.data is None or (self.model is not None and not no_data),
                     "a file, a folder of .json/.jsonl/.parquet files or a glob matching files"
                     + (", with --model: the built-in pi_SFT knows only the built-in task" if self.model is None
                        else "") + no_data),
            "val_data": (self.val_data is None or (self.data is not None and bool(self.val_data) and not no_val_data),
                         "files, folders or globs matching files, with --data" + no_val_data),
            "val_prompt_key": self._per_val_set("val_prompt_key"),
            "val_answer_key": self._per_val_set("val_answer_key"),
            "prompt_template": (self.prompt_template is None
                                or (self.data is not None and "{prompt}" in self.prompt_template),
                                "a text holding '{prompt}', with --data"),
            "eval_every": (self.eval_every is None or self.eval_every >= 1, ">= 1, or unset"),
            "eval_temperature": (self.eval_temperature is None or self.eval_temperature > 0, "> 0, or unset"),
            "eval_max_new_tokens": (self.eval_max_new_tokens is None or self.eval_max_new_tokens >= 1,
                                    ">= 1, or unset"),
            "save_hf_every": (self.save_hf_every is None or self.save_hf_every >= 1, ">= 1, or unset"),
            "wandb_project": (self.wandb_project is None or _importable("wandb"),
                              "unset: wandb is not installed (pip install wandb)"),
            "max_prompt_tokens": (self.max_prompt_tokens >= 1, ">= 1"),
            "task_difficulty": self._task_difficulty_check(),
            "task_train_size": (self.task_train_size >= 1, ">= 1"),
            "task_eval_size": (self.task_eval_size >= 1, ">= 1"),
            "tensor_parallel_size": (self.tensor_parallel_size >= 1 and world_size % self.tensor_parallel_size == 0,
                                     f">= 1 and divide the world size, {world_size}; run under torchrun"),
            "gpu_memory_utilization": (0.0 < self.gpu_memory_utilization < 1.0,
                                       "in (0, 1): the trainer's shards stay on the GPU beside vLLM"),
            "orm_batches": (self.orm_batches >= 1, ">= 1"),
            "orm_steps": (self.orm_steps >= 1, ">= 1"),
            "plateau_window": (self.plateau_window >= 1, ">= 1"),
            "plateau_rel_tol": (self.plateau_rel_tol >= 0, ">= 0"),
            "plateau_ev_tol": (self.plateau_ev_tol >= 0, ">= 0"),
            "grader_workers": (self.grader_workers >= 1, ">= 1"),
            "grader_timeout_s": (self.grader_timeout_s > 0, "> 0"),
            "eval_samples": (self.eval_samples >= 1, ">= 1"),
            "eval_fraction": (0.0 < self.eval_fraction < 1.0, "in (0, 1)"),
            "save_every": (self.save_every >= 1, ">= 1"),
            "truncation_reward": (self.truncation_reward is None or self.truncation_reward <= 0,
                                  "<= 0, or unset: a cut response scored above 0 would count as solved"),
            "overwrite": (not (self.overwrite and self.resume), "unset with --resume"),
            "threads": (self.threads is None or self.threads >= 1, ">= 1, or unset"),
            "sft_steps": (self.sft_steps is None or self.sft_steps >= 1, ">= 1, or unset"),
            # A run's own directory as --out-dir would put runs and caches inside it, where its
            # --overwrite or a resume's clean-up (a run named checkpoint) deletes them.
            "out_dir": (not _is_run_directory(self.out_dir),
                        f"the folder that holds runs, not a run's directory (it holds config.json): for that run, "
                        f"--out-dir {os.path.dirname(os.path.abspath(self.out_dir))} "
                        f"--run-name {os.path.basename(os.path.abspath(self.out_dir))}"),
            # A directory of its own under out_dir; _shared holds the caches (pi_SFT, ORM).
            "run_name": (self.run_name is None or (self.run_name not in ("", ".", "..", "_shared")
                                                   and os.sep not in self.run_name),
                         "a plain directory name, not '', '.', '..' or '_shared'"),
        }
        bad = []
        for field in dataclasses.fields(self):  # in flag order
            value = getattr(self, field.name)
            ok, need = checks.get(field.name, (True, ""))
            if isinstance(value, float) and not math.isfinite(value):  # NaN and inf, in every float flag
                ok, need = False, "finite" + (f" and {need}" if need else "")
            if not ok:
                bad.append(f"--{field.name.replace('_', '-')} = {value!r} (must be {need})")
        if bad:
            raise ConfigError("invalid config: " + "; ".join(bad))


# What only the critic reads: its start, value pretraining and its stop, GAE's parameters, its update, the ORM.
CRITIC_FLAGS = ("critic_init", "value_pretrain_steps", "lam_actor", "lam_critic", "length_adaptive_alpha", "gamma",
                "critic_lr", "value_clip", "orm_batches", "orm_steps", "orm_lr", "orm_loss", "plateau_window",
                "plateau_rel_tol", "plateau_ev_tol")

PRESETS = {
    "tiny": Config(),
    # The long built-in task: ~520-token responses (26 GAE horizons at lambda 0.95), a limit that
    # cuts ~10% of the SFT mix (scored -1), and a larger ORM data set (results/long/README.md).
    "tiny-long": Config(
        preset="tiny-long", task_length="long", max_new_tokens=600, sft_steps=2000,
        orm_batches=8, orm_steps=120, max_prompt_tokens=128,  # vLLM: 128 + 600 within the 1,024 positions
    ),
    # The paper's method at the sizes users start with: its learning rates (actor 1e-6, critic 2e-6),
    # lambdas, value pretraining and 8k responses, bf16 and colocated vLLM. The batch shrinks with the
    # compute: 256 prompts on one GPU and 1,024 on 8, against the paper's 8,192 on 16 H200s, in
    # mini-batches of 64 and 128 (verl's quickstart uses 64), so that a step stays minutes and still
    # makes 4 to 8 optimizer steps. Each fits its target by --plan (README "Presets").
    "qwen2.5-1.5b": Config(
        preset="qwen2.5-1.5b", value_pretrain_steps=100, lam_actor=0.99, steps=500, prompts_per_step=256,
        samples_per_prompt=1, num_minibatches=4, micro_batch_size=1, actor_lr=1e-6, critic_lr=2e-6,
        lr_warmup_steps=10, rollout="vllm", max_new_tokens=8192, max_prompt_tokens=1024, gpu_memory_utilization=0.4,
        eval_samples=4, eval_every=20, save_every=20, grader_workers=4, mixed_precision=True,
        activation_checkpointing=True,
    ),
    "qwen2.5-7b": Config(
        preset="qwen2.5-7b", value_pretrain_steps=100, lam_actor=0.99, steps=500, prompts_per_step=1024,
        samples_per_prompt=1, num_minibatches=8, micro_batch_size=1, actor_lr=1e-6, critic_lr=2e-6,
        lr_warmup_steps=10, rollout="vllm", max_new_tokens=8192, max_prompt_tokens=1024, gpu_memory_utilization=0.5,
        eval_samples=8, eval_every=20, save_every=20, grader_workers=2, mixed_precision=True,
        activation_checkpointing=True,
    ),
    # Qwen2.5-32B after a short Long-CoT SFT, as in the paper; VAPO's PPO settings (actor lr 1e-6,
    # critic lr 2e-6, warm-up then constant, 8192 prompts x 1 sample, mini-batch 512), no KL term.
    "qwen2.5-32b": Config(
        preset="qwen2.5-32b", value_pretrain_steps=100,
        lam_actor=0.99, steps=1000, prompts_per_step=8192, samples_per_prompt=1,
        num_minibatches=16, micro_batch_size=1, actor_lr=1e-6, critic_lr=2e-6,
        lr_warmup_steps=10, rollout="vllm", max_new_tokens=8192, max_prompt_tokens=1024,
        tensor_parallel_size=4, eval_samples=32, save_every=20, grader_workers=2,
        mixed_precision=True, activation_checkpointing=True,
    ),
}


def _importable(module: str) -> bool:
    """Whether an optional package (wandb) is installed, checked at start rather than at step 0."""
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _is_run_directory(path: str) -> bool:
    """Whether `path` holds the config.json of a train.py run (not a model's, which holds one too)."""
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"run_name", "out_dir", "lam_actor"} <= saved.keys()


def _why_no_files(spec: str | None, lead: str) -> str:
    """Why a --data / --val-data value names no file (data.data_files's message, after `lead`), or ""."""
    from support import data

    if spec is None:
        return ""
    try:
        data.data_files(spec)
    except data.DataError as err:
        return f"{lead}{err}"
    return ""


def _check_preset_chosen() -> None:
    """--model on a GPU machine without --preset: refused, rather than trained silently with the CPU
    toy's settings (actor lr 5e-5, the hf-fast rollout, fp32). On a CPU the tiny settings are what a small
    model wants (and what the tests use)."""
    import torch

    if torch.cuda.is_available():
        raise ConfigError("--model on a GPU needs a --preset: qwen2.5-1.5b (one 80 GB GPU), qwen2.5-7b (one node "
                          "of 8 x 80 GB GPUs) or qwen2.5-32b (2 x 8 H200); tiny and tiny-long are the CPU toy's "
                          "settings (actor lr 5e-5, the hf-fast rollout, fp32), and any flag overrides a preset's value")


def one_key_as_text(settings: dict) -> dict:
    """Settings with a one-key --val-prompt-key / --val-answer-key as that key, as recorded (and
    hashed into shared stages' names) before those flags took one key per held-out set."""
    return {k: v[0] if k in ("val_prompt_key", "val_answer_key") and isinstance(v, (tuple, list)) and len(v) == 1
            else v for k, v in settings.items()}


def check_settings(where: str, stored: dict, wanted: dict, ignore=(), remedy: str = "delete it") -> None:
    """ConfigError when something saved on disk (a run directory, a cached model) was made with other
    settings than `wanted`: reusing it would silently mix two experiments. Keys in `ignore` may
    differ. The message names every difference, as a flag."""
    wanted = json.loads(json.dumps(wanted))  # as it was stored: a tuple flag reads back as a list
    old, new = one_key_as_text(stored), one_key_as_text(wanted)  # recorded as text before, or as a list
    old, new = _paths_resolved(old), _paths_resolved(new)
    diff = sorted(k for k in new if k not in ignore and old.get(k) != new[k])
    if diff:
        shown = ", ".join(_difference(k, stored, wanted) for k in diff)
        raise ConfigError(f"{where} was made with other settings ({shown}); {remedy}")


PATH_FLAGS = ("model", "data", "val_data")


def _paths_resolved(settings: dict) -> dict:
    """`settings` with the paths of PATH_FLAGS, and those input_files names its files by, as absolute
    paths, links resolved: models/m, ./models/m/ and /home/me/models/m name one model (a relative path
    taken from where the command runs)."""
    def resolved(path):
        return os.path.realpath(path) if isinstance(path, str) else path

    paths = {k: [resolved(p) for p in v] if isinstance(v, list) else resolved(v)
             for k, v in settings.items() if k in PATH_FLAGS}
    if isinstance(settings.get("input_files"), dict):  # rundir.input_files: {file as given: its digest}
        paths["input_files"] = {resolved(p): digest for p, digest in settings["input_files"].items()}
    return settings | paths


def _difference(key: str, stored: dict, wanted: dict) -> str:
    """One setting's difference, as a flag; input_files (not a flag) by the files that changed."""
    if key not in stored:
        return f"--{key.replace('_', '-')} (not recorded) -> {wanted[key]!r}"
    if key == "input_files" and isinstance(stored[key], dict) and isinstance(wanted[key], dict):
        old, new = (_paths_resolved(settings)[key] for settings in (stored, wanted))
        changed = [f"{path} {'changed' if path in old and path in new else 'added' if path in new else 'gone'}"
                   for path in sorted(old.keys() | new.keys()) if old.get(path) != new.get(path)]
        return f"the input files ({', '.join(changed)})"
    return f"--{key.replace('_', '-')} {stored[key]!r} -> {wanted[key]!r}"


def positions_needed(cfg: Config) -> int:
    """The longest sequence a run samples: the longest prompt kept and the longest response."""
    return cfg.max_prompt_tokens + max(cfg.max_new_tokens, cfg.eval_max_new_tokens or 0)


def launch_world_size(cfg: Config) -> int:
    """The world size this command was launched with, read before any process group exists:
    torchrun's WORLD_SIZE; one process without torchrun, except that --plan then sizes the preset's
    target hardware (memory_plan.TARGETS: 16 GPUs for the paper's and the CPU presets)."""
    from support import memory_plan

    return int(os.environ.get("WORLD_SIZE", memory_plan.target(cfg.preset).gpus if cfg.plan else 1))


def usable_cores() -> int:
    """The CPU cores this process may run on (macOS has no affinity: all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def core_share(processes: int) -> int:
    """Torch threads for each of `processes` processes side by side on the usable cores, at least one."""
    return max(1, usable_cores() // processes)


def cpu_threads(cfg: Config) -> int:
    """--threads, or unset: a share of the cores among the processes torchrun started on this
    machine (LOCAL_WORLD_SIZE)."""
    return cfg.threads if cfg.threads is not None else core_share(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def parse_config(argv: list[str], description: str | None = None) -> Config:
    """`--preset NAME` chooses the defaults; every other flag overrides one field; `description`
    heads `--help`. A bad value raises ConfigError naming the flag."""
    preset = None
    for i, arg in enumerate(argv):
        if arg == "--preset" and i + 1 < len(argv):
            preset = argv[i + 1]
        elif arg.startswith("--preset="):
            preset = arg.split("=", 1)[1]
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = tyro.cli(Config, default=PRESETS[preset or "tiny"], args=argv, description=description)
    if preset is None and cfg.model is not None and not cfg.plan:
        _check_preset_chosen()
    cfg.validate(world_size=launch_world_size(cfg))
    if cfg.run_name is None:
        cfg = dataclasses.replace(cfg, run_name=f"{cfg.preset}__{cfg.critic_init}__seed{cfg.seed}")
    return cfg
