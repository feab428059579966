"""FP8ScaleMonitor: every FP8 layer's scales and quantization health, in the user's own loggers and in a history
file the report reads.

On every `log_every_n_steps`-th optimizer step (and the first one) it samples, for each FP8 layer and each tensor
role (input, weight, grad_output), the scale the cast used, the amax, the overflow fraction, the underflow fraction
and the quantization SQNR (definitions: `lightning_fp8.numerics.stats`), and logs them through `trainer.loggers`
(CSV, TensorBoard, W&B, ...). By default (`per_layer="summary"`) four columns per layer, the figures a reader acts
on, and the run's worst values:

    fp8/<layer fqn>/fp8_enabled                             (1 in FP8, 0 in BF16)
    fp8/<layer fqn>/worst_overflow | worst_underflow | worst_sqnr_db   (the worst of the layer's three roles)
    fp8/worst_range_ratio | worst_overflow | worst_underflow | worst_sqnr_db   (the worst layer and role)

`per_layer="full"` logs every statistic of every role instead (25 columns per layer; "none": the run's worst only):

    fp8/<layer fqn>/<role>/scale | amax | range_ratio | overflow | underflow | sqnr_db
    fp8/<layer fqn>/<role>/clipped_casts | nonfinite_casts   (casts that clipped / had a non-finite amax since
                                                              the previous log; from the layer's counters)
    fp8/<layer fqn>/fp8_enabled

Whatever the setting, the history file below holds every statistic (the HTML report reads it), and any fp8/* name a
callback of the run monitors is logged.

The four `fp8/worst_*` summaries, and any fp8/* name a ModelCheckpoint / EarlyStopping / ReduceLROnPlateau of the run
monitors, also go to `trainer.callback_metrics` through Lightning's `pl_module.log_dict` (see `publish_metrics` in
lightning_fp8/callbacks/hub.py for why the loggers are written directly).

It appends the same numbers, the precision map and every engine event to `<trainer.log_dir>/fp8_history.jsonl` (see
`lightning_fp8.report` for the format and the HTML dashboard): skips and rollbacks, and after *every* optimizer step
the tensors whose amax was non-finite (`engine.last_result.overflow_layers`, already on the host), so a fault between
two samples is recorded at its step, layer and role. Each stats line also carries the loss scale and the mean host
wall time per optimizer step since the previous line.

Statistics are sampled only on logging steps: the observers that compute them are installed on the layers for those
steps and removed afterwards (see `lightning_fp8.callbacks.hub`). Every other step costs two clock reads and a look at
the engine's last result: O(1) host work, no device synchronisation.
"""
from __future__ import annotations

import datetime
import inspect
import logging
import math
import time
from typing import Any, Dict, Iterable, List, Optional

from lightning.pytorch.callbacks import Callback

from lightning_fp8.callbacks.fallback import FP8LayerFallback
from lightning_fp8.callbacks.history_file import HISTORY_VERSION
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
from lightning_fp8.callbacks.sampling import STATS, StatsRecord
from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.numerics.stats import DEFAULT_SAMPLE_SIZE
from lightning_fp8.recipe import ROLES
from lightning_fp8.state_format import format_version, stamped

log = logging.getLogger("lightning_fp8")


#: the thresholds of FP8LayerFallback's rules the report anchors its colours to (recorded in the run header)
THRESHOLDS = ("overflow_factor", "min_sqnr_db", "max_underflow")
#: what the loggers get per layer (see the module docstring)
PER_LAYER_CHOICES = ("summary", "full", "none")


def _compact(value: float) -> float:
    return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def run_thresholds(trainer) -> Dict[str, Any]:
    """FP8LayerFallback's thresholds in this run (its defaults, said so, when the run has no FP8LayerFallback)."""
    fallback = next((cb for cb in trainer.callbacks if isinstance(cb, FP8LayerFallback)), None)
    if fallback is not None:
        return {"source": "FP8LayerFallback", **{name: getattr(fallback, name) for name in THRESHOLDS}}
    defaults = inspect.signature(FP8LayerFallback.__init__).parameters
    return {
        "source": "FP8LayerFallback defaults (no FP8LayerFallback in this run)",
        **{name: defaults[name].default for name in THRESHOLDS},
    }


