"""Replace a layer by its FP8 twin (or back) without losing anything the user attached to it.

An FP8 layer is a new module object built around the original's Parameters (`FP8Linear.from_linear`,
`FP8Conv1D.from_conv1d`), so the Parameters, their `requires_grad` flags, optimizer references and weight tying
survive by construction. What lives on the module object itself is moved here:

- hooks: forward, forward-pre (with kwargs, always-called), backward (full and pre), state_dict and load_state_dict
  hooks. The hook dicts move as objects, so a `RemovableHandle` the user kept still removes its hook afterwards.
- torch parametrizations (`torch.nn.utils.parametrize`, e.g. `parametrizations.weight_norm` / `spectral_norm`): the
  new layer is parametrized the same way over the same `original*` Parameters (conversion happens *underneath* the
  parametrization: the FP8 layer casts the weight the parametrization computes at each forward).
- extra Parameters, buffers, submodules and attributes (the `weight_orig` / `weight_u` of the hook-based
  `torch.nn.utils.spectral_norm`, a flag a library set on the layer).

What the FP8 layer itself added (its metadata, switches, its own state_dict hooks) is recorded at conversion and left
behind by `revert`.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, FrozenSet, Optional, Set, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

#: the nn.Module attributes that hold hooks (all present since torch 2.0)
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
#: recorded on an FP8 layer by `to_fp8`: what the FP8 layer added (left behind on revert)
_INTERNALS_ATTR = "_fp8_internal_names"
_OWN_HOOKS_ATTR = "_fp8_internal_hooks"


def replace_with(old: nn.Module, build: Callable[[nn.Module], nn.Module], exclude: FrozenSet[str] = frozenset(),
                 own_hooks: Optional[Dict[str, Set[int]]] = None) -> nn.Module:
    """`build(old)` (a module around old's Parameters), then everything old carried moved onto it.

    When old's weight or bias is not a Parameter of its own (torch parametrizations; the hook-based
    `torch.nn.utils.weight_norm` / `spectral_norm`, which store the computed weight as a plain attribute), `build`
    sees a stand-in of old's unparametrized class with placeholder Parameters, and the result gets old's
    parametrizations / attributes back. `exclude`: names on `old` not to carry; `own_hooks`: hook ids on `old` not
    to carry."""
    computed = [n for n in ("weight", "bias") if isinstance(old.__dict__.get(n), torch.Tensor)]
    if parametrize.is_parametrized(old) or computed:
        new = _build_with_stand_in(old, build, computed)
    else:
        new = build(old)
    _carry(old, new, exclude, own_hooks or {})
    return new


def to_fp8(old: nn.Module, build: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Conversion: `replace_with`, recording what the FP8 layer added so `to_unconverted` leaves it behind."""

    def build_and_record(module: nn.Module) -> nn.Module:
        new = build(module)
        new.__dict__[_OWN_HOOKS_ATTR] = {name: set(getattr(new, name)) for name in HOOK_DICTS}
        return new

    new = replace_with(old, build_and_record)
    added = _names(new) - _names(old)
    new.__dict__[_INTERNALS_ATTR] = frozenset(added | {_INTERNALS_ATTR, _OWN_HOOKS_ATTR})
    return new


def to_unconverted(layer: nn.Module) -> nn.Module:
    """Revert: the FP8 layer's `to_unconverted()`, with what the user attached carried back."""
    internals = layer.__dict__.get(_INTERNALS_ATTR)
    own_hooks = layer.__dict__.get(_OWN_HOOKS_ATTR)
    if internals is None:  # an FP8 layer built directly, not by conversion: only the user's hooks move
        internals = frozenset(_names(layer))
        own_hooks = {name: {k for k, hook in getattr(layer, name).items() if _is_library_hook(hook)} for name in HOOK_DICTS}
    source = getattr(parametrize.type_before_parametrizations(layer), "_fp8_source_class", None)

    def unconverted(module: nn.Module) -> nn.Module:
        plain = module.to_unconverted()
        if source is not None and type(plain) is not source:  # converted from a subclass: give that class back
            plain.__class__ = source
        return plain

    return replace_with(layer, unconverted, exclude=internals, own_hooks=own_hooks)


def parametrization_mismatch(module: nn.Module, shapes: Dict[str, Tuple[int, ...]]) -> Optional[str]:
    """Why an FP8 layer cannot sit under this module's parametrizations (None: it can). Only a parametrization
    registered with unsafe=True may compute a tensor of another shape than the one it replaced (weight_norm registers
    that way and keeps the shape); it is evaluated once, in eval mode, to check."""
    if not parametrize.is_parametrized(module):
        return None
    for name, plist in module.parametrizations.items():
        if plist.unsafe and name in shapes:
            shape = tuple(_evaluated(plist).shape)
            if shape != tuple(shapes[name]):
                return (f"the parametrization of {name} computes shape {shape}, not the {tuple(shapes[name])} the "
                        "layer's GEMM needs (registered with unsafe=True)")
    return None


