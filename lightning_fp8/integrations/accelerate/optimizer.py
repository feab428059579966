"""FP8AcceleratedOptimizer: Accelerate's optimizer wrapper whose real step goes through the FP8 engine."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from accelerate.optimizer import AcceleratedOptimizer

from lightning_fp8.engine.engine import FP8TrainingEngine, StepResult


class FP8AcceleratedOptimizer(AcceleratedOptimizer):
    """AcceleratedOptimizer whose real step goes through the engine: skipped on non-finite gradients, loss or FP8
    amax, rolled back on divergence. `step_was_skipped` is True when the iteration's update is not in the weights
    (skipped, or undone by a rollback), so a prepared LR scheduler does not step, as after an fp16 overflow in
    Accelerate. Within `accelerator.accumulate(...)` the micro-steps stay no-ops, as in Accelerate: only the step that
    follows the synchronised backward reaches the engine."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: FP8TrainingEngine, device_placement: bool = True):
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.engine = engine
        self._fp8_result: Optional[StepResult] = None

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        self._fp8_result = self.engine.step(self.optimizer, lambda: self.optimizer.step(closure))
        self._is_overflow = not self._fp8_result.stepped

    @property
    def step_was_skipped(self) -> bool:
        # read when the scheduler steps: a rollback at the iteration's close (after this step) counts too
        result = self._fp8_result
        return result is not None and not result.applied


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under any number of AcceleratedOptimizer wrappers."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
