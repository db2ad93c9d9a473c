"""Tests for gae.py: both CPU-testable fast paths of gae_fast.py (the compiled CPU loop and the
chunked scan) against the definition `gae_reference`, closed forms, Eq. (8), GRPO, input checks.
The GPU's Triton kernel: test_gae_triton.py."""

import pytest
import torch

import gae
from support import gae_fast
from gae import (
    compute_gae,
    decoupled_gae,
    eq8_advantages,
    gae_reference,
    grpo_advantages,
    length_adaptive_lambda,
)

torch.set_num_threads(1)


@pytest.fixture(autouse=True, params=["compiled", "scan"])
def fast_path(request, monkeypatch):
    """Every test runs on both CPU-testable fast paths: the compiled loop that CPU inputs take, and
    the chunked scan that GPU inputs without Triton (and autograd) take, here forced on the CPU."""
    if request.param == "scan":
        monkeypatch.setattr(gae_fast, "compiled_loop_applies", lambda *tensors: False)
    return request.param


def make_batch(batch, length, seed=0, dtype=torch.float32, garbage_padding=True):
    """Right-padded batch with one full row and one empty row: outcome reward +-1 on the last
    token plus small per-token (KL-like) rewards, values in [-1, 1]. With garbage_padding the
    padding holds large values, which must never reach any output."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = length
    if batch > 2:
        lengths[1] = 0
    mask = (torch.arange(length)[None] < lengths[:, None]).to(dtype)
    rewards = 0.01 * torch.randn(batch, length, generator=gen, dtype=dtype)
    rows = torch.nonzero(lengths > 0).squeeze(1)
    rewards[rows, lengths[rows] - 1] += torch.randint(0, 2, (len(rows),), generator=gen).to(dtype) * 2 - 1
    values = torch.rand(batch, length, generator=gen, dtype=dtype) * 2 - 1
    if garbage_padding:
        rewards = torch.where(mask.bool(), rewards, torch.full_like(rewards, 50.0))
        values = torch.where(mask.bool(), values, torch.full_like(values, -70.0))
    else:
        rewards, values = rewards * mask, values * mask
    return rewards, values, mask


# Lengths around the chunk size and past CHUNK**2 (three scan levels), and T = 1.
LENGTHS = [1, 5, gae_fast.CHUNK, gae_fast.CHUNK + 1, 3 * gae_fast.CHUNK - 1, gae_fast.CHUNK**2 + 37]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("gamma", [0.9, 1.0])
@pytest.mark.parametrize("lam", [0.0, 0.5, 0.95, 1.0])
def test_chunked_gae_matches_reference_loop(length, gamma, lam):
    rewards, values, mask = make_batch(6, length, seed=length)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    assert (adv - ref_adv).abs().max() <= 1e-5
    assert (ret - ref_ret).abs().max() <= 1e-5


@pytest.mark.parametrize("length", [1, gae_fast.CHUNK + 3, gae_fast.CHUNK**2 + 5])
def test_per_response_lambda_tensor_matches_reference_and_scalar_rows(length):
    rewards, values, mask = make_batch(5, length, seed=1)
    lam = torch.tensor([0.0, 0.5, 0.9, 0.99, 1.0])
    adv, ret = compute_gae(rewards, values, mask, 0.97, lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, 0.97, lam)
    assert (adv - ref_adv).abs().max() <= 1e-5 and (ret - ref_ret).abs().max() <= 1e-5
    for row in range(5):
        row_adv, _ = compute_gae(rewards[row : row + 1], values[row : row + 1], mask[row : row + 1], 0.97, float(lam[row]))
        assert (adv[row] - row_adv[0]).abs().max() <= 1e-6


def test_long_response_is_exact_in_float32_against_float64_reference():
    # T = 32768 exercises four scan levels; the float64 loop is the ground truth.
    rewards, values, mask = make_batch(2, 32768, seed=3)
    adv, ret = decoupled_gae(rewards, values, mask, 1.0, 0.95, 1.0)
    ref_adv, _ = gae_reference(rewards.double(), values.double(), mask, 1.0, 0.95)
    _, ref_ret = gae_reference(rewards.double(), values.double(), mask, 1.0, 1.0)
    assert (adv.double() - ref_adv).abs().max() <= 1e-5
    assert (ret.double() - ref_ret).abs().max() <= 1e-5


def test_float64_inputs_give_float64_outputs_to_float64_precision():
    rewards, values, mask = make_batch(4, 300, seed=4, dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.9)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, 0.99, 0.9)
    assert adv.dtype == ret.dtype == torch.float64
    assert (adv - ref_adv).abs().max() <= 1e-12 and (ret - ref_ret).abs().max() <= 1e-12


def test_lambda_one_gamma_one_gives_monte_carlo_return():
    rewards, values, mask = make_batch(6, 200, seed=5)
    _, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    clean = rewards * mask
    future_sum = clean.flip(1).cumsum(1).flip(1)  # sum_{l >= t} r_l
    assert (ret - future_sum).abs().max() <= 1e-5


def test_lambda_zero_gives_td_errors():
    rewards, values, mask = make_batch(6, 100, seed=6)
    adv, _ = compute_gae(rewards, values, mask, 0.9, 0.0)
    v = values * mask
    next_v = torch.cat([v[:, 1:], torch.zeros(6, 1)], dim=1)
    delta = (rewards + 0.9 * next_v - v) * mask  # delta_t, V(s_L) = 0
    assert (adv - delta).abs().max() <= 1e-6


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0, torch.rand(6, generator=torch.Generator().manual_seed(0))])
def test_padding_outputs_are_exactly_zero_and_padding_inputs_do_not_leak(lam):
    rewards, values, mask = make_batch(6, 150, seed=7, garbage_padding=True)
    adv, ret = compute_gae(rewards, values, mask, 1.0, lam)
    pad = ~mask.bool()
    assert torch.equal(adv[pad], torch.zeros_like(adv[pad]))
    assert torch.equal(ret[pad], torch.zeros_like(ret[pad]))
    clean_adv, clean_ret = compute_gae(rewards * mask, values * mask, mask, 1.0, lam)
    assert torch.equal(adv, clean_adv) and torch.equal(ret, clean_ret)


def test_decoupled_returns_ignore_lambda_actor_and_advantages_ignore_lambda_critic():
    rewards, values, mask = make_batch(6, 300, seed=8)
    adv_a, ret_a = decoupled_gae(rewards, values, mask, 1.0, lam_actor=0.9, lam_critic=1.0)
    adv_b, ret_b = decoupled_gae(rewards, values, mask, 1.0, lam_actor=0.99, lam_critic=1.0)
    adv_c, ret_c = decoupled_gae(rewards, values, mask, 1.0, lam_actor=0.9, lam_critic=0.5)
    assert torch.equal(ret_a, ret_b) and torch.equal(adv_a, adv_c)
    # ...and each half is plain GAE with its own lambda.
    assert torch.equal(adv_a, compute_gae(rewards, values, mask, 1.0, 0.9)[0])
    assert torch.equal(ret_c, compute_gae(rewards, values, mask, 1.0, 0.5)[1])


def test_decoupled_gae_accepts_per_response_lambda_actor():
    rewards, values, mask = make_batch(6, 120, seed=9)
    lam = length_adaptive_lambda(mask.sum(1), alpha=0.05)
    adv, ret = decoupled_gae(rewards, values, mask, 1.0, lam, 1.0)
    ref_adv, _ = gae_reference(rewards, values, mask, 1.0, lam)
    _, ref_ret = gae_reference(rewards, values, mask, 1.0, 1.0)
    assert (adv - ref_adv).abs().max() <= 1e-5 and (ret - ref_ret).abs().max() <= 1e-5


@pytest.mark.parametrize("gamma", [0.8, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equation_8_identity_holds_for_any_values_rewards_and_lambda(gamma, seed):
    # Arbitrary values V' (not a trained critic), dense rewards, random lambdas: Eq. (8) is an
    # algebraic identity, so it must match GAE to float64 precision.
    gen = torch.Generator().manual_seed(seed)
    rewards, values, mask = make_batch(4, 40, seed=seed, dtype=torch.float64, garbage_padding=False)
    rewards = torch.randn(4, 40, generator=gen, dtype=torch.float64) * mask
    values = 3 * torch.randn(4, 40, generator=gen, dtype=torch.float64) * mask
    lam = float(torch.rand(1, generator=gen))
    expected, _ = gae_reference(rewards, values, mask, gamma, lam)
    assert (eq8_advantages(rewards, values, mask, gamma, lam) - expected).abs().max() <= 1e-10
    lam_rows = torch.rand(4, generator=gen, dtype=torch.float64)
    expected_rows, _ = gae_reference(rewards, values, mask, gamma, lam_rows)
    assert (eq8_advantages(rewards, values, mask, gamma, lam_rows) - expected_rows).abs().max() <= 1e-10


def test_nstep_return_bootstraps_from_value_and_stops_at_the_end():
    r, v = [1.0, 2.0, 3.0], [10.0, 20.0, 30.0]
    assert gae.nstep_return(r, v, 0, 1, 0.5) == 1.0 + 0.5 * 20.0
    assert gae.nstep_return(r, v, 1, 2, 0.5) == 2.0 + 0.5 * 3.0  # V(s_3) = 0: terminal


def test_length_adaptive_lambda_follows_vapo_formula_and_clamps():
    lam = length_adaptive_lambda(torch.tensor([0, 10, 20, 100, 10_000]), alpha=0.05)
    expected = torch.tensor([0.0, 0.0, 0.0, 0.8, 1 - 1 / 500])
    assert torch.allclose(lam, expected) and lam.dtype == torch.float32


def test_grpo_advantages_are_group_normalised_and_zero_on_padding():
    scores = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    _, _, mask = make_batch(8, 12, seed=10)
    adv = grpo_advantages(scores, mask, group_size=4)
    group = scores[:4]
    expected_first = (group - group.mean()) / (group.std() + 1e-6)
    valid_rows = mask[:4].sum(1) > 0
    assert torch.allclose(adv[:4, 0][valid_rows], expected_first[valid_rows])
    assert torch.equal(adv[4:], torch.zeros_like(adv[4:]))  # all-equal group: no signal
    assert torch.equal(adv[~mask.bool()], torch.zeros_like(adv[~mask.bool()]))
    assert torch.allclose(adv * mask, adv[:, :1] * mask)  # one value per response


def _good():
    return make_batch(3, 10, seed=11)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda r, v, m: (r[:, :5], v, m), "rewards has shape"),
        (lambda r, v, m: (r, v[:2], m), "values has shape"),
        (lambda r, v, m: (r, v, m * 0.5), "mask must be binary"),
        (lambda r, v, m: (r, v, m + 1), "mask must be binary"),
        (lambda r, v, m: (r, v, m.flip(1)), "right-padded"),
        (lambda r, v, m: (r, v, m.index_put((torch.tensor([0]), torch.tensor([4])), torch.tensor(0.0))), "right-padded"),
        (lambda r, v, m: (r, v, torch.full_like(m, float("nan"))), "mask must be binary"),
        (lambda r, v, m: (r.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"))), v, m), "rewards contains NaN"),
        (lambda r, v, m: (r, v.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("inf"))), m), "values contains NaN"),
        (lambda r, v, m: (r, v.index_put((torch.tensor([1]), torch.tensor([9])), torch.tensor(float("-inf"))), m), "values contains NaN"),
        (lambda r, v, m: (r.long(), v, m), "rewards must be a floating-point"),
        (lambda r, v, m: (r, v, m[0]), "mask must be a 2-D"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(mutate, match):
    rewards, values, mask = mutate(*_good())
    with pytest.raises(ValueError, match=match):
        decoupled_gae(rewards, values, mask)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gamma": 1.5}, "gamma"),
        ({"lam_actor": -0.1}, "lam_actor"),
        ({"lam_critic": float("nan")}, "lam_critic"),
        ({"lam_actor": torch.tensor([0.9, 0.9])}, "lam_actor tensor"),
        ({"lam_actor": torch.tensor([0.9, 1.2, 0.9])}, "lam_actor must lie"),
        ({"lam_actor": torch.tensor([0.9, float("nan"), 0.9])}, "lam_actor must lie"),  # NaN is not in [0, 1]
        # Not numbers: a TypeError from a comparison before.
        ({"gamma": None}, "gamma must be a number"),
        ({"lam_actor": [0.9, 0.9, 0.9]}, "lam_actor must be a number in \\[0, 1\\] or a float tensor \\[3\\]"),
    ],
)
def test_bad_hyperparameters_raise_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decoupled_gae(*_good(), **kwargs)


def test_bool_mask_and_empty_batch_are_accepted():
    rewards, values, mask = _good()
    assert torch.equal(compute_gae(rewards, values, mask.bool())[0], compute_gae(rewards, values, mask)[0])
    adv, ret = decoupled_gae(torch.zeros(0, 7), torch.zeros(0, 7), torch.zeros(0, 7))
    assert adv.shape == ret.shape == (0, 7)
    adv, ret = decoupled_gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert adv.shape == ret.shape == (2, 0)


def test_grpo_and_length_lambda_reject_bad_input():
    mask = torch.ones(6, 3)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(6), mask, group_size=4)
    with pytest.raises(ValueError, match="group_size=2.0"):  # a float: an error inside view() before
        grpo_advantages(torch.zeros(6), mask, group_size=2.0)
    with pytest.raises(ValueError, match="outcomes contains NaN"):
        grpo_advantages(torch.tensor([0.0, float("nan"), 1.0, 1.0, 0.0, 0.0]), mask, group_size=2)
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(torch.tensor([10]), alpha=0.0)
    with pytest.raises(ValueError, match="lengths"):
        length_adaptive_lambda(torch.tensor([-1]))
    with pytest.raises(ValueError, match="lengths"):  # not NaN lambdas, caught later under lam_actor's name
        length_adaptive_lambda(torch.tensor([10.0, float("nan")]))


def test_gae_is_differentiable_in_values_even_after_an_inference_mode_call():
    rewards, values, mask = make_batch(3, 40, seed=12, dtype=torch.float64, garbage_padding=False)
    gae_fast._cached_scan_matrices.cache_clear()
    with torch.inference_mode():  # fills the matrix cache with this call's chunk matrices
        decoupled_gae(rewards, values, mask, 0.9, 0.8, 1.0)
    values = values.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: decoupled_gae(rewards, v, mask, 0.9, 0.8, 1.0), (values,))


@pytest.mark.parametrize("lam_critic", [0.95, torch.tensor([1.0, 0.9, 0.5], dtype=torch.float64)])
def test_decoupled_gae_is_differentiable_when_the_critics_lambda_bootstraps(lam_critic):
    """lam_critic < 1 (plain PPO's 0.95, or per-response lambdas) adds V(s_{t+1}) to the critic's
    scan input: autograd then tracks that buffer, and the actor's scan must not write over it."""
    rewards, values, mask = make_batch(3, 40, seed=13, dtype=torch.float64, garbage_padding=False)
    values = values.clone().requires_grad_(True)
    for output in (0, 1):  # advantages, then returns
        assert torch.autograd.gradcheck(lambda v: decoupled_gae(rewards, v, mask, 0.9, 0.8, lam_critic)[output], (values,))
    got = decoupled_gae(rewards, values, mask, 0.9, 0.8, lam_critic)  # and GAE's numbers
    expected = [gae_reference(rewards, values.detach(), mask, 0.9, lam) for lam in (0.8, lam_critic)]
    torch.testing.assert_close(got[0].detach(), expected[0][0])
    torch.testing.assert_close(got[1].detach(), expected[1][1])


def test_cpu_inputs_take_the_compiled_loop_and_others_the_scan(fast_path):
    rewards, values, mask = _good()
    if fast_path == "scan":
        pytest.skip("about the dispatch itself")
    assert gae_fast.compiled_loop_applies(rewards, values, mask)
    assert gae_fast.compiled_loop_applies(rewards.double(), values.double(), mask.bool())
    assert not gae_fast.compiled_loop_applies(rewards.bfloat16(), values.bfloat16(), mask)
    assert not gae_fast.compiled_loop_applies(rewards, values.double(), mask)
    assert not gae_fast.compiled_loop_applies(rewards, values.requires_grad_(True), mask)
    with torch.no_grad():
        assert gae_fast.compiled_loop_applies(rewards, values, mask)


def test_strided_views_and_odd_dtypes_give_the_contiguous_answer():
    rewards, values, mask = make_batch(6, 40, seed=13)
    expected = decoupled_gae(rewards, values, mask, 0.99, 0.9, 1.0)
    wide = [torch.stack([x, x], dim=2)[:, :, 1] for x in (rewards, values, mask)]  # stride 2 along T
    assert not wide[0].is_contiguous()
    strided = decoupled_gae(*wide, 0.99, 0.9, 1.0)
    assert torch.equal(strided[0], expected[0]) and torch.equal(strided[1], expected[1])
    integer_mask = decoupled_gae(rewards, values, mask.long(), 0.99, 0.9, 1.0)  # the scan, on any path
    assert all((got - want).abs().max() <= 1e-6 for got, want in zip(integer_mask, expected))
    low = decoupled_gae(rewards.bfloat16(), values.bfloat16(), mask.bfloat16(), 0.99, 0.9, 1.0)
    ref = decoupled_gae(rewards.bfloat16().float(), values.bfloat16().float(), mask, 0.99, 0.9, 1.0)
    assert low[0].dtype == torch.bfloat16 and (low[0].float() - ref[0]).abs().max() <= 0.1


@pytest.mark.parametrize("bad", [0.99999994, 1e-30, 1e-40])
def test_a_nearly_binary_mask_is_rejected_like_any_other(bad):
    # sum(m) = sum(m^2) cannot tell these from 0/1 once a row holds a few ones: rounding or underflow.
    rewards, values, _ = _good()
    mask = torch.tensor([[1, 1, bad, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, bad, 0, 0, 0], [1.0] * 10])
    for row in (mask[:1], mask[1:2]):
        with pytest.raises(ValueError, match="mask must be binary"):
            decoupled_gae(rewards[:1], values[:1], row)


def test_without_a_writable_cache_the_loop_is_compiled_per_process(monkeypatch):
    njit = gae_fast.numba.njit

    def no_cache_dir(*args, cache=False, **options):
        if cache:
            raise RuntimeError("cannot cache function 'f': no locator available for file 'gae.py'")
        return njit(*args, **options)

    monkeypatch.setattr(gae_fast.numba, "njit", no_cache_dir)
    loop = gae_fast._compile(gae_fast._lambda_returns_loop.py_func)
    rewards, values, mask = make_batch(4, 30, seed=14)
    advantages, returns = torch.empty_like(values), torch.empty_like(values)
    lams = [torch.full((4,), lam, dtype=torch.float64).numpy() for lam in (0.9, 1.0)]
    assert loop(rewards.numpy(), values.numpy(), mask.numpy(), 1.0, *lams, advantages.numpy(), returns.numpy())
    assert (advantages - gae_reference(rewards, values, mask, 1.0, 0.9)[0]).abs().max() <= 1e-5
    assert (returns - gae_reference(rewards, values, mask, 1.0, 1.0)[1]).abs().max() <= 1e-5


@pytest.mark.parametrize("fast_path", ["compiled"])  # once: the fresh process below takes the compiled loop
def test_the_compiled_loop_leaves_torchs_thread_count_alone(fast_path):
    """numba's OpenMP layer shares torch's libgomp: its first parallel call used to set every core as
    the process's OpenMP thread count, so torch ignored --threads from the first GAE on. In a fresh
    process, since that first call happens once per process; with NUMBA_NUM_THREADS=2 there, so that
    numba's pool has two threads to impose even on a one-core machine (the test can fail anywhere)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch; torch.set_num_threads(1); import gae; "
            "x = torch.randn(512, 4096); (x + x).sum(); "  # torch's OpenMP team exists, as in a PPO step
            "gae.decoupled_gae(torch.zeros(4, 9), torch.zeros(4, 9), torch.ones(4, 9), 1.0, 0.95, 1.0); "
            "print(torch.get_num_threads())")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"
