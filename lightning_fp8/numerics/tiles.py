"""Fine-grained scaling: one scale per tile of a 2-D tensor, and the GEMM of two tile-scaled operands.

Where every fine-grained scale rule is defined (the per-tensor rules are in `scaling.py`; the cast itself is
`quantize.quantize`, here applied with a scale per element). A **tile** is `(rows, cols)`; 0 stands for the whole
extent of that dimension, so `(1, 0)` is one scale per row ("rowwise"), `(1, 128)` one per 128 consecutive elements
of a row, `(128, 128)` one per square block. The last tile of a dimension that is not a multiple of the tile length
is ragged (shorter); its amax is over the elements it has.

For each tile: `scale = fp8_max / amax / 2**margin` in IEEE float32 (the same rule as a per-tensor scale,
`scaling.scale_from_amax`), rounded down to a power of two when asked; a tile whose amax is 0, inf or NaN gets
scale 1 (stateless scaling has no previous scale to keep: an all-zero tile casts to zeros whatever its scale, and a
non-finite tile is an overflow the caller sees in the tensor's amax). The dequant scale is the float32 reciprocal,
exact for a power of two.

Which tiles each operand of each GEMM of a linear layer uses (`operand_tiles`): the scales run along the axis the
GEMM does *not* contract, so every partial product of a K block has one scale per output row and one per output
column, which the GEMM applies to that block's partial sum (`tiled_gemm_reference`).

    y  = x  W^T   x: row tiles (1, t)            W: (t, t) blocks (blockwise) or rows (1, 0) (rowwise)
    dx = dy W     dy: row tiles (1, t)           W^T: (t, t) blocks, or rows of W^T (per input channel)
    dW = dy^T x   dy^T: row tiles (1, t)         x^T: row tiles (1, t) (per input channel over t tokens)

with t = block_size for "blockwise" (DeepSeek-V3: 1x128 activation and gradient tiles, 128x128 weight blocks, the
transposed tiling where backward contracts the other axis) and t = the whole row for "rowwise". The microscaling
recipes ("mxfp8": 1 x 32 tiles for every operand, the weight cast along each of its axes; "nvfp4": 1 x 16 tiles, 16 x 16
weight blocks) have their scale rules in `microscaling.py`: E8M0 and two-level E4M3 + float32 scales, not this
module's float32 ones.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize

Tile = Tuple[int, int]
_FLOAT32_MAX = torch.finfo(torch.float32).max


def tile_extent(tile: Sequence[int], shape: Sequence[int]) -> Tile:
    """The tile with 0 replaced by the dimension's length (at least 1)."""
    return tuple(max(1, n) if t == 0 else int(t) for t, n in zip(tile, shape))  # type: ignore[return-value]


def grid_shape(tile: Sequence[int], shape: Sequence[int]) -> Tile:
    """Number of tiles along each dimension (the shape of the scale tensor)."""
    tr, tc = tile_extent(tile, shape)
    return (math.ceil(shape[0] / tr) if shape[0] else 0, math.ceil(shape[1] / tc) if shape[1] else 0)


def _blocked(x: torch.Tensor, tile: Tile) -> torch.Tensor:
    """x (M, N) zero-padded to whole tiles and viewed as (tiles_r, tr, tiles_c, tc). Zeros never change an amax."""
    m, n = x.shape
    tr, tc = tile_extent(tile, x.shape)
    gr, gc = grid_shape(tile, x.shape)
    pad_r, pad_c = gr * tr - m, gc * tc - n
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(gr, tr, gc, tc)


