"""FP8 for Hugging Face Accelerate: `FP8Accelerator()` + `--mixed_precision fp8`, run by our engine.

Why a subclass and not a backend: Accelerate's FP8 support is a closed set (TransformerEngine, torchao, MS-AMP).
With none of them installed `mixed_precision="fp8"` raises, and its kwargs handlers are matched by exact class, so a
third party cannot register a backend. `FP8AcceleratorMixin` therefore intercepts "fp8" *before* Accelerate builds its
AcceleratorState, runs the base class with mixed_precision="no" (then marks the state "fp8", so
`accelerator.state.mixed_precision` says what runs: docs/accelerate.md lists where Accelerate reads it, and why none
of its FP8 branches runs), and translates Accelerate's hooks into FP8TrainingEngine calls (the same engine the
Lightning and Fabric plugins drive):

    prepare(model)            convert_to_fp8 in place (Parameters reused: optimizer references stay valid),
                              forward wrapped in torch.autocast(compute dtype) + fp8_autocast, engine.attach
    prepare(optimizer)        registered with the engine (one iteration steps every prepared optimizer); an
                              AcceleratedOptimizer whose step() goes through engine.step (skip / rollback);
                              optimizer_state="fp8" swaps torch Adam/AdamW for FP8AdamW first
    prepare(scheduler)        registered with the engine: a rollback restores it with the optimizers
    training forward          engine.begin_iteration (closes the previous iteration)
    backward(loss)            engine.scale_loss
    clip_grad_norm_/value_    engine.unscale_ first, clip on unscaled gradients (norm in fp32)
    save_state/load_state     the open iteration is closed first; engine state and every layer's FP8 metadata are a
                              registered object (checkpoint.py)

When mixed precision does not resolve to "fp8" the class is `accelerate.Accelerator`, unchanged.

`accelerate launch --mixed_precision fp8` itself refuses to start when none of Accelerate's FP8 backends is
installed (the launcher checks before it runs the script). `python -m lightning_fp8.accelerate launch ...` is
`accelerate launch` with that one check satisfied by this engine (launcher.py).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from accelerate.utils.dataclasses import FP8BackendType
from torch import nn

from lightning_fp8.engine import clipping
from lightning_fp8.engine.engine import FP8TrainingEngine
from lightning_fp8.integrations.plugin_core import EngineCounters, FP8PrecisionCore
from lightning_fp8.integrations._distributed import convert_for_fsdp, register_gradient_communication
from lightning_fp8.integrations.accelerate import fp8_config, plain, precision_source
from lightning_fp8.integrations.accelerate.checkpoint import FP8CheckpointState
from lightning_fp8.integrations.accelerate.forward import wrap_forward
from lightning_fp8.integrations.accelerate.kwargs import FP8Kwargs
from lightning_fp8.integrations.accelerate.optimizer import FP8AcceleratedOptimizer, inner_optimizer
from lightning_fp8.modules.autocast import fp8_autocast

#: distributed types the adapter supports: one process, DDP (gloo on CPU, NCCL on GPU), FSDP2 (fsdp_version=2)
SUPPORTED_DISTRIBUTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP)
#: key in AcceleratorState's shared state recording that its "no" is really "fp8" run by this engine, so a second
#: FP8Accelerator in the same process (AcceleratorState is a singleton) resolves to the same precision
_SHARED_STATE_FLAG = "_lightning_fp8"
_ACCELERATE_FP8_HANDLERS = plain.ACCELERATE_FP8_HANDLERS


class FP8AcceleratorMixin(EngineCounters):
    """Makes an `accelerate.Accelerator` (sub)class run `mixed_precision="fp8"` on lightning_fp8's engine.

    Use `FP8Accelerator`, or put the mixin first in your own class: `class MyAccelerator(FP8AcceleratorMixin,
    MyBaseAccelerator)`. Mixed precision resolves as in Accelerate: the `mixed_precision` argument, else the
    ACCELERATE_MIXED_PRECISION environment variable (which `accelerate launch --mixed_precision` and `accelerate
    config` files set), else the existing AcceleratorState. FP8 options come from an `FP8Kwargs` in
    `kwargs_handlers`.

    When FP8 was requested for the process, an argument that a library chose by default, not the user (trl's
    `SFTConfig` turns bf16 on, and transformers' Trainer passes it on: precision_source.py tells the two apart), does
    not count: the launch's FP8 wins, the Trainer's arguments say so (`args.bf16` False, `args.mixed_precision`
    "fp8") and one line names the default and how to keep it. An argument the user chose wins, with a warning at the
    first prepare that names where it came from.

    Without an FP8Kwargs, the launch's `fp8_config` (ACCELERATE_FP8_* variables: an accelerate config file's
    `fp8_config:`, the launcher's `--fp8_*` flags) sets the options it maps onto (fp8_config.py); the rest is named in
    one warning. An explicit FP8Kwargs wins over it.

    Public additions: `fp8_engine` (the FP8TrainingEngine, None unless FP8 is on), `skipped_steps`, `rollbacks`,
    `loss_scale`, `fp8_metrics()`. `mixed_precision` and `state.mixed_precision` report "fp8"; Accelerate itself is
    set up with "no" (the autocast and loss scaling are ours).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        arguments = bound.arguments
        handlers = list(arguments.get("kwargs_handlers") or [])
        fp8_kwargs = [h for h in handlers if isinstance(h, FP8Kwargs)]
        if len(fp8_kwargs) > 1:
            raise ValueError("pass at most one FP8Kwargs in kwargs_handlers")
        if "kwargs_handlers" in arguments:
            arguments["kwargs_handlers"] = [h for h in handlers if not isinstance(h, FP8Kwargs)] or None

        explicit = arguments.get("mixed_precision")
        source = None  # who chose an explicit precision that is not fp8, when FP8 was requested (precision_source.py)
        if explicit is not None and str(explicit).lower() != "fp8" and plain.fp8_requested():
            source = precision_source.trace(explicit, inspect.currentframe())
        library_default = source is not None and source.library_default
        if library_default:
            # a library's default (trl's bf16=True, which transformers' Trainer passes on) is no choice of the user's:
            # the precision resolves as if it were not passed, so the launch's FP8 wins, and one line says so
            explicit, arguments["mixed_precision"] = None, None
        requested = _resolve_mixed_precision(explicit)
        if library_default:
            if requested == "fp8":
                source.let_fp8_win()
                fp8_config.say_once(source.fp8_wins_message(), warn=False)
            source = None
        #: said at the first prepare when FP8 was requested for the process but this Accelerator runs otherwise
        self._fp8_precision_note = _overruled_fp8_note(explicit, requested, source)
        self._fp8_core: Optional[FP8PrecisionCore] = None
        self._fp8_model: Optional[nn.Module] = None
        #: (user's optimizer, FP8AdamW) pairs from optimizer_state="fp8", to re-point LR schedulers
        self._fp8_swapped_optimizers: List[tuple] = []
        if requested == "fp8":
            foreign = [type(h).__name__ for h in handlers if type(h).__name__ in _ACCELERATE_FP8_HANDLERS]
            if foreign:
                raise ValueError(
                    f"{type(self).__name__} runs mixed_precision='fp8' on lightning_fp8's engine; {foreign[0]} "
                    "configures one of Accelerate's own FP8 backends. Pass lightning_fp8.accelerate.FP8Kwargs "
                    "instead, or use accelerate.Accelerator for TransformerEngine / torchao / MS-AMP."
                )
            explicit_kwargs = fp8_kwargs[0] if fp8_kwargs else plain.default_kwargs()
            launch_config = fp8_config.read_launch_config()  # the launch's fp8_config (ACCELERATE_FP8_*), or None
            if explicit_kwargs is not None:
                options = explicit_kwargs  # explicit FP8Kwargs win over the launch configuration (said below)
            elif launch_config is not None:
                options = launch_config.kwargs()
            else:
                options = FP8Kwargs()
            self._fp8_core = options.build_core()
            arguments["mixed_precision"] = "no"  # Accelerate adds no autocast or GradScaler of its own
        elif fp8_kwargs:
            warnings.warn(
                f"FP8Kwargs is ignored: mixed precision resolved to {requested!r}, not 'fp8' "
                "(set Accelerator(mixed_precision='fp8'), `--mixed_precision fp8` or ACCELERATE_MIXED_PRECISION=fp8).",
                UserWarning,
                stacklevel=2,
            )
        with _accelerate_sees_no_mixed_precision(self._fp8_core is not None):
            super().__init__(*bound.args, **bound.kwargs)
        if self._fp8_core is None:
            return
        if self.distributed_type not in SUPPORTED_DISTRIBUTED_TYPES:
            raise NotImplementedError(
                f"{type(self).__name__}(mixed_precision='fp8') supports distributed types "
                f"{[t.value for t in SUPPORTED_DISTRIBUTED_TYPES]}, not {self.distributed_type.value}"
            )
        check_fsdp_version(self)
        # AcceleratorState (one per process) now says what this process runs: `accelerator.state.mixed_precision` is
        # "fp8", as Accelerate's own scripts print it. Accelerate read "no" while it set itself up (above), so it
        # built no autocast, GradScaler or FP8 backend of its own; after __init__ it reads the state's precision in
        # no code path this adapter uses (docs/accelerate.md, "accelerator.state.mixed_precision").
        AcceleratorState._shared_state[_SHARED_STATE_FLAG] = True
        AcceleratorState._shared_state["_mixed_precision"] = "fp8"
        if self.is_main_process and launch_config is not None:
            if explicit_kwargs is not None:
                fp8_config.say_once(launch_config.overridden_message(), warn=True)
            else:
                if launch_config.honoured:
                    fp8_config.say_once(launch_config.honoured_message(), warn=False)
                if launch_config.ignored:
                    fp8_config.say_once(launch_config.ignored_message(), warn=True)
        self.fp8_enabled = True
        checkpoint_state = FP8CheckpointState(self._fp8_core)
        # registered first, so it is always custom_checkpoint_0 whatever the user registers after
        self.register_for_checkpointing(checkpoint_state)
        # and where Accelerate keeps its GradScaler, which under FP8 does not exist (our loss scaling is the engine's):
        # transformers' Trainer saves `accelerator.scaler.state_dict()` in every checkpoint (scaler.pt) and loads it
        # back on resume, so a Trainer checkpoint carries the FP8 state too. Accelerate's own save_state / load_state
        # do not see it there (custom_checkpoint_0 carries it; see _scaler_hidden)
        self.scaler = checkpoint_state

    # -- what the user sees ---------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        return "fp8" if self._fp8_core is not None else super().mixed_precision

    @property
    def fp8_backend(self) -> FP8BackendType:
        # Accelerate's TE / torchao / MS-AMP code paths (chosen from this property, e.g. by `--fp8_backend`) must not
        # run on top of ours
        if getattr(self, "_fp8_core", None) is not None:
            return FP8BackendType.NO
        return super().fp8_backend

    @property
    def fp8_engine(self) -> Optional[FP8TrainingEngine]:
        return self._fp8_core.engine if self._fp8_core is not None else None

    def _counting_engine(self) -> Optional[FP8TrainingEngine]:  # skipped_steps, rollbacks, loss_scale
        return self.fp8_engine

    def fp8_metrics(self) -> Dict[str, float]:
        """fp8/skipped_steps, fp8/rollbacks, fp8/loss_scale, for `accelerator.log(...)`; {} without FP8."""
        return self._fp8_core.engine.metrics() if self._fp8_core is not None else {}

    # -- prepare --------------------------------------------------------------------------------------------------
    def _announce_precision(self) -> None:
        """Once, at the first prepare: FP8 was requested for this process, but this Accelerator runs something else."""
        note, self._fp8_precision_note = self._fp8_precision_note, None
        if note and self.is_main_process:
            warnings.warn(note, UserWarning, stacklevel=3)

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
        self._announce_precision()
        core = self._fp8_core
        if core is None or getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if evaluation_mode:
            # an inference-only model (a teacher, a reference model): compute dtype, no FP8 state to train
            wrap_forward(model, lambda training: core._fp8_context(False))
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        model = self._fp8_trained_model(model, fsdp2=False)
        return self._fp8_communicate(super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode))

    def prepare(self, *args: Any, device_placement: Optional[List[bool]] = None):
        """Accelerate's prepare; under FSDP2 the FP8 model is converted (with FP8 all-gather weights) before Accelerate
        shards it, and its FP8 gradient reduce-scatter installed after (Accelerate's FSDP2 path never calls
        prepare_model)."""
        self._announce_precision()
        fsdp2 = self._fp8_core is not None and self.is_fsdp2
        if fsdp2:
            args = tuple(self._fp8_prepare_fsdp2_model(obj) if isinstance(obj, nn.Module) else obj for obj in args)
        result = super().prepare(*args, device_placement=device_placement)
        if fsdp2:
            for obj in result if isinstance(result, tuple) else (result,):
                if isinstance(obj, nn.Module):
                    self._fp8_communicate(obj)
        return result

    def _fp8_prepare_fsdp2_model(self, model: nn.Module) -> nn.Module:
        """Accelerate's FSDP2 path (which never calls prepare_model): the model converted with FP8 all-gather weights
        before Accelerate's fully_shard."""
        if getattr(model, "_is_accelerate_prepared", False):
            return model
        return self._fp8_trained_model(model, fsdp2=True)

    def _fp8_trained_model(self, model: nn.Module, fsdp2: bool) -> nn.Module:
        """The model this accelerator trains in FP8: converted in place (FP8Linear reuses each nn.Linear's Parameters,
        so an optimizer built before prepare() keeps updating the live weights; only a bare nn.Linear comes back as a
        new module), with FP8 all-gather weights under FSDP2, its forward inside the FP8 context (a training forward
        starts an iteration: the engine closes the previous one before amaxes are recorded)."""
        core = self._fp8_core
        if self._fp8_model is not None and model is not self._fp8_model:
            raise NotImplementedError(
                f"{type(self).__name__}(mixed_precision='fp8') trains one model in FP8 per accelerator (one engine, "
                "one set of scales). Prepare other models with prepare_model(model, evaluation_mode=True)."
            )
        model = convert_for_fsdp(core, model) if fsdp2 else core.convert_module(model)
        self._fp8_model = model
        fp8_eval = core.fp8_eval
        wrap_forward(model, lambda training: core._model_forward_context(training, training or fp8_eval))
        return model

    def _fp8_communicate(self, model: nn.Module) -> nn.Module:
        """gradient_communication="fp8": the FP8 comm hook on the DDP wrapper, the FP8 reduce-scatter on FSDP2 units."""
        if self._fp8_core is not None:
            register_gradient_communication(self._fp8_core, model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None):
        core = self._fp8_core
        if core is None or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if core.optimizer_state == "fp8":
            optimizer = self._to_fp8_optimizer(optimizer)
        if device_placement is None:
            device_placement = self.device_placement
        core.engine.register_optimizer(optimizer)  # every prepared optimizer steps in one iteration, rolls back together
        prepared = FP8AcceleratedOptimizer(optimizer, core.engine, device_placement=device_placement)
        self._optimizers.append(prepared)
        return prepared

    def _to_fp8_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # schedulers are usually built on the user's optimizer before prepare(): those prepared already are
        # re-pointed here, the rest when they reach prepare_scheduler
        new = self._fp8_core.to_fp8_optimizer(optimizer, [s.scheduler for s in self._schedulers])
        if new is not optimizer:
            self._fp8_swapped_optimizers.append((optimizer, new))
        return new

    def prepare_scheduler(self, scheduler):
        if self._fp8_swapped_optimizers:
            from lightning_fp8.optim import rebind_lr_schedulers

            for old, new in self._fp8_swapped_optimizers:
                rebind_lr_schedulers([scheduler], old, new)
        prepared = super().prepare_scheduler(scheduler)
        if self._fp8_core is not None:
            self._fp8_core.engine.register_lr_scheduler(scheduler)  # restored with the optimizers on a rollback
        return prepared

    def save_state(self, *args: Any, **kwargs: Any):
        if self._fp8_core is not None:
            self._fp8_core.engine.settle()  # the checkpoint holds whole iterations, their weights checked
        with self._scaler_hidden():
            return super().save_state(*args, **kwargs)

    def load_state(self, *args: Any, **kwargs: Any):
        with self._scaler_hidden():
            return super().load_state(*args, **kwargs)

    @contextlib.contextmanager
    def _scaler_hidden(self) -> Iterator[None]:
        """Accelerate's save_state / load_state treat a non-None `scaler` as a GradScaler (scaler.pt; under FSDP2 a
        GradScaler-only call): the FP8 state, custom_checkpoint_0 there, is not written or read twice."""
        scaler = self.scaler
        if isinstance(scaler, FP8CheckpointState):
            self.scaler = None
        try:
            yield
        finally:
            self.scaler = scaler

    def free_memory(self, *objects: Any):
        """Accelerate's free_memory (transformers' Trainer calls it at the start of every `train()`), and the engine
        forgets the optimizers and schedulers prepared so far: the next prepare registers the new ones."""
        if self._fp8_core is not None:
            self._fp8_core.engine.track([], [])
        return super().free_memory(*objects)

    # -- backward, unscale, clip ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._fp8_core is None:
            return super().backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)  # a LOMO argument; LOMO optimizers step inside backward, not supported
        loss = loss / self.gradient_accumulation_steps  # as Accelerate does, before the engine records it
        self._fp8_core.engine.scale_loss(loss).backward(**kwargs)

    def unscale_gradients(self, optimizer=None) -> None:
        if self._fp8_core is None:
            return super().unscale_gradients(optimizer)
        if not self.sync_gradients:
            if not self._loss_scaled():
                return  # no loss scale, nothing to unscale (as under BF16); the engine checks the summed gradients
            raise RuntimeError(
                "lightning_fp8: gradients were unscaled / clipped in the middle of gradient accumulation while loss "
                "scaling is active. Clip on the step that updates the weights, as Accelerate documents: `if "
                "accelerator.sync_gradients: accelerator.clip_grad_norm_(model.parameters(), max_norm)` (the "
                "micro-batches still to come would add loss-scaled gradients to unscaled ones)."
            )
        if optimizer is None:
            optimizers = self._optimizers
        elif isinstance(optimizer, (list, tuple)):
            optimizers = optimizer
        else:
            optimizers = [optimizer]
        for opt in optimizers:
            self._fp8_core.engine.unscale_(inner_optimizer(opt))

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip on unscaled gradients. With the L2 norm over exactly one optimizer's parameters (the usual
        `model.parameters()`) this is engine.clip_grad_norm_: norm in fp32, a non-finite norm skips the step."""
        if self._fp8_core is None or self._clipping_a_micro_batch():
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        params = list(parameters)
        owners = self._owners(params)
        self.unscale_gradients(owners or None)
        engine = self._fp8_core.engine
        if float(norm_type) == 2.0 and owners:
            # a subset of parameters (or parameters of several optimizers) is clipped together; a non-finite norm
            # marks the step as skipped in the engine
            return engine.clip_grad_norm_(inner_optimizer(owners[0]), max_norm, parameters=params)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self._fp8_core is None or self._clipping_a_micro_batch():
            return super().clip_grad_value_(parameters, clip_value)
        params = list(parameters)
        owners = self._owners(params)
        self.unscale_gradients(owners or None)
        clipping.clip_grad_value_([p.grad for p in params], clip_value)

    def _loss_scaled(self) -> bool:
        scaler = self._fp8_core.engine.scaler
        return scaler.dynamic or scaler.scale != 1.0

    def _clipping_a_micro_batch(self) -> bool:
        """Clipping inside accumulate() before the gradients sync, without loss scaling: Accelerate's own clipping
        (as under BF16), outside the engine, whose finiteness check then covers every micro-batch at the step."""
        return not self.sync_gradients and not self._loss_scaled()

    def _owners(self, params: Sequence[torch.Tensor]) -> List[AcceleratedOptimizer]:
        ids = {id(p) for p in params}
        return [
            opt for opt in self._optimizers
            if any(id(p) in ids for group in inner_optimizer(opt).param_groups for p in group["params"])
        ]

    @contextlib.contextmanager
    def autocast(self, autocast_handler=None) -> Iterator[None]:
        """The prepared forward's context (compute-dtype autocast + FP8) for code outside the model's forward;
        `AutocastKwargs(enabled=False)` turns both off, as it turns off Accelerate's autocast."""
        if self._fp8_core is None:
            with super().autocast(autocast_handler):
                yield
            return
        handler = autocast_handler if autocast_handler is not None else self.autocast_handler
        if handler is not None and not handler.enabled:
            with torch.autocast(self._fp8_core._device_type(), enabled=False), fp8_autocast(enabled=False):
                yield
            return
        with self._fp8_core._fp8_context(True):
            yield


