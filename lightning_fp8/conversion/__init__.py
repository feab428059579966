"""Model conversion: which linears become FP8 layers, which stay in high precision, and why.

    convert.py       convert_to_fp8 / revert_fp8 / precision_map / fp8_layers
    filters.py       the default filter's rules (alignment, MultiheadAttention, skip patterns, first / last)
    shape_filter.py  the optional shape-aware filter (keep a linear in BF16 where FP8 cannot be faster)
    state.py         fp8_state_dict / load_fp8_state_dict: the FP8 metadata, which the model's state_dict leaves out
"""
from lightning_fp8.conversion.convert import LayerPrecision, convert_to_fp8, fp8_layers, precision_map, revert_fp8
from lightning_fp8.conversion.filters import ModuleFilter, default_skip_reason
from lightning_fp8.conversion.shape_filter import AutoShapeFilter, auto_filter, fp8_wins
from lightning_fp8.conversion.state import fp8_state_dict, load_fp8_state_dict

__all__ = [
    "convert_to_fp8",
    "revert_fp8",
    "precision_map",
    "fp8_layers",
    "LayerPrecision",
    "ModuleFilter",
    "default_skip_reason",
    "auto_filter",
    "AutoShapeFilter",
    "fp8_wins",
    "fp8_state_dict",
    "load_fp8_state_dict",
]
