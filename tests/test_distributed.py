"""FSDP2 under torchrun (2 CPU ranks, gloo) against one process; sharded checkpoints; HF export.

The worker (tests/dist_workers/fsdp_worker.py) runs once per session and writes numbers; each
test checks one property of them. Single-process behaviour of the same helpers is checked here too.
"""

import copy
import json
import math
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from dist_workers.common import full_disk, run_torchrun, tiny_actor
from support import checkpoints
from support.checkpoints import export_hf_checkpoint, iter_full_weights
from fsdp_utils import shard_model

# fp32 on CPU: the sharded step reorders sums (reduce-scatter), nothing else differs.
LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-6
# One AdamW step moves weights by ~lr = 1e-3; its first step divides by |grad| + eps, so a 1e-7
# gradient difference can show as ~1e-6 in the weights: 1e-5 is 1% of the step.
WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    ranks = run_torchrun("fsdp_worker.py", str(out_dir))
    return ranks[0] | {"out_dir": out_dir, "rank1": ranks[1]}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["actor", "critic"])
def test_fsdp_step_on_two_ranks_matches_one_process(fsdp_run, model):
    r = fsdp_run[model]
    assert fsdp_run[model + "_sharded_after_no_grad_forward"]  # the optimizer sees the real shards
    assert r["sharded_loss"] == pytest.approx(r["single_loss"], rel=LOSS_RTOL)
    assert r["grad_max_diff"] <= GRAD_ATOL  # gradients are summed, not averaged, over ranks
    assert r["weight_max_diff"] <= WEIGHT_ATOL
    assert r["weight_change"] > 100 * WEIGHT_ATOL  # the step did move the weights


@pytest.mark.slow
def test_sharded_checkpoint_resumes_to_identical_weights_and_optimizer_state(fsdp_run):
    r = fsdp_run["resume"]
    assert r["extra_step"] == 1 and r["optimizer_steps"] == [1.0]
    assert r["weight_max_diff"] == 0.0 and r["exp_avg_sq_max_diff"] == 0.0
    assert r["next_step_max_diff"] == 0.0  # and the run continues exactly as if never stopped


@pytest.mark.slow
def test_a_rank_0_rename_failure_stops_every_rank_and_all_ranks_resume_from_one_checkpoint(fsdp_run):
    """Rank 0 alone cannot rename a complete save into place: every rank raises CheckpointError (rank 1
    used to wait at the barrier after it and die on a closed connection), and the save is kept as
    checkpoint.tmp. Rank 1 alone finds that one damaged: both pass it over for checkpoint.old (each
    used to take its own pick, and DCP loaded the shards of two steps into one model)."""
    ckpt = f"{fsdp_run['out_dir']}/checkpoint"
    assert fsdp_run["save_rename_fails"] == (f"cannot rename the checkpoint saved in {ckpt}.tmp to {ckpt}: "
                                             f"Input/output error")
    assert fsdp_run["rank1"]["save_rename_fails"] == (f"cannot rename the checkpoint saved in {ckpt}.tmp to "
                                                      f"{ckpt}: it failed on rank 0")
    for rank in (fsdp_run, fsdp_run["rank1"]):
        assert rank["left_after_rename"] == ["checkpoint.tmp", "checkpoint.old"]
        assert rank["resumed_after_damage"] == ["checkpoint.old", 2]


@pytest.mark.slow
def test_whitening_and_metrics_cover_every_ranks_rows(fsdp_run):
    r = fsdp_run["stats"]
    assert r["whiten_max_diff"] <= 1e-5  # global mean and std, not each rank's own
    assert r["reduced"] == {"mean": 0.5, "count": 2.0, "max": 10.0}
    # Token means weigh each rank by its tokens (the mean of the ranks' means gave 0.5); none: undefined.
    assert r["token_means"]["advantage"] == 0.25 and r["token_means"]["late"] == 2.0
    assert math.isnan(r["token_means"]["none"])
    assert r["explained_variance"] == pytest.approx(0.75)  # the mean of the ranks' values was NaN


@pytest.mark.slow
def test_hf_sampling_draws_differently_on_each_rank(fsdp_run):
    assert fsdp_run["sampling"]["ranks_differ"]


@pytest.mark.slow
def test_fast_decode_loop_keeps_ranks_in_step_and_gives_generates_rows(fsdp_run):
    """Rank 0's rows stop at 7 tokens, rank 1's at 24: rank 0 must keep calling the sharded forward
    (FSDP's all-gathers pair up) until rank 1 is done, or the run would hang, not finish."""
    ranks = [fsdp_run["fast_rollout"], fsdp_run["rank1"]["fast_rollout"]]
    assert [r["width"] for r in ranks] == [7, 24]
    assert all(r["tokens_equal"] and r["logprobs_max_diff"] < 1e-5 for r in ranks)
    assert ranks[0]["drawn"] != ranks[1]["drawn"]  # seed + rank


@pytest.mark.slow
def test_export_from_sharded_model_loads_as_same_hf_weights(fsdp_run):
    r = fsdp_run["export"]
    assert r["weight_max_diff"] == 0.0 and r["tied"]
    assert "model.safetensors.index.json" in r["files"] and "tokenizer.json" in r["files"]
    # A full disk on rank 0 at the first shard: both ranks raise (none hangs in a gather), nothing half-written.
    for rank in (fsdp_run, fsdp_run["rank1"]):
        assert re.fullmatch(rf"cannot export a Hugging Face checkpoint to {fsdp_run['out_dir']}/hf_export: "
                            r"(No space left on device|it failed on another rank) \(\d+ MiB free there\)",
                            rank["export_full_disk"])
    assert "No space" in fsdp_run["export_full_disk"] and "another rank" in fsdp_run["rank1"]["export_full_disk"]
    assert "hf_export" in fsdp_run["export_after_full_disk"] and "hf_export.tmp" not in fsdp_run["export_after_full_disk"]


