"""The benchmarks' own code, run on the CPU: bench/mfu_bench.py's dry run and its FLOP count, and
bench/rollout_bench.py's profile, bench/sdpa_shapes_bench.py, and bench/gpu_smoke.sh's check of its part
names, its summary of a skipped part and its time limit on a command's children."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import mfu_bench  # noqa: E402


def test_mfu_bench_dry_run_runs_the_update_with_every_lever_and_ends_with_its_line(capsys, monkeypatch):
    """Each lever reaches the code it drives: --micro-batch-tokens cuts the batch into micro-batches
    of up to 200 padded tokens (not one row each), --logprob-chunk-tokens reaches every
    policy_forward (bare and PPO), --checkpoint-fraction 0.5 recomputes one of the two layers
    (shard_model with activation checkpointing), --profile prints its table; then the result line."""
    shard, forward = mfu_bench.fsdp_utils.shard_model, mfu_bench.train.policy_forward
    sharded, forwards = [], []
    monkeypatch.setattr(mfu_bench.fsdp_utils, "shard_model",
                        lambda model, **options: sharded.append((options, shard(model, **options))) or sharded[-1][1])

    def policy_forward(model, micro, *args, chunk_tokens=None, **kwargs):
        forwards.append((len(micro), micro.response_ids.shape[1] + micro.prompt_ids.shape[1], chunk_tokens))
        return forward(model, micro, *args, chunk_tokens=chunk_tokens, **kwargs)

    monkeypatch.setattr(mfu_bench.train, "policy_forward", policy_forward)
    result = mfu_bench.main(["--dry-run", "--rows", "4", "--repeats", "1", "--micro-batch-tokens", "200",
                             "--logprob-chunk-tokens", "64", "--checkpoint-fraction", "0.5", "--profile"])
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("Self CPU time total") for line in out)  # --profile's table
    assert "in 2 micro-batches" in out[-2]  # the token budget, not one row each
    assert re.fullmatch(r"mfu ppo=\d+\.\d{3} bare=\d+\.\d{3} ratio=\d+\.\d{2} peak_gib=\d+\.\d", out[-1])
    assert result["ratio"] > 0 and result["ppo"] > 0

    # 2 rounds x (bare, PPO) + the profiled update, each over the same 2 micro-batches
    assert len(forwards) == 10 and {chunk for *_, chunk in forwards} == {64}
    assert all(rows * width <= 200 for rows, width, _ in forwards) and max(rows for rows, *_ in forwards) > 1
    [(options, model)] = sharded
    assert options["activation_checkpointing"] and options["checkpoint_fraction"] == 0.5
    assert model.is_gradient_checkpointing
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]


def test_mfu_bench_fresh_batches_time_a_new_batch_at_every_step(monkeypatch):
    """--fresh-batches: every step (bare and PPO, warm-up included) runs on a batch of its own seed,
    and MFU counts each timed step's own FLOPs."""
    drawn, forward, count = mfu_bench.ragged_batch, mfu_bench.train.policy_forward, mfu_bench.model_flops
    seeds, forwarded, counted = [], [], []
    monkeypatch.setattr(mfu_bench, "ragged_batch", lambda *a, seed=0: seeds.append(seed) or drawn(*a, seed=seed))
    monkeypatch.setattr(mfu_bench.train, "policy_forward", lambda model, micro, *a, **k: forwarded.append(
        int(micro.lengths.sum())) or forward(model, micro, *a, **k))
    monkeypatch.setattr(mfu_bench, "model_flops", lambda shape, lengths: counted.append(sorted(lengths)) or count(shape, lengths))
    result = mfu_bench.main(["--dry-run", "--rows", "4", "--repeats", "2", "--fresh-batches"])
    assert seeds == [0, 1, 2, 3, 4, 5, 6]  # the first batch (profiled only), then one per step: 3 rounds x (bare, PPO)
    batches = [drawn(mfu_bench.TINY["vocab_size"], 4, 16, 48, "cpu", seed=s)[0] for s in range(1, 7)]
    # Micro-batches of one row: each step's forwards are its batch's rows, four by four.
    assert [sum(forwarded[4 * k: 4 * k + 4]) for k in range(6)] == [int(b.lengths.sum()) for b in batches]
    assert len(forwarded) == 24
    assert counted == [sorted((16 + b.lengths).tolist()) for b in batches[2:]]  # the timed rounds' FLOPs
    assert result["ppo"] > 0 and result["ratio"] > 0


