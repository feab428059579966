"""The per-layer records the observability callbacks share: statistics samples, the history file, engine access.

One `StatsHub` per Trainer sits between the FP8Linear layers and the callbacks that read them (FP8ScaleMonitor,
FP8LayerFallback):

- on the optimizer steps some callback asked for, it installs `layer.fp8_observer` on every FP8 layer for that one
  step (all micro-batches of it) and removes it afterwards, so the other steps pay nothing;
- the observer computes `lightning_fp8.numerics.stats.quantization_stats` of each operand with the scale its cast
  uses (the cast's own rule, `lightning_fp8.modules.cast`), and a torchmetrics Metric per (layer, role)
  (`QuantStatsMetric`: sums reduced by sum, amax by max) combines the casts of the step;
- at the end of the step it turns them into one `StatsRecord` (one device-to-host copy), which every callback reads.

It also records the layers' forward execution order on the first step (FP8LayerFallback attributes an anomaly to
the layer where it starts), and owns the history file (`fp8_history.jsonl`, JSON lines) the report reads.
"""
from __future__ import annotations

import json
import logging
import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchmetrics import Metric

from lightning_fp8.modules.autocast import current_state
from lightning_fp8.conversion.convert import fp8_layers, precision_map
from lightning_fp8.modules.cast import cast_scale as _cast_scale  # the cast's own scale rule (delayed / current / none)
from lightning_fp8.modules.linear import FP8Linear
from lightning_fp8.numerics.quantize import tensor_amax
from lightning_fp8.numerics.stats import DEFAULT_SAMPLE_SIZE, STAT_FIELDS, QuantStats, overflow_fraction, quantization_stats
from lightning_fp8.numerics.stats import sqnr_db as _sqnr_db
from lightning_fp8.numerics.stats import underflow_fraction
from lightning_fp8.recipe import ROLES

log = logging.getLogger("lightning_fp8")

HISTORY_FILENAME = "fp8_history.jsonl"
HISTORY_VERSION = 1
#: statistics of one role in a StatsRecord (the metric names are fp8/<fqn>/<role>/<stat>)
STATS = ("scale", "amax", "overflow", "underflow", "sqnr_db")
_SUMS = STAT_FIELDS[1:]  # ("numel", "overflow", "sampled", "nonzero", "underflow", "signal", "noise")


# -- small helpers ----------------------------------------------------------------------------------------------
def fp8_engine(trainer) -> Optional[Any]:
    """The FP8TrainingEngine of the trainer's precision plugin (None without FP8Precision)."""
    plugin = getattr(trainer, "precision_plugin", None)
    return getattr(plugin, "engine", None)


