"""Gradient clipping for scaled training: always on unscaled gradients, with the norm computed in float32.

A non-finite norm is reported to the caller (the engine skips the step) instead of scaling gradients by NaN.
"""
from __future__ import annotations

from typing import Iterable

import torch


@torch.no_grad()
def grad_norm_fp32(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2)


@torch.no_grad()
def clip_grad_norm_(grads: Iterable[torch.Tensor], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most max_norm; returns the norm before clipping.
    With a non-finite norm the gradients are left as they are (the step will be skipped)."""
    grads = [g for g in grads if g is not None]
    total = grad_norm_fp32(grads)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    for g in grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


@torch.no_grad()
def clip_grad_value_(grads: Iterable[torch.Tensor], clip_value: float) -> None:
    for g in grads:
        if g is not None:
            g.clamp_(-clip_value, clip_value)
