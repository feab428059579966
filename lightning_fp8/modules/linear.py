"""FP8Linear: a drop-in nn.Linear whose three GEMMs run in FP8.

One autograd function casts each operand of each GEMM:
  forward  y      = x  @ W^T      input (E4M3)      x weight (E4M3)
  dgrad    dx     = dy @ W        grad_output (E5M2) x weight (E4M3)
  wgrad    dW     = dy^T @ x      grad_output (E5M2) x input (E4M3)     (formats for the HYBRID recipe)
with float32 accumulation. The input is saved for backward *in FP8* (half the bytes of a BF16 save), and no copy
of the weight is kept: backward re-casts the high-precision weight with the scale the forward used, which on GPU
happens in the same pass as the transpose the dgrad GEMM needs anyway.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8.modules.autocast import current_state
from lightning_fp8.modules.gemm import fp8_gemm
from lightning_fp8.modules.cast import cast_to_fp8, scaled_cast, scaled_cast_transpose
from lightning_fp8.numerics.quantize import tensor_amax
from lightning_fp8.numerics.scaling import ScalingState
from lightning_fp8.recipe import ROLES, FP8Recipe


class FP8LinearMeta(nn.Module):
    """The FP8 metadata of one linear: a ScalingState per tensor role and the layer's precision switch."""

    def __init__(self, history_len: int, device=None) -> None:
        super().__init__()
        for role in ROLES:
            self.add_module(role, ScalingState(history_len, device=device))
        self.register_buffer("enabled", torch.ones((), dtype=torch.bool, device=device))

    def states(self):
        return {role: getattr(self, role) for role in ROLES}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "enabled" not in state_dict:
            state_dict[prefix + "enabled"] = self.enabled.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, meta: FP8LinearMeta, recipe: FP8Recipe, record: bool, observer):
        out_dtype = _output_dtype(x)
        in_features = weight.shape[1]
        x2d = x.reshape(-1, in_features)
        needs_wgrad = ctx.needs_input_grad[1]
        if needs_wgrad:
            # one read of x gives both layouts: row-major for this GEMM, transposed for the wgrad GEMM in backward
            x_fp8, x_fp8_t, x_scale = scaled_cast_transpose(x2d, meta.input, recipe, "input", record)
        else:  # evaluation or a frozen weight: no wgrad GEMM, no transposed copy to make or keep
            (x_fp8, x_scale), x_fp8_t = scaled_cast(x2d, meta.input, recipe, "input", record), None
        w_fp8, w_scale = scaled_cast(weight, meta.weight, recipe, "weight", record)
        with torch.autocast(x.device.type, enabled=False):
            out = fp8_gemm(
                x_fp8,
                x_scale.reciprocal(),
                w_fp8.t(),
                w_scale.reciprocal(),
                out_dtype=out_dtype,
                bias=bias,
                use_fast_accum=recipe.fast_accum_forward,
                backend=recipe.backend,
            )
        # x in FP8 (1 byte/element, in the layout wgrad wants) + two scalars; `weight` is the Parameter, not a copy
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(x_fp8_t, x_scale, weight, w_scale)
        ctx.meta = meta
        ctx.recipe = recipe
        ctx.record = record
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.observer = observer
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8_t, x_scale, weight, w_scale = ctx.saved_tensors
        recipe: FP8Recipe = ctx.recipe
        out_features = weight.shape[0]
        g2d = grad_out.reshape(-1, out_features)
        if ctx.observer is not None:
            ctx.observer("grad_output", g2d)
        g_fp8, g_fp8_t, g_scale = scaled_cast_transpose(g2d, ctx.meta.grad_output, recipe, "grad_output", ctx.record)
        g_scale_inv = g_scale.reciprocal()
        grad_x = grad_w = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                # re-cast with the forward's scale (dgrad sees the weight the forward saw), straight into the
                # transposed layout: W^T row-major is W column-major, what _scaled_mm wants as second operand
                w_fp8_t = cast_to_fp8(weight, w_scale, recipe.format_for("weight"), layout="t")
                grad_x = fp8_gemm(g_fp8, g_scale_inv, w_fp8_t.t(), w_scale.reciprocal(), out_dtype=ctx.x_dtype, backend=recipe.backend)
                grad_x = grad_x.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                grad_w = fp8_gemm(g_fp8_t, g_scale_inv, x_fp8_t.t(), x_scale.reciprocal(), out_dtype=weight.dtype, backend=recipe.backend)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g2d.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class FP8Layer(nn.Module):
    """What every FP8 layer shares, whatever linear-like class it extends: the FP8 metadata (`fp8_meta`), the
    precision switch, the scale update and the forward that runs the three GEMMs in FP8.

    A concrete FP8 layer is `FP8Layer` mixed into a linear-like module class that has `weight`, `bias`,
    `in_features` and `out_features` (FP8Linear: `class FP8Linear(FP8Layer, nn.Linear)`). It tells the FP8 path how
    its weight maps onto y = x W^T + b through `fp8_weight()` (for nn.Linear the weight itself, (out, in)).

    The FP8 metadata is not part of the layer's `state_dict` (a plain model loads the weights of a converted one,
    and exports such as `save_pretrained` keep the keys of the original model): `lightning_fp8.fp8_state_dict` and
    `load_fp8_state_dict` carry it, and every adapter's checkpoint includes it. A state_dict that does contain
    `fp8_meta.*` entries (written by an earlier version) still loads them.
    """

    in_features: int
    out_features: int

    def _init_fp8(self, recipe: Optional[FP8Recipe], device) -> None:
        self.recipe = recipe if recipe is not None else FP8Recipe()
        self.fp8_meta = FP8LinearMeta(self.recipe.amax_history_len, device=device)
        self._fp8_enabled = True
        #: why the layer is not in FP8 (None while it is); set by fallback logic
        self.fp8_disabled_reason: Optional[str] = None
        #: False when an engine syncs and updates the scales (once per optimizer step, after an amax all-reduce)
        self.autoupdate_scales = True
        #: optional callable(role, tensor) called with each high-precision operand before its cast (observability
        #: samples statistics through it); None costs nothing
        self.fp8_observer = None
        self.register_load_state_dict_post_hook(_sync_enabled_flag_after_load)
        self._register_state_dict_hook(_drop_fp8_meta_from_state_dict)

    def fp8_weight(self) -> torch.Tensor:
        """The weight as the (out_features, in_features) matrix of y = x W^T + b (a view, never a copy)."""
        return self.weight

    # -- precision switch ---------------------------------------------------------------------------------------
    @property
    def fp8_enabled(self) -> bool:
        return self._fp8_enabled

    @fp8_enabled.setter
    def fp8_enabled(self, value: bool) -> None:
        self._fp8_enabled = bool(value)
        self.fp8_meta.enabled.fill_(bool(value))
        if value:
            self.fp8_disabled_reason = None

    # -- scaling ------------------------------------------------------------------------------------------------
    def update_scales(self, recipe: Optional[FP8Recipe] = None) -> None:
        """Close the step for all three roles: new delayed scales from the histories, roll the histories."""
        recipe = recipe or self.recipe
        for role, state in self.fp8_meta.states().items():
            state.update(
                recipe.format_for(role),
                recipe.scaling,
                recipe.amax_compute_algo,
                recipe.margin,
                recipe.power_of_2_scales,
                scaled=recipe.uses_scaling_for(role),
            )

    def _pending_update(self) -> bool:
        return any(state.pending_update for state in self.fp8_meta.states().values())

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast_state = current_state()
        recipe = autocast_state.recipe or self.recipe
        weight = self.fp8_weight()
        if autocast_state.calibrating:
            self._record_calibration(x, weight)
            return F.linear(x, weight, self.bias)
        if not (self._fp8_enabled and autocast_state.enabled):
            return F.linear(x, weight, self.bias)
        training = self.training and torch.is_grad_enabled()
        if training and self.autoupdate_scales and self._pending_update():
            self.update_scales(recipe)
        observer = self.fp8_observer
        if observer is not None:
            observer("input", x)
            observer("weight", weight)
        return _FP8LinearFunction.apply(x, weight, self.bias, self.fp8_meta, recipe, training, observer)

    @torch.no_grad()
    def _record_calibration(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        # nothing is cast while calibrating: only the amaxes are observed (no clip or overflow is counted)
        self.fp8_meta.input.observe_amax(tensor_amax(x))
        self.fp8_meta.weight.observe_amax(tensor_amax(weight))

    def to_unconverted(self) -> nn.Module:
        """The original (high-precision) layer with the same Parameters: what `revert_fp8` puts back."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to revert itself")

    def reset_fp8_state(self) -> None:
        """Forget every role's scale and amax history (e.g. before retrying FP8 after a fallback: old scales may be
        stale); the next training step starts with current scaling."""
        for state in self.fp8_meta.states().values():
            state.reset()

    def sync_precision_flag(self) -> None:
        """Re-read the precision switch from its buffer after the buffer was written in place (a rollback)."""
        self._fp8_enabled = bool(self.fp8_meta.enabled)

    def extra_repr(self) -> str:
        precision = "fp8" if self._fp8_enabled else f"bf16 ({self.fp8_disabled_reason or 'disabled'})"
        return f"{super().extra_repr()}, format={self.recipe.format}, scaling={self.recipe.scaling}, precision={precision}"


class FP8Linear(FP8Layer, nn.Linear):
    """nn.Linear whose GEMMs run in FP8 (see the module docstring for the recipe per GEMM).

    It keeps nn.Linear's `weight` and `bias` Parameters and state_dict keys; the FP8 metadata lives in `fp8_meta`
    (outside the state_dict: see FP8Layer).

    `fp8_enabled = False` makes the layer compute like nn.Linear in the compute dtype (BF16 under autocast), with no
    FP8 cast: this is the switch per-layer fallback uses.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe: Optional[FP8Recipe] = None,
    ) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe, device=self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Optional[FP8Recipe] = None) -> "FP8Linear":
        """Wrap an existing linear, reusing its Parameters (optimizer references and weight tying survive)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new._init_fp8(recipe, device=linear.weight.device)
        return new

    def to_unconverted(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = self.weight
        linear.bias = self.bias
        linear.train(self.training)
        return linear


def _sync_enabled_flag_after_load(module: FP8Layer, incompatible_keys) -> None:
    module.sync_precision_flag()


def _drop_fp8_meta_from_state_dict(module: FP8Layer, state_dict, prefix: str, local_metadata) -> None:
    """The layer's state_dict holds what the original layer's did (see FP8Layer): drop the FP8 metadata entries."""
    for key in [k for k in state_dict if k.startswith(prefix + "fp8_meta.")]:
        del state_dict[key]
