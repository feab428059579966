"""One scaled cast of one tensor role: amax -> scale -> saturating cast, plus the bookkeeping of the state.

This is the reference for the fused "amax + scale + cast" kernel; FP8Linear calls nothing else to cast.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lightning_fp8.numerics.quantize import quantize, tensor_amax
from lightning_fp8.numerics.scaling import ScalingState
from lightning_fp8.recipe import FP8Recipe


def scaled_cast(
    x: torch.Tensor,
    state: ScalingState,
    recipe: FP8Recipe,
    role: str,
    record: bool,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cast `x` to the role's FP8 format. Returns (x_fp8, scale); dequantize with 1/scale.

    record=True (training) writes the amax and counters into `state`; record=False (evaluation) leaves the state
    untouched and uses current scaling, so evaluation never changes what training will do next.
    """
    fmt = recipe.format_for(role)
    amax = tensor_amax(x)
    if not recipe.uses_scaling_for(role):
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    else:
        scaling = recipe.scaling if record else "current"
        scale = state.scale_for_cast(amax, fmt, scaling, recipe.margin, recipe.power_of_2_scales)
    if record:
        state.record(amax, scale, fmt, recipe.scaling)
    x_fp8 = quantize(x, scale, fmt, rounding=recipe.rounding_for(role), generator=generator)
    return x_fp8, scale
