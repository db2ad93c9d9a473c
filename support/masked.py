"""Masked statistics and input checks over the response layout of the README ("Tensor layout"):
[B, T] float tensors, right-padded, with mask = 1 on every generated token. Pure tensor code, read by
the GAE (gae.py), the losses (ppo.py) and the trainer alike."""

import torch


class NonFiniteError(ValueError, FloatingPointError):
    """A tensor holds NaN or inf: a bad input (ValueError) and, mid-training, the sign of a diverged
    model (FloatingPointError, which train.py reports with the checkpoint to resume from)."""


def check_masked_inputs(mask, right_padded=False, contents=True, **tensors):
    """Raise ValueError naming the argument if a tensor's shape differs from mask's, the mask is
    not binary (or, with right_padded, not ones-then-zeros in every row), or a tensor holds
    NaN/inf: reductions over the inputs, with one [B, T] temporary (1 - mask). contents=False
    checks types and shapes only, for a caller that checks the values in its own pass over them
    (gae.py's compiled loop)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a 2-D [B, T] tensor, got {getattr(mask, 'shape', type(mask))}")
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, mask has {tuple(mask.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if not contents:
            continue
        # NaN and inf propagate through a sum, so one scalar tells; only a finite-but-overflowing
        # sum needs the elementwise look.
        if not torch.isfinite(x.detach().sum()) and not torch.isfinite(x).all():
            raise NonFiniteError(f"{name} contains NaN or inf")
    if not contents or mask.numel() == 0:
        return
    m = mask.double() if mask.dtype == torch.float64 else mask.float()  # exact integer sums
    # With 0 <= m <= 1 every m (1 - m) is >= 0, and 0 only where m is 0 or 1: a sum of them is 0
    # exactly when the mask is binary (a sum of positive terms cannot round to 0, unlike a test of
    # sum(m) = sum(m^2), which a 0.99999994 or a 1e-40 slips through).
    lo, hi = torch.aminmax(m)
    if lo < 0 or hi > 1 or torch.linalg.vecdot(m, 1 - m).any():
        raise ValueError("mask must be binary (0/1 or bool)")
    length = m.sum(1)  # for a binary mask every partial sum is an integer <= T: exact (T < 2^24)
    # A binary row is ones-then-zeros iff it starts with a one (or is empty) and its L ones
    # form L - 1 adjacent (1, 1) pairs.
    if right_padded:
        pairs = torch.linalg.vecdot(m[:, :-1], m[:, 1:])
        starts = (m[:, 0] == 1) | (length == 0)
        if not (starts.all() and torch.equal(pairs, (length - 1).clamp_min(0))):
            raise ValueError("mask must be right-padded: ones then zeros in every row")


def check_lambda_range(lam, name):
    """A per-response lambda tensor [B] in [0, 1] (NaN is not)."""
    if not ((lam >= 0) & (lam <= 1)).all():
        raise ValueError(f"{name} must lie in [0, 1]")


def masked_sum(x, mask, dim=None):
    """Sum of x over positions where mask is 1."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over mask; 0 where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1)