class FP8Accelerator(FP8AcceleratorMixin, Accelerator):
    """`accelerate.Accelerator` that runs `mixed_precision="fp8"` on lightning_fp8 (see FP8AcceleratorMixin).

        accelerator = FP8Accelerator()                       # precision from `launch` / config file / env var
        accelerator = FP8Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(loss_scaling="dynamic")])
    """


# -- helpers ------------------------------------------------------------------------------------------------------
def check_fsdp_version(accelerator: Accelerator) -> None:
    """FSDP1 (FullyShardedDataParallel wrappers) is not supported: FP8 layers, their all-gather and the engine's
    sharded-state handling are built on FSDP2's per-parameter DTensor sharding."""
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise NotImplementedError(
            f"{type(accelerator).__name__}(mixed_precision='fp8') supports FSDP through FSDP2 only: pass "
            "FullyShardedDataParallelPlugin(fsdp_version=2) (or fsdp_version: 2 in the accelerate config)."
        )


@contextlib.contextmanager
def _accelerate_sees_no_mixed_precision(fp8: bool) -> Iterator[None]:
    """While an FP8 Accelerator runs Accelerate's own __init__: an AcceleratorState an earlier FP8 Accelerator of this
    process marked "fp8" reads "no", as it did when that one was set up. Accelerate's __init__ would otherwise take
    its FP8 branch (`fp8_enabled`: pick Transformer Engine / torchao / MS-AMP, or raise ImportError without one) and
    refuse the "no" this class passes it ("AcceleratorState has already been initialized")."""
    state = AcceleratorState._shared_state
    marked = fp8 and bool(state.get(_SHARED_STATE_FLAG)) and state.get("_mixed_precision") == "fp8"
    if marked:
        state["_mixed_precision"] = "no"
    try:
        yield
    finally:
        if marked and state.get("_mixed_precision") == "no":
            state["_mixed_precision"] = "fp8"


