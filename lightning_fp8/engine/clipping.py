"""Gradient clipping for scaled training: always on unscaled gradients, with the norm computed in float32.

A non-finite norm is reported to the caller (the engine skips the step) instead of scaling gradients by NaN.

Sharded gradients (DTensors: FSDP2's, tensor parallelism's, FSDP2 x TP's on a 2-D mesh) sit next to plain tensors and
on different meshes, which one DTensor computation cannot mix: each rank takes the norms of what it holds, and the
squared norms of the gradients sharded alike (same mesh, same sharded dimensions) are summed over the ranks holding
their shards, one all-reduce per such group; replicated dimensions are not summed (every rank holds the same values).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch


@torch.no_grad()
def grad_norm_fp32(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of `grads` (float32, a plain tensor on every rank)."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros(())
    norms: List[torch.Tensor] = []
    sharded: Dict[Tuple, List[torch.Tensor]] = {}
    for g in grads:
        if _is_dtensor(g):
            g = _without_partial(g)
            key = (g.device_mesh, tuple(p.is_shard() for p in g.placements))
            sharded.setdefault(key, []).append(torch.linalg.vector_norm(g.to_local(), 2, dtype=torch.float32))
        else:
            norms.append(torch.linalg.vector_norm(g, 2, dtype=torch.float32))
    device = (norms or next(iter(sharded.values())))[0].device
    norms = [n.to(device) for n in norms]
    for (mesh, shard_dims), local_norms in sharded.items():
        norms.append(_global_norm(torch.stack(local_norms).square().sum(), mesh, shard_dims).to(device))
    return torch.linalg.vector_norm(torch.stack(norms), 2)


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _without_partial(g):
    """A gradient still holding partial sums (none after a complete backward) is reduced first."""
    if not any(p.is_partial() for p in g.placements):
        return g
    from torch.distributed.tensor import Replicate

    return g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])


def _global_norm(local_square_sum: torch.Tensor, mesh, shard_dims: Tuple[bool, ...]) -> torch.Tensor:
    """sqrt of the sum of `local_square_sum` over the mesh dimensions the gradients are sharded on (one all-reduce)."""
    if not any(shard_dims):
        return local_square_sum.sqrt()
    from torch.distributed.tensor import DTensor, Partial, Replicate

    placements = [Partial() if sharded else Replicate() for sharded in shard_dims]
    return DTensor.from_local(local_square_sum, mesh, placements, run_check=False).full_tensor().sqrt()


@torch.no_grad()
def clip_grad_norm_(grads: Iterable[torch.Tensor], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most max_norm; returns the norm before clipping.
    With a non-finite norm the gradients are left as they are (the step will be skipped)."""
    grads = [g for g in grads if g is not None]
    total = grad_norm_fp32(grads)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    for g in grads:
        local = g.to_local() if _is_dtensor(g) else g  # every rank scales what it holds
        local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total


@torch.no_grad()
def clip_grad_value_(grads: Iterable[torch.Tensor], clip_value: float) -> None:
    for g in grads:
        if g is not None:
            (g.to_local() if _is_dtensor(g) else g).clamp_(-clip_value, clip_value)
