"""Per-tensor scaling: where every scale in the library is computed and updated.

Rules (one place, tested in tests/test_scaling.py):
- scale = fp8_max / amax / 2**margin, the multiplier applied before the cast (TE's convention).
- amax == 0 (the tensor was all zeros, or the layer did not run): keep the previous scale.
- amax inf or NaN: an *overflow event*. It is counted in `overflow_count`, never written into the amax history,
  and the scale is kept, so one bad step cannot poison the scales of the steps that follow.
- A scale that would be infinite (amax tiny) is clamped to the largest float32.
- Delayed scaling: the amax of the step being computed accumulates (max) in amax_history[0]; `update()` (after
  each optimizer step, or lazily at the next forward) computes the new scale from the history ("max" or
  "most_recent"), then rolls the history and opens a fresh slot 0.
- Current scaling: the scale comes from the amax of the tensor being cast, right now.
- A delayed-scaling state that has never seen an amax (`initialized` False) uses current scaling for its casts,
  so the first steps are safe without a calibration pass.

All of this stays in tensor operations: no host synchronisation in the training step.
"""
from __future__ import annotations



import torch
from torch import nn

from lightning_fp8.numerics.formats import FP8Format

_FLOAT32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    margin: int,
    previous_scale: torch.Tensor,
    power_of_2: bool = False,
) -> torch.Tensor:
    """New scale for an amax, falling back to `previous_scale` when amax is 0, inf or NaN."""
    usable = torch.isfinite(amax) & (amax > 0)
    safe_amax = torch.where(usable, amax, torch.ones_like(amax))
    scale = (fp8_max / safe_amax) / (2.0**margin)
    scale = torch.clamp(scale, max=_FLOAT32_MAX)
    if power_of_2:
        # frexp gives the exact binary exponent (scale = m * 2**e, 0.5 <= m < 1); floor(log2(.)) rounds up just
        # below a power of two, and the resulting scale would clip the amax itself
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return torch.where(usable, scale, previous_scale)


class ScalingState(nn.Module):
    """Scaling metadata of one tensor role of one layer, kept as buffers.

    Buffers (all in the state_dict, so checkpoints carry them and they round-trip exactly):
      scale           float32 scalar, the quantization multiplier in use
      amax_history    float32 [L]; slot 0 is the step in progress, 1.. are past steps, newest first
      overflow_count  int64 scalar, casts whose amax was inf/NaN
      clip_count      int64 scalar, casts where some finite value exceeded the range and was saturated
      initialized     bool scalar, a delayed scale has been computed from a real amax
    """

    def __init__(self, history_len: int, device=None) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("amax_history", torch.zeros(history_len, dtype=torch.float32, device=device))
        self.register_buffer("overflow_count", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("clip_count", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool, device=device))
        # host-side flag: an amax was recorded since the last update (not state: an update is due, nothing more)
        self.pending_update = False

    # -- checkpoint compatibility -------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # A checkpoint of a plain nn.Linear has no FP8 metadata: keep our freshly initialised values instead of
        # failing a strict load. A history of another length is resized (newest entries kept).
        for name, buf in self._buffers.items():
            key = prefix + name
            if key not in state_dict:
                state_dict[key] = buf.detach().clone()
            elif name == "amax_history" and state_dict[key].shape != buf.shape:
                state_dict[key] = _resize_history(state_dict[key], buf.numel())
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    # -- the two operations of a step ---------------------------------------------------------------------------
    def scale_for_cast(self, amax: torch.Tensor, fmt: FP8Format, scaling: str, margin: int, power_of_2: bool) -> torch.Tensor:
        """The scale to cast a tensor whose amax is `amax` with, under `scaling` ("delayed" or "current")."""
        current = scale_from_amax(amax, fmt.max, margin, self.scale, power_of_2)
        if scaling == "current":
            return current
        return torch.where(self.initialized, self.scale, current)

    @torch.no_grad()
    def record(self, amax: torch.Tensor, used_scale: torch.Tensor, fmt: FP8Format, scaling: str) -> None:
        """Account for one cast in training: amax into slot 0 (if finite), counters, and for current scaling
        the scale itself (so the state shows what was used)."""
        finite = torch.isfinite(amax)
        self.overflow_count += (~finite).to(torch.int64)
        self.clip_count += (finite & (amax * used_scale > fmt.max)).to(torch.int64)
        self.observe_amax(amax)
        if scaling == "current":
            self.scale.copy_(used_scale)

    @torch.no_grad()
    def observe_amax(self, amax: torch.Tensor) -> None:
        """Accumulate a finite amax into slot 0 without a cast (what calibration does); inf/NaN are not recorded."""
        finite = torch.isfinite(amax)
        self.amax_history[0] = torch.where(finite, torch.maximum(self.amax_history[0], amax), self.amax_history[0])
        self.pending_update = True

    @torch.no_grad()
    def reset(self) -> None:
        """Forget the amax history and the scale (counters are kept: they are the layer's record). The next cast
        uses current scaling, as a fresh state does."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)
        self.initialized.fill_(False)
        self.pending_update = False

    @torch.no_grad()
    def update(self, fmt: FP8Format, scaling: str, algo: str, margin: int, power_of_2: bool, scaled: bool = True) -> None:
        """End of a step: new delayed scale from the history, then roll the history."""
        if scaling == "delayed" and scaled:
            amax = self.amax_history.max() if algo == "max" else self.amax_history[0]
            new_scale = scale_from_amax(amax, fmt.max, margin, self.scale, power_of_2)
            self.scale.copy_(new_scale)
            self.initialized |= torch.isfinite(amax) & (amax > 0)
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = 0.0
        self.pending_update = False

    def scale_inv(self) -> torch.Tensor:
        return self.scale.reciprocal()


def _resize_history(history: torch.Tensor, length: int) -> torch.Tensor:
    if history.numel() >= length:
        return history[:length].clone()
    out = torch.zeros(length, dtype=history.dtype, device=history.device)
    out[: history.numel()] = history
    return out



__all__ = ["ScalingState", "scale_from_amax"]
