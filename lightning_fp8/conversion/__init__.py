"""Model conversion: which layers of a model become FP8 layers, which stay in high precision and why, and the FP8
state that travels outside the model's state_dict."""
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
from lightning_fp8.conversion.layer_kinds import LinearKind, register_linear_kind
from lightning_fp8.conversion.shape_filter import AutoShapeFilter, auto_filter, fp8_wins
from lightning_fp8.conversion.fp8_state import fp8_state_dict, load_fp8_state_dict
from lightning_fp8.conversion.summary import ConversionSummary, conversion_summary, log_conversion_summary

__all__ = ["register_linear_kind", "LinearKind", "ModuleFilter", "auto_filter", "AutoShapeFilter", "LayerPrecision",
           "conversion_summary"]
