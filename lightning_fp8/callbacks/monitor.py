"""FP8ScaleMonitor: every FP8 layer's scales and quantization health, in the user's own loggers and in a history
file the report reads.

On every `log_every_n_steps`-th optimizer step (and the first one) it samples, for each FP8 layer and each tensor
role (input, weight, grad_output), the scale the cast used, the amax, the overflow fraction, the underflow fraction
and the quantization SQNR (definitions: `lightning_fp8.numerics.stats`), and logs them through `trainer.loggers`
(CSV, TensorBoard, W&B, ...). By default (`per_layer="summary"`) seven columns per layer, the figures a reader
acts on: the scale factors the casts used, the layer's worst health figures, and the run's worst values:

    fp8/<layer fqn>/input/scale | weight/scale | grad_output/scale      (the scale each role's cast used)
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
the tensors whose amax overflowed (`engine.last_result.overflow_layers`, already on the host), so a fault between two
samples is recorded at its step, layer and role: a "nonfinite" event for those whose amax was inf/NaN, a "saturation"
event for roles cast without a scale (`FP8Recipe(scale_gradients=False)`) whose finite amax went beyond the format's
max (the loss scaler's overflow: the step is skipped and the loss scale backs off). The engine's list does not say
which of the two an unscaled role's entry was; the monitor keeps those roles' amaxes of each step on the device
(`on_before_optimizer_step`, only for recipes with unscaled roles) and reads them on the host only in a step whose
list names one. Each stats line also carries the loss scale and the mean host wall time per optimizer step since the
previous line.

Statistics are sampled only on logging steps: the observers that compute them are installed on the layers for those
steps and removed afterwards (see `lightning_fp8.callbacks.hub`). Every other step costs two clock reads and a look at
the engine's last result: O(1) host work, no device synchronisation (a recipe with unscaled gradients adds one stack
of their amaxes on the device per step).
"""
from __future__ import annotations

import datetime
import inspect
import logging
import math
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
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


def _tensor(name: str) -> Dict[str, Any]:
    """{"layer", "role"} of an engine name "fqn.role"."""
    fqn, _, role = name.rpartition(".")
    return {"layer": fqn, "role": role} if role in ROLES else {"layer": name, "role": None}