@pytest.mark.slow
def test_sharded_loading_reads_each_ranks_shards_exactly_from_the_checkpoint(fsdp_run):
    r = fsdp_run["loading"]
    assert r["sharded"] and r["files"] >= 3  # FSDP2 parameters, from a checkpoint in several files
    assert r["differ"] == {"actor": [], "critic": [], "value": []} and r["checked"] > 20  # bitwise, bf16 -> fp32
    assert r["tied"]  # the head is still the embedding
    assert r["rotary_max_diff"] == 0.0  # the non-persistent buffer was recomputed, not left as garbage
    assert r["logits_max_diff"]["actor"] <= 1e-6 and r["logits_max_diff"]["value"] <= 1e-6
    assert r["eval_mode"]


@pytest.mark.slow
def test_orm_training_on_two_ranks_matches_one_process(fsdp_run):
    from critic import load_value_model
    from dist_workers.common import ORM_LABELS, orm_batch
    from critic import train_orm

    single = load_value_model(str(fsdp_run["out_dir"] / "orm_init"))  # the sharded run's starting weights
    history = train_orm(single, [orm_batch([0, 1, 2, 3])], [ORM_LABELS], steps=3, lr=1e-3)
    for h, sharded in zip(history, fsdp_run["orm"]):  # loss, sign accuracy, gradient norm per step
        assert sharded == pytest.approx([h["orm/loss"], h["orm/sign_accuracy"], h["orm/grad_norm"]], rel=LOSS_RTOL)
    assert history[-1]["orm/loss"] < history[0]["orm/loss"]  # it did train
    trained = load_value_model(str(fsdp_run["out_dir"] / "orm_trained"))
    weights = dict(trained.named_parameters())
    assert max((p - weights[n]).abs().max().item() for n, p in single.named_parameters()) <= WEIGHT_ATOL


@pytest.mark.slow
def test_sharded_fresh_value_head_is_the_single_process_head_of_the_same_seed(fsdp_run):
    from critic import fresh_head_seed, load_value_model

    single = load_value_model(str(fsdp_run["out_dir"] / "bf16"), seed=fresh_head_seed(7))
    head = single.score.weight.flatten().tolist() + single.score.bias.tolist()
    assert fsdp_run["loading"]["head"] == head and any(head)


@pytest.mark.slow
def test_sharded_loading_names_what_is_wrong_with_a_checkpoint(fsdp_run):
    errors = fsdp_run["loading"]["errors"]
    assert "no tensor model.norm.weight in the checkpoint" in errors["broken"]
    assert "no model.safetensors or model.safetensors.index.json" in errors["no_safetensors"]


EXIT_WORKER = """
import json, os, sys
import torch
from fsdp_utils import close_distributed, exit_now_if_gloo, init_distributed
info = init_distributed()
both = [None, None]
torch.distributed.all_gather_object(both, info.rank)
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
    json.dump({"gathered": both}, f)
close_distributed()
exit_now_if_gloo()
sys.exit(3)  # reached only if the process did not leave at once
"""


PATIENT_WORKER = """
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist
import fsdp_utils
from support import rundir
# A group timeout of 3 s stands for gloo's 30 min, and rank 0's 8 s of building for a long pi_SFT's 30-60 min.
dist.init_process_group("gloo", timeout=timedelta(seconds=3))
info = fsdp_utils.init_distributed()


def build(staging):
    if info.rank == 0:  # as prepare_sft's: rank 0 alone trains it
        time.sleep(8)
        open(os.path.join(staging, "weights"), "w").close()


built = rundir.build_once(os.path.join(sys.argv[1], "stage"), {"steps": 1}, build, owner="run")
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
    json.dump({"built": built, "stage": sorted(os.listdir(os.path.join(sys.argv[1], "stage")))}, f)
fsdp_utils.close_distributed()
fsdp_utils.exit_now_if_gloo()
"""


@pytest.mark.slow
def test_ranks_wait_for_a_stage_rank_0_builds_alone_past_the_process_groups_timeout(tmp_path):
    """pi_SFT is trained by rank 0 alone (the long task's: 20-30 min on all of a CPU's cores) while
    the others waited in a barrier that gloo's 30 min timeout (NCCL's 10) ended on every rank but 0."""
    script = tmp_path / "patient_worker.py"
    script.write_text(PATIENT_WORKER)
    results = run_torchrun(str(script), str(tmp_path))  # raises when a rank timed out
    assert results == [{"built": True, "stage": ["settings.json", "weights"]}] * 2


