"""Blockwise quantization: the torch reference for storing optimizer state in 8 (or 16) bits.

A tensor is flattened and cut into blocks of `block_size` consecutive elements; each block gets its own scale,
so an outlier only costs precision inside its own block (a per-tensor scale would push every small value of the
tensor towards the subnormals). The last block is padded with zeros for the amax, which cannot change it.

Layout (what a fused kernel must read and write, bit for bit):
  data       the format's dtype, shape [numel] (no padding is stored)
  scale_inv  float32, shape [ceil(numel / block_size)], the *dequantization* multiplier of each block

Scale rule (the library's one rule, `numerics.scaling.scale_from_amax`): scale = fp8_max / block_amax, so the
largest element of every block lands on the format's largest value; a block that is all zeros (or holds inf/NaN)
gets scale 1. The cast itself is `numerics.quantize.quantize` (saturating, nearest or stochastic): this module
adds the blocking, not a second cast.

FP16 storage (the default second moment) goes through the same `quantize` with `FP16_STORAGE`, a description of
float16 in the `FP8Format` shape: nearest rounding only needs the dtype and the largest finite value. The
per-block scale is what lets float16 hold Adam's second moment at all: squared gradients of 1e-5 are 1e-10,
far below float16's smallest subnormal (6e-8).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from lightning_fp8.numerics.formats import E4M3, FP8Format
from lightning_fp8.numerics.quantize import dequantize, quantize
from lightning_fp8.numerics.scaling import scale_from_amax

#: float16 described in the FP8Format shape so that `numerics.quantize` (nearest rounding) casts to it.
#: max_code is unused (it only serves FP8 stochastic rounding, which this format does not support).
FP16_STORAGE = FP8Format(
    name="fp16",
    dtype=torch.float16,
    max=float(torch.finfo(torch.float16).max),  # 65504
    smallest_normal=2.0**-14,
    smallest_subnormal=2.0**-24,
    mantissa_bits=10,
    has_inf=True,
    max_code=-1,
)


def num_blocks(numel: int, block_size: int) -> int:
    """Number of blocks (the last one possibly partial) covering `numel` elements."""
    return math.ceil(numel / block_size) if numel > 0 else 0


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 view [n_blocks, block_size] of the flattened tensor, the last block padded with zeros."""
    flat = x.reshape(-1).to(torch.float32)
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def block_amax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """max |x| of every block, float32 [n_blocks]; inf/NaN propagate (and then give scale 1)."""
    return _blocks(x, block_size).abs().amax(dim=1)


def quantize_blockwise(
    x: torch.Tensor,
    block_size: int,
    fmt: FP8Format = E4M3,
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` (any shape) block by block; returns (data [numel] in fmt.dtype, scale_inv [n_blocks] fp32).

    Each block is cast with scale = fmt.max / amax(block) (1 for an all-zero block). rounding="stochastic" is
    only available for 1-byte formats (it walks the FP8 codes).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if rounding == "stochastic" and fmt.dtype.itemsize != 1:
        raise ValueError(f"stochastic rounding is only defined for FP8 formats, not {fmt.name}")
    numel = x.numel()
    blocks = _blocks(x, block_size)
    amax = blocks.abs().amax(dim=1)
    scale = scale_from_amax(amax, fmt.max, 0, torch.ones_like(amax))
    q = quantize(blocks, scale[:, None], fmt, rounding=rounding, generator=generator).reshape(-1)
    # drop the padding so it is not stored (a slice would keep the padded storage alive)
    data = q[:numel].clone() if q.numel() != numel else q
    return data, scale.reciprocal()


def dequantize_blockwise(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: int,
    shape: Optional[torch.Size] = None,
) -> torch.Tensor:
    """float32 tensor of `shape` (default: flat) from blockwise-quantized data."""
    numel = data.numel()
    blocks = _blocks(data, block_size)  # exact: every FP8 / FP16 value is exact in float32
    out = dequantize(blocks, scale_inv[:, None]).reshape(-1)[:numel]
    return out.reshape(shape if shape is not None else (numel,))
