"""Model conversion: which linear layers and convolutions become FP8 layers, and why the others do not.

    convert_to_fp8(model)   linear layers (nn.Linear, transformers' Conv1D, registered kinds) and convolutions
                            (nn.Conv1d, nn.Conv2d) -> FP8 layers, in place
    revert_fp8(model)       FP8 layers -> the original classes (same Parameters, hooks, parametrizations)
    precision_map(model)    every GEMM-bearing module: FP8 or BF16 and why; on a model not converted yet, a preview
                            of what convert_to_fp8 would do

Every layer left in high precision gets a recorded reason (`precision_map` reads them back), so a user can always
answer "why is this layer not in FP8?". Which classes count as linear layers: lightning_fp8/conversion/layer_kinds.py;
the rules: filters.py; "first" and "last": first_last.py; what moves with a replaced layer: transplant.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from lightning_fp8.conversion import torch_transformer, experts, layer_kinds, transplant
from lightning_fp8.conversion.last_blocks import last_block_reasons
from lightning_fp8.conversion.filters import (
    FIRST_LAST_SWITCH,
    SKIP_REASON_ATTR,
    ModuleFilter,
    filter_reason,
    rule_skip_reason,
    scaling_skip_reason,
    structural_skip_reason,
)
from lightning_fp8.conversion.layer_recipes import LayerRecipes, normalize_layer_recipes, recipe_for, warn_unmatched
from lightning_fp8.conversion.first_last import AUTO, ExampleCall, LayerOrder, NoTrace, layer_order
from lightning_fp8.modules.multihead_attention import ProjectedMultiheadAttention
from lightning_fp8.modules.grouped_linear import revert_experts
from lightning_fp8.modules.linear import FP8Layer, casts_input_per_tensor
from lightning_fp8.modules.local_shards import layout_of
from lightning_fp8.recipe import FP8Recipe

log = logging.getLogger("lightning_fp8")

#: set on a model convert_to_fp8 ran on
CONVERTED_ATTR = "_fp8_converted"
WOULD_CONVERT = "would be converted (preview: convert_to_fp8 has not run on this model)"
#: the precision of a preview row whose layer conversion would make FP8 (it computes in BF16 until then)
WOULD_FP8 = "would-fp8"
#: set on a model whose conversion summary was logged: the text, so the same summary is not logged twice
SUMMARY_LOGGED_ATTR = "_fp8_summary_logged"
#: set on an FP8 layer switched off only on the module order's first / last guess (`first_last_until_traced`)
PROVISIONAL_ATTR = "_fp8_first_last_guess"
#: set on an FP8 layer built as one before conversion decided it (conversion/built_layers.py): `plan_conversion`
#: decides it as the plain layer it stands for
BUILT_UNDECIDED_ATTR = "_fp8_constructed"


@dataclass(frozen=True)
class LayerPrecision:
    """One row of the precision map.

    precision: what the layer computes in now: "fp8", or "bf16" (the compute dtype of everything that is not an FP8
    GEMM); in a preview (`precision_map` of a model `convert_to_fp8` has not run on), "would-fp8" for a layer
    conversion would make FP8 (it is not FP8 yet), so `row.precision == "fp8"` holds only for layers that run FP8
    GEMMs. flops_per_token: the layer's multiply-adds per token (in x out; a convolution's per output position; 0
    where unknown); preview: True when the row says what `convert_to_fp8` would do to a model that is not converted
    (its reason then starts with "would be converted (preview: ..." or says why the layer would stay in BF16);
    `fp8` (property): FP8 now or, in a preview, after conversion. family: "linear", "convolution" or "recurrent"
    (what the conversion summary counts it as)."""

    fqn: str
    precision: str
    reason: str
    module_type: str = ""
    flops_per_token: int = 0
    preview: bool = False
    scaling: str = ""  # an FP8 layer's scaling (its effective recipe's, e.g. "blockwise" after an escalation)
    family: str = "linear"
    #: how tensor parallelism splits the layer ("" when it does not): its layout, the style, what moves in FP8
    parallel: str = ""
    recipe: str = ""  # an FP8 layer's recipe in short (`FP8Recipe.label`: "mxfp8", "nvfp4", "delayed, wgrad bf16")

    @property
    def fp8(self) -> bool:
        """The layer computes in FP8: now ("fp8"), or, in a preview, once converted ("would-fp8")."""
        return self.precision in ("fp8", WOULD_FP8)


def convert_to_fp8(
    model: nn.Module,
    recipe: Optional[FP8Recipe] = None,
    module_filter: Optional[ModuleFilter] = None,
    *,
    layer_recipes: Optional[LayerRecipes] = None,
    example_input: Any = AUTO,
    verbose: bool = True,
    first_last_until_traced: bool = False,
) -> nn.Module:
    """Replace the model's linear layers by FP8 layers in place, and return the model.

    layer_recipes: {fnmatch pattern of layer names: FP8Recipe}, first match wins, for layers that compute with
    another recipe than `recipe` (e.g. {"*.attn.*": FP8Recipe(scaling="rowwise")}); see conversion/layer_recipes.py.

    module_filter(module, fqn) -> bool, if given, replaces the default filter (True: convert); layers that cannot run
    in FP8 as they are used stay in BF16 whatever it says. example_input: an input for one traced forward that finds
    which layers share an input (the first/last rule, see lightning_fp8/conversion/first_last.py); by default one is
    looked for on the model. verbose: log the conversion summary (logger "lightning_fp8") and warn when little or
    nothing converts. Layers already converted are left alone, so converting twice is a no-op. A bare linear layer
    passed as `model` is returned converted (there is no parent to replace it in).

    first_last_until_traced: where no forward could be traced (no example input), the layers the module order
    guesses first / last become FP8 layers switched off (`fp8_enabled=False`, the guess as their reason) instead of
    staying plain, so that `settle_first_last(model, inputs)` can decide on the first real input by switching layers
    on and off (what the Fabric and Accelerate adapters do at the model's first forward)."""
    recipe = _check_recipe(recipe)
    per_layer = normalize_layer_recipes(layer_recipes)
    decisions, _ = _plan_with_attention(model, recipe, module_filter, example_input, layer_recipes=per_layer)
    experts_plan = experts.plan_experts(model, recipe, module_filter, per_layer)
    parents = transplant.parent_index(model)
    if per_layer:
        warn_unmatched(per_layer, [fqn for fqn, reason in decisions.items() if reason is None])
    for fqn, reason in decisions.items():
        module = model.get_submodule(fqn) if fqn else model
        module.__dict__.pop(SKIP_REASON_ATTR, None)
        provisional = first_last_until_traced and isinstance(reason, FirstLastReason) and reason.guessed
        if reason is not None and not provisional:
            module.__dict__[SKIP_REASON_ATTR] = reason
            continue
        kind = layer_kinds.linear_kind(module)
        layer_recipe = recipe_for(fqn, recipe, per_layer)
        unsupported = scaling_skip_reason(module, layer_recipe)  # a layer_recipes entry the layer has no path for
        if unsupported is not None:
            module.__dict__[SKIP_REASON_ATTR] = unsupported
            continue
        new = transplant.to_fp8(module, lambda m, kind=kind, r=layer_recipe: kind.convert(m, r))
        if provisional:
            new.fp8_enabled = False
            new.fp8_disabled_reason = reason
            new.__dict__[PROVISIONAL_ATTR] = True
        if not fqn:
            model = new
        else:
            transplant.replace_everywhere(parents, module, new)
    experts.apply_experts_plan(model, experts_plan)  # mixture-of-experts layers: FP8 grouped GEMMs
    torch_transformer.guard_fast_paths(model)
    model.__dict__[CONVERTED_ATTR] = True  # converted even where nothing could convert (precision_map: no preview)
    if verbose:
        from lightning_fp8.conversion.summary import log_conversion_summary

        # once per model: converting again (a no-op) or an adapter's own summary of the same conversion says nothing
        # new (log_conversion_summary skips a summary this model already logged)
        log_conversion_summary(model, once=True)
    return model


def plan_conversion(
    model: nn.Module,
    recipe: Optional[FP8Recipe] = None,
    module_filter: Optional[ModuleFilter] = None,
    *,
    example_input: Any = AUTO,
    preview: bool = False,
    layer_recipes: Optional[LayerRecipes] = None,
) -> Dict[str, Optional[str]]:
    """{fqn: None (convert) or the reason to stay in BF16} for every linear layer not in FP8 yet, in module order, and
    for every FP8 layer built before conversion decided it (`BUILT_UNDECIDED_ATTR`: decided as the plain layer it
    stands for). example_input: as convert_to_fp8's; `NoTrace(why)` runs no forward (first / last from the module
    order).

    preview: do not call a filter object for its side effects (a filter with `skip_reason` is asked that instead).
    layer_recipes: as convert_to_fp8's; the last blocks rule reads each layer's own recipe."""
    recipe = _check_recipe(recipe)
    layer_recipes = normalize_layer_recipes(layer_recipes)
    decisions: Dict[str, Optional[str]] = {}
    candidates: List[str] = []
    routers = experts.router_names(model)
    for fqn, module in model.named_modules():
        undecided = isinstance(module, FP8Layer) and BUILT_UNDECIDED_ATTR in module.__dict__
        if isinstance(module, FP8Layer) and not undecided:
            if module.fp8_enabled and layer_kinds.family(module) != experts.EXPERTS_FAMILY:
                candidates.append(fqn)  # counts for first / last; left as it is
            continue
        if undecided:  # built as an FP8 layer: the rules see the plain layer it stands for
            module = module.to_unconverted()
        elif layer_kinds.linear_kind(module) is None:
            continue
        if fqn in routers:  # a router's logits stay in high precision whatever the filter says
            decisions[fqn] = experts.ROUTER_REASON
            continue
        if module_filter is not None:
            if preview and callable(getattr(module_filter, "skip_reason", None)):
                reason = module_filter.skip_reason(module, fqn)
            else:
                reason = None if module_filter(module, fqn) else filter_reason(module_filter, module, fqn)
            # what no filter can override
            reason = structural_skip_reason(module) or scaling_skip_reason(module, recipe) or reason
        else:
            reason = rule_skip_reason(module, fqn, recipe)
            if reason is None:
                candidates.append(fqn)
        decisions[fqn] = reason
    first_last: Dict[str, str] = {}
    if module_filter is None and recipe.keep_first_last_in_bf16 and candidates:
        # over every candidate, the tail's too: with a tied head the last linear layer is in the last block, and
        # the layer before the tail is not "the last linear layer"
        first_last = _first_last_reasons(layer_order(model, candidates, example_input), model)
        for fqn, reason in first_last.items():
            if fqn in decisions:  # layers converted before keep their precision (converting twice is a no-op)
                decisions[fqn] = reason
    if module_filter is None and candidates:
        tail = _tail_reasons(model, candidates, recipe, layer_recipes)  # the last blocks rule (last_blocks.py)
        decisions.update({fqn: reason for fqn, reason in tail.items() if fqn in decisions and fqn not in first_last})
    return decisions


def _tail_reasons(model: nn.Module, candidates: List[str], recipe: FP8Recipe,
                  layer_recipes: Tuple[Tuple[str, FP8Recipe], ...]) -> Dict[str, str]:
    """The last blocks rule with each candidate's own recipe (`layer_recipes` over `recipe`): the blocks are counted
    over every candidate, and a layer in the tail of its recipe's fraction stays in BF16."""
    resolved = {fqn: recipe_for(fqn, recipe, layer_recipes) for fqn in candidates}
    reasons: Dict[str, str] = {}
    for layer_recipe in {r for r in resolved.values() if r.keep_last_blocks_in_bf16}:
        tail = last_block_reasons(model, candidates, layer_recipe)
        reasons.update({fqn: why for fqn, why in tail.items() if resolved[fqn] == layer_recipe})
    return reasons


def _plan_with_attention(model: nn.Module, recipe: FP8Recipe, module_filter: Optional[ModuleFilter],
                         example_input: Any, preview: bool = False,
                         layer_recipes: Optional[LayerRecipes] = None) -> Tuple[Dict[str, Optional[str]], list]:
    """plan_conversion with nn.MultiheadAttention's projections exposed as modules (conversion/torch_transformer.py); the
    attentions none of whose projections would convert are given back as torch's own (the exposed ones stay: the
    caller converts them, or a preview hides them again). Returns the decisions and the attentions exposed."""
    exposed = torch_transformer.expose_projections(model)
    try:
        decisions = plan_conversion(model, recipe, module_filter, example_input=example_input, preview=preview,
                                    layer_recipes=layer_recipes)
    except BaseException:
        for _, module in exposed:
            torch_transformer.hide_projections(module)
        raise
    torch_transformer.keep_converting_attentions(exposed, decisions)
    names = {fqn for fqn, _ in model.named_modules()}
    return {fqn: reason for fqn, reason in decisions.items() if fqn in names}, exposed


def revert_fp8(model: nn.Module) -> nn.Module:
    """Undo `convert_to_fp8`: FP8 layers become the original classes again (same Parameters, with the hooks and
    parametrizations they carried); returns the model."""
    if isinstance(model, FP8Layer):
        model = transplant.to_unconverted(model)
        model.__dict__.pop(CONVERTED_ATTR, None)
        return model
    for _, module, _ in list(experts.experts_modules(model)):
        revert_experts(module)
        module.__dict__.pop(SKIP_REASON_ATTR, None)
    parents = transplant.parent_index(model)
    for fqn, module in list(model.named_modules()):
        if isinstance(module, FP8Layer):
            transplant.replace_everywhere(parents, module, transplant.to_unconverted(module))
        else:
            module.__dict__.pop(SKIP_REASON_ATTR, None)
            module.__dict__.pop(torch_transformer.ATTENTION_REASON_ATTR, None)
    torch_transformer.restore(model)
    model.__dict__.pop(CONVERTED_ATTR, None)
    model.__dict__.pop(SUMMARY_LOGGED_ATTR, None)
    return model


def precision_map(
    model: nn.Module,
    recipe: Optional[FP8Recipe] = None,
    module_filter: Optional[ModuleFilter] = None,
    *,
    example_input: Any = AUTO,
) -> List[LayerPrecision]:
    """Every linear layer and convolution of the model (and every other module that runs a GEMM: recurrent layers,
    the fused input projection of nn.MultiheadAttention, layers another FP8 library converted), FP8 or BF16, and why.

    On a converted model, what conversion and fallback decided. On a model `convert_to_fp8` has not run on, a preview:
    what it would do with `recipe` / `module_filter` (default: the default recipe and filter); rows have
    `preview=True`, and a layer conversion would make FP8 has precision "would-fp8" (reason "would be converted
    (preview: ...)"): only a converted layer says "fp8"."""
    converted = is_converted(model)
    if converted and (recipe is not None or module_filter is not None):
        raise ValueError(
            "precision_map(model, recipe=..., module_filter=...) previews a conversion, but this model is converted "
            "already; call precision_map(model) for its state, or revert_fp8(model) first to preview other settings"
        )
    if converted:
        return _precision_rows(model, converted, {}, {})
    # a preview: what conversion would do, attention projections included (given back afterwards)
    plan, exposed = _plan_with_attention(model, recipe, module_filter, example_input, preview=True)
    experts_plan = experts.plan_experts(model, _check_recipe(recipe), module_filter, preview=True)
    try:
        return _precision_rows(model, converted, plan, experts_plan)
    finally:
        for _, module in exposed:
            if isinstance(module, ProjectedMultiheadAttention):
                torch_transformer.hide_projections(module)


def _precision_rows(model: nn.Module, converted: bool, plan: Dict[str, Optional[str]],
                    experts_plan: Dict) -> List[LayerPrecision]:
    rows = []
    routers = experts.router_names(model)
    for fqn, module in model.named_modules():
        moe_rows = experts.experts_rows(fqn, module, converted, experts_plan, WOULD_FP8, WOULD_CONVERT)
        if moe_rows is not None:
            rows.extend(LayerPrecision(name, precision, reason, label, flops, preview=not converted,
                                       family=experts.EXPERTS_FAMILY) for name, precision, reason, label, flops in moe_rows)
            continue
        if fqn in routers and not isinstance(module, FP8Layer):
            weight = getattr(module, "weight", None)
            flops = weight.numel() if weight is not None and weight.dim() == 2 else 0
            rows.append(LayerPrecision(fqn, "bf16", experts.ROUTER_REASON, routers[fqn], flops, not converted,
                                       family=experts.ROUTER_FAMILY))
            continue
        unreadable = experts.unreadable_experts_reason(module)
        if unreadable is not None:
            rows.append(LayerPrecision(fqn, "bf16", unreadable, type(module).__name__, 0, not converted,
                                       family=experts.EXPERTS_FAMILY))
            continue
        layout = layout_of(module)
        # FP8 communication needs a layer casting its input per tensor in FP8 (its styles' run-time rule)
        parallel = layout.describe(casts_input_per_tensor(module)) if layout is not None else ""
        if isinstance(module, FP8Layer):
            label = layer_kinds.label(module)
            flops = getattr(module, "flops_per_token", module.in_features * module.out_features)
            scaling, recipe_label = module.recipe.scaling, module.recipe.label
            family = layer_kinds.family(module)
            if module.fp8_enabled:
                note = getattr(module, "fp8_escalation_reason", None)
                reason = f"converted; {note}" if note else "converted"
                rows.append(LayerPrecision(fqn, "fp8", reason, label, flops, scaling=scaling, family=family,
                                           parallel=parallel, recipe=recipe_label))
            else:
                reason = module.fp8_disabled_reason or "fp8_enabled=False"
                rows.append(LayerPrecision(fqn, "bf16", reason, label, flops, scaling=scaling, family=family,
                                           parallel=parallel, recipe=recipe_label))
            continue
        kind = layer_kinds.linear_kind(module)
        if kind is not None:
            in_f, out_f = kind.features(module)
            if converted:
                reason = module.__dict__.get(SKIP_REASON_ATTR, "not converted (not in the model when convert_to_fp8 ran)")
                rows.append(LayerPrecision(fqn, "bf16", reason, kind.label, in_f * out_f, family=kind.family,
                                           parallel=parallel))
            else:
                reason = plan.get(fqn)
                precision, reason = (WOULD_FP8, WOULD_CONVERT) if reason is None else ("bf16", reason)
                rows.append(LayerPrecision(fqn, precision, reason, kind.label, in_f * out_f, preview=True,
                                           family=kind.family, parallel=parallel))
            continue
        other = layer_kinds.other_module(module)
        if other is not None:
            rows.append(LayerPrecision(fqn, other.precision, other.reason, other.label, other.flops_per_token,
                                       not converted, family=other.family))
    return rows


def fp8_layers(model: nn.Module) -> Dict[str, FP8Layer]:
    """The model's FP8 layers (FP8Linear and every other FP8Layer) by fully qualified name, in module order."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, FP8Layer)}


def is_converted(model: nn.Module) -> bool:
    """Whether `convert_to_fp8` has run on the model (its mark, an FP8 layer, or a linear it left with a reason)."""
    return CONVERTED_ATTR in model.__dict__ or any(
        isinstance(m, FP8Layer) or SKIP_REASON_ATTR in m.__dict__ for m in model.modules()
    )


# -- helpers ------------------------------------------------------------------------------------------------------
def _check_recipe(recipe: Optional[FP8Recipe]) -> FP8Recipe:
    recipe = recipe if recipe is not None else FP8Recipe()
    if not isinstance(recipe, FP8Recipe):
        raise TypeError(f"recipe must be an FP8Recipe, got {type(recipe).__name__}")
    return recipe


class FirstLastReason(str):
    """The first / last rule's reason for a layer; `guessed`: decided from the module order, not a traced forward."""

    guessed: bool = False


def _first_last_reasons(order: LayerOrder, model: nn.Module) -> Dict[str, str]:
    how = {"traced": "forward order, traced",
           "module order": f"module order, a guess: {order.note}"}.get(order.method, f"{order.method}: {order.note}")
    reasons: Dict[str, str] = {}
    for which, group, head in (("last", order.last(), order.last_layer()), ("first", order.first(),
                                                                              order.first_layer())):
        if not group:
            continue
        module = model.get_submodule(head) if head else model
        noun = "convolution" if layer_kinds.family(module) == "convolution" else "linear layer"
        for fqn in group:
            if fqn == head:
                reason = FirstLastReason(f"{which} {noun} kept in BF16 ({FIRST_LAST_SWITCH}; {how})")
            else:
                basis = f" ({order.shared[fqn]})" if fqn in order.shared else ""
                reason = FirstLastReason(f"reads the same input as {head}{basis}, the {which} {noun}: kept in BF16 "
                                         f"with it ({FIRST_LAST_SWITCH}; {how})")
            reason.guessed = order.method == "module order"
            reasons[fqn] = reason
    return reasons


def provisional_layers(model: nn.Module) -> Dict[str, FP8Layer]:
    """The layers `convert_to_fp8(first_last_until_traced=True)` left switched off on the module order's guess, not
    settled yet by `settle_first_last`."""
    return {fqn: m for fqn, m in fp8_layers(model).items() if m.__dict__.get(PROVISIONAL_ATTR)}


def settle_first_last(model: nn.Module, example_input: Any) -> bool:
    """Decide first / last from one forward on `example_input` (traced on the meta device where the model allows,
    see conversion/first_last.py) over the layers conversion counted (FP8 layers computing in FP8, and the provisional
    ones): the first and last groups become their plain classes again with the traced reason (as conversion with an
    example input leaves them), the other provisional layers compute in FP8. Returns whether the trace ran; where it
    fails, the guess stands (`keep_first_last_guess`) with the failure in its reason.

    example_input: what `layer_order` takes, or an `ExampleCall(args, kwargs)` of a real call."""
    provisional = provisional_layers(model)
    if not provisional:
        return False
    candidates = [fqn for fqn, layer in fp8_layers(model).items()
                  if fqn and (layer.fp8_enabled or fqn in provisional) and layer_kinds.family(layer) != experts.EXPERTS_FAMILY]
    order = layer_order(model, candidates, example_input)
    if order.method != "traced":
        for layer in provisional.values():
            layer.fp8_disabled_reason = f"{layer.fp8_disabled_reason}; the first forward could not be traced either"
        keep_first_last_guess(model)
        return False
    reasons = _first_last_reasons(order, model)
    for layer in provisional.values():
        del layer.__dict__[PROVISIONAL_ATTR]
        layer.fp8_enabled = True
    _back_to_plain(model, {fqn: reasons[fqn] for fqn in candidates if fqn in reasons})
    return True


def settle_first_last_from_state(model: nn.Module, state_keys) -> bool:
    """Decide first / last as the run a checkpoint comes from decided them: of the provisional layers, those the
    checkpoint's FP8 state (`fp8_state_dict` keys) holds were FP8 layers there and compute in FP8, the others become
    their plain classes again (that run kept them in BF16). Returns whether anything was provisional."""
    provisional = provisional_layers(model)
    if not provisional:
        return False
    saved = {key.partition(".fp8_meta.")[0] for key in state_keys}
    plain = {}
    for fqn, layer in provisional.items():
        del layer.__dict__[PROVISIONAL_ATTR]
        if fqn in saved:
            layer.fp8_enabled = True
        elif fqn:
            plain[fqn] = (f"first or last linear layer kept in BF16 ({FIRST_LAST_SWITCH}; as in the run the resumed "
                          "checkpoint comes from)")
    _back_to_plain(model, plain)
    return True


def keep_first_last_guess(model: nn.Module) -> None:
    """The provisional layers (`first_last_until_traced`) become their plain classes with the module order's guess
    as their reason: what conversion without a trace leaves (a model about to be sharded, whose first forward is not
    traced, or one whose trace failed)."""
    provisional = provisional_layers(model)
    for layer in provisional.values():
        del layer.__dict__[PROVISIONAL_ATTR]
    _back_to_plain(model, {fqn: layer.fp8_disabled_reason for fqn, layer in provisional.items() if fqn})


def _back_to_plain(model: nn.Module, reasons: Dict[str, str]) -> None:
    """FP8 layers of `model` ({fqn: reason}) replaced by their original classes (same Parameters), the reason
    recorded as conversion records it."""
    if not reasons:
        return
    parents = transplant.parent_index(model)
    for fqn, reason in reasons.items():
        layer = model.get_submodule(fqn)
        plain = transplant.to_unconverted(layer)
        plain.__dict__[SKIP_REASON_ATTR] = reason
        transplant.replace_everywhere(parents, layer, plain)
