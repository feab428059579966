"""Per-tensor scaling: where every scale in the library is defined, as functions of tensors.

The state of one tensor role (input, weight or gradient of one layer) is its **amax history**, a float32 vector of
L + 1 slots: slot 0 accumulates the raw amax of the step in progress (max over every cast of the step: gradient
accumulation, a layer called twice), slots 1..L hold the amaxes of the last L completed steps, newest first.
Everything else is derived from it, so there is nothing else to keep consistent:

- scale = fp8_max / amax / 2**margin (TE's convention: the multiplier applied before the cast), clamped to the
  largest float32, optionally rounded down to a power of two (then scaling and unscaling are exact).
- delayed scaling: a cast uses the scale of the *reference amax* of the completed steps, max(slots 1..L) ("max") or
  slot 1 ("most_recent"). A role whose completed steps hold no amax (a fresh layer) casts with current scaling, so
  the first steps are safe without calibration. The scale is derived at cast time under the *cast's* recipe, so a
  recipe override (`fp8_autocast(recipe=...)`) can never use a scale sized for another format.
- current scaling: the scale of the amax of the tensor being cast.
- amax 0, inf or NaN never produce a scale: the previous one is kept (`scale_from_amax`'s fallback).

Closing a step (`close_step`, once per optimizer step, for every layer at once by the engine or lazily by a layer
without one) turns slot 0 into history:
- a non-finite amax is an *overflow event*: counted, never written into the history (so one bad step cannot poison
  the scales of the steps that follow). For a role cast without a scale (scale_gradients=False), a finite amax above
  the format's range is saturation the cast hid, and counts as an overflow too.
- a delayed-scaling step whose amax exceeded the range of the scale its casts used is a *clip*: counted.
- a taken step with a non-zero amax shifts into slot 1; a rejected (skipped) step, or a role that saw only zeros or
  did not run, leaves the history as it was. Slot 0 is cleared either way.

All of it stays in tensor operations on any leading shape ([L+1], [3, L+1], [layers, 3, L+1]), with no host
synchronisation, so one call closes every role of every layer of a model. The CUDA cast kernels compute the same
scales in-kernel (kernels/triton_cast.py) and are tested bit-exactly against these functions.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple, Union

import torch

_FLOAT32_MAX = torch.finfo(torch.float32).max

Scalarish = Union[float, int, bool, torch.Tensor]


def power_of_2_floor(scale: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= scale (positive finite scale). frexp gives the exact binary exponent
    (scale = m * 2**e, 0.5 <= m < 1); floor(log2(.)) rounds up just below a power of two, and the resulting scale
    would clip the amax itself."""
    _, exponent = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(scale), exponent - 1)


def scale_from_amax(
    amax: torch.Tensor,
    fp8_max: Scalarish,
    margin: Scalarish,
    previous_scale: Union[torch.Tensor, float],
    power_of_2: Scalarish = False,
) -> torch.Tensor:
    """New scale for an amax, falling back to `previous_scale` when amax is 0, inf or NaN. Elementwise: every
    argument may be a tensor broadcastable to amax (one format / margin / power-of-2 choice per role)."""
    usable = torch.isfinite(amax) & (amax > 0)
    safe_amax = torch.where(usable, amax, torch.ones_like(amax))
    if isinstance(margin, torch.Tensor):
        divisor = torch.exp2(margin.to(torch.float32))
    else:
        divisor = 2.0**margin
    # IEEE float32 divisions, as the kernels compute them (a Python number over a tensor would be computed by torch
    # as reciprocal-then-multiply, which rounds twice)
    numerator = fp8_max if isinstance(fp8_max, torch.Tensor) else torch.full_like(safe_amax, float(fp8_max))
    scale = torch.div(numerator, safe_amax) / divisor
    scale = torch.clamp(scale, max=_FLOAT32_MAX)
    if isinstance(power_of_2, torch.Tensor):
        scale = torch.where(power_of_2, power_of_2_floor(scale), scale)
    elif power_of_2:
        scale = power_of_2_floor(scale)
    if not isinstance(previous_scale, torch.Tensor):
        previous_scale = torch.full_like(scale, float(previous_scale))
    return torch.where(usable, scale, previous_scale)


