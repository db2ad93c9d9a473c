"""Shared by the multi-process tests and their torchrun workers: a tiny actor and the launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch

from task import build_tokenizer, make_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["+123+456=\n", "+9=\n", "+1+2+3+4+5+6=\n", "+77+5=\n", "+40+41+42=\n"]


def tiny_actor(seed: int = 0):
    """(tokenizer, tiny Qwen2 with head_dim 64) whose EOS logit is boosted so that some responses
    stop by themselves: both finish reasons occur within a few tokens."""
    tokenizer = build_tokenizer()
    model = make_tiny_model(tokenizer, num_layers=2, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[tokenizer.eos_token_id] *= 8.0  # tied: the head row too
    return tokenizer, model


def run_torchrun(script: str, out_dir: str, *args: str, nproc: int = 2, timeout: int = 240) -> list[dict]:
    """Run tests/dist_workers/<script> on `nproc` CPU ranks (gloo); return each rank's JSON result."""
    with socket.socket() as s:  # a free port: other test runs may hold torchrun's default
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(port),
           os.path.join(REPO, "tests", "dist_workers", script), out_dir, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = []
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def write_result(out_dir: str, rank: int, result: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
