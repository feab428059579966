"""FP8 modules."""
from lightning_fp8.modules.linear import FP8Linear, FP8LinearMeta

__all__ = ["FP8Linear", "FP8LinearMeta"]
