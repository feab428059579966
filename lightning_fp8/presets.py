"""Named recipes for FP8Precision(preset=...), and the recipe `recipe="auto"` picks for a device.

Each preset is an FP8Recipe; the plugin's loss_scaling="auto" picks the loss scaling that goes with it (dynamic for
the E5M2 recipe, whose gradients are cast without a per-tensor scale).

`auto_recipe(device)`: the recipe for the device's compute capability (read through `kernels.device.profile_of`, so
`simulate_cuda((10, 0))` shows the sm100 choice on a CPU), with the reason; the same device always gets the same
recipe. The table:

  no FP8 tensor cores (CPU, < sm89)  the default per-tensor recipe: every GEMM is emulated, and per-tensor scales are
                                     the cheapest to emulate
  sm89, sm90 (Ada, Hopper)           the default per-tensor recipe (delayed scaling): native with one scale per
                                     tensor and fast accumulation in the forward GEMM, Transformer Engine's default
                                     there; layers that need finer scales get them from FP8LayerFallback's ladder
                                     (sm90: blockwise, native there; sm89: rowwise)
  sm100 / sm103 (Blackwell)          mxfp8: 1x32 E8M0 block scaling is native there (cuBLASLt), needs no amax history
                                     and no per-tensor scale, and is Transformer Engine 2.x's default on Blackwell
  sm120 / sm121 (Blackwell RTX)      mxfp8: torch's MX GEMM runs there for the one operand layout every GEMM of this
                                     library uses (row-major x column-major)
  anything else                      the default recipe
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch

from lightning_fp8.kernels.device import DeviceProfile, profile_of
from lightning_fp8.recipe import FP8Recipe

#: the value of FP8Precision(recipe=...) that picks the recipe for the device
AUTO = "auto"

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


class RecipeChoice(NamedTuple):
    """What recipe="auto" chose: the recipe, the device it chose for, and why."""

    recipe: FP8Recipe
    device: str
    reason: str

    def describe(self) -> str:
        return f"recipe='auto' on {self.device}: {self.recipe.label} ({self.reason})"

    def to_dict(self) -> Dict[str, object]:
        return {"recipe": self.recipe.to_dict(), "device": self.device, "reason": self.reason}


def auto_recipe(device=None) -> RecipeChoice:
    """The recipe for `device` (default: the current CUDA device where there is one, else the CPU) by its compute
    capability (module docstring)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = profile_of(device)
    recipe, reason = _choose(profile)
    return RecipeChoice(recipe, profile.name, reason)


def _choose(profile: DeviceProfile):
    capability: Optional[tuple] = profile.capability if profile.is_cuda else None
    if not profile.fp8_tensor_cores:
        return FP8Recipe(), "no FP8 tensor cores: every recipe is emulated, the per-tensor default costs the least"
    if capability < (10, 0):
        return FP8Recipe(), ("per-tensor delayed scaling runs natively with one scale per tensor and fast accumulation "
                             "(Transformer Engine's default on Ada / Hopper); FP8LayerFallback moves layers that need "
                             "finer scales to the next rung of this GPU's ladder")
    if capability[0] == 10:
        return FP8Recipe(scaling="mxfp8"), ("MX block scaling (1x32, E8M0) runs natively on Blackwell, needs no amax "
                                            "history and no per-tensor scale (Transformer Engine 2.x's default there)")
    if capability[0] == 12:
        return FP8Recipe(scaling="mxfp8"), ("MX block scaling runs natively on Blackwell RTX for the row-major x "
                                            "column-major GEMMs this library issues")
    return FP8Recipe(), f"compute capability {capability[0]}.{capability[1]} is not in the auto table: the default recipe"


__all__ = ["PRESETS", "ATTENTION_PATTERNS", "AUTO", "RecipeChoice", "auto_recipe", "get_preset"]
