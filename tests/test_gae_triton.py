"""The GPU's decoupled GAE kernel (gae_triton.py), run on CPU tensors by Triton's interpreter,
against the CPU's compiled loop: both carry float64, so they agree to rounding. Triton is not a
requirement of this project (CUDA builds of torch bring it); without it these tests skip, and
bench/gpu_smoke.sh runs the compiled kernel on a GPU."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # chosen before Triton loads
pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")

import gae  # noqa: E402
from test_gae import make_batch  # noqa: E402

gae_triton = gae._triton_kernel()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 16 tokens: a few dozen tokens then cross blocks (the interpreter is slow)."""
    monkeypatch.setattr(gae_triton, "BLOCK", 16)


@pytest.mark.parametrize("length", [1, 16, 37])
@pytest.mark.parametrize("lam_actor", [0.0, 0.95, "per-row"])
def test_kernel_equals_the_compiled_loop(length, lam_actor):
    rewards, values, mask = make_batch(4, length, seed=length)
    lam = torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64) if lam_actor == "per-row" else lam_actor
    want = gae.decoupled_gae(rewards, values, mask, 0.99, lam, 1.0)
    for m in (mask, mask.bool()):
        got = gae_triton.lambda_returns(rewards, values, m, 0.99, lam, 1.0)
        assert all((g - w).abs().max() <= 1e-6 for g, w in zip(got, want))


def test_kernel_rejects_what_the_compiled_loop_rejects():
    """NaN (on padding too), a 0 inside a response, a mask that is not binary: None, for gae.py's
    full check to name the culprit."""
    rewards, values, mask = make_batch(3, 20, seed=1)
    assert gae_triton.lambda_returns(rewards, values, mask, 1.0, 0.9, 1.0) is not None
    nan, holed, half = values.clone(), mask.clone(), mask.clone()
    nan[1, -1] = float("nan")
    holed[0, 0], half[0, -1] = 0.0, 0.5
    assert gae_triton.lambda_returns(rewards, nan, mask, 1.0, 0.9, 1.0) is None
    for bad in (holed, half):
        assert gae_triton.lambda_returns(rewards, values, bad, 1.0, 0.9, 1.0) is None


def test_gae_takes_the_kernel_for_cuda_inputs_and_names_a_bad_input(monkeypatch):
    """The dispatch, with CPU tensors standing in for CUDA ones."""
    cpu_inputs = gae._compiled_loop_applies
    monkeypatch.setattr(gae, "_kernel_applies", cpu_inputs)
    monkeypatch.setattr(gae, "_compiled_loop_applies", lambda *tensors: False)
    rewards, values, mask = make_batch(3, 20, seed=2)
    calls = []
    kernel = gae_triton.lambda_returns
    monkeypatch.setattr(gae_triton, "lambda_returns", lambda *a: calls.append(1) or kernel(*a))
    got = gae.compute_gae(rewards, values, mask, 1.0, 0.9)
    assert calls and (got[0] - gae.gae_reference(rewards, values, mask, 1.0, 0.9)[0]).abs().max() <= 1e-5
    values[0, 0] = float("inf")
    with pytest.raises(ValueError, match="values contains NaN or inf"):
        gae.compute_gae(rewards, values, mask, 1.0, 0.9)
