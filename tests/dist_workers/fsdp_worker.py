"""torchrun worker for tests/test_distributed.py (2 CPU ranks, gloo).

1. One FSDP2 step (activation checkpointing on) on half the global batch per rank against one
   unsharded process on the whole batch: loss and updated weights, actor and critic, both loaded
   sharded from the actor's checkpoint as train.py loads them.
2. A sharded checkpoint written on both ranks resumes to the same weights and optimizer state,
   and the next step from it matches the next step of the run that wrote it. A rename that fails on
   rank 0 alone stops both ranks; a checkpoint that fails to read back on rank 1 alone is passed
   over by both, which resume from the same one before it.
3. `export_hf_checkpoint` of the sharded actor loads in Hugging Face as the same weights; a full
   disk on rank 0 stops both ranks with its cause.
4. Advantage whitening and logged metrics over the two ranks' rows equal those of one process.
5. Hugging Face sampling draws differently on each rank for the same seed.
6. Sharded loading (train.load_actor, train.load_critic): each rank's shards of a bf16 checkpoint in
   several files, and of a value model, equal the checkpoint's tensors; the head stays tied, the
   rotary buffers are recomputed, outputs equal the unsharded model's; bad checkpoints are named.
7. The outcome reward model's training (critic.train_orm) on each rank's half of a batch, for the
   test to compare with one process on the whole batch.
8. The fast decode loop (`--rollout hf-fast`) on the sharded actor: rank 0's greedy rows stop after
   7 tokens, rank 1's run to the limit, so rank 0 keeps stepping after its last row stopped; each
   rank's rows equal `generate`'s, and a seed draws differently on each rank.
Each rank writes rank<r>.json into argv[1]; the test asserts on the numbers.
"""

import errno
import os
import sys

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from common import full_disk_safetensors, tiny_actor, write_result
from critic import load_value_model
from fsdp_utils import all_reduce, close_distributed, exit_now_if_gloo, init_distributed, is_main, reduce_metrics, shard_model
import support.checkpoints
from support.checkpoints import CheckpointError, export_hf_checkpoint, iter_full_weights, load_checkpoint, load_pretrained, save_checkpoint
from ppo import explained_variance
from ppo_update import masked_whiten
from rollout import HFRollout
import train
from support.config import Config

out_dir = sys.argv[1]
torch.set_num_threads(1)
info = init_distributed()
tokenizer, _ = tiny_actor()
g = torch.Generator().manual_seed(1)
lengths = torch.tensor([9, 5, 12, 7])  # one global batch of 4 sequences, right-padded
ids = torch.randint(3, len(tokenizer), (4, 12), generator=g)
mask = (torch.arange(12) < lengths[:, None]).long()
targets = torch.randn(4, 12, generator=g)
sft_path = os.path.join(out_dir, "sft")
if is_main():
    tiny_actor(seed=0)[1].save_pretrained(sft_path)
torch.distributed.barrier()


def actor():
    return tiny_actor(seed=0)[1]


def sharded_actor():
    return load_pretrained(AutoModelForCausalLM, sft_path, activation_checkpointing=True)


def sharded_critic():
    """The critic as train.py builds it: `load_value_model` on the actor's checkpoint, seeded head."""
    return load_value_model(sft_path, activation_checkpointing=True)


def unsharded_copy(model, model_class):
    """The same weights in one plain model (a tied head is loaded through the embedding)."""
    copy = model_class.from_config(model.config)
    missing, _ = copy.load_state_dict(full_state(model), strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing
    return copy


def loss_sum(model, rows):
    """Summed per-token loss: LM cross-entropy for the actor, squared error for the critic."""
    out = model(input_ids=ids[rows], attention_mask=mask[rows]).logits
    m = mask[rows, 1:].float()
    if out.shape[-1] == 1:
        return (((out.squeeze(-1)[:, :-1] - targets[rows, 1:]) ** 2) * m).sum()
    nll = torch.nn.functional.cross_entropy(out[:, :-1].transpose(1, 2), ids[rows, 1:], reduction="none")
    return (nll * m).sum()


def step(model, opt, rows, sharded=True):
    """One update with the loss normalised by the GLOBAL token count (FSDP sums the gradients)."""
    count = mask[rows, 1:].sum().float()
    if sharded:
        all_reduce(count)
    loss = loss_sum(model, rows) / count
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss = loss.detach()
    return (all_reduce(loss) if sharded else loss).item()


def full_grads(model):
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
    }


