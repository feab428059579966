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
- Bounded temporaries: a scale per tensor segment (`SegmentScales`), never one float per element, and the encode
  (`encode_into`) and the decode-and-sum (`decode_sum_into`) run `CHUNK` elements at a time, straight into the uint8
  send buffer and into the output. What a call allocates is the uint8 buffers its collectives need plus temporaries
  of O(CHUNK) bytes, whatever the buffer's size; the values are the unchunked code's to the bit.
- One MAX all-reduce per call (per DDP bucket, per FSDP2 unit), not one per iteration: the shared scale needs the
  amax of the gradients being cast, which exists only once backward has produced that bucket, while the next
  buckets are still being computed. A collective per iteration could only carry an earlier iteration's amaxes
  (delayed scaling: a gradient larger than last step's saturates or, unsaturated, turns the step into a skip) or be
  issued after backward (too late for DDP's overlap). Its cost is a latency, not bytes: 4 bytes per tensor against
  the bucket's megabytes.
"""
from __future__ import annotations

import bisect
import math
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize, saturate
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


#: elements per step of the chunked encode and decode-and-sum: the float32 temporaries of one call are a few times
#: CHUNK x 4 bytes, whatever the buffer's size. A power of two: the decode's column
#: chunks then start where torch's vectorised reduction groups start (bit-identical sums, see `decode_sum_into`).
CHUNK = 1 << 22
#: the narrowest block of columns the decode sums at once (more than torch's vectorised groups, 64 floats at most)
MIN_COLUMNS = 1024


class SegmentScales:
    """The scale of each element of a flat buffer whose consecutive segments hold tensors of `numels` elements, each
    cast with its own scale (`scales[i]`); the rest of the buffer (padding) has scale 1. Never materialised for the
    whole buffer: `scale(start, stop)` gives the scale of a range, a 0-d tensor where the range lies in one segment
    (a view, no allocation), else stop - start floats built from expanded views (one concatenation). The segment
    boundaries are host integers: no host synchronisation."""

    def __init__(self, scales: Tensor, numels: Sequence[int], total: int) -> None:
        if scales.dim() == 0:
            scales, numels = scales.reshape(1), [total]
        self.scales = scales
        self.starts = [0]
        for n in numels:
            self.starts.append(self.starts[-1] + n)
        if self.starts[-1] > total:
            raise ValueError(f"segments of {self.starts[-1]} elements do not fit a buffer of {total}")
        self.total = total
        self._one: Optional[Tensor] = None

    def _segment_scale(self, i: int) -> Tensor:
        if i < self.scales.numel():
            return self.scales[i]
        if self._one is None:
            self._one = self.scales.new_ones(())
        return self._one

    def scale(self, start: int, stop: int) -> Tensor:
        bounds = self.starts + [self.total] if self.starts[-1] < self.total else self.starts
        first = bisect.bisect_right(bounds, start) - 1
        last = bisect.bisect_left(bounds, stop) - 1
        if first == last:
            return self._segment_scale(first)
        parts = []
        for i in range(first, last + 1):
            lo, hi = max(start, bounds[i]), min(stop, bounds[i + 1])
            if hi > lo:
                parts.append(self._segment_scale(i).expand(hi - lo))
        return torch.cat(parts)


def _as_segments(scale, n: int):
    """A 0-d scale as the segments of one tensor of n elements; anything with `scale(start, stop)` as it is."""
    return SegmentScales(scale, [n], n) if isinstance(scale, Tensor) else scale


def encode(x: Tensor, scale: Tensor, fmt: FP8Format) -> Tensor:
    """`x` cast to FP8 with `scale` (scalar or per element), as uint8 (the dtype collectives move)."""
    return quantize(x, scale, fmt).view(torch.uint8)


def encode_into(out: Tensor, x: Tensor, scale, fmt: FP8Format, chunk: Optional[int] = None) -> Tensor:
    """Write flat `x` cast to FP8 into `out` (uint8, at least x.numel() elements; the rest is left as it is),
    `chunk` elements at a time: `encode`'s values exactly (an elementwise cast, whatever the chunking), with float32
    temporaries of O(chunk) elements. `scale`: a 0-d tensor or a `SegmentScales` over x."""
    x = x.reshape(-1)
    n = x.numel()
    chunk = chunk or CHUNK
    segments = _as_segments(scale, n)
    target = out.view(fmt.dtype)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        cast_into(target[start:stop], x[start:stop], segments.scale(start, stop), fmt)
    return out


def cast_into(target: Tensor, x: Tensor, scale: Tensor, fmt: FP8Format) -> Tensor:
    """`quantize(x, scale, fmt)` (round to nearest) written into the FP8 tensor `target`: the same float32 product
    and saturation, and the copy into `target` converts as `.to(fmt.dtype)` does (one temporary fewer)."""
    return target.copy_(saturate(x.to(torch.float32) * scale, fmt))


def decode_sum(received: Tensor, ranks: int, scale: Tensor, fmt: FP8Format) -> Tensor:
    """float32 sum over `ranks` equal chunks of uint8-encoded FP8 values cast with the same `scale` (scalar, or per
    element of one chunk): sum first (every rank used the same scale), then one division. Unchunked (ranks x chunk x
    4 bytes of float32): the reference `decode_sum_into` is tested against; the communication paths use that."""
    values = received.view(fmt.dtype).reshape(ranks, -1).to(torch.float32)
    return values.sum(0) / scale


def decode_sum_into(out: Tensor, received: Tensor, ranks: int, scale, fmt: FP8Format, divisor: Optional[int] = None,
                    nonfinite: Optional[Tensor] = None, chunk: Optional[int] = None) -> Tensor:
    """out = poison_if(decode_sum(received, ranks, scale, fmt)[:out.numel()] / divisor, nonfinite), written into
    the flat `out` (any float dtype: rounded once, as `copy_` rounds) without the whole float32 sum: the columns of
    the [ranks, m] received values are decoded and summed a block at a time, chunk // 2^ceil(log2 ranks) columns
    (at least MIN_COLUMNS), so the float32 temporaries are about 4 x chunk bytes whatever m and the number of ranks.

    The same values to the bit as the unchunked expression: each block is reduced by the same `sum(0)` over ranks
    (torch's CPU kernel reduces a column in an order that depends on the number of rows and on whether the column
    falls in a vectorised group or in the scalar tail; blocks of a power-of-two width start where those groups start
    and the tail stays the tail), then the same elementwise division(s) and NaN addition. `scale`: a 0-d tensor or a
    `SegmentScales` over one rank's chunk."""
    if not out.is_contiguous():
        return out.copy_(decode_sum_into(torch.empty_like(out, memory_format=torch.contiguous_format), received, ranks,
                                         scale, fmt, divisor, nonfinite, chunk))
    flat = out.view(-1)
    poison = torch.where(nonfinite, math.nan, 0.0) if nonfinite is not None else None
    for start, stop, total in decoded_blocks(received, ranks, scale, fmt, flat.numel(), divisor, chunk):
        if poison is None:
            flat[start:stop].copy_(total)
        else:  # computed in float32, rounded once to out's dtype: poison_if then copy_
            torch.add(total, poison, out=flat[start:stop])
    return out


def decoded_blocks(received: Tensor, ranks: int, scale, fmt: FP8Format, m: int, divisor: Optional[int] = None,
                   chunk: Optional[int] = None) -> Iterator[Tuple[int, int, Tensor]]:
    """(start, stop, float32 values) for consecutive blocks of the first `m` columns of `decode_sum(received, ranks,
    scale, fmt) / divisor` (see `decode_sum_into` for the block width and why the values are the same to the bit)."""
    rows = received.view(fmt.dtype).reshape(ranks, -1)
    if m > rows.shape[1]:
        raise ValueError(f"decode_sum_into: {m} outputs from {rows.shape[1]} received columns")
    segments = _as_segments(scale, rows.shape[1])
    columns = max((chunk or CHUNK) >> max(ranks - 1, 0).bit_length(), MIN_COLUMNS)
    for start in range(0, m, columns):
        stop = min(start + columns, m)
        if ranks == 1:  # nothing to add (a sum would also turn -0 into +0)
            total = rows[0, start:stop].to(torch.float32)
        else:
            total = rows[:, start:stop].to(torch.float32).sum(0)
        total.div_(segments.scale(start, stop))  # in place: the same IEEE divisions, no new block
        if divisor is not None:
            total.div_(divisor)
        yield start, stop, total


def poison_if(x: Tensor, nonfinite: Tensor) -> Tensor:
    """`x`, or NaN everywhere when `nonfinite` (a 0-d bool tensor): the reduced gradient carries the event."""
    return x + torch.where(nonfinite, math.nan, 0.0).to(x.dtype)
