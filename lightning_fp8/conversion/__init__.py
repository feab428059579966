"""Model conversion: which linear layers become FP8 layers, which stay in high precision, and why.

    convert.py       convert_to_fp8 / revert_fp8 / precision_map (with its dry-run preview) / fp8_layers
    kinds.py         which classes are linear layers (nn.Linear, transformers' Conv1D, registered kinds) and how
                     every other GEMM-bearing module is named in the precision map
    filters.py       the default filter's rules (alignment, MultiheadAttention, skip patterns, LoRA adapters)
    order.py         "first" and "last": forward order and layers that share an input (the first/last rule)
    transplant.py    what moves with a replaced layer: hooks, parametrizations, attributes
    summary.py       the conversion summary logged at conversion (FP8 share of linear FLOPs, BF16 layers and why)
    shape_filter.py  the optional shape-aware filter (keep a linear in BF16 where FP8 cannot be faster)
    state.py         fp8_state_dict / load_fp8_state_dict: the FP8 metadata, which the model's state_dict leaves out
"""
from lightning_fp8.conversion.convert import (
    LayerPrecision,
    convert_to_fp8,
    fp8_layers,
    is_converted,
    plan_conversion,
    precision_map,
    revert_fp8,
)
from lightning_fp8.conversion.filters import ModuleFilter, default_skip_reason
from lightning_fp8.conversion.kinds import LinearKind, register_linear_kind
from lightning_fp8.conversion.shape_filter import AutoShapeFilter, auto_filter, fp8_wins
from lightning_fp8.conversion.state import fp8_state_dict, load_fp8_state_dict
from lightning_fp8.conversion.summary import ConversionSummary, conversion_summary, log_conversion_summary

__all__ = [
    "convert_to_fp8",
    "revert_fp8",
    "precision_map",
    "plan_conversion",
    "is_converted",
    "fp8_layers",
    "LayerPrecision",
    "ModuleFilter",
    "default_skip_reason",
    "LinearKind",
    "register_linear_kind",
    "auto_filter",
    "AutoShapeFilter",
    "fp8_wins",
    "fp8_state_dict",
    "load_fp8_state_dict",
    "ConversionSummary",
    "conversion_summary",
    "log_conversion_summary",
]
