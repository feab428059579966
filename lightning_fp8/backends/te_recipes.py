"""FP8Recipe -> Transformer Engine recipe: the TE recipe object that computes what a lightning_fp8 recipe says, or
the fields of it that TE cannot express.

    scaling    TE recipe              fields set from the FP8Recipe
    delayed    DelayedScaling         fp8_format, margin, amax_history_len, amax_compute_algo,
                                      scaling_factor_compute_algo (power_of_2_scales)
    current    Float8CurrentScaling   fp8_format, use_power_2_scales and fp8_quant_* (power_of_2_scales),
                                      fp8_gemm_fprop (fast_accum_forward)
    blockwise  Float8BlockScaling     fp8_format, use_f32_scales and fp8_quant_* (power_of_2_scales);
                                      1 x 128 inputs and gradients, 128 x 128 weights (block_size 128)
    mxfp8      MXFP8BlockScaling      fp8_format E4M3, 1 x 32 blocks (enable_2d_quantization=False)
    nvfp4      NVFP4BlockScaling      disable_rht (random_hadamard), disable_stochastic_rounding (rounding),
                                      16 x 16 weight blocks (disable_2d_quantization=False)

`FIELD_MAPPING` says, for every FP8Recipe field, where it goes. Every TE field that has an environment-variable
default in TE (NVTE_BACKWARD_OVERRIDE, NVTE_NVFP4_*, ...) is passed explicitly, so the recipe built does not depend on
the environment. TE's recipe classes are pydantic dataclasses that ignore keyword arguments they do not know: a field
the installed TE lacks is refused here, by name, instead of being dropped.
"""
from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import torch

from lightning_fp8.numerics.scaling import scale_from_amax
from lightning_fp8.recipe import FP8Recipe

#: the Transformer Engine release this mapping is tested against, with TE's own recipe classes
TESTED_TE_VERSION = "2.20.2"

#: our scaling -> the TE recipe class that expresses it (rowwise has none)
TE_RECIPE_CLASSES: Dict[str, str] = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "blockwise": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}

#: the FP8Recipe.backend values TE runs as they say: TE's own GEMMs on the GPU
TE_GEMM_BACKENDS = ("auto", "scaled_mm")

#: every FP8Recipe field, and what becomes of it on the TE backend
FIELD_MAPPING: Dict[str, str] = {
    "format": "fp8_format (hybrid -> Format.HYBRID, e4m3 -> Format.E4M3; mxfp8: E4M3; nvfp4: fp4_format E2M1); "
              "e5m2 refused",
    "scaling": "the TE recipe class (TE_RECIPE_CLASSES); rowwise refused",
    "amax_history_len": "DelayedScaling.amax_history_len; the other scalings do not use it (in lightning_fp8 either)",
    "amax_compute_algo": "DelayedScaling.amax_compute_algo; the other scalings do not use it",
    "margin": "DelayedScaling.margin; refused unless 0 for current and blockwise; mxfp8 / nvfp4 ignore it",
    "rounding": "NVFP4BlockScaling.disable_stochastic_rounding; 'stochastic' refused for the other scalings",
    "scale_gradients": "False refused",
    "power_of_2_scales": "delayed: scaling_factor_compute_algo=power_of_2_delayed_scale; current / blockwise: "
                         "fp8_quant_*.power_2_scale (and use_power_2_scales / use_f32_scales); mxfp8 / nvfp4 "
                         "ignore it",
    "keep_first_last_in_bf16": "the conversion filter (which layers become te.Linear), not the TE recipe",
    "skip_patterns": "the conversion filter, not the TE recipe",
    "backend": "'auto' / 'scaled_mm': TE runs its own GPU GEMMs; any other (emulated GEMMs) refused",
    "fast_accum_forward": "Float8CurrentScaling.fp8_gemm_fprop; delayed: False refused (TE's forward GEMM uses fast "
                          "accumulation); fine-grained scalings never use it (neither does lightning_fp8)",
    "block_size": "Float8BlockScaling takes 128 only; the other scalings ignore it",
    "weight_grad": "'high_precision' refused (TE's backward_override='high_precision' is another recipe)",
    "keep_last_blocks_in_bf16": "the conversion filter, not the TE recipe",
    "random_hadamard": "NVFP4BlockScaling.disable_rht",
    "allow_emulation": "not applicable: it governs lightning_fp8's own GEMM planner",
}


class Refusal(NamedTuple):
    """A field of an FP8Recipe that TE cannot express: its value, why, and the values TE can express."""

    field: str
    value: Any
    why: str
    valid: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r} ({self.why}; valid choices: {self.valid})"


