"""What every FP8 adapter shares: conversion, the FP8 + autocast context, the engine, checkpoint state.

The Lightning and Fabric plugins inherit this mixin next to their framework's Precision base and only translate
hooks; the Accelerate adapter drives a bare instance (`FP8PrecisionCore.from_options`). Options are validated in
`_options.py`.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, Optional

import torch
from torch import nn

from lightning_fp8.conversion.convert import convert_to_fp8
from lightning_fp8.conversion.state import FP8_META_MARKER, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.conversion.summary import log_conversion_summary
from lightning_fp8.distributed.sharding import is_fsdp_sharded
from lightning_fp8.engine.engine import FP8TrainingEngine
from lightning_fp8.integrations._distributed import adopt_sharded_module, adopt_tensor_parallel, convert_for_fsdp
from lightning_fp8.integrations._options import FP8Options, resolve_compute_dtype
from lightning_fp8.modules.autocast import fp8_autocast
from lightning_fp8.presets import RecipeChoice
from lightning_fp8.recipe import FP8Recipe


class FP8PrecisionCore:
    """Shared behaviour of the FP8 adapters: conversion, the FP8 + autocast context, the engine, checkpoint state.

    Built from an `FP8Options` (the adapters' constructors spell the options out and pass them on)."""

    precision = "fp8-mixed"

    def _init_core(self, options: FP8Options) -> None:
        self.options = options
        #: the recipe and where it came from (recipe="auto": the device it was chosen for, and why)
        self.recipe_choice = options.recipe_choice()
        self.recipe = self.recipe_choice.recipe
        self.preset = options.preset
        self.module_filter = options.module_filter
        self.optimizer_state = options.optimizer_state
        self.optimizer_kwargs = dict(options.optimizer_kwargs or {})
        self.compute_dtype = resolve_compute_dtype(options.compute_dtype)
        self.fp8_eval = bool(options.fp8_eval)
        self.engine = FP8TrainingEngine(self.recipe, options.stability_config(), compute_dtype=self.compute_dtype)
        self._module: Optional[nn.Module] = None

    @classmethod
    def from_options(cls, options: FP8Options) -> "FP8PrecisionCore":
        """A bare core (no framework base class): what the Accelerate adapter drives."""
        core = cls.__new__(cls)
        core._init_core(options)
        return core

    # -- public counters ----------------------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def rollbacks(self) -> int:
        return self.engine.rollbacks

    @property
    def loss_scale(self) -> float:
        return self.engine.loss_scale

    # -- conversion and autocast --------------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert in place (some strategies ignore the return value); converting twice is a no-op."""
        if self.options.backend == "transformer_engine":
            return self._convert_module_te(module)
        if is_fsdp_sharded(module):  # FSDP2: converted before fully_shard (convert_for_fsdp), nothing to replace now
            return adopt_sharded_module(self, module)
        module = convert_to_fp8(module, self.recipe, self.module_filter, layer_recipes=self.options.layer_recipes,
                                verbose=False)
        if module is not self._module:  # the conversion summary, once per model, through Lightning's rank-zero logging
            from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

            log_conversion_summary(module, info=rank_zero_info, warn=rank_zero_warn, note=self.recipe_note())
        exclude_fp8_meta_from_ddp_broadcast(module)
        adopt_tensor_parallel(self, module)
        self._module = module
        self.engine.attach(module)
        return module

    def recipe_note(self) -> Optional[str]:
        """The conversion summary's line on the recipe: what recipe="auto" chose, for which device, and why."""
        return self.recipe_choice.describe() if self.options.recipe == "auto" else None

    def _convert_module_te(self, module: nn.Module) -> nn.Module:
        """backend="transformer_engine": nn.Linear layers become te.Linear (backends/transformer_engine.py); the engine
        runs loss scaling, skip and rollback on top, and says once what it cannot see inside TE layers."""
        from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

        from lightning_fp8.backends.transformer_engine import convert_for_plugin

        if is_fsdp_sharded(module):
            raise NotImplementedError(
                "lightning_fp8: backend='transformer_engine' under FSDP2 is not supported by the plugins (TE's layers "
                "and their FP8 all-gather are set up through TE itself); use backend='lightning_fp8' with FSDP2."
            )
        if module is not self._module:
            convert_for_plugin(module, self.recipe, self.module_filter)
            log_conversion_summary(module, info=rank_zero_info, warn=rank_zero_warn)
            rank_zero_warn(
                "lightning_fp8: backend='transformer_engine': te.Linear layers keep their own FP8 scales (TE's "
                "amax histories, reduced across ranks by te.autocast). Loss scaling, skipped steps and rollback of "
                "the weights and optimizers are lightning_fp8's; per-layer scale statistics (FP8ScaleMonitor), "
                "FP8LayerFallback, FP8Calibration and FP8 all-gather do not see inside TE layers, and a rollback does "
                "not restore TE's scaling state."
            )
        exclude_fp8_meta_from_ddp_broadcast(module)
        self._module = module
        self.engine.attach(module)
        return module

    def convert_for_fsdp(self, module: nn.Module) -> nn.Module:
        """Convert `module` for FSDP2 sharding: call it BEFORE `fully_shard` (in a LightningModule's configure_model, in
        Fabric's parallelize function). It converts as `convert_module` does and, with fp8_all_gather=True, makes
        FSDP2 all-gather the FP8 layers' weights in FP8 (docs/distributed.md). FSDP2 fixes the modules it shards,
        so a model sharded unconverted cannot be converted afterwards."""
        return convert_for_fsdp(self, module)

    def _device_type(self) -> str:
        if self._module is not None:
            for p in self._module.parameters():
                return p.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @contextlib.contextmanager
    def _fp8_context(self, fp8: bool) -> Iterator[None]:
        if self.options.backend == "transformer_engine":
            from lightning_fp8.backends.transformer_engine import te_autocast

            with torch.autocast(self._device_type(), dtype=self.compute_dtype), te_autocast(self.recipe, enabled=fp8):
                yield
            return
        with torch.autocast(self._device_type(), dtype=self.compute_dtype), fp8_autocast(enabled=fp8):
            yield

    def forward_context(self):
        return self._fp8_context(True)

    @contextlib.contextmanager
    def _model_forward_context(self, training: bool, fp8: bool) -> Iterator[None]:
        """Around a forward of the trained model: a training forward starts an iteration (the engine closes the
        previous one before this forward records amaxes); an evaluation forward records nothing and leaves it open."""
        if training:
            self.engine.begin_iteration()
        with self._fp8_context(fp8):
            yield

    # -- checkpoint state ---------------------------------------------------------------------------------------
    def state_dict(self, settle: bool = True) -> Dict[str, Any]:
        """Engine state (loss scaler, counters, events) and every FP8 layer's metadata (`fp8_state_dict`), which the
        model's own state_dict leaves out. An open iteration is closed first: a checkpoint holds whole iterations.

        settle: also check the weights the last step wrote (`engine.settle`: a rollback if they are not finite) -
        one collective, so only where every rank asks for the state, as Lightning's and Fabric's checkpoints do
        (`trainer.save_checkpoint` and `fabric.save` run on every rank). transformers' Trainer saves `scaler.pt`
        on the main process alone: that path (accelerate/checkpoint.py) passes False."""
        if settle:
            self.engine.settle()
        else:
            self.engine.end_iteration()
        state: Dict[str, Any] = {"engine": self.engine.state_dict(), "preset": self.preset}
        if self.options.recipe == "auto":
            state["auto_recipe"] = self.recipe_choice.to_dict()
        if self._module is not None:
            state["fp8_meta"] = fp8_state_dict(self._module)
            state["layer_recipes"] = layer_recipe_state(self._module)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict["engine"])
        saved_recipe = FP8Recipe.from_dict(state_dict["engine"]["recipe"])
        if saved_recipe != self.recipe:
            warnings.warn(
                f"lightning_fp8: the checkpoint was trained with {saved_recipe}, this run uses {self.recipe}; "
                "the scaling state is loaded as it is."
            )
        saved_auto = state_dict.get("auto_recipe")
        if saved_auto is not None and self.options.recipe == "auto":
            if saved_auto["device"] != self.recipe_choice.device:
                warnings.warn(f"lightning_fp8: the checkpoint's recipe='auto' chose {saved_auto['recipe']['scaling']} "
                              f"on {saved_auto['device']}; on {self.recipe_choice.device} it chooses "
                              f"{self.recipe.scaling}: the run resumes with the checkpoint's recipe for every layer")
            # the layers run the checkpoint's choice from here on: the next checkpoint records that choice, not
            # the one this device would have made
            self.recipe_choice = RecipeChoice(FP8Recipe.from_dict(saved_auto["recipe"]), saved_auto["device"],
                                              saved_auto["reason"])
        # each layer's recipe first: adopting it resizes the amax history to the saved length, which the saved
        # history then fills (the other order cut the saved history to this run's length, then padded it with zeros)
        if self._module is not None and state_dict.get("layer_recipes"):
            load_layer_recipe_state(self._module, state_dict["layer_recipes"])
        meta = state_dict.get("fp8_meta")
        if meta and self._module is not None:
            load_fp8_state_dict(self._module, meta)
        self.engine.resync()


