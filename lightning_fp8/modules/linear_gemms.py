"""The one autograd function of FP8 linear GEMMs, for every scaling: the three GEMMs of y = x W^T + b.

  forward  y  = x  @ W^T     x.matrix          x  W.matrix^T
  dgrad    dx = dY @ W       dY.matrix         x  (W^T)^T   (W^T as kept from forward, or cast again in backward)
  wgrad    dW = dY^T @ x     dY^T              x  (x^T)^T   (x^T as cast in forward)

Each operand is an `FP8Operand` from the recipe's caster (modules/cast.py); its `matrix_t()` is the layout a GEMM
contracting the rows reads. The forward's casts of x and W happen before this function, in FP8Layer.forward, so their
state updates live in the main graph (what lets `torch.compile` trace a converted model as one graph); backward casts
dY, recording its amax into the layer's history (the live tensor, not a saved copy: a layer called twice in one
forward has changed it by then).

What backward keeps: x^T as cast (x itself in high precision with FP8Recipe(weight_grad="high_precision"), whose
weight gradient is then a GEMM in the compute dtype), the weight's transpose where the forward's cast wrote it (1 byte
per weight element, as Transformer Engine keeps it), else the weight Parameter itself (no copy), which backward casts
again with the forward's scale.

Output dtypes: every GEMM produces the compute dtype (`GemmConfig.out_dtype`); dx, dW and db are then converted to the
dtypes of x, W and b, as nn.Linear under autocast does.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from lightning_fp8.modules.cast import caster_for
from lightning_fp8.modules.gemm import fp8_gemm, high_precision_gemm
from lightning_fp8.modules.operand import FP8Matrix, FP8Operand
from lightning_fp8.modules.gathered_fp8 import GatheredFP8Weight
from lightning_fp8 import kernels
from lightning_fp8.numerics.tiles import operand_tiles
from lightning_fp8.recipe import FP8Recipe

Tensor = torch.Tensor


class GemmConfig(NamedTuple):
    """The constants of one layer call (the frozen recipe and primitives, so torch.compile specialises on them).

    recipe: how every operand is cast and which GEMM backend runs.
    out_dtype: the compute dtype every GEMM produces.
    training: a training call (backward records dY's amax and uses the recipe's scaling).
    pad_to: the multiple dY^T's token columns are padded to, as the forward padded x^T's (`Caster.token_padding`).
    grad_history_sized: the engine knows dY's history sizes a delayed scale (its cast skips the amax pre-pass)."""

    recipe: FP8Recipe
    out_dtype: torch.dtype
    training: bool
    pad_to: int = 1
    grad_history_sized: bool = False


def linear_gemms(x2d: Tensor, weight: Tensor, bias: Optional[Tensor], x: FP8Operand, w: FP8Operand,
                 history: Tensor, observer, cfg: GemmConfig, offsets: Optional[Tensor] = None) -> Tensor:
    """y = x W^T + b from the forward's casts `x` and `w`; gradients flow to x2d, weight and bias.

    x2d (M, in) and weight (out, in) carry the autograd graph (the high-precision tensors the casts came from); x must
    hold x^T (`FP8Operand.matrix_t`) where a quantized weight gradient will be computed; history is the layer's amax
    history; observer (or None) is called with ("grad_output", dY) in backward.

    offsets: an experts layer's groups (x's rows sorted by expert, int32 end offsets): weight is then (E, out, in),
    every GEMM is grouped (GemmRequest.offsets) and the casts are the grouped caster's; None for one linear layer."""
    return FP8LinearGemms.apply(x2d, weight, bias, history, observer, cfg, offsets, *_flat(x), *_flat(w))


def _flat(op: FP8Operand):
    """The tensors of an operand, for Function.apply (which takes tensors and constants only; the tiles are the
    recipe's, restored by `_operand`)."""
    m, t = op.matrix, op.transposed
    # a per-tensor cast's two layouts share one scale: passed once (torch.compile refuses a tensor passed twice)
    t_scale_inv = t.scale_inv if t and not (m and t.scale_inv is m.scale_inv) else None
    return (m.data if m else None, m.scale_inv if m else None, m.tensor_scale if m else None,
            t.data if t else None, t_scale_inv, t.tensor_scale if t else None, op.scale)


def _operand(recipe: FP8Recipe, role: str, data, scale_inv, tensor_scale, data_t, scale_inv_t, tensor_scale_t,
             scale) -> FP8Operand:
    tile = tile_t = None
    if recipe.fine_grained:
        tile, tile_t = operand_tiles(recipe.scaling, recipe.block_size, role)
    matrix = FP8Matrix(data, scale_inv, tile, tensor_scale) if data is not None else None
    if data_t is not None and scale_inv_t is None:
        scale_inv_t = scale_inv
    transposed = FP8Matrix(data_t, scale_inv_t, tile_t, tensor_scale_t) if data_t is not None else None
    return FP8Operand(matrix, transposed, scale)