def _classify_unscaled(unscaled: Tuple[List[str], torch.Tensor, List[float]], overflow_layers: List[str]):
    """({name: amax} of the unscaled roles in `overflow_layers` whose finite amax went beyond the format's max, {names
    whose amax was non-finite}), over every rank: each rank flags its own amaxes, one MAX all-reduce combines the
    flags (the engine's list is the same on every rank, so every rank gets here together), one host read. Nothing
    runs unless the list names an unscaled role."""
    from lightning_fp8.engine.distributed import all_reduce_max_

    names, amaxes, maxima = unscaled
    listed = [i for i, name in enumerate(names) if name in set(overflow_layers)]
    if not listed:
        return {}, set()
    amax = amaxes[listed]
    limit = torch.tensor([maxima[i] for i in listed], dtype=amax.dtype, device=amax.device)
    finite = torch.isfinite(amax)
    flags = torch.stack([(~finite).float(), (finite & (amax > limit)).float(),
                         torch.where(finite, amax, torch.zeros_like(amax))])
    all_reduce_max_([flags])
    nonfinite, beyond, values = flags.tolist()  # the one read, only in a step that names an unscaled role
    picked = [names[i] for i in listed]
    return ({name: value for name, hit, value in zip(picked, beyond, values) if hit},
            {name for name, hit in zip(picked, nonfinite) if hit})


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
        per_layer: what the loggers get per layer: "summary" (the scale of each role's cast, fp8_enabled and the
            worst overflow, underflow and SQNR over the layer's roles: 7 columns), "full" (every statistic of every
            role: 25 columns) or "none". The history file always has everything.
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
        #: ("fqn.role" names, their amaxes of the step on the device, their formats' max) of the roles cast without a
        #: scale, taken before the engine's decision (None: the recipe scales every role)
        self._unscaled: Optional[Tuple[List[str], Any, List[float]]] = None
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
        # whether any layer casts a role without a scale (then the step's amaxes of those roles are kept on the
        # device before each decision, see on_before_optimizer_step); a fallback or an escalation never adds one
        self._may_saturate = any(not layer.recipe.scale_gradients for layer in hub.layers(pl_module).values())
        self._last_result = engine.last_result if engine is not None else None
        self._step_t0, self._timed_step = None, trainer.global_step
        self._time_sum, self._time_steps = 0.0, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not getattr(self, "_started", False):
            self._start(trainer, pl_module)
        if self._step_t0 is None:  # the first micro-batch of an optimizer step
            self._step_t0 = time.perf_counter()
        hub_for(trainer).begin_batch(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """After backward, before the engine's decision: the step's amaxes of the roles cast without a scale (an
        unscaled gradient), kept on the device. The engine names such a role in `overflow_layers` when its amax is
        non-finite *or* beyond the format's max; `_record_nonfinite` reads these only then, to say which."""
        self._unscaled = None
        if not getattr(self, "_may_saturate", False):
            return  # every role is cast with a scale: an overflow in the engine's list is a non-finite amax
        names, amaxes, maxima = [], [], []
        with torch.no_grad():
            for fqn, layer in hub_for(trainer).layers(pl_module).items():
                recipe = layer.recipe
                if not layer.fp8_enabled or recipe.scale_gradients:
                    continue
                for role, state in layer.fp8_meta.states().items():
                    if recipe.uses_scaling_for(role):
                        continue
                    amax = state.amax_history[0].reshape(())
                    amaxes.append(amax.to(amaxes[0].device) if amaxes else amax)
                    names.append(f"{fqn}.{role}")
                    maxima.append(recipe.format_for(role).max)
        self._unscaled = (names, torch.stack(amaxes).float(), maxima) if names else None

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
        """After every optimizer step: the tensors whose amax the engine found overflowing, as events with the layer
        and role of each: "nonfinite" (inf/NaN amax) and "saturation" (a role cast without a scale whose finite amax
        went beyond the format's max). The engine computed the list on the host already; the amaxes of unscaled roles
        are read (one small copy) only in a step whose list names one."""
        engine = fp8_engine(trainer)
        result = getattr(engine, "last_result", None)
        unscaled, self._unscaled = self._unscaled, None
        if result is None or result is self._last_result:
            return
        self._last_result = result
        if not result.overflow_layers or not getattr(self, "_writes", False):
            return
        saturated: Dict[str, float] = {}
        unscaled_nonfinite = set()
        if unscaled is not None:
            saturated, unscaled_nonfinite = _classify_unscaled(unscaled, result.overflow_layers)
        nonfinite = [name for name in result.overflow_layers if name not in saturated or name in unscaled_nonfinite]
        common = {"type": "event", "source": "engine", "step": engine.step_count, "skipped": not result.stepped,
                  "loss_scale": float(engine.loss_scale)}
        hub = hub_for(trainer)
        if nonfinite:
            tensors = [_tensor(name) for name in nonfinite]
            hub.write(trainer, {
                **common, "kind": "nonfinite", "reason": "non-finite FP8 amax (inf/NaN) in " + ", ".join(nonfinite),
                "layers": sorted({t["layer"] for t in tensors}), "tensors": tensors,
            })
        if saturated:
            layers = self._layers_of(trainer)
            tensors = []
            for name, amax in saturated.items():
                tensor = _tensor(name)
                layer = layers.get(tensor["layer"])
                if layer is not None and tensor["role"] in ROLES:
                    tensor["ratio"] = _compact(amax / layer.recipe.format_for(tensor["role"]).max)
                tensor["amax"] = _compact(amax)
                tensors.append(tensor)
            hub.write(trainer, {
                **common, "kind": "saturation",
                "reason": ("amax beyond the FP8 format's max in " + ", ".join(saturated) + ", cast without a scale "
                           "(FP8Recipe(scale_gradients=False)): the loss scaler's overflow, the step is skipped and "
                           "the loss scale backs off"),
                "layers": sorted({t["layer"] for t in tensors}), "tensors": tensors,
            })

    @staticmethod
    def _layers_of(trainer):
        module = getattr(trainer, "lightning_module", None)
        return hub_for(trainer).layers(module) if module is not None else {}

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
                for role, stats in roles.items():  # the scale factors, under the names "full" gives them
                    out[f"fp8/{fqn}/{role}/scale"] = float(stats["scale"])
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
