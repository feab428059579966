"""FP8Precision for Lightning Fabric: `Fabric(plugins=lightning_fp8.fabric.FP8Precision())`.

Fabric drives the same FP8TrainingEngine as the Trainer plugin. `fabric.backward(loss)` scales the loss,
`fabric.clip_gradients(model, optimizer, max_norm=..., error_if_nonfinite=False)` unscales first (pass
error_if_nonfinite=False: a non-finite norm then skips the step instead of raising), and `optimizer.step()` goes through the engine, which skips non-finite
steps and rolls back. Save the plugin with your checkpoint (`fabric.save(path, {"model": m, "optimizer": o,
"fp8": plugin})`) to resume with the loss scaler and counters; the layers' FP8 metadata is in the model's state_dict.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins.precision import Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fp8.plugin_core import FP8PrecisionCore


class FP8Precision(FP8PrecisionCore, Precision):
    """Fabric precision plugin; same arguments as lightning_fp8.FP8Precision."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        FP8PrecisionCore.__init__(self, *args, **kwargs)
        if self.optimizer_state != "fp32":
            raise ValueError(
                "lightning_fp8.fabric.FP8Precision(optimizer_state='fp8') is not supported: Fabric sets up the "
                "optimizer you build, so build lightning_fp8.optim.FP8AdamW directly."
            )

    def forward_context(self):
        return self._fp8_context(True)

    def pre_backward(self, tensor: Tensor, module: Optional[Module]) -> Tensor:
        return self.engine.scale_loss(tensor)

    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        tensor.backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.engine.unscale_(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        result = {}

        def step() -> None:
            result["out"] = optimizer.step(**kwargs)

        self.engine.step(optimizer, step)
        return result.get("out")

    # the Fabric Stateful protocol: fabric.save(path, {"fp8": plugin}) stores and restores these
    def state_dict(self):
        return FP8PrecisionCore.state_dict(self)

    def load_state_dict(self, state_dict) -> None:
        FP8PrecisionCore.load_state_dict(self, state_dict)


__all__ = ["FP8Precision"]
