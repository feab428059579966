"""Models built inside the plugins' `module_init_context`: their linear layers are constructed as FP8 layers.

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

Which layers stay in BF16 is not known while the model is being built (the first / last rule needs the whole model,
a module_filter the layer's name), so a layer built here is provisional (`CONSTRUCTED_ATTR`) until the next
conversion call decides it with the conversion rules (`settle_constructed_layers`):

- before sharding (the model is neither FSDP2- nor tensor-parallel-sharded: Fabric's `setup`, Lightning's conversion
  before `configure_model`, a model built in configure_model that nothing sharded): every provisional layer is given
  back its plain class and the model converts as any other, with every rule (a traced forward for first / last where
  an example input exists);
- after sharding (built and sharded inside configure_model): layers cannot be replaced any more. Each provisional
  layer gets the decision the rules make for it, with `module order` for first / last (a traced forward would run
  the sharded model's collectives): a layer the rules keep in BF16 stays an FP8Linear with `fp8_enabled=False` and
  the rule's reason (the precision map shows it), computes in BF16 and, under FSDP2, gathers its weight in high
  precision only (`gather_in_high_precision`). Per-layer recipes (`layer_recipes`) are applied then too.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from lightning_fp8.conversion.convert import _first_last_reasons, fp8_layers, plan_conversion
from lightning_fp8.conversion.filters import scaling_skip_reason
from lightning_fp8.conversion.layer_recipes import normalize_layer_recipes, recipe_for
from lightning_fp8.conversion.order import LayerOrder, module_order
from lightning_fp8.conversion.transplant import to_unconverted
from lightning_fp8.distributed.all_gather import (
    disable_fp8_all_gather,
    enable_fp8_all_gather_layer,
    gather_in_high_precision,
    uses_fp8_all_gather,
)
from lightning_fp8.distributed.sharding import is_fsdp_sharded
from lightning_fp8.modules.linear import FP8Layer, FP8Linear
from lightning_fp8.modules.tensor_parallel import is_dtensor

if TYPE_CHECKING:  # pragma: no cover
    from lightning_fp8.integrations._core import FP8PrecisionCore

#: set on an FP8Linear built inside `constructing_fp8_layers`, until a conversion call decided it
CONSTRUCTED_ATTR = "_fp8_constructed"
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
        layer.__dict__[CONSTRUCTED_ATTR] = True
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


# -- deciding the provisional layers -------------------------------------------------------------------------------
def constructed_layers(model: nn.Module) -> Dict[str, FP8Linear]:
    """The provisional FP8 layers of `model` (built in a context, not decided yet), by fully qualified name."""
    return {fqn: m for fqn, m in fp8_layers(model).items() if m.__dict__.get(CONSTRUCTED_ATTR)}


def _is_sharded(layer: nn.Module) -> bool:
    return any(is_dtensor(p) for p in layer.parameters(recurse=False))


def settle_constructed_layers(core: "FP8PrecisionCore", model: nn.Module) -> int:
    """Decide every provisional layer of `model` with the conversion rules (module docstring); returns how many there
    were. Before sharding they become plain linear layers again (the caller's conversion then decides them as any
    other); after sharding each is kept in FP8 or switched to BF16 in place."""
    pending = constructed_layers(model)
    if not pending:
        return 0
    with suspended():
        if not is_fsdp_sharded(model) and not any(_is_sharded(layer) for layer in pending.values()):
            _give_back_plain_layers(model, pending)
        else:
            _decide_in_place(core, model, pending)
    return len(pending)


def _give_back_plain_layers(model: nn.Module, pending: Dict[str, FP8Linear]) -> None:
    parents = _parent_index(model)
    for layer in pending.values():
        disable_fp8_all_gather(layer)  # a weight made an FP8 all-gather weight as it was built: plain again
        plain = to_unconverted(layer)
        for parent, name in parents.get(id(layer), []):
            setattr(parent, name, plain)


def _decide_in_place(core: "FP8PrecisionCore", model: nn.Module, pending: Dict[str, FP8Linear]) -> None:
    decisions = _plan_after_sharding(core, model, pending)
    layer_recipes = normalize_layer_recipes(core.options.layer_recipes)
    users: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        users[id(p)] = users.get(id(p), 0) + 1
    kept: List[str] = []
    for fqn, layer in pending.items():
        layer.__dict__.pop(CONSTRUCTED_ATTR, None)
        reason = decisions.get(fqn)
        if reason is None:
            recipe = recipe_for(fqn, core.recipe, layer_recipes)
            reason = scaling_skip_reason(layer, recipe)
            if reason is None and recipe != layer.recipe:
                layer.recipe = recipe  # a per-layer recipe (before the first forward: the history resizes)
        if reason is not None:
            layer.fp8_enabled = False
            layer.fp8_disabled_reason = reason
            kept.append(fqn)
            if uses_fp8_all_gather(layer):
                gather_in_high_precision(layer, "computes in BF16: kept there by the conversion rules")
        elif not uses_fp8_all_gather(layer) and core.options.fp8_all_gather and is_fsdp_sharded(model):
            _explain_high_precision_gather(layer, fqn, users)


def _explain_high_precision_gather(layer: FP8Linear, fqn: str, users: Dict[int, int]) -> None:
    """Why a layer built with an FP8 all-gather weight gathers in high precision after all (its weight was replaced
    after it was built: tied to another module's, or assigned)."""
    from lightning_fp8.distributed.all_gather import _REASON_ATTR, _ineligible_reason

    if _REASON_ATTR not in layer.__dict__:
        layer.__dict__[_REASON_ATTR] = (_ineligible_reason(layer, fqn, users)
                                        or "its weight was replaced after the layer was built (FP8 all-gather is "
                                           "installed on the weight a layer is built with)")


def _plan_after_sharding(core: "FP8PrecisionCore", model: nn.Module,
                         pending: Dict[str, FP8Linear]) -> Dict[str, Optional[str]]:
    """The conversion plan for the provisional layers as if they were plain nn.Linear: each stands in for a moment as a
    plain nn.Linear over the same Parameters (in its parents only; nothing FSDP2 holds changes), the rules run without
    a traced forward, and first / last is taken in module order."""
    parents = _parent_index(model)
    swapped: List[Tuple[nn.Module, str, nn.Module]] = []
    try:
        for layer in pending.values():
            stand_in = _stand_in(layer)
            for parent, name in parents.get(id(layer), []):
                parent._modules[name] = stand_in
                swapped.append((parent, name, layer))
        recipe = dataclasses.replace(core.recipe, keep_first_last_in_bf16=False)
        plan = plan_conversion(model, recipe, core.module_filter, example_input=None,
                               layer_recipes=core.options.layer_recipes)
        if core.module_filter is None and core.recipe.keep_first_last_in_bf16:
            # what plan_conversion counts: layers that would convert, and FP8 layers converted before (enabled)
            candidates = [fqn for fqn, module in model.named_modules()
                          if plan.get(fqn, "") is None or (isinstance(module, FP8Layer) and module.fp8_enabled)]
            if candidates:
                for fqn, reason in _first_last_reasons(_module_order(model, candidates), model).items():
                    if fqn in plan:
                        plan[fqn] = reason
    finally:
        for parent, name, layer in swapped:
            parent._modules[name] = layer
    return plan


def _module_order(model: nn.Module, candidates: List[str]) -> LayerOrder:
    """First / last without a trace (conversion/order.py `module_order`: registration order corrected by structure)."""
    return module_order(model, candidates, AFTER_SHARDING_NOTE)


def _stand_in(layer: FP8Linear) -> nn.Module:
    stand_in = _ORIGINAL_LINEAR.__new__(_ORIGINAL_LINEAR)
    nn.Module.__init__(stand_in)
    stand_in.in_features, stand_in.out_features = layer.in_features, layer.out_features
    stand_in.weight = layer.weight
    stand_in.bias = layer.bias
    stand_in.train(layer.training)
    return stand_in


def _parent_index(model: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    """id(child) -> [(parent, attribute name), ...] (a module shared by several parents is found in each)."""
    index: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                index.setdefault(id(child), []).append((parent, name))
    return index


__all__ = ["CONSTRUCTED_ATTR", "FP8LinearBuilder", "constructing_fp8_layers", "suspended", "set_fp8_all_gather",
           "constructed_layers", "settle_constructed_layers"]
