"""The fast paths of gae.py's `compute_gae` and `decoupled_gae`: the same numbers as the
definition `gae.gae_reference` (GAE, Eq. 5), checked against it and against Eq. (8) in
tests/test_gae.py, with no Python loop over tokens.

Both compute R_t of Eq. (5) as the recursive lambda-return (GAE's sum of deltas, summed by parts)
    R_t = r_t + gamma (1 - lam) V(s_{t+1}) + gamma lam R_{t+1},     A_t = R_t - V(s_t),
which is the same number without the deltas' telescoping cancellation (at lam = 1 it is the
plain reward sum, so error does not grow with T).
- CPU: that recursion as a loop compiled by numba, one pass that reads each input once, checks
  it as it goes, and carries both lambdas in float64, its rows spread over torch's threads (the memory
  bound is the goal here);
- GPU: the same recursion as one Triton kernel (`gae_triton.py`), which checks its inputs as it
  reads them: one launch;
- GPU without Triton, or when autograd needs a graph: a chunked scan of matrix products (a few
  batched matmuls instead of T dependent steps).
"""

import functools

import numba
import numpy as np
import torch
import torch.nn.functional as F

from support.masked import check_lambda_range, check_masked_inputs

# numba's default OpenMP layer shares torch's libgomp, and its first parallel call sets the process's
# OpenMP thread count to every core (omp_set_num_threads): every later torch op would run on that
# many threads whatever --threads says (two runs side by side on two cores: four busy threads).
# Its own work queue leaves torch's setting alone; compiled_gae uses torch's count.
numba.config.THREADING_LAYER = "workqueue"

# Tokens per chunk of the scan: the work is B*T*CHUNK multiply-adds (dense triangular matrices)
# over log_CHUNK(T) levels of recursion. 16 was the fastest on the 2-core development CPU at
# T = 8k-32k (bench/gae_bench.py --chunk); untuned on GPUs, which may prefer a larger one.
CHUNK = 16


# --- CPU: the recursion, compiled, rows in parallel (bench/gae_bench.py: near the copy bound) --


def compiled_loop_applies(rewards, values, mask, device_type="cpu"):
    """Tensors on `device_type` of one float32/float64 dtype that autograd does not need to track."""
    dtype = values.dtype
    return (
        all(x.device.type == device_type for x in (rewards, values, mask))
        and dtype in (torch.float32, torch.float64)
        and rewards.dtype == dtype
        and mask.dtype in (torch.bool, dtype)
        and not (torch.is_grad_enabled() and (rewards.requires_grad or values.requires_grad))
    )


def compiled_gae(rewards, values, mask, gamma, lam_actor, lam_critic):
    """Run _lambda_returns_loop; on a bad input the full check names the argument."""
    advantages, returns = (torch.empty(values.shape, dtype=values.dtype) for _ in range(2))  # contiguous
    lams = [np.full(mask.shape[0], lam) if isinstance(lam, float) else lam.cpu().numpy() for lam in (lam_actor, lam_critic)]
    inputs = [x.detach().numpy() for x in (rewards, values, mask)]
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if not _lambda_returns_loop(*inputs, float(gamma), *lams, advantages.numpy(), returns.numpy()):
        _reject(rewards, values, mask)
    return advantages, returns


def _reject(rewards, values, mask, **lambdas):
    """After a fast path flagged a bad input: the full check names the culprit."""
    for name, lam in lambdas.items():
        if isinstance(lam, torch.Tensor):
            check_lambda_range(lam, name)
    check_masked_inputs(mask, right_padded=True, rewards=rewards, values=values)
    raise ValueError("rewards/values hold NaN or inf, mask is not ones-then-zeros in every row, "
                     "or a lambda is outside [0, 1]")


def _compile(fn, parallel=False):
    """numba.njit with fused multiply-adds, cached on disk where numba finds a writable place (next
    to this file, else ~/.cache); with none (a read-only install and home), compiled per process.
    parallel: prange loops run on numba's threads (as many as torch uses: compiled_gae)."""
    options = {"nogil": True, "fastmath": {"contract"}, "parallel": parallel}
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(**options)(fn)


