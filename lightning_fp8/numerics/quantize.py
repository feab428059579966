"""Quantize / dequantize: the torch reference that defines what every FP8 cast in this library means.

Facts about torch's casts this module is built around:
- torch's cast to e4m3fn saturates silently and maps +inf to 448; the cast to e5m2 overflows to inf. So we clamp
  explicitly to +-max before every cast, which makes both formats saturate the same way, and overflow is detected
  from the amax (see `scaling.py`), never from the cast result.
- NaN stays NaN through the clamp and the cast, so a NaN input is never turned into a finite number.

Kernels in `lightning_fp8.kernels` must reproduce `quantize` bit for bit; tests compare them.
"""
from __future__ import annotations

from typing import Optional

import torch

from lightning_fp8.numerics.formats import FP8Format

ROUNDING_MODES = ("nearest", "stochastic")


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 scalar tensor (0 for an empty tensor). NaN and inf propagate, which is what lets
    the scaling state see an overflow."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


def saturate(x_scaled: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Clamp to the format's finite range; NaN passes through unchanged."""
    return torch.clamp(x_scaled, -fmt.max, fmt.max)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    rounding: str = "nearest",
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Cast `x * scale` to FP8 with explicit saturation.

    `scale` is the quantization multiplier (TE's convention: `x_fp8 = cast(x * scale)`), a float32 scalar
    tensor or a tensor broadcastable to `x`. The product is computed in float32 so that the result does not
    depend on x's dtype beyond its exact conversion to float32.

    rounding="stochastic" rounds each value up or down to one of its two FP8 neighbours with the probability
    that makes the expectation equal the input. `noise`, uniform in [0, 1) with x's shape, makes the draw
    reproducible (kernels are tested against the reference with the same noise); otherwise it is drawn
    from `generator`.
    """
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; valid choices: {list(ROUNDING_MODES)}")
    if fmt.bits != 8:
        raise ValueError(f"quantize casts to the FP8 formats; {fmt.name} elements are cast by "
                         "lightning_fp8.numerics.microscaling (quantize_nvfp4, fp4_codes)")
    y = saturate(x.to(torch.float32) * scale, fmt)
    if rounding == "nearest":
        return y.to(fmt.dtype)
    if noise is None:
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=torch.float32)
    return _stochastic_round(y, fmt, noise)


def dequantize(x_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Back to high precision: every FP8 value is exact in float32 (and in bf16), so only the multiply rounds."""
    return (x_fp8.to(torch.float32) * scale_inv).to(dtype)


def _stochastic_round(y: torch.Tensor, fmt: FP8Format, noise: torch.Tensor) -> torch.Tensor:
    """Round already-saturated float32 values to one of their two FP8 neighbours, unbiased.

    Works on the uint8 codes of the format: for non-negative magnitudes the code order is the value order, so the
    neighbour of a code is the code +-1. This handles subnormals and zero with no special case, which the usual
    "add random bits below the mantissa" trick does not.
    """
    nearest = y.to(fmt.dtype)
    codes = nearest.view(torch.uint8).to(torch.int16)
    sign = codes & 0x80
    mag_code = codes & 0x7F
    magnitude = y.abs()
    nearest_mag = nearest.to(torch.float32).abs()
    # the other neighbour lies on the far side of the input from the nearest value
    other_code = torch.where(nearest_mag > magnitude, mag_code - 1, mag_code + 1).clamp(0, fmt.max_code)
    other_mag = _decode_magnitude(other_code, fmt)
    lo = torch.minimum(nearest_mag, other_mag)
    hi = torch.maximum(nearest_mag, other_mag)
    gap = hi - lo
    p_up = torch.where(gap > 0, (magnitude - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    round_up = noise < p_up
    lo_code = torch.minimum(mag_code, other_code)
    hi_code = torch.maximum(mag_code, other_code)
    chosen = torch.where(round_up, hi_code, lo_code)
    exact = nearest_mag == magnitude
    chosen = torch.where(exact, mag_code, chosen)
    # NaN keeps the nearest cast's code; selected on the bytes (torch < 2.7 has no `where` for float8 on CPU)
    codes_out = torch.where(torch.isnan(y), nearest.view(torch.uint8), (chosen | sign).to(torch.uint8))
    return codes_out.view(fmt.dtype)


def _decode_magnitude(code: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    return code.to(torch.uint8).view(fmt.dtype).to(torch.float32)
