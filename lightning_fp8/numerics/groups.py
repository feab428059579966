"""Grouped scaling: the rules of a mixture-of-experts layer's grouped GEMMs, whose rows (tokens) are sorted by expert.

A **group** is the run of rows one expert computes: `offsets` (int32, one per expert) are the end rows of the groups,
as torch's grouped GEMMs take them (group g is rows [offsets[g-1], offsets[g]), offsets[-1] = 0); rows past the last
offset belong to no group (tokens routed to another rank's experts under expert parallelism): they cast to zeros and
their outputs are zeros. A group may be empty.

The grouped GEMMs of y = x W_g^T (x (M, K) sorted by expert, W (E, N, K)) and their scales, rowwise throughout (the
scaling torch's grouped scaled GEMM takes; the rules of each scale are `tiles.tile_scales`'):

    forward  y  = x  @ W_g^T     x: one scale per row (token)             W_g^T: one per output column (per expert)
    dgrad    dx = dy @ W_g       dy: one scale per row                    W_g: one per input column (per expert)
    wgrad    dW_g = dy_g^T @ x_g dy_g^T: one per row over its group's     x_g: one per column over its group's
                                 tokens (output column n of expert g)     tokens (input column k of expert g)

so the forward and dgrad operands are rowwise tiles of `tiles.py` (a 3-D weight is E matrices), and the weight
gradient's are per (group, column): `group_amax` / `quantize_groups`. `grouped_gemm_reference` defines both kinds of
grouped GEMM on those operands: per group, the product of the exact FP8 values accumulated in float32, scaled by
its rows' and columns' dequant scales, rounded once.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize
from lightning_fp8.numerics.tiles import tile_scales

Tensor = torch.Tensor


def group_of_rows(offsets: Tensor, rows: int) -> Tensor:
    """The group of each of `rows` rows (int64, (rows,)); len(offsets) for a row past the last offset."""
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, positions, right=True)


def group_counts(offsets: Tensor) -> Tensor:
    """Rows per group (int64, (E,)) from the end offsets."""
    ends = offsets.to(torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def group_amax(x: Tensor, offsets: Tensor) -> Tensor:
    """max|x| of each column over each group's rows: float32 (E, C); 0 for an empty group; NaN and inf propagate (as
    in `tiles.tile_amax`). Rows past the last offset count in no group."""
    if x.dim() != 2:
        raise ValueError(f"group_amax expects a 2-D tensor, got shape {tuple(x.shape)}")
    groups = offsets.shape[0]
    rows, cols = x.shape
    index = group_of_rows(offsets, rows).unsqueeze(1).expand(rows, cols)
    out = torch.zeros((groups + 1, cols), dtype=torch.float32, device=x.device)
    out.scatter_reduce_(0, index, x.detach().to(torch.float32).abs(), "amax", include_self=True)
    return out[:groups]


def quantize_groups(
    x: Tensor,
    offsets: Tensor,
    fmt: FP8Format,
    margin: int = 0,
    power_of_2: bool = True,
    rounding: str = "nearest",
    noise: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Cast a 2-D `x` (rows sorted by group) to FP8 with one scale per (group, column): (x_fp8 (M, C), scale_inv
    (E, C), amax of the tensor). Rows past the last offset cast to zeros. The cast is `quantize` with each element's
    scale, as `tiles.quantize_tiles` does with a tile's."""
    amax = group_amax(x, offsets)
    scale = tile_scales(amax, fmt, margin, power_of_2)
    groups = group_of_rows(offsets, x.shape[0])
    in_group = groups < offsets.shape[0]
    per_row = torch.cat([scale, torch.zeros_like(scale[:1])])[groups]  # rows in no group: scale 0, value 0
    q = quantize(torch.where(in_group.unsqueeze(1), x, torch.zeros_like(x)), per_row, fmt, rounding=rounding,
                 noise=noise)
    total = amax.amax() if amax.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    return q, scale.reciprocal(), total


def grouped_gemm_reference(a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor, offsets: Tensor,
                           out_dtype: torch.dtype) -> Tensor:
    """The grouped GEMM of two rowwise-scaled FP8 operands, as torch's grouped scaled GEMM defines it.

    Rows grouped (forward, dgrad): a (M, K) with scale_inv (M, 1), b (E, K, N) with scale_inv (E, 1, N): out (M, N),
    the rows of group g times b[g]; rows past the last offset are zeros.
    Contraction grouped (wgrad): a (N, M) with scale_inv (E, N, 1), b (M, K) with scale_inv (E, 1, K): out (E, N, K),
    group g's columns of a times its rows of b; an empty group gives zeros.
    Per group: the exact FP8 values multiplied with float32 accumulation, then scaled by the rows' and columns'
    dequant scales, rounded once to out_dtype."""
    ends = [int(v) for v in offsets.tolist()]
    starts = [0] + ends[:-1]
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    if b.dim() == 3:
        out = torch.zeros((a.shape[0], b.shape[2]), dtype=torch.float32, device=a.device)
        for g, (start, end) in enumerate(zip(starts, ends)):
            if end > start:
                out[start:end] = (a32[start:end] @ b32[g]) * a_scale_inv[start:end] * b_scale_inv[g]
        return out.to(out_dtype)
    out = torch.zeros((len(ends), a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    for g, (start, end) in enumerate(zip(starts, ends)):
        if end > start:
            out[g] = (a32[:, start:end] @ b32[start:end]) * a_scale_inv[g] * b_scale_inv[g]
    return out.to(out_dtype)
