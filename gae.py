"""Generalised advantage estimation and decoupled GAE (paper §3.3, Eq. 5 and 8).

Tensors are [B, T], right-padded; mask = 1 on every generated token (README "Tensor layout").
rewards[b, t] holds the outcome on the last token t = L_b - 1 (plus any per-token term), values[b, t]
is V(s_t), and the state after the last token is terminal:

GAE      delta_t = r_t + gamma V(s_{t+1}) - V(s_t)           V(s_L) = 0 after the last token
         A_t     = sum_{l=0}^{L-t-1} (gamma lam)^l delta_{t+l}
Eq. (5)  R_t     = A_t + V(s_t)                               (the critic's target; lam = 1: the return)
Eq. (8)  A_t     = (1-lam) sum_{h=1}^{L-t-1} lam^(h-1) G_{t:t+h} + lam^(L-t-1) G_{t:L} - V(s_t)
         with the n-step return G_{t:t+h} = sum_{l<h} gamma^l r_{t+l} + gamma^h V(s_{t+h}).

Decoupled GAE (VC-PPO): the same rewards and values give the actor's advantages with
lam_actor < 1 and the critic's targets with lam_critic = 1, whose targets then carry the
undecayed outcome reward (at lam < 1 it reaches token t only as lam^(L-1-t) r).

Eq. (8) is an identity: it holds for any V, which `eq8_advantages` shows numerically. The paper
reads it as "a critic trained with another lambda adds no bias"; the -V(s_t) term indeed adds
none, but the n-step returns G still contain V(s_{t+h}), so with lam_actor < 1 the policy
gradient is unbiased only when V is the policy's true value, and with lam_actor = 1 for any V
(analysis/eq8_check.py measures all three facts).

Read this file top down: `gae_reference` is the definition, the recursion of GAE and Eq. (5) as a
loop over tokens. `compute_gae` and `decoupled_gae` compute the same numbers on the fast paths of
`gae_fast.py` (a compiled CPU loop; on GPUs a Triton kernel, `gae_triton.py`, or a chunked scan
without Triton and for autograd), which tests/test_gae.py checks against `gae_reference` and
Eq. (8). Also here: VAPO's length-adaptive lambda and GRPO's group-normalised outcome advantage
(the paper's main baseline).
"""

import numbers

import torch

from support import gae_fast
from support.masked import check_lambda_range, check_masked_inputs


# --- the definition ------------------------------------------------------------------------------


def gae_reference(rewards, values, mask, gamma=1.0, lam=0.95):
    """GAE by its definition, and Eq. (5): the right-to-left recursion A_t = delta_t + gamma lam A_{t+1}
    over tokens (slow: what the fast paths are checked against). Computes in the input dtype; lam
    may be a float or a tensor [B]. Returns (advantages, returns), 0 on padding."""
    check_masked_inputs(mask, right_padded=True, rewards=rewards, values=values)
    mask = mask.to(values.dtype)
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device)
    batch, length = rewards.shape
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros(batch, dtype=values.dtype, device=values.device)
    for t in reversed(range(length)):
        # V(s_{t+1}) = 0 after the last token: padding values must not leak in (verl PR #50).
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < length else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # delta_t
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]  # A_t, recursively
        advantages[:, t] = next_adv
    return advantages, (advantages + values) * mask  # Eq. (5)


def eq8_advantages(rewards, values, mask, gamma=1.0, lam=0.95):
    """A_t through Eq. (8): a lam-weighted mix of n-step returns minus V(s_t). Equal to GAE for
    any values, which is what the identity says. O(B L^2) Python loop: small inputs only."""
    check_masked_inputs(mask, right_padded=True, rewards=rewards, values=values)
    lams = torch.as_tensor(lam, dtype=torch.float64).expand(rewards.shape[0]).tolist()
    out = torch.zeros_like(values)
    for b, length in enumerate(mask.sum(1).long().tolist()):
        r, v, lam_b = rewards[b, :length].tolist(), values[b, :length].tolist(), lams[b]
        for t in range(length):
            n = length - t  # steps left; G_{t:t+n} = G_{t:L} is the full return
            mix = sum((1 - lam_b) * lam_b ** (h - 1) * nstep_return(r, v, t, h, gamma) for h in range(1, n))
            out[b, t] = mix + lam_b ** (n - 1) * nstep_return(r, v, t, n, gamma) - v[t]
    return out


def nstep_return(rewards, values, t, h, gamma=1.0):
    """G_{t:t+h} = sum_{l<h} gamma^l r_{t+l} + gamma^h V(s_{t+h}) for one response (lists or 1-D
    tensors of its valid tokens); V(s_L) = 0 past the end."""
    bootstrap = values[t + h] if t + h < len(values) else 0.0
    return sum(gamma**l * rewards[t + l] for l in range(h)) + gamma**h * bootstrap


# --- the public API: the same numbers, on the fast paths (gae_fast.py) ---------------------------


def compute_gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """GAE and Eq. (5). lam is a float or a float tensor [B] (one lambda per response).
    Returns (advantages, returns), both [B, T] and 0 on padding."""
    (lam, _), fast = _checked_fast_path(rewards, values, mask, gamma, (lam,), ("lam",))
    if fast is not None:
        return fast
    mask = _check_contents(rewards, values, mask)
    ret = gae_fast.lambda_return(rewards * mask, values, mask, gamma, lam)
    return torch.addcmul(ret, values, mask, value=-1), ret


