"""FP8 experts: the grouped GEMMs of a mixture-of-experts layer, on the same GEMM path as every linear layer.

An experts module (transformers 5's, wrapped by `transformers.integrations.moe.use_experts_implementation`) holds 3-D
parameters: `gate_up_proj` (E, 2I, H) (or `up_proj` without a gate) and `down_proj` (E, H, I), stored (E, in, out)
instead where `is_transposed` (gpt-oss), with optional biases `<name>_bias` (E, out). Its forward sorts the routed
tokens by expert and runs two grouped GEMMs with the activation between (`_apply_gate` or `act_fn`).

Conversion keeps the module, its class and its Parameters (same names, same 3-D shapes, state_dict and
`save_pretrained` unchanged) and gives it one `FP8GroupedLinear` per projection: a child named after its parameter
without "_proj" (`gate_up` / `up`, `down`), an FP8 layer like any other (its own switch, FP8 state, fallback,
monitoring, checkpoint entries), which reads its weight from the parent at each call. The module's forward is then
`fp8_experts_forward` (transformers' ExpertsInterface entry "lightning_fp8", selected on the module through its own
copy of the config): the same routing as transformers' grouped_mm implementation, with the two GEMMs run by those
layers. Each GEMM is one `lightning_fp8::fp8_gemm` with the experts' offsets (modules/linear_gemms.py), cast by the grouped
caster (modules/cast.py): rowwise, per token row and per expert output column (numerics/groups.py), the scaling
torch's grouped scaled GEMM takes. The router's logits and top-k are the module's caller's and stay in high precision.

transformers is never imported here except to register the implementation (`register_with_transformers`), which
conversion calls only for a model that holds such a module, so transformers is imported already.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from lightning_fp8.modules.cast import caster_for
from lightning_fp8.modules.linear_gemms import GemmConfig, linear_gemms
from lightning_fp8.modules.linear import FP8Layer, _output_dtype
from lightning_fp8.modules.gathered_fp8 import observed_weight
from lightning_fp8.modules.local_shards import is_dtensor
from lightning_fp8.numerics.groups import group_of_rows
from lightning_fp8.recipe import FP8Recipe

Tensor = torch.Tensor

#: the name of the experts implementation registered in transformers' ExpertsInterface
IMPLEMENTATION = "lightning_fp8"
#: the recipe scalings an experts layer computes with: per-tensor recipes give their experts rowwise scaling
_ROWWISE_FROM = ("delayed", "current", "rowwise")
#: on a converted experts module: its config before conversion (revert puts it back)
ORIGINAL_CONFIG_ATTR = "_fp8_original_config"


def grouped_recipe(recipe: FP8Recipe) -> Tuple[Optional[FP8Recipe], Optional[str]]:
    """The recipe an experts layer computes with under `recipe`, and None, or None and why it cannot run FP8.

    torch's grouped scaled GEMM takes e4m3 operands with rowwise scales: a per-tensor recipe's experts are scaled per
    token row and per expert output column (finer than one scale per expert), every role in e4m3 (the recipe's
    margin, rounding, amax history, weight-gradient choice and backend kept; a modelled GPU's backend, which models
    per-tensor GEMMs only, becomes "auto"). The fine-grained scalings have no grouped FP8 GEMM here yet."""
    if recipe.scaling not in _ROWWISE_FROM:
        return None, (f"FP8Recipe.scaling={recipe.scaling!r}: no grouped FP8 GEMM for it (experts run rowwise FP8, "
                      f"the scaling torch's grouped scaled GEMM takes, under scalings {list(_ROWWISE_FROM)}; give the "
                      "experts one with layer_recipes, e.g. {'*.experts': FP8Recipe(scaling='rowwise')})")
    backend = recipe.backend if recipe.backend in ("auto", "scaled_mm", "emulated") else "auto"
    return dataclasses.replace(recipe, scaling="rowwise", format="e4m3", scale_gradients=True, backend=backend,
                               random_hadamard=None), None


# -- what an experts module is ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Projection:
    """One grouped GEMM of an experts module: the parameter, its bias (or None) and the child layer's name."""

    parameter: str
    bias: Optional[str]
    child: str


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module stores its projections (transformers' flags), read without importing transformers."""

    num_experts: int
    projections: Tuple[Projection, Projection]  # the first (gate_up or up) and the down projection
    transposed: bool  # parameters stored (E, in, out)
    top_k: int  # experts per token (the config's num_experts_per_tok; 1 where it has none)
    label: str  # the module's class name

    def features(self, module: nn.Module, projection: Projection) -> Tuple[int, int]:
        """(in_features, out_features) of one expert's GEMM of `projection`."""
        shape = getattr(module, projection.parameter).shape
        return (shape[1], shape[2]) if self.transposed else (shape[2], shape[1])


def experts_layout(module: nn.Module) -> Optional[ExpertsLayout]:
    """The layout of a transformers experts module (its class wrapped by `use_experts_implementation`: the flags
    `has_gate`, `has_bias`, `is_transposed`, a `config`, and 3-D parameters `gate_up_proj` / `up_proj` and
    `down_proj`), or None for any other module."""
    if not all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed", "config")):
        return None
    if getattr(type(module).forward, "__wrapped__", None) is None:
        return None
    first = "gate_up_proj" if module.has_gate else "up_proj"
    params = module._parameters
    if not all(isinstance(params.get(name), torch.Tensor) and params[name].dim() == 3 for name in (first, "down_proj")):
        return None
    has_bias = bool(module.has_bias)
    projections = tuple(
        Projection(name, f"{name}_bias" if has_bias and params.get(f"{name}_bias") is not None else None,
                   name[: -len("_proj")])
        for name in (first, "down_proj")
    )
    config = module.config
    top_k = next((int(getattr(config, key)) for key in ("num_experts_per_tok", "moe_topk", "top_k")
                  if isinstance(getattr(config, key, None), int)), 1)
    return ExpertsLayout(params[first].shape[0], projections, bool(module.is_transposed), top_k,
                         type(module).__name__)


# -- the FP8 layer of one projection ----------------------------------------------------------------------------
class FP8GroupedLinear(FP8Layer, nn.Module):
    """The grouped GEMM of one projection of an experts module, in FP8: y[rows of expert e] = x[rows] W_e^T for x
    sorted by expert (`forward(x, offsets)`, offsets the int32 end rows of each expert's tokens).

    It holds no Parameter: it reads `parameter` of its experts module (its parent) at each call, (E, out, in), or the
    (E, in, out) storage's transpose. in_features / out_features are one expert's; `flops_per_token` counts the
    experts a token is routed to (top-k)."""

    fp8_scalings = ("rowwise",)
    bias = None  # an expert's bias is added by the experts forward, after the GEMM, in high precision

    def __init__(self, experts: nn.Module, layout: ExpertsLayout, projection: Projection,
                 recipe: FP8Recipe) -> None:
        nn.Module.__init__(self)
        self.__dict__["_experts"] = experts  # the parent, not a submodule
        self.parameter = projection.parameter
        self.transposed = layout.transposed
        self.num_experts = layout.num_experts
        self.top_k = layout.top_k
        self.experts_label = layout.label
        self.in_features, self.out_features = layout.features(experts, projection)
        self._init_fp8(recipe, device=getattr(experts, self.parameter).device)

    @property
    def weight(self) -> Tensor:
        """The experts module's 3-D Parameter, as stored."""
        return getattr(self.__dict__["_experts"], self.parameter)

    def fp8_weight(self) -> Tensor:
        """(E, out, in): the Parameter, or the transpose of its (E, in, out) storage (a view)."""
        weight = self.weight
        return weight.transpose(-2, -1) if self.transposed else weight

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds per token of the model: top-k experts x one expert's GEMM."""
        return self.top_k * self.in_features * self.out_features

    @property
    def label(self) -> str:
        return f"{self.experts_label}.{self.parameter} ({self.num_experts} experts, grouped)"

    def forward(self, x: Tensor, offsets: Tensor) -> Tensor:  # type: ignore[override]
        weight = self.fp8_weight()
        if is_dtensor(weight):
            raise NotImplementedError(
                f"lightning_fp8: {self.experts_label}.{self.parameter} is a DTensor (tensor or expert parallelism "
                "over the experts): FP8 experts run on whole (or FSDP2-gathered) expert weights only"
            )
        return self._forward_on(x, weight, None, offsets)

    def high_precision_forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor],  # type: ignore[override]
                               offsets: Tensor) -> Tensor:
        """The grouped GEMM in the compute dtype (BF16 under autocast): torch's grouped GEMM, rows past the last
        offset zero."""
        dtype = _output_dtype(x)
        if dtype not in (torch.bfloat16, torch.float32) or (dtype == torch.float32 and x.device.type == "cuda"):
            dtype = torch.float32 if x.device.type != "cuda" else torch.bfloat16
        out = torch._grouped_mm(x.to(dtype), weight.transpose(-2, -1).to(dtype), offs=offsets)
        in_group = (group_of_rows(offsets, x.shape[0]) < offsets.shape[0]).unsqueeze(1)
        return torch.where(in_group, out, torch.zeros((), dtype=out.dtype, device=out.device)).to(_output_dtype(x))

    def fp8_forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe,  # type: ignore[override]
                    training: bool, observer, offsets: Tensor) -> Tensor:
        """The casts (grouped caster) and the three grouped GEMMs (modules/linear_gemms.py with offsets)."""
        if observer is not None:
            observer("input", observed_weight(x))
            observer("weight", observed_weight(weight))
        meta = self.fp8_meta
        caster = caster_for(recipe, offsets)
        quantized_wgrad = torch.is_grad_enabled() and weight.requires_grad and not recipe.high_precision_wgrad
        x_cast = caster.cast(x, meta.amax_history, "input", training, layouts=(True, quantized_wgrad))
        w_cast = caster.cast(weight, meta.amax_history, "weight", training, layouts=(True, False))
        cfg = GemmConfig(recipe, _output_dtype(x), training)
        return linear_gemms(x, weight, None, x_cast, w_cast, meta.amax_history, observer, cfg, offsets=offsets)

    def to_unconverted(self) -> nn.Module:
        raise TypeError(f"{type(self).__name__} is part of an FP8 experts module: revert the experts module "
                        "(lightning_fp8.revert_fp8 of the model) instead")

    def extra_repr(self) -> str:
        return (f"{self.parameter}: {self.num_experts} experts x {self.in_features} -> {self.out_features}, "
                f"top-{self.top_k}, " + FP8Layer.extra_repr(self).lstrip(", "))


