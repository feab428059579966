"""Escalation: FP8LayerFallback's steps before BF16. A layer whose casts lose too much (a rule fired) first moves to the
next recipe of its GPU's ladder, and only a layer at the top of the ladder moves to BF16.

Why a finer scaling helps: one huge channel (an "outlier feature") makes a per-tensor scale push every other value of
the tensor below the FP8 range, so the weight gradient of the other channels is flushed to zero while the loss looks
healthy. Per-tile scales along the axis a GEMM does not contract give that channel its own scales in the
weight-gradient GEMM, so the layer keeps FP8 speed instead of falling back to BF16.

The ladder per device (`ladder_for`, escalate_to="auto", the default): the recipes its tensor cores run natively, from
the least to the most precise (lightning_fp8/recipe.py, SCALING_ORDER: nvfp4 < delayed = current < rowwise < blockwise
< mxfp8); a layer moves to the first rung more precise than its own, and from the top to BF16:

  sm100 / sm103   nvfp4 -> mxfp8 -> BF16      (per-tensor and blockwise layers: -> mxfp8 -> BF16)
  sm120           ... -> mxfp8 -> BF16
  sm90            per-tensor -> blockwise -> BF16   (blockwise: 1x128 / 128x128, native on sm90 only)
  sm89            per-tensor -> rowwise -> BF16     (rowwise is what sm89's tensor cores scale natively)
  no FP8 cores    per-tensor -> blockwise -> BF16   (everything emulated: the most precise FP8 recipe the GPUs
                                                     most users train on run natively)

escalate_to="rowwise" / "blockwise" / "mxfp8" fixes the one step instead, None moves straight to BF16. The non-finite
rule never escalates (a NaN made in a layer is not a range problem): it moves the layer to BF16 directly.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from lightning_fp8.kernels.device import DeviceProfile
from lightning_fp8.recipe import MICROSCALING_SCALINGS, SCALING_ORDER, FP8Recipe, scale_gradients_with

#: the rules whose failure a finer scaling can cure (too much of an operand clipped, flushed, or lost in noise)
ESCALATING_RULES = ("overflow", "sqnr", "underflow")
AUTO = "auto"
#: the recipes a layer may be moved to (nvfp4 is the least precise: never a step up)
ESCALATION_TARGETS = ("rowwise", "blockwise", "mxfp8")


def check_escalate_to(value: Optional[str]) -> Optional[str]:
    if value is not None and value != AUTO and value not in ESCALATION_TARGETS:
        raise ValueError(f"escalate_to={value!r} is not valid; valid choices: {AUTO!r} (the ladder of the layer's "
                         f"GPU), {list(ESCALATION_TARGETS)}, or None (no escalation: straight to BF16)")
    return value


def ladder_for(profile: DeviceProfile) -> Tuple[str, ...]:
    """The FP8 / FP4 recipes above per-tensor scaling that `profile`'s tensor cores run natively, least precise first
    (module docstring); BF16 is the step after the last."""
    capability = profile.capability if profile.fp8_tensor_cores else None
    if capability is None:
        return ("blockwise",)
    if capability[0] == 10:
        return ("nvfp4", "mxfp8")
    if capability[0] >= 12:
        return ("mxfp8",)
    if capability[0] == 9:
        return ("blockwise",)
    return ("rowwise",)


def describe_ladder(profile: DeviceProfile, current: str = "delayed") -> str:
    """The ladder as a layer of scaling `current` climbs it on `profile`: e.g. "nvfp4 -> mxfp8 -> BF16"."""
    rungs = [current] + [r for r in ladder_for(profile) if SCALING_ORDER[r] > SCALING_ORDER[current]]
    return " -> ".join(rungs + ["BF16"])


def escalation_target(recipe: FP8Recipe, rule: str, escalate_to: Optional[str],
                      profile: Optional[DeviceProfile] = None,
                      layer_scalings: Optional[Tuple[str, ...]] = None) -> Optional[str]:
    """The scaling to move a layer to instead of BF16 (None: move it to BF16). escalate_to="auto": the next rung of
    `profile`'s ladder. layer_scalings: the scalings the layer has a path for (`FP8Layer.fp8_scalings`, None: all); a
    layer is never escalated to one outside them (an FP8 convolution has no path for mxfp8 / nvfp4)."""
    if escalate_to is None or rule not in ESCALATING_RULES:
        return None
    order = SCALING_ORDER[recipe.scaling]
    if escalate_to == AUTO:
        rungs = ladder_for(profile) if profile is not None else ("blockwise",)
        return next((r for r in rungs if SCALING_ORDER[r] > order
                     and (layer_scalings is None or r in layer_scalings)), None)
    if layer_scalings is not None and escalate_to not in layer_scalings:
        return None
    if order >= SCALING_ORDER[escalate_to]:
        return None  # already as fine as escalation goes: it did not help
    return escalate_to


def escalated_recipe(recipe: FP8Recipe, scaling: str) -> FP8Recipe:
    """The layer's recipe with the finer scaling; its formats and everything else stay (a hybrid layer keeps E5M2
    gradients, now with per-tile scales), except between the microscaling recipes and the others, whose formats,
    rounding and transforms differ: those take the new scaling's defaults (nvfp4 -> mxfp8: E4M3, nearest rounding,
    no Hadamard transform). Gradients cast with scale 1 (scale_gradients=False) get scales on a fine-grained target,
    which scales every tile (recipe.scale_gradients_with)."""
    scale_gradients = scale_gradients_with(recipe, scaling)
    if scaling in MICROSCALING_SCALINGS or recipe.scaling in MICROSCALING_SCALINGS:
        return dataclasses.replace(recipe, scaling=scaling, format=None, rounding=None, random_hadamard=None,
                                   scale_gradients=scale_gradients)
    return dataclasses.replace(recipe, scaling=scaling, scale_gradients=scale_gradients)
