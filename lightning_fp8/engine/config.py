"""StabilityConfig: the knobs of loss scaling, skipping and rollback, validated once.

Every adapter takes each of these fields as an option of the same name and default (the options are the parameters
of `FP8PrecisionCore.__init__`, lightning_fp8/integrations/plugin_core.py); `StabilityConfig.from_options` picks them out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from lightning_fp8.engine.loss_scaler import LossScaling


@dataclass(frozen=True)
class StabilityConfig:
    """The knobs of loss scaling, skipping and rollback.

    loss_scaling: "auto" | "dynamic" | "none" | float (static scale).
    init_loss_scale / growth_interval: the dynamic scaler starts at init_loss_scale and doubles after growth_interval
        clean iterations in a row.
    snapshot_every: iterations between snapshots of the last good state (host memory). Smaller loses fewer good
        iterations on a rollback and copies the model and optimizer state to the host more often.
    max_consecutive_skips: this many skipped iterations in a row trigger a rollback.
    max_rollbacks / rollback_window: more than max_rollbacks rollbacks within rollback_window iterations stop
        training; max_rollbacks=0 turns rollback (and so snapshots) off.
    spike_factor: roll back when the loss exceeds spike_factor x its running mean (None: off); the mean is over the
        last spike_window good iterations, and the rule waits for spike_warmup of them.
    check_weights_every: iterations between checks that every weight is finite (one norm pass and one
        device-to-host copy each).

    An iteration is one backward (or several, accumulated) and a step of every optimizer (engine.py).
    """

    loss_scaling: LossScaling = "auto"
    init_loss_scale: float = 2.0**8
    growth_interval: int = 1000
    snapshot_every: int = 50
    max_consecutive_skips: int = 10
    max_rollbacks: int = 3
    rollback_window: int = 1000
    spike_factor: Optional[float] = None
    spike_window: int = 50
    spike_warmup: int = 20
    check_weights_every: int = 1

    def __post_init__(self) -> None:
        for name in (
            "snapshot_every", "max_consecutive_skips", "rollback_window", "spike_window", "spike_warmup",
            "check_weights_every", "growth_interval",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_rollbacks, int) or self.max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be an int >= 0, got {self.max_rollbacks!r}")
        if isinstance(self.init_loss_scale, bool) or not (
            isinstance(self.init_loss_scale, (int, float)) and 0 < self.init_loss_scale < float("inf")
        ):
            raise ValueError(f"init_loss_scale must be a positive finite float, got {self.init_loss_scale!r}")
        if self.spike_factor is not None and not self.spike_factor > 1.0:
            raise ValueError(f"spike_factor must be > 1 (or None to disable), got {self.spike_factor!r}")

    @classmethod
    def from_options(cls, options: Any) -> "StabilityConfig":
        """The config of an adapter's options (any record with one attribute per field, e.g. `FP8Options`)."""
        return cls(**{field.name: getattr(options, field.name) for field in dataclasses.fields(cls)})
