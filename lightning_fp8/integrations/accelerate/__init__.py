"""FP8 for Hugging Face Accelerate, run by lightning_fp8's engine (`FP8Accelerator()` + `--mixed_precision fp8`).
Public import path: `lightning_fp8.accelerate`."""
from lightning_fp8.integrations.accelerate.accelerator import FP8Accelerator, FP8AcceleratorMixin
from lightning_fp8.integrations.accelerate.kwargs import FP8Kwargs
from lightning_fp8.integrations.accelerate.launch import main
from lightning_fp8.integrations.accelerate.optimizer import FP8AcceleratedOptimizer
from lightning_fp8.integrations.accelerate.plain import enable_fp8

__all__ = ["FP8Accelerator", "FP8AcceleratorMixin", "FP8Kwargs", "FP8AcceleratedOptimizer", "enable_fp8", "main"]
