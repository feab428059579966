"""One scaled cast of one tensor role: amax -> scale -> saturating cast, plus the bookkeeping of the state.

Two paths compute the same thing:
- the torch reference (CPU, or CUDA without triton, or LIGHTNING_FP8_DISABLE_TRITON=1): `tensor_amax`, then
  `ScalingState.scale_for_cast`, then `quantize`;
- the fused path (CUDA with triton): the Triton kernels of `lightning_fp8.kernels`, bit-exact twins of
  `tensor_amax` / `quantize`, with the *same* `ScalingState.scale_for_cast` / `record` calls in between, so the
  scaling rules stay defined once (in numerics/scaling.py) and no host synchronisation happens:
    delayed scaling:  [amax pre-pass, skipped on device once the state is initialised] -> one pass that reads x
                      once and writes x_fp8 (and x_fp8^T) and the amax
    current scaling:  amax pass -> cast pass (the scale depends on this tensor's amax)
    unscaled:         one pass (scale 1; amax only when recording)

FP8Linear calls nothing else to cast.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lightning_fp8 import kernels
from lightning_fp8.numerics.formats import FP8Format
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
    if kernels.fused_cast_enabled_for(x) and x.numel() > 0:
        x2d = _as_2d(x)
        out, _, scale = _scaled_cast_fused(x2d, state, recipe, role, record, generator, write_row=True, write_t=False)
        return out.reshape(x.shape), scale
    fmt = recipe.format_for(role)
    amax = tensor_amax(x)
    scale = cast_scale(x, amax, state, recipe, role, record, fmt)
    if record:
        state.record(amax, scale, fmt, recipe.scaling)
    x_fp8 = quantize(x, scale, fmt, rounding=recipe.rounding_for(role), generator=generator)
    return x_fp8, scale


def scaled_cast_transpose(
    x: torch.Tensor,
    state: ScalingState,
    recipe: FP8Recipe,
    role: str,
    record: bool,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`scaled_cast` of a 2-D tensor that also returns the transpose: (x_fp8, x_fp8^T contiguous, scale).

    The backward GEMMs need each operand in the other layout (`_scaled_mm` takes its first operand row-major and
    its second column-major); on the fused path both layouts come from a single read of `x`."""
    if x.dim() != 2:
        raise ValueError(f"scaled_cast_transpose expects a 2-D tensor, got shape {tuple(x.shape)}")
    if kernels.fused_cast_enabled_for(x) and x.numel() > 0:
        return _scaled_cast_fused(x, state, recipe, role, record, generator, write_row=True, write_t=True)
    x_fp8, scale = scaled_cast(x, state, recipe, role, record, generator)
    return x_fp8, x_fp8.t().contiguous(), scale


def cast_to_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
    layout: str = "row",
):
    """`quantize` with a known scale and no state (e.g. backward's re-cast of the weight with the forward's scale),
    on the fused kernel where available. layout: "row" -> x_fp8; "t" -> x_fp8^T contiguous (2-D x);
    "both" -> (x_fp8, x_fp8^T)."""
    if layout not in ("row", "t", "both"):
        raise ValueError(f"unknown layout {layout!r}; valid: ['row', 't', 'both']")
    if layout != "row" and x.dim() != 2:
        raise ValueError(f"layout={layout!r} needs a 2-D tensor, got shape {tuple(x.shape)}")
    if kernels.fused_cast_enabled_for(x) and x.numel() > 0:
        x2d = _as_2d(x)
        noise, seed = _noise_for(x2d, rounding, generator)
        out, out_t, _ = kernels.fp8_cast(
            x2d, scale, fmt, write_row=layout != "t", write_t=layout != "row", compute_amax=False, noise=noise, seed=seed
        )
        if layout == "row":
            return out.reshape(x.shape)
        return out_t if layout == "t" else (out, out_t)
    q = quantize(x, scale, fmt, rounding=rounding, generator=generator)
    if layout == "row":
        return q
    q_t = q.t().contiguous()
    return q_t if layout == "t" else (q, q_t)


# -- shared pieces ------------------------------------------------------------------------------------------------
def cast_scale(x, amax, state: ScalingState, recipe: FP8Recipe, role: str, record: bool, fmt: FP8Format) -> torch.Tensor:
    """The scale a cast of `x` (amax `amax`) uses under the recipe: 1 for unscaled roles, the state's rule otherwise
    (current scaling outside training). Observers call it to see what the cast saw."""
    if not recipe.uses_scaling_for(role):
        return torch.ones((), dtype=torch.float32, device=x.device)
    scaling = recipe.scaling if record else "current"
    return state.scale_for_cast(amax, fmt, scaling, recipe.margin, recipe.power_of_2_scales)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2:
        return x
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def _noise_for(x2d: torch.Tensor, rounding: str, generator: Optional[torch.Generator]):
    """(noise, seed) for the kernel. By default the same torch.rand draw as `quantize` makes (same shape, dtype,
    device, generator, at the same point of the cast), so the fused path is bit-identical to the reference path on
    the same device; LIGHTNING_FP8_TRITON_RAND=1 draws one seed instead and the kernel makes its own noise."""
    if rounding != "stochastic":
        return None, None
    if kernels.in_kernel_rand():
        seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=x2d.device, dtype=torch.int64)
        return None, seed
    return torch.rand(x2d.shape, generator=generator, device=x2d.device, dtype=torch.float32), None


def _scaled_cast_fused(x2d, state, recipe, role, record, generator, write_row: bool, write_t: bool):
    """The fused path of scaled_cast on a 2-D tensor. Same scale and same state updates as the reference path:
    `state.scale_for_cast` and `state.record` are called with bit-identical amaxes."""
    fmt = recipe.format_for(role)
    rounding = recipe.rounding_for(role)
    if not recipe.uses_scaling_for(role):
        scale = torch.ones((), dtype=torch.float32, device=x2d.device)
        noise, seed = _noise_for(x2d, rounding, generator)
        out, out_t, amax = kernels.fp8_cast(
            x2d, scale, fmt, write_row=write_row, write_t=write_t, compute_amax=record, noise=noise, seed=seed
        )
    elif record and recipe.scaling == "delayed":
        # The scale is the state's own once initialised; before that, it is the current scale of this tensor,
        # which needs its amax first. The pre-pass reads the `initialized` flag on device and does nothing once it
        # is set, so there is no host sync and the steady state reads x once.
        pre_amax = kernels.fp8_amax(x2d, skip_if=state.initialized)
        scale = state.scale_for_cast(pre_amax, fmt, "delayed", recipe.margin, recipe.power_of_2_scales)
        noise, seed = _noise_for(x2d, rounding, generator)
        out, out_t, amax = kernels.fp8_cast(
            x2d, scale, fmt, write_row=write_row, write_t=write_t, compute_amax=True, noise=noise, seed=seed
        )
    else:  # current scaling (training with scaling="current", or evaluation)
        amax = kernels.fp8_amax(x2d)
        scaling = recipe.scaling if record else "current"
        scale = state.scale_for_cast(amax, fmt, scaling, recipe.margin, recipe.power_of_2_scales)
        noise, seed = _noise_for(x2d, rounding, generator)
        out, out_t, _ = kernels.fp8_cast(
            x2d, scale, fmt, write_row=write_row, write_t=write_t, compute_amax=False, noise=noise, seed=seed
        )
    if record:
        state.record(amax, scale, fmt, recipe.scaling)
    if write_row and write_t:
        return out, out_t, scale
    return out, None, scale


__all__ = ["scaled_cast", "scaled_cast_transpose", "cast_to_fp8", "cast_scale"]