def layer_recipe_state(module: nn.Module) -> Dict[str, Dict[str, Any]]:
    """Every FP8 layer's recipe (what recipe="auto", per-layer recipes, the NVFP4 scope and FP8LayerFallback's
    escalations made of it), so a resumed run computes each layer as before."""
    from lightning_fp8.conversion.convert import fp8_layers

    return {fqn: layer.recipe.to_dict() for fqn, layer in fp8_layers(module).items()}


def load_layer_recipe_state(module: nn.Module, saved: Dict[str, Dict[str, Any]]) -> None:
    from lightning_fp8.conversion.convert import fp8_layers

    for fqn, layer in fp8_layers(module).items():
        if fqn in saved:
            recipe = FP8Recipe.from_dict(saved[fqn])
            if recipe != layer.recipe:
                layer.recipe = recipe


def exclude_fp8_meta_from_ddp_broadcast(module: nn.Module) -> None:
    """Keep DistributedDataParallel from broadcasting rank 0's FP8 metadata before every forward.

    DDP copies rank 0's buffers to all ranks at each forward (broadcast_buffers=True). For the FP8 metadata that is
    wrong twice over: it overwrites each rank's overflow counters (the engine would see an overflow of rank 0 again
    on the other ranks a step later and skip a clean step), and under gradient accumulation it discards the amaxes
    the other ranks recorded in earlier micro-batches. The engine already keeps these buffers in agreement (an amax
    all-reduce per optimizer step), so DDP must leave them alone. Call before the module is wrapped.
    """
    from torch.nn.parallel import DistributedDataParallel

    names = [name for name, _ in module.named_buffers() if FP8_META_MARKER in f".{name}"]
    if names:
        existing = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(set(existing + names)))