# -- internals ----------------------------------------------------------------------------------------------------
def _names(module: nn.Module) -> Set[str]:
    return set(module.__dict__) | set(module._parameters) | set(module._buffers) | set(module._modules)


def _build_with_stand_in(old: nn.Module, build: Callable[[nn.Module], nn.Module], computed) -> nn.Module:
    """`build` on a stand-in of old's unparametrized class whose computed tensors are placeholder Parameters; then
    old's parametrizations moved onto the result (its computed plain attributes are carried by `_carry`)."""
    plists = old.parametrizations if parametrize.is_parametrized(old) else {}
    placeholders = {name: _placeholder(plists[name]) for name in plists}
    placeholders.update({n: nn.Parameter(torch.empty_like(old.__dict__[n]), requires_grad=False) for n in computed})
    base = parametrize.type_before_parametrizations(old)
    stand_in = base.__new__(base)
    state = {k: v for k, v in old.__dict__.items() if k not in computed}
    state["_parameters"] = {**old._parameters, **placeholders}
    state["_modules"] = {k: v for k, v in old._modules.items() if k != "parametrizations"}
    stand_in.__dict__.update(state)
    new = build(stand_in)
    for name, placeholder in placeholders.items():
        if new._parameters.get(name) is placeholder:
            del new._parameters[name]
    if plists:
        parametrize._inject_new_class(new)
        new.parametrizations = plists
        for name in plists:
            parametrize._inject_property(new, name)
    return new


def _placeholder(plist: nn.Module) -> nn.Parameter:
    """A Parameter shaped like the tensor the parametrization computes, on its device."""
    return nn.Parameter(torch.empty_like(_evaluated(plist)), requires_grad=False)


@torch.no_grad()
def _evaluated(plist: nn.Module) -> torch.Tensor:
    """The parametrized tensor, computed with the parametrization modules in eval mode, so stateful ones
    (spectral_norm's power iteration) do not advance."""
    modes = [(m, m.training) for m in plist.modules()]
    try:
        for m, _ in modes:
            m.training = False
        return plist()
    finally:
        for m, mode in modes:
            m.training = mode


def _carry(old: nn.Module, new: nn.Module, exclude: FrozenSet[str], own_hooks: Dict[str, Set[int]]) -> None:
    for name in HOOK_DICTS:
        old_hooks = getattr(old, name)
        new_own = getattr(new, name)
        skip = own_hooks.get(name, set())
        for key in [k for k in old_hooks if k in skip]:
            del old_hooks[key]
        old_hooks.update(new_own)  # the new layer's own hooks run after the user's
        new.__dict__[name] = old_hooks
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
    for wrapped in new._load_state_dict_pre_hooks.values():  # hooks registered with_module hold the old module
        if getattr(wrapped, "with_module", False) and wrapped.module() is old:
            wrapped.module = weakref.ref(new)
    for name, param in old._parameters.items():
        if name not in new._parameters and name not in new.__dict__ and name not in exclude and name != "parametrizations":
            new._parameters[name] = param
    for name, buffer in old._buffers.items():
        if name not in new._buffers and name not in exclude:
            new._buffers[name] = buffer
            if name in old._non_persistent_buffers_set:
                new._non_persistent_buffers_set.add(name)
    for name, child in old._modules.items():
        if name not in new._modules and name not in exclude:
            new._modules[name] = child
    for name, value in old.__dict__.items():
        if name not in new.__dict__ and name not in exclude and not _is_property(new, name):
            new.__dict__[name] = value


def _is_library_hook(hook) -> bool:
    hook = getattr(hook, "hook", hook)  # _WrappedHook
    return (getattr(hook, "__module__", None) or "").startswith("lightning_fp8.")


def _is_property(module: nn.Module, name: str) -> bool:
    return isinstance(getattr(type(module), name, None), property)


def parent_index(model: nn.Module) -> Dict[int, list]:
    """id(child) -> [(parent, attribute name), ...] over the whole model (a module shared by several parents is found in
    each): where a replaced layer must be put."""
    index: Dict[int, list] = {}
    seen = set()
    for _, parent in model.named_modules(remove_duplicate=False):
        if id(parent) in seen:
            continue
        seen.add(id(parent))
        for name, child in parent._modules.items():
            if child is not None:
                index.setdefault(id(child), []).append((parent, name))
    return index


def replace_everywhere(parents: Dict[int, list], old: nn.Module, new: nn.Module) -> None:
    """Put `new` wherever `old` is registered (`parents`: `parent_index`'s, kept up to date)."""
    entries = parents.pop(id(old), [])
    for parent, name in entries:
        setattr(parent, name, new)
    parents[id(new)] = entries
