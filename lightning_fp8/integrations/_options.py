"""The options every FP8 adapter takes, defined once: names, types, defaults, validation.

`FP8Options` is the single list of what a user can set. The Lightning and Fabric plugins spell the same arguments
out in their own `__init__` (so IDEs, `help()` and LightningCLI / jsonargparse see a real signature) and hand them
to `FP8Options`; Accelerate's `FP8Kwargs` *is* an `FP8Options`. A test checks that the three signatures agree.
Every value is validated here, where the user wrote it, with an error naming the valid choices.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import torch

from lightning_fp8.conversion.filters import ModuleFilter
from lightning_fp8.conversion.layer_recipes import LayerRecipes, normalize_layer_recipes
from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.loss_scaler import LossScaling, parse_loss_scaling, resolve_loss_scaling
from lightning_fp8.presets import AUTO, RecipeChoice, auto_recipe, get_preset
from lightning_fp8.recipe import FP8Recipe

OPTIMIZER_STATE_CHOICES = ("fp32", "fp8")
GRADIENT_COMMUNICATION_CHOICES = ("bf16", "fp8")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: who computes the FP8 layers (FP8Options.backend)
BACKEND_CHOICES = ("lightning_fp8", "transformer_engine")
#: options that must be real booleans
BOOLEAN_OPTIONS = ("fp8_eval", "fp8_all_gather")


@dataclass(kw_only=True)
class FP8Options:
    """Options of FP8 training (documented in docs/plugin.md; the adapters' docstrings repeat them).

    recipe: an FP8Recipe (formats, scaling, which layers); or "auto": the recipe for the device's compute capability
        (`presets.auto_recipe`: mxfp8 on Blackwell, the per-tensor default elsewhere; logged in the conversion summary
        and kept in checkpoints); or preset: a named recipe ("default", "conservative", "mellempudi"). At most one of
        recipe and preset.
    module_filter: callable(module, fqn) -> bool replacing the recipe's default layer filter.
    loss_scaling: "auto" (dynamic only where gradients can underflow), "dynamic", "none", or a static float.
    init_loss_scale, growth_interval: the dynamic loss scaler's start value and clean steps before it doubles.
    snapshot_every: optimizer steps between snapshots of the last good state (rollback targets).
    max_consecutive_skips: skipped steps in a row that trigger a rollback.
    max_rollbacks, rollback_window: more than max_rollbacks rollbacks within rollback_window steps stop training.
    spike_factor, spike_window, spike_warmup: roll back when the loss exceeds spike_factor x its mean over the last
        spike_window good steps (None: off), once spike_warmup losses are known.
    check_weights_every: optimizer steps between checks that the weights are finite (one norm pass each).
    optimizer_state: "fp32" (the optimizer as it is) or "fp8" (torch Adam / AdamW become FP8AdamW);
        optimizer_kwargs: FP8AdamW storage options for that swap.
    compute_dtype: "bf16" or "fp16" (or the torch dtype): the autocast dtype of everything that is not an FP8 GEMM.
    fp8_eval: run evaluation forwards in FP8 too (True) or in compute_dtype (False).
    layer_recipes: {fnmatch pattern of layer names: FP8Recipe}, first match wins: the layers that compute with
        another recipe than `recipe` (e.g. {"*.attn.*": FP8Recipe(scaling="rowwise")}).
    fp8_all_gather: under FSDP2, all-gather the weights of FP8 layers in FP8 (1 byte per element instead of 2), each
        rank casting its shard with the scale all ranks share; applies to layers with a per-tensor recipe (delayed or
        current scaling), others gather in high precision (docs/distributed.md says which and why). No effect
        without FSDP2.
    gradient_communication: "bf16" leaves gradient reduction to the framework, in high precision (DDP reduces in the
        gradients' dtype, FSDP2 in its MixedPrecisionPolicy.reduce_dtype); "fp8" reduces gradients in FP8 with a
        scale shared across ranks (FP8-LM's automatic scaling: DDP through a comm hook, FSDP2 through a custom
        reduce-scatter), half the bytes of a BF16 reduction.
    backend: who computes the FP8 layers: "lightning_fp8" (FP8Linear and the other FP8 layers of this library) or
        "transformer_engine" (NVIDIA Transformer Engine's te.Linear under te.autocast, with the same recipe, loss
        scaling, skip and rollback; per-layer features cannot see inside TE layers: docs/plugin.md, "Transformer
        Engine backend"). Not to be confused with FP8Recipe.backend, the GEMM implementation of FP8Linear.
    """

    recipe: Optional[Union[FP8Recipe, str]] = None
    preset: Optional[str] = None
    module_filter: Optional[ModuleFilter] = None
    loss_scaling: LossScaling = "auto"
    init_loss_scale: float = 2.0**8
    growth_interval: int = 1000
    snapshot_every: int = 50
    max_consecutive_skips: int = 10
    max_rollbacks: int = 3
    rollback_window: int = 1000
    spike_factor: Optional[float] = None
    spike_window: int = 50
    spike_warmup: int = 20
    check_weights_every: int = 1
    optimizer_state: str = "fp32"
    optimizer_kwargs: Optional[Dict[str, Any]] = None
    compute_dtype: Union[str, torch.dtype] = "bf16"
    fp8_eval: bool = True
    layer_recipes: Optional[LayerRecipes] = None
    fp8_all_gather: bool = True
    gradient_communication: str = "bf16"
    backend: str = "lightning_fp8"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.recipe is not None and self.preset is not None:
            raise ValueError("give either recipe= or preset=, not both (a preset is a named recipe)")
        if isinstance(self.recipe, str) and self.recipe != AUTO:
            raise ValueError(f"recipe={self.recipe!r} is not valid; valid choices: an FP8Recipe, {AUTO!r} (the recipe "
                             "for this device's compute capability), or None (the preset's)")
        if self.recipe is not None and not isinstance(self.recipe, (FP8Recipe, str)):
            raise TypeError(f"recipe must be an FP8Recipe or {AUTO!r}, got {type(self.recipe).__name__}")
        if self.preset is not None:
            get_preset(self.preset)  # raises naming the valid presets
        if self.optimizer_state not in OPTIMIZER_STATE_CHOICES:
            raise ValueError(
                f"optimizer_state={self.optimizer_state!r} is not valid; valid choices: {list(OPTIMIZER_STATE_CHOICES)}"
            )
        resolve_compute_dtype(self.compute_dtype)
        normalize_layer_recipes(self.layer_recipes)  # raises naming what a layer_recipes entry must be
        if self.gradient_communication not in GRADIENT_COMMUNICATION_CHOICES:
            raise ValueError(
                f"gradient_communication={self.gradient_communication!r} is not valid; valid choices: "
                f"{list(GRADIENT_COMMUNICATION_CHOICES)}"
            )
        for name in BOOLEAN_OPTIONS:  # bool("no") is True: a string here would silently mean the opposite
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        # a command line or a YAML file (LightningCLI: `--trainer.plugins.loss_scaling=1024`) hands a static scale
        # over as a string, since the type is Union[str, float]: it means that float
        self.loss_scaling = parse_loss_scaling(self.loss_scaling)
        resolve_loss_scaling(self.loss_scaling, True, torch.bfloat16)
        self.stability_config()  # validates the stability knobs
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={self.backend!r} is not valid; valid choices: {list(BACKEND_CHOICES)}")
        if self.backend == "transformer_engine":
            if self.layer_recipes:
                raise ValueError("layer_recipes applies to lightning_fp8's own FP8 layers; backend='transformer_engine' "
                                 "runs one TE recipe for every layer")
            from lightning_fp8.backends.transformer_engine import te_recipe

            choice = self.recipe_choice()
            try:
                te_recipe(choice.recipe)  # TE installed, and the recipe expressible: said here, at construction
            except ValueError as error:
                if self.recipe != AUTO:
                    raise
                raise ValueError(
                    f"recipe='auto' chose {choice.recipe.label} on {choice.device} ({choice.reason}), and {error}; "
                    f"with backend='transformer_engine' pass a recipe TE expresses (e.g. FP8Recipe(), per-tensor "
                    f"delayed scaling), or use backend='lightning_fp8' for recipe='auto'"
                ) from error

    def resolved_recipe(self) -> FP8Recipe:
        return self.recipe_choice().recipe

    def recipe_choice(self) -> RecipeChoice:
        """The recipe with where it came from: recipe="auto" chooses for the device (`presets.auto_recipe`)."""
        if self.recipe == AUTO:
            return auto_recipe()
        if self.recipe is not None:
            return RecipeChoice(self.recipe, "", "given")
        return RecipeChoice(get_preset(self.preset or "default"), "", f"preset {self.preset or 'default'!r}")

    def stability_config(self) -> StabilityConfig:
        return StabilityConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StabilityConfig)})

    def as_dict(self) -> Dict[str, Any]:
        """The options as keyword arguments (shallow: the recipe and the filter are the objects given)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(FP8Options)}


def option_names() -> tuple:
    return tuple(f.name for f in dataclasses.fields(FP8Options))


def resolve_compute_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in COMPUTE_DTYPES.values():
        return value
    if isinstance(value, str) and value in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[value]
    raise ValueError(f"compute_dtype={value!r} is not valid; valid choices: {list(COMPUTE_DTYPES)}")


__all__ = ["FP8Options", "OPTIMIZER_STATE_CHOICES", "GRADIENT_COMMUNICATION_CHOICES", "COMPUTE_DTYPES", "option_names", "resolve_compute_dtype"]
