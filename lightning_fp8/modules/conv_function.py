"""The autograd functions of FP8 convolutions: the three GEMMs of a convolution on FP8 operands, through the same
casts and GEMM op as FP8Linear (`lightning_fp8::scaled_cast` / `tiled_cast` / `microscaled_cast`,
`lightning_fp8::fp8_gemm`). Layout (unfold, col2im, the weight as a matrix): lightning_fp8/modules/conv_layout.py.

Per group g of the convolution (cols = the unfolded input, conv_layout.im2col):

  forward  y_g     = cols_g @ W_g^T          input (E4M3)        x weight (E4M3)    out: the compute dtype
  dgrad    dx_g    = dycols_g @ W'_g^T       grad_output (E5M2)  x weight (E4M3)    stride 1: a convolution of dy
           dcols_g = dy_g @ W_g              grad_output (E5M2)  x weight (E4M3)    strided: float32, then col2im
  wgrad    dW_g    = dy_g^T @ cols_g         grad_output (E5M2)  x input (E4M3)     out: the compute dtype

(formats of the HYBRID recipe; dycols: the unfolded, padded gradient, W': the flipped weight, conv_layout.py). A
strided input gradient is accumulated in float32 through the col2im additions and rounded once; every other GEMM
accumulates in float32 and rounds once. So every output and gradient equals its definition (the FP8 operands'
products summed in float32, rounded once) up to summation order.

Per-tensor recipes (delayed / current), `FP8ConvGemms`: a per-tensor scale commutes with the unfold, so x (and dy)
is cast once, compactly (the forward's cast happens before this function, as FP8Linear's does), and unfolded as FP8
bytes. What backward keeps: x in FP8 (1 byte per input element, padded; a BF16 convolution keeps 2), the scales and
the weight Parameter (re-cast in backward with the forward's scale, as FP8Linear does). Transient: the unfolded FP8
input, k*k bytes per input element, in forward and again in backward; the unfolded FP8 gradient (stride 1), k*k bytes
per input element, or the float32 columns of a strided input gradient, 4*k*k bytes per output position and channel.

Fine-grained recipes (rowwise / blockwise), `fine_grained_conv`: a tile scale covers a window of the unfolded input,
so the unfold comes first, in float32 (a differentiable `Unfold` whose backward is the float32 col2im), and each
group's GEMMs are FP8Linear's tiled autograd function on that matrix, computing in float32 (one rounding to the
compute dtype afterwards: the same result as rounding the accumulator directly). Costs: the float32 unfold
(4*k*k bytes per input element, transient) and the FP8 transpose of the unfolded input kept for the weight gradient
(k*k bytes per input element): the layers FP8LayerFallback escalates to a finer scaling pay this, not the others.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from lightning_fp8.kernels.device import profile_of
from lightning_fp8.modules.cast import cast_to_fp8, caster_for
from lightning_fp8.modules.conv_layout import (
    ConvGeometry,
    col2im_add_,
    crop_to_input,
    flipped_weight_matrix,
    im2col,
    input_gradient_geometry,
    padded_nhwc,
    weight_from_matrix,
    weight_matrix,
)
from lightning_fp8.modules.linear_gemms import GemmConfig, linear_gemms
from lightning_fp8.modules.gemm import fp8_gemm
from lightning_fp8.modules.operand import FP8Matrix
from lightning_fp8.recipe import FP8Recipe

Tensor = torch.Tensor


def _memory_format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if (x.dim() == 4 and not x.is_contiguous()
                                   and x.is_contiguous(memory_format=torch.channels_last)) else torch.contiguous_format


def _b_column_major(device: torch.device, backend: str) -> bool:
    """Whether this device's GEMMs read their second operand column-major: `torch._scaled_mm` takes mat_b (K, N)
    column-major, so where it runs, the unfold and the weight matrix (copies made anyway) write B that way and the
    planner passes it on instead of copying it again. The emulation reads either layout. Decided by the device, not
    by the FP8 tensor: `kernels.materializes_transpose` answers whether the cast kernel writes a transpose, and is
    False for every FP8 tensor (the kernels read high-precision input only)."""
    return backend != "emulated" and profile_of(device).fp8_tensor_cores


def _group_slice(size: int, groups: int, group: int) -> slice:
    per = size // groups
    return slice(group * per, (group + 1) * per)


class FP8ConvGemms(torch.autograd.Function):
    """apply(x, weight, bias, xp_fp8, x_scale_inv, w_fp8, w_scale, w_scale_inv, history, observer, cfg, geometry).

    x (N, C, H, W) / weight (O, C/g, kh, kw) / bias carry the autograd graph; xp_fp8 is x cast to FP8, padded and
    channels-last (`conv_layout.padded_nhwc`); w_fp8 the weight cast (its shape); history the layer's [3, L+1] amax
    history (backward records the gradient's amax in it). Returns y (N, O, Ho, Wo) as a channels-last view."""

    @staticmethod
    def forward(ctx, x, weight, bias, xp_fp8, x_scale_inv, w_fp8, w_scale, w_scale_inv, history, observer,
                cfg: GemmConfig, geometry: ConvGeometry):
        n, _, h, w = x.shape
        out_hw = geometry.output_size(h, w)
        groups = geometry.groups
        outs = []
        for g in range(groups):
            b = bias[_group_slice(bias.shape[0], groups, g)] if bias is not None else None
            outs.append(fp8_gemm(FP8Matrix(im2col(xp_fp8, geometry, g, out_hw), x_scale_inv),
                                 FP8Matrix(weight_matrix(w_fp8, g, groups).t(), w_scale_inv), cfg.out_dtype, b,
                                 cfg.recipe.fast_accum_forward, cfg.recipe.backend, cfg.recipe.allow_emulation))
        out = outs[0] if groups == 1 else torch.cat(outs, dim=1)
        ctx.cfg, ctx.geometry, ctx.observer = cfg, geometry, observer
        ctx.x_shape, ctx.x_dtype, ctx.x_format = tuple(x.shape), x.dtype, _memory_format(x)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(
            xp_fp8 if ctx.needs_input_grad[1] else None,
            x_scale_inv,
            weight if ctx.needs_input_grad[0] else None,
            w_scale,
            w_scale_inv,
        )
        ctx.history = history  # the live state, not a saved value (see linear_gemms.py)
        return out.view(n, out_hw[0], out_hw[1], out.shape[1]).permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        xp_fp8, x_scale_inv, weight, w_scale, w_scale_inv = ctx.saved_tensors
        cfg: GemmConfig = ctx.cfg
        geometry: ConvGeometry = ctx.geometry
        groups = geometry.groups
        needs_dgrad, needs_wgrad, needs_bgrad = ctx.needs_input_grad[:3]
        n, c, h, w = ctx.x_shape
        out_hw = (grad_out.shape[2], grad_out.shape[3])
        if ctx.observer is not None:
            ctx.observer("grad_output", grad_out)
        g2d = grad_out.permute(0, 2, 3, 1).reshape(-1, grad_out.shape[1])  # a view for channels-last gradients
        caster = caster_for(cfg.recipe)
        dy = caster.cast(g2d, ctx.history, "grad_output", cfg.training, layouts=(True, needs_wgrad),
                         history_sized=cfg.grad_history_sized)
        g_fp8, g_scale_inv = dy.matrix.data, dy.matrix.scale_inv
        o = g2d.shape[1]
        grad_x = grad_w = grad_b = None
        if needs_dgrad:
            # the weight the forward saw, re-cast with its scale (as FP8Linear's backward does)
            w_fp8 = cast_to_fp8(weight.reshape(weight.shape[0], -1), w_scale, cfg.recipe.format_for("weight"))
            w_fp8 = w_fp8.view(weight.shape)
            grad_x = _input_gradient(g_fp8, g_scale_inv, w_fp8, w_scale_inv, ctx.x_shape, out_hw, cfg, geometry)
            grad_x = grad_x.to(dtype=ctx.x_dtype, memory_format=ctx.x_format)
        if needs_wgrad:
            g_a = dy.matrix_t().data  # (O, M)
            column_major = _b_column_major(xp_fp8.device, cfg.recipe.backend)
            parts = [
                fp8_gemm(FP8Matrix(g_a[_group_slice(o, groups, g)], g_scale_inv),
                         FP8Matrix(im2col(xp_fp8, geometry, g, out_hw, transposed=column_major), x_scale_inv),
                         cfg.out_dtype, None, False, cfg.recipe.backend, cfg.recipe.allow_emulation)
                for g in range(groups)
            ]
            dw = parts[0] if groups == 1 else torch.cat(parts, dim=0)
            grad_w = weight_from_matrix(dw, torch.Size((o, c // groups, *geometry.kernel)))
            if grad_w.dtype != ctx.weight_dtype:
                grad_w = grad_w.to(ctx.weight_dtype)
        if needs_bgrad:
            grad_b = g2d.sum(0, dtype=torch.float32)
            if grad_b.dtype != ctx.bias_dtype:
                grad_b = grad_b.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def _input_gradient(g_fp8: Tensor, g_scale_inv: Tensor, w_fp8: Tensor, w_scale_inv: Tensor, x_shape, out_hw,
                    cfg: GemmConfig, geometry: ConvGeometry) -> Tensor:
    """dx (N, C, H, W) from the FP8 gradient (N*Ho*Wo, O) and weight (module docstring: a convolution of dy at stride
    1, the transposed GEMM and col2im otherwise)."""
    n, c, h, w = x_shape
    groups = geometry.groups
    o = g_fp8.shape[1]
    dgeo = input_gradient_geometry(geometry)
    if dgeo is not None:
        gp = padded_nhwc(g_fp8.view(n, out_hw[0], out_hw[1], o).permute(0, 3, 1, 2), dgeo)
        parts = [fp8_gemm(FP8Matrix(im2col(gp, dgeo, g, (h, w)), g_scale_inv),
                          FP8Matrix(flipped_weight_matrix(w_fp8, g, groups).t(), w_scale_inv), cfg.out_dtype, None,
                          False, cfg.recipe.backend, cfg.recipe.allow_emulation)
                 for g in range(groups)]
        dx = parts[0] if groups == 1 else torch.cat(parts, dim=1)
        return dx.view(n, h, w, c).permute(0, 3, 1, 2)
    column_major = _b_column_major(g_fp8.device, cfg.recipe.backend)
    top, bottom, left, right = geometry.padding
    dxp = torch.zeros((n, h + top + bottom, w + left + right, c), dtype=torch.float32, device=g_fp8.device)
    for g in range(groups):
        cols = fp8_gemm(FP8Matrix(g_fp8[:, _group_slice(o, groups, g)], g_scale_inv),
                        FP8Matrix(weight_matrix(w_fp8, g, groups, transposed=column_major), w_scale_inv),
                        torch.float32, None, False, cfg.recipe.backend, cfg.recipe.allow_emulation)
        col2im_add_(dxp, cols, geometry, g, out_hw)
    # rounded once, to the compute dtype every other GEMM of the layer produces
    return crop_to_input(dxp, geometry, h, w).to(cfg.out_dtype)


def per_tensor_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], x_fp8: Tensor, x_scale_inv: Tensor,
                    w_fp8: Tensor, w_scale: Tensor, w_scale_inv: Tensor, history: Tensor, observer, cfg: GemmConfig,
                    geometry: ConvGeometry) -> Tensor:
    """y (N, O, Ho, Wo) of a per-tensor FP8 convolution: x_fp8 is x cast to FP8 (x's shape, any layout), w_fp8 the
    weight cast (its shape)."""
    xp_fp8 = padded_nhwc(x_fp8, geometry)
    return FP8ConvGemms.apply(x, weight, bias, xp_fp8, x_scale_inv, w_fp8, w_scale, w_scale_inv, history, observer,
                              cfg, geometry)


class Unfold(torch.autograd.Function):
    """apply(x, geometry) -> the unfolded input of every group, float32 (`conv_layout.im2col`); backward: col2im
    in float32, rounded once to x's dtype."""

    @staticmethod
    def forward(ctx, x, geometry: ConvGeometry):
        n, c, h, w = x.shape
        out_hw = geometry.output_size(h, w)
        xp = padded_nhwc(x.to(torch.float32), geometry)
        ctx.geometry, ctx.x_shape, ctx.out_hw = geometry, (n, c, h, w), out_hw
        ctx.x_dtype, ctx.x_format = x.dtype, _memory_format(x)
        return tuple(im2col(xp, geometry, g, out_hw).contiguous() for g in range(geometry.groups))

    @staticmethod
    def backward(ctx, *grad_cols):
        geometry: ConvGeometry = ctx.geometry
        n, c, h, w = ctx.x_shape
        top, bottom, left, right = geometry.padding
        device = next(gc.device for gc in grad_cols if gc is not None)
        dxp = torch.zeros((n, h + top + bottom, w + left + right, c), dtype=torch.float32, device=device)
        for g, cols in enumerate(grad_cols):
            if cols is not None:
                col2im_add_(dxp, cols.to(torch.float32), geometry, g, ctx.out_hw)
        return crop_to_input(dxp, geometry, h, w).to(dtype=ctx.x_dtype, memory_format=ctx.x_format), None


def fine_grained_conv(layer, x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe, training: bool,
                      observer, out_dtype: torch.dtype, geometry: ConvGeometry) -> Tensor:
    """y (N, O, Ho, Wo) of a fine-grained (rowwise / blockwise) FP8 convolution: per group, FP8Linear's tiled GEMMs on
    the unfolded input (see the module docstring). `layer` holds the FP8 metadata."""
    meta = layer.fp8_meta
    n, _, h, w = x.shape
    out_hw = geometry.output_size(h, w)
    groups = geometry.groups
    cols: Tuple[Tensor, ...] = Unfold.apply(x, geometry)
    needs_wgrad = torch.is_grad_enabled() and weight.requires_grad
    caster = caster_for(recipe)
    pad_to = caster.token_padding(cols[0], needs_wgrad)  # the weight-gradient GEMM contracts the N*Ho*Wo positions
    cfg = GemmConfig(recipe, torch.float32, training, pad_to)
    outs: List[Tensor] = []
    for g in range(groups):
        w_g = weight_matrix(weight, g, groups)  # differentiable: its gradient reaches the weight through the permute
        b = bias[_group_slice(bias.shape[0], groups, g)] if bias is not None else None
        if observer is not None:
            observer("input", cols[g])
            observer("weight", w_g)
        x_cast = caster.cast(cols[g], meta.amax_history, "input", training, layouts=(True, needs_wgrad), pad_to=pad_to)
        w_cast = caster.cast(w_g, meta.amax_history, "weight", training)
        outs.append(linear_gemms(cols[g], w_g, b, x_cast, w_cast, meta.amax_history, observer, cfg))
    out = outs[0] if groups == 1 else torch.cat(outs, dim=1)
    return out.to(out_dtype).view(n, out_hw[0], out_hw[1], out.shape[1]).permute(0, 3, 1, 2)
