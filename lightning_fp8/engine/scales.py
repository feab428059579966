"""ModelScales: the FP8 scaling state of every layer of a model, closed once per training step.

The engine (engine.py) decides *when* a step ends and whether it was taken; this object does what ending it means for
the scales, for all layers at once:

    overflows = scales.new_overflows()      before the skip decision: which (layer, role) casts overflowed this step
    scales.close_step(taken=...)            after it: sync the step's amaxes across ranks, then update every layer's
                                            scales (taken) or forget the step's amaxes (rejected)

The rules themselves (what a new scale is) live in lightning_fp8/numerics/scaling.py.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from lightning_fp8.engine.distributed import all_reduce_max_
from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.recipe import ROLES


class ModelScales:
    """The scaling states of `layers` ({fqn: FP8 layer}), closed together once per step."""

    def __init__(self, layers: Dict[str, FP8Layer]) -> None:
        self.layers = dict(layers)
        self.keys = [f"{fqn}.{role}" for fqn in self.layers for role in ROLES]
        self._baseline = self._overflow_counts()

    def resync(self) -> None:
        """Take the layers' overflow counters as the baseline (after loading FP8 state, or a rollback), so only
        overflows that happen from now on are reported."""
        self._baseline = self._overflow_counts()

    def new_overflows(self) -> List[str]:
        """"fqn.role" of every cast whose amax overflowed since the last call (one device-to-host copy)."""
        counts = self._overflow_counts()
        if self._baseline.shape != counts.shape:
            self._baseline = torch.zeros_like(counts)
        new = (counts - self._baseline).tolist()
        self._baseline = counts
        return [key for key, n in zip(self.keys, new) if n > 0]

    @torch.no_grad()
    def close_step(self, taken: bool = True) -> None:
        """End the step for every layer: all-reduce the step's amaxes across ranks (one collective), then update
        every layer's scales and roll the histories."""
        if not self.layers:
            return
        slots = [getattr(layer.fp8_meta, role).amax_history[:1] for layer in self.layers.values() for role in ROLES]
        all_reduce_max_(slots)
        for layer in self.layers.values():
            layer.update_scales()

    def _overflow_counts(self) -> torch.Tensor:
        counts = [getattr(layer.fp8_meta, role).overflow_count for layer in self.layers.values() for role in ROLES]
        if not counts:
            return torch.zeros(0, dtype=torch.int64)
        device = counts[0].device
        return torch.stack([c.to(device) for c in counts]).cpu()


__all__ = ["ModelScales"]
