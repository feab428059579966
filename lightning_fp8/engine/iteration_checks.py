"""What an iteration's decision checks besides its gradients: the loss (non-finite, or a spike above its running
mean) and, after the step, the weights; and the one read that brings every flag of a decision to the host
(`IterationFlags`). The engine (engine.py) decides what to do with the answers.

The checks compute on the device and read nothing: the engine gathers the decision's flags (non-finite gradients or
gradient norm, non-finite loss, loss spike, every FP8 role's overflow, the weights the previous step wrote) into one
tensor, MAX-reduces it across ranks on the device and reads it once, with this rank's loss for the spike window (one
device-to-host synchronisation per iteration, after the backward, where the step waits for the gradients anyway)."""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.distributed import all_reduce_max_, local_shards
from lightning_fp8.engine.host_reads import to_host
from lightning_fp8.modules.local_shards import is_dtensor


def plain_value(value: torch.Tensor) -> torch.Tensor:
    """`value` as a plain tensor: a DTensor (a loss computed under tensor parallelism's `loss_parallel()`, a norm of
    sharded gradients) becomes its local tensor where every rank holds the whole value (Replicate on every mesh
    dimension: nothing to communicate), else its full tensor (a collective, which every rank reaches here alike:
    the engine records the loss at each backward). Any other tensor is returned as it is."""
    if not is_dtensor(value):
        return value
    if all(placement.is_replicate() for placement in value.placements):
        return value.to_local()
    return value.full_tensor()


class LossRecord:
    """The losses of the open iteration (one per backward) and the running window of good iterations' losses."""

    def __init__(self, config: StabilityConfig) -> None:
        self.config = config
        self.window: Deque[float] = deque(maxlen=config.spike_window)
        self._losses: List[torch.Tensor] = []
        self._pending: Optional[float] = None

    def record(self, loss: torch.Tensor) -> None:
        """Keep this backward's loss (detached; a DTensor loss as the plain value every rank agrees on)."""
        self._losses.append(plain_value(loss.detach()))

    def clear(self) -> None:
        self._losses.clear()

    def device_value(self) -> Optional[torch.Tensor]:
        """The iteration's loss (mean over its backwards) on the device, or None without a backward."""
        if not self._losses:
            return None
        return torch.stack([loss.float().reshape(()) for loss in self._losses]).mean()

    def spike_threshold(self) -> Optional[float]:
        """The loss above which this iteration is a spike (`spike_factor` x the running mean), None while the rule is
        off or its window is still warming up."""
        factor = self.config.spike_factor
        if factor is None or len(self.window) < min(self.config.spike_warmup, self.window.maxlen):
            return None
        return factor * (sum(self.window) / len(self.window))

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
def weights_nonfinite(model: Optional[nn.Module]) -> torch.Tensor:
    """A device flag, 1.0 if a parameter of `model` (this rank's shards under FSDP2) holds inf / NaN: one fused norm
    over the parameters, nothing read on the host."""
    params = [p for p in local_shards(model.parameters()) if p.numel()] if model is not None else []
    if not params:
        return torch.zeros(())  # an empty shard still joins the flags' all-reduce, or the ranks would hang
    device = params[0].device
    norms = torch._foreach_norm(params)
    return (~torch.isfinite(torch.stack([n.float().to(device) for n in norms])).all()).float()


@torch.no_grad()
def weights_finite(model: Optional[nn.Module], flag: Optional[torch.Tensor] = None, agree: bool = True) -> bool:
    """Every parameter of `model` is finite (one fused norm, or `flag`, a `weights_nonfinite` computed before; one
    host read): for the checks that cannot wait for the next decision's flags (before a snapshot overwrites the last
    good state, before a checkpoint). agree=True: on every rank (the flag MAX-reduced on the device first, one
    collective every rank must join); agree=False: this rank's weights only, no collective (replicated weights,
    where every rank's answer is the same)."""
    flag = (weights_nonfinite(model) if flag is None else flag).reshape(1).float()
    if agree:
        all_reduce_max_([flag])
    return to_host(flag, "weights finite") == [0.0]


class IterationFlags:
    """A decision's flags, gathered on the device and read in one copy.

    `agree(name, flag)` adds device flags (0 / 1, any shape) every rank must agree on: `read` MAX-reduces them across
    ranks in one collective on the device, so a flag set on any rank is set on all. `local(name, value)` adds device
    values read as this rank has them (the loss, for this rank's spike window), NaN included. `read()` returns
    {name: [floats]} after one `to_host`."""

    def __init__(self) -> None:
        self._agreed: List[Tuple[str, torch.Tensor]] = []
        self._local: List[Tuple[str, torch.Tensor]] = []

    def agree(self, name: str, flag: Optional[torch.Tensor], numel: int = 1) -> None:
        """`flag`, or `numel` zeros where this rank has nothing to flag (the ranks' vectors must match)."""
        flag = plain_value(flag.detach()) if flag is not None else None
        self._agreed.append((name, flag.reshape(-1).float() if flag is not None else torch.zeros(numel)))

    def local(self, name: str, value: Optional[torch.Tensor]) -> None:
        if value is not None:
            self._local.append((name, plain_value(value.detach()).reshape(-1).float()))

    def read(self) -> Dict[str, List[float]]:
        parts = self._agreed + self._local
        if not parts:
            return {}
        on_device = [t for _, t in parts if t.device.type != "cpu"]
        device = on_device[0].device if on_device else torch.device("cpu")
        agreed = torch.cat([t.to(device) for _, t in self._agreed]) if self._agreed else torch.zeros(0, device=device)
        all_reduce_max_([agreed])  # flags are 0 / 1: no NaN to lose in the MAX
        flat = torch.cat([agreed] + [t.to(device) for _, t in self._local])
        values = to_host(flat, "iteration flags")
        out, offset = {}, 0
        for name, t in parts:
            out[name] = values[offset : offset + t.numel()]
            offset += t.numel()
        return out
