"""FP8TrainingEngine: the stability machinery every adapter (Lightning, Fabric, Accelerate) drives.

Where a step is skipped, where a run is rolled back, where scales are updated after a step: all here. Adapters
translate their framework's hooks into four calls per optimizer step:

    engine.attach(model)                        once, after conversion
    loss = engine.scale_loss(loss)              before backward (also records the unscaled loss)
    engine.unscale_(optimizer)                  before clipping (idempotent within a step)
    result = engine.step(optimizer, step_fn)    instead of optimizer.step()

`step` decides, in this order: skip the update if gradients, the loss or an FP8 amax were non-finite (for every
loss-scaling mode, including "none"); update the loss scale; all-reduce amaxes and update every layer's scales; check
the weights; roll back to the last snapshot when the loss or weights went non-finite, after too many consecutive
skips, or on a loss spike; take a snapshot every `snapshot_every` good steps. Too many rollbacks in a window raise
FP8DivergenceError naming the layers whose amax overflowed.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.engine import clipping
from lightning_fp8.engine.distributed import all_reduce_max_, local_shards
from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.loss_scaler import LossScaler, resolve_loss_scaling
from lightning_fp8.engine.scales import ModelScales
from lightning_fp8.engine.snapshot import Snapshot
from lightning_fp8.modules.linear import FP8Linear
from lightning_fp8.recipe import FP8Recipe

log = logging.getLogger("lightning_fp8")


class FP8DivergenceError(RuntimeError):
    """Training kept diverging after the allowed number of rollbacks."""


@dataclass
class StepResult:
    stepped: bool
    skipped_reason: Optional[str] = None
    rolled_back: bool = False
    rollback_reason: Optional[str] = None
    overflow_layers: List[str] = field(default_factory=list)


class FP8TrainingEngine:
    def __init__(
        self,
        recipe: FP8Recipe,
        config: Optional[StabilityConfig] = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.recipe = recipe
        self.config = config or StabilityConfig()
        self.compute_dtype = compute_dtype
        mode = resolve_loss_scaling(self.config.loss_scaling, recipe.scale_gradients, compute_dtype)
        self.scaler = LossScaler(mode, init_scale=self.config.init_loss_scale, growth_interval=self.config.growth_interval)
        self.model: Optional[nn.Module] = None
        self.layers: Dict[str, FP8Linear] = {}
        self.optimizers: List[torch.optim.Optimizer] = []
        # counters (public through the adapters)
        self.skipped_steps = 0
        self.rollbacks = 0
        self.step_count = 0
        self.consecutive_skips = 0
        #: (fqn.role) -> number of steps in which that tensor's amax overflowed; names layers in errors
        self.overflow_events: Counter = Counter()
        #: chronological record of skips and rollbacks for loggers and the report
        self.events: List[Dict[str, Any]] = []
        self._rollback_steps: Deque[int] = deque()
        self._loss_window: Deque[float] = deque(maxlen=self.config.spike_window)
        self._snapshot: Optional[Snapshot] = None
        self.scales = ModelScales({})
        self._losses: List[torch.Tensor] = []
        self._unscaled: set = set()
        self._grads_nonfinite = False
        self.last_result: Optional[StepResult] = None

    # -- setup --------------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Adopt a converted model: the engine now syncs and updates its FP8 scales once per optimizer step."""
        self.model = model
        self.layers = fp8_layers(model)
        for layer in self.layers.values():
            layer.autoupdate_scales = False
        self.scales = ModelScales(self.layers)
        # a loss-scale change scales every gradient amax by the same factor: delayed gradient scales follow it
        self.scaler.on_change = self.scales.rescale_gradient_history

    def resync(self) -> None:
        """Take the layers' overflow counters as the baseline (after attaching, or after loading FP8 state from a
        checkpoint), so only overflows that happen from now on count against a step."""
        self.scales.resync()

    def _register(self, optimizer: torch.optim.Optimizer) -> None:
        if not any(opt is optimizer for opt in self.optimizers):
            self.optimizers.append(optimizer)

    def replace_optimizer(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        self.optimizers = [new if opt is old else opt for opt in self.optimizers]

    # -- per step -----------------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._losses.append(loss.detach())
        return self.scaler.scale_loss(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this optimizer's gradients in place and note whether any is non-finite (once per step)."""
        if id(optimizer) in self._unscaled:
            return
        self._unscaled.add(id(optimizer))
        found_inf = self.scaler.unscale_and_check(_grads(optimizer))
        self._grads_nonfinite |= bool(found_inf.item())

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, parameters: Optional[Sequence[torch.Tensor]] = None
    ) -> torch.Tensor:
        """Clip the unscaled gradients of `optimizer` (or of `parameters`, a subset of its parameters) to a global
        L2 norm of max_norm, the norm computed in float32; a non-finite norm marks the step to be skipped."""
        self.unscale_(optimizer)
        grads = _grads(optimizer) if parameters is None else [p.grad for p in parameters if p.grad is not None]
        norm = clipping.clip_grad_norm_(grads, max_norm)
        if not torch.isfinite(norm):
            self._grads_nonfinite = True
        return norm

    def clip_grad_value_(
        self, optimizer: torch.optim.Optimizer, clip_value: float, parameters: Optional[Sequence[torch.Tensor]] = None
    ) -> None:
        self.unscale_(optimizer)
        grads = _grads(optimizer) if parameters is None else [p.grad for p in parameters if p.grad is not None]
        clipping.clip_grad_value_(grads, clip_value)

    def step(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any]) -> StepResult:
        """Apply (or skip) one optimizer step and run the post-step stability logic."""
        self._register(optimizer)
        if self._snapshot is None and self.model is not None:
            self._take_snapshot()  # the state before the first step is a valid rollback target
        self.unscale_(optimizer)
        overflow_layers = self._new_overflows()
        loss_value = self._step_loss()
        loss_nonfinite = loss_value is not None and not torch.isfinite(loss_value).item()
        spike = self._is_spike(loss_value) if not loss_nonfinite else False
        flags = torch.tensor(
            [float(self._grads_nonfinite), float(loss_nonfinite), float(bool(overflow_layers)), float(spike)]
        )
        all_reduce_max_([flags])
        grads_bad, loss_bad, amax_bad, spike = (bool(f) for f in flags.tolist())

        skip_reason = None
        if loss_bad:
            skip_reason = "non-finite loss"
        elif grads_bad:
            skip_reason = "non-finite gradients"
        elif amax_bad:
            skip_reason = "FP8 amax overflow in " + ", ".join(overflow_layers) if overflow_layers else "FP8 amax overflow on another rank"
        elif spike:
            skip_reason = "loss spike"
        result = StepResult(stepped=skip_reason is None, skipped_reason=skip_reason, overflow_layers=overflow_layers)
        self.step_count += 1
        if result.stepped:
            step_fn()
            self.consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self._event("skip", skip_reason, overflow_layers)
            log.info("lightning_fp8: step %d skipped (%s)", self.step_count, skip_reason)
        self.scaler.update(overflow=grads_bad or amax_bad or loss_bad)
        self.scales.close_step(taken=result.stepped)

        rollback_reason = None
        if loss_bad:
            rollback_reason = "non-finite loss"
        elif spike:
            rollback_reason = f"loss spike above {self.config.spike_factor}x its running mean"
        elif self.consecutive_skips >= self.config.max_consecutive_skips:
            rollback_reason = f"{self.consecutive_skips} consecutive skipped steps"
        elif result.stepped and self._weights_due() and not self._weights_finite():
            rollback_reason = "non-finite weights"
        if rollback_reason is not None:
            self._rollback(rollback_reason)
            result.rolled_back, result.rollback_reason = True, rollback_reason
        elif result.stepped:
            if loss_value is not None:
                self._loss_window.append(float(loss_value))
            if self.step_count % self.config.snapshot_every == 0 and self._weights_finite():
                self._take_snapshot()
        self._end_step()
        self.last_result = result
        return result

    def skip_step(self) -> None:
        """End a step whose backward never ran (e.g. the training step returned None): nothing to apply."""
        self._end_step()

    # -- scales -------------------------------------------------------------------------------------------------
    def update_scales(self) -> None:
        """Close a scaling step outside `step` (calibration does, once per calibration batch)."""
        self.scales.close_step(taken=True)

    def _new_overflows(self) -> List[str]:
        overflowed = self.scales.new_overflows()
        self.overflow_events.update(overflowed)
        return overflowed

    # -- checks -------------------------------------------------------------------------------------------------
    def _step_loss(self) -> Optional[torch.Tensor]:
        if not self._losses:
            return None
        return torch.stack([loss.float().reshape(()) for loss in self._losses]).mean().cpu()

    def _is_spike(self, loss_value: Optional[torch.Tensor]) -> bool:
        factor = self.config.spike_factor
        if factor is None or loss_value is None or len(self._loss_window) < min(self.config.spike_warmup, self._loss_window.maxlen):
            return False
        mean = sum(self._loss_window) / len(self._loss_window)
        return float(loss_value) > factor * mean

    def _weights_due(self) -> bool:
        return self.step_count % self.config.check_weights_every == 0

    @torch.no_grad()
    def _weights_finite(self) -> bool:
        if self.model is None:
            return True
        params = [p for p in local_shards(self.model.parameters()) if p.numel()]  # FSDP2: this rank's shards
        if not params:
            params = [torch.zeros(1)]  # an empty shard still joins the flag's all-reduce below
        device = params[0].device
        norms = torch._foreach_norm(params)
        all_finite = torch.isfinite(torch.stack([n.float().to(device) for n in norms])).all()
        flag = (~all_finite).float().reshape(1).cpu()  # one device-to-host transfer
        all_reduce_max_([flag])
        return flag.item() == 0.0

    # -- rollback -----------------------------------------------------------------------------------------------
    def _take_snapshot(self) -> None:
        self._snapshot = Snapshot(self.step_count, self.model, self.optimizers, {"scaler": self.scaler.state_dict()})

    def _rollback(self, reason: str) -> None:
        window_start = self.step_count - self.config.rollback_window
        while self._rollback_steps and self._rollback_steps[0] <= window_start:
            self._rollback_steps.popleft()
        if len(self._rollback_steps) >= self.config.max_rollbacks:
            raise FP8DivergenceError(self._divergence_message(reason))
        self._rollback_steps.append(self.step_count)
        self.rollbacks += 1
        restored_to = self._snapshot.step if self._snapshot is not None else None
        if self._snapshot is not None:
            extra = self._snapshot.restore(self.model, self.optimizers)
            self.scaler.load_state_dict(extra["scaler"])
        self.scaler.backoff()
        self.consecutive_skips = 0
        self.resync()  # the counters were restored with the model's buffers
        self._event("rollback", reason, [], restored_to_step=restored_to)
        log.warning(
            "lightning_fp8: rolled back at step %d to the snapshot of step %s (%s); loss scale now %g",
            self.step_count, restored_to, reason, self.scaler.scale,
        )

    def _divergence_message(self, reason: str) -> str:
        layers = ", ".join(f"{name} ({n} steps)" for name, n in self.overflow_events.most_common(10))
        return (
            f"lightning_fp8: training diverged: {self.config.max_rollbacks} rollbacks within "
            f"{self.config.rollback_window} steps (latest at step {self.step_count}: {reason}). "
            f"Layers whose FP8 amax overflowed: {layers or 'none recorded'}. "
            "Consider keeping these layers in BF16 (FP8Recipe(skip_patterns=...) or FP8LayerFallback), a larger "
            "FP8Recipe(margin=...), current scaling, or a lower learning rate."
        )

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def _end_step(self) -> None:
        self._losses.clear()
        self._unscaled.clear()
        self._grads_nonfinite = False

    def _event(self, kind: str, reason: Optional[str], layers: Sequence[str], **extra: Any) -> None:
        self.events.append({"step": self.step_count, "kind": kind, "reason": reason, "layers": list(layers), **extra})

    def metrics(self) -> Dict[str, float]:
        return {
            "fp8/skipped_steps": float(self.skipped_steps),
            "fp8/rollbacks": float(self.rollbacks),
            "fp8/loss_scale": float(self.scaler.scale),
        }

    def state_dict(self) -> Dict[str, Any]:
        return {
            "recipe": self.recipe.to_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "step_count": self.step_count,
            "consecutive_skips": self.consecutive_skips,
            "overflow_events": dict(self.overflow_events),
            "rollback_steps": list(self._rollback_steps),
            "loss_window": list(self._loss_window),
            "events": list(self.events),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state["skipped_steps"])
        self.rollbacks = int(state["rollbacks"])
        self.step_count = int(state["step_count"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.overflow_events = Counter(state.get("overflow_events", {}))
        self._rollback_steps = deque(state.get("rollback_steps", []))
        self._loss_window = deque(state.get("loss_window", []), maxlen=self.config.spike_window)
        self.events = list(state.get("events", []))
        self._snapshot = None  # a fresh snapshot is taken at the next step


def _grads(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
