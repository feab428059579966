"""Model conversion: which linears become FP8Linear, and why the others do not.

Every linear that is left in high precision gets a recorded reason (`precision_map` reads them back), so a user
can always answer "why is this layer not in FP8?".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from torch import nn

from lightning_fp8.conversion.filters import SKIP_REASON_ATTR, ModuleFilter, default_skip_reason, filter_reason
from lightning_fp8.modules.linear import FP8Layer, FP8Linear
from lightning_fp8.recipe import FP8Recipe

@dataclass(frozen=True)
class LayerPrecision:
    """One row of the precision map."""

    fqn: str
    precision: str  # "fp8" or "bf16"
    reason: str


def _linears(model: nn.Module) -> List[Tuple[str, nn.Linear]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]


def convert_to_fp8(
    model: nn.Module,
    recipe: Optional[FP8Recipe] = None,
    module_filter: Optional[ModuleFilter] = None,
) -> nn.Module:
    """Replace the model's nn.Linear layers by FP8Linear in place, and return the model.

    module_filter(module, fqn) -> bool, if given, replaces the default filter (True: convert). Layers already
    converted are left alone, so converting twice is a no-op. A bare nn.Linear passed as `model` is returned
    converted (there is no parent to replace it in).
    """
    recipe = recipe if recipe is not None else FP8Recipe()
    if not isinstance(recipe, FP8Recipe):
        raise TypeError(f"recipe must be an FP8Recipe, got {type(recipe).__name__}")
    linears = _linears(model)
    if not linears:
        return model
    first_fqn, last_fqn = linears[0][0], linears[-1][0]
    decisions: Dict[str, Optional[str]] = {}
    for fqn, module in linears:
        if isinstance(module, FP8Layer):
            continue
        if module_filter is not None:
            decisions[fqn] = None if module_filter(module, fqn) else filter_reason(module_filter, module, fqn)
        else:
            decisions[fqn] = default_skip_reason(module, fqn, recipe, fqn == first_fqn, fqn == last_fqn)
    if "" in decisions:  # the model itself is a linear
        if decisions[""] is None:
            return FP8Linear.from_linear(model, recipe)
        setattr(model, SKIP_REASON_ATTR, decisions[""])
        return model
    for fqn, reason in decisions.items():
        module = model.get_submodule(fqn)
        if reason is None:
            _replace(model, fqn, FP8Linear.from_linear(module, recipe))
        else:
            setattr(module, SKIP_REASON_ATTR, reason)
    return model


def revert_fp8(model: nn.Module) -> nn.Module:
    """Undo `convert_to_fp8`: FP8Linear layers become nn.Linear again (same Parameters); returns the model."""
    if isinstance(model, FP8Layer):
        return model.to_unconverted()
    for fqn, module in list(model.named_modules()):
        if isinstance(module, FP8Layer):
            _replace(model, fqn, module.to_unconverted())
        elif isinstance(module, nn.Linear) and hasattr(module, SKIP_REASON_ATTR):
            delattr(module, SKIP_REASON_ATTR)
    return model


def precision_map(model: nn.Module) -> List[LayerPrecision]:
    """Every linear of the model: FP8 or BF16, and why."""
    rows = []
    for fqn, module in _linears(model):
        if isinstance(module, FP8Layer):
            if module.fp8_enabled:
                rows.append(LayerPrecision(fqn, "fp8", "converted"))
            else:
                rows.append(LayerPrecision(fqn, "bf16", module.fp8_disabled_reason or "fp8_enabled=False"))
        else:
            rows.append(LayerPrecision(fqn, "bf16", getattr(module, SKIP_REASON_ATTR, "not converted")))
    return rows


def fp8_layers(model: nn.Module) -> Dict[str, FP8Layer]:
    """The model's FP8 layers (FP8Linear and every other FP8Layer) by fully qualified name, in module order."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, FP8Layer)}


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child_name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, new)