def worst_metrics(record: StatsRecord) -> Dict[str, float]:
    """fp8/worst_*: the largest range ratio, overflow and underflow and the lowest SQNR over every sampled layer and
    role (NaN values, e.g. the SQNR of an all-zero tensor, are left out)."""
    columns: Dict[str, List[float]] = {"range_ratio": [], "overflow": [], "underflow": [], "sqnr_db": []}
    for roles in record.layers.values():
        for stats in roles.values():
            for stat, values in columns.items():
                value = float(stats[stat])
                if not math.isnan(value):
                    values.append(value)
    out = {f"fp8/worst_{stat}": (min if stat == "sqnr_db" else max)(values) for stat, values in columns.items() if values}
    return out


class FP8ScaleMonitor(StatsConsumer, Callback):
    """Log per-layer FP8 scales, amaxes, overflow / underflow fractions and SQNR.

    Args:
        log_every_n_steps: optimizer steps between samples (the first step is always sampled). None: the
            Trainer's `log_every_n_steps` (50 by default).
        sample_size: elements per tensor the underflow and SQNR statistics look at (amax and overflow always see
            the whole tensor).
        log_counts: with per_layer="full", also log the clipped / non-finite cast counters per role.
        history_file: path of the JSON-lines history; None: `<trainer.log_dir>/fp8_history.jsonl`. False: no file.
        per_layer: what the loggers get per layer: "summary" (fp8_enabled and the worst overflow, underflow and SQNR
            over the layer's roles: 4 columns), "full" (every statistic of every role: 25 columns) or "none". The
            history file always has everything.
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        sample_size: int = DEFAULT_SAMPLE_SIZE,
        log_counts: bool = True,
        history_file: Any = None,
        per_layer: str = "summary",
    ) -> None:
        if per_layer not in PER_LAYER_CHOICES:
            raise ValueError(f"per_layer={per_layer!r} is not valid; valid choices: {list(PER_LAYER_CHOICES)}")
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps must be an int >= 1 or None, got {log_every_n_steps!r}")
        if not isinstance(sample_size, int) or sample_size < 1:
            raise ValueError(f"sample_size must be an int >= 1, got {sample_size!r}")
        self.log_every_n_steps = log_every_n_steps
        self.sample_size = sample_size
        self.log_counts = log_counts
        self.history_file = history_file
        self.per_layer = per_layer
        self._interval = log_every_n_steps or 50
        self._events_seen = 0
        self._restored_events_seen: Optional[int] = None
        self._counters: Optional[Dict] = None
        self._last_result: Any = None
        self._step_t0: Optional[float] = None
        self._timed_step = 0
        self._time_sum, self._time_steps = 0.0, 0
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

    def on_fit_start(self, trainer, pl_module) -> None:
        warn_if_nothing_in_fp8(trainer, pl_module, type(self).__name__)

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
                "thresholds": run_thresholds(trainer),
                "world_size": int(getattr(trainer, "world_size", 1) or 1),
            })
            hub.write(trainer, {"type": "precision_map", "step": trainer.global_step, "layers": precision_rows(pl_module)})
        # engine events already in a restored checkpoint: written again into a fresh file, skipped when appending
        start = 0 if fresh else min(len(events), self._restored_events_seen or len(events))
        self._events_seen = start
        self._flush_engine_events(trainer, from_checkpoint=True)
        # baseline after any calibration pass (which also counts casts)
        self._counters = layer_counters(fp8_layers(pl_module))
        self._last_result = engine.last_result if engine is not None else None
        self._step_t0, self._timed_step = None, trainer.global_step
        self._time_sum, self._time_steps = 0.0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not getattr(self, "_started", False):
            self._start(trainer, pl_module)
        if self._step_t0 is None:  # the first micro-batch of an optimizer step
            self._step_t0 = time.perf_counter()
        hub_for(trainer).begin_batch(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self._timed_step:  # an optimizer step completed with this batch
            if self._step_t0 is not None:
                self._time_sum += time.perf_counter() - self._step_t0
                self._time_steps += 1
            self._step_t0, self._timed_step = None, trainer.global_step
            self._record_nonfinite(trainer)
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
            else:
                record["loss_scale"] = float(engine.loss_scale)  # after the step: the backed-off scale of a skip
            if getattr(self, "_writes", False):
                hub_for(trainer).write(trainer, record)
        self._events_seen = len(events)

    def _record_nonfinite(self, trainer) -> None:
        """After every optimizer step: the tensors whose amax the engine found non-finite, as one event with the
        layer and role of each (the engine computed the list on the host already: no extra device work)."""
        engine = fp8_engine(trainer)
        result = getattr(engine, "last_result", None)
        if result is None or result is self._last_result:
            return
        self._last_result = result
        if not result.overflow_layers or not getattr(self, "_writes", False):
            return
        tensors = []
        for name in result.overflow_layers:
            fqn, _, role = name.rpartition(".")
            tensors.append({"layer": fqn, "role": role} if role in ROLES else {"layer": name, "role": None})
        hub_for(trainer).write(trainer, {
            "type": "event", "source": "engine", "kind": "nonfinite", "step": engine.step_count,
            "reason": "non-finite FP8 amax (inf/NaN) in " + ", ".join(result.overflow_layers),
            "layers": sorted({t["layer"] for t in tensors}), "tensors": tensors, "skipped": not result.stepped,
            "loss_scale": float(engine.loss_scale),
        })

    def metrics(self, record: StatsRecord, pl_module, counters: Optional[Dict] = None,
                keep: Iterable[str] = ()) -> Dict[str, float]:
        """The logger metrics of one record for `per_layer` (names: see the module docstring), plus the names in
        `keep` (what the run's callbacks monitor) whatever `per_layer` says."""
        full = self._full_metrics(record, pl_module, counters)
        if self.per_layer == "full":
            return full
        out = {name: value for name, value in full.items() if name in set(keep)}
        if self.per_layer == "summary":
            for fqn, layer in self._layers(pl_module).items():
                out[f"fp8/{fqn}/fp8_enabled"] = float(layer.fp8_enabled)
                roles = record.layers.get(fqn, {})
                for stat, worst in (("overflow", max), ("underflow", max), ("sqnr_db", min)):
                    values = [float(stats[stat]) for stats in roles.values() if not math.isnan(float(stats[stat]))]
                    if values:
                        out[f"fp8/{fqn}/worst_{stat}"] = worst(values)
        return out

    def _full_metrics(self, record: StatsRecord, pl_module, counters: Optional[Dict] = None) -> Dict[str, float]:
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
        watched = watched_metrics(trainer)
        metrics = self.metrics(record, pl_module, counters, keep=watched)
        summary = worst_metrics(record)
        metrics.update(summary)
        publish_metrics(trainer, pl_module, metrics, record.logger_step, callback_keys=[*summary, *watched])
        step_time = self._time_sum / self._time_steps if self._time_steps else None
        timed_steps, self._time_sum, self._time_steps = self._time_steps, 0.0, 0
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
        engine = fp8_engine(trainer)
        hub_for(trainer).write(trainer, {
            "type": "stats", "step": record.step, "logger_step": record.logger_step, "layers": layers,
            "loss_scale": float(engine.loss_scale) if engine is not None else None,
            "step_time_s": _compact(step_time) if step_time is not None else None, "timed_steps": timed_steps,
        })

    # -- checkpoint --------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return stamped({"events_seen": self._events_seen}, 1)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        format_version(state_dict, "FP8ScaleMonitor state", 1)
        self._restored_events_seen = int(state_dict.get("events_seen", 0))


__all__ = ["FP8ScaleMonitor"]
