"""FP8ScaleMonitor: every FP8 layer's scales and quantization health, in the user's own loggers and in a history
file the report reads.

On every `log_every_n_steps`-th optimizer step (and the first one) it samples, for each FP8 layer and each tensor
role (input, weight, grad_output), the scale the cast used, the amax, the overflow fraction, the underflow fraction
and the quantization SQNR (definitions: `lightning_fp8.numerics.stats`), and logs them through `trainer.loggers`
(CSV, TensorBoard, W&B, ...) as

    fp8/<layer fqn>/<role>/scale | amax | overflow | underflow | sqnr_db
    fp8/<layer fqn>/<role>/clipped_casts | nonfinite_casts   (casts that clipped / had a non-finite amax since
                                                              the previous log; from the layer's counters)
    fp8/<layer fqn>/fp8_enabled                             (1 in FP8, 0 in BF16)

It appends the same numbers, the precision map and the engine's skip / rollback events to
`<trainer.log_dir>/fp8_history.jsonl` (see `lightning_fp8.report` for the format and the HTML dashboard).

Statistics are sampled only on logging steps: the observers that compute them are installed on the layers for those
steps and removed afterwards (see `lightning_fp8.callbacks.hub`), so the other steps cost nothing.
"""
from __future__ import annotations

import datetime
import logging
from typing import Any, Dict, Optional

from lightning.pytorch.callbacks import Callback

from lightning_fp8.callbacks.history_file import HISTORY_VERSION
from lightning_fp8.callbacks.hub import StatsConsumer, fp8_engine, hub_for, layer_counters, precision_rows
from lightning_fp8.callbacks.sampling import STATS, StatsRecord
from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.numerics.stats import DEFAULT_SAMPLE_SIZE
from lightning_fp8.recipe import ROLES

log = logging.getLogger("lightning_fp8")


def _compact(value: float) -> float:
    return float(f"{value:.6g}") if isinstance(value, float) else value