# -- an experts module in FP8 -------------------------------------------------------------------------------------
def fp8_gemms(module: nn.Module) -> Optional[Tuple[FP8GroupedLinear, FP8GroupedLinear]]:
    """The FP8 layers of a converted experts module (first projection, down projection), or None."""
    layers = [child for child in module.children() if isinstance(child, FP8GroupedLinear)]
    return (layers[0], layers[1]) if len(layers) == 2 else None


def convert_experts(module: nn.Module, layout: ExpertsLayout, recipe: FP8Recipe) -> Tuple[FP8GroupedLinear, ...]:
    """Give an experts module its FP8 layers (module docstring) and select the FP8 implementation for it alone (its
    own copy of the config, the original kept for `revert_experts`). `recipe`: from `grouped_recipe`."""
    register_with_transformers()
    layers = tuple(FP8GroupedLinear(module, layout, projection, recipe) for projection in layout.projections)
    for projection, layer in zip(layout.projections, layers):
        module.add_module(projection.child, layer)
    original = module.config
    config = copy.copy(original)
    config._experts_implementation_internal = IMPLEMENTATION
    module.__dict__[ORIGINAL_CONFIG_ATTR] = original
    module.config = config
    return layers


def revert_experts(module: nn.Module) -> None:
    """Undo `convert_experts`: the FP8 layers removed, the module's own config (and implementation) back."""
    for name, child in list(module.named_children()):
        if isinstance(child, FP8GroupedLinear):
            delattr(module, name)
    original = module.__dict__.pop(ORIGINAL_CONFIG_ATTR, None)
    if original is not None:
        module.config = original


