"""BatchNormRefresh: BatchNorm running statistics re-estimated with the current weights before validation, before
checkpoints and at the end of fit, and their lag logged while training.

Why (lightning_fp8/engine/batchnorm_stats.py, docs/numerics.md "Eval-mode quality"): at a constant or slowly decaying
learning rate the running statistics trail the weights, and eval mode (validation, early stopping, a checkpoint
evaluated later) scores below what the weights can: ResNet-18 on the digits, 40 seeds, 95.4 % (bf16-mixed) and
95.2 % (FP8) in eval mode, 97.6 % for both after re-estimation. It is BatchNorm's effect, not FP8's: the same
callback helps a bf16 run as much, and needs no FP8 layer.

What runs, exactly, at each refresh: on `num_batches` batches of a fresh iterator over the train dataloader (moved to
the device by the strategy and converted by the precision plugin, as training's are), every module in eval mode but
the BatchNorm layers that training ran in train mode (a layer kept in eval mode, a frozen backbone's, keeps its
statistics), under torch.no_grad and the precision plugin's validation context (FP8 evaluates in FP8, as validation
does; FP8 layers record no amax), the module's `training_step` (its `self.log` calls dropped, torchmetrics states,
RNG streams and modes restored, as in FP8Calibration) or `forward_fn`; then `refresh_batchnorm`'s cumulative average
replaces the running statistics, and across ranks they are averaged (one all-reduce). No backward, no optimizer step:
the training trajectory is the same as without the callback (train mode normalises with batch statistics; the
running ones only feed eval mode).

When: at `on_validation_start` of a fit's validation (not the sanity check), so validation metrics, early stopping
and the checkpoint ModelCheckpoint saves right after see current statistics; at a checkpoint saved without a
refresh since the last optimizer step (`every_n_train_steps`, `trainer.save_checkpoint`), whose state_dict is
updated too (also a strategy's copy, keys with a wrapper prefix included); at `on_train_end`. Never twice for the
same global step, never before the first training step, never for a checkpoint saved because the run stopped (an
exception, Ctrl-C). Lightning does not call callbacks for weights-only checkpoints (`save_weights_only=True`): those
keep the statistics of the last refresh.

Logged, to the loggers at the step measured: every `log_every_n_steps`-th optimizer step (the trainer's, unless
`check_every` is given), `batchnorm/lag` (the largest `mean_shift` of a running mean from the batch's mean over the
BatchNorm layers, before the batch updates it) and `batchnorm/lag_layer_mean`; at each refresh
`batchnorm/refresh_shift` (how far the replaced statistics were from the re-estimated ones, largest layer), with the
layer named in the log at INFO.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, Dict, Iterable, Optional, Set

import torch

from lightning.pytorch.callbacks import Callback

from lightning_fp8.engine.batchnorm_stats import (
    BatchNormRefreshResult, batchnorm_layers, default_forward, refresh_batchnorm, watch_batchnorm_lag,
)
from lightning_fp8.callbacks.calibration import preserved_state, train_iterable, training_step_forward

log = logging.getLogger("lightning_fp8")

#: forward_fn(pl_module, batch, batch_idx), as FP8Calibration's
ForwardFn = Callable[[Any, Any, int], Any]

#: batches averaged per refresh by default: detectron2's PreciseBN default (200 iterations); a cumulative average
#: over that many batches is within about 1/sqrt(200 x batch) of the full training set's statistics
DEFAULT_NUM_BATCHES = 200


class BatchNormRefresh(Callback):
    """Re-estimate BatchNorm running statistics before validation, before checkpoints and at the end of fit.

    Args:
        num_batches: training batches averaged per refresh (fewer when the dataloader is shorter).
        forward_fn: callable(pl_module, batch, batch_idx) running the model; default: the module's `training_step`
            (with automatic optimization), else `pl_module(batch[0])` / `pl_module(**batch)`.
        dataloader: an iterable of batches to use instead of the trainer's train dataloader.
        before_validation, before_checkpoint, at_fit_end: which refreshes run.
        check_every: training steps between lag measurements; None: the trainer's `log_every_n_steps`; 0: never.
    """

    def __init__(
        self,
        num_batches: int = DEFAULT_NUM_BATCHES,
        forward_fn: Optional[ForwardFn] = None,
        dataloader: Optional[Iterable] = None,
        before_validation: bool = True,
        before_checkpoint: bool = True,
        at_fit_end: bool = True,
        check_every: Optional[int] = None,
    ) -> None:
        if not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
        if check_every is not None and (not isinstance(check_every, int) or check_every < 0):
            raise ValueError(f"check_every must be None (the trainer's log_every_n_steps), 0 (never) or an int >= 1, "
                             f"got {check_every!r}")
        self.num_batches = num_batches
        self.forward_fn = forward_fn
        self.dataloader = dataloader
        self.before_validation = before_validation
        self.before_checkpoint = before_checkpoint
        self.at_fit_end = at_fit_end
        self.check_every = check_every
        #: the last refresh's result (None before the first)
        self.last_refresh: Optional[BatchNormRefreshResult] = None
        #: the last lag measurement: BatchNorm layer -> mean_shift
        self.last_lag: Dict[str, float] = {}
        self._refreshed_step = -1
        self._measured_step = -1
        #: BatchNorm layers seen in train mode at a training step (None: no training step yet)
        self._trained_layers: Optional[Set[str]] = None
        self._watch: Optional[contextlib.ExitStack] = None
        self._lag: Dict[str, float] = {}

    # -- lag, while training ------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # a callback instance reused for another fit starts over (a resume restores its state)
            self._refreshed_step = -1
            self._trained_layers = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._close_watch()
        layers = batchnorm_layers(pl_module)
        # the layers training normalises with batch statistics: a layer the user keeps in eval mode (a frozen
        # backbone) keeps its statistics, and training through it stays as it was
        trained = {name for name, m in layers.items() if m.training}
        self._trained_layers = trained if self._trained_layers is None else self._trained_layers | trained
        every = trainer.log_every_n_steps if self.check_every is None else self.check_every
        if every and trainer.global_step % every == 0 and trainer.global_step != self._measured_step and trained:
            self._measured_step = trainer.global_step  # once per optimizer step (the first micro-batch)
            self._watch = contextlib.ExitStack()
            self._lag = self._watch.enter_context(watch_batchnorm_lag(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._watch is None:
            return
        self._close_watch()
        lag = {name: value for name, value in self._lag.items() if name in (self._trained_layers or ())}
        if lag:
            self.last_lag = lag
            values = list(lag.values())
            metrics = {"batchnorm/lag": max(values), "batchnorm/lag_layer_mean": sum(values) / len(values)}
            if trainer.is_global_zero:  # at the step it was measured (self.log would write it at the next logging step)
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=self._measured_step)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close_watch()
        if self.at_fit_end:
            self.refresh(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._close_watch()

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    # -- refreshes ----------------------------------------------------------------------------------------------
    def on_validation_start(self, trainer, pl_module) -> None:
        if self.before_validation and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.refresh(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        # not for a checkpoint saved because the run stopped (an exception, Ctrl-C: OnExceptionCheckpoint): 200
        # forwards and collectives at that moment could fail again or hang ranks that did not fail
        if not self.before_checkpoint or self._refreshed_step == trainer.global_step or trainer.interrupted:
            return
        if self.refresh(trainer, pl_module) is None:
            return
        saved = checkpoint.get("state_dict")
        if isinstance(saved, dict):  # taken before this hook; a strategy's copy gets the refreshed statistics too
            patch_state_dict(saved, pl_module, self.last_refresh.shift)

    def refresh(self, trainer, pl_module) -> Optional[BatchNormRefreshResult]:
        """Re-estimate now (once per global step); returns the result, None when skipped (no BatchNorm layer that
        training normalised with batch statistics, no training step yet, no batches)."""
        if self._refreshed_step == trainer.global_step or not self._trained_layers:
            return None
        loader = self.dataloader if self.dataloader is not None else train_iterable(trainer)
        if loader is None:
            log.warning("lightning_fp8: BatchNormRefresh skipped: no train dataloader")
            return None
        forward = self._forward(pl_module)
        plugin = getattr(trainer, "precision_plugin", None)
        context = getattr(plugin, "val_step_context", None) or contextlib.nullcontext
        convert = _input_conversion(plugin)
        counter = itertools.count()

        def batches():
            for batch in itertools.islice(iter(loader), self.num_batches):
                yield convert(trainer.strategy.batch_to_device(batch))

        try:
            with preserved_state(pl_module, trainer, restore_batchnorm=False,
                                 loader=(loader, trainer.train_dataloader)):
                result = refresh_batchnorm(pl_module, batches(), lambda m, b: forward(m, b, next(counter)), context,
                                           layers=self._trained_layers)
        except ValueError as error:  # no batches: the statistics stay as they were
            log.warning("lightning_fp8: BatchNormRefresh skipped: %s", error)
            return None
        if trainer.world_size > 1:
            refreshed = [layer for name, layer in batchnorm_layers(pl_module).items() if name in result.shift]
            flat = torch.cat([torch.cat([m.running_mean.float(), m.running_var.float()]) for m in refreshed])
            flat = trainer.strategy.reduce(flat, reduce_op="mean")
            offset = 0
            for m in refreshed:
                for buffer in (m.running_mean, m.running_var):
                    buffer.copy_(flat[offset:offset + buffer.numel()])
                    offset += buffer.numel()
        self._refreshed_step = trainer.global_step
        self.last_refresh = result
        worst = result.worst
        if trainer.is_global_zero:
            log.info("lightning_fp8: BatchNormRefresh re-estimated %d BatchNorm layers from %d batches at step %d; "
                     "the replaced statistics were off by a mean shift of up to %.3g (%s)", len(result.shift),
                     result.batches, trainer.global_step, result.shift[worst], worst)
            for logger in trainer.loggers:
                logger.log_metrics({"batchnorm/refresh_shift": result.shift[worst]}, step=trainer.global_step)
        return result

    def _forward(self, pl_module) -> ForwardFn:
        if self.forward_fn is not None:
            return self.forward_fn
        step = training_step_forward(pl_module)
        if step is not None:
            return step
        return lambda module, batch, batch_idx: default_forward(module, batch)

    def state_dict(self) -> Dict[str, Any]:  # (taken before on_save_checkpoint: a refresh there is not in it)
        return {"refreshed_step": self._refreshed_step}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._refreshed_step = int(state_dict.get("refreshed_step", -1))


def _input_conversion(plugin) -> Callable[[Any], Any]:
    """The precision plugin's input conversion, as Lightning's loops apply it (bf16-true / 16-true / 64-true cast
    floating inputs to the weights' dtype). Not FP8Precision's: its convert_input opens an engine iteration, and its
    inputs stay as they are."""
    from lightning_fp8.integrations.lightning import FP8Precision

    if plugin is None or isinstance(plugin, FP8Precision):
        return lambda batch: batch
    return plugin.convert_input


def patch_state_dict(saved: Dict[str, Any], pl_module, layers: Iterable[str]) -> int:
    """Write the refreshed statistics of `layers` into a state_dict a strategy copied; keys may carry a wrapper's
    prefix (`_forward_module.`, `module.`). Returns how many tensors were written; warns when a refreshed layer is
    found in none of the keys."""
    live = batchnorm_layers(pl_module)
    written = 0
    missing = []
    for name in layers:
        found = False
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            suffix = f"{name}.{buffer}"
            for key in [k for k in saved if k == suffix or k.endswith("." + suffix)]:
                value = saved[key]
                if isinstance(value, torch.Tensor) and value.shape == getattr(live[name], buffer).shape:
                    saved[key] = getattr(live[name], buffer).detach().clone().to(value.dtype)
                    written += 1
                    found = True
        if not found:
            missing.append(name)
    if missing:
        log.warning("lightning_fp8: BatchNormRefresh could not find %s in the checkpoint's state_dict: the checkpoint "
                    "keeps the statistics it was saved with for them", ", ".join(missing[:4]))
    return written
