"""FP8TrainingEngine: the stability machinery every adapter (Lightning, Fabric, Accelerate) drives.

Skips, rollbacks and scale updates happen once per training **iteration**, whatever the number of optimizers: the
backward(s) that produced the gradients, then one step of each optimizer. Adapters translate their hooks into:

    engine.attach(model)                          once, after conversion
    engine.track(optimizers, lr_schedulers)       the framework's complete sets (Lightning's connect), or
    engine.register_optimizer / _lr_scheduler     one at a time (Accelerate's prepare; Fabric at a first step)
    engine.begin_iteration()                      before a training forward (closes the previous iteration)
    loss = engine.scale_loss(loss)                before a backward (closes a decided iteration first)
    engine.unscale_(optimizer)                    before clipping (each gradient is unscaled once per iteration)
    result = engine.step(optimizer, step_fn)      instead of optimizer.step()
    engine.end_iteration()                        at the framework's end of an iteration, before a checkpoint

The first `step` of an iteration decides for all its optimizers: unscale every gradient the iteration produced (the
model's and every registered optimizer's; gradients.py), check them, the loss, the FP8 amaxes and the weights the
previous step wrote, all on the device, all-reduce the flags once and read them once (iteration_checks.py `IterationFlags`: the
iteration's one device-to-host read), then step or skip; the other optimizers reuse the decision. The iteration
closes once, when every registered optimizer has stepped or at the next boundary above: loss-scale update, every
layer's scaling step closed (taken or not), the iteration counted, the weights checked on the device (read at the
next decision; read at once before a snapshot, which must not replace the last good state with bad weights), a
snapshot every `snapshot_every` iterations (rollback.py says when its parts are taken). An optimizer stepping after
the close with no forward or backward in between joins the closed iteration's decision (Fabric's first iteration,
before the engine knows every optimizer).

Rollback to the last snapshot happens at the decision for a non-finite loss, a loss spike or too many skips in a row
(every optimizer of the iteration then skips), when the previous step made the weights non-finite (at this decision,
so no optimizer steps from them; at the close of a snapshot's iteration; at `settle`, before a checkpoint); too many
rollbacks in a window raise FP8DivergenceError naming the layers whose amax overflowed. A rollback restores the
model, every registered optimizer and LR scheduler, and the loss scaler (snapshot.py). The parts that stand alone
live in gradients.py, iteration_checks.py, rollback.py and snapshot.py.
"""
from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.distributed.all_gather import precompute_fp8_weight_amaxes
from lightning_fp8.distributed.sharding import is_fsdp_sharded
from lightning_fp8.engine import clipping, rollback
from lightning_fp8.engine.iteration_checks import IterationFlags, LossRecord, weights_finite, weights_nonfinite
from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.gradients import GradientUnscaler, iteration_params
from lightning_fp8.engine.loss_scaler import LossScaler, resolve_loss_scaling
from lightning_fp8.engine.rollback import FP8DivergenceError, RollbackBudget, SnapshotKeeper
from lightning_fp8.engine.step_closer import ScalingStepCloser
from lightning_fp8.engine.snapshot import optimizer_params
from lightning_fp8.modules.linear import FP8Linear
from lightning_fp8.modules.local_shards import localize_fp8_state
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.state_format import FORMAT_VERSION_KEY, format_version
from lightning_fp8.renamed import warn_renamed

log = logging.getLogger("lightning_fp8")

#: the format version of `FP8TrainingEngine.state_dict` (lightning_fp8/state_format.py)
ENGINE_STATE_VERSION = 1


def _has_sharded_parameters(model: Optional[nn.Module]) -> bool:
    """Whether some parameter of `model` is a DTensor (FSDP2, tensor parallelism): ranks hold different weights."""
    return model is not None and any(hasattr(p, "device_mesh") for p in model.parameters())


