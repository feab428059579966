"""FP8Conv1d / FP8Conv2d: convolutions whose three GEMMs (forward, input gradient, weight gradient) run in FP8.

Each is `FP8Layer` mixed into nn.Conv1d / nn.Conv2d, like FP8Linear into nn.Linear: it keeps the convolution's
`weight` / `bias` Parameters and state_dict keys, stays an instance of its class, and shares with every FP8 layer
the FP8 metadata (one amax history per role: input, weight, grad_output), the recipe, the precision switch that
FP8LayerFallback turns off, calibration, the scale close and the observers FP8ScaleMonitor samples through.

How a convolution becomes GEMMs: unfold + GEMM (lightning_fp8/modules/conv_layout.py), one GEMM of
K = kh*kw*C/groups per group; the GEMMs, their casts and gradients: lightning_fp8/modules/conv_function.py.
Unfold rather than an implicit GEMM (kh*kw shifted GEMMs accumulated in float32): on a GPU it is one
`torch._scaled_mm` per GEMM instead of kh*kw, at the cost of the unfolded input's transient memory.

Every padding mode is supported: "zeros" inside the unfold, the others by padding the input with F.pad first, as
nn.Conv2d does. Unbatched inputs ((C, H, W) / (C, L)) are supported as nn.Conv2d supports them.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8.modules.cast import caster_for
from lightning_fp8.modules.conv_function import fine_grained_conv, per_tensor_conv
from lightning_fp8.modules.conv_layout import ConvGeometry, is_channels_last
from lightning_fp8.modules.linear_gemms import GemmConfig
from lightning_fp8.modules.linear import FP8Layer, _output_dtype
from lightning_fp8.recipe import PER_TENSOR_SCALINGS, FP8Recipe

Tensor = torch.Tensor

#: the scalings FP8 convolutions have a path for. Per-tensor ones cast x once and unfold the FP8 bytes
#: (conv_function.per_tensor_conv); tiled ones scale windows of the unfolded input, so they unfold first
#: (conv_function.fine_grained_conv). A scaling FP8Recipe gains later has no convolution path until one is added here.
TILED_SCALINGS = ("rowwise", "blockwise")
CONV_SCALINGS = PER_TENSOR_SCALINGS + TILED_SCALINGS

#: the attributes that define an nn.Conv1d / nn.Conv2d besides its Parameters
_CONV_ATTRIBUTES = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "transposed",
                    "output_padding", "groups", "padding_mode", "_reversed_padding_repeated_twice")


class FP8ConvNd(FP8Layer):
    """What FP8Conv1d and FP8Conv2d share (see the module docstring). Build one with `from_conv`."""

    #: the class this FP8 layer replaces (nn.Conv1d / nn.Conv2d)
    unconverted_class: type = nn.Module
    fp8_scalings = CONV_SCALINGS
    #: the weight-gradient GEMM runs on the FP8 operands only (FP8Recipe(weight_grad="high_precision") has no
    #: convolution path yet: the backward would need the unfolded input kept in high precision)
    fp8_weight_grads = ("quantized",)

    # -- the GEMM view of the layer ---------------------------------------------------------------------------------
    @property
    def in_features(self) -> int:
        """K of the layer's GEMMs: the inputs one output value is summed over (C/groups x kernel)."""
        return self.in_channels // self.groups * math.prod(self.kernel_size)

    @property
    def out_features(self) -> int:
        return self.out_channels

    def fp8_weight(self) -> Tensor:
        """The weight the GEMMs read: the Parameter itself, (O, C/groups, *kernel) (the GEMMs take it as a matrix
        in conv_layout.weight_matrix)."""
        return self.weight

    # -- forward ----------------------------------------------------------------------------------------------------
    def high_precision_forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        return self._conv_forward(x, weight, bias)

    def fp8_forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe, training: bool,
                    observer) -> Tensor:
        one_d = len(self.kernel_size) == 1
        unbatched = x.dim() == len(self.kernel_size) + 1
        if unbatched:
            x = x.unsqueeze(0)
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        x4, w4 = (x.unsqueeze(2), weight.unsqueeze(2)) if one_d else (x, weight)
        channels_last = is_channels_last(x4) or is_channels_last(w4)
        geometry = ConvGeometry.of(self)
        out_dtype = _output_dtype(x)
        meta = self.fp8_meta
        if recipe.weight_grad not in self.fp8_weight_grads:
            raise ValueError(f"{type(self).__name__}: FP8Recipe.weight_grad={recipe.weight_grad!r} has no convolution "
                             f"path; valid choices: {list(self.fp8_weight_grads)}")
        if recipe.scaling in TILED_SCALINGS:
            y = fine_grained_conv(self, x4, w4, bias, recipe, training, observer, out_dtype, geometry)
        elif recipe.scaling not in PER_TENSOR_SCALINGS:
            raise ValueError(f"{type(self).__name__}: FP8Recipe.scaling={recipe.scaling!r} has no convolution path; "
                             f"valid choices: {list(CONV_SCALINGS)}")
        else:
            if observer is not None:
                observer("input", x)
                observer("weight", weight)
            caster = caster_for(recipe)
            x_fp8, x_scale_inv = _cast_input(caster, x4, meta, training)
            w_cast = caster.cast(weight.reshape(weight.shape[0], -1), meta.amax_history, "weight", training,
                                 history_sized=meta.weight.history_sized)
            cfg = GemmConfig(recipe, out_dtype, training,
                             grad_history_sized=training and meta.grad_output.history_sized)
            y = per_tensor_conv(x4, w4, bias, x_fp8, x_scale_inv, w_cast.matrix.data.view(w4.shape), w_cast.scale,
                                w_cast.matrix.scale_inv, meta.amax_history, observer, cfg, geometry)
        # the output in the layout nn.Conv2d gives it: channels-last where the input or the weight is
        y = y.squeeze(2).contiguous() if one_d else y.contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return y.squeeze(0) if unbatched else y

    # -- conversion -------------------------------------------------------------------------------------------------
    @classmethod
    def from_conv(cls, conv: nn.Module, recipe: Optional[FP8Recipe] = None) -> "FP8ConvNd":
        """Wrap an existing convolution, reusing its Parameters (optimizer references and weight tying survive)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name in _CONV_ATTRIBUTES:
            setattr(new, name, getattr(conv, name))
        new.weight = conv.weight
        new.bias = conv.bias
        new.train(conv.training)
        new._init_fp8(recipe, device=conv.weight.device)
        return new

    def to_unconverted(self) -> nn.Module:
        conv = self.unconverted_class(
            self.in_channels, self.out_channels, self.kernel_size, stride=self.stride, padding=self.padding,
            dilation=self.dilation, groups=self.groups, bias=self.bias is not None, padding_mode=self.padding_mode,
            device="meta",
        )
        conv.weight = self.weight
        conv.bias = self.bias
        conv.train(self.training)
        return conv


def _cast_input(caster, x4: Tensor, meta, training: bool):
    """Cast x (N, C, H, W) as the input role through a 2-D view of its memory (the cast op takes 2-D tensors; a
    per-tensor scale does not care about the order), no copy for contiguous or channels-last data. Returns the FP8
    tensor with x's shape and layout, and its scale_inv."""
    n, c, h, w = x4.shape
    if is_channels_last(x4):
        x_cast = caster.cast(x4.permute(0, 2, 3, 1).reshape(-1, c), meta.amax_history, "input", training,
                             history_sized=meta.input.history_sized)
        return x_cast.matrix.data.view(n, h, w, c).permute(0, 3, 1, 2), x_cast.matrix.scale_inv
    x_cast = caster.cast(x4.contiguous().view(-1, w), meta.amax_history, "input", training,
                         history_sized=meta.input.history_sized)
    return x_cast.matrix.data.view(n, c, h, w), x_cast.matrix.scale_inv


class FP8Conv1d(FP8ConvNd, nn.Conv1d):
    """nn.Conv1d whose GEMMs run in FP8 (see the module docstring). `FP8Conv1d.from_conv(conv, recipe)`."""

    unconverted_class = nn.Conv1d


class FP8Conv2d(FP8ConvNd, nn.Conv2d):
    """nn.Conv2d whose GEMMs run in FP8 (see the module docstring). `FP8Conv2d.from_conv(conv, recipe)`."""

    unconverted_class = nn.Conv2d
