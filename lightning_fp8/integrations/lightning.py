"""FP8Precision for the Lightning Trainer: `Trainer(plugins=FP8Precision())`.

A thin translation of Lightning's precision hooks into FP8TrainingEngine calls; the numerics and the stability logic
live in lightning_fp8.engine. The plugin is the Fabric plugin with Lightning's Precision in front of it, as Lightning's
own TransformerEnginePrecision is built on Fabric's: its arguments are `FP8PrecisionCore`'s.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, List, Tuple

from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from lightning_fp8.integrations.plugin_core import FP8PrecisionCore
from lightning_fp8.integrations.linear_builder import set_fp8_all_gather
from lightning_fp8.integrations._distributed import (
    prepare_for_sharding,
    register_gradient_communication,
    release_unsharded,
)
from lightning_fp8.integrations.fabric_plugin import FP8Precision as FabricFP8Precision


class FP8Precision(Precision, FabricFP8Precision):
    """Train an unchanged LightningModule with its linear layers in FP8: `Trainer(plugins=FP8Precision())`.

    The arguments are those of `FP8PrecisionCore.__init__` (recipe, preset, module_filter, loss_scaling and the
    stability knobs, optimizer_state, compute_dtype, fp8_eval, layer_recipes, fp8_all_gather, gradient_communication,
    backend); optimizer_state="fp8" is supported here (the plugin swaps Adam / AdamW for FP8AdamW when Lightning
    connects the optimizers).

    Attributes `skipped_steps`, `rollbacks` and `loss_scale` are logged as fp8/* metrics and saved in checkpoints.
    Counts are in iterations: one backward (or several, accumulated) and a step of every optimizer, whatever their
    number; a rollback restores the model, every optimizer and every LR scheduler.

    Method resolution: FP8Precision, Lightning's Precision, the Fabric FP8Precision, FP8PrecisionCore, Fabric's
    Precision. Lightning's Precision comes before the Fabric plugin, so every Lightning hook the Fabric plugin also
    defines (pre_backward, optimizer_step) is overridden here; of the Fabric plugin's own hooks, the ones Lightning's
    flow must not get are set back below (forward_context: the FP8 context, without Fabric's start of an iteration).
    """

    unsupported_options = {}  # the Trainer shows the plugin its optimizers: optimizer_state="fp8" works here
    # first / last: the LightningModule's example_input_array (or the plugin's example_input) is traced at conversion;
    # its training_step need not call the module's own forward, so its first forward decides nothing
    trace_first_forward = False

    # hooks of the Fabric plugin that Lightning's flow keeps as they were: forward_context (Fabric's starts an
    # iteration; here convert_input / train_step_context do, and the model summary's forward runs in it),
    # convert_output (Fabric's returns float32; here outputs come back as the step computed them), unscale_gradients
    # (here optimizer_step unscales, once per iteration)
    forward_context = FP8PrecisionCore.forward_context
    convert_output = FabricPrecision.convert_output
    unscale_gradients = FabricPrecision.unscale_gradients

    def _set_up_framework(self) -> None:
        # Lightning's ModelSummary knows the bit widths of its own precision names only and warns for any other that
        # it counts 32 bits per parameter instead; an FP8 run's parameters are float32 masters, so the estimate is
        # right and the warning is noise (the message names this precision exactly, nothing else is filtered)
        warnings.filterwarnings("ignore", message=rf"Precision {self.precision} is not supported by the model summary",
                                category=UserWarning)

    # -- ModelParallelStrategy: conversion before configure_model's sharding code ----------------------------------
    @contextlib.contextmanager
    def module_init_context(self) -> Iterator[None]:
        """Lightning enters this around `configure_model` (only there: `trainer.init_module()` enters the precision's
        `tensor_init_context`). Two things happen inside:

        - `torch.nn.Linear` builds FP8 layers (FP8PrecisionCore.module_init_context, as Lightning's
          TransformerEnginePrecision builds te.Linear): a model built *inside* configure_model and sharded there is
          in FP8, with FP8 all-gather weights under ModelParallelStrategy, and the conversion rules decide its layers
          at the strategy's conversion after the hook (integrations/linear_builder.py);
        - under ModelParallelStrategy (FSDP2, tensor parallelism, both) the model the LightningModule holds already
          (built in __init__, on the meta device under `trainer.init_module(empty_init=True)`) is converted with FP8
          all-gather weights right before the hook runs, so the user's fully_shard and tensor-parallel plan (torch's
          styles or lightning_fp8's) meet FP8 layers; where FSDP2 did not shard after all, the FP8 all-gather weights
          are plain again after the hook (`_around_configure_model`).

        Lightning hands a precision plugin no model here: the call is recognised by wrapping, for this context only,
        the function Lightning calls the hook through (lightning.pytorch.trainer.call._call_lightning_module_hook,
        the call of `_call_configure_model`)."""
        from lightning.pytorch.trainer import call

        original = call._call_lightning_module_hook

        def call_hook(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
            if hook_name != "configure_model":
                return original(trainer, hook_name, *args, **kwargs)
            with self._around_configure_model(trainer):
                return original(trainer, hook_name, *args, **kwargs)

        with super().module_init_context():
            call._call_lightning_module_hook = call_hook
            try:
                yield
            finally:
                call._call_lightning_module_hook = original

    @contextlib.contextmanager
    def _around_configure_model(self, trainer: Any) -> Iterator[None]:
        """Under ModelParallelStrategy: convert the LightningModule's layers with FP8 all-gather weights before the
        hook, build new linear layers with FP8 all-gather weights during it, and after it give plain weights back
        where FSDP2 did not shard. The conversion summary waits for the strategy's conversion after the hook, which
        sees how the user's code split the layers (one summary per run)."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        if not isinstance(trainer.strategy, ModelParallelStrategy):
            yield
            return
        module = trainer.lightning_module
        self._summary_deferred = True
        try:
            prepare_for_sharding(self, module)
            set_fp8_all_gather(self.options.fp8_all_gather and self.options.backend == "lightning_fp8")
            yield
            release_unsharded(self, module)
        finally:
            self._summary_deferred = False

    # -- contexts: FP8 + autocast around every step (evaluation in FP8 only with fp8_eval) ------------------------
    def convert_input(self, data: Any) -> Any:
        # Lightning converts each training batch before the batch's callbacks run (LearningRateMonitor logs there):
        # the earliest point where the plugin sees a new iteration, so the schedule a rollback restored is already
        # back in place when anything reads it (evaluation batches pass here too: nothing is open then)
        self.engine.begin_iteration()
        return super().convert_input(data)

    @contextlib.contextmanager
    def train_step_context(self) -> Iterator[None]:
        # Lightning runs every training_step inside this context, and manual optimization steps its optimizers
        # inside training_step: the iteration ends with the context at the latest
        if self.engine.begin_iteration():  # an optimizer stepped after the previous training_step returned
            self._log_counters(self._module)
        with self._fp8_context(True):
            yield
        if self.engine.end_iteration():
            self._log_counters(self._module)

    @contextlib.contextmanager
    def _evaluation_step_context(self) -> Iterator[None]:
        """Around every validation, test and predict step: the weights evaluated are checked ones (a read at the
        first batch after training, none after), FP8 as fp8_eval says."""
        self.engine.settle()
        with self._fp8_context(self.fp8_eval):
            yield

    val_step_context = test_step_context = predict_step_context = _evaluation_step_context

    # -- optimizers ---------------------------------------------------------------------------------------------
    def connect(self, model: nn.Module, optimizers: List[Optimizer], lr_schedulers: List[Any]) -> Tuple[nn.Module, List[Optimizer], List[Any]]:
        register_gradient_communication(self, model)  # "fp8": DDP's comm hook / FSDP2's reduce-scatter
        if self.optimizer_state == "fp8":
            schedulers = [config.scheduler for config in lr_schedulers]
            optimizers = [self.to_fp8_optimizer(opt, schedulers) for opt in optimizers]
        # every optimizer and LR scheduler of the run: one iteration steps them all, a rollback restores them all
        self.engine.track(optimizers, [config.scheduler for config in lr_schedulers])
        return model, optimizers, lr_schedulers

    # -- backward and step --------------------------------------------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        tensor = self.engine.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("FP8Precision does not support LBFGS: it must evaluate the closure itself.")
        closure_result = closure()
        if closure_result is None and getattr(model, "automatic_optimization", True):
            self.engine.skip_step()  # training_step returned None: Lightning skips backward, nothing to apply
            return None
        self.engine.unscale_(optimizer)  # the iteration's gradients, once (a second optimizer finds them unscaled)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping on unscaled grads
        self.engine.step(optimizer, lambda: optimizer.step(**kwargs))  # the iteration's decision, for every optimizer
        self._log_counters(model)
        return closure_result

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.engine.clip_grad_value_(optimizer, clip_val)
        else:
            self.engine.clip_grad_norm_(optimizer, clip_val)

    def _log_counters(self, model: Any) -> None:
        if model is None:
            return
        log_dict = getattr(model, "log_dict", None)
        trainer = getattr(model, "_trainer", None)
        if log_dict is None or trainer is None:
            return
        log_dict(self.engine.metrics(), on_step=True, on_epoch=False, prog_bar=False, logger=bool(trainer.loggers))

    # Checkpoints: Lightning stores `state_dict()` (engine state and every layer's FP8 metadata, see
    # FP8PrecisionCore.state_dict) under the plugin's entry and hands it back to `load_state_dict` after
    # `convert_module`. The model's own state_dict has no FP8 entries, so every checkpoint loads into the plain model
    # as well (LightningModule.load_from_checkpoint, weights-only checkpoints).