def decoupled_gae(rewards, values, mask, gamma=1.0, lam_actor=0.95, lam_critic=1.0):
    """Decoupled GAE (§3.3): advantages A(lam_actor), critic targets R = A(lam_critic) + V.
    lam_actor/lam_critic: float or float tensor [B]. Returns (advantages, returns), 0 on padding."""
    (lam_actor, lam_critic), fast = _checked_fast_path(rewards, values, mask, gamma, (lam_actor, lam_critic),
                                                       ("lam_actor", "lam_critic"))
    if fast is not None:
        return fast
    mask = _check_contents(rewards, values, mask)
    # One scratch buffer holds the critic's scan input, then the actor's: at long-CoT sizes a
    # fresh [B, T] buffer cost about as much as the arithmetic on the CPU. Each input
    # is rebuilt from r * mask, so neither result depends, even in rounding, on the other lambda.
    # Under autograd the critic's input is part of its graph, so the actor's gets a buffer of its own.
    scratch = rewards * mask
    ret = gae_fast.lambda_return(scratch, values, mask, gamma, lam_critic)
    tracked = torch.is_grad_enabled() and (rewards.requires_grad or values.requires_grad)
    actor_input = rewards * mask if tracked else torch.mul(rewards, mask, out=scratch)
    adv = gae_fast.lambda_return(actor_input, values, mask, gamma, lam_actor)
    return adv.addcmul_(values, mask, value=-1), ret  # A = R(lam_actor) - V(s_t), in place


def length_adaptive_lambda(lengths, alpha=0.05):
    """VAPO's per-response lambda = 1 - 1/(alpha l), clamped to [0, 1] (short responses get 0)."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or (lengths.numel() and not (lengths >= 0).all()):  # NaN fails >= 0 too
        raise ValueError(f"lengths must be a 1-D tensor of non-negative lengths, got {lengths}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return (1 - 1 / (alpha * lengths.float())).clamp(0.0, 1.0)


def grpo_advantages(outcomes, mask, group_size, eps=1e-6):
    """GRPO outcome advantage: (r - mean_group) / (std_group + eps), broadcast on valid tokens.
    Consecutive rows in groups of group_size share a prompt; std is Bessel-corrected."""
    if not isinstance(outcomes, torch.Tensor) or outcomes.dim() != 1:
        raise ValueError(f"outcomes must be a 1-D tensor [B], got {getattr(outcomes, 'shape', outcomes)}")
    check_masked_inputs(mask, right_padded=True)
    if not torch.isfinite(outcomes).all():
        raise ValueError("outcomes contains NaN or inf")
    if (not isinstance(group_size, int) or group_size < 2 or outcomes.shape[0] % group_size
            or mask.shape[0] != outcomes.shape[0]):
        raise ValueError(
            f"need group_size >= 2 dividing B; got group_size={group_size}, "
            f"outcomes {tuple(outcomes.shape)}, mask {tuple(mask.shape)}"
        )
    groups = outcomes.float().view(-1, group_size)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)
    return adv.view(-1, 1) * mask.float()


# --- input checks of the public API ----------------------------------------------------------


def _check_shapes(rewards, values, mask, gamma):
    """Types, shapes and gamma (cheap); returns the batch size."""
    check_masked_inputs(mask, right_padded=True, contents=False, rewards=rewards, values=values)
    if not isinstance(gamma, numbers.Real) or not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
    return mask.shape[0]


def _check_contents(rewards, values, mask):
    """Finite inputs, binary right-padded mask; returns the mask in the values' dtype."""
    check_masked_inputs(mask, right_padded=True, rewards=rewards, values=values)
    return mask.to(values.dtype)


def _checked_fast_path(rewards, values, mask, gamma, lams, names):
    """Where both GAEs start: the lambdas (actor's and critic's, or one for both) validated under the
    caller's `names`, as a pair, and (advantages, returns) from the GPU kernel or the compiled CPU loop
    where one applies, else None. The GPU kernel checks a per-response lambda's range as it reads it:
    no synchronisation here."""
    batch = _check_shapes(rewards, values, mask, gamma)
    kernel = gae_fast.kernel_applies(rewards, values, mask)
    lams = tuple(_lam(lam, batch, name, check_range=not kernel) for lam, name in zip(lams, names))
    lams = lams * 2 if len(lams) == 1 else lams
    if kernel:
        return lams, gae_fast.kernel_gae(rewards, values, mask, gamma, *lams, names=names)
    if gae_fast.compiled_loop_applies(rewards, values, mask):
        return lams, gae_fast.compiled_gae(rewards, values, mask, gamma, *lams)
    return lams, None


def _lam(lam, batch, name, check_range=True):
    """Validated lambda: a Python float, or a float64 [B] tensor for per-response lambdas, whose
    range is left to the caller with check_range=False (the GPU kernel checks it)."""
    if isinstance(lam, torch.Tensor):
        if lam.shape != (batch,) or not lam.is_floating_point():
            raise ValueError(f"{name} tensor must be float with shape [{batch}], got {lam.dtype} {tuple(lam.shape)}")
        if check_range:
            check_lambda_range(lam, name)
        return lam.detach().double()
    if not isinstance(lam, numbers.Real) or not 0 <= lam <= 1:
        raise ValueError(f"{name} must be a number in [0, 1] or a float tensor [{batch}], got {lam!r}")
    return float(lam)