@_compile
def _lambda_returns_row(r_row, v_row, m_row, gamma, lam_actor, lam_critic, adv_row, ret_row):
    """Right to left over one response: R_t for lam_actor and lam_critic in float64 (Eq. 5 by
    parts), A_t = R_t(lam_actor) - V(s_t), both 0 on padding. Returns False, leaving the outputs
    partly written, on a NaN/inf input or a mask row that is not ones-then-zeros."""
    decay_actor, decay_critic = gamma * lam_actor, gamma * lam_critic
    bootstrap_actor, bootstrap_critic = gamma - decay_actor, gamma - decay_critic  # gamma (1 - lam)
    ret_actor = ret_critic = next_value = 0.0  # V(s_L) = 0 after the last token
    in_response = False
    nonfinite = 0.0  # x * 0 is NaN iff x is NaN or inf: a running sum checks without a branch
    for t in range(r_row.shape[0] - 1, -1, -1):
        r, v, m = r_row[t], v_row[t], m_row[t]
        nonfinite += r * 0.0 + v * 0.0
        if m == 1:  # R_t = r_t + gamma (1 - lam) V(s_{t+1}) + gamma lam R_{t+1}
            ret_actor = r + bootstrap_actor * next_value + decay_actor * ret_actor
            ret_critic = r + bootstrap_critic * next_value + decay_critic * ret_critic
            adv_row[t] = ret_actor - v
            ret_row[t] = ret_critic
            next_value = v
            in_response = True
        elif m == 0 and not in_response:  # padding: its values reach no output (verl PR #50)
            adv_row[t] = 0.0
            ret_row[t] = 0.0
        else:  # not 0/1, or a 0 inside the response
            return False
    return nonfinite == 0.0


@functools.partial(_compile, parallel=True)
def _lambda_returns_loop(rewards, values, mask, gamma, lam_actor, lam_critic, advantages, returns):
    """_lambda_returns_row for every row, the rows spread over numba's threads (each row is one
    sequential recursion, computed as in a plain loop: threads change no bit of the result).
    Returns False if any row was rejected."""
    ok = np.empty(rewards.shape[0], dtype=np.bool_)
    for b in numba.prange(rewards.shape[0]):
        ok[b] = _lambda_returns_row(rewards[b], values[b], mask[b], gamma, lam_actor[b], lam_critic[b],
                                    advantages[b], returns[b])
    return ok.all()


# --- GPU: the same recursion as one Triton kernel (gae_triton.py), where Triton is installed ------


@functools.lru_cache(maxsize=1)
def triton_kernel():
    """The gae_triton module, or None without Triton (CPU builds of torch do not bring it)."""
    try:
        from support import gae_triton
    except ImportError:
        return None
    return gae_triton


def kernel_applies(rewards, values, mask):
    return compiled_loop_applies(rewards, values, mask, "cuda") and triton_kernel() is not None


def kernel_gae(rewards, values, mask, gamma, lam_actor, lam_critic, names=("lam_actor", "lam_critic")):
    """gae_triton.lambda_returns; on a bad input (per-response lambdas included: the kernel checks
    their range) the full check names the argument (the lambdas by `names`, the caller's)."""
    lams = [lam if isinstance(lam, float) else lam.to(values.device) for lam in (lam_actor, lam_critic)]
    result = triton_kernel().lambda_returns(rewards.detach(), values.detach(), mask, gamma, *lams)
    if result is None:
        _reject(rewards, values, mask, **dict(zip(names, lams)))
    return result


# --- GPU without Triton, and autograd: the recursion as a chunked scan ------------------------------


