"""Mixture-of-experts layers in conversion: which experts modules take FP8 grouped GEMMs, what stays in high precision
(routers, experts the rules cannot read) and their rows in the precision map.

The rules for an experts module (lightning_fp8/modules/grouped_linear.py `experts_layout`), in order, each giving the reason
it stays in BF16:

- what no filter overrides: an expert GEMM whose dimensions are not multiples of 16 (torch's grouped scaled GEMM
  takes none other), a recipe whose scaling has no grouped FP8 GEMM (`grouped_recipe`), a layer recipe likewise;
- a `module_filter` (called with the experts module and its name) that returns False;
- the default filter: `FP8Recipe.skip_patterns`. Experts are never "first" or "last": the rule counts linear layers,
  and a model's experts sit between its attention layers.

Routers (the modules that score the experts: transformers' `*TopKRouter` / `*Router` classes, or a linear layer
named `gate` / `router` beside an experts module whose outputs are one per expert) are never FP8: their logits pick
the experts, so they stay in high precision whatever the filter says. Shared experts are ordinary linear layers.

Precision-map rows (`experts_rows`): one per projection of every experts module, named `<experts>.<child>` (`gate_up`
/ `up`, `down`: the FP8 layer's name once converted), family "experts", with its multiply-adds per token of the model
(top-k x one expert's GEMM), and one per router, family "router".
"""
from __future__ import annotations

import fnmatch
from typing import Dict, Iterator, List, Optional, Tuple

from torch import nn

from lightning_fp8.conversion.filters import SKIP_REASON_ATTR, ModuleFilter, filter_reason
from lightning_fp8.conversion.layer_recipes import recipe_for
from lightning_fp8.modules.grouped_linear import ExpertsLayout, convert_experts, experts_layout, fp8_gemms, grouped_recipe
from lightning_fp8.recipe import FP8Recipe

ROUTER_REASON = ("router of a mixture-of-experts layer: its logits and top-k choose the experts, so they stay in high "
                 "precision (never FP8)")
#: family of the precision-map rows of experts and routers (the conversion summary counts them apart)
EXPERTS_FAMILY, ROUTER_FAMILY = "experts", "router"


def experts_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module, ExpertsLayout]]:
    """Every experts module of `model` (transformers' layout), with its name and layout, in module order."""
    for fqn, module in model.named_modules():
        layout = experts_layout(module)
        if layout is not None:
            yield fqn, module, layout


def plan_experts(model: nn.Module, recipe: FP8Recipe, module_filter: Optional[ModuleFilter] = None,
                 layer_recipes=(), preview: bool = False) -> Dict[str, Tuple[Optional[FP8Recipe], Optional[str]]]:
    """{fqn: (the experts' recipe, None) to convert, or (None, why it stays in BF16)} for every experts module not
    converted yet (module docstring's rules). preview: a filter with `skip_reason` is asked that instead of being
    called."""
    plan: Dict[str, Tuple[Optional[FP8Recipe], Optional[str]]] = {}
    for fqn, module, layout in experts_modules(model):
        if fp8_gemms(module) is not None:
            continue
        experts_recipe, reason = grouped_recipe(recipe_for(fqn, recipe, layer_recipes))
        reason = _shape_reason(module, layout) or reason
        if reason is None and module_filter is not None:
            if preview and callable(getattr(module_filter, "skip_reason", None)):
                reason = module_filter.skip_reason(module, fqn)
            elif not module_filter(module, fqn):
                reason = filter_reason(module_filter, module, fqn)
        if reason is None and module_filter is None:
            pattern = next((p for p in recipe.skip_patterns if fnmatch.fnmatchcase(fqn, p)), None)
            if pattern is not None:
                reason = f"name matches skip pattern {pattern!r}"
        plan[fqn] = (None, reason) if reason is not None else (experts_recipe, None)
    return plan


