"""When rollback snapshots are taken within an iteration, and how many rollbacks a run may make.

`SnapshotKeeper` owns the engine's one `Snapshot` (snapshot.py: what it holds and how it copies) and its timing:

- the first decision of a run takes the state before any step (a valid rollback target, with every optimizer and
  LR scheduler the framework handed over);
- every `snapshot_every` iterations the close of an iteration snapshots the model and the optimizers, right after it
  checked the weights (so state corrupted *between* iterations never enters a snapshot), and the copies overlap the
  next iteration's forward and backward;
- the LR schedulers and the optimizers' hyperparameters (learning rates) join that snapshot at the start of the
  next iteration (`complete`): frameworks step schedulers after the optimizers, so an iteration's schedule is final
  only then;
- after a rollback, the schedule is written back once more at the start of the next iteration: frameworks step
  their schedulers after the rejected iteration too (Lightning after every batch, a Fabric loop after its step), and
  the run must continue from the snapshot's schedule, not one step past it;
- an optimizer the engine meets late (Fabric: at its first step) joins the snapshot with its state before that
  step, which is its state at the snapshot's iteration since it never stepped before. When it steps after the close
  that took a snapshot, that snapshot is taken again at the start of the next iteration (after checking the weights
  its step changed), so a snapshot never holds one optimizer's update of an iteration without the others'.

`RollbackBudget` counts rollbacks within `rollback_window` iterations; one more than `max_rollbacks` is
FP8DivergenceError. `max_rollbacks=0` therefore means no rollback can ever happen, and no snapshot is taken.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Any, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.snapshot import Snapshot


class FP8DivergenceError(RuntimeError):
    """Training kept diverging after the allowed number of rollbacks."""


class TrainingState(Protocol):
    """What the keeper snapshots (the engine)."""

    model: Optional[nn.Module]
    optimizers: List[torch.optim.Optimizer]
    lr_schedulers: List[Any]

    def snapshot_extra(self) -> Dict[str, Any]: ...

    def weights_finite(self) -> bool: ...


class SnapshotKeeper:
    """The engine's rollback target and when it is (re)taken (see the module docstring)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.snapshot: Optional[Snapshot] = None
        self._schedules_due = False  # the LR schedules join at the start of the next iteration
        self._stale = False  # an optimizer stepped after the close that took the snapshot
        self._reapply_schedules = False  # a rollback happened: the schedule goes back again at the next start

    @property
    def step(self) -> Optional[int]:
        return self.snapshot.step if self.snapshot is not None else None

    def drop(self) -> None:
        """Forget the snapshot (a new run, another model, a loaded checkpoint): the next decision takes a fresh one."""
        self.snapshot, self._schedules_due, self._stale, self._reapply_schedules = None, False, False, False

    def take(self, state: TrainingState, step: int, complete: bool) -> None:
        if not self.enabled or state.model is None:
            return
        if self.snapshot is None:
            self.snapshot = Snapshot()
        self.snapshot.capture(step, state.model, state.optimizers, state.lr_schedulers, state.snapshot_extra())
        self._schedules_due, self._stale = not complete, False

    def ensure(self, state: TrainingState, step: int) -> None:
        """At a decision: the run's first snapshot, before any step, if there is none yet."""
        self.complete(state, step)
        if self.snapshot is None:
            self.take(state, step, complete=True)

    def complete(self, state: TrainingState, step: int) -> None:
        """At the start of an iteration: add the schedules the framework stepped after the last close, or take the
        snapshot again if an optimizer stepped after it; after a rollback, write the snapshot's schedule back again
        (the framework stepped its schedulers for the rejected iteration)."""
        if self._reapply_schedules:
            self._reapply_schedules = False
            self.snapshot.restore_schedules(state.optimizers, state.lr_schedulers)
        if self._stale:
            self._stale = False
            if state.weights_finite():  # the late step's weights were never checked
                self.take(state, step, complete=True)
        elif self._schedules_due:
            self._schedules_due = False
            self.snapshot.capture_schedules(state.optimizers, state.lr_schedulers)

    def optimizer_joined(self, optimizer: torch.optim.Optimizer) -> None:
        if self.snapshot is not None:
            self.snapshot.add_optimizer(optimizer)

    def scheduler_joined(self, scheduler: Any) -> None:
        if self.snapshot is not None:
            self.snapshot.add_scheduler(scheduler)

    def stepped_late(self, closed_step: int) -> None:
        """An optimizer applied the update of iteration `closed_step` after that iteration closed."""
        if self.snapshot is not None and self.snapshot.step == closed_step:
            self._stale = True

    def fence(self) -> None:
        """Before an in-place update of the snapshotted tensors (see Snapshot.fence)."""
        if self.snapshot is not None:
            self.snapshot.fence()

    def restore(self, state: TrainingState, step: int) -> Tuple[Optional[int], List[Any], Dict[str, Any]]:
        """(the snapshot's iteration, what it holds no state for, its extra state); (None, [], {}) without one."""
        if self.snapshot is None:
            return None, [], {}
        self.complete(state, step)  # (normally done: a decision or close always follows the start of an iteration)
        missing = self.snapshot.restore(state.model, state.optimizers, state.lr_schedulers)
        self._reapply_schedules = True
        return self.snapshot.step, missing, self.snapshot.extra


NO_SCHEDULER_WARNING = (
    "lightning_fp8: rolled back the model and the optimizers, but no LR scheduler is registered: if you step one, it "
    "did not roll back and its learning rate is now ahead of the restored state. Register it (Fabric: "
    "`plugin.register_lr_scheduler(scheduler)`; Accelerate: prepare it with the optimizers)."
)


def divergence_message(config: StabilityConfig, reason: str, iteration: int, overflow_events: Counter) -> str:
    layers = ", ".join(f"{name} ({n} steps)" for name, n in overflow_events.most_common(10))
    return (
        f"lightning_fp8: training diverged: {config.max_rollbacks} rollbacks within {config.rollback_window} steps "
        f"(latest at step {iteration}: {reason}). Layers whose FP8 amax overflowed: {layers or 'none recorded'}. "
        "Consider keeping these layers in BF16 (FP8Recipe(skip_patterns=...) or FP8LayerFallback), a larger "
        "FP8Recipe(margin=...), current scaling, or a lower learning rate."
    )


class RollbackBudget:
    """At most `max_rollbacks` rollbacks within any `rollback_window` iterations."""

    def __init__(self, config: StabilityConfig) -> None:
        self.config = config
        self.steps: Deque[int] = deque()

    def admit(self, iteration: int) -> bool:
        """Record a rollback at `iteration`; False (nothing recorded) when the budget is spent."""
        window_start = iteration - self.config.rollback_window
        while self.steps and self.steps[0] <= window_start:
            self.steps.popleft()
        if len(self.steps) >= self.config.max_rollbacks:
            return False
        self.steps.append(iteration)
        return True

    def load(self, steps: Sequence[int]) -> None:
        self.steps = deque(steps)