def test_matmul_parameters_are_the_models_projections_and_its_tied_head_once():
    model = Qwen2ForCausalLM(Qwen2Config(**mfu_bench.TINY))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # head included once
    assert mfu_bench.matmul_parameters(mfu_bench.TINY) == linear
    shape = mfu_bench.QWEN25_1_5B  # 1.54B parameters, 0.23B of them the embedding
    assert 1.30e9 < mfu_bench.matmul_parameters(shape) - shape["vocab_size"] * shape["hidden_size"] < 1.32e9
    assert mfu_bench.model_flops(shape, [8192]) == 6 * mfu_bench.matmul_parameters(shape) * 8192 + 6 * 28 * 1536 * 8192**2


def test_rollout_bench_profiles_hugging_face_generate():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_bench.py"), "--models", "tiny", "--backends", "hf",
                           "--prompts", "2", "--new-tokens", "4", "--repeats", "1", "--profile"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    shares = [float(line.split("%")[0]) for line in done.stdout.splitlines() if "of the call's host time" in line]
    assert len(shares) == 6 and 0 < sum(shares) <= 100.05 and shares == sorted(shares, reverse=True)


def test_rollout_bench_times_a_trained_checkpoint_on_its_tasks_prompts(tmp_path):
    from support.checkpoints import export_hf_checkpoint
    from support.task import build_tokenizer, make_tiny_model

    tokenizer = build_tokenizer()
    model = make_tiny_model(tokenizer, num_layers=1, seed=0)
    export_hf_checkpoint(model, tokenizer, str(tmp_path / "model"))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_bench.py"), "--checkpoint", str(tmp_path / "model"),
                           "--task-length", "long", "--backends", "hf", "hf-fast", "--prompts", "2", "--new-tokens", "4",
                           "--repeats", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    *_, hf, fast, machine, last = done.stdout.splitlines()
    params = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"  # the checkpoint's model, not --models'
    assert hf.split()[:3] == ["ckpt", params, "hf"] and 1 <= int(hf.split()[6]) <= 8  # 2 responses of 1-4 tokens
    assert fast.split()[:3] == ["ckpt", params, "hf-fast"]
    assert re.fullmatch(r"machine: matmul \d+ GFLOP/s, copy [\d.]+ GB/s; the fast path reaches \d+% of the matmul "
                        r"floor and \d+% of the K/V memory floor", machine), machine
    m = re.fullmatch(r"rollout new_tokens_per_s=(\d+) hf_generate_tokens_per_s=(\d+) speedup=(\S+) floor_fraction=(\S+)", last)
    assert m and float(m[3]) == pytest.approx(int(m[1]) / int(m[2]), abs=0.02) and 0 < float(m[4]) < 1


def test_rollout_floor_counts_the_projections_the_head_and_causal_attention():
    """One row of a 3-token prompt and 2 sampled tokens: 4 positions through the model, the head
    at the 2 sampled ones, and 1 + 2 + 3 + 4 = 10 attended keys."""
    import rollout_bench

    config = Qwen2Config(**mfu_bench.TINY)
    head = config.vocab_size * config.hidden_size
    projections = sum(m.weight.numel() for m in Qwen2ForCausalLM(config).modules()
                      if isinstance(m, torch.nn.Linear)) - head
    expected = 2 * projections * 4 + 2 * head * 2 + 4 * config.num_hidden_layers * config.hidden_size * 10
    assert rollout_bench.call_flops(config, [3], [2]) == expected


