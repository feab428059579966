"""FP8 for Hugging Face Accelerate: `FP8Accelerator()` + `--mixed_precision fp8`, run by our engine.

Why a subclass and not a backend: Accelerate's FP8 support is a closed set (TransformerEngine, torchao, MS-AMP).
With none of them installed `mixed_precision="fp8"` raises, and its kwargs handlers are matched by exact class, so a
third party cannot register a backend. `FP8AcceleratorMixin` therefore intercepts "fp8" *before* Accelerate builds its
AcceleratorState, runs the base class with mixed_precision="no", and translates Accelerate's hooks into
FP8TrainingEngine calls (the same engine the Lightning and Fabric plugins drive):

    prepare(model)            convert_to_fp8 in place (Parameters reused: optimizer references stay valid),
                              forward wrapped in torch.autocast(compute dtype) + fp8_autocast, engine.attach
    prepare(optimizer)        an AcceleratedOptimizer whose step() goes through engine.step (skip / rollback);
                              optimizer_state="fp8" swaps torch Adam/AdamW for FP8AdamW first
    backward(loss)            engine.scale_loss
    clip_grad_norm_/value_    engine.unscale_ first, clip on unscaled gradients (norm in fp32)
    save_state/load_state     layer metadata is in the model state_dict; engine state is a registered object

When mixed precision does not resolve to "fp8" the class is `accelerate.Accelerator`, unchanged.

`accelerate launch --mixed_precision fp8` itself refuses to start when none of Accelerate's FP8 backends is
installed (the launcher checks before it runs the script). `python -m lightning_fp8.accelerate launch ...` is
`accelerate launch` with that one check satisfied by this engine; see docs/accelerate.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import warnings
from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, KwargsHandler
from accelerate.utils.dataclasses import FP8BackendType
from accelerate.utils.operations import convert_outputs_to_fp32
from torch import nn

from lightning_fp8.autocast import fp8_autocast
from lightning_fp8.convert import ModuleFilter
from lightning_fp8.engine import clipping
from lightning_fp8.engine.engine import FP8TrainingEngine
from lightning_fp8.engine.loss_scaler import LossScaling
from lightning_fp8.plugin_core import FP8_META_MARKER, FP8PrecisionCore
from lightning_fp8.recipe import FP8Recipe

#: distributed types the adapter supports: one process, or DDP (gloo on CPU, NCCL on GPU)
SUPPORTED_DISTRIBUTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
#: key in AcceleratorState's shared state recording that its "no" is really "fp8" run by this engine, so a second
#: FP8Accelerator in the same process (AcceleratorState is a singleton) resolves to the same precision
_SHARED_STATE_FLAG = "_lightning_fp8"
_ACCELERATE_FP8_HANDLERS = ("FP8RecipeKwargs", "TERecipeKwargs", "AORecipeKwargs", "MSAMPRecipeKwargs")
_CHECKPOINT_FORMAT = "lightning_fp8.accelerate/1"


@dataclass
class FP8Kwargs(KwargsHandler):
    """FP8 options for `FP8Accelerator(kwargs_handlers=[FP8Kwargs(...)])`; the same options as
    `lightning_fp8.FP8Precision` (the fields and defaults are those of the plugins).

    Args:
        recipe: an FP8Recipe (formats, scaling, which layers); or
        preset: a named recipe: "default", "conservative", "mellempudi" (lightning_fp8.presets).
        module_filter: callable(module, fqn) -> bool replacing the recipe's default layer filter.
        loss_scaling: "auto" (dynamic only where gradients can underflow), "dynamic", "none", or a static float.
            Steps with non-finite gradients are skipped in every mode.
        snapshot_every: optimizer steps between host-memory snapshots used for rollback.
        max_consecutive_skips: skipped steps in a row that trigger a rollback.
        max_rollbacks: rollbacks allowed within `rollback_window` steps before training stops with an error.
        spike_factor: roll back when the loss exceeds this multiple of its running mean (None: off).
        optimizer_state: "fp32" (the optimizer as it is) or "fp8" (torch Adam/AdamW become FP8AdamW at prepare()).
        compute_dtype: "bf16" or "fp16": the autocast dtype of everything that is not an FP8 GEMM.
        fp8_eval: forward passes in eval mode (model.eval()) run in FP8 too (True) or in compute_dtype (False).
        rollback_window, init_loss_scale: see lightning_fp8.engine.StabilityConfig.
        optimizer_kwargs: FP8AdamW storage options used with optimizer_state="fp8".

    Invalid values raise ValueError here, naming the valid choices. The options only take effect when mixed precision
    resolves to "fp8"; otherwise they are ignored with a warning.
    """

    recipe: Optional[FP8Recipe] = None
    preset: Optional[str] = None
    module_filter: Optional[ModuleFilter] = None
    loss_scaling: LossScaling = "auto"
    snapshot_every: int = 50
    max_consecutive_skips: int = 10
    max_rollbacks: int = 3
    spike_factor: Optional[float] = None
    optimizer_state: str = "fp32"
    compute_dtype: Union[str, torch.dtype] = "bf16"
    fp8_eval: bool = True
    rollback_window: int = 1000
    init_loss_scale: float = 2.0**8
    optimizer_kwargs: Optional[Dict[str, Any]] = None

    def __post_init__(self) -> None:
        self.build_core()  # validate now, where the user wrote the options, not at Accelerator() time

    def build_core(self) -> FP8PrecisionCore:
        """The option handling the Lightning/Fabric plugins share: validation, presets, the engine."""
        return FP8PrecisionCore(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


class FP8AcceleratedOptimizer(AcceleratedOptimizer):
    """AcceleratedOptimizer whose real step goes through the engine: skipped on non-finite gradients, loss or FP8
    amax (then `step_was_skipped` is True and a prepared LR scheduler does not step), rolled back on divergence.
    Within `accelerator.accumulate(...)` the micro-steps stay no-ops, as in Accelerate: only the step that follows
    the synchronised backward reaches the engine."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: FP8TrainingEngine, device_placement: bool = True):
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.engine = engine

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        result = self.engine.step(self.optimizer, lambda: self.optimizer.step(closure))
        self._is_overflow = not result.stepped


