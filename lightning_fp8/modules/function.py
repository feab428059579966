"""The one autograd function of FP8 layers: the three GEMMs of y = x W^T + b, each on FP8 operands.

  forward  y  = x  @ W^T      input (E4M3)        x weight (E4M3)
  dgrad    dx = dy @ W        grad_output (E5M2)  x weight (E4M3)
  wgrad    dW = dy^T @ x      grad_output (E5M2)  x input (E4M3)      (formats of the HYBRID recipe)

The forward's casts of x and W happen *before* this function, in FP8Layer.forward (their state updates then live in
the main graph, which is what lets `torch.compile` trace a whole model without a break); the function receives the
FP8 operands, their scales and, for the gradient cast, the layer's amax history, which its backward updates in place
(a custom op with a declared mutation). Only tensors and constants cross `apply`.

What backward keeps: x in FP8 (1 byte per element, in the layout wgrad reads), the scales, and the weight Parameter
itself (no copy): the weight is re-cast with the forward's scale in the layout dgrad reads. With
weight_grad="high_precision" it keeps x in high precision instead, and the weight gradient is the BF16 GEMM dy^T @ x
(`gemm.high_precision_gemm`).

Output dtypes: every GEMM produces the compute dtype (the autocast dtype, else the input's), as nn.Linear under
autocast does; dx and dW are then converted to the dtypes of x and W. (On the emulated path this is what makes a BF16
GEMM faithful, see lightning_fp8/modules/gemm.py.)
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from lightning_fp8 import kernels
from lightning_fp8.modules.cast import cast_to_fp8, scaling_mode
from lightning_fp8.modules.fp8_meta import ROLE_INDEX
from lightning_fp8.modules.gemm import fp8_gemm, high_precision_gemm
from lightning_fp8.modules.precast import PrecastFP8Weight
from lightning_fp8.numerics.formats import get_format
from lightning_fp8.recipe import FP8Recipe


class GemmConfig(NamedTuple):
    """Constants of one call (primitives only, so torch.compile specialises on them)."""

    out_dtype: torch.dtype  # the compute dtype: every GEMM's output dtype
    weight_fmt: str
    grad_fmt: str
    grad_scaling: str  # "delayed" | "current" | "none"
    algo_max: bool
    margin: int
    power_of_2: bool
    grad_stochastic: bool
    record: bool
    fast_accum: bool
    backend: str
    hp_wgrad: bool = False  # weight_grad="high_precision"
    pad_to: int = 1  # dY^T's token columns padded to a multiple of it, as the forward padded x^T's (`token_padding`)
    grad_history_sized: bool = False  # the engine knows dY's history sizes a delayed scale: no amax pre-pass

    @staticmethod
    def build(recipe: FP8Recipe, out_dtype: torch.dtype, record: bool, pad_to: int = 1,
              grad_history_sized: bool = False) -> "GemmConfig":
        return GemmConfig(
            out_dtype=out_dtype,
            weight_fmt=recipe.format_for("weight").name,
            grad_fmt=recipe.format_for("grad_output").name,
            grad_scaling=scaling_mode(recipe, "grad_output", record),
            algo_max=recipe.amax_compute_algo == "max",
            margin=recipe.margin,
            power_of_2=recipe.power_of_2_scales,
            grad_stochastic=recipe.rounding_for("grad_output") == "stochastic",
            record=record,
            fast_accum=recipe.fast_accum_forward,
            backend=recipe.backend,
            hp_wgrad=recipe.high_precision_wgrad,
            pad_to=pad_to,
            grad_history_sized=record and grad_history_sized,
        )


class FP8Gemms(torch.autograd.Function):
    """apply(x2d, weight, bias, x_fp8, x_fp8_t, x_scale_inv, w_fp8, w_fp8_t, w_scale, w_scale_inv, history, observer,
    cfg).

    x2d / weight / bias carry the autograd graph (their gradients come back); x_fp8_t is x^T in FP8 where the cast
    wrote it (CUDA: the layout the weight-gradient GEMM reads), else None and x_fp8 serves (the emulated GEMM reads
    any layout); w_fp8 is the weight cast (out, in), w_fp8_t its transpose (in, out) where the forward's cast wrote
    it in the same pass (CUDA, when an input gradient is needed: the layout the input-gradient GEMM reads, kept
    from forward as Transformer Engine does, 1 byte per weight element held, instead of a second cast of the weight
    in backward), else None; history is the layer's [3, L+1] amax history (backward
    accumulates the gradient's amax into it). Every tensor is passed once: torch.compile rejects duplicates."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, x_fp8, x_fp8_t, x_scale_inv, w_fp8, w_fp8_t, w_scale, w_scale_inv, history,
                observer, cfg):
        x_wgrad = x_fp8_t.t() if x_fp8_t is not None else x_fp8
        if cfg.hp_wgrad:
            x_wgrad = x2d  # the weight gradient is a BF16 GEMM: x in high precision, not its FP8 cast
        out = fp8_gemm(
            x_fp8, x_scale_inv, w_fp8.t(), w_scale_inv, cfg.out_dtype, bias, cfg.fast_accum, cfg.backend
        )
        ctx.cfg = cfg
        ctx.observer = observer
        ctx.x_dtype = x2d.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(
            x_wgrad if ctx.needs_input_grad[1] else None,
            x_scale_inv,
            weight if ctx.needs_input_grad[0] and w_fp8_t is None else None,
            w_fp8_t if ctx.needs_input_grad[0] else None,
            w_scale,
            w_scale_inv,
        )
        # the live state, not a saved value: backward accumulates the gradient's amax into it, and a layer called
        # twice in one forward (weight sharing) has changed it by then, which a saved tensor's version check rejects
        ctx.history = history
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_wgrad, x_scale_inv, weight, w_fp8_t, w_scale, w_scale_inv = ctx.saved_tensors
        history = ctx.history
        cfg: GemmConfig = ctx.cfg
        needs_dgrad, needs_wgrad, needs_bgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g = grad_out
        if ctx.observer is not None:
            ctx.observer("grad_output", g)
        quantized_wgrad = needs_wgrad and not cfg.hp_wgrad
        write_t = quantized_wgrad and kernels.materializes_transpose(g)
        g_fp8, g_t, g_scale_inv = cast_gradient(g, history, cfg, write_t=write_t)
        grad_x = grad_w = grad_b = None
        if needs_dgrad:
            # the weight the forward saw, in the layout the dgrad GEMM reads (W column-major on CUDA)
            if w_fp8_t is not None:  # written by the forward's cast
                w_b = w_fp8_t.t()
            elif isinstance(weight, PrecastFP8Weight):  # gathered in FP8 (FSDP2): the data of this pass, its scale
                w_b, w_scale_inv = weight.dgrad_operand(kernels.materializes_transpose(weight))
            elif kernels.materializes_transpose(weight):
                w_b = cast_to_fp8(weight, w_scale, _fmt(cfg.weight_fmt), layout="t").t()
            else:
                w_b = cast_to_fp8(weight, w_scale, _fmt(cfg.weight_fmt))
            grad_x = fp8_gemm(g_fp8, g_scale_inv, w_b, w_scale_inv, cfg.out_dtype, None, False, cfg.backend)
            if grad_x.dtype != ctx.x_dtype:
                grad_x = grad_x.to(ctx.x_dtype)
        if needs_wgrad and cfg.hp_wgrad:
            grad_w = high_precision_gemm(g.t(), x_wgrad, cfg.out_dtype)
        elif needs_wgrad:
            g_a = g_t if g_t is not None else g_fp8.t()
            grad_w = fp8_gemm(g_a, g_scale_inv, x_wgrad, x_scale_inv, cfg.out_dtype, None, False, cfg.backend)
        if needs_wgrad:
            if grad_w.dtype != ctx.weight_dtype:
                grad_w = grad_w.to(ctx.weight_dtype)
        if needs_bgrad:
            grad_b = g.sum(0, dtype=torch.float32)
            if grad_b.dtype != ctx.bias_dtype:
                grad_b = grad_b.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None


