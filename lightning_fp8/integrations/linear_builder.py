"""Models built inside the plugins' `module_init_context`: `torch.nn.Linear(...)` builds FP8 layers there.

Lightning calls `configure_model` inside the precision plugin's `module_init_context()` and Fabric's `init_module()`
enters it too. A model built there and sharded in the same hook (the large-model form: build, then `fully_shard`) can
no longer be converted afterwards: FSDP2 keeps the modules it sharded and reads the FP8 all-gather extension when it
shards. So, as Lightning's own TransformerEnginePrecision does with `te.Linear`, `torch.nn.Linear` is replaced for the
duration of the context (`constructing_fp8_layers`): `nn.Linear(...)` builds an `FP8Linear` (an nn.Linear subclass;
`isinstance(m, nn.Linear)` holds for every linear, built before or inside the context), and, where FSDP2 may shard it
in the same hook (Lightning's configure_model under ModelParallelStrategy), with its weight already an FP8 all-gather
weight. Classes bound before the context (`from torch.nn import Linear` at import time, nn.Linear subclasses) are
not replaced: they convert as usual where the model can still be converted, otherwise the strategy's conversion
stops with an error naming them.

The layers built here are undecided until the next conversion call: conversion decides them with its rules
(lightning_fp8/conversion/built_layers.py); `settle_built_layers` applies what the decision means for a sharded
model (a layer kept in BF16 gathers its weight in high precision only) or gives a model no one sharded its plain
layers back for the conversion that follows.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from lightning_fp8.conversion.built_layers import (
    BUILT_UNDECIDED_ATTR,
    decided,
    give_back_plain_layers,
    plan_undecided,
    undecided_layers,
)
from lightning_fp8.conversion.filters import scaling_skip_reason
from lightning_fp8.conversion.layer_recipes import normalize_layer_recipes, recipe_for
from lightning_fp8.distributed.all_gather import (
    disable_fp8_all_gather,
    enable_fp8_all_gather_layer,
    explain_high_precision_gather,
    gather_in_high_precision,
    uses_fp8_all_gather,
)
from lightning_fp8.distributed.sharding import is_fsdp_sharded
from lightning_fp8.modules.linear import FP8Layer, FP8Linear
from lightning_fp8.modules.local_shards import is_dtensor

if TYPE_CHECKING:  # pragma: no cover
    from lightning_fp8.integrations.plugin_core import FP8PrecisionCore

#: why the first / last rule was applied in module order to layers decided after sharding
AFTER_SHARDING_NOTE = ("the layers were built and sharded inside configure_model, where a traced forward would run "
                       "the sharded model's collectives")

#: torch's own class, whatever `torch.nn.Linear` names while a context is active
_ORIGINAL_LINEAR = nn.Linear


class _Builder:
    """What `nn.Linear(...)` builds inside one `constructing_fp8_layers` context."""

    def __init__(self, core: "FP8PrecisionCore") -> None:
        self.core = core
        #: give each layer FP8 all-gather weights as it is built (set by the Lightning plugin around configure_model
        #: under ModelParallelStrategy, where fully_shard may follow in the same hook)
        self.fp8_all_gather = False
        self.batch: List[nn.Module] = []  # the layers built with FP8 all-gather: one amax agreement covers them

    def build(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
              dtype: Any = None) -> nn.Module:
        layer = FP8Linear(in_features, out_features, bias=bias, device=device, dtype=dtype, recipe=self.core.recipe)
        layer.__dict__[BUILT_UNDECIDED_ATTR] = True
        if self.fp8_all_gather:
            enable_fp8_all_gather_layer(layer, self.batch)
        return layer


#: the active contexts, innermost last; a None entry suspends construction (the library's own nn.Linear calls)
_ACTIVE: List[Optional[_Builder]] = []


class _LinearClass(type):
    """The replacement's metaclass: `isinstance` / `issubclass` against it answer for torch's nn.Linear, so checks
    in user code (`isinstance(m, nn.Linear)`) hold for linear layers built before the context too."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _ORIGINAL_LINEAR)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _ORIGINAL_LINEAR)


