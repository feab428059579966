"""Quantization statistics of one tensor under one scale: the single definition of the numbers the monitoring and
fallback callbacks (and the report) show.

For a high-precision tensor `x` that is about to be cast to FP8 format `fmt` with quantization scale `scale`
(`x_fp8 = quantize(x, scale, fmt)`, TE's convention, see `quantize.py`):

- overflow fraction: elements whose scaled value does not fit the format, |x * scale| > fmt.max (they are clipped
  to +-max by the saturating cast), plus non-finite elements; counted over the *whole* tensor, so a single clipped
  value is never missed by sampling;
- underflow fraction: non-zero finite elements that the cast flushes to zero, over the non-zero finite elements of
  a sample;
- SQNR: signal-to-quantization-noise ratio of the round trip `dequantize(quantize(x))` on the same sample,
  10 log10(sum x^2 / sum (x - x_roundtrip)^2) in dB; +inf when the sample round-trips exactly, NaN when the sample is
  all zeros (no signal).

The round trip uses the library's own `quantize` / `dequantize` (the same saturating cast FP8Linear uses), never a
second cast implementation. Everything stays in tensors (no host synchronisation): callers batch the `.tolist()`.

The sample is a fixed-size subset of the elements (all of them when the tensor is smaller than `sample_size`), drawn
with the caller's `torch.Generator` so the training run's own random stream is never touched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import dequantize, quantize, tensor_amax

#: default number of elements the sampled statistics (underflow, SQNR) look at
DEFAULT_SAMPLE_SIZE = 4096


@dataclass
class QuantStats:
    """Sufficient statistics of one cast (0-dim float64 tensors on the tensor's device: sums of squares of large
    unscaled values would overflow float32, and counts stay exact).

    They are sums (and one max), so the statistics of several casts of the same role in one step (gradient
    accumulation, a layer called twice) combine by adding them up; the fractions and the SQNR are computed from the
    sums (`overflow_fraction`, `underflow_fraction`, `sqnr_db`)."""

    amax: torch.Tensor  # max |x| over the whole tensor (NaN / inf propagate)
    numel: torch.Tensor  # elements of the whole tensor
    overflow: torch.Tensor  # elements with |x * scale| > max, or non-finite
    sampled: torch.Tensor  # elements in the sample
    nonzero: torch.Tensor  # finite non-zero elements of the sample
    underflow: torch.Tensor  # of those, flushed to zero by the cast
    signal: torch.Tensor  # sum of x^2 over the finite elements of the sample
    noise: torch.Tensor  # sum of (x - dequantize(quantize(x)))^2 over the same elements

    def overflow_fraction(self) -> torch.Tensor:
        return overflow_fraction(self.overflow, self.numel)

    def underflow_fraction(self) -> torch.Tensor:
        return underflow_fraction(self.underflow, self.nonzero)

    def sqnr_db(self) -> torch.Tensor:
        return sqnr_db(self.signal, self.noise)

    def as_tensor(self) -> torch.Tensor:
        """The eight numbers as one float64 vector (field order), for one batched device-to-host copy."""
        return torch.stack([getattr(self, f.name).reshape(()).to(torch.float64) for f in fields(self)])


STAT_FIELDS = tuple(f.name for f in fields(QuantStats))


def overflow_fraction(overflow, numel):
    """Fraction of elements clipped by the cast (0 for an empty tensor). Works on tensors and on floats."""
    if isinstance(overflow, torch.Tensor):
        return torch.where(numel > 0, overflow / torch.clamp(numel, min=1), torch.zeros_like(overflow))
    return overflow / numel if numel > 0 else 0.0


def underflow_fraction(underflow, nonzero):
    """Fraction of the non-zero elements flushed to zero (0 when there are none). Works on tensors and on floats."""
    if isinstance(underflow, torch.Tensor):
        return torch.where(nonzero > 0, underflow / torch.clamp(nonzero, min=1), torch.zeros_like(underflow))
    return underflow / nonzero if nonzero > 0 else 0.0


def sqnr_db(signal, noise):
    """10 log10(signal / noise) in dB: +inf for an exact round trip, NaN without signal. Tensors or floats."""
    if isinstance(signal, torch.Tensor):
        signal = signal.to(torch.float64)
        noise = noise.to(torch.float64)
        ratio = torch.where(signal > 0, signal / noise, torch.full_like(signal, float("nan")))
        return 10.0 * torch.log10(ratio)
    if not signal > 0:
        return float("nan")
    if noise == 0:
        return float("inf")
    return 10.0 * math.log10(signal / noise)


def sample_indices(n: int, sample_size: int, generator: Optional[torch.Generator], device) -> Optional[torch.Tensor]:
    """The flat indices `sample_elements` draws for a tensor of n elements (None: all of them)."""
    if sample_size <= 0 or n <= sample_size:
        return None
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(n, (sample_size,), generator=generator, device=gen_device).to(device, non_blocking=True)


def sample_elements(x: torch.Tensor, sample_size: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A 1-D sample of `sample_size` elements of `x` drawn uniformly (with replacement) by `generator`, or all of
    `x` flattened when it has no more elements than that. The indices are drawn on the generator's device (CPU for a
    default generator) and moved to x's device, so a CPU generator can sample a CUDA tensor."""
    flat = x.reshape(-1)
    n = flat.numel()
    if sample_size <= 0 or n <= sample_size:
        return flat
    gen_device = generator.device if generator is not None else torch.device("cpu")
    idx = torch.randint(n, (sample_size,), generator=generator, device=gen_device)
    return flat[idx.to(x.device, non_blocking=True)]