def full_state(model):
    return {name: t.clone() for bucket in iter_full_weights(model, 1 << 16) for name, t in bucket}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() <= b.keys(), sorted(set(a) - set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)


mine = list(range(info.rank, 4, info.world_size))  # rows 0, 2 on rank 0; rows 1, 3 on rank 1
result = {}
for name, load, model_class in (("actor", sharded_actor, AutoModelForCausalLM),
                                ("critic", sharded_critic, AutoModelForTokenClassification)):
    sharded = load().train()  # Hugging Face checkpoints layers in training mode only
    single, start = unsharded_copy(sharded, model_class).train(), full_state(sharded)
    single_opt = optimizer(single)
    single_loss = step(single, single_opt, [0, 1, 2, 3], sharded=False)
    with torch.no_grad():  # as train.py evaluates pi_SFT before it builds the optimizers
        sharded(input_ids=ids[mine], attention_mask=mask[mine])
    result[name + "_sharded_after_no_grad_forward"] = all(isinstance(p, DTensor) for p in sharded.parameters())
    sharded_opt = optimizer(sharded)
    sharded_loss = step(sharded, sharded_opt, mine)
    result[name] = {
        "single_loss": single_loss,
        "sharded_loss": sharded_loss,
        "grad_max_diff": max_diff(full_grads(sharded), full_grads(single)),
        "grad_max_abs": max(g.abs().max().item() for g in full_grads(single).values()),
        "weight_max_diff": max_diff(full_state(sharded), single.state_dict()),
        "weight_change": max_diff(full_state(sharded), start),
    }

# 2. Sharded checkpoint -> fresh sharded model and optimizer -> identical state and next step.
ckpt = os.path.join(out_dir, "checkpoint")
model = shard_model(actor())
opt = optimizer(model)
step(model, opt, mine)
save_checkpoint(ckpt, {"actor": model}, {"actor": opt}, {"step": 1})
resumed = shard_model(actor())
resumed_opt = optimizer(resumed)
extra = load_checkpoint(ckpt, {"actor": resumed}, {"actor": resumed_opt})
exp_avg = lambda o: [o.state[p]["exp_avg_sq"].to_local() for p in o.param_groups[0]["params"]]
result["resume"] = {
    "extra_step": extra["step"],
    "weight_max_diff": max_diff(full_state(resumed), full_state(model)),
    "exp_avg_sq_max_diff": max((a - b).abs().max().item() for a, b in zip(exp_avg(opt), exp_avg(resumed_opt))),
    "optimizer_steps": [float(resumed_opt.state[p]["step"]) for p in resumed_opt.param_groups[0]["params"]][:1],
}
step(model, opt, mine)
step(resumed, resumed_opt, mine)
result["resume"]["next_step_max_diff"] = max_diff(full_state(resumed), full_state(model))

# Rank 0's last rename of a complete save fails (a lost mount): both ranks raise, the save stays in
# checkpoint.tmp beside checkpoint.old. Then rank 1 alone finds checkpoint.tmp damaged (a node whose
# view of the filesystem lags): both must resume from checkpoint.old, not each from its own pick.
save_checkpoint(ckpt, {"actor": model}, {"actor": opt}, {"step": 2})
real_replace, real_check = os.replace, support.checkpoints.check_checkpoint


def replace_failing_from_tmp(src, dst):
    if str(src).endswith(".tmp"):
        raise OSError(errno.EIO, os.strerror(errno.EIO), src)
    real_replace(src, dst)


def check_seeing_tmp_damaged(path):
    if path.endswith(".tmp"):
        raise CheckpointError(f"{path} lacks __0_0.distcp")
    return real_check(path)


os.replace = replace_failing_from_tmp if info.rank == 0 else real_replace
try:
    save_checkpoint(ckpt, {"actor": model}, {"actor": opt}, {"step": 3})
    result["save_rename_fails"] = "no error"
except CheckpointError as err:
    result["save_rename_fails"] = str(err)
os.replace = real_replace
result["left_after_rename"] = [os.path.basename(p) for p in support.checkpoints.saved_checkpoints(ckpt)]
if info.rank == 1:
    support.checkpoints.check_checkpoint = check_seeing_tmp_damaged
