"""FP8 reduction of gradients across ranks with a scale all ranks share (FP8-LM's automatic scaling).

What the DDP comm hook (comm_hook.py) and the FSDP2 reduce-scatter (reduce_scatter.py) both do to a flat gradient
buffer; they differ only in which collectives move the bytes.

- One scale per tensor (or per buffer), agreed before anything is cast: each rank's amax, one MAX all-reduce
  (4 bytes per scale), scale = fp8_max / global amax (`numerics.scaling.scale_from_amax`). Every rank's values then
  fit the format (|x| * scale <= fp8_max): the cast cannot overflow, and nothing is flushed that a per-rank scale
  would have kept. This is the shared factor of FP8-LM's scheme (the minimum of the ranks' scales).
- The sum is never taken in FP8: collectives cannot add FP8 (gloo rejects float8 dtypes, NCCL has no FP8
  reduction) and an FP8 sum would overflow. FP8 bytes move as uint8; each rank decodes what it receives and sums in
  float32.
- Non-finite gradients are not hidden: a saturating cast would turn inf into 448. An inf / NaN amax on any rank
  makes the global amax inf (NaN is mapped to inf before the MAX, which some backends drop NaN from), and the
  result is then made NaN on every rank, arithmetically (no host synchronisation), so the engine's check of the
  reduced gradients skips the step on all ranks, as it would after a BF16 all-reduce.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize
from lightning_fp8.numerics.scaling import scale_from_amax

Tensor = torch.Tensor


def local_amaxes(tensors: Sequence[Tensor]) -> Tensor:
    """float32 [len(tensors)]: max |t| of each tensor (NaN mapped to inf), in one fused pass."""
    norms = torch._foreach_norm(list(tensors), math.inf)
    amax = torch.stack([n.to(torch.float32).reshape(()) for n in norms])
    return torch.where(torch.isnan(amax), math.inf, amax)  # (nan_to_num would also turn inf into the float max)


def shared_scales(local_amax: Tensor, fmt: FP8Format, margin: int, group: Optional[dist.ProcessGroup]) -> Tuple[Tensor, Tensor]:
    """(scales, nonfinite) from this rank's amaxes: one MAX all-reduce, then scale = fp8_max / amax / 2**margin
    (1 where the amax is 0 or not finite), and a 0-d bool tensor, True if any rank saw a non-finite value."""
    amax = local_amax.clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    nonfinite = ~torch.isfinite(amax).all()
    scales = scale_from_amax(amax, fmt.max, margin, 1.0)
    return scales, nonfinite


def elementwise(scales: Tensor, numels: Sequence[int], total: int) -> Tensor:
    """A per-element scale over a flat buffer whose consecutive segments hold tensors of `numels` elements (the
    rest, padding, gets scale 1): one concatenation of expanded views, no host synchronisation."""
    parts = [s.expand(n) for s, n in zip(scales.unbind(0), numels)]
    rest = total - sum(numels)
    if rest:
        parts.append(scales.new_ones(rest))
    return torch.cat(parts)


def encode(x: Tensor, scale: Tensor, fmt: FP8Format) -> Tensor:
    """`x` cast to FP8 with `scale` (scalar or per element), as uint8 (the dtype collectives move)."""
    return quantize(x, scale, fmt).view(torch.uint8)


def decode_sum(received: Tensor, ranks: int, scale: Tensor, fmt: FP8Format) -> Tensor:
    """float32 sum over `ranks` equal chunks of uint8-encoded FP8 values cast with the same `scale` (scalar, or per
    element of one chunk): sum first (every rank used the same scale), then one division."""
    values = received.view(fmt.dtype).reshape(ranks, -1).to(torch.float32)
    return values.sum(0) / scale


def poison_if(x: Tensor, nonfinite: Tensor) -> Tensor:
    """`x`, or NaN everywhere when `nonfinite` (a 0-d bool tensor): the reduced gradient carries the event."""
    return x + torch.where(nonfinite, math.nan, 0.0).to(x.dtype)


__all__ = ["local_amaxes", "shared_scales", "elementwise", "encode", "decode_sum", "poison_if"]
