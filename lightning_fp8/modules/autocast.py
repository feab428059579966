"""`fp8_autocast`: switch the FP8 path of converted layers on or off for a region of code.

Converted layers compute in FP8 by default; `fp8_autocast(enabled=False)` makes them compute in high precision
(BF16 under torch.autocast). `recipe=` overrides the recipe of every converted layer inside the region, and
`calibrating=True` runs layers in high precision while recording amaxes (used by FP8Calibration).

The state is one process-wide value, not thread-local: `torch.compile` reads it as a guarded global (a thread-local
would break the graph at every FP8 layer), and a region is entered and left by the thread that runs the model.
Threads running converted models concurrently with different settings are not supported.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

from lightning_fp8.recipe import FP8Recipe


@dataclass(frozen=True)
class AutocastState:
    enabled: bool = True
    recipe: Optional[FP8Recipe] = None
    calibrating: bool = False


_state = AutocastState()


def current_state() -> AutocastState:
    return _state


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True, recipe: Optional[FP8Recipe] = None, calibrating: Optional[bool] = None
) -> Iterator[None]:
    """Turn the FP8 path of converted layers on (default) or off inside the block.

    `enabled=False` holds for every forward inside the block, the forwards of models prepared by the adapters
    included (the Lightning Trainer's evaluation loops, a Fabric-set-up model, a model Accelerate or transformers'
    Trainer prepared): their own FP8 context can turn FP8 off (fp8_eval=False), never back on.

    `recipe` and `calibrating` are inherited from an enclosing block unless given, so a plugin's step context
    nested in a calibration region does not cancel the calibration."""
    if recipe is not None and not isinstance(recipe, FP8Recipe):
        raise TypeError(f"fp8_autocast(recipe=...) expects an FP8Recipe, got {type(recipe).__name__}")
    global _state
    previous = _state
    _state = AutocastState(
        enabled=bool(enabled),
        recipe=recipe if recipe is not None else previous.recipe,
        calibrating=previous.calibrating if calibrating is None else bool(calibrating),
    )
    try:
        yield
    finally:
        _state = previous
