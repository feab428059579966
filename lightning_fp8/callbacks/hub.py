"""StatsHub: the per-Trainer coordinator between the FP8 layers and the callbacks that read them.

One `StatsHub` per Trainer (`hub_for(trainer)`) sits between the FP8Linear layers and FP8ScaleMonitor /
FP8LayerFallback:

- on the optimizer steps some callback asked for (`StatsConsumer.wants_stats`), it starts a `LayerStatsSampler`
  (lightning_fp8/callbacks/sampling.py) for that one step and closes it afterwards, so the other steps pay nothing;
  every callback reads the same `StatsRecord`;
- it records the layers' forward execution order on the first step (FP8LayerFallback attributes an anomaly to the
  layer where it starts);
- it owns the history file (lightning_fp8/callbacks/history_file.py) the report reads;
- `publish_metrics` is how the callbacks' metrics reach the loggers and `trainer.callback_metrics`.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from lightning_fp8.callbacks.history_file import HISTORY_FILENAME, HistoryFile
from lightning_fp8.callbacks.sampling import LayerStatsSampler, StatsRecord
from lightning_fp8.conversion.convert import fp8_layers, precision_map
from lightning_fp8.modules.linear import FP8Linear
from lightning_fp8.numerics.stats import DEFAULT_SAMPLE_SIZE
from lightning_fp8.recipe import ROLES


def fp8_engine(trainer) -> Optional[Any]:
    """The FP8TrainingEngine of the trainer's precision plugin (None without FP8Precision)."""
    plugin = getattr(trainer, "precision_plugin", None)
    return getattr(plugin, "engine", None)


#: what a precision-map row of a model no FP8 plugin converted says in the history file (the map's preview says
#: what conversion *would* do; nothing of it ran)
NOT_CONVERTED = "not converted: this run has no FP8 plugin (Trainer(plugins=FP8Precision()))"


def precision_rows(model: nn.Module) -> List[Dict[str, str]]:
    """The precision map as the history file records it: what each layer computed in. On a model no conversion ran
    on, every row is BF16 (the map's preview of what conversion would do is said as such in the reason)."""
    rows = []
    for row in precision_map(model):
        precision, reason = row.precision, row.reason
        if row.preview:
            precision = "bf16"
            reason = f"{NOT_CONVERTED}; FP8Precision would convert it" if row.fp8 else (
                f"{NOT_CONVERTED}; {reason}")
        rows.append({"fqn": row.fqn, "precision": precision, "reason": reason,
                     **({"scaling": row.scaling} if row.scaling and precision == "fp8" else {}),
                     **({"recipe": row.recipe} if row.recipe and not row.preview else {})})
    return rows


def warn_if_nothing_in_fp8(trainer, pl_module, callback: str) -> None:
    """At fit start: an FP8 callback in a run where nothing computes in FP8 (no FP8 plugin, no FP8 layer) says so,
    once per Trainer for all of them, instead of reporting on layers that never ran in FP8."""
    if fp8_engine(trainer) is not None or fp8_layers(pl_module):
        return
    hub = hub_for(trainer)
    if hub.warned_no_fp8:
        return
    hub.warned_no_fp8 = True
    import warnings

    names = sorted({type(cb).__name__ for cb in getattr(trainer, "callbacks", []) if type(cb).__module__.startswith(
        "lightning_fp8.")} | {callback})
    warnings.warn(
        f"lightning_fp8: {', '.join(names)} {'is' if len(names) == 1 else 'are'} in this Trainer, but nothing in this "
        "run computes in FP8: the Trainer has no FP8 precision plugin and the model has no FP8 layers. Add "
        "`plugins=lightning_fp8.FP8Precision()` to the Trainer. (The FP8 history and report record every layer as "
        "BF16, not converted.)",
        UserWarning,
        stacklevel=2,
    )


class StatsConsumer:
    """Mixin of the callbacks that read StatsRecords: say which optimizer steps to sample."""

    sample_size: int = DEFAULT_SAMPLE_SIZE

    def wants_stats(self, step: int) -> bool:  # step: 0-based index of the optimizer step about to run
        return False


class StatsHub:
    """Per-Trainer coordinator (see the module docstring). Obtain it with `hub_for(trainer)`."""

    def __init__(self) -> None:
        #: whether `warn_if_nothing_in_fp8` has spoken for this Trainer
        self.warned_no_fp8 = False
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


def watched_metrics(trainer) -> Set[str]:
    """The fp8/* metric names something in the run watches through `trainer.callback_metrics`: the `monitor` of every
    callback that has one (ModelCheckpoint, EarlyStopping, ...) and of every LR scheduler config (ReduceLROnPlateau)."""
    monitors = [getattr(cb, "monitor", None) for cb in getattr(trainer, "callbacks", None) or []]
    monitors += [getattr(config, "monitor", None) for config in getattr(trainer, "lr_scheduler_configs", None) or []]
    return {m for m in monitors if isinstance(m, str) and m.startswith("fp8/")}


def publish_metrics(trainer, pl_module, metrics: Dict[str, float], step: int, callback_keys: Iterable[str] = ()) -> None:
    """Write `metrics` to every logger at `step` and put `callback_keys` (those of them present) into
    `trainer.callback_metrics`. Call it from a hook that may log per step (on_train_batch_end).

    Two paths, on purpose. The loggers get every metric directly (`logger.log_metrics`, what LearningRateMonitor
    does), at the step it was measured: Lightning's own path writes a `self.log` value only on its logging steps
    (`Trainer(log_every_n_steps)`) and then repeats it on every later row of the epoch, so a sampled statistic would
    land on the wrong row or look freshly measured when it is not. The metrics ModelCheckpoint / EarlyStopping /
    ReduceLROnPlateau watch go through `pl_module.log_dict(..., logger=False)`, Lightning's logging path, which is
    how they reach `trainer.callback_metrics`. Only the watched ones: every `self.log` name costs Python time per
    step, and a model with hundreds of FP8 layers has thousands of names. Values are CPU tensors (no device copy, no
    sync)."""
    keys = [key for key in callback_keys if key in metrics]
    if keys:
        pl_module.log_dict(
            {key: torch.tensor(float(metrics[key]), dtype=torch.float64) for key in keys},
            on_step=True, on_epoch=False, prog_bar=False, logger=False, sync_dist=False, batch_size=1,
        )
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