class FP8ScaleMonitor(StatsConsumer, Callback):
    """Log per-layer FP8 scales, amaxes, overflow / underflow fractions and SQNR.

    Args:
        log_every_n_steps: optimizer steps between samples (the first step is always sampled). None: the
            Trainer's `log_every_n_steps` (50 by default).
        sample_size: elements per tensor the underflow and SQNR statistics look at (amax and overflow always see
            the whole tensor).
        log_counts: also log the clipped / non-finite cast counters per role.
        history_file: path of the JSON-lines history; None: `<trainer.log_dir>/fp8_history.jsonl`. False: no file.
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        sample_size: int = DEFAULT_SAMPLE_SIZE,
        log_counts: bool = True,
        history_file: Any = None,
    ) -> None:
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be an int >= 1 or None, got {log_every_n_steps!r}")
        if not isinstance(sample_size, int) or sample_size < 1:
            raise ValueError(f"sample_size must be an int >= 1, got {sample_size!r}")
        self.log_every_n_steps = log_every_n_steps
        self.sample_size = sample_size
        self.log_counts = log_counts
        self.history_file = history_file
        self._interval = log_every_n_steps or 50
        self._events_seen = 0
        self._restored_events_seen: Optional[int] = None
        self._counters: Optional[Dict] = None
        #: the last StatsRecord (handy in tests and notebooks)
        self.last_record: Optional[StatsRecord] = None

    # -- which steps -------------------------------------------------------------------------------------------
    def wants_stats(self, step: int) -> bool:
        return step == 0 or (step + 1) % self._interval == 0

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._interval = self.log_every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 50) or 50))
        self._writes = self.history_file is not False
        if stage == "fit" and self._writes:
            hub_for(trainer).setup_history(trainer, self.history_file or None, required=True)

    def on_train_start(self, trainer, pl_module) -> None:
        hub_for(trainer).reset_layers()
        self._started = False
        self._counters = None

    def _start(self, trainer, pl_module) -> None:
        """At the first batch, after every on_train_start hook (calibration, restored fallbacks) has run."""
        self._started = True
        hub = hub_for(trainer)
        engine = fp8_engine(trainer)
        events = list(engine.events) if engine is not None else []
        fresh = hub.history is None or hub.history._fresh
        if self._writes:
            hub.write(trainer, {
                "type": "run",
                "version": HISTORY_VERSION,
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "step": trainer.global_step,
                "resumed": getattr(trainer, "ckpt_path", None) is not None,
                "log_every_n_steps": self._interval,
                "sample_size": self.sample_size,
                "recipe": engine.recipe.to_dict() if engine is not None else None,
            })
            hub.write(trainer, {"type": "precision_map", "step": trainer.global_step, "layers": precision_rows(pl_module)})
        # engine events already in a restored checkpoint: written again into a fresh file, skipped when appending
        start = 0 if fresh else min(len(events), self._restored_events_seen or len(events))
        self._events_seen = start
        self._flush_engine_events(trainer, from_checkpoint=True)
        # baseline after any calibration pass (which also counts casts)
        self._counters = layer_counters(fp8_layers(pl_module))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not getattr(self, "_started", False):
            self._start(trainer, pl_module)
        hub_for(trainer).begin_batch(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        hub = hub_for(trainer)
        record = hub.end_batch(trainer)
        self._flush_engine_events(trainer)
        if record is not None:
            self.last_record = record
            self._publish(trainer, pl_module, record)

    def on_train_end(self, trainer, pl_module) -> None:
        hub = hub_for(trainer)
        hub.abort()
        if getattr(self, "_writes", False):
            hub.write(trainer, {"type": "precision_map", "step": trainer.global_step, "layers": precision_rows(pl_module)})

    def on_exception(self, trainer, pl_module, exception) -> None:
        hub_for(trainer).abort()

    # -- output ------------------------------------------------------------------------------------------------
    @staticmethod
    def _layers(pl_module):
        trainer = getattr(pl_module, "_trainer", None)
        return hub_for(trainer).layers(pl_module) if trainer is not None else fp8_layers(pl_module)

    def _flush_engine_events(self, trainer, from_checkpoint: bool = False) -> None:
        engine = fp8_engine(trainer)
        if engine is None:
            return
        events = engine.events
        if len(events) < self._events_seen:  # the engine's list was replaced (e.g. loaded state)
            self._events_seen = 0
        for event in events[self._events_seen:]:
            record = {"type": "event", "source": "engine", **event}
            if from_checkpoint:
                record["from_checkpoint"] = True
            if getattr(self, "_writes", False):
                hub_for(trainer).write(trainer, record)
        self._events_seen = len(events)

    def metrics(self, record: StatsRecord, pl_module, counters: Optional[Dict] = None) -> Dict[str, float]:
        """The logger metrics of one record (names: see the module docstring)."""
        out: Dict[str, float] = {}
        for fqn, layer in self._layers(pl_module).items():
            out[f"fp8/{fqn}/fp8_enabled"] = float(layer.fp8_enabled)
            for role, stats in record.layers.get(fqn, {}).items():
                for stat in STATS:
                    out[f"fp8/{fqn}/{role}/{stat}"] = float(stats[stat])
            if counters is not None and layer.fp8_enabled:
                for role in ROLES:
                    clipped, nonfinite = counters.get((fqn, role), (0, 0))
                    out[f"fp8/{fqn}/{role}/clipped_casts"] = float(clipped)
                    out[f"fp8/{fqn}/{role}/nonfinite_casts"] = float(nonfinite)
        return out

    def _counter_deltas(self, pl_module) -> Dict:
        now = layer_counters(self._layers(pl_module))
        before = self._counters or {}
        deltas = {}
        for key, (clip, over) in now.items():
            c0, o0 = before.get(key, (0, 0))
            # counters go back after a rollback (restored from the snapshot): count from the restored value
            deltas[key] = (clip - c0 if clip >= c0 else clip, over - o0 if over >= o0 else over)
        self._counters = now
        return deltas

    def _publish(self, trainer, pl_module, record: StatsRecord) -> None:
        counters = self._counter_deltas(pl_module) if self.log_counts else None
        metrics = self.metrics(record, pl_module, counters)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.logger_step)
        if not getattr(self, "_writes", False):
            return
        layers: Dict[str, Any] = {}
        for fqn, layer in self._layers(pl_module).items():
            entry: Dict[str, Any] = {"enabled": bool(layer.fp8_enabled)}
            for role in ROLES if layer.fp8_enabled else ():
                stats = record.layers.get(fqn, {}).get(role)
                row: Dict[str, Any] = {k: _compact(float(stats[k])) for k in STATS} if stats else {}
                if counters is not None and (fqn, role) in counters:
                    row["clipped_casts"], row["nonfinite_casts"] = counters[(fqn, role)]
                if row:
                    entry[role] = row
            layers[fqn] = entry
        hub_for(trainer).write(
            trainer, {"type": "stats", "step": record.step, "logger_step": record.logger_step, "layers": layers}
        )

    # -- checkpoint --------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"events_seen": self._events_seen}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._restored_events_seen = int(state_dict.get("events_seen", 0))


__all__ = ["FP8ScaleMonitor"]
