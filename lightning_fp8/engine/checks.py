"""What an iteration's decision checks besides its gradients: the loss (non-finite, or a spike above its running
mean) and, after the step, the weights. The engine (engine.py) decides what to do with the answers."""
from __future__ import annotations

from collections import deque
from typing import Deque, List, Optional, Sequence

import torch
from torch import nn

from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.distributed import local_shards, max_across_ranks
from lightning_fp8.engine.host import to_host


class LossRecord:
    """The losses of the open iteration (one per backward) and the running window of good iterations' losses."""

    def __init__(self, config: StabilityConfig) -> None:
        self.config = config
        self.window: Deque[float] = deque(maxlen=config.spike_window)
        self._losses: List[torch.Tensor] = []
        self._pending: Optional[float] = None

    def record(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def clear(self) -> None:
        self._losses.clear()

    def value(self) -> Optional[float]:
        """The iteration's loss (mean over its backwards) on the host, or None without a backward."""
        if not self._losses:
            return None
        return to_host(torch.stack([loss.float().reshape(()) for loss in self._losses]).mean(), "loss")[0]

    def is_spike(self, value: Optional[float]) -> bool:
        factor = self.config.spike_factor
        if factor is None or value is None or len(self.window) < min(self.config.spike_warmup, self.window.maxlen):
            return False
        return float(value) > factor * (sum(self.window) / len(self.window))

    def hold(self, value: Optional[float]) -> None:
        """The decided iteration's loss, to join the window if its update is kept (`accept` at the close)."""
        self._pending = float(value) if value is not None else None

    def accept(self) -> None:
        if self._pending is not None:
            self.window.append(self._pending)
        self._pending = None

    def load(self, window: Sequence[float]) -> None:
        self.window = deque(window, maxlen=self.config.spike_window)


@torch.no_grad()
def weights_finite(model: Optional[nn.Module]) -> bool:
    """Every parameter of `model` is finite on every rank (one fused norm, one host copy, one collective)."""
    if model is None:
        return True
    params = [p for p in local_shards(model.parameters()) if p.numel()]  # FSDP2: this rank's shards
    if not params:
        params = [torch.zeros(1)]  # an empty shard still joins the flag's all-reduce below, or the ranks would hang
    device = params[0].device
    norms = torch._foreach_norm(params)
    all_finite = torch.isfinite(torch.stack([n.float().to(device) for n in norms])).all()
    return max_across_ranks(to_host((~all_finite).float(), "weights finite")) == [0.0]


__all__ = ["LossRecord", "weights_finite"]