@torch.no_grad()
def quantization_stats(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    generator: Optional[torch.Generator] = None,
    rounding: str = "nearest",
    amax: Optional[torch.Tensor] = None,
) -> QuantStats:
    """Statistics of casting `x` to `fmt` with quantization scale `scale` (see the module docstring).

    scale: a scalar, or one scale per element of x (x's shape: a fine-grained cast's tile scales, expanded), sampled
    at the same elements as x.
    rounding: the cast's rounding ("stochastic" draws its noise from `generator` too). amax: pass it when already
    computed (it is `tensor_amax(x)`).
    """
    x = x.detach()
    scale = scale.detach().to(device=x.device, dtype=torch.float32)
    if amax is None:
        amax = tensor_amax(x)
    numel = x.numel()
    # overflow over the whole tensor: the product in float32, as `quantize` computes it; NaN fails `<=` and counts
    in_range = torch.count_nonzero((x.to(torch.float32) * scale).abs_() <= fmt.max)
    overflow = (numel - in_range).to(torch.float64)

    if scale.numel() > 1:
        idx = sample_indices(x.numel(), sample_size, generator, x.device)
        xs = x.reshape(-1)[idx].to(torch.float32) if idx is not None else x.reshape(-1).to(torch.float32)
        scale = scale.reshape(-1)[idx] if idx is not None else scale.reshape(-1)
    else:
        xs = sample_elements(x, sample_size, generator).to(torch.float32)
    roundtrip = _round_trip(xs, scale, fmt, rounding, generator)
    finite = torch.isfinite(xs)
    nonzero_mask = finite & (xs != 0)
    flushed = nonzero_mask & (roundtrip == 0)
    xs_f = torch.where(finite, xs, torch.zeros_like(xs))
    err = torch.where(finite, xs - roundtrip, torch.zeros_like(xs))
    f64 = dict(dtype=torch.float64, device=x.device)
    return QuantStats(
        amax=amax.to(torch.float64),
        numel=torch.tensor(float(numel), **f64),
        overflow=overflow,
        sampled=torch.tensor(float(xs.numel()), **f64),
        nonzero=nonzero_mask.sum().to(torch.float64),
        underflow=flushed.sum().to(torch.float64),
        signal=(xs_f.to(torch.float64) ** 2).sum(),
        noise=(err.to(torch.float64) ** 2).sum(),
    )


def _round_trip(xs: torch.Tensor, scale: torch.Tensor, fmt: FP8Format, rounding: str, generator) -> torch.Tensor:
    """dequantize(quantize(xs)): the cast FP8Linear makes, back in float32; FP4 (NVFP4's elements) through its codes."""
    if fmt.bits == 4:
        from lightning_fp8.numerics.microscaling import fp4_codes, fp4_values

        noise = torch.rand(xs.shape, generator=generator, device=xs.device) if rounding == "stochastic" else None
        scaled = torch.clamp(xs * scale, -fmt.max, fmt.max)
        return fp4_values(fp4_codes(scaled, noise)) / scale
    return dequantize(quantize(xs, scale, fmt, rounding=rounding, generator=generator), scale.reciprocal())