def reference_amax(history: torch.Tensor, algo_max: Union[bool, torch.Tensor]) -> torch.Tensor:
    """The amax a delayed-scaling cast sizes its scale for: max of the completed steps (slots 1..L) or the most
    recent one (slot 1). history: [..., L+1]; algo_max: True for "max" (or a bool tensor, one per row)."""
    past = history[..., 1:]
    if isinstance(algo_max, torch.Tensor):
        return torch.where(algo_max, past.amax(dim=-1), past[..., 0])
    return past.amax(dim=-1) if algo_max else past[..., 0]


def cast_scale(
    history: torch.Tensor,
    amax: torch.Tensor,
    fp8_max: float,
    scaling: str,
    algo_max: bool,
    margin: int,
    power_of_2: bool,
) -> torch.Tensor:
    """The quantization scale of one cast. history: the role's [L+1] amax history; amax: max|x| of the tensor
    being cast (used by current scaling, and by delayed scaling before the role has history).

    scaling: "delayed", "current", or "none" (scale 1: a gradient cast without per-tensor scaling)."""
    if scaling == "none":
        return torch.ones((), dtype=torch.float32, device=amax.device)
    # the scale of the last completed step: what "keep the previous scale" falls back to
    previous = scale_from_amax(history[1], fp8_max, margin, 1.0, power_of_2)
    current = scale_from_amax(amax, fp8_max, margin, previous, power_of_2)
    if scaling == "current":
        return current
    ref = reference_amax(history, algo_max)
    delayed = scale_from_amax(ref, fp8_max, margin, current, power_of_2)  # no reference amax yet: current scaling
    return delayed


class StepConstants(NamedTuple):
    """The recipe constants that closing a scaling step reads, one value per row of the history it closes: per role
    for one layer ([3]), per (layer, role) for the engine's stacked close ([layers, 3]). The one record of them: the
    layer state builds it (modules/layer_state.py), the engine stacks it (engine/step_closer.py), the close op takes
    it flat (kernels/ops.py: a torch.library schema takes tensors, not records).

    fp8_max: float32, the format's largest value; scaled: the role is cast with a scale; delayed: delayed scaling;
    algo_max: the reference amax is the history's max (else its newest slot); margin: float32, the scale's margin in
    powers of two; power_of_2: scales are rounded down to a power of two."""

    fp8_max: torch.Tensor
    scaled: torch.Tensor
    delayed: torch.Tensor
    algo_max: torch.Tensor
    margin: torch.Tensor
    power_of_2: torch.Tensor


def step_flags(history: torch.Tensor, constants: StepConstants) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(step amax with non-finite values cleared, overflow, clip) of the step in progress, per row.

    history: [..., L+1]; constants: per-row recipe constants broadcastable to history[..., 0]."""
    fp8_max, scaled, delayed, algo_max, margin, power_of_2 = constants
    amax = history[..., 0]
    finite = torch.isfinite(amax)
    overflow = ~finite | (~scaled & (amax > fp8_max))
    ref = reference_amax(history, algo_max)
    used = scale_from_amax(ref, fp8_max, margin, 1.0, power_of_2)
    clip = finite & scaled & delayed & (ref > 0) & (amax * used > fp8_max)
    clean = torch.where(finite, amax, torch.zeros_like(amax))
    return clean, overflow, clip


def advance_history(history: torch.Tensor, step_amax: torch.Tensor, taken: Union[bool, torch.Tensor]) -> torch.Tensor:
    """The history after a step: a taken step with a non-zero (finite) amax shifts into slot 1; otherwise the
    completed slots are unchanged. Slot 0 is cleared. history: [..., L+1]; step_amax: [...] (finite)."""
    advance = step_amax > 0
    if isinstance(taken, torch.Tensor):
        advance = advance & taken
    elif not taken:
        advance = torch.zeros_like(advance)
    shifted = torch.cat([step_amax.unsqueeze(-1), history[..., 1:-1]], dim=-1)
    past = torch.where(advance.unsqueeze(-1), shifted, history[..., 1:])
    return torch.cat([torch.zeros_like(step_amax).unsqueeze(-1), past], dim=-1)


def close_step(
    history: torch.Tensor, constants: StepConstants, taken: Union[bool, torch.Tensor] = True
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new history, overflow, clip) after closing the step in progress (see the module docstring); a single
    process's version of what the engine does around a cross-rank MAX of the step amax."""
    clean, overflow, clip = step_flags(history, constants)
    return advance_history(history, clean, taken), overflow, clip
