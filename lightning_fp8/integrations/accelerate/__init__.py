"""FP8 for Hugging Face Accelerate, run by lightning_fp8's engine (`FP8Accelerator()` + `--mixed_precision fp8`).
Public import path: `lightning_fp8.accelerate`.

Parts: accelerator.py (FP8AcceleratorMixin / FP8Accelerator: the hooks), kwargs.py (FP8Kwargs), fp8_config.py
(Accelerate's `fp8_config` / `ACCELERATE_FP8_*` settings mapped onto the options), plain.py (unchanged scripts'
`accelerate.Accelerator` made FP8; `enable_fp8`), launcher.py (`python -m lightning_fp8.accelerate launch`),
precision_source.py (who chose an explicit mixed_precision: the user, or a library's default such as trl's bf16),
optimizer.py, forward.py, checkpoint.py."""
from lightning_fp8.integrations.accelerate.accelerator import FP8Accelerator, FP8AcceleratorMixin
from lightning_fp8.integrations.accelerate.kwargs import FP8Kwargs
from lightning_fp8.integrations.accelerate.launcher import main
from lightning_fp8.integrations.accelerate.optimizer import FP8AcceleratedOptimizer
from lightning_fp8.integrations.accelerate.plain import enable_fp8
