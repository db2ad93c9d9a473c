"""The GPU's decoupled GAE kernel (gae_triton.py), run on CPU tensors by Triton's interpreter in a
process of its own (tests/dist_workers/gae_triton_worker.py), against the CPU's compiled loop: both
carry float64, so they agree to rounding. Triton is not a requirement of this project (CUDA builds
of torch bring it); without it this test skips, and bench/gpu_smoke.sh runs the compiled kernel on
a GPU."""

import pytest

from dist_workers.common import run_torchrun


def test_kernel_in_the_interpreter_equals_the_compiled_loop_and_rejects_what_it_rejects(tmp_path):
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
    r = run_torchrun("gae_triton_worker.py", str(tmp_path), nproc=0)[0]
    assert len(r["equal"]) == 30 and max(r["equal"].values()) <= 1e-6, r["equal"]  # T crosses blocks of 16
    assert r["rejected"] == {"good": False, "nan": True, "hole": True, "half": True,  # None for gae.py to name
                             "lam_above": [True, True], "lam_nan": [True, True], "lam_in_range": False}
    assert r["dispatch_calls"] == 1 and r["dispatch_error"] <= 1e-5
    assert r["bad_input_message"] == "values contains NaN or inf"
    assert r["bad_lambda_message"] == "lam_critic must lie in [0, 1]" and r["dispatch_calls_with_bad_lambda"] == 3
    assert r["bad_single_lambda_message"] == "lam must lie in [0, 1]" and r["dispatch_calls_with_bad_single_lambda"] == 4