def _shape_reason(module: nn.Module, layout: ExpertsLayout) -> Optional[str]:
    for projection in layout.projections:
        in_f, out_f = layout.features(module, projection)
        if in_f % 16 or out_f % 16:
            return (f"{projection.parameter}: one expert's GEMM is {in_f} -> {out_f}, not multiples of 16 (FP8 grouped "
                    "GEMMs need 16-aligned dimensions)")
    return None


def apply_experts_plan(model: nn.Module, plan: Dict[str, Tuple[Optional[FP8Recipe], Optional[str]]]) -> None:
    """Convert the experts modules the plan converts; record the reason on the others."""
    for fqn, (experts_recipe, reason) in plan.items():
        module = model.get_submodule(fqn) if fqn else model
        module.__dict__.pop(SKIP_REASON_ATTR, None)
        if reason is not None:
            module.__dict__[SKIP_REASON_ATTR] = reason
            continue
        convert_experts(module, experts_layout(module), experts_recipe)


def router_names(model: nn.Module) -> Dict[str, str]:
    """{fqn: label} of the routers of `model`'s mixture-of-experts layers (module docstring)."""
    routers: Dict[str, str] = {}
    for parent_fqn, parent in model.named_modules():
        experts = parent._modules.get("experts")
        if experts is None:
            continue
        count = _expert_count(experts)
        for name, child in parent._modules.items():
            if child is None or child is experts:
                continue
            fqn = f"{parent_fqn}.{name}" if parent_fqn else name
            cls = type(child).__name__
            if cls.endswith("Router") or cls.endswith("TopkRouter"):
                routers[fqn] = cls
            elif (isinstance(child, nn.Linear) and name in ("gate", "router", "gating")
                  and count is not None and child.out_features == count):
                routers[fqn] = f"nn.Linear ({child.in_features} -> {child.out_features} experts)"
    return routers


def _expert_count(experts: nn.Module) -> Optional[int]:
    layout = experts_layout(experts)
    if layout is not None:
        return layout.num_experts
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return len(experts)
    return None


def experts_rows(fqn: str, module: nn.Module, converted: bool, plan: Dict[str, Tuple[Optional[FP8Recipe],
                 Optional[str]]], would_fp8: str, would_convert: str) -> Optional[List[Tuple[str, str, str, str, int]]]:
    """Rows (fqn, precision, reason, label, flops per token) of an experts module that has no FP8 layers (a converted
    one's rows are its FP8 layers'): in a converted model bf16 with the recorded reason; in a preview what conversion
    would do (`would_fp8`, `would_convert`: the preview's precision and reason). None for any other module."""
    layout = experts_layout(module)
    if layout is None or fp8_gemms(module) is not None:
        return None
    if converted:
        precision, reason = "bf16", module.__dict__.get(SKIP_REASON_ATTR, "not converted (not in the model when "
                                                                        "convert_to_fp8 ran)")
    else:
        _, why = plan.get(fqn, (None, "not planned"))
        precision, reason = (would_fp8, would_convert) if why is None else ("bf16", why)
    rows = []
    for projection in layout.projections:
        in_f, out_f = layout.features(module, projection)
        name = f"{fqn}.{projection.child}" if fqn else projection.child
        label = f"{layout.label}.{projection.parameter} ({layout.num_experts} experts, grouped)"
        rows.append((name, precision, reason, label, layout.top_k * in_f * out_f))
    return rows


def unreadable_experts_reason(module: nn.Module) -> Optional[str]:
    """Why a module that looks like experts (3-D parameters, "expert" in its class name) is left in BF16, or None:
    an experts module conversion cannot read (not transformers' layout)."""
    if experts_layout(module) is not None or "expert" not in type(module).__name__.lower():
        return None
    three_d = [name for name, p in module._parameters.items() if p is not None and p.dim() == 3]
    if not three_d:
        return None
    return (f"an experts module lightning_fp8 cannot read (3-D parameters {three_d}, not transformers' experts layout: "
            "gate_up_proj / up_proj and down_proj with has_gate / has_bias / is_transposed): no FP8 path, its GEMMs "
            "run in BF16")
