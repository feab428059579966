"""Named recipes for FP8Precision(preset=...), and the recipe `recipe="auto"` picks for a device.

Each preset is an FP8Recipe; the plugin's loss_scaling="auto" picks the loss scaling that goes with it (dynamic for
the E5M2 recipe, whose gradients are cast without a per-tensor scale).

`auto_recipe(device)`: the recipe for the device's compute capability (read through `kernels.device.profile_of`, so
`simulate_cuda((10, 0))` shows the sm100 choice on a CPU), with the reason; the same device always gets the same
recipe. Per-tensor delayed scaling (`FP8Recipe()`, the default) is the reference; where the architecture has a
recipe that would suit it better (Blackwell: MX block scaling, Transformer Engine 2.x's default on sm100; on sm120
Transformer Engine picks current scaling), that candidate is taken only where the roofline model
(conversion/roofline.py `predict`) predicts it no slower than per-tensor scaling on that GPU, for one training step
of `REFERENCE_SHAPE` (LLaMA-3 8B's MLP up-projection at 16384 tokens); the reason names the model's figures. The
table:

  no FP8 tensor cores (CPU, < sm89)  the default per-tensor recipe: every GEMM is emulated, and per-tensor scales are
                                     the cheapest to emulate
  sm89, sm90 (Ada, Hopper)           the default per-tensor recipe (delayed scaling): native with one scale per
                                     tensor and fast accumulation in the forward GEMM, Transformer Engine's default
                                     there; layers that need finer scales get them from FP8LayerFallback's ladder
                                     (sm90: blockwise, native there; sm89: rowwise)
  sm100 / sm103 (Blackwell)          candidate mxfp8 (1x32 E8M0 block scaling, native, no amax history, no per-tensor
                                     scale), else per-tensor delayed
  sm120 / sm121 (Blackwell RTX)      candidates mxfp8 (native for the row-major x column-major GEMMs this library
                                     issues), then current scaling (Transformer Engine's choice there), else
                                     per-tensor delayed
  anything else                      the default recipe

The model records the kernels the library launches (the Triton casts, or their torch reference on a machine without
triton), so a faster cast changes the choice without a change here; what it picks per architecture, with the figures,
is in benchmarks/results/roofline.md. The decision is computed once per (capability, Triton kernels or not, GPU model)
and cached: it runs at plugin construction.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import replace
from typing import Dict, NamedTuple, Optional, Tuple

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


#: the layer step the roofline model compares the recipes at: (tokens, in features, out features), LLaMA-3 8B's MLP
#: up-projection at 16384 tokens per step
REFERENCE_SHAPE: Tuple[int, int, int] = (16384, 4096, 14336)

#: per compute-capability major version, the scalings auto considers before the reference (per-tensor delayed
#: scaling), preferred first, with the name the reason gives them; each is taken only where the model predicts it no
#: slower than the reference (and the installed torch has what it needs: `candidates`)
CANDIDATES: Dict[int, Tuple[Tuple[str, str], ...]] = {
    10: (("mxfp8", "mxfp8"),),
    12: (("mxfp8", "mxfp8"), ("current scaling", "current")),
}
REFERENCE: Tuple[str, FP8Recipe] = ("per-tensor delayed", FP8Recipe())


def candidates(major: int) -> Tuple[Tuple[str, FP8Recipe], ...]:
    """The (name, recipe) candidates of compute-capability `major` (CANDIDATES) that the installed torch can run (a
    torch without `float8_e8m0fnu` has no mxfp8)."""
    from lightning_fp8.recipe import SCALING_NEEDS_TORCH
    from lightning_fp8.numerics.formats import torch_has

    return tuple((name, FP8Recipe(scaling=scaling)) for name, scaling in CANDIDATES.get(major, ())
                 if scaling not in SCALING_NEEDS_TORCH or torch_has(SCALING_NEEDS_TORCH[scaling]))


def auto_recipe(device=None) -> RecipeChoice:
    """The recipe for `device` (default: the current CUDA device where there is one, else the CPU) by its compute
    capability and the roofline model (module docstring)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = profile_of(device)
    recipe, reason = _choose(profile, _gpu_name(profile, device))
    return RecipeChoice(recipe, profile.name, reason)


def _gpu_name(profile: DeviceProfile, device) -> Optional[str]:
    """The real GPU's name (its speed model may be in shape_filter.GPU_SPECS); None for a simulated one."""
    if not profile.is_cuda or profile.simulated or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.device(device))


