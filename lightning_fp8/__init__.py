"""lightning-fp8: FP8 mixed-precision training for PyTorch Lightning and Hugging Face Accelerate.

Public entry points (docs/architecture.md maps where each lives):

    from lightning_fp8 import FP8Recipe, FP8Precision, FP8Linear, convert_to_fp8, revert_fp8, fp8_autocast
    from lightning_fp8 import FP8Conv1d, FP8Conv2d          # what convert_to_fp8 makes of nn.Conv1d / nn.Conv2d
    from lightning_fp8.fabric import FP8Precision          # Lightning Fabric
    from lightning_fp8.accelerate import FP8Accelerator    # Hugging Face Accelerate
    from lightning_fp8.callbacks import FP8ScaleMonitor, FP8LayerFallback, FP8Calibration
    from lightning_fp8.optim import FP8AdamW
"""
from lightning_fp8.callbacks import FP8Calibration, FP8LayerFallback, FP8ScaleMonitor
from lightning_fp8.conversion import (
    convert_to_fp8,
    fp8_layers,
    fp8_state_dict,
    load_fp8_state_dict,
    precision_map,
    revert_fp8,
)
from lightning_fp8.engine import FP8DivergenceError
from lightning_fp8.integrations.lightning import FP8Precision
from lightning_fp8.modules import FP8Conv1d, FP8Conv2d, FP8EmulationWarning, FP8Layer, FP8Linear, fp8_autocast
from lightning_fp8.recipe import FP8Recipe

__version__ = "0.1.0"

__all__ = [
    "FP8Recipe",
    "FP8Precision",
    "FP8Linear",
    "FP8Conv1d",
    "FP8Conv2d",
    "FP8Layer",
    "convert_to_fp8",
    "revert_fp8",
    "precision_map",
    "fp8_layers",
    "fp8_state_dict",
    "load_fp8_state_dict",
    "fp8_autocast",
    "FP8ScaleMonitor",
    "FP8LayerFallback",
    "FP8Calibration",
    "FP8EmulationWarning",
    "FP8DivergenceError",
]
