"""Optional Transformer Engine backend: the same FP8Recipe, run by NVIDIA's TE modules instead of FP8Linear.

    from lightning_fp8.backends.transformer_engine import convert_to_te, te_autocast
    model = convert_to_te(model, recipe)           # nn.Linear -> te.Linear (the same Parameters)
    with te_autocast(recipe):                      # te.autocast / te.fp8_autocast with a recipe built from ours
        loss = model(x).sum()

or, with the plugins' loss scaling, skip and rollback on top: `FP8Precision(backend="transformer_engine")`
(Lightning, Fabric) / `FP8Kwargs(backend="transformer_engine")` (Accelerate), which convert with
`convert_for_plugin` (the plugins' default filter decides which nn.Linear layers go to TE) and run every step under
`te_autocast`.

Only TE's public API is used: `transformer_engine.pytorch.Linear`, `transformer_engine.pytorch.autocast` (`recipe=`)
or the older `transformer_engine.pytorch.fp8_autocast` (`fp8_recipe=`), and the recipe classes of
`transformer_engine.common.recipe`. Which FP8Recipe becomes which TE recipe, and what is refused by name:
`lightning_fp8.backends.te_recipes`. TE is not a dependency (`pip install lightning-fp8[te]`); without it every entry
point raises an ImportError that says so.

The engine's loss scaling, skip and rollback keep working on top (they act on parameters, gradients and the loss),
but TE layers have no `fp8_enabled` switch and no lightning_fp8 scaling state: per-layer fallback, the scale
monitor's statistics, calibration, layer_recipes, the engine's per-layer scale sync and FP8 all-gather do not see
inside them (TE keeps and reduces its own scales).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

from torch import nn

from lightning_fp8.backends.te_recipes import te_recipe_from
from lightning_fp8.recipe import FP8Recipe

_INSTALL_HINT = (
    "Transformer Engine is not installed; the TE backend needs it: pip install 'lightning-fp8[te]' "
    "(or transformer-engine[pytorch] matching your CUDA and torch). Without TE, use lightning_fp8's own "
    "convert_to_fp8 / fp8_autocast."
)


def te_available() -> bool:
    """True when `transformer_engine.pytorch` can be imported."""
    try:
        if importlib.util.find_spec("transformer_engine") is None:
            return False
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # find_spec raises ValueError for a module in sys.modules without a spec; TE raises without CUDA
        return False
    return True


def _te() -> ModuleType:
    """`transformer_engine.pytorch`: the one place the backend imports it."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err


def _te_recipe_module() -> ModuleType:
    """`transformer_engine.common.recipe`: the one place the backend imports it."""
    try:
        return importlib.import_module("transformer_engine.common.recipe")
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err


def te_recipe(recipe: Optional[FP8Recipe] = None) -> Any:
    """TE's recipe object for our FP8Recipe (the default recipe without one): `te_recipes.te_recipe_from` with the
    installed Transformer Engine. ValueError names every field TE cannot express."""
    return te_recipe_from(recipe if recipe is not None else FP8Recipe(), _te_recipe_module())


@contextlib.contextmanager
def te_autocast(recipe: Optional[FP8Recipe] = None, enabled: bool = True) -> Iterator[None]:
    """TE's FP8 autocast region with the recipe built from `recipe`."""
    te = _te()
    te_r = te_recipe(recipe)
    if hasattr(te, "autocast") and "recipe" in inspect.signature(te.autocast).parameters:
        ctx = te.autocast(enabled=enabled, recipe=te_r)
    elif hasattr(te, "fp8_autocast"):
        ctx = te.fp8_autocast(enabled=enabled, fp8_recipe=te_r)
    else:
        raise RuntimeError("this Transformer Engine has neither te.autocast(recipe=...) nor te.fp8_autocast")
    with ctx:
        yield


def convert_to_te(
    model: nn.Module,
    recipe: Optional[FP8Recipe] = None,
    module_filter: Optional[Callable[[nn.Module, str], bool]] = None,
) -> nn.Module:
    """Replace the model's nn.Linear layers by te.Linear, in place; returns the model. Each te.Linear takes the
    original layer's `weight` / `bias` Parameters (optimizer references and tied weights stay valid, as with
    lightning_fp8's own conversion).

    Layers whose features are not multiples of 16 stay nn.Linear (TE's FP8 GEMMs need them aligned), as do those
    `module_filter(module, fqn)` rejects. The recipe is checked here so an inexpressible one fails at conversion."""
    te = _te()
    te_recipe(recipe)  # fail early on a recipe TE cannot express
    if isinstance(model, nn.Linear):
        raise TypeError("convert_to_te needs a container module (a bare nn.Linear has no parent to replace it in)")
    targets = []
    for fqn, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        if module_filter is not None and not module_filter(module, fqn):
            continue
        targets.append((fqn, module))
    for fqn, module in targets:
        new = te.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            params_dtype=module.weight.dtype,
            device=module.weight.device,
        )
        new.weight = module.weight
        if module.bias is not None:
            new.bias = module.bias
        new.train(module.training)
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model


#: why a linear layer stays as it is under backend="transformer_engine" although the plugins' filter would convert it
TE_LINEAR_ONLY = "the Transformer Engine backend converts nn.Linear layers only (this one stays in BF16)"


def convert_for_plugin(model: nn.Module, recipe: FP8Recipe,
                       module_filter: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """The plugins' conversion with backend="transformer_engine": the layers lightning_fp8's conversion would put in
    FP8 (its default filter: first / last, skip patterns, LoRA, alignment; or `module_filter`) that are nn.Linear
    become te.Linear; every other linear layer keeps its reason, so `precision_map` and the conversion summary say
    what runs where (te.Linear rows: "converted to FP8 by Transformer Engine")."""
    from lightning_fp8.conversion.convert import CONVERTED_ATTR, plan_conversion
    from lightning_fp8.conversion.filters import SKIP_REASON_ATTR

    plan = plan_conversion(model, recipe, module_filter)
    chosen = {fqn for fqn, reason in plan.items() if reason is None}
    convert_to_te(model, recipe, lambda module, fqn: fqn in chosen)
    for fqn, reason in plan.items():
        module = model.get_submodule(fqn) if fqn else model
        if type(module).__module__.split(".")[0] == "transformer_engine":
            continue
        module.__dict__[SKIP_REASON_ATTR] = reason if reason is not None else TE_LINEAR_ONLY
    model.__dict__[CONVERTED_ATTR] = True
    return model