def test_rollout_memory_floor_counts_every_key_and_value_read():
    """The same row: its 4 positions read 1 + 2 + 3 + 4 = 10 keys and as many values, in every layer,
    each kv_heads x head_dim fp32 numbers."""
    import rollout_bench

    config = Qwen2Config(**mfu_bench.TINY)
    per_key = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    assert rollout_bench.call_kv_bytes(config, [3], [2]) == config.num_hidden_layers * 2 * per_key * 10


def test_decode_step_bench_times_the_models_own_step_and_an_operator_copy_with_the_same_logits(capsys):
    import decode_step_bench

    results = decode_step_bench.main(["--rows", "3", "--keys", "5", "9", "--repeats", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert [r["keys"] for r in results] == [5, 9]
    for r, line in zip(results, last):
        assert r["difference"] < 1e-5  # the operator copy decodes the same logits as Decoder.step
        assert re.fullmatch(rf"decode keys={r['keys']} hf_ms=[\d.]+ ops_ms=[\d.]+ sdpa_ms=[\d.]+ matmul_ms=[\d.]+ "
                            r"bound_ms=[\d.]+ best_speedup=[\d.]+ kv_read_gb_per_s=[\d.]+", line)
    # pi_SFT's shape: 3 layers of (128 x 256 q/k/v, 128 x 128 o, 128 x 768 gate/up, 384 x 128 down) and the head
    vocab = results[0]["flops"] / (2 * 3) - 3 * (128 * 256 + 128 * 128 + 128 * 768 + 384 * 128)
    assert vocab / 128 == int(vocab / 128) and results[1]["kv_bytes"] == 3 * 3 * 2 * 1 * 64 * 4 * 9


def test_operator_step_refuses_a_model_whose_mlp_is_not_silu():
    import decode_step_bench
    from support.fast_rollout import Decoder
    from support.task import build_tokenizer, make_tiny_model

    model = make_tiny_model(build_tokenizer(), num_layers=1, seed=0).eval()
    model.config.hidden_act = "gelu"
    prompt = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="gelu"):
        decode_step_bench.OperatorStep(model, Decoder(model, prompt, torch.ones_like(prompt), 1))


def test_gpu_smoke_refuses_an_unknown_part_before_running_any():
    """GPU time is scarce: a typo in GPU_SMOKE_PARTS stops the script before part 5, listed first, runs."""
    env = dict(os.environ, GPU_SMOKE_PARTS="5 4b", GPU_SMOKE_DRY_RUN="1", PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_smoke.sh")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert "error: GPU_SMOKE_PARTS: no part 4b (parts are 0-7)" in done.stdout
    assert "== part 5" not in done.stdout and "summary" not in done.stdout


def test_sdpa_shapes_bench_times_new_and_seen_shapes_under_each_backend_set(capsys, monkeypatch):
    """Each backend set warms up on a shape of its own, then runs --shapes (rows, keys) shapes twice
    each (first, again), every one new: distinct within the set and from every other set's and the
    warm-up's. The default set runs under torch's own SDPA settings; "without cuDNN" inside
    sdpa_kernel(flash, efficient, math), which is what SDPA's flags say while its shapes run."""
    import contextlib

    import sdpa_shapes_bench
    from torch.nn.attention import SDPBackend

    def enabled():
        flags = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled(),
                 SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled(),
                 SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled(),
                 SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled()}
        return frozenset(backend for backend, on in flags.items() if on)

    defaults, active, runs = enabled(), [], []
    kernel, attention = sdpa_shapes_bench.sdpa_kernel, sdpa_shapes_bench.decoding_attention

    @contextlib.contextmanager
    def recorded_kernel(backends):
        active.append(tuple(backends))
        try:
            with kernel(backends):
                yield
        finally:
            active.pop()

    def recorded_attention(rows, keys, device, dtype):
        call = attention(rows, keys, device, dtype)
        return lambda: runs.append((active[-1] if active else None, enabled(), rows, keys)) or call()

    monkeypatch.setattr(sdpa_shapes_bench, "sdpa_kernel", recorded_kernel)
    monkeypatch.setattr(sdpa_shapes_bench, "decoding_attention", recorded_attention)
    results = sdpa_shapes_bench.main(["--device", "cpu", "--shapes", "3"])
    assert set(results) == {"default", "without cuDNN"}  # no cuDNN on a CPU
    for r in results.values():
        assert 0 < r["first_ms"] <= r["first_max_ms"] <= r["total_first_ms"] and r["again_ms"] > 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    d, w = results["default"], results["without cuDNN"]
    assert last == (f"sdpa_new_shape first_ms={d['first_ms']:.3f},{w['first_ms']:.3f} "
                    f"again_ms={d['again_ms']:.3f},{w['again_ms']:.3f}")

    without = tuple(sdpa_shapes_bench.BACKENDS["without cuDNN"])
    assert SDPBackend.CUDNN_ATTENTION in defaults and SDPBackend.CUDNN_ATTENTION not in without
    sets = list(dict.fromkeys((applied, flags) for applied, flags, _, _ in runs))
    assert sets == [(None, defaults), (without, frozenset(without))]
    timed = []
    for backend_set in sets:
        shapes = [(rows, keys) for applied, flags, rows, keys in runs if (applied, flags) == backend_set]
        warm_up, first, again = shapes[0], shapes[1::2], shapes[2::2]
        assert len(shapes) == 1 + 2 * 3 and first == again  # each shape timed new, then once more
        assert len(set(first)) == 3 and warm_up not in first
        timed += first
    assert len(set(timed)) == len(timed)  # no set meets a shape another set has met


def test_gpu_smoke_reports_a_skipped_part_as_skipped_not_as_passed():
    """Part 4 without vLLM (the dry run leaves it out, as a GPU machine without vLLM does) runs nothing:
    the summary says so, rather than 'ok' and 'all checks passed' as if vLLM had been checked."""
    env = dict(os.environ, GPU_SMOKE_PARTS="4", GPU_SMOKE_DRY_RUN="1", PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_smoke.sh")], env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("== summary")[1].splitlines()
    assert summary[1].startswith("  part 4: skipped (the dry run leaves vLLM out")
    assert summary[2] == "gpu_smoke: all checks passed, but for the skipped part(s) 4 (dry run on the CPU)"


@pytest.mark.skipif(shutil.which("timeout") is None, reason="gpu_smoke.sh bounds its parts with GNU timeout (Linux)")
def test_gpu_smoke_stops_a_commands_children_at_the_parts_time_limit(tmp_path):
    """A part's command that has started a process of its own (rollout_bench's engine child, the
    graders of train.py) is stopped with it at the limit: the child does not run on under the next
    part (nor hold the script's output open after it ends). Here each bench command is a stand-in
    that starts a long sleep and waits for it; GPU_SMOKE_LIMIT_S makes the limit 3 s."""
    pid_file = tmp_path / "child.pid"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"""#!/usr/bin/env bash
case "$1" in
  bench/*.py) sleep 300 > /dev/null 2>&1 & echo $! > {pid_file}; wait ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    stand_in.chmod(0o755)
    env = dict(os.environ, GPU_SMOKE_PARTS="0", GPU_SMOKE_DRY_RUN="1", GPU_SMOKE_LIMIT_S="3", PYTHON=str(stand_in))
    try:
        done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_smoke.sh")], env=env, capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)  # no terminal, as on the device
        assert "part 0: FAILED (exit 124, over its time limit)" in done.stdout and done.returncode == 1
        time.sleep(0.5)
        child = Path(f"/proc/{pid_file.read_text().strip()}/status")
        assert not child.exists() or "zombie" in child.read_text(), "the command's child outlived the time limit"
    finally:
        if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
            os.kill(int(pid_file.read_text()), 9)