SLOW_GRADING_WORKER = """
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import fsdp_utils
from reward import GradeResult
from rollout import RolloutBatch
from sampling import Sampler
from support.config import Config
# A group timeout of 3 s stands for NCCL's 10 min, and rank 1's 8 s of grading for responses that
# math-verify cannot finish (--grader-timeout-s each).
dist.init_process_group("gloo", timeout=timedelta(seconds=3))
info = fsdp_utils.init_distributed()


class Engine:
    def generate(self, prompt_ids, max_new_tokens, temperature, top_p, seed=None):
        one = torch.ones(len(prompt_ids), 2, dtype=torch.long)
        return RolloutBatch(one, one, one, one.float(), torch.zeros(len(prompt_ids), 2), ["stop"] * len(prompt_ids))


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "1"


class Grader:
    def grade(self, texts, answers):
        if info.rank == 1:
            time.sleep(8)
        return GradeResult(outcomes=[1.0] * len(texts), num_timeouts=0, num_missing_box=0)


sampler = Sampler(Config(), Engine(), Tokenizer(), Grader())
scored = sampler.sample_and_score([{"prompt_ids": [1], "answer": "1"}] * 2, seed=0)
total = fsdp_utils.all_reduce(scored.outcomes.sum())  # as PPO's forward would gather next
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
    json.dump({"total": total.item()}, f)
fsdp_utils.close_distributed()
fsdp_utils.exit_now_if_gloo()
"""


@pytest.mark.slow
def test_ranks_wait_for_a_rank_whose_grading_takes_past_the_process_groups_timeout(tmp_path):
    """Each rank grades its own responses, each one math-verify cannot finish costing --grader-timeout-s:
    at the 32B preset a rank of such responses grades for 20 min and more, while the others waited in
    the next collective, which NCCL's 10 min timeout ended."""
    script = tmp_path / "slow_grading_worker.py"
    script.write_text(SLOW_GRADING_WORKER)
    results = run_torchrun(str(script), str(tmp_path))  # raises when a rank timed out
    assert results == [{"total": 4.0}] * 2


FOREIGN_GROUP_WORKER = """
import json, os, socket, sys
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import Qwen2Config, Qwen2ForCausalLM
import fsdp_utils
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
# What vLLM's engine does in one CPU process: a gloo group of one, without torchrun's environment.
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1))
sharded = isinstance(fsdp_utils.shard_model(model), FSDPModule)
fsdp_utils.close_distributed()
result = {"sharded": sharded, "distributed": fsdp_utils.distributed(), "group_left_alone": dist.is_initialized()}
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], "rank0.json"), "w") as f:
    json.dump(result, f)
"""


def test_a_process_group_vllm_started_in_one_process_is_not_the_trainers(tmp_path):
    script = tmp_path / "foreign_group_worker.py"
    script.write_text(FOREIGN_GROUP_WORKER)
    [result] = run_torchrun(str(script), str(tmp_path), nproc=0)
    assert result == {"sharded": False, "distributed": False, "group_left_alone": True}


@pytest.mark.slow
def test_gloo_workers_leave_at_once_after_close_distributed(tmp_path):
    # Interpreter shutdown with gloo threads alive can abort a rank (see exit_now_if_gloo).
    script = tmp_path / "exit_worker.py"
    script.write_text(EXIT_WORKER)
    results = run_torchrun(str(script), str(tmp_path))  # raises on a non-zero exit, such as 3
    assert [r["gathered"] for r in results] == [[0, 1], [0, 1]]


def test_shard_model_without_process_group_returns_the_model_itself():
    _, model = tiny_actor()
    assert shard_model(model, activation_checkpointing=True) is model
    assert all(type(p) is torch.nn.Parameter for p in model.parameters()) and model.is_gradient_checkpointing


@pytest.mark.parametrize("flag", ["mixed_precision", "cpu_offload"])
def test_gpu_only_options_stop_with_a_message_on_a_cpu(flag):
    """Not silently ignored: bf16 and offload are FSDP2's CUDA options (torch.cuda is off in tests)."""
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} needs a GPU"):
        shard_model(tiny_actor()[1], **{flag: True})


def test_gpu_only_options_are_accepted_where_there_is_a_gpu(monkeypatch):
    """The refusal above is the CPU's: on a GPU (faked here) bf16 and offload are FSDP2's to honour."""
    from fsdp_utils import check_gpu_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_gpu_options(mixed_precision=True, cpu_offload=True)  # no ValueError


def test_a_process_on_a_gpu_keeps_cudnn_out_of_attention(monkeypatch):
    """cuDNN plans each new attention shape (~40 ms on an H200), and a run's shapes are new at every
    micro-batch and decoding step: init_distributed turns it off where it puts the process on a GPU.
    The GPU and the process group are faked; only the SDPA flag is real."""
    import torch.distributed as dist

    import fsdp_utils

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(fsdp_utils, "_gloo_threads", False)
    monkeypatch.setattr(fsdp_utils, "_patient_group", object())  # made already: no group to fake for it
    for name, fake in (("is_initialized", lambda: True), ("get_backend", lambda: "nccl"),
                       ("get_rank", lambda: 0), ("get_world_size", lambda: 1)):
        monkeypatch.setattr(dist, name, fake)
    was_on = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        info = fsdp_utils.init_distributed()
        assert info.device == torch.device("cuda", 0)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was_on)


def test_one_process_on_a_group_of_one_rank_trains_as_the_plain_model(tmp_path):
    """The path one GPU takes, run here on gloo: FSDP2 over a 1-rank group (with and without
    activation checkpointing) gives exactly the plain model's PPO update."""
    r = run_torchrun("one_rank_worker.py", str(tmp_path), nproc=0)[0]
    assert not r["grouped_before"] and r["world_size"] == 1 and r["backend"] == "gloo"
    assert r["weight_change"] > 1e-4  # the update moved the weights
    for checkpointing in (False, True):
        got = r[f"checkpointing={checkpointing}"]
        assert got["sharded"]
        assert got["weight_max_diff"] == 0.0 and got["metric_max_diff"] == 0.0, got  # the same arithmetic


