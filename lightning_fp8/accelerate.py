"""Public import path of the Accelerate adapter: `from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs`
(it lives in lightning_fp8/integrations/accelerate/), `enable_fp8()` (unchanged Accelerator / transformers Trainer
scripts in FP8), and the launcher `python -m lightning_fp8.accelerate launch`."""
from lightning_fp8.integrations.accelerate import (
    FP8AcceleratedOptimizer,
    FP8Accelerator,
    FP8AcceleratorMixin,
    FP8Kwargs,
    enable_fp8,
    main,
)

__all__ = ["FP8Accelerator", "FP8AcceleratorMixin", "FP8Kwargs", "FP8AcceleratedOptimizer", "enable_fp8", "main"]

if __name__ == "__main__":
    main()