@dataclass
class StepResult:
    """The decision of one iteration, shared by every optimizer of it (`rolled_back` may be set when it closes)."""

    stepped: bool
    skipped_reason: Optional[str] = None
    rolled_back: bool = False
    rollback_reason: Optional[str] = None
    overflow_layers: List[str] = field(default_factory=list)
    iteration: int = 0

    @property
    def applied(self) -> bool:
        """The iteration's updates are in the weights (stepped and not undone by a rollback)."""
        return self.stepped and not self.rolled_back


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
        self.step_closer = ScalingStepCloser({})
        self.optimizers: List[torch.optim.Optimizer] = []
        self.lr_schedulers: List[Any] = []
        #: the framework handed over every LR scheduler it holds (`track`): no warning at a rollback without one
        self.lr_schedulers_complete = False
        # counters (public through the adapters); all count iterations
        self.skipped_steps = 0
        self.rollbacks = 0
        self.step_count = 0
        self.consecutive_skips = 0
        #: (fqn.role) -> number of iterations in which that tensor's amax overflowed; names layers in errors
        self.overflow_events: Counter = Counter()
        #: chronological record of skips and rollbacks for loggers and the report
        self.events: List[Dict[str, Any]] = []
        self.last_result: Optional[StepResult] = None
        self._budget = RollbackBudget(self.config)
        self._snapshots = SnapshotKeeper(enabled=self.config.max_rollbacks > 0)
        self._loss = LossRecord(self.config)
        self._grads = GradientUnscaler(self.scaler)
        #: device flags of this iteration's gradient norms (clipping): a non-finite norm skips the step
        self._norm_flags: List[torch.Tensor] = []
        #: device flag of the weights the last applied step wrote, read with the next decision's flags
        self._weights_flag: Optional[torch.Tensor] = None
        self._decision: Optional[StepResult] = None  # the open iteration's, once its first optimizer stepped
        self._overflow = False  # the open iteration's overflow flag for the loss scaler
        self._stepped: List[int] = []  # ids of the optimizers the open iteration has stepped (or skipped)
        self._joinable: Optional[StepResult] = None  # the iteration closed last, for optimizers that step late
        self._joined: set = set()
        self._warned_no_scheduler = False

    # -- setup --------------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Adopt a converted model: the engine now syncs and updates its FP8 scales once per iteration.

        One model per engine: attaching another (a second `fabric.setup`) hands the earlier model's FP8 layers back
        their own lazy scale close, so their scales keep updating, and says loudly that skip / rollback now cover
        the last model only (otherwise the earlier layers' scales would silently never change again)."""
        previous = self.layers if self.model is not None and self.model is not model else {}
        self.model = model
        localize_fp8_state(model)  # tensor parallelism: torch's styles made the FP8 metadata replicated DTensors
        self.layers = fp8_layers(model)
        kept = set(map(id, self.layers.values()))
        released = [layer for layer in previous.values() if id(layer) not in kept]
        for layer in released:
            layer.closes_own_steps = True
        if released:
            warnings.warn(
                f"lightning_fp8: another model was set up with this FP8 plugin; its engine (once-per-iteration "
                f"scale updates, skip on overflow, rollback) now covers only that model ({len(self.layers)} FP8 "
                f"layers). The earlier model's {len(released)} FP8 layers update their own scales after each "
                f"backward, without skip or rollback protection. Wrap the models in one nn.Module and set that up "
                f"once to protect them all.",
                UserWarning,
                stacklevel=3,
            )
        sharded = is_fsdp_sharded(model)
        for layer in self.layers.values():
            layer.closes_own_steps = False
            # FSDP2 frees a gathered weight after its forward: keeping W^T for backward would hold a whole unsharded
            # weight per layer (1 byte per parameter); the backward casts it from the re-gathered weight instead
            layer.keep_weight_transpose = not sharded
        self.step_closer = ScalingStepCloser(self.layers)
        # a loss-scale change scales every gradient amax by the same factor: delayed gradient scales follow it
        self.scaler.on_change = self.step_closer.rescale_gradient_history
        self._snapshots.drop()  # another model: the next decision takes a fresh snapshot

    def track(self, optimizers: Sequence[torch.optim.Optimizer], lr_schedulers: Sequence[Any] = ()) -> None:
        """The framework's complete set of optimizers and LR schedulers for a training run (Lightning's `connect`):
        a fresh run, so the pending iteration and the snapshot of an earlier one are dropped (the last step's weights
        checked first: the next decision's snapshot must not take non-finite ones)."""
        self.settle()
        self._reset_iteration()
        self.optimizers = []
        self.lr_schedulers = []
        self._snapshots.drop()
        for opt in optimizers:
            self.register_optimizer(opt)
        for scheduler in lr_schedulers:
            self.register_lr_scheduler(scheduler)
        self.lr_schedulers_complete = True

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Step, skip and roll back `optimizer` with the others. One the engine meets late (Fabric: at its first step)
        has not stepped before, so its state now is its state at the current snapshot's step: it joins the snapshot."""
        if any(opt is optimizer for opt in self.optimizers):
            return
        self.optimizers.append(optimizer)
        self._snapshots.optimizer_joined(optimizer)

    def register_lr_scheduler(self, scheduler: Any) -> None:
        """Restore `scheduler` with the optimizers on a rollback. Register before training: the current snapshot takes
        its state as it is now."""
        if any(s is scheduler for s in self.lr_schedulers):
            return
        self.lr_schedulers.append(scheduler)
        self._snapshots.scheduler_joined(scheduler)

    def replace_optimizer(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        self.settle()  # the snapshot is dropped: the next one must not take weights the last step made non-finite
        self.optimizers = [new if opt is old else opt for opt in self.optimizers]
        self._snapshots.drop()

    # -- iteration boundaries -------------------------------------------------------------------------------------
    def begin_iteration(self) -> bool:
        """Before a training forward: close the previous iteration (True if one was open), end its window for late
        optimizers, and complete the last snapshot with the LR schedules the framework has stepped since."""
        closed = self.end_iteration()
        self._joinable = None
        self._snapshots.complete(self, self.step_count)
        return closed

    def end_iteration(self) -> bool:
        """Close the open iteration if it has decided (True if one was closed): the framework's end of an iteration,
        or before a checkpoint is taken."""
        if self._decision is None:
            return False
        self._close()
        return True

    # -- per iteration ------------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def snapshot_step(self) -> Optional[int]:
        """The iteration a rollback would return to now (None before the first decision, or with max_rollbacks=0)."""
        return self._snapshots.step

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Record the loss and scale it for backward. A backward after a decision starts a new iteration."""
        self.begin_iteration()
        self._grads.before_backward()
        self._loss.record(loss)
        return self.scaler.scale_loss(loss)

    def unscale_(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[torch.Tensor]:
        """Unscale the iteration's gradients in place (each once); returns the device flag (1.0 if a gradient
        unscaled since the last backward is inf / NaN; None if none was), which the decision reads."""
        if optimizer is not None:
            self.register_optimizer(optimizer)
        return self._grads.unscale(iteration_params(self.model, self.optimizers))

    def clip_grad_norm_(
        self, optimizer: torch.optim.Optimizer, max_norm: float, parameters: Optional[Sequence[torch.Tensor]] = None
    ) -> torch.Tensor:
        """Clip the unscaled gradients of `optimizer` (or of `parameters`, a subset of its parameters) to a global
        L2 norm of max_norm, the norm computed in float32; a non-finite norm marks the iteration to be skipped (a
        device flag the decision reads: nothing is read here)."""
        self.unscale_(optimizer)
        grads = [p.grad for p in (optimizer_params(optimizer) if parameters is None else parameters) if p.grad is not None]
        norm = clipping.clip_grad_norm_(grads, max_norm)
        self._norm_flags.append((~torch.isfinite(norm.to_local() if hasattr(norm, "to_local") else norm)).float())
        return norm

    def clip_grad_value_(
        self, optimizer: torch.optim.Optimizer, clip_value: float, parameters: Optional[Sequence[torch.Tensor]] = None
    ) -> None:
        self.unscale_(optimizer)
        grads = [p.grad for p in (optimizer_params(optimizer) if parameters is None else parameters) if p.grad is not None]
        clipping.clip_grad_value_(grads, clip_value)

    def step(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any]) -> StepResult:
        """Apply or skip `optimizer`'s step under the iteration's decision (made here by its first optimizer)."""
        self.register_optimizer(optimizer)
        key = id(optimizer)
        if self._decision is not None and key in self._stepped:
            self._close()  # the same optimizer again, with no backward in between: a new iteration
        if self._decision is None:
            if self._joinable is not None and key not in self._joined:
                return self._join_late(optimizer, step_fn)
            self._joinable = None
            self._decide()
        result = self._decision
        self._stepped.append(key)
        if result.applied:
            self._apply(step_fn)
        if all(id(opt) in self._stepped for opt in self.optimizers):
            self._close()
        return result

    def skip_step(self) -> None:
        """An optimizer step whose backward never ran (Lightning: the training step returned None): nothing to
        decide; the losses recorded since the last iteration are dropped with the gradients Lightning drops."""
        self._loss.clear()

    # -- the decision -------------------------------------------------------------------------------------------
    def _decide(self) -> None:
        iteration = self.step_count + 1
        self._snapshots.ensure(self, self.step_count)  # the state before the first step is a valid rollback target
        flags = self._decision_flags()
        values = flags.read()  # the iteration's one device-to-host read; every rank reads the same flags
        grads_bad, loss_bad, spike, weights_bad = (values[name][0] > 0 for name in ("gradients", "loss", "spike", "weights"))
        overflow_layers = [key for key, flag in zip(self.step_closer.keys, values["overflows"]) if flag]
        self.step_closer.learn_sizes(values["sized"])  # the next forward's delayed casts skip their amax pre-pass
        if weights_bad:  # a forward on non-finite weights overflows everywhere: no layer to blame for it
            overflow_layers = []
        self.overflow_events.update(overflow_layers)
        loss_value = values["loss value"][0] if "loss value" in values else None

        skip_reason = None
        if weights_bad:
            skip_reason = "non-finite weights"
        elif loss_bad:
            skip_reason = "non-finite loss"
        elif grads_bad:
            skip_reason = "non-finite gradients"
        elif overflow_layers:
            skip_reason = "FP8 amax overflow in " + ", ".join(overflow_layers)
        elif spike:
            skip_reason = "loss spike"
        result = StepResult(skip_reason is None, skip_reason, overflow_layers=overflow_layers, iteration=iteration)
        self._decision, self._stepped, self.last_result = result, [], result
        self._overflow = grads_bad or bool(overflow_layers) or loss_bad
        if result.stepped:
            self.consecutive_skips = 0
            self._loss.hold(loss_value)
            return
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self._event("skip", skip_reason, overflow_layers, iteration)
        log.info("lightning_fp8: step %d skipped (%s)", iteration, skip_reason)
        if weights_bad:
            self._rollback("non-finite weights (written by the previous step)", result)
        elif loss_bad:
            self._rollback("non-finite loss", result)
        elif spike:
            self._rollback(f"loss spike above {self.config.spike_factor}x its running mean", result)
        elif self.consecutive_skips >= self.config.max_consecutive_skips:
            self._rollback(f"{self.consecutive_skips} consecutive skipped steps", result)

    def _decision_flags(self) -> IterationFlags:
        """Everything the decision checks, as device flags (nothing read yet): non-finite gradients or gradient
        norm, non-finite loss, loss spike, the weights the previous step wrote, every FP8 role's overflow. Every rank
        adds the same entries in the same order (zeros for what it lacks): the flags are MAX-reduced as one vector."""
        flags = IterationFlags()
        grads = [f for f in [self.unscale_()] + self._norm_flags if f is not None]
        flags.agree("gradients", torch.stack([f.reshape(()).to(grads[0].device) for f in grads]).amax() if grads else None)
        loss = self._loss.device_value()
        threshold = self._loss.spike_threshold()
        finite = torch.isfinite(loss) if loss is not None else None
        flags.agree("loss", (~finite).float() if loss is not None else None)
        flags.agree("spike", (finite & (loss > threshold)).float() if loss is not None and threshold is not None else None)
        flags.agree("weights", self._weights_flag)
        flags.agree("overflows", self.step_closer.overflow_flags(), numel=len(self.step_closer.keys))
        flags.agree("sized", self.step_closer.sized_flags(), numel=len(self.step_closer.keys))
        flags.local("loss value", loss)
        self._weights_flag, self._norm_flags = None, []
        return flags

    def _apply(self, step_fn: Callable[[], Any]) -> None:
        self._snapshots.fence()  # the step updates in place what a snapshot copy may still be reading
        step_fn()

    def _join_late(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any]) -> StepResult:
        result = self._joinable
        self._joined.add(id(optimizer))
        if result.applied:
            self._apply(step_fn)
            self._snapshots.stepped_late(self.step_count)
        return result

    # -- closing an iteration -----------------------------------------------------------------------------------
    def _close(self) -> None:
        result, self._decision = self._decision, None
        self.step_count += 1
        if not result.rolled_back:  # a rollback set the loss scale already
            self.scaler.update(overflow=self._overflow)
        self.step_closer.close_step(taken=result.applied)
        if result.applied:
            if self.step_count % self.config.snapshot_every == 0:
                # a snapshot replaces the last good state: its weights are checked first, here (the one read of a
                # close, every snapshot_every iterations)
                if not weights_finite(self.model):
                    self._rollback("non-finite weights", result)
                else:
                    self._loss.accept()
                    self._snapshots.take(self, self.step_count, complete=False)  # copies overlap the next iteration
            else:
                self._loss.accept()
                if self._weights_due():  # read with the next decision's flags, which rolls back before another step
                    self._weights_flag = weights_nonfinite(self.model)
        self._joinable, self._joined = result, set(self._stepped)
        self._stepped = []
        self._loss.clear()
        self._norm_flags = []
        if self.model is not None:  # FSDP2 FP8 all-gather: every layer's weight amax in one collective, after the step
            precompute_fp8_weight_amaxes(self.model, always=True)

    def _reset_iteration(self) -> None:
        self._decision, self._stepped, self._joinable, self._joined = None, [], None, set()
        self._loss.clear()
        self._norm_flags, self._weights_flag = [], None
        self._grads.forget()

    # -- scales -------------------------------------------------------------------------------------------------
    def close_scaling_step(self) -> None:
        """Close a scaling step outside an iteration (calibration does, once per calibration batch)."""
        self.step_closer.close_step(taken=True)

    def update_scales(self) -> None:
        """Deprecated name of `close_scaling_step` (removed in 0.3)."""
        warn_renamed("FP8TrainingEngine.update_scales()", "FP8TrainingEngine.close_scaling_step()")
        self.close_scaling_step()

    # -- checks -------------------------------------------------------------------------------------------------
    def _weights_due(self) -> bool:
        return self.step_count % self.config.check_weights_every == 0

    def weights_finite(self) -> bool:
        return weights_finite(self.model)

    def settle(self) -> None:
        """Check now the weights the last step wrote, which otherwise the next decision checks (one read, only when
        such a check is pending), and roll back if they are not finite: before a checkpoint, an evaluation, the end
        of a run, or dropping the snapshot. Sharded weights (FSDP2, tensor parallelism: DTensors) are checked on
        every rank, one collective, so every rank must call it, as it must for their checkpoints; replicated
        weights (one device, DDP) are checked locally, no collective: every rank's weights are the same, and a
        checkpoint saved by the main process alone (Accelerate's save_state under DDP) cannot hang here."""
        self.end_iteration()
        flag, self._weights_flag = self._weights_flag, None
        if flag is None:
            return
        if not weights_finite(self.model, flag, agree=_has_sharded_parameters(self.model)):
            result = self.last_result or StepResult(True, iteration=self.step_count)
            self._rollback("non-finite weights", result)  # that iteration's result now says rolled back

    # -- rollback -----------------------------------------------------------------------------------------------
    def snapshot_extra(self) -> Dict[str, Any]:
        """The engine's own state a snapshot holds."""
        return {"scaler": self.scaler.state_dict()}

    def _rollback(self, reason: str, result: StepResult) -> None:
        iteration = result.iteration
        if not self._budget.admit(iteration):
            raise FP8DivergenceError(rollback.divergence_message(self.config, reason, iteration, self.overflow_events))
        self.rollbacks += 1
        result.rolled_back, result.rollback_reason = True, reason
        restored_to, missing, extra = self._snapshots.restore(self, self.step_count)
        if restored_to is not None:
            self.scaler.load_state_dict(extra["scaler"])
            if missing:
                warnings.warn(f"lightning_fp8: the rollback snapshot holds no state for {missing}: left as they are")
            self._warn_if_no_scheduler()
        self.scaler.backoff()
        self.step_closer.discard_open_step()  # the restored state is between iterations
        self.step_closer.forget_sizes()  # the restored histories are not the ones the decision read
        self._weights_flag = None  # the restored weights were checked before their snapshot
        self.consecutive_skips = 0
        self._event("rollback", reason, [], iteration, restored_to_step=restored_to)
        log.warning(
            "lightning_fp8: rolled back at step %d to the snapshot of step %s (%s); loss scale now %g",
            iteration, restored_to, reason, self.scaler.scale,
        )

    def _warn_if_no_scheduler(self) -> None:
        if not (self.lr_schedulers or self.lr_schedulers_complete or self._warned_no_scheduler):
            self._warned_no_scheduler = True
            warnings.warn(rollback.NO_SCHEDULER_WARNING, UserWarning)

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def _event(self, kind: str, reason: Optional[str], layers: Sequence[str], step: int, **extra: Any) -> None:
        self.events.append({"step": step, "kind": kind, "reason": reason, "layers": list(layers), **extra})

    def metrics(self) -> Dict[str, float]:
        return {
            "fp8/skipped_steps": float(self.skipped_steps),
            "fp8/rollbacks": float(self.rollbacks),
            "fp8/loss_scale": float(self.scaler.scale),
        }

    def state_dict(self) -> Dict[str, Any]:
        """The engine's state between iterations (callers close the open iteration first: `end_iteration`)."""
        return {
            FORMAT_VERSION_KEY: ENGINE_STATE_VERSION,
            "recipe": self.recipe.to_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "step_count": self.step_count,
            "consecutive_skips": self.consecutive_skips,
            "overflow_events": dict(self.overflow_events),
            "rollback_steps": list(self._budget.steps),
            "loss_window": list(self._loss.window),
            "events": list(self.events),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        format_version(state, "FP8 engine state", ENGINE_STATE_VERSION)
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state["skipped_steps"])
        self.rollbacks = int(state["rollbacks"])
        self.step_count = int(state["step_count"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.overflow_events = Counter(state.get("overflow_events", {}))
        self._budget.load(state.get("rollback_steps", []))
        self._loss.load(state.get("loss_window", []))
        self.events = list(state.get("events", []))
        self._reset_iteration()
        self.step_closer.forget_sizes()
        self._snapshots.drop()  # a fresh snapshot is taken at the next decision