def test_iter_full_weights_buckets_are_bounded_and_cover_each_tensor_once():
    _, model = tiny_actor()
    bucket_bytes = 100_000
    buckets = list(iter_full_weights(model, bucket_bytes))
    names = [name for bucket in buckets for name, _ in bucket]
    assert len(names) == len(set(names))
    assert "lm_head.weight" not in names  # tied to the embedding: sent once
    assert set(names) == {n for n, _ in model.named_parameters()}
    for bucket in buckets:  # a bucket closes as soon as it reaches the bound
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes[:-1]) < bucket_bytes
    assert all(t.dtype == torch.bfloat16 for _, t in next(iter_full_weights(model, bucket_bytes, torch.bfloat16)))
    first, tensor = next(iter(model.state_dict().items()))  # a bound the first tensor reaches alone: it closes there
    assert [name for name, _ in next(iter_full_weights(model, tensor.numel() * tensor.element_size()))] == [first]


def test_export_hf_checkpoint_single_process_round_trips(tmp_path):
    tokenizer, model = tiny_actor()
    export_hf_checkpoint(model, tokenizer, str(tmp_path / "hf"))
    export_hf_checkpoint(model, tokenizer, str(tmp_path / "hf"), shard_bytes=1 << 20)  # overwrite
    files = os.listdir(tmp_path / "hf")
    assert "model.safetensors" not in files  # the first export's single file did not survive
    shards = sorted(f for f in files if f.endswith(".safetensors"))  # named as save_pretrained names them
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_an_exported_critic_is_recorded_as_a_scalar_head_model_in_the_dtype_written(tmp_path):
    """A critic made from pi_SFT carries pi_SFT's config, architectures ["Qwen2ForCausalLM"]: exported
    as such, a loader (critic.load_value_model) would take its trained value head for a fresh one.
    The config records the class exported and the dtype of its weights (bf16 here, not the fp32 trained)."""
    from transformers import AutoModelForTokenClassification

    _, model = tiny_actor()
    config = copy.deepcopy(model.config)
    config.num_labels, config.architectures = 1, ["Qwen2ForCausalLM"]
    critic = AutoModelForTokenClassification.from_config(config)
    export_hf_checkpoint(critic, None, str(tmp_path / "critic_hf"), dtype=torch.bfloat16)
    saved = json.loads((tmp_path / "critic_hf" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForTokenClassification"]
    assert saved["dtype"] == "bfloat16" and next(critic.parameters()).dtype == torch.float32


def test_a_generation_config_that_loads_with_a_warning_is_exported_as_it_came(tmp_path):
    """A temperature beside do_sample false loads with a warning, but save_pretrained refuses it: a
    --model with such a config trained to the end of its run, then failed to export."""
    tokenizer, model = tiny_actor()
    model.generation_config.do_sample, model.generation_config.temperature = False, 0.5
    export_hf_checkpoint(model, tokenizer, str(tmp_path / "hf"))
    saved = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert saved["temperature"] == 0.5 and saved["do_sample"] is False


def test_a_checkpoint_of_other_shapes_is_named_tensor_by_tensor_in_one_process(tmp_path):
    """One process loads through from_pretrained, which raised deep in transformers, pointing to a
    report that is held back; now the error names the tensors and both shapes, as under torchrun."""
    from support.checkpoints import CheckpointError, load_pretrained

    _, model = tiny_actor()
    model.save_pretrained(tmp_path / "lm")
    config = copy.deepcopy(model.config)
    config.intermediate_size = 256
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight has shape \(128, \d+\), the model "
                                              r"wants \(128, 256\); .* and 3 more tensors of other shapes") as err:
        load_pretrained(AutoModelForCausalLM, str(tmp_path / "lm"), config)
    assert str(err.value).count(" has shape ") == 3  # 3 named and 3 more: the 2 layers' 3 MLP matrices


def test_a_save_killed_between_its_renames_resumes_from_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    _, model = tiny_actor()
    models, optimizers = {"actor": model}, {"actor": torch.optim.AdamW(model.parameters())}
    path = str(tmp_path / "checkpoint")
    assert checkpoints.latest_checkpoint(path) is None
    checkpoints.save_checkpoint(path, models, optimizers, {"step": 1})
    real_replace, calls = os.replace, []

    def killed_after_first_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # checkpoint -> checkpoint.old happened; tmp -> checkpoint did not
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(checkpoints.os, "replace", killed_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_checkpoint(path, models, optimizers, {"step": 2})
    monkeypatch.undo()
    assert not os.path.exists(path)
    assert checkpoints.latest_checkpoint(path) == path + ".tmp"  # step 2, complete
    assert checkpoints.load_checkpoint(path + ".tmp", models, optimizers)["step"] == 2

    monkeypatch.setattr(checkpoints.dcp, "save", full_disk)  # the resumed run's next save fails too
    with pytest.raises(checkpoints.CheckpointError, match="No space left"):
        checkpoints.save_checkpoint(path, models, optimizers, {"step": 3})
    monkeypatch.undo()
    assert checkpoints.latest_checkpoint(path) == path  # step 2 was kept, under the name it lacked
    assert checkpoints.checkpoint_extra(path)["step"] == 2
    os.replace(path, path + ".tmp")  # back to the state the kill left
    os.remove(os.path.join(path + ".tmp", "extra.pt"))  # as if killed while writing step 2
    assert checkpoints.latest_checkpoint(path) == path + ".old"
    checkpoints.save_checkpoint(path, models, optimizers, {"step": 3})  # and the next save cleans up
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "checkpoint.old"]  # the one before is kept
    assert checkpoints.load_checkpoint(checkpoints.latest_checkpoint(path), models, optimizers)["step"] == 3
    os.makedirs(os.path.join(path + ".old", "half-deleted"))  # killed while removing the previous one
    checkpoints.save_checkpoint(path, models, optimizers, {"step": 4})
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "checkpoint.old"]
    assert checkpoints.load_checkpoint(checkpoints.latest_checkpoint(path), models, optimizers)["step"] == 4
    assert checkpoints.checkpoint_extra(path + ".old")["step"] == 3


