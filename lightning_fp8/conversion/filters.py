"""Which linear layers stay in high precision, and how a user filter explains its choices.

Two kinds of rules, each returning the reason a layer stays in BF16 (None: convert it):

- `structural_skip_reason`: the layer cannot become an FP8 layer as it is used, whatever the filter says
  (nn.MultiheadAttention calls its out-projection functionally; dimensions not multiples of 16; an uninitialized
  LazyLinear; a forward replaced on the instance; a parametrization that changes the weight's shape).
- `default_skip_reason`: the default filter on top of those: `FP8Recipe.skip_patterns`, LoRA adapters, and the
  first / last rule (decided in lightning_fp8/conversion/order.py, over layers that would otherwise convert).

`convert_to_fp8` records every reason on the module so `precision_map` can say why a layer is not in FP8.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Optional

from torch import nn

from lightning_fp8.conversion import kinds
from lightning_fp8.conversion.transplant import parametrization_mismatch
from lightning_fp8.recipe import FP8Recipe

#: module_filter(module, fqn) -> bool: True converts the layer
ModuleFilter = Callable[[nn.Module, str], bool]


#: attribute set on a linear that conversion left in high precision (precision_map reads it)
SKIP_REASON_ATTR = "_fp8_skip_reason"

FIRST_LAST_SWITCH = "recipe.keep_first_last_in_bf16"


def structural_skip_reason(module: nn.Module) -> Optional[str]:
    """Reasons no filter can override: the layer cannot run an FP8 GEMM as it is used (None: it can)."""
    if (isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)
            and not module.__dict__.get("_fp8_called_as_module")):  # see conversion/attention.py
        return "used functionally by nn.MultiheadAttention (its forward never calls the module)"
    if isinstance(module._parameters.get("weight"), nn.parameter.UninitializedParameter):  # (no parametrized read)
        return "LazyLinear not initialized yet (run one forward before conversion)"
    if "forward" in module.__dict__:
        return ("its forward is replaced on the instance (a wrapper or a library hook, e.g. Accelerate's device-map "
                "hooks): an FP8 layer would bypass that replacement")
    kind = kinds.linear_kind(module)
    if kind is not None:
        mismatch = parametrization_mismatch(module, kind.tensor_shapes(module))
        if mismatch is not None:
            return mismatch
    in_features, out_features = kinds.features(module)
    if in_features % 16 or out_features % 16:
        return (
            f"in/out features {in_features}x{out_features} are not multiples of 16 "
            "(FP8 GEMMs need 16-aligned dimensions)"
        )
    return None


def is_lora_adapter(fqn: str) -> bool:
    """A PEFT LoRA adapter matrix (`<layer>.lora_A.<adapter>` / `lora_B`)."""
    parts = fqn.split(".")
    return any(part in ("lora_A", "lora_B") for part in parts[:-1])


def rule_skip_reason(module: nn.Module, fqn: str, recipe: FP8Recipe) -> Optional[str]:
    """The default filter's reasons other than first / last (None: the layer is a first/last candidate)."""
    structural = structural_skip_reason(module)
    if structural is not None:
        return structural
    for pattern in recipe.skip_patterns:
        if fnmatch.fnmatchcase(fqn, pattern):
            return f"name matches skip pattern {pattern!r}"
    if is_lora_adapter(fqn):
        return ("LoRA adapter matrix: a rank-r GEMM too small for FP8 to pay off, and the weight being trained; kept in "
                "BF16 (the frozen base layer runs in FP8)")
    return None


def default_skip_reason(
    module: nn.Module, fqn: str, recipe: FP8Recipe, is_first: bool = False, is_last: bool = False
) -> Optional[str]:
    """Why the default filter keeps this linear in BF16, or None to convert it (`is_first` / `is_last`: whether the
    layer is in the first / last group, see lightning_fp8/conversion/order.py)."""
    reason = rule_skip_reason(module, fqn, recipe)
    if reason is not None:
        return reason
    if recipe.keep_first_last_in_bf16 and is_first:
        return f"first linear layer kept in BF16 ({FIRST_LAST_SWITCH})"
    if recipe.keep_first_last_in_bf16 and is_last:
        return f"last linear layer kept in BF16 ({FIRST_LAST_SWITCH})"
    return None


def filter_reason(module_filter: ModuleFilter, module: nn.Module, fqn: str) -> str:
    """A filter object may explain itself through `skip_reason(module, fqn)` (e.g. the shape-aware auto filter)."""
    explain = getattr(module_filter, "skip_reason", None)
    reason = explain(module, fqn) if callable(explain) else None
    return reason or "excluded by module_filter"


__all__ = [
    "ModuleFilter",
    "SKIP_REASON_ATTR",
    "structural_skip_reason",
    "rule_skip_reason",
    "default_skip_reason",
    "filter_reason",
    "is_lora_adapter",
]
