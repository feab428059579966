"""Numerics: FP8 formats, quantize/dequantize and scaling rules. The torch reference for every kernel."""
from lightning_fp8.numerics.formats import E4M3, E5M2, FORMATS, FP8Format, get_format
from lightning_fp8.numerics.quantize import dequantize, quantize, saturate, tensor_amax
from lightning_fp8.numerics.scaling import cast_scale, close_step, scale_from_amax