def test_a_damaged_checkpoint_is_named_by_its_missing_file_or_the_last_line_of_the_loads_error(tmp_path):
    """A shard deleted is found before loading (the metadata names it) and the one before is taken; a
    shard cut short shows at the load, whose DCP error is a whole traceback per rank: the error says
    its last line (a read that ran out of file), not its first ("CheckpointException ranks: ...")."""
    _, model = tiny_actor()
    models, optimizers = {"actor": model}, {"actor": torch.optim.AdamW(model.parameters())}
    path = str(tmp_path / "checkpoint")
    for step in (1, 2):
        checkpoints.save_checkpoint(path, models, optimizers, {"step": step})
    shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    os.remove(os.path.join(path, shard))
    with pytest.raises(checkpoints.CheckpointError, match=rf"{re.escape(path)} lacks {shard}$"):
        checkpoints.check_checkpoint(path)
    assert checkpoints.latest_checkpoint(path) == path + ".old"
    with open(os.path.join(path + ".old", shard), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.load_checkpoint(path + ".old", models, optimizers)
    assert str(err.value) == f"cannot resume from {path}.old (CheckpointException: EOFError)"


def test_a_full_disk_behind_the_error_a_writer_raised_while_handling_it_is_named(tmp_path, monkeypatch):
    """The operating system's word is looked for along the whole chain: here a writer that met a
    full disk and raised its own error while handling it (no `from`: the OSError is its context)."""
    _, model = tiny_actor()
    models, optimizers = {"actor": model}, {"actor": torch.optim.AdamW(model.parameters())}

    def writer_of_its_own(*args, **kwargs):
        try:
            full_disk()
        except OSError:
            raise RuntimeError("the writer gave up")

    monkeypatch.setattr(checkpoints.dcp, "save", writer_of_its_own)
    with pytest.raises(checkpoints.CheckpointError, match="No space left on device"):
        checkpoints.save_checkpoint(str(tmp_path / "checkpoint"), models, optimizers, {"step": 1})
    assert not os.path.exists(tmp_path / "checkpoint.tmp")


def test_bucket_size_must_be_positive():
    _, model = tiny_actor()
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(iter_full_weights(model, 0))


def test_memory_plan_counts_the_parameters_of_the_real_models():
    from transformers import AutoModelForTokenClassification

    from support.memory_plan import ModelShape

    _, model = tiny_actor()
    shape = ModelShape.from_config(model.config)
    assert shape.params() == sum(p.numel() for p in model.parameters())  # tied head counted once
    config = copy.deepcopy(model.config)
    config.num_labels = 1
    critic = AutoModelForTokenClassification.from_config(config)
    assert shape.params(value_head=True) == sum(p.numel() for p in critic.parameters())


def test_memory_plan_reads_a_head_width_that_is_not_hidden_over_heads():
    """Configs may set head_dim apart from hidden_size / heads (Qwen3's 128 beside 1024 / 16): the
    attention's matrices are that wide, so the count must use it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from support.memory_plan import ModelShape

    config = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = Qwen2ForCausalLM(config)
    assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 64 != config.hidden_size
    assert ModelShape.from_config(config).params() == sum(p.numel() for p in model.parameters())


def test_memory_plan_counts_what_a_decoder_layer_saves_for_backward():
    """activation_elements_per_token against the tensors autograd keeps: those a tiny Qwen2 of two
    layers saves beyond one of one layer (parameters aside, each storage once), per token, in
    training mode on the unmasked path the update takes when no prompt is left-padded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from support.memory_plan import ModelShape

    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=344, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))

    def saved_elements(layers):
        config.num_hidden_layers = layers
        model = Qwen2ForCausalLM(config).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def keep(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes() // tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model(input_ids=ids, use_cache=False)
        return sum(storages.values())

    per_token = (saved_elements(2) - saved_elements(1)) / ids.numel()
    counted = ModelShape.from_config(config).activation_elements_per_token()
    assert per_token <= counted <= 1.02 * per_token, (per_token, counted)


def test_memory_plan_32b_actor_and_critic_fit_16_h200_but_not_8():
    from support.memory_plan import QWEN25_32B, plan

    assert QWEN25_32B.params() == 32_763_876_352
    sixteen = plan(QWEN25_32B, world_size=16)
    assert sixteen.fits and "fits" in str(sixteen)
    assert not plan(QWEN25_32B, world_size=8).fits
    assert not plan(QWEN25_32B, world_size=16, micro_batch_tokens=4 * 9216).fits  # logits dominate
    with pytest.raises(ValueError, match="multiple of tensor_parallel_size"):
        plan(QWEN25_32B, world_size=6, tensor_parallel_size=4)


def test_selective_checkpointing_and_compiled_layers_keep_the_parameter_names():
    _, model = tiny_actor()
    names = [n for n, _ in model.named_parameters()]
    shard_model(model, activation_checkpointing=True, checkpoint_fraction=0.5, compile_layers=True)
    layers = model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]  # one layer of two
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert [n for n, _ in model.named_parameters()] == names
    with pytest.raises(ValueError, match="checkpoint_fraction"):
        shard_model(model, activation_checkpointing=True, checkpoint_fraction=0.0)


