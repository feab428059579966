"""lightning-fp8: FP8 mixed-precision training for PyTorch Lightning and Hugging Face Accelerate.

Public entry points:

    from lightning_fp8 import FP8Recipe, FP8Precision, FP8Linear, convert_to_fp8, revert_fp8, fp8_autocast
    from lightning_fp8 import FP8Conv1d, FP8Conv2d          # what convert_to_fp8 makes of nn.Conv1d / nn.Conv2d
    from lightning_fp8.fabric import FP8Precision          # Lightning Fabric
    from lightning_fp8.accelerate import FP8Accelerator    # Hugging Face Accelerate
    from lightning_fp8.callbacks import FP8ScaleMonitor, FP8LayerFallback, FP8Calibration, BatchNormRefresh
    from lightning_fp8 import refresh_batchnorm            # BatchNorm statistics for eval mode, any framework
    from lightning_fp8.optim import FP8AdamW

Importing the package imports torch and no framework: the Lightning plugin and the callbacks (which import Lightning)
are loaded on first access (`lightning_fp8.FP8Precision`, `from lightning_fp8 import FP8ScaleMonitor`).
"""
import importlib as _importlib

from lightning_fp8.engine.batchnorm_stats import refresh_batchnorm
from lightning_fp8.conversion import (
    convert_to_fp8,
    fp8_layers,
    fp8_state_dict,
    load_fp8_state_dict,
    precision_map,
    revert_fp8,
)
from lightning_fp8.engine import FP8DivergenceError
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
    "BatchNormRefresh",
    "refresh_batchnorm",
    "FP8EmulationWarning",
    "FP8DivergenceError",
]

#: public names that import Lightning, and the module each lives in (loaded on first access)
_LAZY = {
    "FP8Precision": "lightning_fp8.integrations.lightning",
    "FP8ScaleMonitor": "lightning_fp8.callbacks",
    "FP8LayerFallback": "lightning_fp8.callbacks",
    "FP8Calibration": "lightning_fp8.callbacks",
    "BatchNormRefresh": "lightning_fp8.callbacks",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later lookups find it without this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
