"""Which linear layers stay in high precision, and how a user filter explains its choices.

Two kinds of rules, each returning the reason a layer stays in BF16 (None: convert it):

- `structural_skip_reason`: the layer cannot become an FP8 layer as it is used, whatever the filter says
  (nn.MultiheadAttention calls its out-projection functionally; dimensions not multiples of 16 (a convolution's
  channels per group); a depthwise convolution; an uninitialized LazyLinear / LazyConv; a forward replaced on the
  instance; a parametrization that changes the weight's shape).
- `scaling_skip_reason`: the layer has no FP8 path for the recipe's scaling (no filter overrides it either).
- `default_skip_reason`: the default filter on top of those: `FP8Recipe.skip_patterns`, LoRA adapters, and the
  first / last rule (decided in lightning_fp8/conversion/first_last.py, over layers that would otherwise convert).

`convert_to_fp8` records every reason on the module so `precision_map` can say why a layer is not in FP8.
"""
from __future__ import annotations

import fnmatch
import math
from typing import Callable, Optional

from torch import nn

from lightning_fp8.conversion import layer_kinds
from lightning_fp8.conversion.transplant import parametrization_mismatch
from lightning_fp8.modules.conv_layout import PADDING_MODES
from lightning_fp8.recipe import FP8Recipe

#: module_filter(module, fqn) -> bool: True converts the layer
ModuleFilter = Callable[[nn.Module, str], bool]


#: attribute set on a linear that conversion left in high precision (precision_map reads it)
SKIP_REASON_ATTR = "_fp8_skip_reason"

FIRST_LAST_SWITCH = "recipe.keep_first_last_in_bf16"


def structural_skip_reason(module: nn.Module) -> Optional[str]:
    """Reasons no filter can override: the layer cannot run an FP8 GEMM as it is used (None: it can)."""
    if (isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)
            and not module.__dict__.get("_fp8_called_as_module")):  # see conversion/torch_transformer.py
        return "used functionally by nn.MultiheadAttention (its forward never calls the module)"
    if isinstance(module._parameters.get("weight"), nn.parameter.UninitializedParameter):  # (no parametrized read)
        return f"{type(module).__name__} not initialized yet (run one forward before conversion)"
    if "forward" in module.__dict__:
        return ("its forward is replaced on the instance (a wrapper or a library hook, e.g. Accelerate's device-map "
                "hooks): an FP8 layer would bypass that replacement")
    kind = layer_kinds.linear_kind(module)
    if kind is not None:
        mismatch = parametrization_mismatch(module, kind.tensor_shapes(module))
        if mismatch is not None:
            return mismatch
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):  # a registered kind's convolution subclass too
            return convolution_skip_reason(module)
    in_features, out_features = layer_kinds.features(module)
    if in_features % 16 or out_features % 16:
        return (
            f"in/out features {in_features}x{out_features} are not multiples of 16 "
            "(FP8 GEMMs need 16-aligned dimensions)"
        )
    return None


def convolution_skip_reason(conv: nn.Module) -> Optional[str]:
    """Why an nn.Conv1d / nn.Conv2d cannot run its GEMMs in FP8 (None: it can). Its GEMMs per group are
    (N*Ho*Wo) x (kh*kw*C/g) x (O/g): 16-aligned when the channels per group are."""
    if conv.padding_mode not in PADDING_MODES:
        return f"padding_mode={conv.padding_mode!r}: no FP8 path (supported: {list(PADDING_MODES)})"
    groups = conv.groups
    c_in, c_out = conv.in_channels // groups, conv.out_channels // groups
    if groups > 1 and c_in == 1:
        return (f"depthwise convolution (groups={groups}): each channel is its own GEMM of K = "
                f"{c_in * math.prod(conv.kernel_size)}, N = {c_out}, too small for FP8 to pay off (and not 16-aligned)")
    if c_in % 16 or c_out % 16:
        per_group = " per group" if groups > 1 else ""
        return (f"in/out channels{per_group} {c_in}x{c_out} are not multiples of 16 (FP8 GEMMs need 16-aligned "
                "dimensions)")
    return None


def scaling_skip_reason(module: nn.Module, recipe: FP8Recipe) -> Optional[str]:
    """Why a layer cannot run the recipe's scaling or weight gradient (None: it can): its FP8 layer has no path for it
    (`fp8_scalings`, `fp8_weight_grads`; FP8 convolutions run the per-tensor and the tiled scalings with FP8 weight
    gradients only). Asked of the FP8 class, so a scaling added to
    FP8Recipe later stays out of such layers until they get a path for it, and so does a registered kind's layer."""
    kind = layer_kinds.linear_kind(module)
    if kind is None:
        return None
    try:
        scalings = kind.fp8_layer_class().fp8_scalings
    except ImportError:
        return None
    if scalings is not None and recipe.scaling not in scalings:
        return (f"FP8Recipe.scaling={recipe.scaling!r}: {kind.label} has no FP8 path for it (valid choices: "
                f"{list(scalings)})")
    weight_grads = kind.fp8_layer_class().fp8_weight_grads
    if weight_grads is not None and recipe.weight_grad not in weight_grads:
        return (f"FP8Recipe.weight_grad={recipe.weight_grad!r}: {kind.label} has no FP8 path for it (valid choices: "
                f"{list(weight_grads)})")
    return None


def is_lora_adapter(fqn: str) -> bool:
    """A PEFT LoRA adapter matrix (`<layer>.lora_A.<adapter>` / `lora_B`)."""
    parts = fqn.split(".")
    return any(part in ("lora_A", "lora_B") for part in parts[:-1])


def rule_skip_reason(module: nn.Module, fqn: str, recipe: FP8Recipe) -> Optional[str]:
    """The default filter's reasons other than first / last (None: the layer is a first/last candidate). A LoRA
    adapter is named as one first: its rank (often 8 or 4) also fails the 16-alignment rule, but the adapter rule is
    why it stays in BF16 at any rank."""
    if is_lora_adapter(fqn):
        return ("LoRA adapter matrix: a rank-r GEMM too small for FP8 to pay off, and the weight being trained; kept in "
                "BF16 (the frozen base layer runs in FP8)")
    structural = structural_skip_reason(module) or scaling_skip_reason(module, recipe)
    if structural is not None:
        return structural
    for pattern in recipe.skip_patterns:
        if fnmatch.fnmatchcase(fqn, pattern):
            return f"name matches skip pattern {pattern!r}"
    return None


def default_skip_reason(
    module: nn.Module, fqn: str, recipe: FP8Recipe, is_first: bool = False, is_last: bool = False
) -> Optional[str]:
    """Why the default filter keeps this linear in BF16, or None to convert it (`is_first` / `is_last`: whether the
    layer is in the first / last group, see lightning_fp8/conversion/first_last.py)."""
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
