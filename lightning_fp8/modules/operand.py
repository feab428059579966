"""The records an FP8 GEMM is made of: one scaled matrix (`FP8Matrix`), one cast tensor role (`FP8Operand`), one GEMM
request (`GemmRequest`). Every scaling (per-tensor, rowwise, blockwise, MXFP8, NVFP4) fills the same records; what
differs is only which fields are set, so the autograd function, the GEMM op, its planner and its emulation each exist
once.

Orientation: a GEMM computes out (M, N) = A (M, K) @ B (K, N). A matrix's `tile` is (rows, cols) of the block one
scale covers, 0 meaning the whole dimension; None for one scale per tensor.

A grouped GEMM (a mixture-of-experts layer: `GemmRequest.offsets`, numerics/groups.py) is the same request over
groups of rows: either A's rows are grouped and B is 3-D, one (K, N) matrix per group, or the contraction is grouped
(A's columns and B's rows) and the output is 3-D, one (M, N) matrix per group. A 3-D matrix's scales have a leading
group dimension, and a grouped contraction's tiles cover one group's extent of it (a `0` there is "the group's").
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

Tensor = torch.Tensor
Tile = Tuple[int, int]

#: packed FP4 (two E2M1 values per byte along the contraction dimension)
FP4 = torch.float4_e2m1fn_x2 if hasattr(torch, "float4_e2m1fn_x2") else None


class FP8Matrix(NamedTuple):
    """A 2-D FP8 (or packed FP4) matrix with the dequant scales that give its values: value = data * scale_inv
    (per tile), times `tensor_scale` where set.

    data: FP8 values, any layout; packed FP4 holds two values per byte along the dimension a GEMM contracts.
    scale_inv: float32 0-d (one scale for the matrix, `tile` None), or one scale per tile in grid layout
        (`numerics.tiles.grid_shape`): float32, E8M0 (MXFP8) or E4M3 (NVFP4).
    tile: the block one scale covers, (rows, cols), 0 for a whole dimension; None for a per-tensor scale.
    tensor_scale: NVFP4's second scale level, a float32 0-d decode scale; None for every other format."""

    data: Tensor
    scale_inv: Tensor
    tile: Optional[Tile] = None
    tensor_scale: Optional[Tensor] = None

    def t(self) -> "FP8Matrix":
        """The transposed matrix as a view (data, scales and tile transposed; no copy); a 3-D (grouped) matrix
        transposes each group's."""
        scale_inv = self.scale_inv.transpose(-2, -1) if self.scale_inv.dim() >= 2 else self.scale_inv
        tile = None if self.tile is None else (int(self.tile[1]), int(self.tile[0]))
        return FP8Matrix(self.data.transpose(-2, -1), scale_inv, tile, self.tensor_scale)


class FP8Operand(NamedTuple):
    """One tensor role of a layer (input, weight or output gradient) cast for the GEMMs that read it.

    matrix: the tensor as cast, (rows, cols): what a GEMM contracting its columns reads (forward: x and W; dgrad: dY).
    transposed: the transpose as its own cast, where one was written: a fine-grained recipe's tiles along the other
        axis, or a per-tensor cast that wrote the transposed layout in the same pass (CUDA); its token columns may be
        zero-padded. None where the transpose of `matrix` serves (`matrix_t`).
    scale: a per-tensor cast's quantization scale (what backward re-casts the weight with); None for tiled casts."""

    matrix: Optional[FP8Matrix]
    transposed: Optional[FP8Matrix] = None
    scale: Optional[Tensor] = None

    def matrix_t(self) -> FP8Matrix:
        """The transpose a GEMM contracting the rows reads (wgrad: dY^T and x^T; dgrad: W^T)."""
        if self.transposed is not None:
            return self.transposed
        return self.matrix.t()


class GemmRequest(NamedTuple):
    """One FP8 GEMM request: out = A @ B + bias, products accumulated in float32, rounded once to out_dtype.

    a: A (M, K) and b: B (K, N), any layout, with their scales (see FP8Matrix).
    bias: (N,), added before the one rounding; None for no bias.
    use_fast_accum: the scaled GEMM may use its fast accumulation (forward GEMMs only).
    offsets: a grouped GEMM's groups (int32 end offsets, one per group: module docstring); None for one GEMM. With a
        3-D b the groups are A's rows (out (M, N)); with a 2-D b, the contraction (out (groups, M, N))."""

    a: FP8Matrix
    b: FP8Matrix
    out_dtype: torch.dtype
    bias: Optional[Tensor] = None
    use_fast_accum: bool = False
    offsets: Optional[Tensor] = None

    @property
    def grouped(self) -> Optional[str]:
        """"rows" (A's rows grouped, b 3-D), "contraction" (the contraction grouped) or None (one GEMM)."""
        if self.offsets is None:
            return None
        return "rows" if self.b.data.dim() == 3 else "contraction"

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(M, K, N), K in elements (packed FP4 holds two per byte along K); a grouped GEMM's over all groups."""
        packing = 2 if FP4 is not None and self.a.data.dtype == FP4 else 1
        return self.a.data.shape[0], self.a.data.shape[1] * packing, self.b.data.shape[-1]
