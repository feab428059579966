"""The FP8 engine's state as an object checkpoints carry: `Accelerator.save_state` / `load_state`
(register_for_checkpointing: custom_checkpoint_0.pkl) and transformers' `Trainer` (as `accelerator.scaler`:
scaler.pt in every checkpoint-N folder, loaded back by `trainer.train(resume_from_checkpoint=...)`)."""
from __future__ import annotations

from typing import Any, Dict

from lightning_fp8.integrations.plugin_core import FP8PrecisionCore

CHECKPOINT_FORMAT = "lightning_fp8.accelerate/1"


class FP8CheckpointState:
    """The engine's state (loss scaler, counters, rollback bookkeeping) and every FP8 layer's metadata (scales, amax
    histories, fallback switches: not part of the model's state_dict), as an object checkpoints carry.

    FP8Accelerator registers it for Accelerate's save_state / load_state and also puts it where Accelerate keeps a
    GradScaler (`accelerator.scaler`; FP8 has none, the engine scales the loss), because that is what transformers'
    Trainer saves with each checkpoint. Like a GradScaler it answers `get_scale()` and `is_enabled()`; loss scaling
    itself goes through `accelerator.backward`."""

    def __init__(self, core: FP8PrecisionCore) -> None:
        self.core = core

    def get_scale(self) -> float:
        """The engine's current loss scale (1.0 without loss scaling)."""
        return float(self.core.engine.loss_scale)

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> Dict[str, Any]:
        # no collective here: transformers' Trainer asks on the main process alone (scaler.pt); Accelerate's
        # save_state, which every rank calls, settles the engine before it gets here (FP8Accelerator.save_state)
        return {"format": CHECKPOINT_FORMAT, **self.core.state_dict(settle=False)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                "lightning_fp8: this checkpoint has no FP8Accelerator engine state where the FP8 run registered it "
                "(custom_checkpoint_0.pkl): it was saved without mixed_precision='fp8', or with other objects "
                "registered first. Load it with the mixed precision it was saved with."
            )
        self.core.load_state_dict({k: v for k, v in state.items() if k != "format"})