found, extra = support.checkpoints.restore_latest(ckpt, {"actor": resumed}, {"actor": resumed_opt})
support.checkpoints.check_checkpoint = real_check
result["resumed_after_damage"] = [os.path.basename(found), extra["step"]]

# 3. Export the sharded actor as a Hugging Face checkpoint (several shard files).
export = os.path.join(out_dir, "hf_export")
expected = full_state(model)
export_hf_checkpoint(model, tokenizer, export, shard_bytes=1 << 20)
if is_main():
    loaded = AutoModelForCausalLM.from_pretrained(export)
    result["export"] = {
        "files": sorted(os.listdir(export)),
        "weight_max_diff": max_diff(expected, loaded.state_dict()),
        "tied": loaded.lm_head.weight is loaded.model.embed_tokens.weight,
    }
# Rank 0's disk fills at its first shard: rank 1 is still in the gathers of the next ones, so both
# must finish them and raise, not hang; the export before is kept and no .tmp is left.
support.checkpoints.save_file, saved = full_disk_safetensors, support.checkpoints.save_file  # as the real one fails
try:
    export_hf_checkpoint(model, tokenizer, export, shard_bytes=1 << 20)
    result["export_full_disk"] = "no error"
except CheckpointError as err:
    result["export_full_disk"] = str(err)
support.checkpoints.save_file = saved
result["export_after_full_disk"] = sorted(os.listdir(out_dir))

# 4. Statistics over ranks: whitening and logged metrics see every rank's rows, as one process does.
x = torch.randn(4, 12, generator=torch.Generator().manual_seed(2))
valid = x[mask.bool()]
whole_batch = (x - valid.mean()) / valid.std() * mask  # Bessel-corrected, over all four rows
result["stats"] = {
    "whiten_max_diff": (masked_whiten(x[mine], mask[mine]) - whole_batch[mine]).abs().max().item(),
    "reduced": reduce_metrics({"mean": float(info.rank), "count": 1.0, "max": 10.0 * info.rank},
                              sums=("count",), maxes=("max",)),
    # Means over tokens: rank 0 has 1 token of advantage 1, rank 1 three of 0; "late" has tokens on rank 1 only.
    "token_means": reduce_metrics({"advantage": 1.0 - info.rank, "late": 2.0 * info.rank, "none": 0.0},
                                  tokens={"advantage": 1 + 2 * info.rank, "late": 2 * info.rank, "none": 0}),
    # Rank 0's returns are all equal (undefined there alone); over both ranks' 8 tokens it is 0.75.
    "explained_variance": explained_variance(torch.tensor([[-0.5] * 4, [0.5, 0.5, -0.5, -0.5]])[[info.rank]],
                                             torch.tensor([[-1.0] * 4, [1.0, 1.0, -1.0, -1.0]])[[info.rank]],
                                             torch.ones(1, 4), total=all_reduce).item(),
}

# 5. HF sampling under torchrun: the same seed and prompts give each rank its own draws.
sampled = HFRollout(actor(), tokenizer).generate([[5, 6, 7]] * 8, max_new_tokens=8, seed=123).response_ids
both = [None, None]
torch.distributed.all_gather_object(both, sampled.tolist())
result["sampling"] = {"ranks_differ": both[0] != both[1]}

# 6. Sharded loading from Hugging Face checkpoints, as train.py loads the actor and the critics.
from safetensors.torch import load_file, save_file  # noqa: E402

bf16_path, value_path, broken_path, config_only = (os.path.join(out_dir, d) for d in ("bf16", "value", "broken", "bin"))
if is_main():
    actor().to(torch.bfloat16).save_pretrained(bf16_path, max_shard_size="200KB")  # several files + index
    value = AutoModelForTokenClassification.from_pretrained(sft_path, num_labels=1)  # a saved head
    torch.nn.init.normal_(value.score.weight, generator=torch.Generator().manual_seed(5))
    value.save_pretrained(value_path)
    tiny_actor()[1].config.save_pretrained(broken_path)
    tiny_actor()[1].config.save_pretrained(config_only)  # as if its weights were a pytorch_model.bin
    state = actor().state_dict()
    save_file({k: v for k, v in state.items() if k not in ("model.norm.weight", "lm_head.weight")},
              os.path.join(broken_path, "model.safetensors"))
