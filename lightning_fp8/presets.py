"""Named recipes for FP8Precision(preset=...). Each is an FP8Recipe; the plugin's loss_scaling="auto" picks the loss
scaling that goes with it (dynamic for the E5M2 recipe, whose gradients are cast without a per-tensor scale)."""
from __future__ import annotations

from typing import Dict

from lightning_fp8.recipe import FP8Recipe

#: names of attention projections in common model families (GPT-2, LLaMA, BERT, nn.MultiheadAttention users)
ATTENTION_PATTERNS = (
    "*attn*",
    "*attention*",
    "*q_proj",
    "*k_proj",
    "*v_proj",
    "*o_proj",
    "*qkv*",
    "*.query",
    "*.key",
    "*.value",
    "*out_proj",
)

PRESETS: Dict[str, FP8Recipe] = {
    # HYBRID formats, delayed per-tensor scaling, first and last linear in BF16: the TE-style default
    "default": FP8Recipe(),
    # current scaling (no stale scales after a sudden change), attention projections kept in BF16
    "conservative": FP8Recipe(scaling="current", skip_patterns=ATTENTION_PATTERNS),
    # Mellempudi et al., "Mixed Precision Training With 8-bit Floating Point" (2019): E5M2 everywhere,
    # stochastic rounding of gradients, gradients cast without a per-tensor scale (dynamic loss scaling instead)
    "mellempudi": FP8Recipe(format="e5m2", scaling="current", rounding="stochastic", scale_gradients=False),
}


def get_preset(name: str) -> FP8Recipe:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 preset {name!r}; valid presets: {sorted(PRESETS)}") from None
