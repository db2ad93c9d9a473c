"""Shared by the multi-process tests and their torchrun workers: a tiny actor and the launcher."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import torch

from support.task import build_tokenizer, make_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Rows 0-2 go to rank 0 and rows 3-4 to rank 1; the prompts ending in "7" stop at once (see below).
PROMPTS = ["+123+456=\n", "+17+7", "+1+2+3+4+5+6=\n", "+77+5=\n", "+40+47"]


def full_disk(*args, **kwargs):
    """A write that fails as on a full disk (patched over a writer by the fault tests)."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_disk_safetensors(*args, **kwargs):
    """safetensors' `save_file` on a full disk: its error is no OSError, only a message."""
    from safetensors import SafetensorError

    raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} (os error {errno.ENOSPC})")


def tiny_actor(seed: int = 0):
    """(tokenizer, tiny 2-layer Qwen2 with head_dim 64) that stops deterministically after a "7".

    The embedding is tied to the head, so EOS's row set to 2 x the row of "7" makes EOS the
    greedy choice right after a "7" (the hidden state there is mostly that embedding): greedy
    runs then end both ways, by EOS and by length, whatever the random initialisation."""
    tokenizer = build_tokenizer()
    model = make_tiny_model(tokenizer, num_layers=2, seed=seed)
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        embedding[tokenizer.eos_token_id] = 2.0 * embedding[tokenizer.convert_tokens_to_ids("7")]
    return tokenizer, model


def run_torchrun(script: str, out_dir: str, *args: str, nproc: int = 2, timeout: int = 240) -> list[dict]:
    """Run tests/dist_workers/<script> (or a script at an absolute path) on `nproc` CPU ranks (gloo);
    return each rank's JSON result (rank<r>.json in out_dir).

    nproc=0 runs it as one plain process without torchrun (the ordinary single-process path).
    Workers always run in a child process: vLLM changes process-wide state (thread binding,
    `torch.set_num_threads`) that must not leak into the other tests.
    """
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for attempt in range(2):
        with socket.socket() as s:  # a free port: other test runs may hold torchrun's default
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                    "--master_addr", "127.0.0.1", "--master_port", str(port)] if nproc else []
        cmd = [sys.executable, *launcher, os.path.join(REPO, "tests", "dist_workers", script), out_dir, *args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        # A rank that ran gloo collectives can abort at exit (std::terminate: see
        # fsdp_utils.exit_now_if_gloo, which the workers call, but which cannot help after vLLM ran).
        # About 1 run in 30 on the loaded 2-core machine: run once more, and say so.
        if attempt == 0 and proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
            print(f"{script}: a rank aborted in C++ (std::terminate); running it once more", file=sys.stderr)
            continue
        break
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = []
    for rank in range(max(nproc, 1)):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def write_result(out_dir: str, rank: int, result: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


# The outcome reward model's training data in the torchrun test: 4 prompts of 4 tokens with
# responses of 1-8 tokens, labelled +-1.
ORM_LABELS = torch.tensor([1.0, -1.0, -1.0, 1.0])


def orm_batch(rows: list[int]):
    """Rows of the ORM test batch as a RolloutBatch (the worker takes its rank's, the test all)."""
    from rollout import RolloutBatch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 70, (4, 12), generator=g)
    response_mask = (torch.arange(8) < torch.tensor([5, 1, 8, 3])[:, None]).float()[rows]
    return RolloutBatch(prompt_ids=ids[rows, :4], prompt_mask=torch.ones(len(rows), 4, dtype=torch.long),
                        response_ids=ids[rows, 4:] * response_mask.long(), response_mask=response_mask,
                        logprobs=torch.zeros(len(rows), 8), finish_reasons=["stop"] * len(rows))
