"""The FP8 engine's state as an object `Accelerator.save_state` / `load_state` carry (register_for_checkpointing)."""
from __future__ import annotations

from typing import Any, Dict

from lightning_fp8.integrations._core import FP8PrecisionCore

CHECKPOINT_FORMAT = "lightning_fp8.accelerate/1"


class FP8CheckpointState:
    """The engine's state (loss scaler, counters, rollback bookkeeping) as an object Accelerate's save_state /
    load_state carry (register_for_checkpointing). Layer scales and amax histories are model buffers: they travel
    with the model weights."""

    def __init__(self, core: FP8PrecisionCore) -> None:
        self.core = core

    def state_dict(self) -> Dict[str, Any]:
        return {"format": CHECKPOINT_FORMAT, **self.core.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                "lightning_fp8: this checkpoint has no FP8Accelerator engine state where the FP8 run registered it "
                "(custom_checkpoint_0.pkl): it was saved without mixed_precision='fp8', or with other objects "
                "registered first. Load it with the mixed precision it was saved with."
            )
        self.core.load_state_dict({k: v for k, v in state.items() if k != "format"})


__all__ = ["FP8CheckpointState", "CHECKPOINT_FORMAT"]
