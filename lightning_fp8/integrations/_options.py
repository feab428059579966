"""What each FP8 option may be: the validation every adapter runs, written once.

The options themselves (names, types, defaults, what each does) are the parameters of `FP8PrecisionCore.__init__`
(lightning_fp8/integrations/plugin_core.py); the records built from that signature (`FP8Options`, Accelerate's `FP8Kwargs`)
are validated here, where the user wrote the values, with an error naming the valid choices.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple, Union

import torch

from lightning_fp8.conversion.layer_recipes import normalize_layer_recipes
from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.loss_scaler import parse_loss_scaling, resolve_loss_scaling
from lightning_fp8.presets import AUTO, RecipeChoice, auto_recipe, get_preset
from lightning_fp8.recipe import FP8Recipe

OPTIMIZER_STATE_CHOICES = ("fp32", "fp8")
GRADIENT_COMMUNICATION_CHOICES = ("bf16", "fp8")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: who computes the FP8 layers (the `backend` option)
BACKEND_CHOICES = ("lightning_fp8", "transformer_engine")
#: options that must be real booleans
BOOLEAN_OPTIONS = ("fp8_eval", "fp8_all_gather")

#: {(option, value): why}: values an adapter cannot honour although they are valid (`FP8PrecisionCore.unsupported_options`)
UnsupportedOptions = Mapping[Tuple[str, Any], str]


def validate_options(options: Any, unsupported: Optional[UnsupportedOptions] = None) -> None:
    """Check every option of `options` (a record with one attribute per option) and raise ValueError (TypeError for
    a recipe of the wrong type) naming the valid choices. Normalises in place what a command line or a YAML file
    hands over as a string: a static `loss_scaling` ("1024") becomes its float.

    unsupported: values the calling adapter refuses, each with its message (raised after the checks above)."""
    if options.recipe is not None and options.preset is not None:
        raise ValueError("give either recipe= or preset=, not both (a preset is a named recipe)")
    if isinstance(options.recipe, str) and options.recipe != AUTO:
        raise ValueError(f"recipe={options.recipe!r} is not valid; valid choices: an FP8Recipe, {AUTO!r} (the recipe "
                         "for this device's compute capability), or None (the preset's)")
    if options.recipe is not None and not isinstance(options.recipe, (FP8Recipe, str)):
        raise TypeError(f"recipe must be an FP8Recipe or {AUTO!r}, got {type(options.recipe).__name__}")
    if options.preset is not None:
        get_preset(options.preset)  # raises naming the valid presets
    if options.optimizer_state not in OPTIMIZER_STATE_CHOICES:
        raise ValueError(
            f"optimizer_state={options.optimizer_state!r} is not valid; valid choices: {list(OPTIMIZER_STATE_CHOICES)}"
        )
    resolve_compute_dtype(options.compute_dtype)
    normalize_layer_recipes(options.layer_recipes)  # raises naming what a layer_recipes entry must be
    if options.gradient_communication not in GRADIENT_COMMUNICATION_CHOICES:
        raise ValueError(
            f"gradient_communication={options.gradient_communication!r} is not valid; valid choices: "
            f"{list(GRADIENT_COMMUNICATION_CHOICES)}"
        )
    for name in BOOLEAN_OPTIONS:  # bool("no") is True: a string here would silently mean the opposite
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(options, name)!r}")
    # a command line or a YAML file (LightningCLI: `--trainer.plugins.loss_scaling=1024`) hands a static scale
    # over as a string, since the type is Union[str, float]: it means that float
    options.loss_scaling = parse_loss_scaling(options.loss_scaling)
    resolve_loss_scaling(options.loss_scaling, True, torch.bfloat16)
    StabilityConfig.from_options(options)  # validates the stability knobs
    if options.backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={options.backend!r} is not valid; valid choices: {list(BACKEND_CHOICES)}")
    if options.backend == "transformer_engine":
        _validate_transformer_engine(options)
    for (name, value), why in (unsupported or {}).items():
        if getattr(options, name) == value:
            raise ValueError(why)


def _validate_transformer_engine(options: Any) -> None:
    if options.layer_recipes:
        raise ValueError("layer_recipes applies to lightning_fp8's own FP8 layers; backend='transformer_engine' "
                         "runs one TE recipe for every layer")
    from lightning_fp8.backends.transformer_engine import te_recipe

    choice = recipe_choice(options)
    try:
        te_recipe(choice.recipe)  # TE installed, and the recipe expressible: said here, at construction
    except ValueError as error:
        if options.recipe != AUTO:
            raise
        raise ValueError(
            f"recipe='auto' chose {choice.recipe.label} on {choice.device} ({choice.reason}), and {error}; "
            f"with backend='transformer_engine' pass a recipe TE expresses (e.g. FP8Recipe(), per-tensor "
            f"delayed scaling), or use backend='lightning_fp8' for recipe='auto'"
        ) from error


def recipe_choice(options: Any) -> RecipeChoice:
    """The recipe `options` ask for, with where it came from: recipe="auto" chooses for the device
    (`presets.auto_recipe`), no recipe means the preset's ("default" without one)."""
    if options.recipe == AUTO:
        return auto_recipe()
    if options.recipe is not None:
        return RecipeChoice(options.recipe, "", "given")
    return RecipeChoice(get_preset(options.preset or "default"), "", f"preset {options.preset or 'default'!r}")


def resolve_compute_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in COMPUTE_DTYPES.values():
        return value
    if isinstance(value, str) and value in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[value]
    raise ValueError(f"compute_dtype={value!r} is not valid; valid choices: {list(COMPUTE_DTYPES)}")
