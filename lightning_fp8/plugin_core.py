"""What the Lightning and Fabric precision plugins share: option validation, conversion, autocast, engine.

The two plugin classes inherit this mixin next to their framework's Precision base and only translate hooks.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, Optional, Union

import torch
from torch import nn

from lightning_fp8.autocast import fp8_autocast
from lightning_fp8.convert import ModuleFilter, convert_to_fp8
from lightning_fp8.engine.engine import FP8TrainingEngine, StabilityConfig
from lightning_fp8.engine.loss_scaler import LossScaling
from lightning_fp8.presets import get_preset
from lightning_fp8.recipe import FP8Recipe

OPTIMIZER_STATE_CHOICES = ("fp32", "fp8")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP8_META_MARKER = ".fp8_meta."


class FP8PrecisionCore:
    """Options and shared behaviour of the FP8 precision plugins (see FP8Precision for the documentation)."""

    precision = "fp8-mixed"

    def __init__(
        self,
        recipe: Optional[FP8Recipe] = None,
        preset: Optional[str] = None,
        module_filter: Optional[ModuleFilter] = None,
        loss_scaling: LossScaling = "auto",
        snapshot_every: int = 50,
        max_consecutive_skips: int = 10,
        max_rollbacks: int = 3,
        spike_factor: Optional[float] = None,
        optimizer_state: str = "fp32",
        compute_dtype: Union[str, torch.dtype] = "bf16",
        fp8_eval: bool = True,
        rollback_window: int = 1000,
        init_loss_scale: float = 2.0**8,
        optimizer_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        if recipe is not None and preset is not None:
            raise ValueError("give FP8Precision either recipe= or preset=, not both (a preset is a named recipe)")
        if recipe is not None and not isinstance(recipe, FP8Recipe):
            raise TypeError(f"recipe must be an FP8Recipe, got {type(recipe).__name__}")
        self.recipe = recipe if recipe is not None else get_preset(preset or "default")
        self.preset = preset
        self.module_filter = module_filter
        if optimizer_state not in OPTIMIZER_STATE_CHOICES:
            raise ValueError(f"optimizer_state={optimizer_state!r} is not valid; valid choices: {list(OPTIMIZER_STATE_CHOICES)}")
        self.optimizer_state = optimizer_state
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.compute_dtype = _resolve_compute_dtype(compute_dtype)
        self.fp8_eval = bool(fp8_eval)
        self.engine = FP8TrainingEngine(
            self.recipe,
            StabilityConfig(
                loss_scaling=loss_scaling,
                init_loss_scale=init_loss_scale,
                snapshot_every=snapshot_every,
                max_consecutive_skips=max_consecutive_skips,
                max_rollbacks=max_rollbacks,
                rollback_window=rollback_window,
                spike_factor=spike_factor,
            ),
            compute_dtype=self.compute_dtype,
        )
        self._module: Optional[nn.Module] = None

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
        module = convert_to_fp8(module, self.recipe, self.module_filter)
        exclude_fp8_meta_from_ddp_broadcast(module)
        self._module = module
        self.engine.attach(module)
        return module

    def _device_type(self) -> str:
        if self._module is not None:
            for p in self._module.parameters():
                return p.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @contextlib.contextmanager
    def _fp8_context(self, fp8: bool) -> Iterator[None]:
        with torch.autocast(self._device_type(), dtype=self.compute_dtype), fp8_autocast(enabled=fp8):
            yield

    def forward_context(self):
        return self._fp8_context(True)

    # -- checkpoint state ---------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"engine": self.engine.state_dict(), "preset": self.preset}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict["engine"])
        saved_recipe = FP8Recipe.from_dict(state_dict["engine"]["recipe"])
        if saved_recipe != self.recipe:
            warnings.warn(
                f"lightning_fp8: the checkpoint was trained with {saved_recipe}, this run uses {self.recipe}; "
                "the scaling state is loaded as it is."
            )
        meta = state_dict.get("fp8_meta")
        if meta and self._module is not None:
            load_fp8_meta(self._module, meta)
        self.engine.resync()


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


def split_fp8_meta(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Remove the FP8 metadata entries from a model state_dict (in place) and return them."""
    keys = [k for k in state_dict if FP8_META_MARKER in f".{k}"]
    return {k: state_dict.pop(k) for k in keys}


def load_fp8_meta(module: nn.Module, meta: Dict[str, torch.Tensor]) -> None:
    result = module.load_state_dict(meta, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(
            "lightning_fp8: the checkpoint holds FP8 metadata for layers this model does not have in FP8: "
            f"{result.unexpected_keys[:5]}{' ...' if len(result.unexpected_keys) > 5 else ''}"
        )


def _resolve_compute_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in COMPUTE_DTYPES.values():
        return value
    if value in COMPUTE_DTYPES:
        return COMPUTE_DTYPES[value]
    raise ValueError(f"compute_dtype={value!r} is not valid; valid choices: {list(COMPUTE_DTYPES)}")
