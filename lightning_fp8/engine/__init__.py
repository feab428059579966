"""The training engine shared by every adapter: loss scaling, skip-on-overflow, rollback, clipping, amax sync; and
BatchNorm running statistics re-estimated for eval mode (batchnorm_stats)."""
from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.engine import FP8DivergenceError, FP8TrainingEngine, StepResult
from lightning_fp8.engine.loss_scaler import LossScaler, resolve_loss_scaling

__all__ = ["FP8TrainingEngine", "StabilityConfig", "FP8DivergenceError"]
