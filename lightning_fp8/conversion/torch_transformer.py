"""PyTorch's own transformer layers for conversion: nn.MultiheadAttention's projections made modules, and the
transformer encoder's fast path kept off where they compute in FP8.

    expose_projections(model)      every nn.MultiheadAttention (or subclass keeping its forward) becomes a
                                   ProjectedMultiheadAttention in place (lightning_fp8/modules/multihead_attention.py): same
                                   object, Parameters and state_dict keys; q_proj / k_proj / v_proj / out_proj are
                                   then linear layers conversion can decide on like any other
    hide_projections(attention)    undo it for one attention (conversion does so where none of its projections
                                   converts, so an unconverted attention stays torch's own, fast path included)
    shared_input_projections(model) which of those projections read one input (the first/last rule's groups
                                   without a traced forward)
    guard_fast_paths(model)        nn.TransformerEncoderLayer / nn.TransformerEncoder holding an FP8 projection get the
                                   FastPathFree mixin (their eval fast path would read the Parameters directly)
    restore(model)                 everything above undone (revert_fp8)
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch import nn

from lightning_fp8.modules.multihead_attention import (
    PROJECTION_NAMES,
    FastPathFree,
    ProjectedMultiheadAttention,
    projections_for,
)
from lightning_fp8.modules.linear import FP8Layer

#: on a projected attention / a guarded encoder: the class to give back
ORIGINAL_CLASS_ATTR = "_fp8_original_class"
#: on an out_proj its (projected) attention calls as a module: conversion may replace it
CALLED_AS_MODULE_ATTR = "_fp8_called_as_module"
#: on an attention left as torch's: why none of its projections converts (the precision map shows it)
ATTENTION_REASON_ATTR = "_fp8_attention_reason"

_PROJECTED: Dict[type, type] = {}
_GUARDED: Dict[type, type] = {}


def _projectable(module: nn.Module) -> bool:
    cls = type(module)
    return (isinstance(module, nn.MultiheadAttention) and not isinstance(module, ProjectedMultiheadAttention)
            and cls.forward is nn.MultiheadAttention.forward)


def _projected_class(cls: type) -> type:
    if cls is nn.MultiheadAttention:
        return ProjectedMultiheadAttention
    if cls not in _PROJECTED:
        _PROJECTED[cls] = type(f"Projected{cls.__name__}", (ProjectedMultiheadAttention, cls),
                               {"__module__": cls.__module__})
    return _PROJECTED[cls]


def expose_projections(model: nn.Module) -> List[Tuple[str, nn.MultiheadAttention]]:
    """Turn every projectable attention of `model` into a ProjectedMultiheadAttention; returns (fqn, module) of those
    it changed. q_proj, k_proj and v_proj are registered before out_proj, in the order the forward runs them."""
    changed = []
    for fqn, module in list(model.named_modules()):
        if not _projectable(module):
            continue
        projections = projections_for(module)
        module.__dict__[ORIGINAL_CLASS_ATTR] = type(module)
        module.__dict__.pop(ATTENTION_REASON_ATTR, None)
        module.__class__ = _projected_class(type(module))
        others = dict(module._modules)
        module._modules.clear()
        module._modules.update(zip(PROJECTION_NAMES, projections))
        module._modules.update(others)
        module.out_proj.__dict__[CALLED_AS_MODULE_ATTR] = True
        changed.append((fqn, module))
    return changed


def hide_projections(attention: nn.Module) -> None:
    """Give a projected attention its original class back (its projections must not be FP8 layers)."""
    for name in PROJECTION_NAMES:
        if isinstance(attention._modules.get(name), FP8Layer):
            raise RuntimeError(f"lightning_fp8: {name} of this attention is an FP8 layer; revert it first")
        attention._modules.pop(name, None)
    attention.__class__ = attention.__dict__.pop(ORIGINAL_CLASS_ATTR)
    out_proj = attention._modules.get("out_proj")
    if out_proj is not None:
        out_proj.__dict__.pop(CALLED_AS_MODULE_ATTR, None)


def keep_converting_attentions(changed: List[Tuple[str, nn.MultiheadAttention]], decisions: Dict[str, object]) -> None:
    """Undo the projection of every attention none of whose projections converts (decisions: {fqn: None to convert,
    else the reason}), recording why on it."""
    for fqn, attention in changed:
        names = [f"{fqn}.{name}" if fqn else name for name in (*PROJECTION_NAMES, "out_proj")]
        if any(name in decisions and decisions[name] is None for name in names):
            continue
        hide_projections(attention)
        q_reason = decisions.get(names[0])
        if q_reason is not None:
            attention.__dict__[ATTENTION_REASON_ATTR] = f"its projections stay in BF16 (q_proj: {q_reason})"


def shared_input_projections(model: nn.Module) -> List[List[str]]:
    """The input projections of each projected nn.MultiheadAttention of `model` that read one tensor, as groups of
    fully qualified names (q_proj, k_proj, v_proj order), for the first/last rule without a traced forward
    (conversion/first_last.py):

    - a self-attention (kdim == vdim == embed_dim, the packed in_proj_weight; how nn.TransformerEncoderLayer's
      `self_attn`, a ViT's or a GPT's attention is used: `attn(x, x, x)`): q, k and v;
    - nn.TransformerDecoderLayer's `multihead_attn` (cross-attention: the query is the decoder's stream, key and value
      are the encoder's memory): k and v;
    - separate kdim / vdim (a cross-attention): k and v when kdim == vdim, else none.
    A traced forward sees which tensors each projection receives and needs none of this."""
    groups: List[List[str]] = []
    cross = {id(m.multihead_attn) for m in model.modules() if isinstance(m, nn.TransformerDecoderLayer)}
    for fqn, module in model.named_modules():
        if not isinstance(module, ProjectedMultiheadAttention):
            continue
        prefix = f"{fqn}." if fqn else ""
        if module._qkv_same_embed_dim and id(module) not in cross:
            roles = PROJECTION_NAMES
        elif module.kdim == module.vdim:
            roles = PROJECTION_NAMES[1:]
        else:
            continue
        groups.append([prefix + role for role in roles if role in module._modules])
    return groups


def guard_fast_paths(model: nn.Module) -> None:
    """FastPathFree on every nn.TransformerEncoderLayer / nn.TransformerEncoder that holds an FP8 layer."""
    for module in model.modules():
        cls = type(module)
        if isinstance(module, FastPathFree) or not isinstance(module, (nn.TransformerEncoderLayer,
                                                                        nn.TransformerEncoder)):
            continue
        if not any(isinstance(m, FP8Layer) for m in module.modules()):
            continue
        if cls not in _GUARDED:
            _GUARDED[cls] = type(cls.__name__, (FastPathFree, cls), {"__module__": cls.__module__,
                                                                     "__qualname__": cls.__qualname__})
        module.__dict__[ORIGINAL_CLASS_ATTR] = cls
        module.__class__ = _GUARDED[cls]


def restore(model: nn.Module) -> None:
    """Undo guard_fast_paths and expose_projections on `model` (its FP8 layers must be reverted first)."""
    for module in model.modules():
        if isinstance(module, FastPathFree) and ORIGINAL_CLASS_ATTR in module.__dict__:
            module.__class__ = module.__dict__.pop(ORIGINAL_CLASS_ATTR)
    for module in list(model.modules()):
        if isinstance(module, ProjectedMultiheadAttention) and ORIGINAL_CLASS_ATTR in module.__dict__:
            hide_projections(module)