class FP8LinearGemms(torch.autograd.Function):
    """apply(x2d, weight, bias, history, observer, cfg, offsets, *x's 7 tensors, *w's 7 tensors): see
    `linear_gemms`."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, history, observer, cfg, offsets, *tensors):
        recipe = cfg.recipe
        x, w = _operand(recipe, "input", *tensors[:7]), _operand(recipe, "weight", *tensors[7:])
        out = fp8_gemm(x.matrix, w.matrix.t(), cfg.out_dtype, bias, recipe.fast_accum_forward, recipe.backend,
                       recipe.allow_emulation, offsets=offsets)
        ctx.cfg, ctx.observer, ctx.history, ctx.offsets = cfg, observer, history, offsets
        ctx.dtypes = (x2d.dtype, weight.dtype, bias.dtype if bias is not None else None)
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # the weight-gradient GEMM's x: x^T as cast, or x in high precision
        x_t = x.matrix_t() if needs_wgrad and not recipe.high_precision_wgrad else None
        keep_x = x2d if needs_wgrad and recipe.high_precision_wgrad else None
        # the input-gradient GEMM's W: its transpose as the forward wrote it, else the weight to cast again
        w_t = w.transposed if needs_dgrad else None
        keep_weight = weight if needs_dgrad and w_t is None else None
        ctx.tiles = (x_t.tile if x_t is not None else None, w_t.tile if w_t is not None else None)
        recast = keep_weight is not None and w.scale is not None  # per-tensor: cast again with the forward's scale
        ctx.save_for_backward(
            keep_x, keep_weight, w.scale if recast else None, w.matrix.scale_inv if recast else None,
            *_matrix_tensors(x_t), *_matrix_tensors(w_t),
        )
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cfg: GemmConfig = ctx.cfg
        recipe = cfg.recipe
        keep_x, weight, w_scale, w_scale_inv, *saved = ctx.saved_tensors
        x_t, w_t = _matrix(saved[:3], ctx.tiles[0]), _matrix(saved[3:], ctx.tiles[1])
        needs_dgrad, needs_wgrad, needs_bgrad = ctx.needs_input_grad[:3]
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        g = grad_out
        if ctx.observer is not None:
            ctx.observer("grad_output", g)
        offsets = ctx.offsets
        caster = caster_for(recipe, offsets)
        quantized_wgrad = needs_wgrad and not recipe.high_precision_wgrad
        dy = caster.cast(g, ctx.history, "grad_output", cfg.training, layouts=(needs_dgrad, quantized_wgrad),
                         pad_to=cfg.pad_to, history_sized=cfg.grad_history_sized)
        grad_x = grad_w = grad_b = None
        if needs_dgrad:
            if w_t is not None:
                w_b = w_t.t()
            elif isinstance(weight, GatheredFP8Weight):  # gathered in FP8 (FSDP2): the data of this pass
                data, scale_inv = weight.dgrad_operand(kernels.materializes_transpose(weight))
                w_b = FP8Matrix(data, scale_inv)
            else:
                w_b = caster.weight_for_dgrad(weight, ctx.history, w_scale, w_scale_inv)
            grad_x = fp8_gemm(dy.matrix, w_b, cfg.out_dtype, None, False, recipe.backend, recipe.allow_emulation,
                              offsets=offsets)
            grad_x = grad_x.to(x_dtype)
        if needs_wgrad:
            if recipe.high_precision_wgrad:
                grad_w = high_precision_gemm(g.t(), keep_x, cfg.out_dtype, offsets=offsets)
            else:
                grad_w = fp8_gemm(dy.matrix_t(), x_t.t(), cfg.out_dtype, None, False, recipe.backend,
                                  recipe.allow_emulation, offsets=offsets)
            grad_w = grad_w.to(weight_dtype)
        if needs_bgrad:
            grad_b = g.sum(0, dtype=torch.float32).to(bias_dtype)
        return (grad_x, grad_w, grad_b) + (None,) * (4 + 14)


def _matrix_tensors(m: Optional[FP8Matrix]):
    return (None, None, None) if m is None else (m.data, m.scale_inv, m.tensor_scale)


def _matrix(tensors, tile) -> Optional[FP8Matrix]:
    data, scale_inv, tensor_scale = tensors
    return None if data is None else FP8Matrix(data, scale_inv, tile, tensor_scale)