def lambda_return(x, values, mask, gamma, lam):
    """R_t = x_t + gamma lam R_{t+1}, where x holds r * mask on entry and gets, in place,
    x_t += gamma (1 - lam) V(s_{t+1}) wherever token t+1 is valid: V(s_{t+1}) is never read on
    padding, so padding values never leak in (verl PR #50). lam: float or [B] tensor."""
    bootstrap = gamma * (1 - lam)
    if isinstance(bootstrap, torch.Tensor):
        x[:, :-1].addcmul_(values[:, 1:] * bootstrap.to(x).unsqueeze(1), mask[:, 1:])
    elif bootstrap != 0:
        x[:, :-1].addcmul_(values[:, 1:], mask[:, 1:], value=bootstrap)
    return _reverse_discounted_sum(x, gamma * lam)


def _scan_matrices(decay, size, like):
    """powers [size+1] (or [B, size+1]) with powers[k] = decay^k, and the chunk matrix
    tri[j, i] = decay^(j-i) for j >= i, else 0 ([size, size] or [B, size, size]).

    Powers come from float64 pow (0^0 = 1, no cumprod error growth), rounded once to like's
    dtype. Powers below the smallest normal float (1.2e-38 in float32) are flushed to 0: a token
    that far away weighs nothing at float32 precision, and subnormals slow CPU matrix products
    down by orders of magnitude."""
    if not isinstance(decay, torch.Tensor):
        return _cached_scan_matrices(decay, size, like.dtype, like.device)
    k = torch.arange(size + 1, dtype=torch.float64, device=like.device)
    powers = torch.pow(decay.to(like.device, torch.float64).unsqueeze(-1), k).to(like.dtype)
    powers = torch.where(powers < torch.finfo(like.dtype).tiny, torch.zeros_like(powers), powers)
    j = torch.arange(size, device=like.device)
    offset = j[:, None] - j[None, :]  # j - i
    return powers, powers[..., offset.clamp(min=0)] * (offset >= 0)


@functools.lru_cache(maxsize=64)
def _cached_scan_matrices(decay, size, dtype, device):
    # A scalar decay gives the same small matrices on every call; building them costs more than
    # using them at the upper levels of the scan. Built as normal tensors even under
    # inference_mode, so that a later differentiable call can save them for backward.
    with torch.inference_mode(False):
        return _scan_matrices(torch.tensor(decay, dtype=torch.float64), size, torch.empty(0, dtype=dtype, device=device))


def _reverse_discounted_sum(x, decay):
    """y_t = sum_{j>=t} decay^(j-t) x_j along dim 1 (GAE's A_t with decay = gamma lam), y = 0 past T.

    Chunked scan: split T into chunks of C; inside a chunk y = x @ M with M[j, i] = decay^(j-i)
    for j >= i (one batched matrix product for all chunks). Each chunk then needs the full y at
    the first token of the next chunk, y_next, added as decay^(C-i) y_next. Those chunk heads obey
    the same recursion one level up (a_k = local_k + decay^C a_{k+1}), so they come from this
    function on [B, T/C] with decay^C: depth log_C(T), no loop over tokens or chunks."""
    batch, length = x.shape
    if length == 0:
        return x.clone()
    n_chunks = -(-length // CHUNK)
    size = CHUNK if n_chunks > 1 else length  # one short chunk when T <= CHUNK
    powers, tri = _scan_matrices(decay, size, x)
    pad = n_chunks * size - length
    chunks = (F.pad(x, (0, pad)) if pad else x).view(batch, n_chunks, size)
    local = chunks @ tri  # [B, n_chunks, size]: sums within each chunk
    if n_chunks > 1:
        heads = _reverse_discounted_sum(local[:, :, 0], decay**size)  # full y at each chunk start
        carry = F.pad(heads[:, 1:], (0, 1))  # y at the start of the next chunk; 0 after the last
        tail = powers[..., 1:].flip(-1)  # decay^(size - i), i = 0..size-1
        local.addcmul_(carry.unsqueeze(-1), tail.unsqueeze(-2))
    return local.view(batch, -1)[:, :length].contiguous() if pad else local.view(batch, length)
