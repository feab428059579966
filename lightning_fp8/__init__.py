"""lightning-fp8: FP8 mixed-precision training for PyTorch Lightning and Hugging Face Accelerate."""
from lightning_fp8.autocast import fp8_autocast
from lightning_fp8.callbacks import FP8Calibration, FP8LayerFallback, FP8ScaleMonitor
from lightning_fp8.convert import convert_to_fp8, fp8_layers, precision_map, revert_fp8
from lightning_fp8.modules.linear import FP8Linear
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.trainer import FP8Precision

__version__ = "0.1.0"

__all__ = [
    "FP8Recipe",
    "FP8Precision",
    "FP8Linear",
    "convert_to_fp8",
    "revert_fp8",
    "precision_map",
    "fp8_layers",
    "fp8_autocast",
    "FP8ScaleMonitor",
    "FP8LayerFallback",
    "FP8Calibration",
]
