"""FP8Precision for Lightning Fabric: `Fabric(plugins=lightning_fp8.fabric.FP8Precision())`.

Fabric drives the same FP8TrainingEngine as the Trainer plugin. `fabric.backward(loss)` scales the loss,
`fabric.clip_gradients(model, optimizer, max_norm=..., error_if_nonfinite=False)` unscales first (pass
error_if_nonfinite=False: a non-finite norm then skips the step instead of raising), and `optimizer.step()` goes
through the engine, which skips non-finite steps and rolls back. Save the plugin with your checkpoint
(`fabric.save(path, {"model": m, "optimizer": o, "fp8": plugin})`) to resume with the loss scaler, the counters and
every layer's FP8 metadata (scales, amax histories), which the model's own state_dict leaves out.

What Fabric shows a precision plugin, and so where an iteration starts and ends: a forward of the set-up model in
training mode (`forward_context`) and a backward (`pre_backward`) start one; the optimizers' steps
(`optimizer_step`) decide it, and it ends when every optimizer the engine knows has stepped, or at the next of those
boundaries, or at `fabric.save` (`state_dict`). Fabric never hands the plugin its optimizers or LR schedulers: the
engine meets each optimizer at its first step (then it joins the rollback snapshot with the state it had before that
step), and LR schedulers must be registered (`plugin.register_lr_scheduler(scheduler)`) to roll back with them.

Distributed training: with ModelParallelStrategy (FSDP2) the plugin converts the model with FP8 all-gather weights
before your parallelize function runs (see `_convert_before_parallelize`); resume a sharded checkpoint with
`lightning_fp8.fabric.load_checkpoint(fabric, path, state)`: `fabric.load` hands a sharded checkpoint's plugin state
back as a plain dict instead of loading it. With DDP and gradient_communication="fp8", call
`precision.setup_gradient_communication(model)` after `fabric.setup`: Fabric never shows a precision plugin its DDP
wrapper.
"""
from __future__ import annotations

import weakref
from typing import Any, ContextManager, Dict, Optional

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fp8.distributed.sharding import is_fsdp_sharded
from lightning_fp8.integrations.plugin_core import FP8PrecisionCore
from lightning_fp8.conversion.convert import precision_map
from lightning_fp8.conversion.summary import conversion_summary
from lightning_fp8.integrations._distributed import (
    adopt_tensor_parallel,
    prepare_for_sharding,
    register_gradient_communication,
    release_unsharded,
    warn_if_gathered_in_high_precision,
)