def te_refusals(recipe: FP8Recipe) -> List[Refusal]:
    """Every field of `recipe` that Transformer Engine cannot express (empty: TE can run it)."""
    scaling = recipe.scaling
    if scaling not in TE_RECIPE_CLASSES:
        return [Refusal("scaling", scaling, "Transformer Engine has no recipe with one scale per row over the whole "
                        "contraction dimension", str(list(TE_RECIPE_CLASSES)))]
    te_class = TE_RECIPE_CLASSES[scaling]
    refusals = []
    if recipe.format == "e5m2":
        refusals.append(Refusal("format", recipe.format, "Transformer Engine refuses pure E5M2 training",
                                "['hybrid', 'e4m3']"))
    if recipe.rounding == "stochastic" and scaling != "nvfp4":
        refusals.append(Refusal("rounding", recipe.rounding, "Transformer Engine rounds stochastically only the "
                                "gradients of NVFP4BlockScaling", f"['nearest'] with scaling={scaling!r}"))
    if not recipe.scale_gradients:
        refusals.append(Refusal("scale_gradients", False, "Transformer Engine scales every tensor it casts", "[True]"))
    if recipe.margin and scaling in ("current", "blockwise"):
        refusals.append(Refusal("margin", recipe.margin, f"{te_class} has no margin",
                                f"[0] with scaling={scaling!r}, or scaling='delayed'"))
    if scaling == "blockwise" and recipe.block_size != 128:
        refusals.append(Refusal("block_size", recipe.block_size, "Float8BlockScaling's blocks are 1 x 128 and "
                                "128 x 128", "[128]"))
    if scaling == "delayed" and not recipe.fast_accum_forward:
        refusals.append(Refusal("fast_accum_forward", False, "DelayedScaling runs the forward GEMM with fast "
                                "accumulation", "[True] with scaling='delayed', or scaling='current'"))
    if recipe.weight_grad == "high_precision":
        refusals.append(Refusal("weight_grad", recipe.weight_grad, "Transformer Engine's "
                                "backward_override='high_precision' computes the input gradient in high precision "
                                "too, not only the weight gradient", "['quantized']"))
    if recipe.backend not in TE_GEMM_BACKENDS:
        refusals.append(Refusal("backend", recipe.backend, "Transformer Engine runs its own GPU GEMMs: lightning_fp8's "
                                "emulated GEMMs do not apply to them", str(list(TE_GEMM_BACKENDS))))
    return refusals


def power_of_2_delayed_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, recipe: Any) -> torch.Tensor:
    """DelayedScaling.scaling_factor_compute_algo for FP8Recipe(power_of_2_scales=True), called by TE as
    `fn(amax, old_scaling_factor, fp8_max, recipe)`: lightning_fp8's delayed scale (`scale_from_amax`:
    fp8_max / amax / 2**recipe.margin in float32, rounded down to a power of two; the old scale where amax is 0, inf or
    NaN). A module-level function: TE pickles the recipe into its checkpoints, and sets a layer's FP8 state up again
    whenever the recipe in autocast does not compare equal to the last one, so two recipes built from the same
    FP8Recipe must hold the same function."""
    return scale_from_amax(amax, fp8_max, recipe.margin, scale, power_of_2=True)


#: what a builder returns: the TE class name, the fields that carry the FP8Recipe's meaning (the installed TE must take
#: them), the fields pinned to TE's defaults against its environment variables (passed where TE has them), and the
#: attributes set on the object after construction (TE reads them, but they are class attributes, not fields)
Build = Tuple[str, Dict[str, Any], Dict[str, Any], Dict[str, Any]]

_NO_ATTENTION = {"fp8_dpa": False, "fp8_mha": False, "backward_override": None}


def _fp8_format(te: ModuleType, recipe: FP8Recipe) -> Any:
    return te.Format.HYBRID if recipe.format == "hybrid" else te.Format.E4M3


def _quantization_params(te: ModuleType, power_of_2: bool) -> Dict[str, Any]:
    params = te.QParams(power_2_scale=power_of_2, amax_epsilon=0.0)
    return {"fp8_quant_fwd_inp": params, "fp8_quant_fwd_weight": params, "fp8_quant_bwd_grad": params}


def _delayed(te: ModuleType, recipe: FP8Recipe) -> Build:
    fields = {
        "margin": recipe.margin,
        "fp8_format": _fp8_format(te, recipe),
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo,
    }
    pinned = {"reduce_amax": True, **_NO_ATTENTION}
    if recipe.power_of_2_scales:
        fields["scaling_factor_compute_algo"] = power_of_2_delayed_scale
    else:  # TE's own scale rule
        pinned["scaling_factor_compute_algo"] = None
    return "DelayedScaling", fields, pinned, {}