def _overruled_fp8_note(explicit: Any, resolved: str, source: Optional[precision_source.PrecisionSource] = None
                        ) -> Optional[str]:
    """The warning for an Accelerator that does not run FP8 although FP8 was requested for the process (which setting
    won and why, from `source` for an explicit argument), or None."""
    if resolved == "fp8" or not plain.fp8_requested():
        return None
    if explicit is not None:
        if source is None:
            source = precision_source.trace(explicit, None)
        why = f"{source.why}, and an explicit argument wins over the launch setting, as in Accelerate"
        fix = source.fix
    else:
        why = (f"an Accelerator built earlier in this process fixed mixed precision to {resolved!r} "
               "(AcceleratorState is one per process)")
        fix = "Build the FP8 Accelerator first, or reset AcceleratorState."
    return (f"lightning_fp8: FP8 was requested for this run (ACCELERATE_MIXED_PRECISION=fp8: `--mixed_precision fp8`, "
            f"an accelerate config file or enable_fp8()), but {why}: this run trains in {resolved!r}, NOT in FP8. {fix}")


def _resolve_mixed_precision(value: Any) -> str:
    """What Accelerate would resolve mixed precision to, read before its AcceleratorState exists (which would raise
    on "fp8" without an FP8 backend)."""
    state = AcceleratorState._shared_state
    current = None
    if state.get("_mixed_precision") is not None:  # AcceleratorState is a process-wide singleton
        current = "fp8" if state.get(_SHARED_STATE_FLAG) else state["_mixed_precision"]
    if value is None:
        if current is not None:
            return current
        return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    value = str(value).lower()
    if current is not None and value != current and (value == "fp8" or current == "fp8"):
        raise ValueError(
            f"AcceleratorState has already been initialized with mixed_precision={current!r} and cannot be changed to "
            f"{value!r}; reset it (AcceleratorState._reset_state(True)) or restart the process."
        )
    return value
