"""FP8Precision for the Lightning Trainer: `Trainer(plugins=FP8Precision())`.

A thin translation of Lightning's precision hooks into FP8TrainingEngine calls; the numerics and the stability logic
live in lightning_fp8.engine.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from lightning_fp8.conversion.filters import ModuleFilter
from lightning_fp8.engine.loss_scaler import LossScaling
from lightning_fp8.integrations._core import FP8PrecisionCore
from lightning_fp8.integrations._distributed import prepare_for_sharding, register_gradient_communication
from lightning_fp8.integrations._options import FP8Options, option_names
from lightning_fp8.recipe import FP8Recipe

_OPTION_NAMES = frozenset(option_names())


class FP8Precision(FP8PrecisionCore, Precision):
    """Train an unchanged LightningModule with its linear layers in FP8: `Trainer(plugins=FP8Precision())`.

    Args:
        recipe: an FP8Recipe (formats, scaling, which layers); "auto" (the recipe for the device's compute capability:
            mxfp8 on Blackwell, the per-tensor default elsewhere; docs/plugin.md); or
        preset: a named recipe: "default", "conservative", "mellempudi" (see lightning_fp8.presets).
        module_filter: callable(module, fqn) -> bool replacing the recipe's default layer filter.
        loss_scaling: "auto" (dynamic only where gradients can underflow), "dynamic", "none", or a static float.
            Steps with non-finite gradients are skipped in every mode.
        init_loss_scale: the dynamic loss scaler's first scale.
        growth_interval: clean iterations in a row after which the dynamic loss scale doubles.
        snapshot_every: iterations between snapshots of the last good state, the rollback targets.
        max_consecutive_skips: skipped iterations in a row that trigger a rollback.
        max_rollbacks: rollbacks allowed within `rollback_window` steps before training stops with an error.
        rollback_window: the window (iterations) `max_rollbacks` counts over.
        spike_factor: roll back when the loss exceeds this multiple of its running mean (None: off).
        spike_window: good iterations the running mean of the loss covers.
        spike_warmup: losses needed before the spike rule can fire.
        check_weights_every: iterations between checks that every weight is finite.
        optimizer_state: "fp32" (the user's optimizer as it is) or "fp8" (Adam/AdamW become FP8AdamW).
        optimizer_kwargs: FP8AdamW storage options used with optimizer_state="fp8".
        compute_dtype: "bf16" or "fp16": the autocast dtype of everything that is not an FP8 GEMM.
        fp8_eval: run validation / test / predict in FP8 too (True) or in compute_dtype (False).
        layer_recipes: {fnmatch pattern of layer names: FP8Recipe}, first match wins: layers that compute with another
            recipe than `recipe` (e.g. {"*.attn.*": FP8Recipe(scaling="rowwise")}); `layer.recipe` is each layer's.
        fp8_all_gather: with FSDP2 (ModelParallelStrategy), all-gather FP8 layers' weights in FP8: half the bytes of
            a BF16 all-gather. The plugin converts the model before configure_model's fully_shard (a model built
            inside configure_model: call `self.trainer.precision_plugin.convert_for_fsdp(module)` there first;
            docs/distributed.md).
        gradient_communication: "bf16" (the strategy's own gradient reduction, in high precision) or "fp8" (gradients
            reduced in FP8 with a scale shared across ranks: a DDP comm hook, or FSDP2's reduce-scatter; half the
            bytes of BF16).
        backend: "lightning_fp8" (this library's FP8 layers) or "transformer_engine" (NVIDIA TE's te.Linear and
            te.autocast with the same recipe; loss scaling, skip and rollback stay the engine's; docs/plugin.md).

    Attributes `skipped_steps`, `rollbacks` and `loss_scale` are logged as fp8/* metrics and saved in checkpoints.
    Counts are in iterations: one backward (or several, accumulated) and a step of every optimizer, whatever their
    number (docs/plugin.md, "Iterations"); a rollback restores the model, every optimizer and every LR scheduler.
    """

    def __init__(
        self,
        recipe: Optional[Union[FP8Recipe, str]] = None,
        *,
        preset: Optional[str] = None,
        module_filter: Optional[ModuleFilter] = None,
        loss_scaling: LossScaling = "auto",
        init_loss_scale: float = 2.0**8,
        growth_interval: int = 1000,
        snapshot_every: int = 50,
        max_consecutive_skips: int = 10,
        max_rollbacks: int = 3,
        rollback_window: int = 1000,
        spike_factor: Optional[float] = None,
        spike_window: int = 50,
        spike_warmup: int = 20,
        check_weights_every: int = 1,
        optimizer_state: str = "fp32",
        optimizer_kwargs: Optional[Dict[str, Any]] = None,
        compute_dtype: Union[str, torch.dtype] = "bf16",
        fp8_eval: bool = True,
        layer_recipes: Optional[Dict[str, FP8Recipe]] = None,
        fp8_all_gather: bool = True,
        gradient_communication: str = "bf16",
        backend: str = "lightning_fp8",
    ) -> None:
        self._init_core(FP8Options(**{name: value for name, value in locals().items() if name in _OPTION_NAMES}))
        # Lightning's ModelSummary knows the bit widths of its own precision names only and warns for any other that
        # it counts 32 bits per parameter instead; an FP8 run's parameters are float32 masters, so the estimate is
        # right and the warning is noise (the message names this precision exactly, nothing else is filtered)
        warnings.filterwarnings("ignore", message=rf"Precision {self.precision} is not supported by the model summary",
                                category=UserWarning)

    # -- FSDP2: conversion before configure_model's fully_shard ---------------------------------------------------
    @contextlib.contextmanager
    def module_init_context(self) -> Iterator[None]:
        """Lightning enters this around `configure_model` (and `trainer.init_module()`). Under ModelParallelStrategy
        the documented FSDP2 pattern calls fully_shard inside configure_model, after which no layer can be replaced;
        so right before Lightning calls the hook, the model is converted with FP8 all-gather weights (see
        `_before_configure_model`). Lightning hands a precision plugin no model here: the call is recognised by
        wrapping, for this context only, the function Lightning calls the hook through
        (lightning.pytorch.trainer.call._call_lightning_module_hook, the call of `_call_configure_model`)."""
        from lightning.pytorch.trainer import call

        original = call._call_lightning_module_hook

        def call_hook(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
            if hook_name == "configure_model":
                self._before_configure_model(trainer)
            return original(trainer, hook_name, *args, **kwargs)

        with super().module_init_context():
            call._call_lightning_module_hook = call_hook
            try:
                yield
            finally:
                call._call_lightning_module_hook = original

    def _before_configure_model(self, trainer: Any) -> None:
        """Under ModelParallelStrategy with data parallelism only (FSDP2; tensor parallelism with FP8 layers is not
        supported), convert the LightningModule's layers with FP8 all-gather weights before the user's fully_shard."""
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, ModelParallelStrategy):
            return
        mesh = strategy.device_mesh
        if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            return
        prepare_for_sharding(self, trainer.lightning_module)

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
        # inside training_step: the iteration ends with the context at the latest (see docs/plugin.md)
        if self.engine.begin_iteration():  # an optimizer stepped after the previous training_step returned
            self._log_counters(self._module)
        with self._fp8_context(True):
            yield
        if self.engine.end_iteration():
            self._log_counters(self._module)

    @contextlib.contextmanager
    def val_step_context(self) -> Iterator[None]:
        self.engine.settle()  # evaluate checked weights (a read at the first batch after training, none after)
        with self._fp8_context(self.fp8_eval):
            yield

    @contextlib.contextmanager
    def test_step_context(self) -> Iterator[None]:
        self.engine.settle()
        with self._fp8_context(self.fp8_eval):
            yield

    @contextlib.contextmanager
    def predict_step_context(self) -> Iterator[None]:
        self.engine.settle()
        with self._fp8_context(self.fp8_eval):
            yield

    # -- optimizers ---------------------------------------------------------------------------------------------
    def connect(self, model: nn.Module, optimizers: List[Optimizer], lr_schedulers: List[Any]) -> Tuple[nn.Module, List[Optimizer], List[Any]]:
        register_gradient_communication(self.options, model)  # "fp8": DDP's comm hook / FSDP2's reduce-scatter
        if self.optimizer_state == "fp8":
            optimizers = [self._to_fp8_optimizer(opt, lr_schedulers) for opt in optimizers]
        # every optimizer and LR scheduler of the run: one iteration steps them all, a rollback restores them all
        self.engine.track(optimizers, [config.scheduler for config in lr_schedulers])
        return model, optimizers, lr_schedulers

    def _to_fp8_optimizer(self, optimizer: Optimizer, lr_scheduler_configs: List[Any]) -> Optimizer:
        from lightning_fp8.optim import rebind_lr_schedulers, to_fp8_optimizer, unsupported_optimizer_message

        new = to_fp8_optimizer(optimizer, **self.optimizer_kwargs)
        if new is None:
            rank_zero_warn(unsupported_optimizer_message(optimizer))
            return optimizer
        rebind_lr_schedulers([config.scheduler for config in lr_scheduler_configs], optimizer, new)
        self.engine.replace_optimizer(optimizer, new)
        return new

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


__all__ = ["FP8Precision"]