def _current(te: ModuleType, recipe: FP8Recipe) -> Build:
    return "Float8CurrentScaling", {
        "fp8_format": _fp8_format(te, recipe),
        "use_power_2_scales": recipe.power_of_2_scales,
        "fp8_gemm_fprop": te.MMParams(use_split_accumulator=not recipe.fast_accum_forward),
        "fp8_gemm_dgrad": te.MMParams(use_split_accumulator=True),
        "fp8_gemm_wgrad": te.MMParams(use_split_accumulator=True),
    }, dict(_NO_ATTENTION), _quantization_params(te, recipe.power_of_2_scales)


def _blockwise(te: ModuleType, recipe: FP8Recipe) -> Build:
    return "Float8BlockScaling", {
        "fp8_format": _fp8_format(te, recipe),
        "use_f32_scales": not recipe.power_of_2_scales,
        "x_block_scaling_dim": 1,
        "w_block_scaling_dim": 2,
        "grad_block_scaling_dim": 1,
    }, {
        "fp8_gemm_fprop": te.MMParams(use_split_accumulator=True),
        "fp8_gemm_dgrad": te.MMParams(use_split_accumulator=True),
        "fp8_gemm_wgrad": te.MMParams(use_split_accumulator=True),
        **_NO_ATTENTION,
    }, _quantization_params(te, recipe.power_of_2_scales)


def _mxfp8(te: ModuleType, recipe: FP8Recipe) -> Build:
    return "MXFP8BlockScaling", {"fp8_format": te.Format.E4M3}, {
        "margin": 0, "enable_2d_quantization": False, **_NO_ATTENTION}, {}


def _nvfp4(te: ModuleType, recipe: FP8Recipe) -> Build:
    return "NVFP4BlockScaling", {
        "fp4_format": te.Format.E2M1,
        "fp8_format": te.Format.E4M3,
        "disable_rht": not recipe.random_hadamard,
        "disable_stochastic_rounding": recipe.rounding != "stochastic",
        "disable_2d_quantization": False,
    }, {
        "row_scaled_activation": False,
        "nvfp4_4over6": "none",
        "nvfp4_4over6_e4m3_use_256": "all",
        "nvfp4_4over6_err_mode": "MAE",
        **_NO_ATTENTION,
    }, {}


_BUILDERS: Dict[str, Callable[[ModuleType, FP8Recipe], Build]] = {
    "delayed": _delayed, "current": _current, "blockwise": _blockwise, "mxfp8": _mxfp8, "nvfp4": _nvfp4}


def _field_names(cls: type) -> set:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:  # not a dataclass: its constructor's parameters
        return set(inspect.signature(cls).parameters)


def _cannot_express(recipe: FP8Recipe, what: str) -> ValueError:
    return ValueError(
        f"the Transformer Engine backend cannot express scaling={recipe.scaling!r} with the installed Transformer "
        f"Engine: {what} (lightning_fp8's mapping is tested against Transformer Engine {TESTED_TE_VERSION}); "
        "upgrade Transformer Engine, or use backend='lightning_fp8'"
    )


def te_recipe_from(recipe: FP8Recipe, te: ModuleType) -> Any:
    """The Transformer Engine recipe object for `recipe`, built from `te`, TE's `transformer_engine.common.recipe`
    module. Raises ValueError naming every field TE cannot express (`te_refusals`), or the TE class or field the
    installed TE lacks."""
    refusals = te_refusals(recipe)
    if refusals:
        raise ValueError(
            f"the Transformer Engine backend cannot express {'; '.join(str(r) for r in refusals)}; use "
            "backend='lightning_fp8' (lightning_fp8's own FP8 layers) for this recipe"
        )
    class_name, fields, pinned, attributes = _BUILDERS[recipe.scaling](te, recipe)
    cls = getattr(te, class_name, None)
    if cls is None:
        raise _cannot_express(recipe, f"it has no {class_name} recipe")
    known = _field_names(cls)
    missing = [name for name in fields if name not in known] + [name for name in attributes if not hasattr(cls, name)]
    if missing:
        raise _cannot_express(recipe, f"its {class_name} takes no {', '.join(missing)}")
    te_recipe = cls(**fields, **{name: value for name, value in pinned.items() if name in known})
    for name, value in attributes.items():
        setattr(te_recipe, name, value)
    return te_recipe