def test_checkpoint_fraction_recomputes_the_nearest_share_of_the_layers_spread_evenly_and_at_least_one():
    """checkpoint_fraction is a share of the decoder layers: the nearest whole number of them (0.6 of 3
    layers is 2, not 1 cut down), spread over the stack (half of 4 is layers 0 and 2, not the first two),
    and at least one when checkpointing is asked for (0.1 of 4 rounds to none)."""
    from support.task import build_tokenizer, make_tiny_model

    for layers, fraction, recomputed in ((4, 0.5, [True, False, True, False]), (3, 0.6, [True, True, False]),
                                         (4, 0.1, [True, False, False, False])):
        model = make_tiny_model(build_tokenizer(), num_layers=layers, seed=0)
        shard_model(model, activation_checkpointing=True, checkpoint_fraction=fraction)
        assert [layer.gradient_checkpointing for layer in model.model.layers] == recomputed, (layers, fraction)


def test_a_model_whose_decoder_layers_are_not_listed_is_refused_not_sharded_whole():
    """The layers come from the model's `_no_split_modules`: without them, FSDP2 would shard the root alone
    (a whole model gathered at once), compile nothing and checkpoint every layer or none, in silence."""
    _, model = tiny_actor()
    model._no_split_modules = None
    with pytest.raises(ValueError, match="shard_model: no decoder layers found in Qwen2ForCausalLM"):
        shard_model(model, compile_layers=True)


def test_exit_now_if_gloo_skips_shutdown_only_after_gloo_and_never_where_vllm_ran(monkeypatch):
    """os._exit skips atexit and flushing by the interpreter: right after gloo's collectives (their threads
    abort shutdown), wrong in a process without them, and wrong where vLLM ran (its shared-memory
    segments are removed at a normal exit only)."""
    import sys
    import types

    import fsdp_utils

    exits = []
    monkeypatch.setattr(fsdp_utils.os, "_exit", exits.append)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(fsdp_utils, "_gloo_threads", False)
    fsdp_utils.exit_now_if_gloo(3)
    assert exits == []  # no gloo: an ordinary exit
    monkeypatch.setattr(fsdp_utils, "_gloo_threads", True)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    fsdp_utils.exit_now_if_gloo(3)
    assert exits == []  # vLLM ran here
    monkeypatch.delitem(sys.modules, "vllm")
    fsdp_utils.exit_now_if_gloo(3)
    assert exits == [3]


def test_memory_plan_host_constants_are_the_codes():
    import inspect

    from support import memory_plan

    assert memory_plan.READ_BYTES == checkpoints.READ_BYTES
    assert memory_plan.EXPORT_SHARD_BYTES == inspect.signature(export_hf_checkpoint).parameters["shard_bytes"].default


def test_memory_plan_host_per_node_holds_read_buffers_not_whole_models():
    from support.memory_plan import GIB, QWEN25_32B, needs, plan

    sharded = {name: values for name, *values in plan(QWEN25_32B, world_size=16).host_rows}
    assert sharded["loading: each rank's read buffer (2 x 64 MiB)"][0] == 8 * 128 / 1024  # GiB, 8 ranks per node
    assert plan(QWEN25_32B, world_size=16).host_peak_gib < 10  # the HF export's 4 GiB file + one fp32 tensor
    single = plan(QWEN25_32B, world_size=4, tensor_parallel_size=1, gpus_per_node=1)
    assert single.host_rows[0][1] == 0.125  # one rank per node
    one_process = plan(QWEN25_32B, world_size=1, tensor_parallel_size=1)
    assert one_process.host_peak_gib == pytest.approx(32_763_876_352 * 6 / GIB)  # whole fp32 model + bf16 pages
    offloaded = plan(QWEN25_32B, world_size=8, cpu_offload=True)
    states = (QWEN25_32B.params() + QWEN25_32B.params(value_head=True)) * 16 / GIB  # params, grads, 2 AdamW
    export = 4 + 152064 * 5120 * 4 / GIB  # rank 0's 4 GiB file + the fp32 embedding
    assert offloaded.host_peak_gib == pytest.approx(states + export)  # one node holds all the states
    at_8, at_16 = needs(QWEN25_32B)
    assert at_8.startswith("at 8 GPUs (1 node of 8)") and "does NOT fit" in at_8
    assert at_16.startswith("at 16 GPUs (2 nodes of 8)") and "(fits)" in at_16 and "host" in at_16


