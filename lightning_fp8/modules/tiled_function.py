"""The autograd function of fine-grained FP8 layers (scaling="rowwise" / "blockwise"): the three GEMMs of
y = x W^T + b on tile-scaled FP8 operands, with the same structure as the per-tensor one (function.py).

  forward  y  = x  @ W^T      x: row tiles              W: blocks / rows                (forward's casts)
  dgrad    dx = dy @ W        dy: row tiles             W^T: blocks / rows of W^T       (backward's casts)
  wgrad    dW = dy^T @ x      dy^T: row tiles           x^T: row tiles                  (x^T cast in forward)

Tiles per role: `numerics.tiles.operand_tiles`. The forward casts x (both layouts, one op) and W before this
function; backward casts dy (both layouts, one op, recording its amax) and re-casts W's transpose (stateless
scaling: the same bits as in forward, so nothing of W is kept). What backward keeps: x^T in FP8 with its tile
scales, and the weight Parameter itself.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from lightning_fp8.kernels.device import profile_of
from lightning_fp8.kernels.tiled_ops import tiled_cast
from lightning_fp8.modules.fp8_meta import ROLE_INDEX
from lightning_fp8.modules.tiled_gemm import fp8_gemm_tiled
from lightning_fp8.numerics.tiles import Tile, operand_tiles, transposed
from lightning_fp8.recipe import FP8Recipe


class TiledGemmConfig(NamedTuple):
    """Constants of one call (primitives only, so torch.compile specialises on them)."""

    out_dtype: torch.dtype
    weight_fmt: str
    grad_fmt: str
    x_tile_t: Tile  # tile of x^T (wgrad's second operand)
    w_tile: Tile  # tile of W (forward's second operand, transposed)
    w_tile_t: Tile  # tile of W^T (dgrad's second operand, transposed)
    g_tile: Tile  # tile of dy (dgrad's first operand)
    g_tile_t: Tile  # tile of dy^T (wgrad's first operand)
    x_tile: Tile
    margin: int
    power_of_2: bool
    grad_stochastic: bool
    record: bool
    fast_accum: bool
    backend: str
    pad_to: int  # x^T's and dy^T's token columns padded to a multiple of it (`token_padding`)

    @staticmethod
    def build(recipe: FP8Recipe, out_dtype: torch.dtype, record: bool, pad_to: int = 1) -> "TiledGemmConfig":
        x_tile, x_tile_t = operand_tiles(recipe.scaling, recipe.block_size, "input")
        w_tile, w_tile_t = operand_tiles(recipe.scaling, recipe.block_size, "weight")
        g_tile, g_tile_t = operand_tiles(recipe.scaling, recipe.block_size, "grad_output")
        return TiledGemmConfig(
            out_dtype=out_dtype,
            weight_fmt=recipe.format_for("weight").name,
            grad_fmt=recipe.format_for("grad_output").name,
            x_tile_t=x_tile_t,
            w_tile=w_tile,
            w_tile_t=w_tile_t,
            g_tile=g_tile,
            g_tile_t=g_tile_t,
            x_tile=x_tile,
            margin=recipe.margin,
            power_of_2=recipe.power_of_2_scales,
            grad_stochastic=recipe.rounding_for("grad_output") == "stochastic",
            record=record,
            fast_accum=recipe.fast_accum_forward,
            backend=recipe.backend,
            pad_to=pad_to,
        )


def token_padding(recipe: FP8Recipe, x: torch.Tensor) -> int:
    """The multiple the token columns of x^T and dy^T are padded to: where the GPU's scaled GEMM runs (the CUDA
    paths), the weight-gradient GEMM contracts the tokens, which blockwise scaling takes in whole blocks and torch's
    scaled GEMM in multiples of 16; padding them in the cast costs no copy (kernels/tiled_ops.py). 1 elsewhere: the
    emulation takes any shape."""
    if not profile_of(x.device).is_cuda:
        return 1
    return int(recipe.block_size) if recipe.scaling == "blockwise" else 16


class FP8TiledGemms(torch.autograd.Function):
    """apply(x2d, weight, bias, x_fp8, x_scale_inv, xt_fp8, xt_scale_inv, w_fp8, w_scale_inv, history, observer, cfg).

    x2d / weight / bias carry the autograd graph; x_fp8 / x_scale_inv: x with row tiles (forward); xt_fp8 /
    xt_scale_inv: x^T with row tiles (None when no weight gradient is needed); w_fp8 / w_scale_inv: W with its
    tiles; history: the layer's [3, L+1] amax history (backward records the gradient's amax in it)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, x_fp8, x_scale_inv, xt_fp8, xt_scale_inv, w_fp8, w_scale_inv, history, observer, cfg):
        out = fp8_gemm_tiled(x_fp8, x_scale_inv, cfg.x_tile, w_fp8.t(), w_scale_inv.t(), transposed(cfg.w_tile),
                             cfg.out_dtype, bias, cfg.fast_accum, cfg.backend)
        ctx.cfg = cfg
        ctx.observer = observer
        ctx.x_dtype = x2d.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        keep_x = ctx.needs_input_grad[1]
        ctx.save_for_backward(
            xt_fp8 if keep_x else None,
            xt_scale_inv if keep_x else None,
            weight if ctx.needs_input_grad[0] else None,
        )
        ctx.history = history  # the live state (see function.py)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xt_fp8, xt_scale_inv, weight = ctx.saved_tensors
        cfg: TiledGemmConfig = ctx.cfg
        needs_dgrad, needs_wgrad, needs_bgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g = grad_out
        if ctx.observer is not None:
            ctx.observer("grad_output", g)
        noise = torch.rand(g.shape, device=g.device, dtype=torch.float32) if cfg.grad_stochastic else None
        (g_fp8, g_scale_inv), (gt_fp8, gt_scale_inv) = tiled_cast(
            g, ctx.history, ROLE_INDEX["grad_output"], cfg.grad_fmt, cfg.g_tile if needs_dgrad else (),
            cfg.g_tile_t if needs_wgrad else (), cfg.margin, cfg.power_of_2, record=cfg.record, noise=noise,
            pad_to=cfg.pad_to,
        )
        grad_x = grad_w = grad_b = None
        if needs_dgrad:
            # W^T with its tiles, as the forward's W cast (stateless: the same values); not recorded again
            _, (wt_fp8, wt_scale_inv) = tiled_cast(
                weight, ctx.history, ROLE_INDEX["weight"], cfg.weight_fmt, (), cfg.w_tile_t, cfg.margin,
                cfg.power_of_2, record=False,
            )
            grad_x = fp8_gemm_tiled(g_fp8, g_scale_inv, cfg.g_tile, wt_fp8.t(), wt_scale_inv.t(),
                                    transposed(cfg.w_tile_t), cfg.out_dtype, None, False, cfg.backend)
            if grad_x.dtype != ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
        if needs_wgrad:
            grad_w = fp8_gemm_tiled(gt_fp8, gt_scale_inv, cfg.g_tile_t, xt_fp8.t(), xt_scale_inv.t(),
                                    transposed(cfg.x_tile_t), cfg.out_dtype, None, False, cfg.backend)
            if grad_w.dtype != ctx.weight_dtype:
                grad_w = grad_w.to(ctx.weight_dtype)
        if needs_bgrad:
            grad_b = g.sum(0, dtype=torch.float32)
            if grad_b.dtype != ctx.bias_dtype:
                grad_b = grad_b.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def apply_fp8_tiled_gemms(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    x_cast: Tuple[torch.Tensor, torch.Tensor],
    xt_cast: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    w_cast: Tuple[torch.Tensor, torch.Tensor],
    history: torch.Tensor,
    observer,
    cfg: TiledGemmConfig,
) -> torch.Tensor:
    return FP8TiledGemms.apply(x2d, weight, bias, x_cast[0], x_cast[1], xt_cast[0], xt_cast[1], w_cast[0], w_cast[1],
                               history, observer, cfg)


__all__ = ["FP8TiledGemms", "TiledGemmConfig", "apply_fp8_tiled_gemms", "token_padding"]
