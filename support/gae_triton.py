"""Decoupled GAE on the GPU as one Triton kernel (paper §3.3, Eq. 5): `gae.py`'s fast path for
CUDA inputs when Triton is installed (it comes with CUDA builds of torch; not a requirement).

The same recursion as the CPU's compiled loop, in float64, for both lambdas in one pass:
    R_t = r_t + gamma (1 - lam) V(s_{t+1}) + gamma lam R_{t+1},     A_t = R_t(lam_actor) - V(s_t),
with R = 0 on padding. One program per response walks it from right to left in blocks of
BLOCK tokens; inside a block, read from its last token to its first, the recursion
y_t = x_t + d y_{t+1} is a forward associative scan over the affine maps y -> x_t + d y (composed
as functions), and the value at the first token of the block to the right is carried in. The kernel checks its inputs as it
reads them (finite rewards and values; a mask of ones then zeros; a per-response lambda in
[0, 1]) and flags a bad row, so that a call costs one launch and one synchronisation, not a chain
of small checking kernels.
"""

import struct

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per step of a program: 8 steps at T = 8192


@triton.jit
def _compose(d_later, x_later, d_earlier, x_earlier):
    # The scan runs right to left (later tokens first): y -> x_earlier + d_earlier (x_later + d_later y)
    return d_later * d_earlier, x_earlier + d_earlier * x_later


@triton.jit
def _lambda_returns_kernel(rewards, values, mask, advantages, returns, ok, length,
                           gamma_bits, lam_actor_bits, lam_critic_bits, lam_actor_ptr, lam_critic_ptr,
                           PER_ROW_ACTOR: tl.constexpr, PER_ROW_CRITIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    # Python floats would arrive as float32: they come as the bits of their float64 instead.
    gamma = gamma_bits.to(tl.int64).to(tl.float64, bitcast=True)
    bad = row * 0
    if PER_ROW_ACTOR:
        lam_actor = tl.load(lam_actor_ptr + row)
        bad += (~((lam_actor >= 0.0) & (lam_actor <= 1.0))).to(tl.int32)  # NaN is outside too
    else:
        lam_actor = lam_actor_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if PER_ROW_CRITIC:
        lam_critic = tl.load(lam_critic_ptr + row)
        bad += (~((lam_critic >= 0.0) & (lam_critic <= 1.0))).to(tl.int32)
    else:
        lam_critic = lam_critic_bits.to(tl.int64).to(tl.float64, bitcast=True)
    decay_actor, decay_critic = gamma * lam_actor, gamma * lam_critic
    bootstrap_actor, bootstrap_critic = gamma - decay_actor, gamma - decay_critic  # gamma (1 - lam)
    start = row.to(tl.int64) * length
    r_row, v_row, m_row = rewards + start, values + start, mask + start
    offsets = tl.arange(0, BLOCK)
    carry_actor = gamma * 0.0  # R at the first token of the block to the right (0 past T)
    carry_critic = gamma * 0.0
    n_blocks = tl.cdiv(length, BLOCK)
    for k in range(n_blocks):  # blocks from the last; inside each, tokens from its last (a forward scan)
        t = (n_blocks - k) * BLOCK - 1 - offsets
        inside, next_inside = t < length, t + 1 < length
        r = tl.load(r_row + t, mask=inside, other=0.0).to(tl.float64)
        v = tl.load(v_row + t, mask=inside, other=0.0).to(tl.float64)
        m = tl.load(m_row + t, mask=inside, other=0).to(tl.float64)
        # V(s_{t+1}) where token t+1 is valid, else 0: padding values never leak in (verl PR #50)
        v_next = tl.load(v_row + t + 1, mask=next_inside, other=0.0).to(tl.float64)
        m_next = tl.load(m_row + t + 1, mask=next_inside, other=0).to(tl.float64)
        # binary, ones then zeros (m_t >= m_{t+1}), finite: x * 0 is NaN iff x is NaN or inf
        rejected = ((m != 0) & (m != 1)) | (m_next > m) | ((r * 0.0 + v * 0.0) != 0.0)
        bad += tl.sum(rejected.to(tl.int32), axis=0)
        v_next = tl.where(m_next == 1, v_next, 0.0)
        ones = tl.full((BLOCK,), 1.0, tl.float64)
        x_actor = tl.where(m == 1, r + bootstrap_actor * v_next, 0.0)
        x_critic = tl.where(m == 1, r + bootstrap_critic * v_next, 0.0)
        # within the block: y_t = X_t + D_t y_next, D_t = d^(tokens to the block's end)
        d_actor, y_actor = tl.associative_scan((ones * decay_actor, x_actor), 0, _compose)
        d_critic, y_critic = tl.associative_scan((ones * decay_critic, x_critic), 0, _compose)
        y_actor = tl.where(m == 1, y_actor + d_actor * carry_actor, 0.0)
        y_critic = tl.where(m == 1, y_critic + d_critic * carry_critic, 0.0)
        tl.store(advantages + start + t, tl.where(m == 1, y_actor - v, 0.0), mask=inside)
        tl.store(returns + start + t, y_critic, mask=inside)
        first = offsets == BLOCK - 1  # the block's first token
        carry_actor = tl.sum(tl.where(first, y_actor, 0.0), axis=0)
        carry_critic = tl.sum(tl.where(first, y_critic, 0.0), axis=0)
    tl.store(ok + row, bad == 0)


def lambda_returns(rewards, values, mask, gamma, lam_actor, lam_critic):
    """(advantages A(lam_actor), returns R(lam_critic)), [B, T] in the values' dtype and 0 on
    padding; None when an input is bad (NaN/inf, or a mask that is not ones-then-zeros), for the
    caller's full check to name it; likewise a per-response lambda outside [0, 1]. lam_*: float, or
    a float64 tensor [B] on the inputs' device.
    Inputs: one float dtype, on one device (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    batch, length = values.shape
    rewards, values = rewards.contiguous(), values.contiguous()
    mask = (mask.view(torch.uint8) if mask.dtype == torch.bool else mask).contiguous()
    advantages, returns = torch.empty_like(values), torch.empty_like(values)
    if batch == 0 or length == 0:
        return advantages, returns
    ok = torch.empty(batch, dtype=torch.bool, device=values.device)
    bits = lambda x: struct.unpack("<q", struct.pack("<d", float(x)))[0]  # noqa: E731
    per_row = [isinstance(lam, torch.Tensor) for lam in (lam_actor, lam_critic)]
    _lambda_returns_kernel[(batch,)](
        rewards, values, mask, advantages, returns, ok, length, bits(gamma),
        *(0 if tensor else bits(lam) for lam, tensor in zip((lam_actor, lam_critic), per_row)),
        *(lam if tensor else ok for lam, tensor in zip((lam_actor, lam_critic), per_row)),  # ok: never read
        PER_ROW_ACTOR=per_row[0], PER_ROW_CRITIC=per_row[1], BLOCK=min(BLOCK, triton.next_power_of_2(length)),
    )
    return (advantages, returns) if bool(ok.all()) else None
