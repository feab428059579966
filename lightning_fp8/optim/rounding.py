"""Stochastic rounding from float32 to bfloat16 / float16, and the seeds that make it reproducible.

Why: a bf16 weight of magnitude 1 has a spacing of 2**-7; an AdamW update of lr=1e-4 is 1/78 of that, so
round-to-nearest throws every such update away and training stalls. Rounding up with probability
(x - lo) / (hi - lo) keeps the *expected* weight equal to the float32 result, so small updates accumulate on
average at no memory cost (a Kahan compensation buffer would cost 2 more bytes per parameter, the same as an
fp32 master copy).

`numerics.quantize` walks FP8 codes and does not cover 16-bit formats; this is the 16-bit counterpart, written
generically with `torch.nextafter` so that one function serves bf16 and fp16, subnormals included.

Reproducibility: the noise of step t of parameter i is drawn from a generator seeded with
`noise_seed(seed, t, i)`, a pure function of values that `state_dict` carries. A checkpoint therefore resumes
bit-identically without saving any generator state (a fused kernel does the same with a counter-based RNG).
"""
from __future__ import annotations

from typing import Optional

import torch

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


def stochastic_round(
    x: torch.Tensor,
    dtype: torch.dtype,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Round float32 `x` to `dtype` (bf16 or fp16), up or down with probabilities that make it unbiased.

    Values beyond the format's range saturate to its largest finite value (an optimizer update must never turn
    a weight into inf); NaN stays NaN. `noise` (uniform [0, 1), x's shape) overrides `generator`.
    """
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(f"stochastic_round targets {list(LOW_PRECISION_DTYPES)}, got {dtype}")
    x = x.to(torch.float32)
    fmax = torch.finfo(dtype).max
    x = torch.clamp(x, -fmax, fmax)
    nearest = x.to(dtype)
    near32 = nearest.to(torch.float32)
    # the neighbour on the other side of x (towards x from `nearest`)
    toward = torch.where(near32 < x, torch.full_like(nearest, float("inf")), torch.full_like(nearest, -float("inf")))
    other = torch.nextafter(nearest, toward).to(torch.float32)
    gap = (other - near32).abs()
    dist = (x - near32).abs()
    p_other = torch.where(gap > 0, dist / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(gap))
    if noise is None:
        noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    # other is finite: x was clamped to the finite range and lies between nearest and other
    take_other = (noise < p_other) & (dist > 0)
    return torch.where(take_other, other, near32).to(dtype)


_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for (base seed, optimizer step, parameter index): splitmix64 of the three, so neighbouring
    steps or parameters do not get correlated streams."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + int(index) * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
