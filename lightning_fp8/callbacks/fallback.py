"""FP8LayerFallback: move a layer that cannot live in FP8 to a finer scaling, then to BF16, by itself, and say why.

Escalation (callbacks/fallback_escalation.py): when the overflow or precision rule fires for a layer, the layer first
moves to the next recipe of its GPU's ladder (escalate_to="auto", the default: nvfp4 -> mxfp8 on sm100, per-tensor ->
blockwise on sm90, per-tensor -> rowwise on sm89, per-tensor -> blockwise without FP8 tensor cores; `layer.recipe`
changes), with its reason logged and an "escalate" event; only when a rule fires again for a layer at the top of the
ladder (it did not help), or the non-finite rule fires, does the layer move to BF16. `escalate_to="blockwise"` (or
"rowwise", "mxfp8") fixes the one step; `escalate_to=None` moves straight to BF16.

Where a layer falls back to BF16: here, in `FP8LayerFallback._fall_back` (the only place that switches
`layer.fp8_enabled` off at run time).

Rules, each checked per FP8 layer and tensor role (input, weight, grad_output):

overflow   the step's amax exceeded the range the cast's scale allows by more than `overflow_factor`
           (amax * scale > overflow_factor * fp8_max: values clipped by more than that factor). Checked every
           optimizer step from the layers' own scaling state, before the engine updates the scales (one small
           device-to-host copy per step). A cast that clips a hair (a weight growing slightly under delayed scaling
           does that on most steps early in training) is normal and does not count. A layer falls back when it was
           the *origin* of an overflow in `overflow_patience` of the last `overflow_window` steps.
precision  the quantization SQNR of a role is below `min_sqnr_db`, or more than `max_underflow` of its non-zero values
           are flushed to zero (on by default: a layer that silently zeroes most of an operand is the failure users
           cannot see; None turns it off), in `stats_patience` consecutive statistics checks
           (every `check_every_n_steps` steps, and on FP8ScaleMonitor's logging steps; statistics come from
           `lightning_fp8.numerics.stats` through the shared sampler).
non-finite a non-finite value originates in the layer: after the engine reports a non-finite amax, the next steps
           run with cheap forward hooks that find FP8 layers whose input and weight are finite but whose output is
           not; `nonfinite_patience` such steps move the layer. (A non-finite value that starts outside every FP8
           layer, e.g. in the data, moves nothing: the engine's skip / rollback handles it.)

Where an anomaly originates (lightning_fp8/callbacks/fallback_rules.py): one bad layer makes the layers after it overflow
in the same step, so every anomaly is attributed to the layer where it starts, and only steps where a layer is the
origin count against it.

Every switch is logged (python logging, a `fp8/<fqn>/fp8_enabled` logger metric and `fp8/fallback_layers`, an
event in the history file) and kept in checkpoints (this callback's state; the layer's `fp8_meta.enabled` buffer
travels with the precision plugin's state), so a resumed run has the same precision map with the same reasons.
`fp8/fallback_layers` is also in `trainer.callback_metrics` from the first step on (EarlyStopping / ModelCheckpoint
can watch it). Every step in which a tensor went beyond `overflow_factor` is an "overflow" event in the history file
(step, layer, role, ratio), whether or not it moves a layer, so the report shows faults between the monitor's samples.
`retry_after_steps` optionally tries a fallen-back layer in FP8 again later (with fresh scaling state).
`keep_in_bf16` keeps layers matching glob patterns in BF16 from the start.

Under DDP the per-rank observations are combined with one MAX all-reduce per step, so every rank makes the same
decision.
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Any, Dict, List, Optional, Sequence, Set

import torch
from lightning.pytorch.callbacks import Callback

from lightning_fp8.callbacks.fallback_escalation import check_escalate_to, escalated_recipe, escalation_target
from lightning_fp8.callbacks.fallback_rules import FallbackRules, Key, NonFiniteOriginProbe
from lightning_fp8.callbacks.hub import (
    StatsConsumer,
    fp8_engine,
    hub_for,
    layer_counters,
    precision_rows,
    publish_metrics,
    warn_if_nothing_in_fp8,
    watched_metrics,
)
from lightning_fp8.callbacks.sampling import StatsRecord
from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.engine.distributed import all_reduce_max_
from lightning_fp8.kernels.device import profile_of
from lightning_fp8.modules.linear import FP8Linear
from lightning_fp8.numerics.stats import DEFAULT_SAMPLE_SIZE
from lightning_fp8.recipe import ROLES

log = logging.getLogger("lightning_fp8")


def reset_scaling_state(layer: FP8Linear) -> None:
    """Forget a layer's amax histories so its next FP8 step starts with current scaling (used when retrying a
    layer in FP8 after a fallback: its old scales may be stale)."""
    layer.reset_fp8_state()


class FP8LayerFallback(StatsConsumer, Callback):
    """Move layers that cannot live in FP8 to a finer scaling, then to BF16 (see the module docstring for the rules).

    Args:
        keep_in_bf16: glob patterns of layer names (fully qualified, e.g. "blocks.*.attn.*") kept in BF16 from the
            start.
        overflow_factor: an amax more than this factor beyond the cast's range counts as an overflow.
        overflow_patience / overflow_window: overflows (as origin) in that many of the last `overflow_window`
            steps move the layer.
        min_sqnr_db: quantization SQNR (dB) below which a statistics check is bad (None: off); the default is far
            below the SQNR of FP8 casts of well-scaled tensors.
        max_underflow: fraction of non-zero values flushed to zero above which a check is bad (None: off).
        escalate_to: "auto" (the next recipe of the ladder of the layer's GPU, see the module docstring), or the one
            finer scaling ("rowwise", "blockwise", "mxfp8") a layer moves to before BF16 when the overflow or
            precision rule fires (None: straight to BF16).
        stats_patience: consecutive bad statistics checks that move the layer.
        check_every_n_steps: optimizer steps between statistics checks (they also run on FP8ScaleMonitor's logging
            steps). None: only on the monitor's steps.
        nonfinite_patience: steps in which a non-finite value originated in the layer that move it.
        retry_after_steps: steps after which a layer moved by a rule is tried in FP8 again (None: never).
        max_retries: retries per layer; after that the layer stays in BF16.
        sample_size: elements per tensor for the sampled statistics.
    """

    def __init__(
        self,
        keep_in_bf16: Sequence[str] = (),
        overflow_factor: float = 8.0,
        overflow_patience: int = 3,
        overflow_window: int = 20,
        min_sqnr_db: Optional[float] = 10.0,
        max_underflow: Optional[float] = 0.5,
        stats_patience: int = 3,
        check_every_n_steps: Optional[int] = 10,
        nonfinite_patience: int = 2,
        retry_after_steps: Optional[int] = None,
        max_retries: int = 2,
        sample_size: int = DEFAULT_SAMPLE_SIZE,
        escalate_to: Optional[str] = "auto",
    ) -> None:
        if isinstance(keep_in_bf16, str):
            keep_in_bf16 = (keep_in_bf16,)
        # the rule thresholds are validated where they are used
        self._rules = FallbackRules(
            overflow_factor, overflow_patience, overflow_window, min_sqnr_db, max_underflow, stats_patience,
            nonfinite_patience,
        )
        if not isinstance(sample_size, int) or sample_size < 1:
            raise ValueError(f"sample_size must be an int >= 1, got {sample_size!r}")
        for name, value in (("check_every_n_steps", check_every_n_steps), ("retry_after_steps", retry_after_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self.keep_in_bf16 = tuple(keep_in_bf16)
        self.overflow_factor = float(overflow_factor)
        self.overflow_patience = overflow_patience
        self.overflow_window = overflow_window
        self.min_sqnr_db = min_sqnr_db
        self.max_underflow = max_underflow
        self.stats_patience = stats_patience
        self.check_every_n_steps = check_every_n_steps
        self.nonfinite_patience = nonfinite_patience
        self.retry_after_steps = retry_after_steps
        self.max_retries = max_retries
        self.sample_size = sample_size
        self.escalate_to = check_escalate_to(escalate_to)
        #: fqn -> {"from", "to", "reason", "rule", "roles", "step"}: the layers this callback moved to a finer
        #: scaling, with why. Survives checkpoints.
        self.escalations: Dict[str, Dict[str, Any]] = {}
        #: fqn -> {"reason", "rule", "roles", "step", "manual", "retries", "retry_at"}: the layers this callback
        #: keeps in BF16, with why. Survives checkpoints.
        self.fallbacks: Dict[str, Dict[str, Any]] = {}
        #: chronological switches (escalate / fallback / retry / keep_bf16) made by this callback
        self.events: List[Dict[str, Any]] = []
        self._retries: Dict[str, int] = {}
        self._step_start: Optional[int] = None
        self._ratios: Optional[torch.Tensor] = None
        self._ratio_keys: List[Key] = []
        self._diagnose_next = False
        self._probe = NonFiniteOriginProbe()
        self._rollbacks_seen = 0
        self._last_result = None
        self._counters: Optional[Dict] = None
        self._manual_logged: Set[str] = set()
        self._published: Optional[tuple] = None  # (epoch, fallback count) last put into callback_metrics

    # -- statistics cadence ------------------------------------------------------------------------------------
    def wants_stats(self, step: int) -> bool:
        if self.min_sqnr_db is None and self.max_underflow is None:
            return False
        n = self.check_every_n_steps
        return n is not None and (step + 1) % n == 0

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            hub_for(trainer).setup_history(trainer)

    def on_fit_start(self, trainer, pl_module) -> None:
        warn_if_nothing_in_fp8(trainer, pl_module, type(self).__name__)
        self._apply(trainer, pl_module, announce=False)

    def on_train_start(self, trainer, pl_module) -> None:
        hub_for(trainer).reset_layers()
        # again: the precision plugin restores `fp8_meta.enabled` from a checkpoint after on_fit_start
        self._apply(trainer, pl_module, announce=True)
        engine = fp8_engine(trainer)
        self._rollbacks_seen = engine.rollbacks if engine is not None else 0
        self._last_result = engine.last_result if engine is not None else None
        self._counters = None
        self._published = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        hub = hub_for(trainer)
        hub.begin_batch(trainer, pl_module)
        if self._step_start is None:
            self._step_start = trainer.global_step
            if self._diagnose_next:
                self._probe.install(fp8_layers(pl_module))
        if self._counters is None and fp8_engine(trainer) is None:
            self._counters = layer_counters(fp8_layers(pl_module))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """After forward and backward, before the engine updates the scales: how far each amax went beyond the
        range of the scale its cast used (on device; read once at the end of the batch)."""
        ratios, keys = [], []
        with torch.no_grad():
            for fqn, layer in hub_for(trainer).layers(pl_module).items():
                if not layer.fp8_enabled:
                    continue
                recipe = layer.recipe
                for role, state in layer.fp8_meta.states().items():
                    if recipe.scaling != "delayed" or not recipe.uses_scaling_for(role):
                        continue  # current scaling never clips; unscaled casts are the loss scaler's business
                    fmt = recipe.format_for(role)
                    ratio = state.amax_history[0] * state.scale / fmt.max
                    # a non-finite amax is not a clip: the engine skips that step and the non-finite rule finds
                    # the layer where the value starts (downstream layers only see it)
                    counts = state.initialized & torch.isfinite(ratio)
                    ratio = torch.where(counts, ratio, torch.zeros_like(ratio)).reshape(())
                    ratios.append(ratio.to(ratios[0].device) if ratios else ratio)
                    keys.append((fqn, role))
        self._ratios = torch.stack(ratios) if ratios else None  # stays on device until the end of the batch
        self._ratio_keys = keys

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = hub_for(trainer).end_batch(trainer)
        if self._step_start is None or trainer.global_step <= self._step_start:
            return  # gradient accumulation: the optimizer step has not happened yet
        self._step_start = None
        self._evaluate(trainer, pl_module, record)

    def on_train_end(self, trainer, pl_module) -> None:
        self._probe.remove()
        hub_for(trainer).abort()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._probe.remove()
        hub_for(trainer).abort()

    # -- manual list and restored state ------------------------------------------------------------------------
    def _apply(self, trainer, pl_module, announce: bool) -> None:
        layers = fp8_layers(pl_module)
        for fqn, layer in layers.items():
            for pattern in self.keep_in_bf16:
                if fnmatch.fnmatchcase(fqn, pattern) and fqn not in self.fallbacks:
                    self.fallbacks[fqn] = {
                        "reason": f"kept in BF16 by FP8LayerFallback(keep_in_bf16=[{pattern!r}])",
                        "rule": "manual",
                        "roles": [],
                        "step": trainer.global_step,
                        "manual": True,
                        "retry_at": None,
                    }
                    break
        for fqn, info in self.escalations.items():
            if fqn in layers:
                self._set_scaling(layers[fqn], info)
        for fqn, info in self.fallbacks.items():
            layer = layers.get(fqn)
            if layer is None:
                log.warning("lightning_fp8: FP8LayerFallback has a decision for %s, which is not an FP8 layer of this model", fqn)
                continue
            self._disable(layer, info["reason"])
            if announce and info.get("manual") and fqn not in self._manual_logged:
                self._manual_logged.add(fqn)
                log.info("lightning_fp8: %s kept in BF16 (%s)", fqn, info["reason"])
                self._record_event(trainer, pl_module, "keep_bf16", [fqn], info["reason"], log_metric=False)

    @staticmethod
    def _set_scaling(layer: FP8Linear, info: Dict[str, Any]) -> None:
        if layer.recipe.scaling != info["to"]:
            layer.recipe = escalated_recipe(layer.recipe, info["to"])
        layer.fp8_escalation_reason = f"escalated from {info['from']} to {info['to']} scaling at step {info['step']}: {info['reason']}"

    @staticmethod
    def _disable(layer: FP8Linear, reason: str) -> None:
        layer.fp8_enabled = False
        layer.fp8_disabled_reason = reason

    # -- the per-step decision ---------------------------------------------------------------------------------
    def _evaluate(self, trainer, pl_module, record: Optional[StatsRecord]) -> None:
        step = trainer.global_step
        layers = hub_for(trainer).layers(pl_module)
        engine = fp8_engine(trainer)
        hub = hub_for(trainer)
        order = hub.order_index(pl_module)
        keys = [(fqn, role) for fqn in layers for role in ROLES]
        index = {key: i for i, key in enumerate(keys)}
        n = len(keys)
        # one flag vector: [overflow per key | bad statistics per key | nonfinite origin per layer | nonfinite seen]
        flags = torch.zeros(2 * n + len(layers) + 1)
        if self._ratios is not None:
            for key, ratio in zip(self._ratio_keys, self._ratios.tolist()):
                if key in index and ratio > self._rules.overflow_factor:
                    flags[index[key]] = ratio  # the ratio itself, for the reason text
        self._ratios = None
        bad_stats_values: Dict[Key, str] = {}
        if record is not None:
            for fqn, roles in record.layers.items():
                for role, stats in roles.items():
                    why = self._rules.bad_stats(role, stats)
                    if why is not None and (fqn, role) in index:
                        flags[n + index[(fqn, role)]] = 1.0
                        bad_stats_values[(fqn, role)] = why
        layer_list = list(layers)
        for i, fqn in enumerate(layer_list):
            diag = self._probe.originated_in(fqn)
            if diag:
                flags[2 * n + i] = 1.0
        self._probe.remove()
        flags[-1] = float(self._nonfinite_reported(engine, layers))
        all_reduce_max_([flags])
        values = flags.tolist()

        # rollbacks restore the layers' buffers (the `enabled` flag too): keep the decisions
        if engine is not None and engine.rollbacks != self._rollbacks_seen:
            self._rollbacks_seen = engine.rollbacks
            for fqn, info in self.fallbacks.items():
                if fqn in layers:
                    self._disable(layers[fqn], info["reason"])

        enabled = {fqn for fqn, layer in layers.items() if layer.fp8_enabled}
        overflow = {key: values[index[key]] for key in keys if values[index[key]] > 0 and key[0] in enabled}
        for fqn, roles, reason in self._rules.overflow_decisions(step, overflow, enabled, order):
            self._fall_back(trainer, pl_module, fqn, "overflow", roles, reason)
            enabled.discard(fqn)
        self._record_overflows(trainer, step, overflow)
        if record is not None:  # the precision rule runs on steps with statistics only
            bad = {
                key: bad_stats_values.get(key, f"{key[1]} out of bounds on another rank")
                for key in keys
                if values[n + index[key]] > 0 and key[0] in enabled
            }
            for fqn, rule, roles, reason in self._rules.stats_decisions(step, bad, enabled & set(record.layers), order):
                self._fall_back(trainer, pl_module, fqn, rule, roles, reason)
                enabled.discard(fqn)
        originated = {fqn for i, fqn in enumerate(layer_list) if values[2 * n + i] > 0 and fqn in enabled}
        for fqn, reason in self._rules.nonfinite_decisions(step, originated):
            self._fall_back(trainer, pl_module, fqn, "nonfinite", ["output"], reason)
            enabled.discard(fqn)
        self._diagnose_next = values[-1] > 0

        self._retry_due(trainer, pl_module, step, layers)
        self._publish_fallback_count(pl_module)

    # -- non-finite diagnosis ----------------------------------------------------------------------------------
    def _nonfinite_reported(self, engine, layers: Dict[str, FP8Linear]) -> bool:
        if engine is not None:
            result = engine.last_result
            fresh = result is not None and result is not self._last_result
            self._last_result = result
            return bool(fresh and result.overflow_layers)
        now = layer_counters(layers)
        before = self._counters or {}
        self._counters = now
        return any(o > before.get(key, (0, 0))[1] for key, (_, o) in now.items())

    # -- switching ---------------------------------------------------------------------------------------------
    def _fall_back(self, trainer, pl_module, fqn: str, rule: str, roles: List[str], reason: str) -> None:
        layer = fp8_layers(pl_module)[fqn]
        target = escalation_target(layer.recipe, rule, self.escalate_to, profile_of(layer.weight.device),
                                   layer.fp8_scalings)
        if target is not None:
            self._escalate(trainer, pl_module, layer, fqn, target, rule, roles, reason)
            return
        if fqn in self.escalations:
            info = self.escalations[fqn]
            reason += f"; {info['to']} scaling (since step {info['step']}) did not help"
        retries = self._retries.get(fqn, 0)
        retry_at = None
        if self.retry_after_steps is not None:
            if retries < self.max_retries:
                retry_at = trainer.global_step + self.retry_after_steps
                reason += f"; FP8 retry at step {retry_at}"
            else:
                reason += f"; no more FP8 retries ({retries} done)"
        self.fallbacks[fqn] = {
            "reason": reason,
            "rule": rule,
            "roles": roles,
            "step": trainer.global_step,
            "manual": False,
            "retry_at": retry_at,
        }
        self._disable(layer, reason)
        self._rules.forget(fqn, episodes=False)
        log.warning("lightning_fp8: layer %s moved to BF16 at step %d: %s", fqn, trainer.global_step, reason)
        self._record_event(trainer, pl_module, "fallback", [fqn], reason, rule=rule, roles=roles)

    def _escalate(self, trainer, pl_module, layer: FP8Linear, fqn: str, target: str, rule: str, roles: List[str],
                  reason: str) -> None:
        """Move a layer to a finer scaling instead of BF16 (callbacks/fallback_escalation.py)."""
        info = {"from": layer.recipe.scaling, "to": target, "reason": reason, "rule": rule, "roles": roles,
                "step": trainer.global_step}
        self.escalations[fqn] = info
        self._set_scaling(layer, info)
        self._rules.forget(fqn, episodes=False)  # judged afresh under the new scaling
        log.warning("lightning_fp8: layer %s escalated from %s to %s scaling at step %d: %s", fqn, info["from"], target,
                    trainer.global_step, reason)
        self._record_event(trainer, pl_module, "escalate", [fqn], reason, rule=rule, roles=roles, scaling=target)

    def _retry_due(self, trainer, pl_module, step: int, layers: Dict[str, FP8Linear]) -> None:
        for fqn, info in list(self.fallbacks.items()):
            retry_at = info.get("retry_at")
            if info.get("manual") or retry_at is None or step < retry_at or fqn not in layers:
                continue
            layer = layers[fqn]
            reset_scaling_state(layer)
            layer.fp8_enabled = True  # also clears fp8_disabled_reason
            del self.fallbacks[fqn]
            self._retries[fqn] = self._retries.get(fqn, 0) + 1
            self._rules.forget(fqn)
            reason = f"retry {self._retries[fqn]} of {self.max_retries} in FP8 after {self.retry_after_steps} steps in BF16"
            log.warning("lightning_fp8: layer %s back in FP8 at step %d (%s)", fqn, step, reason)
            self._record_event(trainer, pl_module, "retry", [fqn], reason)

    # -- events and metrics -----------------------------------------------------------------------------------
    def _fallback_count(self) -> int:
        return sum(1 for info in self.fallbacks.values() if not info.get("manual"))

    def _publish_fallback_count(self, pl_module) -> None:
        """`fp8/fallback_layers` into trainer.callback_metrics on the first step of each epoch and on every change
        (Lightning keeps the value in between), so EarlyStopping / ModelCheckpoint find it before any fallback."""
        trainer = pl_module.trainer
        now = (trainer.current_epoch, self._fallback_count())
        if now != self._published:
            self._published = now
            pl_module.log("fp8/fallback_layers", torch.tensor(float(now[1]), dtype=torch.float64), on_step=True,
                          on_epoch=False, prog_bar=False, logger=False, sync_dist=False, batch_size=1)

    def _record_overflows(self, trainer, step: int, overflow: Dict[Key, float]) -> None:
        """One history event per step in which tensors went beyond overflow_factor (whether or not a layer moves),
        each with the layer the rules attribute it to ("origin")."""
        if not overflow:
            return
        tensors = [
            {"layer": fqn, "role": role, "ratio": float(f"{ratio:.4g}"), "origin": self._rules.origins.origin("overflow", (fqn, role))}
            for (fqn, role), ratio in overflow.items()
        ]
        names = ", ".join(f"{t['layer']}.{t['role']} {t['ratio']:.3g}x" for t in tensors)
        hub_for(trainer).write(trainer, {
            "type": "event", "source": "fallback", "kind": "overflow", "step": step,
            "reason": f"amax beyond {self._rules.overflow_factor:g}x the range of the cast's scale: {names}",
            "layers": sorted({t["layer"] for t in tensors}), "tensors": tensors, "threshold": self._rules.overflow_factor,
        })

    def _record_event(self, trainer, pl_module, kind: str, fqns: List[str], reason: str, log_metric: bool = True, **extra) -> None:
        event = {"step": trainer.global_step, "kind": kind, "reason": reason, "layers": list(fqns), **extra}
        self.events.append(event)
        hub = hub_for(trainer)
        hub.write(trainer, {"type": "event", "source": "fallback", **event})
        hub.write(trainer, {"type": "precision_map", "step": trainer.global_step, "layers": precision_rows(pl_module)})
        if log_metric:
            metrics = {f"fp8/{fqn}/fp8_enabled": float(fp8_layers(pl_module)[fqn].fp8_enabled) for fqn in fqns}
            metrics["fp8/fallback_layers"] = float(self._fallback_count())
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            publish_metrics(trainer, pl_module, metrics, step, callback_keys=watched_metrics(trainer) - {"fp8/fallback_layers"})

    # -- checkpoint --------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {
            "version": 1,
            "fallbacks": {fqn: dict(info) for fqn, info in self.fallbacks.items()},
            "retries": dict(self._retries),
            "events": list(self.events),
            "escalations": {fqn: dict(info) for fqn, info in self.escalations.items()},
            **self._rules.state_dict(),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.fallbacks = {fqn: dict(info) for fqn, info in state_dict.get("fallbacks", {}).items()}
        self._retries = dict(state_dict.get("retries", {}))
        self.events = list(state_dict.get("events", []))
        self.escalations = {fqn: dict(info) for fqn, info in state_dict.get("escalations", {}).items()}
        self._rules.load_state_dict(state_dict)
        self._manual_logged = {fqn for fqn, info in self.fallbacks.items() if info.get("manual")}