def _choose(profile: DeviceProfile, gpu_name: Optional[str] = None):
    capability: Optional[tuple] = profile.capability if profile.is_cuda else None
    if not profile.fp8_tensor_cores:
        return FP8Recipe(), "no FP8 tensor cores: every recipe is emulated, the per-tensor default costs the least"
    if capability < (10, 0) and capability[0] not in CANDIDATES:
        reason = ("per-tensor delayed scaling runs natively with one scale per tensor and fast accumulation "
                  "(Transformer Engine's default on Ada / Hopper); FP8LayerFallback moves layers that need finer "
                  "scales to the next rung of this GPU's ladder")
        modelled = _modelled(tuple(capability), _triton(profile), gpu_name)
        if modelled is not None:
            (name, speedup), where = modelled[0][0], modelled[1]
            reason += f"; {name} predicted {speedup:.2f}x BF16 at {where} (roofline model)"
        return FP8Recipe(), reason
    if capability[0] not in CANDIDATES:
        return FP8Recipe(), (f"compute capability {capability[0]}.{capability[1]} is not in the auto table: the default "
                             "recipe")
    return _decide(tuple(capability), _triton(profile), gpu_name)


def _triton(profile: DeviceProfile) -> bool:
    """Whether the device's CUDA path runs the Triton kernels (a simulation says; else whether triton is installed)."""
    if profile.simulated:
        return profile.triton
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _decide(capability: Tuple[int, int], triton: bool, gpu_name: Optional[str]) -> Tuple[FP8Recipe, str]:
    """The first candidate of the capability the model predicts no slower than the reference (and faster than BF16),
    else the reference, with the model's figures."""
    runnable = candidates(capability[0])
    if not runnable:
        return REFERENCE[1], (f"{REFERENCE[0]} scaling: this torch ({torch.__version__}) has none of the recipes "
                              f"sm{capability[0]}{capability[1]} would be offered (a newer torch adds them)")
    modelled = _modelled(capability, triton, gpu_name, runnable)
    if modelled is None:  # no speed model for this GPU: the reference
        return REFERENCE[1], f"{REFERENCE[0]} scaling: no speed model for this GPU to compare the candidates with"
    figures, where = modelled
    (ref_name, ref_speedup), offered = figures[0], figures[1:]
    by_name = dict(runnable)
    compared = ", ".join(f"{name} {speedup:.2f}x" for name, speedup in offered)
    for i, (name, speedup) in enumerate(offered):
        if speedup >= ref_speedup and speedup > 1.0:
            passed = "".join(f"; preferred {n} {s:.2f}x, slower" for n, s in offered[:i])
            return by_name[name], (f"{name} predicted {speedup:.2f}x BF16 vs {ref_name} {ref_speedup:.2f}x at {where} "
                                   f"(roofline model): native here and no slower than per-tensor scaling{passed}")
    reason = (f"{ref_name} scaling: predicted {ref_speedup:.2f}x BF16 at {where} (roofline model) against {compared} "
              "for the recipes this GPU could run natively instead: auto picks none the model predicts slower than "
              "per-tensor scaling")
    if ref_speedup <= 1.0:
        reason += ("; no FP8 recipe is predicted faster than BF16 here" + (
            "" if triton else " (without triton the casts run their torch reference: install triton)"))
    return REFERENCE[1], reason


@functools.lru_cache(maxsize=None)
def _modelled(capability: Tuple[int, int], triton: bool, gpu_name: Optional[str],
              candidates: Tuple[Tuple[str, FP8Recipe], ...] = ()):
    """([(name, predicted speedup over BF16)] for the reference and `candidates`, "MxKxN on GPU"), or None where no
    speed model stands for this GPU."""
    from lightning_fp8.conversion import roofline, shape_filter

    spec = shape_filter.spec_for_name(gpu_name) if gpu_name else None
    spec = replace(spec, capability=capability) if spec is not None else shape_filter.spec_for_capability(capability)
    if spec is None:
        return None
    shape = roofline.LayerShape(*REFERENCE_SHAPE)
    figures = []
    for name, recipe in (REFERENCE,) + tuple(candidates):
        launches = roofline.fp8_launches(shape, recipe, capability, triton)
        figures.append((name, roofline.predict(shape, recipe, spec, launches=launches).speedup))
    return figures, f"{'x'.join(map(str, REFERENCE_SHAPE))} on {spec.name}"