def cast_gradient(g: torch.Tensor, history: torch.Tensor, cfg: GemmConfig, write_t: bool):
    """The backward's cast of the output gradient g (2-D) as grad_output under `cfg`: (g_fp8, g_fp8^T or None,
    scale_inv), recording g's amax into the layer's history in training. Shared by every per-tensor FP8 layer's
    backward (FP8Linear's here, the convolutions' in conv_function.py), so the gradient cast is defined once."""
    noise = torch.rand(g.shape, device=g.device, dtype=torch.float32) if cfg.grad_stochastic else None
    g_fp8, g_t, _, g_scale_inv = kernels.scaled_cast(
        g, history, ROLE_INDEX["grad_output"], cfg.grad_fmt, cfg.grad_scaling, cfg.algo_max, cfg.margin,
        cfg.power_of_2, write_t=write_t, record=cfg.record, noise=noise, pad_to=cfg.pad_to if write_t else 1,
        history_sized=cfg.grad_history_sized,
    )
    return g_fp8, g_t, g_scale_inv


def token_padding(x2d: torch.Tensor, writes_transpose: bool) -> int:
    """The multiple x^T's and dY^T's token columns are padded to in the cast that writes them: torch's scaled GEMM
    takes its contraction in multiples of 16, and the weight-gradient GEMM contracts the tokens; padded in the cast
    (zeros, in the same pass), the GEMM's planner copies neither operand to pad it. 1 where the cast writes no
    transpose (the emulation takes any shape) or the tokens are a multiple of 16 already."""
    return 16 if writes_transpose and x2d.shape[0] % 16 else 1


def _fmt(name: str):
    return get_format(name)


def apply_fp8_gemms(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    x_fp8: torch.Tensor,
    x_fp8_t: Optional[torch.Tensor],
    x_scale_inv: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    w_scale_inv: torch.Tensor,
    history: torch.Tensor,
    observer,
    cfg: GemmConfig,
    w_fp8_t: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return FP8Gemms.apply(x2d, weight, bias, x_fp8, x_fp8_t, x_scale_inv, w_fp8, w_fp8_t, w_scale, w_scale_inv, history,
                          observer, cfg)


__all__ = ["FP8Gemms", "GemmConfig", "apply_fp8_gemms", "cast_gradient"]
