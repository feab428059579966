"""Loss scaling: where the loss scale lives, grows and backs off.

FP8 gradients with per-tensor scaling rarely underflow, so the default ("auto") is no loss scaling unless the
recipe casts gradients without a scale (E5M2 everywhere) or the compute dtype is FP16. Whatever the mode, the
scaler also owns the "were the gradients finite?" answer for the step, because the unscale and the check are one
fused pass (`torch._amp_foreach_non_finite_check_and_unscale_`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Union

import torch

LOSS_SCALING_CHOICES = ("auto", "dynamic", "none")
LossScaling = Union[str, float]


def parse_loss_scaling(loss_scaling: Any) -> LossScaling:
    """A static scale written as a string ("1024", "2e10": what a command line or a YAML file hands over) becomes the
    float it spells; every other value is returned as it is (validated by `resolve_loss_scaling`)."""
    if isinstance(loss_scaling, str) and loss_scaling not in LOSS_SCALING_CHOICES:
        try:
            return float(loss_scaling)
        except ValueError:
            return loss_scaling
    return loss_scaling


def resolve_loss_scaling(loss_scaling: LossScaling, gradients_scaled: bool, compute_dtype: torch.dtype) -> LossScaling:
    """Turn "auto" into "dynamic" or "none"; validate the rest (a numeric string is its float)."""
    loss_scaling = parse_loss_scaling(loss_scaling)
    if isinstance(loss_scaling, bool) or not isinstance(loss_scaling, (str, int, float)):
        raise ValueError(f"loss_scaling={loss_scaling!r} is not valid; valid choices: {list(LOSS_SCALING_CHOICES)} or a float")
    if isinstance(loss_scaling, (int, float)):
        if not (loss_scaling > 0 and loss_scaling != float("inf")):
            raise ValueError(f"a static loss_scaling must be a positive finite float, got {loss_scaling!r}")
        return float(loss_scaling)
    if loss_scaling not in LOSS_SCALING_CHOICES:
        raise ValueError(f"loss_scaling={loss_scaling!r} is not valid; valid choices: {list(LOSS_SCALING_CHOICES)} or a float")
    if loss_scaling == "auto":
        underflow_risk = compute_dtype == torch.float16 or not gradients_scaled
        return "dynamic" if underflow_risk else "none"
    return loss_scaling


class LossScaler:
    """Static, dynamic or no loss scaling.

    dynamic: start at `init_scale` (2**8), halve on an overflowing step, double after `growth_interval` clean
    steps in a row.
    """

    def __init__(
        self,
        mode: LossScaling = "none",
        init_scale: float = 2.0**8,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        if mode == "auto":
            raise ValueError("resolve 'auto' with resolve_loss_scaling() before building a LossScaler")
        self.mode = mode
        self.scale = float(mode) if isinstance(mode, float) else (init_scale if mode == "dynamic" else 1.0)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0
        #: called with the factor by which the scale changed (growth or back-off; not when a state is loaded):
        #: delayed gradient scales follow it (ScalingStepCloser.rescale_gradient_history)
        self.on_change: Optional[Callable[[float], None]] = None

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    @torch.no_grad()
    def unscale_and_check(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide gradients by the scale in place; return a float tensor, 1.0 if any gradient is inf/NaN."""
        grads = [g for g in grads if g is not None]
        found_inf = None
        by_device: Dict[Any, list] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            flag = flag.to("cpu") if found_inf is not None and found_inf.device != flag.device else flag
            found_inf = flag if found_inf is None else torch.maximum(found_inf.to(flag.device), flag)
        return found_inf if found_inf is not None else torch.zeros(1)

    def update(self, overflow: bool) -> None:
        """After a step: back off on overflow, grow after a clean window (dynamic mode only)."""
        if not self.dynamic:
            return
        if overflow:
            self.backoff()
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self._set(self.scale * self.growth_factor)
                self.clean_steps = 0

    def backoff(self) -> None:
        if self.dynamic:
            self._set(max(self.scale * self.backoff_factor, self.min_scale))
            self.clean_steps = 0

    def _set(self, scale: float) -> None:
        factor = scale / self.scale
        self.scale = scale
        if factor != 1.0 and self.on_change is not None:
            self.on_change(factor)

    def state_dict(self) -> Dict[str, Any]:
        return {"mode": self.mode, "scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