class _FP8CheckpointState:
    """The engine's state (loss scaler, counters, rollback bookkeeping) as an object Accelerate's save_state /
    load_state carry (register_for_checkpointing). Layer scales and amax histories are model buffers: they travel
    with the model weights."""

    def __init__(self, core: FP8PrecisionCore) -> None:
        self.core = core

    def state_dict(self) -> Dict[str, Any]:
        return {"format": _CHECKPOINT_FORMAT, **self.core.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
            raise ValueError(
                "lightning_fp8: this checkpoint has no FP8Accelerator engine state where the FP8 run registered it "
                "(custom_checkpoint_0.pkl): it was saved without mixed_precision='fp8', or with other objects "
                "registered first. Load it with the mixed precision it was saved with."
            )
        self.core.load_state_dict({k: v for k, v in state.items() if k != "format"})


class FP8AcceleratorMixin:
    """Makes an `accelerate.Accelerator` (sub)class run `mixed_precision="fp8"` on lightning_fp8's engine.

    Use `FP8Accelerator`, or put the mixin first in your own class: `class MyAccelerator(FP8AcceleratorMixin,
    MyBaseAccelerator)`. Mixed precision resolves as in Accelerate: the `mixed_precision` argument, else the
    ACCELERATE_MIXED_PRECISION environment variable (which `accelerate launch --mixed_precision` and `accelerate
    config` files set), else the existing AcceleratorState. FP8 options come from an `FP8Kwargs` in
    `kwargs_handlers`.

    Public additions: `fp8_engine` (the FP8TrainingEngine, None unless FP8 is on), `skipped_steps`, `rollbacks`,
    `loss_scale`, `fp8_metrics()`. `mixed_precision` reports "fp8"; Accelerate's own state runs with "no" (the
    autocast and loss scaling are ours).
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

        requested = _resolve_mixed_precision(arguments.get("mixed_precision"))
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
            self._fp8_core = (fp8_kwargs[0] if fp8_kwargs else FP8Kwargs()).build_core()
            arguments["mixed_precision"] = "no"  # Accelerate adds no autocast or GradScaler of its own
        elif fp8_kwargs:
            warnings.warn(
                f"FP8Kwargs is ignored: mixed precision resolved to {requested!r}, not 'fp8' "
                "(set Accelerator(mixed_precision='fp8'), `--mixed_precision fp8` or ACCELERATE_MIXED_PRECISION=fp8).",
                UserWarning,
                stacklevel=2,
            )
        super().__init__(*bound.args, **bound.kwargs)
        if self._fp8_core is None:
            return
        if self.distributed_type not in SUPPORTED_DISTRIBUTED_TYPES:
            raise NotImplementedError(
                f"{type(self).__name__}(mixed_precision='fp8') supports distributed types "
                f"{[t.value for t in SUPPORTED_DISTRIBUTED_TYPES]}, not {self.distributed_type.value}"
            )
        AcceleratorState._shared_state[_SHARED_STATE_FLAG] = True
        self.fp8_enabled = True
        # registered first, so it is always custom_checkpoint_0 whatever the user registers after
        self.register_for_checkpointing(_FP8CheckpointState(self._fp8_core))

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

    @property
    def skipped_steps(self) -> int:
        return self._fp8_core.skipped_steps if self._fp8_core is not None else 0

    @property
    def rollbacks(self) -> int:
        return self._fp8_core.rollbacks if self._fp8_core is not None else 0

    @property
    def loss_scale(self) -> float:
        return self._fp8_core.loss_scale if self._fp8_core is not None else 1.0

    def fp8_metrics(self) -> Dict[str, float]:
        """fp8/skipped_steps, fp8/rollbacks, fp8/loss_scale, for `accelerator.log(...)`; {} without FP8."""
        return self._fp8_core.engine.metrics() if self._fp8_core is not None else {}

    # -- prepare --------------------------------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
        core = self._fp8_core
        if core is None or getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if evaluation_mode:
            # an inference-only model (a teacher, a reference model): compute dtype, no FP8 state to train
            _wrap_forward(model, lambda training: core._fp8_context(False))
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self._fp8_model is not None and model is not self._fp8_model:
            raise NotImplementedError(
                f"{type(self).__name__}(mixed_precision='fp8') trains one model in FP8 per accelerator (one engine, "
                "one set of scales). Prepare other models with prepare_model(model, evaluation_mode=True)."
            )
        # In place: FP8Linear reuses each nn.Linear's Parameters, so an optimizer built on model.parameters() before
        # prepare() keeps updating the live weights. (Only a bare nn.Linear comes back as a new module.)
        model = core.convert_module(model)
        self._fp8_model = model
        fp8_eval = core.fp8_eval
        _wrap_forward(model, lambda training: core._fp8_context(training or fp8_eval))
        if self.distributed_type != DistributedType.NO:
            _keep_fp8_meta_out_of_ddp(model)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None):
        core = self._fp8_core
        if core is None or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if core.optimizer_state == "fp8":
            optimizer = self._to_fp8_optimizer(optimizer)
        if device_placement is None:
            device_placement = self.device_placement
        prepared = FP8AcceleratedOptimizer(optimizer, core.engine, device_placement=device_placement)
        self._optimizers.append(prepared)
        return prepared

    def _to_fp8_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from lightning_fp8.optim import rebind_lr_schedulers, to_fp8_optimizer, unsupported_optimizer_message

        new = to_fp8_optimizer(optimizer, **self._fp8_core.optimizer_kwargs)
        if new is None:
            warnings.warn(unsupported_optimizer_message(optimizer), UserWarning, stacklevel=3)
            return optimizer
        # schedulers are usually built on the user's optimizer before prepare(): re-point those prepared already
        # here, and the rest when they reach prepare_scheduler
        self._fp8_swapped_optimizers.append((optimizer, new))
        rebind_lr_schedulers([s.scheduler for s in self._schedulers], optimizer, new)
        self._fp8_core.engine.replace_optimizer(optimizer, new)
        return new

    def prepare_scheduler(self, scheduler):
        if self._fp8_swapped_optimizers:
            from lightning_fp8.optim import rebind_lr_schedulers

            for old, new in self._fp8_swapped_optimizers:
                rebind_lr_schedulers([scheduler], old, new)
        return super().prepare_scheduler(scheduler)

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
            raise RuntimeError(
                "lightning_fp8: gradients were unscaled / clipped in the middle of gradient accumulation. Clip on the "
                "step that updates the weights, as Accelerate documents: `if accelerator.sync_gradients: "
                "accelerator.clip_grad_norm_(model.parameters(), max_norm)` (the micro-batches still to come would "
                "add loss-scaled gradients to unscaled ones)."
            )
        if optimizer is None:
            optimizers = self._optimizers
        elif isinstance(optimizer, (list, tuple)):
            optimizers = optimizer
        else:
            optimizers = [optimizer]
        for opt in optimizers:
            self._fp8_core.engine.unscale_(_inner(opt))

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip on unscaled gradients. With the L2 norm over exactly one optimizer's parameters (the usual
        `model.parameters()`) this is engine.clip_grad_norm_: norm in fp32, a non-finite norm skips the step."""
        if self._fp8_core is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        params = list(parameters)
        owners = self._owners(params)
        self.unscale_gradients(owners or None)
        engine = self._fp8_core.engine
        if float(norm_type) == 2.0 and owners:
            # a subset of parameters (or parameters of several optimizers) is clipped together; a non-finite norm
            # marks the step as skipped in the engine
            return engine.clip_grad_norm_(_inner(owners[0]), max_norm, parameters=params)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self._fp8_core is None:
            return super().clip_grad_value_(parameters, clip_value)
        params = list(parameters)
        owners = self._owners(params)
        self.unscale_gradients(owners or None)
        clipping.clip_grad_value_([p.grad for p in params], clip_value)

    def _owners(self, params: Sequence[torch.Tensor]) -> List[AcceleratedOptimizer]:
        ids = {id(p) for p in params}
        return [
            opt for opt in self._optimizers
            if any(id(p) in ids for group in _inner(opt).param_groups for p in group["params"])
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


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _wrap_forward(model: nn.Module, context: Callable[[bool], Any]) -> None:
    """Run model.forward inside `context(model.training)`, outputs converted to fp32 as Accelerate's own
    mixed-precision wrapper does. Built like Accelerate's (MethodType over the function, a `__wrapped__` chain,
    `_original_forward`) so `accelerator.unwrap_model(model, keep_fp32_wrapper=False)` removes it."""
    if _is_wrapped(model.forward):
        return
    model._original_forward = model.forward
    func = getattr(model.forward, "__func__", None)
    if func is not None:
        @functools.wraps(func)
        def forward(self, *args, **kwargs):
            with context(self.training):
                return func(self, *args, **kwargs)

        forward._lightning_fp8_forward = True  # type: ignore[attr-defined]
        model.forward = MethodType(convert_outputs_to_fp32(forward), model)
    else:  # forward already replaced by a plain callable (Accelerate handles this case the same way)
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with context(model.training):
                return original(*args, **kwargs)

        forward._lightning_fp8_forward = True  # type: ignore[attr-defined]
        model.forward = convert_outputs_to_fp32(forward)


def _is_wrapped(forward: Any) -> bool:
    while forward is not None:
        if getattr(forward, "_lightning_fp8_forward", False):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def _keep_fp8_meta_out_of_ddp(model: nn.Module) -> None:
    """Exclude FP8 metadata buffers from DDP's buffer broadcast.

    DDP (broadcast_buffers=True, its default) copies rank 0's buffers to every rank before each forward. The engine
    already keeps scales and amax histories identical across ranks (MAX all-reduce of amaxes, then the same update
    everywhere), so the broadcast only does harm: it overwrites the per-rank overflow counters the engine diffs to
    detect new overflows (a rank-0-only overflow would then be seen again on the other ranks one step later and skip
    a second, clean step), and inside `accumulate()` it overwrites the amax the other ranks recorded in the earlier
    micro-batches before the all-reduce sees it.
    """
    names = [name for name, _ in model.named_buffers() if FP8_META_MARKER in f".{name}"]
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, existing + names)


# -- `python -m lightning_fp8.accelerate launch ...` ----------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> None:
    """`accelerate` CLI with `launch --mixed_precision fp8` allowed without TE / torchao / MS-AMP.

    Accelerate's launcher refuses fp8 unless one of its backends is importable (accelerate.utils.launch checks
    `is_fp8_available()` before starting the script). Scripts built on FP8Accelerator do not need one, so this entry
    point answers that check with True and hands everything else to Accelerate unchanged: same flags, same config
    files, same environment the script sees.
    """
    import accelerate.utils.launch as launch_utils
    from accelerate.commands.accelerate_cli import main as accelerate_main

    launch_utils.is_fp8_available = lambda: True
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["accelerate", *argv]
    accelerate_main()


__all__ = ["FP8Accelerator", "FP8AcceleratorMixin", "FP8Kwargs", "FP8AcceleratedOptimizer", "main"]


if __name__ == "__main__":
    main()
