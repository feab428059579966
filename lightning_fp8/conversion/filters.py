"""Which linears the default filter keeps in high precision, and how a user filter explains its choices.

`default_skip_reason` is the one place the default rules live (alignment, nn.MultiheadAttention's functional
out-projection, `FP8Recipe.skip_patterns`, first/last linear); `convert_to_fp8` records every returned reason on the
module so `precision_map` can say why a layer is not in FP8.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Optional

from torch import nn

from lightning_fp8.recipe import FP8Recipe

#: module_filter(module, fqn) -> bool: True converts the layer
ModuleFilter = Callable[[nn.Module, str], bool]


#: attribute set on a linear that conversion left in high precision (precision_map reads it)
SKIP_REASON_ATTR = "_fp8_skip_reason"


def structural_skip_reason(module: nn.Linear) -> Optional[str]:
    """Reasons no filter can override: the layer cannot run an FP8 GEMM as it is used (None: it can)."""
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "used functionally by nn.MultiheadAttention (its forward never calls the module)"
    if module.in_features % 16 or module.out_features % 16:
        return (
            f"in/out features {module.in_features}x{module.out_features} are not multiples of 16 "
            "(FP8 GEMMs need 16-aligned dimensions)"
        )
    return None


def default_skip_reason(
    module: nn.Linear, fqn: str, recipe: FP8Recipe, is_first: bool, is_last: bool
) -> Optional[str]:
    """Why the default filter keeps this linear in BF16, or None to convert it."""
    structural = structural_skip_reason(module)
    if structural is not None:
        return structural
    for pattern in recipe.skip_patterns:
        if fnmatch.fnmatchcase(fqn, pattern):
            return f"name matches skip pattern {pattern!r}"
    if recipe.keep_first_last_in_bf16 and is_first:
        return "first linear layer kept in BF16 (recipe.keep_first_last_in_bf16)"
    if recipe.keep_first_last_in_bf16 and is_last:
        return "last linear layer kept in BF16 (recipe.keep_first_last_in_bf16)"
    return None


def filter_reason(module_filter: ModuleFilter, module: nn.Module, fqn: str) -> str:
    """A filter object may explain itself through `skip_reason(module, fqn)` (e.g. the shape-aware auto filter)."""
    explain = getattr(module_filter, "skip_reason", None)
    reason = explain(module, fqn) if callable(explain) else None
    return reason or "excluded by module_filter"


__all__ = ["ModuleFilter", "SKIP_REASON_ATTR", "structural_skip_reason", "default_skip_reason", "filter_reason"]
