"""FP8 modules and what they call: FP8Linear (linear.py), FP8Conv1d / FP8Conv2d (conv.py), the scaled casts
(cast.py), the FP8 GEMM and its backends (gemm.py) and the fp8_autocast switch (autocast.py)."""
from lightning_fp8.modules.autocast import fp8_autocast
from lightning_fp8.modules.conv import FP8Conv1d, FP8Conv2d
from lightning_fp8.modules.gemm import FP8EmulationWarning, FP8GemmRefusedError, fp8_gemm
from lightning_fp8.modules.linear import FP8Layer, FP8Linear, FP8LinearMeta

__all__ = ["FP8Layer", "FP8Linear", "FP8Conv1d", "FP8Conv2d", "FP8LinearMeta", "fp8_autocast", "fp8_gemm", "FP8EmulationWarning",
           "FP8GemmRefusedError"]
