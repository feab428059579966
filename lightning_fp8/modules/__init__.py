"""FP8 layers (FP8Linear, FP8Conv1d / FP8Conv2d) and what they run on: the scaled casts, the FP8 GEMM and its
backends, and the fp8_autocast switch."""
from lightning_fp8.modules.autocast import fp8_autocast
from lightning_fp8.modules.conv import FP8Conv1d, FP8Conv2d
from lightning_fp8.modules.gemm import FP8EmulationWarning, FP8GemmRefusedError, fp8_gemm
from lightning_fp8.modules.linear import FP8Layer, FP8Linear, FP8LayerState
from lightning_fp8.renamed import renamed_module_names


__getattr__ = renamed_module_names(__name__, {"FP8LinearMeta": ("FP8LayerState", FP8LayerState)})
