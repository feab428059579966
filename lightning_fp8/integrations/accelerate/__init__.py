"""FP8 for Hugging Face Accelerate, run by lightning_fp8's engine (`FP8Accelerator()` + `--mixed_precision fp8`).

    accelerator.py  FP8AcceleratorMixin / FP8Accelerator: Accelerate's hooks translated into engine calls
    kwargs.py       FP8Kwargs: the options (the plugins' options, as an Accelerate KwargsHandler)
    optimizer.py    FP8AcceleratedOptimizer: the prepared optimizer whose step goes through the engine
    forward.py      the prepared model's forward inside the FP8 + autocast context
    checkpoint.py   the engine state carried by save_state / load_state and by transformers' Trainer checkpoints
    plain.py        unchanged scripts: every accelerate.Accelerator (transformers' Trainer's too) runs fp8 on the
                    engine when FP8 is requested (`enable_fp8()`, or each process of the launcher)
    launch.py       `python -m lightning_fp8.accelerate launch ...`

The public import path is `lightning_fp8.accelerate` (lightning_fp8/accelerate.py re-exports this package).
"""
from lightning_fp8.integrations.accelerate.accelerator import FP8Accelerator, FP8AcceleratorMixin
from lightning_fp8.integrations.accelerate.kwargs import FP8Kwargs
from lightning_fp8.integrations.accelerate.launch import main
from lightning_fp8.integrations.accelerate.optimizer import FP8AcceleratedOptimizer
from lightning_fp8.integrations.accelerate.plain import enable_fp8

__all__ = ["FP8Accelerator", "FP8AcceleratorMixin", "FP8Kwargs", "FP8AcceleratedOptimizer", "enable_fp8", "main"]