def fp8_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts forward (ExpertsInterface) with the grouped GEMMs in FP8: hidden_states (T, H), the
    routed experts (T, K) and their weights (T, K) -> (T, H), as transformers' grouped_mm implementation computes it
    (tokens sorted by expert, the expert-parallel sentinel ids >= num_experts giving zero rows, biases after the
    GEMMs, `_apply_gate` / `act_fn` between them, the optional post-expert norm, the weighted sum per token). A module
    without FP8 layers runs the implementation it had before conversion."""
    gemms = fp8_gemms(self)
    if gemms is None:
        return _original_forward(self)(self, hidden_states, top_k_index, top_k_weights)
    first, down = gemms
    tokens, k = top_k_index.shape
    num_experts = first.num_experts
    expert_ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    counts = torch.bincount(sorted_ids.clamp(max=num_experts), minlength=num_experts + 1)[:num_experts]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    x = hidden_states[order // k]
    routed = (sorted_ids < num_experts).unsqueeze(1)  # the expert-parallel sentinel rows are no expert's here
    bias_ids = sorted_ids.clamp(max=num_experts - 1)
    h = _with_bias(first(x, offsets), self, first.parameter, bias_ids, routed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = _with_bias(down(h, offsets), self, down.parameter, bias_ids, routed)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse].view(tokens, k, -1).sum(1).to(hidden_states.dtype)


def _with_bias(out: Tensor, module: nn.Module, parameter: str, ids: Tensor, routed: Tensor) -> Tensor:
    bias = getattr(module, f"{parameter}_bias", None) if module.has_bias else None
    if bias is None:
        return out
    return out + torch.where(routed, bias[ids], torch.zeros((), dtype=bias.dtype, device=bias.device)).to(out.dtype)


def _original_forward(module: nn.Module):
    """The implementation the module ran before conversion (its original config's choice; "eager": the class's own
    forward, which transformers' decorator wraps)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    config = module.__dict__.get(ORIGINAL_CONFIG_ATTR, module.config)
    name = config._experts_implementation
    if name == IMPLEMENTATION:
        name = "grouped_mm"
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, type(module).forward.__wrapped__)


def register_with_transformers() -> None:
    """Register `fp8_experts_forward` as transformers' experts implementation "lightning_fp8" (once)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, fp8_experts_forward)
