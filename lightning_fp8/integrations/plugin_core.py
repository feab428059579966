"""What every FP8 adapter shares: the options, conversion, the FP8 + autocast context, the engine, checkpoint state.

`FP8PrecisionCore.__init__` is the one definition of the options (names, types, defaults, what each does): the Fabric
plugin adds Fabric's Precision to this class and the Lightning plugin adds Lightning's to the Fabric plugin, neither
with an `__init__` of its own, so both take exactly these arguments (what help(), IDEs and LightningCLI /
jsonargparse read). Records of the options are generated from the same signature (`options_dataclass`): `FP8Options`
(what an adapter was built with, `core.options`) and Accelerate's `FP8Kwargs`, whose adapter drives a bare core.
Validation: `_options.validate_options`. This module imports no framework.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from lightning_fp8.conversion.convert import (
    ExampleCall,
    convert_to_fp8,
    fp8_layers,
    keep_first_last_guess,
    provisional_layers,
    settle_first_last,
    settle_first_last_from_state,
)
from lightning_fp8.conversion.first_last import AUTO
from lightning_fp8.conversion.filters import ModuleFilter
from lightning_fp8.conversion.fp8_state import FP8_META_MARKER, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.conversion.summary import log_conversion_summary
from lightning_fp8.distributed.sharding import is_fsdp_sharded
from lightning_fp8.engine.config import StabilityConfig
from lightning_fp8.engine.engine import FP8TrainingEngine
from lightning_fp8.engine.loss_scaler import LossScaling
from lightning_fp8.integrations import _rank_zero
from lightning_fp8.integrations.linear_builder import constructing_fp8_layers, settle_built_layers, suspended
from lightning_fp8.integrations._distributed import adopt_sharded_module, adopt_tensor_parallel, convert_for_fsdp
from lightning_fp8.integrations._options import UnsupportedOptions, recipe_choice, resolve_compute_dtype, validate_options
from lightning_fp8.modules.autocast import current_state, fp8_autocast
from lightning_fp8.presets import RecipeChoice
from lightning_fp8.recipe import FP8Recipe
from lightning_fp8.state_format import format_version, stamped

#: the format version of the plugins' checkpoint state (`FP8PrecisionCore.state_dict`; lightning_fp8/state_format.py)
PLUGIN_STATE_VERSION = 1


class EngineCounters:
    """The counters every adapter shows (`skipped_steps`, `rollbacks`, `loss_scale`, in iterations), read from the
    engine `_counting_engine()` returns (None: nothing counted yet)."""

    def _counting_engine(self) -> Optional[FP8TrainingEngine]:
        raise NotImplementedError

    @property
    def skipped_steps(self) -> int:
        engine = self._counting_engine()
        return engine.skipped_steps if engine is not None else 0

    @property
    def rollbacks(self) -> int:
        engine = self._counting_engine()
        return engine.rollbacks if engine is not None else 0

    @property
    def loss_scale(self) -> float:
        engine = self._counting_engine()
        return engine.loss_scale if engine is not None else 1.0


class FP8PrecisionCore(EngineCounters):
    """Shared behaviour of the FP8 adapters: conversion, the FP8 + autocast context, the engine, checkpoint state.

    A framework's plugin is this class plus the framework's Precision base (integrations/fabric_plugin.py, lightning.py);
    the Accelerate adapter drives a bare instance (`FP8Kwargs.build_core()`)."""

    precision = "fp8-mixed"
    #: decide first / last at the model's first forward when conversion could not trace one (`example_input`); the
    #: Lightning plugin traces the LightningModule's example_input_array instead (its training_step need not call
    #: the module's forward)
    trace_first_forward: bool = True
    #: option values this adapter refuses although they are valid, {(option, value): message}; construction raises
    #: ValueError(message) (the Fabric plugin: optimizer_state="fp8")
    unsupported_options: UnsupportedOptions = {}

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
        example_input: Any = None,
    ) -> None:
        """FP8 training of an unchanged model: its linear layers compute in FP8, the engine keeps the run stable.

        Invalid values raise ValueError here, naming the valid choices.

        Args:
            recipe: an FP8Recipe (formats, scaling, which layers); "auto" (the recipe for the device's compute
                capability: mxfp8 on Blackwell, the per-tensor default elsewhere; logged in the conversion summary
                and kept in checkpoints); or None: the preset's. At most one of recipe and preset.
            preset: a named recipe: "default", "conservative", "mellempudi" (see lightning_fp8.presets).
            module_filter: callable(module, fqn) -> bool replacing the recipe's default layer filter.
            loss_scaling: "auto" (dynamic only where gradients can underflow), "dynamic", "none", or a static float
                (a numeric string, as a command line or a YAML file hands it over, is that float). Steps with
                non-finite gradients are skipped in every mode.
            init_loss_scale: the dynamic loss scaler's first scale.
            growth_interval: clean iterations in a row after which the dynamic loss scale doubles.
            snapshot_every: iterations between snapshots of the last good state, the rollback targets.
            max_consecutive_skips: skipped iterations in a row that trigger a rollback.
            max_rollbacks: rollbacks allowed within `rollback_window` iterations before training stops with
                FP8DivergenceError; 0 turns rollback (and so snapshots) off.
            rollback_window: the window (iterations) `max_rollbacks` counts over.
            spike_factor: roll back when the loss exceeds this multiple of its running mean (None: off).
            spike_window: good iterations the running mean of the loss covers.
            spike_warmup: losses needed before the spike rule can fire.
            check_weights_every: iterations between checks that every weight is finite.
            optimizer_state: "fp32" (the user's optimizer as it is) or "fp8" (torch Adam / AdamW become FP8AdamW; not
                with Fabric, which never shows a precision plugin the optimizers: build FP8AdamW there).
            optimizer_kwargs: FP8AdamW storage options used with optimizer_state="fp8".
            compute_dtype: "bf16" or "fp16" (or the torch dtype): the autocast dtype of everything that is not an
                FP8 GEMM.
            fp8_eval: run evaluation forwards (validation / test / predict; Accelerate: the model in eval mode) in
                FP8 too (True) or in compute_dtype (False).
            layer_recipes: {fnmatch pattern of layer names: FP8Recipe}, first match wins: layers that compute with
                another recipe than `recipe` (e.g. {"*.attn.*": FP8Recipe(scaling="rowwise")}); `layer.recipe` is
                each layer's.
            fp8_all_gather: under FSDP2, all-gather the weights of FP8 layers in FP8 (1 byte per element instead of
                2), each rank casting its shard with the scale all ranks share; applies to layers with a per-tensor
                recipe (delayed or current scaling), others gather in high precision. The plugins convert the model
                before the user's fully_shard (a model built inside Lightning's configure_model is built with FP8
                layers and FP8 all-gather weights). No effect without FSDP2.
            gradient_communication: "bf16" leaves gradient reduction to the framework, in high precision (DDP reduces
                in the gradients' dtype, FSDP2 in its MixedPrecisionPolicy.reduce_dtype); "fp8" reduces gradients in
                FP8 with a scale shared across ranks (a DDP comm hook, or FSDP2's reduce-scatter): half the bytes of
                a BF16 reduction.
            backend: who computes the FP8 layers: "lightning_fp8" (this library's FP8 layers) or
                "transformer_engine" (NVIDIA Transformer Engine's te.Linear under te.autocast, with the same recipe;
                loss scaling, skip and rollback stay the engine's; FP8ScaleMonitor, FP8LayerFallback, FP8Calibration
                and FP8 all-gather cannot see inside TE layers). Not FP8Recipe.backend, the GEMM implementation of
                FP8Linear.
            example_input: an input of the model for one forward traced on the meta device at conversion, which
                finds the first and the last layers (docs/models.md, "What first and last mean"): a tensor, a tuple
                of positional arguments or a dict of keyword arguments. None: the LightningModule's
                `example_input_array` or a Hugging Face model's own; without one, the Fabric and Accelerate adapters
                trace the first forward of the set-up model before it computes (until then the layers the module
                order guesses first / last compute in BF16).

        Attributes `skipped_steps`, `rollbacks` and `loss_scale` count in iterations: one backward (or several,
        accumulated) and a step of every optimizer.
        """
        arguments = locals()
        self.options = FP8Options(**{name: arguments[name] for name in OPTION_NAMES})
        validate_options(self.options, self.unsupported_options)
        #: the recipe and where it came from (recipe="auto": the device it was chosen for, and why)
        self.recipe_choice = recipe_choice(self.options)
        self.recipe = self.recipe_choice.recipe
        self.preset = self.options.preset
        self.module_filter = self.options.module_filter
        self.optimizer_state = self.options.optimizer_state
        self.optimizer_kwargs = dict(self.options.optimizer_kwargs or {})
        self.compute_dtype = resolve_compute_dtype(self.options.compute_dtype)
        self.fp8_eval = bool(self.options.fp8_eval)
        self.engine = FP8TrainingEngine(self.recipe, StabilityConfig.from_options(self.options),
                                        compute_dtype=self.compute_dtype)
        self._module: Optional[nn.Module] = None
        #: the conversion summary: logged once per set of FP8 layers (`log_summary`); held back while True (the
        #: Lightning plugin, from its conversion before configure_model until the strategy's conversion after it, so
        #: the one summary shows how the user's sharding code split the layers)
        self._summary_deferred = False
        self._summarized_layers: set = set()
        self._summarized_models: set = set()
        #: id(model) -> the forward pre-hook deciding its first / last layers at its first forward
        self._first_forward_hooks: Dict[int, Any] = {}
        self._set_up_framework()

    def _counting_engine(self) -> FP8TrainingEngine:
        return self.engine

    def _set_up_framework(self) -> None:
        """Called once at the end of construction: what a framework's plugin must install before the framework uses
        it (the Fabric plugin: its conversion before the parallelize function; the Lightning plugin: a warnings
        filter). Nothing for a bare core."""

    # -- logging: rank zero only ----------------------------------------------------------------------------------
    def _rank_zero_info(self, message: str) -> None:
        """Log on rank 0 (a bare core: logger "lightning_fp8"; the plugins: Lightning's rank-zero logging)."""
        _rank_zero.rank_zero_info(message)

    def _rank_zero_warn(self, message: str) -> None:
        """Warn on rank 0 (a bare core: warnings.warn; the plugins: Lightning's rank-zero warning)."""
        _rank_zero.rank_zero_warn(message)

    # -- optimizer_state="fp8" -----------------------------------------------------------------------------------
    def to_fp8_optimizer(self, optimizer: Any, lr_schedulers: Sequence[Any]) -> Any:
        """optimizer_state="fp8": torch Adam / AdamW replaced by FP8AdamW (optimizer_kwargs), the LR schedulers built
        on it re-pointed and the engine told; an optimizer FP8AdamW cannot replace is kept, with a warning naming why.
        Returns the optimizer to use."""
        from lightning_fp8.optim import rebind_lr_schedulers, to_fp8_optimizer, unsupported_optimizer_message

        new = to_fp8_optimizer(optimizer, **self.optimizer_kwargs)
        if new is None:
            self._rank_zero_warn(unsupported_optimizer_message(optimizer))
            return optimizer
        rebind_lr_schedulers(list(lr_schedulers), optimizer, new)
        self.engine.replace_optimizer(optimizer, new)
        return new

    # -- conversion and autocast --------------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert in place (some strategies ignore the return value); converting twice is a no-op. Layers built as
        provisional FP8 layers inside `module_init_context` are decided here by the conversion rules
        (integrations/linear_builder.py)."""
        if self.options.backend == "transformer_engine":
            return self._convert_module_te(module)
        with suspended():  # the library's own nn.Linear calls build torch's class, inside module_init_context too
            settle_built_layers(self, module)
            if is_fsdp_sharded(module):  # FSDP2: converted before fully_shard (convert_for_fsdp), nothing to replace
                return adopt_sharded_module(self, module)
            example = self.options.example_input if self.options.example_input is not None else AUTO
            module = convert_to_fp8(module, self.recipe, self.module_filter, layer_recipes=self.options.layer_recipes,
                                    example_input=example, verbose=False,
                                    first_last_until_traced=self.trace_first_forward)
        if provisional_layers(module):
            self._settle_at_first_forward(module)  # the summary follows the decision
        else:
            self.log_summary(module)
        exclude_fp8_meta_from_ddp_broadcast(module)
        adopt_tensor_parallel(self, module)
        self._module = module
        self.engine.attach(module)
        return module

    def _settle_at_first_forward(self, module: nn.Module) -> None:
        """The first / last layers of a model no example input could trace are decided by its first forward, traced
        on the meta device with that call's arguments before it computes (conversion/convert.py
        `settle_first_last`); the conversion summary is logged then."""

        def settle(model: nn.Module, args: tuple, kwargs: dict) -> None:
            self._first_forward_hooks.pop(id(model)).remove()
            settle_first_last(model, ExampleCall(tuple(args), dict(kwargs)))
            if self.engine.model is model:  # the first and last layers are plain again: the engine's record follows
                self.engine.attach(model)
            self.log_summary(model)

        self._first_forward_hooks[id(module)] = module.register_forward_pre_hook(settle, with_kwargs=True)

    def keep_first_last_guess(self, module: nn.Module) -> None:
        """A model about to be sharded or parallelized (its first forward would run collectives on shards): its first
        / last layers stay as the module order guessed (plain layers, the guess as reason), and the summary says so
        when it is logged."""
        handle = self._first_forward_hooks.pop(id(module), None)
        changed = bool(provisional_layers(module))
        keep_first_last_guess(module)
        if changed and self.engine.model is module:  # the provisional layers are plain again: the engine's record too
            self.engine.attach(module)
        if handle is not None:
            handle.remove()
            self.log_summary(module)  # held back for the first forward's decision

    def log_summary(self, module: nn.Module) -> bool:
        """The conversion summary of `module`, on rank zero, once per run: not again for a model whose FP8 layers a
        summary covered already (the LightningModule after its inner model, a model converted again), nor while
        deferred. Returns whether it logged."""
        if self._summary_deferred:
            return False
        layers = {id(layer) for layer in fp8_layers(module).values()}
        if (layers and layers <= self._summarized_layers) or (not layers and id(module) in self._summarized_models):
            return False
        log_conversion_summary(module, info=self._rank_zero_info, warn=self._rank_zero_warn, note=self.recipe_note())
        self._summarized_layers |= layers
        self._summarized_models.add(id(module))
        return True

    @contextlib.contextmanager
    def module_init_context(self) -> Iterator[None]:
        """While a model is built under it (Lightning's configure_model, Fabric's init_module), `torch.nn.Linear`
        builds FP8 layers, decided by the conversion rules at the next conversion call
        (integrations/linear_builder.py), as Lightning's TransformerEnginePrecision builds te.Linear."""
        framework = getattr(super(), "module_init_context", None)  # the framework's Precision (a bare core: none)
        with (framework() if framework is not None else contextlib.nullcontext()), constructing_fp8_layers(self):
            yield

    def recipe_note(self) -> Optional[str]:
        """The conversion summary's line on the recipe: what recipe="auto" chose, for which device, and why."""
        return self.recipe_choice.describe() if self.options.recipe == "auto" else None

    def _convert_module_te(self, module: nn.Module) -> nn.Module:
        """backend="transformer_engine": nn.Linear layers become te.Linear (backends/transformer_engine.py); the engine
        runs loss scaling, skip and rollback on top, and says once what it cannot see inside TE layers."""
        from lightning_fp8.backends.transformer_engine import convert_for_plugin

        if is_fsdp_sharded(module):
            raise NotImplementedError(
                "lightning_fp8: backend='transformer_engine' under FSDP2 is not supported by the plugins (TE's layers "
                "and their FP8 all-gather are set up through TE itself); use backend='lightning_fp8' with FSDP2."
            )
        if module is not self._module:
            convert_for_plugin(module, self.recipe, self.module_filter)
            log_conversion_summary(module, info=self._rank_zero_info, warn=self._rank_zero_warn)
            self._rank_zero_warn(
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
        FSDP2 all-gather the FP8 layers' weights in FP8. FSDP2 fixes the modules it shards,
        so a model sharded unconverted cannot be converted afterwards."""
        return convert_for_fsdp(self, module)

    def _device_type(self) -> str:
        if self._module is not None:
            for p in self._module.parameters():
                return p.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @contextlib.contextmanager
    def _fp8_context(self, fp8: bool) -> Iterator[None]:
        """The compute-dtype autocast with FP8 on (`fp8`) or off, around every forward the adapter runs. A user's
        `fp8_autocast(enabled=False)` around it (an evaluation of the prepared model in high precision) stays in force:
        the adapter's context can turn FP8 off, never back on."""
        fp8 = fp8 and current_state().enabled
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
        state: Dict[str, Any] = stamped({"engine": self.engine.state_dict(), "preset": self.preset}, PLUGIN_STATE_VERSION)
        if self.options.recipe == "auto":
            state["auto_recipe"] = self.recipe_choice.to_dict()
        if self._module is not None:
            state["fp8_meta"] = fp8_state_dict(self._module)
            state["layer_recipes"] = layer_recipe_state(self._module)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        format_version(state_dict, "FP8 plugin state", PLUGIN_STATE_VERSION)
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
        # history then fills (in the other order the saved history would be cut to this run's length)
        meta = state_dict.get("fp8_meta")
        if self._module is not None and provisional_layers(self._module):
            # first / last as the checkpoint's run decided them (its FP8 layers are in its FP8 state), before its
            # layers' recipes and states load; the first forward traces nothing then
            settle_first_last_from_state(self._module, list(meta or {}))
            self.engine.attach(self._module)
            hook = self._first_forward_hooks.pop(id(self._module), None)
            if hook is not None:
                hook.remove()
                self.log_summary(self._module)  # held back for the first forward's decision
        if self._module is not None and state_dict.get("layer_recipes"):
            load_layer_recipe_state(self._module, state_dict["layer_recipes"])
        if meta and self._module is not None:
            load_fp8_state_dict(self._module, meta)



#: the options, in the order of the signature
OPTION_PARAMETERS: Tuple[inspect.Parameter, ...] = tuple(
    inspect.signature(FP8PrecisionCore.__init__, eval_str=True).parameters.values())[1:]  # without self
OPTION_NAMES: Tuple[str, ...] = tuple(parameter.name for parameter in OPTION_PARAMETERS)


def options_dataclass(cls: type) -> type:
    """Class decorator: `cls` as a keyword-only dataclass with one field per option of `FP8PrecisionCore.__init__`
    (same name, annotation and default, in the same order), keeping `cls`'s bases, docstring and methods.

    The methods are copied into the new class, so they must not use zero-argument `super()` (its cell would name the
    class before decoration)."""
    namespace = {key: value for key, value in vars(cls).items() if key not in ("__dict__", "__weakref__")}
    fields = [(p.name, p.annotation, dataclasses.field(default=p.default)) for p in OPTION_PARAMETERS]
    return dataclasses.make_dataclass(cls.__name__, fields, bases=cls.__bases__, namespace=namespace, kw_only=True)


@options_dataclass
class FP8Options:
    """The options an adapter was built with (`core.options`), one attribute per parameter of
    `FP8PrecisionCore.__init__`, validated by the core that holds them."""


def option_values(options: Any) -> Dict[str, Any]:
    """The options of a record (`FP8Options`, `FP8Kwargs`) as keyword arguments of `FP8PrecisionCore` (shallow: the
    recipe and the filter are the objects given)."""
    return {name: getattr(options, name) for name in OPTION_NAMES}


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
    all-reduce per iteration), so DDP must leave them alone. Call before the module is wrapped.
    """
    from torch.nn.parallel import DistributedDataParallel

    names = [name for name, _ in module.named_buffers() if FP8_META_MARKER in f".{name}"]
    if names:
        existing = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(set(existing + names)))