def test_memory_plan_export_row_holds_a_small_model_whole_not_a_4_gib_file():
    """The export streams files of up to 4 GiB: a model smaller than that is one file of its own
    size (the plan said 4 GiB for a model of a million parameters), and the 32B model's stays 4 GiB."""
    from support.memory_plan import GIB, QWEN25_32B, ModelShape, plan

    _, model = tiny_actor()
    shape = ModelShape.from_config(model.config)
    export = {name: values[-1] for name, *values in plan(shape, world_size=2, tensor_parallel_size=1).host_rows
              if name.startswith("HF export")}
    whole = shape.params(value_head=True) * 4  # the critic: the actor's backbone and a head, in fp32
    assert export == {f"HF export on rank 0: one file's {whole / GIB:.3g} GiB + one tensor":
                      pytest.approx((whole + shape.largest_tensor * 4) / GIB)}
    export = [values[-1] for name, *values in plan(QWEN25_32B, world_size=16).host_rows if name.startswith("HF export")]
    assert export == [pytest.approx((4 * GIB + QWEN25_32B.largest_tensor * 4) / GIB)]


def test_memory_plan_largest_tensor_is_the_real_models_largest():
    """The DCP save and export rows stage the largest tensor: an MLP matrix when the vocabulary is
    smaller than the MLP's width (the tiny task model's), not the embedding."""
    from support.memory_plan import ModelShape

    _, model = tiny_actor()
    shape = ModelShape.from_config(model.config)
    assert shape.intermediate > shape.vocab
    assert shape.largest_tensor == max(p.numel() for p in model.parameters())


def test_memory_plan_gpu_rows_follow_precision_offload_reference_critic_and_tensor_parallelism():
    """Each option against the same plan without it, from the rows' own definitions: fp32 compute
    doubles the gathered layers; CPU offload leaves no sharded state on the GPU; the frozen reference
    policy is resident in both phases like the actor; the gradients are the larger model's; vLLM's
    bf16 weights are split by tensor parallelism; a logits chunk longer than the micro-batch is none."""
    from support.memory_plan import GIB, QWEN25_1_5B, QWEN25_32B, QWEN25_7B, plan

    def rows(shape=QWEN25_32B, world_size=16, **options):
        return {name: (rollout, training) for name, rollout, training in plan(shape, world_size, **options).rows}

    base = rows()
    gathered = "gathered layers (2 decoder layers)"
    assert rows(mixed_precision=False)[gathered][1] == 2 * base[gathered][1] > 0
    offloaded = rows(cpu_offload=True)
    for name in ("actor parameters (fp32, sharded)", "actor AdamW states (2 x fp32, sharded)",
                 "critic parameters (fp32, sharded)", "critic AdamW states (2 x fp32, sharded)",
                 "gradients of one model (fp32, sharded)"):
        assert base[name][1] > 0 and offloaded[name] == (0.0, 0.0), name
    assert rows(reference_policy=True)["reference policy parameters (fp32, sharded)"] == \
        base["actor parameters (fp32, sharded)"]
    larger_critic = rows(QWEN25_1_5B, 8, critic=QWEN25_7B)
    critic_parameters = larger_critic["critic parameters (fp32, sharded)"][1]
    assert larger_critic["gradients of one model (fp32, sharded)"] == (0.0, critic_parameters)
    for tp in (1, 4):
        weights = rows(tensor_parallel_size=tp)["vLLM weights (bf16 / tensor parallel)"][0]
        assert weights == pytest.approx(QWEN25_32B.params() * 2 / tp / GIB)
    activations = "activations of one micro-batch (actor/critic max)"
    longer_chunk = rows(micro_batch_tokens=4096, logits_chunk_tokens=8192)
    assert longer_chunk[activations] == rows(micro_batch_tokens=4096)[activations]
    with pytest.raises(ValueError, match="gpu_memory_utilization must lie in"):
        plan(QWEN25_32B, 16, gpu_memory_utilization=1.0)  # nothing would be left to train in


def test_memory_plan_activations_keep_every_layer_without_checkpointing_and_one_at_least_with_it():
    """Without checkpointing every layer keeps its activations and nothing is recomputed; with it, a
    checkpointed layer keeps only its input and the one being recomputed holds its activations and
    their gradients; fsdp_utils.shard_model checkpoints one layer at least, however small the share."""
    from support.memory_plan import GIB, LOGITS_BYTES, QWEN25_7B as shape, plan

    tokens = 4096
    per_layer = shape.activation_elements_per_token() * tokens * 2  # bf16
    logits = tokens * shape.vocab * LOGITS_BYTES

    def actor(**options):
        p = plan(shape, 8, micro_batch_tokens=tokens, with_critic=False, **options)
        return {name: training for name, _, training in p.rows}["activations of one micro-batch (actor/critic max)"]

    assert actor(activation_checkpointing=False) == pytest.approx((shape.layers * per_layer + logits) / GIB)
    everything = shape.layers * shape.hidden * tokens * 2 + 2 * per_layer
    assert actor() == pytest.approx((everything + logits) / GIB)
    one = shape.hidden * tokens * 2 + (shape.layers - 1) * per_layer + 2 * per_layer
    assert actor(checkpoint_fraction=0.001) == actor(checkpoint_fraction=1 / shape.layers) == \
        pytest.approx((one + logits) / GIB)