class FP8LinearBuilder(_ORIGINAL_LINEAR, metaclass=_LinearClass):
    """What `torch.nn.Linear` names inside `constructing_fp8_layers`: calling it builds an FP8Linear (or, while
    construction is suspended, torch's nn.Linear). A class derived from it inside the context is an ordinary
    nn.Linear subclass."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not FP8LinearBuilder:
            return super().__new__(cls)
        builder = _ACTIVE[-1] if _ACTIVE else None
        if builder is None:
            return _ORIGINAL_LINEAR(*args, **kwargs)
        return builder.build(*args, **kwargs)


@contextlib.contextmanager
def constructing_fp8_layers(core: "FP8PrecisionCore") -> Iterator[_Builder]:
    """For its duration, `torch.nn.Linear(...)` builds provisional FP8Linear layers (module docstring). Only for the
    lightning_fp8 backend (the Transformer Engine backend converts after construction)."""
    if core.options.backend != "lightning_fp8":
        yield _Builder(core)
        return
    builder = _Builder(core)
    _ACTIVE.append(builder)
    previous = torch.nn.Linear
    torch.nn.Linear = FP8LinearBuilder  # type: ignore[misc]
    try:
        yield builder
    finally:
        _ACTIVE.remove(builder)
        torch.nn.Linear = previous if _ACTIVE else _ORIGINAL_LINEAR  # type: ignore[misc]


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """torch's nn.Linear again while the library itself builds modules (conversion, reverts, stand-ins)."""
    _ACTIVE.append(None)
    try:
        yield
    finally:
        _ACTIVE.pop()


def set_fp8_all_gather(enabled: bool) -> None:
    """Whether layers built in the innermost active context get FP8 all-gather weights as they are built."""
    for builder in reversed(_ACTIVE):
        if builder is not None:
            builder.fp8_all_gather = enabled
            return


# -- applying the decisions -----------------------------------------------------------------------------------------
def settle_built_layers(core: "FP8PrecisionCore", model: nn.Module) -> int:
    """Decide every layer of `model` built in a context (conversion/built_layers.py); returns how many there were.
    Before sharding they become plain linear layers again (the caller's conversion then decides them as any other);
    after sharding each keeps its FP8 class and is switched to BF16 where the rules say so."""
    pending = undecided_layers(model)
    if not pending:
        return 0
    with suspended():
        if not is_fsdp_sharded(model) and not any(_is_sharded(layer) for layer in pending.values()):
            for layer in pending.values():
                disable_fp8_all_gather(layer)  # a weight made an FP8 all-gather weight as it was built: plain again
            give_back_plain_layers(model, pending)
        else:
            _decide_in_place(core, model, pending)
    return len(pending)


def _is_sharded(layer: nn.Module) -> bool:
    return any(is_dtensor(p) for p in layer.parameters(recurse=False))


def _decide_in_place(core: "FP8PrecisionCore", model: nn.Module, pending: Dict[str, FP8Layer]) -> None:
    decisions = plan_undecided(model, core.recipe, core.module_filter, core.options.layer_recipes, AFTER_SHARDING_NOTE)
    layer_recipes = normalize_layer_recipes(core.options.layer_recipes)
    users: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        users[id(p)] = users.get(id(p), 0) + 1
    for fqn, layer in pending.items():
        decided(layer)
        reason = decisions.get(fqn)
        if reason is None:
            recipe = recipe_for(fqn, core.recipe, layer_recipes)
            reason = scaling_skip_reason(layer, recipe)
            if reason is None and recipe != layer.recipe:
                layer.recipe = recipe  # a per-layer recipe (before the first forward: the history resizes)
        if reason is not None:
            layer.fp8_enabled = False
            layer.fp8_disabled_reason = reason
            if uses_fp8_all_gather(layer):
                gather_in_high_precision(layer, "computes in BF16: kept there by the conversion rules")
        elif not uses_fp8_all_gather(layer) and core.options.fp8_all_gather and is_fsdp_sharded(model):
            explain_high_precision_gather(layer, fqn, users)
