"""Escalation: FP8LayerFallback's step before BF16. A layer whose casts lose too much (a rule fired) first moves to a
finer scaling, and only a layer that is already there moves to BF16.

Why a finer scaling helps: one huge channel (an "outlier feature") makes a per-tensor scale push every other value of
the tensor below the FP8 range, so the weight gradient of the other channels is flushed to zero (measured: 0 dB at
x1e6, docs/numerics.md) while the loss looks healthy. Per-tile scales along the axis a GEMM does not contract give
that channel its own scales in the weight-gradient GEMM (28.5 dB at x1e6), so the layer keeps FP8 speed instead of
falling back to BF16.

Order of scalings (lightning_fp8/recipe.py, SCALING_ORDER): delayed = current < rowwise < blockwise. The non-finite
rule never escalates (a NaN made in a layer is not a range problem): it moves the layer to BF16 directly.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from lightning_fp8.recipe import FINE_GRAINED_SCALINGS, SCALING_ORDER, FP8Recipe

#: the rules whose failure a finer scaling can cure (too much of an operand clipped, flushed, or lost in noise)
ESCALATING_RULES = ("overflow", "sqnr", "underflow")


def check_escalate_to(value: Optional[str]) -> Optional[str]:
    if value is not None and value not in FINE_GRAINED_SCALINGS:
        raise ValueError(f"escalate_to={value!r} is not valid; valid choices: {list(FINE_GRAINED_SCALINGS)} or None "
                         "(no escalation: straight to BF16)")
    return value


def escalation_target(recipe: FP8Recipe, rule: str, escalate_to: Optional[str],
                      layer_scalings: Optional[Tuple[str, ...]] = None) -> Optional[str]:
    """The scaling to move a layer to instead of BF16 (None: move it to BF16). layer_scalings: the scalings the
    layer has a path for (`FP8Layer.fp8_scalings`, None: all); a layer is never escalated to one outside them (an
    FP8 convolution has no path for a scaling added to FP8Recipe after it)."""
    if escalate_to is None or rule not in ESCALATING_RULES:
        return None
    if layer_scalings is not None and escalate_to not in layer_scalings:
        return None
    if SCALING_ORDER[recipe.scaling] >= SCALING_ORDER[escalate_to]:
        return None  # already as fine as escalation goes: it did not help
    return escalate_to


def escalated_recipe(recipe: FP8Recipe, scaling: str) -> FP8Recipe:
    """The layer's recipe with the finer scaling; its formats and everything else stay (a hybrid layer keeps E5M2
    gradients, now with per-tile scales)."""
    return dataclasses.replace(recipe, scaling=scaling)


__all__ = ["ESCALATING_RULES", "check_escalate_to", "escalation_target", "escalated_recipe"]