def json_safe(value: Any) -> Any:
    """Non-finite floats become the strings "nan" / "inf" / "-inf" (strict JSON; `float()` reads them back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def precision_rows(model: nn.Module) -> List[Dict[str, str]]:
    return [{"fqn": row.fqn, "precision": row.precision, "reason": row.reason} for row in precision_map(model)]


# -- the statistics record --------------------------------------------------------------------------------------
@dataclass
class StatsRecord:
    """Statistics of one optimizer step, sampled on every FP8 layer that ran in FP8.

    step: optimizer steps completed when the record was taken (`trainer.global_step` after the step: the same
        count the engine's events use). logger_step: the step value Lightning's own `self.log` uses for that
        batch (so the fp8/* metrics land in the same rows as the user's).
    layers: {fqn: {role: {"scale", "amax", "overflow", "underflow", "sqnr_db", "calls"}}}; overflow and
        underflow are fractions (see lightning_fp8.numerics.stats), scale is the quantization scale the step's last
        cast of that role used.
    """

    step: int
    logger_step: int
    layers: Dict[str, Dict[str, Dict[str, float]]] = field(default_factory=dict)


class QuantStatsMetric(Metric):
    """Running statistics of one (layer, role) over the casts of one step, as a torchmetrics Metric: the sums of
    `QuantStats` (reduced by sum), the amax (reduced by max, NaN propagates) and the last cast's scale. One metric
    object per role keeps the per-cast cost to one update (eight scalar metrics per role cost 8x the bookkeeping)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__(sync_on_compute=False)
        f64 = torch.float64
        self.add_state("sums", default=torch.zeros(len(_SUMS), dtype=f64), dist_reduce_fx="sum")
        self.add_state("amax", default=torch.tensor(-math.inf, dtype=f64), dist_reduce_fx="max")
        self.add_state("scale", default=torch.tensor(math.nan, dtype=f64), dist_reduce_fx="max")
        self.add_state("calls", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, stats: QuantStats, scale: torch.Tensor) -> None:  # type: ignore[override]
        packed = stats.as_tensor()  # amax, then the sums in _SUMS order
        self.sums += packed[1:]
        self.amax = torch.maximum(self.amax, packed[0])  # NaN wins: a NaN amax is an overflow
        self.scale = scale.detach().reshape(()).to(torch.float64)
        self.calls += 1

    def compute(self) -> torch.Tensor:
        """[amax, *sums, scale] as one float64 vector."""
        return torch.cat([self.amax.reshape(1), self.sums, self.scale.reshape(1)])


class LayerStatsSampler:
    """Installs observers on FP8 layers for one step and turns what they saw into a StatsRecord."""

    def __init__(self, sample_size: int = DEFAULT_SAMPLE_SIZE, seed: int = 0) -> None:
        self.sample_size = int(sample_size)
        # a private generator: sampling never moves the training run's random stream
        self.generator = torch.Generator().manual_seed(seed)
        self._aggregates: Dict[Tuple[str, str], QuantStatsMetric] = {}
        self._calls: Dict[Tuple[str, str], int] = {}
        self._installed: Dict[str, Tuple[FP8Linear, Optional[Callable]]] = {}

    def start(self, layers: Dict[str, FP8Linear]) -> None:
        self.stop_observing()
        for fqn, layer in layers.items():
            previous = layer.fp8_observer
            layer.fp8_observer = self._observer(fqn, layer, previous)
            self._installed[fqn] = (layer, previous)

    def stop_observing(self) -> None:
        for layer, previous in self._installed.values():
            layer.fp8_observer = previous
        self._installed.clear()

    def _observer(self, fqn: str, layer: FP8Linear, previous: Optional[Callable]) -> Callable:
        def observe(role: str, x: torch.Tensor) -> None:
            if previous is not None:
                previous(role, x)
            self.observe(fqn, layer, role, x)

        return observe

    @torch.no_grad()
    def observe(self, fqn: str, layer: FP8Linear, role: str, x: torch.Tensor) -> None:
        recipe = current_state().recipe or layer.recipe
        fmt = recipe.format_for(role)
        state = getattr(layer.fp8_meta, role)
        x = x.detach()
        amax = tensor_amax(x)
        scale = _cast_scale(x, amax, state, recipe, role, True, fmt)
        stats = quantization_stats(
            x, scale, fmt, self.sample_size, self.generator, rounding=recipe.rounding_for(role), amax=amax
        )
        key = (fqn, role)
        metric = self._aggregates.get(key)
        if metric is None:
            metric = self._aggregates[key] = QuantStatsMetric().to(x.device)
        metric.update(stats, scale)
        self._calls[key] = self._calls.get(key, 0) + 1

    def finish(self, step: int, logger_step: int) -> StatsRecord:
        """Stop observing and return the step's record (one host copy per device); the aggregators are reset."""
        self.stop_observing()
        record = StatsRecord(step=step, logger_step=logger_step)
        seen = [(key, self._aggregates[key]) for key, calls in self._calls.items() if calls > 0]
        if seen:
            packed = torch.stack([metric.compute().cpu() for _, metric in seen]).tolist()
            for (fqn, role), values in zip((key for key, _ in seen), packed):
                amax, numel, overflow, _sampled, nonzero, underflow, signal, noise, scale = values
                record.layers.setdefault(fqn, {})[role] = {
                    "scale": scale,
                    "amax": amax,
                    "overflow": overflow_fraction(overflow, numel),
                    "underflow": underflow_fraction(underflow, nonzero),
                    "sqnr_db": _sqnr_db(signal, noise),
                    "calls": self._calls[(fqn, role)],
                }
        for key, _ in seen:
            self._aggregates[key].reset()
        self._calls.clear()
        return record


# -- the history file -------------------------------------------------------------------------------------------
class HistoryFile:
    """Append-only JSON-lines file (one object per line, "type" in run | precision_map | stats | event)."""

    def __init__(self, path: str, fresh: bool) -> None:
        self.path = path
        self._fresh = fresh
        self._opened = False

    def append(self, record: Dict[str, Any]) -> None:
        mode = "a"
        if not self._opened:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            mode = "w" if self._fresh else "a"
            self._opened = True
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(json_safe(record), separators=(",", ":"), allow_nan=False) + "\n")


# -- the hub ------------------------------------------------------------------------------------------------------
class StatsConsumer:
    """Mixin of the callbacks that read StatsRecords: say which optimizer steps to sample."""

    sample_size: int = DEFAULT_SAMPLE_SIZE

    def wants_stats(self, step: int) -> bool:  # step: 0-based index of the optimizer step about to run
        return False


class StatsHub:
    """Per-Trainer coordinator (see the module docstring). Obtain it with `hub_for(trainer)`."""

    def __init__(self) -> None:
        self.sampler: Optional[LayerStatsSampler] = None
        self._active_step: Optional[int] = None
        self.record: Optional[StatsRecord] = None
        self.forward_order: List[str] = []
        self._order_hooks: List[Any] = []
        self._order_seen: List[str] = []
        self.history: Optional[HistoryFile] = None
        self._layers: Optional[Dict[str, FP8Linear]] = None
        self._layers_of: Optional[int] = None

    # layers ----------------------------------------------------------------------------------------------------
    def layers(self, pl_module: nn.Module) -> Dict[str, FP8Linear]:
        """The module's FP8Linear layers by name, looked up once per fit (the per-step hooks use this)."""
        if self._layers is None or self._layers_of != id(pl_module):
            self._layers = fp8_layers(pl_module)
            self._layers_of = id(pl_module)
        return self._layers

    def reset_layers(self) -> None:
        """Forget the cached layers (at the start of each fit: conversion may have changed them)."""
        self._layers = None

    # history ---------------------------------------------------------------------------------------------------
    def setup_history(self, trainer, path: Optional[str] = None, required: bool = False) -> None:
        """Decide the history file. Call it from a hook every rank runs (`setup`): `trainer.log_dir` is a collective
        under DDP. `path` None: `<trainer.log_dir>/fp8_history.jsonl`, used when `required` (FP8ScaleMonitor) or
        when the trainer has a logger (FP8LayerFallback alone never drops a file into the working directory). An
        explicit path replaces the default one as long as nothing was written. A fresh run truncates the file, a
        resumed run (ckpt_path given) appends to it."""
        if self.history is not None:
            if path is None or path == self.history.path or self.history._opened:
                return
        if path is None:
            if not (required or trainer.loggers):
                return
            log_dir = trainer.log_dir or trainer.default_root_dir
            path = os.path.join(log_dir, HISTORY_FILENAME)
        fresh = getattr(trainer, "ckpt_path", None) is None
        self.history = HistoryFile(path, fresh=fresh)

    def write(self, trainer, record: Dict[str, Any]) -> None:
        if self.history is None or not getattr(trainer, "is_global_zero", True):
            return
        self.history.append(record)

    # sampling --------------------------------------------------------------------------------------------------
    def _consumers(self, trainer) -> List[StatsConsumer]:
        return [cb for cb in trainer.callbacks if isinstance(cb, StatsConsumer)]

    def begin_batch(self, trainer, pl_module: nn.Module) -> None:
        """on_train_batch_start: start sampling if a consumer wants the optimizer step this batch belongs to."""
        step = trainer.global_step
        layers = self.layers(pl_module)
        if not self.forward_order and not self._order_hooks and layers:
            self._watch_order(layers)
        if self._active_step is not None:
            return  # a later micro-batch of a step already being sampled
        consumers = self._consumers(trainer)
        if not any(c.wants_stats(step) for c in consumers):
            return
        if self.sampler is None:
            self.sampler = LayerStatsSampler(max(c.sample_size for c in consumers))
        self.sampler.start({fqn: layer for fqn, layer in layers.items() if layer.fp8_enabled})
        self._active_step = step

    def end_batch(self, trainer) -> Optional[StatsRecord]:
        """on_train_batch_end: close the record when the optimizer step completed; returns this step's record (or
        None when this step was not sampled). Idempotent: every consumer may call it."""
        if self._order_hooks:
            self._finish_order()  # the first batch's forward has run every layer it runs
        if self._active_step is not None and trainer.global_step > self._active_step:
            logger_step = trainer.fit_loop.epoch_loop._batches_that_stepped
            self.record = self.sampler.finish(trainer.global_step, logger_step)
            self._active_step = None
        if self.record is not None and self.record.step == trainer.global_step:
            return self.record
        return None

    def abort(self) -> None:
        if self.sampler is not None:
            self.sampler.stop_observing()
        self._active_step = None
        self._finish_order()

    # forward order ---------------------------------------------------------------------------------------------
    def _watch_order(self, layers: Dict[str, FP8Linear]) -> None:
        self._order_seen = []

        def hook_for(fqn: str):
            def hook(module, args):
                if fqn not in self._order_seen:
                    self._order_seen.append(fqn)

            return hook

        self._order_hooks = [layer.register_forward_pre_hook(hook_for(fqn)) for fqn, layer in layers.items()]
        self._order_all = list(layers)

    def _finish_order(self) -> None:
        if not self._order_hooks:
            return
        for handle in self._order_hooks:
            handle.remove()
        self._order_hooks = []
        seen = list(self._order_seen)
        self.forward_order = seen + [fqn for fqn in self._order_all if fqn not in seen]

    def order_index(self, pl_module: nn.Module) -> Dict[str, int]:
        """Forward execution position of each FP8 layer (module order for layers not seen running)."""
        order = list(self.forward_order)
        for fqn in self.layers(pl_module):
            if fqn not in order:
                order.append(fqn)
        return {fqn: i for i, fqn in enumerate(order)}


_hubs: "weakref.WeakKeyDictionary[Any, StatsHub]" = weakref.WeakKeyDictionary()


def hub_for(trainer) -> StatsHub:
    hub = _hubs.get(trainer)
    if hub is None:
        hub = _hubs[trainer] = StatsHub()
    return hub


def layer_counters(layers: Dict[str, FP8Linear]) -> Dict[Tuple[str, str], Tuple[int, int]]:
    """(clip_count, overflow_count) of every (layer, role), in one device-to-host copy."""
    keys = [(fqn, role) for fqn in layers for role in ROLES]
    if not keys:
        return {}
    by_device: Dict[torch.device, List[int]] = {}
    tensors = []
    for i, (fqn, role) in enumerate(keys):
        state = getattr(layers[fqn].fp8_meta, role)
        tensors.append(torch.stack([state.clip_count, state.overflow_count]))
        by_device.setdefault(state.clip_count.device, []).append(i)
    values: List[Any] = [None] * len(keys)
    for indices in by_device.values():
        for i, row in zip(indices, torch.stack([tensors[i] for i in indices]).tolist()):
            values[i] = row
    return {key: (int(c), int(o)) for key, (c, o) in zip(keys, values)}


__all__ = [
    "HISTORY_FILENAME",
    "STATS",
    "StatsRecord",
    "LayerStatsSampler",
    "StatsHub",
    "StatsConsumer",
    "HistoryFile",
    "hub_for",
    "fp8_engine",
    "layer_counters",
    "precision_rows",
]
