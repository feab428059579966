"""FP8Calibration: initialise every FP8 scale and amax history from a few real batches before the first optimizer step.

Without it training is still safe: a delayed-scaling state that has never seen an amax casts with current scaling
(the scale of the tensor being cast), and from the second step on the history holds one step. With it, the first
steps already use delayed scaling whose history holds `num_batches` representative amaxes, so an early batch with
larger activations than the first one does not clip.

What the pass does, at `on_train_start` (after the model is converted, after a checkpoint would have been restored,
after the sanity check), on `num_batches` batches of the train dataloader:

    with torch.no_grad(), fp8_autocast(calibrating=True):      # FP8Linear computes in high precision and records
        training_step(batch)                                   # input and weight amaxes into amax_history[0]
    engine.close_scaling_step()   (or each layer's close_scaling_step())  # new scale from the history, history rolled

once per batch, in train mode and under the precision plugin's autocast, so the amaxes are those training sees.
Closing each batch as one step makes the result exactly "delayed scaling with the calibration amaxes as history":
after N batches `amax_history[1:N+1]` holds the N per-batch amaxes (newest first), the scale is computed from them
by the recipe's rule (`amax_compute_algo`, `margin`), and `initialized` is set. The first training step then casts
with that scale and adds its own amax to the same history.

Gradients (`grad_output`) have no forward pass to calibrate on: they start with current scaling on the first step,
as without calibration.

What runs, exactly: the module's `training_step` (or `forward_fn`), once per calibration batch, `num_batches` times
in all, on every rank, before the first optimizer step; never on a resumed run, never when every scale is
initialised already (a second `fit`), never under current scaling; no backward, no optimizer, no callback hooks. The
batches come from a fresh iterator of the train dataloader, moved to the device by the strategy (the module's
`on_before_batch_transfer` / `transfer_batch_to_device` / `on_after_batch_transfer` run, as for training).

What is undone afterwards, so the run matches one without calibration except for the scales: the random number
generators (data order, dropout), BatchNorm running statistics, train/eval modes, the state of every torchmetrics
`Metric` in the module (a `self.train_acc(preds, y)` in the training step would otherwise count the calibration
batches in the epoch's accuracy); `self.log` / `self.log_dict` and direct `logger.log_metrics` calls are dropped; the
engine's overflow baseline is re-taken. What cannot be undone: other Python side effects of the training step
(appending to a list, a counter, a print, a file). Guard them with `if not is_calibrating(): ...` (this module), or
pass `forward_fn` to run something else than the training step.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import random
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torchmetrics import Metric

from lightning_fp8.modules.autocast import current_state, fp8_autocast
from lightning_fp8.callbacks.hub import fp8_engine, hub_for, warn_if_nothing_in_fp8
from lightning_fp8.conversion.convert import fp8_layers

log = logging.getLogger("lightning_fp8")

ForwardFn = Callable[[Any, Any, int], Any]


def is_calibrating() -> bool:
    """True while a calibration forward runs (FP8Calibration's pass, or any `fp8_autocast(calibrating=True)`).

    Use it in a `training_step` to keep side effects that FP8Calibration cannot undo out of the calibration pass:

        loss = ...
        if not is_calibrating():
            self.losses.append(loss.item())
    """
    return bool(current_state().calibrating)


class FP8Calibration(Callback):
    """Calibrate FP8 scales on `num_batches` training batches at the start of fit.

    Args:
        num_batches: batches to calibrate on (each is one entry of the amax history; more than the recipe's
            `amax_history_len` only keeps the newest).
        forward_fn: callable(pl_module, batch, batch_idx) running the model forward; default: the module's
            `training_step` (its `self.log` calls are dropped). Needed for manual optimization, whose training_step
            steps optimizers itself.
        dataloader: an iterable of batches to use instead of the trainer's train dataloader.
        force: calibrate even when resuming from a checkpoint or when every scale is initialised already.
    """

    def __init__(
        self,
        num_batches: int = 8,
        forward_fn: Optional[ForwardFn] = None,
        dataloader: Optional[Iterable] = None,
        force: bool = False,
    ) -> None:
        if not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
        self.num_batches = num_batches
        self.forward_fn = forward_fn
        self.dataloader = dataloader
        self.force = force
        #: batches the last pass used (0: no pass ran)
        self.calibrated_batches = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        warn_if_nothing_in_fp8(trainer, pl_module, type(self).__name__)

    def on_train_start(self, trainer, pl_module) -> None:
        self.calibrated_batches = 0
        layers = fp8_layers(pl_module)
        if not layers:
            return
        if not self.force:
            if getattr(trainer, "ckpt_path", None) is not None:
                log.info("lightning_fp8: FP8Calibration skipped: resuming from a checkpoint, whose scales are kept")
                return
            if all(layer.fp8_meta.input.initialized and layer.fp8_meta.weight.initialized for layer in layers.values()):
                log.info("lightning_fp8: FP8Calibration skipped: every FP8 scale is initialised already")
                return
        if all(layer.recipe.scaling != "delayed" for layer in layers.values()):
            log.info("lightning_fp8: FP8Calibration skipped: current scaling computes every scale from its own tensor")
            return
        forward = self.forward_fn or training_step_forward(pl_module)
        if forward is None:
            log.warning(
                "lightning_fp8: FP8Calibration skipped: with manual optimization pass forward_fn=(module, batch, idx) "
                "so calibration can run the model without stepping optimizers"
            )
            return
        loader = self.dataloader if self.dataloader is not None else train_iterable(trainer)
        if loader is None:
            log.warning("lightning_fp8: FP8Calibration skipped: no train dataloader")
            return
        engine = fp8_engine(trainer)
        plugin = getattr(trainer, "precision_plugin", None)
        step_context = getattr(plugin, "train_step_context", None)
        n = 0
        with preserved_state(pl_module, trainer, loader=(loader, trainer.train_dataloader)), torch.no_grad():
            pl_module.train()
            for batch_idx, batch in enumerate(itertools.islice(iter(loader), self.num_batches)):
                batch = trainer.strategy.batch_to_device(batch)
                with (step_context() if step_context is not None else contextlib.nullcontext()):
                    with fp8_autocast(calibrating=True):  # innermost: the plugin's context would reset it
                        forward(pl_module, batch, batch_idx)
                if engine is not None:
                    engine.close_scaling_step()  # all-reduces the amaxes across ranks, then updates every layer
                else:
                    for layer in layers.values():
                        layer.close_scaling_step()
                n += 1
        self.calibrated_batches = n
        log.info(
            "lightning_fp8: FP8Calibration initialised the scales of %d FP8 layers on %d batches (%s ran %d times under "
            "no_grad; see is_calibrating() to keep side effects out)",
            len(layers), n, "forward_fn" if self.forward_fn is not None else "training_step", n,
        )
        hub = hub_for(trainer)
        hub.write(trainer, {
            "type": "event", "source": "calibration", "step": trainer.global_step, "kind": "calibration",
            "reason": f"scales initialised from {n} batches", "layers": list(layers),
        })


def training_step_forward(pl_module) -> Optional[ForwardFn]:
    if not getattr(pl_module, "automatic_optimization", True):
        return None

    def forward(module, batch, batch_idx):
        return module.training_step(batch, batch_idx)

    return forward


def train_iterable(trainer) -> Optional[Iterable]:
    """The trainer's train dataloader(s) as one iterable of batches whose iterator is independent of the epoch's: a
    DataLoader with persistent workers hands every `iter()` the same worker iterator, reset (a second iterator
    during an epoch would cut the epoch short), so it is read through a twin without persistent workers."""
    loaders = trainer.train_dataloader
    if loaders is None:
        return None
    if isinstance(loaders, (list, tuple, dict)):
        from lightning.pytorch.utilities import CombinedLoader

        independent = ({k: _independent(v) for k, v in loaders.items()} if isinstance(loaders, dict)
                       else type(loaders)(_independent(v) for v in loaders))
        combined = CombinedLoader(independent, mode="max_size_cycle")
        return (item[0] for item in combined)
    return _independent(loaders)


def _independent(loader: Iterable) -> Iterable:
    """`loader`, or for a DataLoader with persistent workers the same loader (dataset, batching, sampler and its
    generator, collate, workers and their init, pinning) without them."""
    from torch.utils.data import DataLoader, IterableDataset

    if not (isinstance(loader, DataLoader) and loader.persistent_workers and loader.num_workers > 0):
        return loader
    kwargs = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                  prefetch_factor=loader.prefetch_factor, persistent_workers=False)
    if isinstance(loader.dataset, IterableDataset):
        return DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs)
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **kwargs)
    return DataLoader(loader.dataset, batch_size=None, sampler=loader.sampler, **kwargs)


def _metric_state(metric: Metric) -> Dict[str, Any]:
    """A copy of a torchmetrics Metric's accumulated state (its `add_state` values and update count)."""
    state: Dict[str, Any] = {}
    for name, value in metric.metric_state.items():
        state[name] = value.detach().clone() if isinstance(value, torch.Tensor) else [v.detach().clone() for v in value]
    for name in ("_update_count", "_computed", "_forward_cache"):  # what compute() and forward() read besides
        if hasattr(metric, name):
            state[name] = getattr(metric, name)
    return state


@contextlib.contextmanager
def preserved_state(pl_module: nn.Module, trainer, restore_batchnorm: bool = True, loader: Any = None):
    """Restore RNG streams (the global ones, and the generators `loader` and its samplers draw from: a new iterator
    of a shuffling DataLoader with `generator=` draws its permutation's seed from it, which would change the data
    order of the epochs that follow), BatchNorm statistics (unless `restore_batchnorm` is False: BatchNormRefresh
    keeps the statistics it estimated), torchmetrics states, train/eval modes and the module's log methods
    afterwards; drop logger writes in between."""
    generators = {g: g.get_state() for g in _generators_of(loader)}
    modes = {m: m.training for m in pl_module.modules()}
    metrics = {m: _metric_state(m) for m in pl_module.modules() if isinstance(m, Metric)}
    norms: Dict[nn.Module, List[torch.Tensor]] = {}
    for m in pl_module.modules() if restore_batchnorm else ():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            norms[m] = [b.detach().clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    dropped = lambda *args, **kwargs: None  # noqa: E731
    had = {name: name in vars(pl_module) for name in ("log", "log_dict")}
    previous = {name: vars(pl_module).get(name) for name in had}
    pl_module.log = dropped
    pl_module.log_dict = dropped
    loggers = {logger: vars(logger).get("log_metrics") for logger in getattr(trainer, "loggers", None) or []}
    for logger in loggers:
        logger.log_metrics = dropped  # an instance attribute over the class method, removed afterwards
    py_state = random.getstate()
    np_state = _numpy_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for generator, state in generators.items():
            generator.set_state(state)
        random.setstate(py_state)
        if np_state is not None:
            import numpy

            numpy.random.set_state(np_state)
        for name, present in had.items():
            if present:
                setattr(pl_module, name, previous[name])
            else:
                delattr(pl_module, name)
        for logger, own in loggers.items():
            if own is not None:
                logger.log_metrics = own
            else:
                del logger.log_metrics
        for metric, state in metrics.items():
            for name, value in state.items():
                setattr(metric, name, value)
        for m, training in modes.items():
            m.training = training
        for m, saved in norms.items():
            live = [b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
            for b, s in zip(live, saved):
                b.copy_(s)


def _generators_of(loader: Any) -> List[torch.Generator]:
    """The torch Generators a DataLoader (or a Lightning CombinedLoader's wrapped ones) and its samplers draw from."""
    found: List[torch.Generator] = []
    pending = [loader]
    while pending:
        obj = pending.pop()
        if obj is None:
            continue
        if isinstance(obj, (list, tuple)):
            pending.extend(obj)
            continue
        if isinstance(obj, dict):
            pending.extend(obj.values())
            continue
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
        for attr in ("sampler", "batch_sampler"):
            inner = getattr(obj, attr, None)
            if inner is not None and inner is not obj:
                pending.append(inner)
    return found


def _numpy_state():
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy.random.get_state()