def test_memory_plan_a_node_holds_the_ranks_it_runs_and_a_part_filled_node_counts():
    """Fewer GPUs than a node: the node holds those ranks' read buffers (4, not 8); 12 GPUs in nodes
    of 8 take 2 nodes; the grouped KV heads of a 1.5B (2) are replicated when tensor parallelism (4)
    exceeds them: one head a GPU, K and V, 28 layers, 128 wide, bf16 = 14 KiB a token."""
    from support.memory_plan import QWEN25_1_5B, QWEN25_7B, MemoryPlan, needs, plan

    assert plan(QWEN25_7B, world_size=4).host_rows[0][1] == 4 * 128 / 1024  # GiB: 4 ranks x 2 x 64 MiB
    assert needs(QWEN25_7B, world_sizes=(12,))[0].startswith("at 12 GPUs (2 nodes of 8)")
    assert "(14 KiB per token per GPU)" in str(plan(QWEN25_1_5B, world_size=4, tensor_parallel_size=4))
    assert MemoryPlan([("all of it", 1.0, 70.0)], capacity_gib=70.0, notes=[]).fits  # exactly full fits


def test_a_sleeping_engine_gives_torchs_cached_gpu_memory_back_before_each_wake(monkeypatch):
    """vLLM maps its weights and KV cache with the CUDA driver, outside torch's caching allocator: the
    update's freed activations and gradients, still cached by torch, were not free for the wake, which
    the memory plan counts on (--plan's rollout column has no training memory in it)."""
    from types import SimpleNamespace

    from support import vllm_rollout

    events = []

    class LLM:  # what sync_weights calls of vllm.LLM
        llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))

        def wake_up(self, tags):
            events.append(f"wake {tags[0]}")

        def collective_rpc(self, method, kwargs=None):
            events.append(method if isinstance(method, str) else "refresh the tied head")

        def reset_prefix_cache(self):
            events.append("reset the prefix cache")

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty torch's cache"))
    engine = object.__new__(vllm_rollout.VLLMRollout)  # an engine asleep, as on a GPU between rollouts
    engine.llm, engine.asleep, engine.needs_weights = LLM(), True, False
    engine.sync_weights(torch.nn.Linear(2, 2))
    assert events == ["empty torch's cache", "wake weights", "reload_weights", "refresh the tied head",
                      "empty torch's cache", "wake kv_cache", "reset the prefix cache"]
    assert not engine.asleep


def test_memory_plan_says_when_vllms_share_cannot_hold_its_weights_and_counts_no_kv_cache():
    """Qwen2.5-32B unsplit (tensor parallel 1) is ~61 GiB of bf16 weights, beyond a tenth of an H200:
    the plan says so, and its KV cache holds no tokens rather than a negative number of them."""
    from support.memory_plan import QWEN25_32B, plan

    text = str(plan(QWEN25_32B, world_size=16, tensor_parallel_size=1, gpu_memory_utilization=0.1))
    assert "vLLM's share cannot even hold its weights" in text
    assert "vLLM KV cache holds ~0k tokens per engine" in text


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_update_recomputes_activations_only_with_activation_checkpointing(checkpointing):
    """Hugging Face recomputes a layer in the backward pass only in training mode, and loaded models
    are in eval mode: update_model trains in training mode, so --activation-checkpointing takes
    effect (each layer runs twice per micro-batch), and leaves the model in eval mode after."""
    import train
    from support.config import Config
    from ppo_update import update_model
    from rollout import HFRollout

    tokenizer, model = tiny_actor()
    model.eval()
    cfg = Config(num_minibatches=1, micro_batch_size=2, prompts_per_step=2, samples_per_prompt=1)
    batch = HFRollout(model, tokenizer).generate([tokenizer("S:12").input_ids] * 2, 6, seed=0)
    per_token = {"old_logprobs": batch.logprobs, "advantages": batch.response_mask.clone()}
    model = shard_model(model, activation_checkpointing=checkpointing)
    calls, mlp = [], model.model.layers[0].mlp
    forward = mlp.forward  # counted directly: the recompute runs no module hooks
    mlp.forward = lambda *args, **kwargs: (calls.append(1), forward(*args, **kwargs))[1]
    update_model(cfg, model, torch.optim.SGD(model.parameters(), lr=0.0), batch, per_token, train.actor_loss,
                 seed=0, prefix="actor")
    assert len(calls) == (2 if checkpointing else 1) and not model.training


def test_every_sharding_setting_of_a_run_reaches_shard_model():
    """shard_options carries each sharding flag of the config into shard_model: one dropped there would
    leave the run, in silence, without it (layers not compiled, every layer recomputed)."""
    import inspect
    from types import SimpleNamespace

    from fsdp_utils import shard_options

    cfg = SimpleNamespace(mixed_precision=True, activation_checkpointing=True, cpu_offload=True,
                          checkpoint_fraction=0.25, compile_layers=True)
    assert shard_options(cfg) == vars(cfg)
    assert set(shard_options(cfg)) <= set(inspect.signature(shard_model).parameters)  # each one a shard_model option


def test_one_cpu_process_without_torchrun_joins_no_process_group(monkeypatch):
    """Only a GPU gets a group of one rank (launch_as_one_rank); one process on the CPU is the plain
    single process: no torchrun environment set, no gloo group, every collective the identity."""
    import torch.distributed as dist

    import fsdp_utils

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        info = fsdp_utils.init_distributed()
        assert info == fsdp_utils.DistInfo(rank=0, world_size=1, device=torch.device("cpu"))
        assert "RANK" not in os.environ and not dist.is_initialized()
    finally:
        if dist.is_initialized():  # left by a broken init_distributed: not for the next test
            dist.destroy_process_group()
