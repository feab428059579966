"""The torch twins of the kernels in `triton_cast.py`: what each kernel variant must reproduce.

They are thin compositions of `lightning_fp8.numerics` (the single definition of quantize / amax); the CPU path of
the library and the tests use them, the CUDA path uses the Triton kernels.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize, tensor_amax


def cast_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    *,
    write_row: bool = True,
    write_t: bool = False,
    compute_amax: bool = True,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    stochastic: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(x_fp8 row-major, x_fp8^T row-major, amax) of a 2-D `x`; entries not asked for are None."""
    amax = tensor_amax(x) if compute_amax else None
    out = out_t = None
    if write_row or write_t:
        rounding = "stochastic" if (stochastic or noise is not None) else "nearest"
        q = quantize(x, scale, fmt, rounding=rounding, noise=noise, generator=generator)
        out = q.contiguous() if write_row else None
        out_t = q.t().contiguous() if write_t else None
    return out, out_t, amax


def amax_reference(x: torch.Tensor, skip_if: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max|x| in float32; 0 where the device flag `skip_if` is set (delayed scaling's pre-pass)."""
    amax = tensor_amax(x)
    if skip_if is None:
        return amax
    return torch.where(skip_if, torch.zeros_like(amax), amax)