torch.distributed.barrier()


def saved_tensors(path):
    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def shards_equal_checkpoint(model, path):
    """Names whose shards, put together, differ from the checkpoint's tensor (bf16 -> fp32 is exact)."""
    saved = saved_tensors(path)
    differ = []
    for name, param in model.named_parameters():
        full = param.full_tensor()  # collective: every rank checks every name
        if name in saved and not (full.dtype == torch.float32 and torch.equal(full, saved[name].float())):
            differ.append(name)
    return differ


cfg = Config(seed=7)
loaded = {"actor": train.load_actor(cfg, bf16_path, info), "critic": train.load_critic(cfg, bf16_path, info),
          "value": train.load_critic(cfg, value_path, info)}
unsharded = {"actor": AutoModelForCausalLM.from_pretrained(bf16_path, dtype=torch.float32),
             "value": AutoModelForTokenClassification.from_pretrained(value_path, dtype=torch.float32)}
with torch.no_grad():
    outputs = {name: loaded[name](input_ids=ids[mine], attention_mask=mask[mine]).logits for name in loaded}
    expected = {name: unsharded[name](input_ids=ids[mine], attention_mask=mask[mine]).logits for name in unsharded}
errors = {}
for name, path in (("broken", broken_path), ("no_safetensors", config_only)):
    try:
        train.load_actor(cfg, path, info)
    except CheckpointError as err:
        errors[name] = str(err)
head = loaded["critic"].score
result["loading"] = {
    "sharded": all(isinstance(p, DTensor) for m in loaded.values() for p in m.parameters()),
    "files": len([f for f in os.listdir(bf16_path) if f.endswith(".safetensors")]),
    "differ": {name: shards_equal_checkpoint(model, {"value": value_path}.get(name, bf16_path))
               for name, model in loaded.items()},
    "checked": len(list(loaded["actor"].named_parameters())),
    "tied": loaded["actor"].lm_head.weight is loaded["actor"].model.embed_tokens.weight,
    "rotary_max_diff": (loaded["actor"].model.rotary_emb.inv_freq
                        - unsharded["actor"].model.rotary_emb.inv_freq).abs().max().item(),
    "logits_max_diff": {name: (outputs[name] - expected[name]).abs().max().item() for name in expected},
    "head": head.weight.full_tensor().flatten().tolist() + head.bias.full_tensor().tolist(),
    "errors": errors,
    "eval_mode": not any(m.training for m in loaded.values()),
}

# 7. ORM training, sharded on half the rows per rank; the test trains one process on all of them.
from common import ORM_LABELS, orm_batch  # noqa: E402
from critic import train_orm  # noqa: E402

orm = sharded_critic()
export_hf_checkpoint(orm, None, os.path.join(out_dir, "orm_init"))
history = train_orm(orm, [orm_batch(mine)], [ORM_LABELS[mine]], steps=3, lr=1e-3)
export_hf_checkpoint(orm, None, os.path.join(out_dir, "orm_trained"))
result["orm"] = [[h["orm/loss"], h["orm/sign_accuracy"], h["orm/grad_norm"]] for h in history]

# 8. The fast decode loop on the sharded actor, ranks stopping at different steps.
from support.fast_rollout import FastHFRollout  # noqa: E402

policy = sharded_actor()
greedy_prompts = [tokenizer("+2=\n" if info.rank == 0 else "+17+4=\n")["input_ids"]] * 2  # stop at 7 / 24 tokens
fast = FastHFRollout(policy, tokenizer).generate(greedy_prompts, 24, temperature=0)
ref = HFRollout(policy, tokenizer).generate(greedy_prompts, 24, temperature=0)
drawn = FastHFRollout(policy, tokenizer).generate([[5, 6, 7]] * 8, max_new_tokens=8, seed=123).response_ids
result["fast_rollout"] = {
    "width": fast.response_ids.shape[1],
    "tokens_equal": torch.equal(fast.response_ids, ref.response_ids) and fast.finish_reasons == ref.finish_reasons,
    "logprobs_max_diff": (fast.logprobs - ref.logprobs).abs().max().item(),
    "drawn": drawn.tolist(),
}
write_result(out_dir, info.rank, result)
close_distributed()
exit_now_if_gloo()