class FP8Precision(FP8PrecisionCore, Precision):
    """Fabric precision plugin: `Fabric(plugins=FP8Precision(...))`. Its arguments are `FP8PrecisionCore`'s (the same
    as the Trainer plugin's, `lightning_fp8.FP8Precision`), except that optimizer_state="fp8" is refused: Fabric sets
    up the optimizer you build, so build `lightning_fp8.optim.FP8AdamW` directly. fp8_all_gather and
    gradient_communication: see the module docstring for the calls they need under FSDP2 and DDP."""

    unsupported_options = {
        ("optimizer_state", "fp8"): "lightning_fp8.fabric.FP8Precision(optimizer_state='fp8') is not supported: Fabric "
                                    "sets up the optimizer you build, so build lightning_fp8.optim.FP8AdamW directly.",
    }

    def _set_up_framework(self) -> None:
        _convert_before_parallelize(self)  # at construction: before Fabric can set up a model with this plugin

    # the plugins log through Lightning's rank-zero utilities (the loggers Lightning configures; the rank its
    # strategies set), pointing at the same caller as a direct call would (one frame more: stacklevel 5, not 4)
    def _rank_zero_info(self, message: str) -> None:
        from lightning.fabric.utilities import rank_zero

        rank_zero.rank_zero_info(message, stacklevel=5)

    def _rank_zero_warn(self, message: str) -> None:
        from lightning.fabric.utilities import rank_zero

        rank_zero.rank_zero_warn(message, stacklevel=5)

    def register_lr_scheduler(self, *schedulers: Any) -> None:
        """Restore these LR schedulers with the model and the optimizers on a rollback. Fabric does not show the
        plugin the schedulers it sets up, so register each one, before training (without any, a rollback warns once
        that the schedule did not roll back)."""
        for scheduler in schedulers:
            self.engine.register_lr_scheduler(scheduler)

    def forward_context(self) -> ContextManager:
        # every forward of the set-up module runs inside it: a training one starts an iteration; an evaluation one
        # (module.eval()) runs in FP8 only with fp8_eval=True
        if self._module is not None and not getattr(self, "_parallel_adopted", False):
            self._adopt_parallel_module()
        training = self._module is not None and self._module.training
        return self._model_forward_context(training, training or self.fp8_eval)

    def convert_output(self, data: Any) -> Any:
        """Floating-point outputs of the set-up module in the default dtype (float32), as Fabric's own "bf16-mixed"
        returns them: a loss computed from them is computed in float32, whatever the last layer computed in."""
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    def _adopt_parallel_module(self) -> None:
        """Once, at the first forward (Fabric converts before the strategy's parallelize function runs, so the
        conversion summary could not show it): tensor parallelism's layers adopted (FP8 metadata local, the styles
        told gradient_communication) and reported."""
        self._parallel_adopted = True
        if adopt_tensor_parallel(self, self._module) or any(row.parallel for row in precision_map(self._module)):
            self._rank_zero_info("\n".join(["lightning_fp8: after the parallelize function:",
                                            *conversion_summary(self._module).tensor_parallel_lines()]))

    def pre_backward(self, tensor: Tensor, module: Optional[Module]) -> Tensor:
        self._check_distributed_setup()
        return self.engine.scale_loss(tensor)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self.engine.unscale_(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        result = {}

        def step() -> None:
            result["out"] = optimizer.step(**kwargs)

        self.engine.step(optimizer, step)
        return result.get("out")

    # -- distributed training --------------------------------------------------------------------------------------
    def setup_gradient_communication(self, model: Module) -> None:
        """With gradient_communication="fp8" under DDP: register the FP8 comm hook on the model `fabric.setup` returned
        (FSDP2 needs no call: the plugin installs the FP8 reduce-scatter on the sharded model at the first backward)."""
        module = getattr(model, "_forward_module", model)  # a _FabricModule's DDP wrapper
        self._fp8_comm_ready = register_gradient_communication(self, module)

    def _check_distributed_setup(self) -> None:
        """Once, at the first backward (Fabric has sharded or wrapped the model by then): under FSDP2 the FP8
        reduce-scatter (gradient_communication="fp8") and a warning if FP8 all-gather was not set up; under tensor
        parallelism alone nothing more (its styles reduce as the option says); under DDP an error naming the call
        gradient_communication="fp8" needs (the gradients would be reduced in BF16 instead)."""
        if getattr(self, "_distributed_checked", False) or self._module is None:
            return
        self._distributed_checked = True
        if is_fsdp_sharded(self._module):
            warn_if_gathered_in_high_precision(self, self._module)
            register_gradient_communication(self, self._module)
        elif adopt_tensor_parallel(self, self._module):
            pass  # tensor parallelism alone: lightning_fp8's styles reduce as gradient_communication says
        elif (self.options.gradient_communication == "fp8" and not getattr(self, "_fp8_comm_ready", False)
              and torch.distributed.is_available() and torch.distributed.is_initialized()
              and torch.distributed.get_world_size() > 1):
            self._distributed_checked = False
            raise RuntimeError(
                "lightning_fp8: gradient_communication='fp8' under DDP needs "
                "`precision.setup_gradient_communication(model)` after `model = fabric.setup(model)` (Fabric does not "
                "show a precision plugin its DDP wrapper)."
            )

    # state_dict / load_state_dict come from FP8PrecisionCore (first in the MRO): `fabric.save(path, {"fp8": plugin})`
    # stores and restores the engine state through them (Fabric's Stateful protocol).


def _convert_before_parallelize(plugin: "FP8Precision") -> None:
    """Make Fabric's ModelParallelStrategy convert for FSDP2 (FP8 all-gather weights) before the user's
    parallelize_fn, when its precision is an FP8 plugin. Fabric converts a module (`convert_module`) before
    `strategy.setup_module` calls parallelize_fn, but hands the precision plugin neither the strategy nor a call in
    between, and FP8 all-gather must be installed before fully_shard; so `setup_module` of that one class is wrapped
    while any FP8 plugin exists (installed with the first, removed when the last is garbage-collected), and does the
    extra step only for an FP8 plugin, whatever the mesh (the same rule as the Lightning plugin's configure_model):
    the parallelize function may apply tensor parallelism with torch's styles or lightning_fp8's, and / or
    fully_shard. Where it did not fully_shard, the weights are plain again afterwards."""
    from lightning.fabric.strategies import ModelParallelStrategy

    if _PATCH["plugins"] == 0:
        original = ModelParallelStrategy.setup_module

        def setup_module(self, module: Module) -> Module:
            precision = self.precision
            if not isinstance(precision, FP8PrecisionCore):
                return original(self, module)
            prepare_for_sharding(precision, module)
            module = original(self, module)
            release_unsharded(precision, module)
            return module

        setup_module.__wrapped__ = original  # type: ignore[attr-defined]
        ModelParallelStrategy.setup_module = setup_module
        _PATCH["original"] = original
    _PATCH["plugins"] += 1
    weakref.finalize(plugin, _release_parallelize_conversion)


#: the ModelParallelStrategy.setup_module wrapper: how many FP8 plugins use it, and the method it wraps
_PATCH: Dict[str, Any] = {"plugins": 0, "original": None}


def _release_parallelize_conversion() -> None:
    """One FP8 plugin fewer; after the last, ModelParallelStrategy.setup_module is Fabric's own again."""
    _PATCH["plugins"] -= 1
    if _PATCH["plugins"] == 0 and _PATCH["original"] is not None:
        from lightning.fabric.strategies import ModelParallelStrategy

        ModelParallelStrategy.setup_module = _PATCH["original"]
        _PATCH["original"] = None


def load_checkpoint(fabric: Any, path: Any, state: Dict[str, Any], **kwargs: Any) -> Dict[str, Any]:
    """`fabric.load(path, state, **kwargs)` that also restores the stateful objects of `state` (the FP8Precision
    plugin, LR schedulers: anything with `load_state_dict`).

    Why: Fabric's ModelParallelStrategy loads a sharded (distributed checkpoint) directory by replacing every entry of
    `state` that is neither a module nor an optimizer with the saved value, so `{"fp8": plugin}` comes back as the
    plugin's state dict and the plugin itself (loss scale, counters, every layer's FP8 scales) is never restored; an
    LR scheduler likewise. This loads each such object from what Fabric put in its place and puts the object back;
    with other strategies fabric.load has done it already and nothing changes."""
    stateful = {key: value for key, value in state.items() if callable(getattr(value, "load_state_dict", None))
                and not isinstance(value, (Module, Optimizer))}
    remainder = fabric.load(path, state, **kwargs)
    for key, obj in stateful.items():
        value = state[key]
        if value is not obj:
            if isinstance(value, dict):
                obj.load_state_dict(value)
            state[key] = obj
    return remainder