def tile_amax(x: torch.Tensor, tile: Sequence[int]) -> torch.Tensor:
    """max|x| of every tile, float32, shape `grid_shape(tile, x.shape)`; NaN and inf propagate."""
    if x.dim() != 2:
        raise ValueError(f"tile_amax expects a 2-D tensor, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return torch.zeros(grid_shape(tile, x.shape), dtype=torch.float32, device=x.device)
    blocks = _blocked(x.detach().to(torch.float32).abs(), tile)
    return blocks.amax(dim=(1, 3))


def tile_scales(amax: torch.Tensor, fmt: FP8Format, margin: int = 0, power_of_2: bool = True) -> torch.Tensor:
    """Quantization scale of each tile from its amax (module docstring): float32, the shape of `amax`."""
    usable = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(usable, amax, torch.ones_like(amax))
    scale = torch.div(torch.full_like(safe, fmt.max), safe) / (2.0**margin)
    scale = torch.clamp(scale, max=_FLOAT32_MAX)
    if power_of_2:
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return torch.where(usable, scale, torch.ones_like(scale))


def expand_tiles(values: torch.Tensor, tile: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """A per-tile tensor (grid shape) repeated over each tile's elements: shape `shape` (ragged tiles cut)."""
    tr, tc = tile_extent(tile, shape)
    out = values.repeat_interleave(tr, dim=0) if tr > 1 else values
    out = out.repeat_interleave(tc, dim=1) if tc > 1 else out
    return out[: shape[0], : shape[1]]


def times_tiles(x: torch.Tensor, values: torch.Tensor, tile: Sequence[int]) -> torch.Tensor:
    """x times each element's tile value: the same float multiplies as `x * expand_tiles(values, tile, x.shape)`, by
    broadcasting over a blocked view where the tiles divide x (a transposed x through its transpose), so the values
    are not expanded to every element; expanded where a tile is ragged."""
    (m, n), (tr, tc) = x.shape, tile_extent(tile, x.shape)
    if m % tr == 0 and n % tc == 0:
        if x.is_contiguous():
            gr, gc = m // tr, n // tc
            return (x.view(gr, tr, gc, tc) * values.reshape(gr, 1, gc, 1)).view(m, n)
        if x.t().is_contiguous():
            return times_tiles(x.t(), values.t(), transposed((tr, tc))).t()
    return x * expand_tiles(values, tile, x.shape)


def quantize_tiles(
    x: torch.Tensor,
    tile: Sequence[int],
    fmt: FP8Format,
    margin: int = 0,
    power_of_2: bool = True,
    rounding: str = "nearest",
    noise: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast a 2-D `x` to FP8 with one scale per tile: (x_fp8, scale_inv per tile, amax of the whole tensor).

    The cast is `quantize` (saturating, round to nearest even or stochastic) with each element's tile scale; the
    amax is the max of the tile amaxes (NaN / inf propagate), what the layer records for overflow detection."""
    amax = tile_amax(x, tile)
    scale = tile_scales(amax, fmt, margin, power_of_2)
    q = quantize(x, expand_tiles(scale, tile, x.shape), fmt, rounding=rounding, noise=noise)
    total = amax_of_tiles(amax)
    return q, scale.reciprocal(), total


def amax_of_tiles(amax: torch.Tensor) -> torch.Tensor:
    """The tensor's amax from its tiles' (0 for no tile; NaN propagates, as in `tensor_amax`)."""
    if amax.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=amax.device)
    return amax.amax()


def dequantize_tiles(
    x_fp8: torch.Tensor, scale_inv: torch.Tensor, tile: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Back to high precision: each FP8 value (exact in float32) times its tile's dequant scale, rounded to dtype."""
    return (x_fp8.to(torch.float32) * expand_tiles(scale_inv.to(torch.float32), tile, x_fp8.shape)).to(dtype)


def operand_tiles(scaling: str, block_size: int, role: str) -> Tuple[Tile, Tile]:
    """(tile of the tensor, tile of its transpose) that a role of a linear layer is cast with (module docstring).

    input / grad_output: the tensor in row tiles (forward / dgrad contract its columns), its transpose in row tiles
    (wgrad contracts its rows); weight: (t, t) blocks or rows, and the same for its transpose (dgrad)."""
    if scaling == "rowwise":
        return (1, 0), (1, 0)
    if scaling == "blockwise":
        t = int(block_size)
        if role == "weight":
            return (t, t), (t, t)
        return (1, t), (1, t)
    if scaling == "mxfp8":  # 1 x 32 along the contraction dimension of every operand of every GEMM
        return (1, 32), (1, 32)
    if scaling == "nvfp4":  # 1 x 16, and 16 x 16 weight blocks (W and W^T then quantize alike)
        if role == "weight":
            return (16, 16), (16, 16)
        return (1, 16), (1, 16)
    raise ValueError(f"no tiles for scaling {scaling!r}; fine-grained scalings: ['rowwise', 'blockwise', 'mxfp8', "
                     "'nvfp4']")


def transposed(tile: Sequence[int]) -> Tile:
    return (int(tile[1]), int(tile[0]))


def tiled_gemm_reference(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_tile: Sequence[int],
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_tile: Sequence[int],
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The GEMM of two tile-scaled FP8 operands as the GPU's blockwise / rowwise GEMMs define it.

    a (M, K) with tiles `a_tile` = (rows, K-block), b (K, N) with tiles `b_tile` = (K-block, cols); both K blocks
    must be equal. For each K block k: the partial product P_k = a[:, k] @ b[k, :] of the exact FP8 values,
    accumulated in float32, then scaled by the dequant scales of its rows and columns; out = sum_k (in float32) +
    bias, rounded once to out_dtype."""
    m, k = a.shape
    n = b.shape[1]
    ak = tile_extent(a_tile, (m, k))[1]
    bk = tile_extent(b_tile, (k, n))[0]
    if ak != bk:
        raise ValueError(f"the operands' K blocks differ: a tile {tuple(a_tile)}, b tile {tuple(b_tile)} (K={k})")
    row_scale = expand_tiles(a_scale_inv.to(torch.float32), (tile_extent(a_tile, (m, k))[0], 1), (m, a_scale_inv.shape[1]))
    col_scale = expand_tiles(b_scale_inv.to(torch.float32), (1, tile_extent(b_tile, (k, n))[1]), (b_scale_inv.shape[0], n))
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    for j, start in enumerate(range(0, k, max(ak, 1))):
        stop = min(start + ak, k)
        partial = torch.mm(a32[:, start:stop], b32[start:stop, :])
        acc += partial * row_scale[:, j : j + 1] * col_scale[j : j + 1, :]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def exact_in_bf16(scale_inv: torch.Tensor) -> bool:
    """True when every dequant scale is a power of two between 2^-100 and 2^100 (a CPU check, no device sync): then
    an FP8 value times its scale is exact in BF16, and so is a product of two of them in float32."""
    s = scale_inv.detach().to(torch.float32)
    if s.numel() == 0:
        return True
    mantissa, exponent = torch.frexp(s)
    return bool(((mantissa == 0.5) & (exponent > -100) & (exponent < 100)).all())
