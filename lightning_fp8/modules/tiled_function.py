"""The autograd function of fine-grained FP8 layers (scaling="rowwise" / "blockwise", and the microscaling recipes
"mxfp8" / "nvfp4"): the three GEMMs of y = x W^T + b on block-scaled operands, with the same structure as the
per-tensor one (function.py).

  forward  y  = x  @ W^T      x: row tiles              W: blocks / rows                (forward's casts)
  dgrad    dx = dy @ W        dy: row tiles             W^T: blocks / rows of W^T       (backward's casts)
  wgrad    dW = dy^T @ x      dy^T: row tiles           x^T: row tiles                  (x^T cast in forward)

Tiles per role: `numerics.tiles.operand_tiles`. The forward casts x (both layouts, one op) and W before this
function; backward casts dy (both layouts, one op, recording its amax) and re-casts W's transpose (stateless
scaling: the same bits as in forward, so nothing of W is kept). What backward keeps: x^T cast with its tile
scales, and the weight Parameter itself.

Each cast is a triple (data, block scales, tensor scale): the tensor scale is NVFP4's second level (None otherwise),
handed to the GEMM with its operand. NVFP4's x^T and dy^T are random-Hadamard transformed along the tokens by
their cast (the weight-gradient GEMM is unchanged by it, numerics/microscaling.py), and dy is rounded
stochastically (recipe.rounding, "stochastic" by default for nvfp4).

weight_grad="high_precision": x is kept in high precision instead of x^T cast, and the weight gradient is the BF16 GEMM
dy^T @ x (`gemm.high_precision_gemm`); dy is then cast in one layout only.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from lightning_fp8.kernels.device import profile_of
from lightning_fp8.modules.cast import cast_tiles
from lightning_fp8.modules.fp8_meta import ROLE_INDEX
from lightning_fp8.modules.gemm import high_precision_gemm
from lightning_fp8.modules.tiled_gemm import fp8_gemm_tiled
from lightning_fp8.numerics.tiles import Tile, operand_tiles, transposed
from lightning_fp8.recipe import FP8Recipe

Cast = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


class TiledGemmConfig(NamedTuple):
    """Constants of one call (primitives and the frozen recipe only, so torch.compile specialises on them)."""

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
    recipe: FP8Recipe  # how backward casts dy and W^T (cast.cast_tiles)
    hp_wgrad: bool  # weight_grad="high_precision"
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
            recipe=recipe,
            hp_wgrad=recipe.high_precision_wgrad,
            pad_to=pad_to,
        )


def _t(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.t() if t is not None and t.dim() == 2 else t


def token_padding(recipe: FP8Recipe, x: torch.Tensor) -> int:
    """The multiple the token columns of x^T and dy^T are padded to: where the GPU's scaled GEMM runs (the CUDA
    paths), the weight-gradient GEMM contracts the tokens, which blockwise scaling takes in whole blocks and torch's
    scaled GEMM in multiples of 16; padding them in the cast costs no copy (kernels/tiled_ops.py). 1 elsewhere: the
    emulation takes any shape."""
    if not profile_of(x.device).is_cuda or recipe.microscaled:  # the microscaled plan pads K itself (scaled_mm.py)
        return 1
    return int(recipe.block_size) if recipe.scaling == "blockwise" else 16


class FP8TiledGemms(torch.autograd.Function):
    """apply(x2d, weight, bias, x_q, x_s, x_g, xt_q, xt_s, xt_g, w_q, w_s, w_g, history, observer, cfg).

    x2d / weight / bias carry the autograd graph; (x_q, x_s, x_g): x with row tiles (forward); (xt_q, xt_s, xt_g): x^T
    with row tiles (None when no weight gradient is needed, or weight_grad="high_precision"); (w_q, w_s, w_g): W with
    its tiles (the *_g are NVFP4's tensor scales, else None); history: the layer's [3, L+1] amax history (backward
    records the gradient's amax in it)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, x_q, x_s, x_g, xt_q, xt_s, xt_g, w_q, w_s, w_g, history, observer, cfg):
        out = fp8_gemm_tiled(x_q, x_s, cfg.x_tile, w_q.t(), w_s.t(), transposed(cfg.w_tile), cfg.out_dtype, bias,
                             cfg.fast_accum, cfg.backend, x_g, w_g)
        ctx.cfg = cfg
        ctx.observer = observer
        ctx.x_dtype = x2d.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        keep_x = ctx.needs_input_grad[1]
        if cfg.hp_wgrad:
            saved_x = (x2d if keep_x else None, None, None)
        else:
            saved_x = (xt_q, xt_s, xt_g) if keep_x else (None, None, None)
        ctx.save_for_backward(*saved_x, weight if ctx.needs_input_grad[0] else None)
        ctx.history = history  # the live state (see function.py)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xt_q, xt_s, xt_g, weight = ctx.saved_tensors
        cfg: TiledGemmConfig = ctx.cfg
        needs_dgrad, needs_wgrad, needs_bgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g = grad_out
        if ctx.observer is not None:
            ctx.observer("grad_output", g)
        quantized_wgrad = needs_wgrad and not cfg.hp_wgrad
        (g_q, g_s, g_g), (gt_q, gt_s, gt_g) = cast_tiles(
            g, ctx.history, ROLE_INDEX["grad_output"], cfg.recipe, "grad_output", cfg.record,
            layouts=(needs_dgrad, quantized_wgrad), pad_to=cfg.pad_to,
        )
        grad_x = grad_w = grad_b = None
        if needs_dgrad:
            # W^T with its tiles, as the forward's W cast (stateless: the same values); not recorded again
            _, (wt_q, wt_s, wt_g) = cast_tiles(weight, ctx.history, ROLE_INDEX["weight"], cfg.recipe, "weight", False,
                                              layouts=(False, True))
            grad_x = fp8_gemm_tiled(g_q, g_s, cfg.g_tile, wt_q.t(), wt_s.t(), transposed(cfg.w_tile_t), cfg.out_dtype,
                                    None, False, cfg.backend, g_g, wt_g)
            if grad_x.dtype != ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
        if needs_wgrad:
            if cfg.hp_wgrad:
                grad_w = high_precision_gemm(g.t(), xt_q, cfg.out_dtype)  # xt_q: x itself, kept in high precision
            else:
                grad_w = fp8_gemm_tiled(gt_q, gt_s, cfg.g_tile_t, xt_q.t(), _t(xt_s), transposed(cfg.x_tile_t),
                                        cfg.out_dtype, None, False, cfg.backend, gt_g, xt_g)
            if grad_w.dtype != ctx.weight_dtype:
                grad_w = grad_w.to(ctx.weight_dtype)
        if needs_bgrad:
            grad_b = g.sum(0, dtype=torch.float32)
            if grad_b.dtype != ctx.bias_dtype:
                grad_b = grad_b.to(ctx.bias_dtype)
        return (grad_x, grad_w, grad_b) + (None,) * 12


def apply_fp8_tiled_gemms(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    x_cast: Cast,
    xt_cast: Cast,
    w_cast: Cast,
    history: torch.Tensor,
    observer,
    cfg: TiledGemmConfig,
) -> torch.Tensor:
    """The layer's output; each cast a (data, scales, tensor scale) triple from `cast.tiled_cast` (a pair (data,
    scales) is taken as having no tensor scale)."""
    x_cast, xt_cast, w_cast = (tuple(c) + (None,) * (3 - len(c)) for c in (x_cast, xt_cast, w_cast))
    return FP8TiledGemms.apply(x2d, weight, bias, *x_cast, *xt_cast, *w_cast, history, observer, cfg)


__all__ = ["FP8TiledGemms", "TiledGemmConfig", "apply_fp8_tiled_gemms", "token_padding"]
