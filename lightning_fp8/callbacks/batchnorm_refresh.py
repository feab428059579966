"""BatchNormRefresh: BatchNorm running statistics re-estimated with the current weights before validation, before
checkpoints and at the end of fit, and their lag logged while training.

Why (lightning_fp8/engine/batchnorm_stats.py, docs/numerics.md "Eval-mode quality"): at a constant or slowly decaying
learning rate the running statistics trail the weights, and eval mode (validation, early stopping, a checkpoint
evaluated later) scores below what the weights can: ResNet-18 on the digits, 40 seeds, 95.4 % (bf16-mixed) and
95.2 % (FP8) in eval mode, 97.6 % for both after re-estimation. It is BatchNorm's effect, not FP8's: the same
callback helps a bf16 run as much, and needs no FP8 layer.

What runs, exactly, at each refresh: on `num_batches` batches of a fresh iterator over the train dataloader (moved to
the device by the strategy), every module in eval mode but the BatchNorm layers, under torch.no_grad and the
precision plugin's validation context (FP8 evaluates in FP8, as validation does; FP8 layers record no amax), the
module's `training_step` (its `self.log` calls dropped, torchmetrics states, RNG streams and modes restored, as in
FP8Calibration) or `forward_fn`; then `refresh_batchnorm`'s cumulative average replaces the running statistics, and
across ranks they are averaged. No backward, no optimizer step: the training trajectory is the same as without the
callback (train mode normalises with batch statistics; the running ones only feed eval mode).

When: at `on_validation_start` of a fit's validation (not the sanity check), so validation metrics, early stopping
and the checkpoint ModelCheckpoint saves right after see current statistics; at a checkpoint saved without a
validation since the last optimizer step (`every_n_train_steps`, `trainer.save_checkpoint`), whose state_dict is
updated too; at `on_train_end`. Never twice for the same global step.

Logged: every `log_every_n_steps`-th training step (the trainer's, unless `check_every` is given), `batchnorm/lag`
(the largest `mean_shift` of a running mean from the batch's mean over the BatchNorm layers, before the batch updates
it) and `batchnorm/lag_layer_mean`; at each refresh `batchnorm/refresh_shift` (how far the replaced statistics were
from the re-estimated ones, largest layer) with the layer named in the log at INFO.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, Dict, Iterable, Optional

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
        self._watch: Optional[contextlib.ExitStack] = None

    # -- lag, while training ------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        every = trainer.log_every_n_steps if self.check_every is None else self.check_every
        if every and trainer.global_step % every == 0 and batchnorm_layers(pl_module):
            self._watch = contextlib.ExitStack()
            self._lag = self._watch.enter_context(watch_batchnorm_lag(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._watch is None:
            return
        self._watch.close()
        self._watch = None
        if self._lag:
            self.last_lag = dict(self._lag)
            values = list(self.last_lag.values())
            pl_module.log_dict({"batchnorm/lag": max(values), "batchnorm/lag_layer_mean": sum(values) / len(values)},
                               on_step=True, on_epoch=False)

    # -- refreshes ----------------------------------------------------------------------------------------------
    def on_validation_start(self, trainer, pl_module) -> None:
        if self.before_validation and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.refresh(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        if not self.before_checkpoint or self._refreshed_step == trainer.global_step:
            return
        if self.refresh(trainer, pl_module) is None:
            return
        saved = checkpoint.get("state_dict")
        if isinstance(saved, dict):  # taken before this hook: put the refreshed statistics in
            for name, layer in batchnorm_layers(pl_module).items():
                for buffer in ("running_mean", "running_var", "num_batches_tracked"):
                    key = f"{name}.{buffer}"
                    if key in saved:
                        saved[key] = getattr(layer, buffer).detach().clone()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.at_fit_end:
            self.refresh(trainer, pl_module)

    def refresh(self, trainer, pl_module) -> Optional[BatchNormRefreshResult]:
        """Re-estimate now (once per global step); returns the result, None when skipped (no BatchNorm layer, no
        batches)."""
        if self._refreshed_step == trainer.global_step or not batchnorm_layers(pl_module):
            return None
        loader = self.dataloader if self.dataloader is not None else train_iterable(trainer)
        if loader is None:
            log.warning("lightning_fp8: BatchNormRefresh skipped: no train dataloader")
            return None
        forward = self._forward(pl_module)
        plugin = getattr(trainer, "precision_plugin", None)
        context = getattr(plugin, "val_step_context", None) or contextlib.nullcontext
        counter = itertools.count()

        def batches():
            for batch in itertools.islice(iter(loader), self.num_batches):
                yield trainer.strategy.batch_to_device(batch)

        with preserved_state(pl_module, trainer, restore_batchnorm=False, loader=(loader, trainer.train_dataloader)):
            result = refresh_batchnorm(pl_module, batches(), lambda m, b: forward(m, b, next(counter)), context)
        if trainer.world_size > 1:
            for layer in batchnorm_layers(pl_module).values():
                for buffer in (layer.running_mean, layer.running_var):
                    buffer.copy_(trainer.strategy.reduce(buffer.detach().clone(), reduce_op="mean"))
        self._refreshed_step = trainer.global_step
        self.last_refresh = result
        worst = result.worst
        log.info("lightning_fp8: BatchNormRefresh re-estimated %d BatchNorm layers from %d batches at step %d; the "
                 "replaced statistics were off by a mean shift of up to %.3g (%s)", len(result.shift), result.batches,
                 trainer.global_step, result.shift[worst], worst)
        if trainer.is_global_zero:
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

    def state_dict(self) -> Dict[str, Any]:
        return {"refreshed_step": self._refreshed_step}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._refreshed_step = int(state_dict.get("refreshed_step", -1))
