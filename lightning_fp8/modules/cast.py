"""How one tensor role of an FP8 layer is cast: recipe -> arguments of the cast op.

Every cast FP8Layer makes is one `lightning_fp8::scaled_cast` op (lightning_fp8/kernels/ops.py): it reads the role's
amax history, derives the scale under the cast's recipe (numerics/scaling.py), casts, and writes the tensor's amax
into the history's open slot, all on the device. The torch reference runs on CPU; CUDA runs the Triton kernels.
Nothing here computes; it only translates a recipe, and gives observers the scale a cast uses.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lightning_fp8 import kernels
from lightning_fp8.modules.fp8_meta import ROLE_INDEX, FP8LinearMeta, RoleState
from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.scaling import cast_scale as _cast_scale
from lightning_fp8.kernels.microscaled_ops import transposed_noise_shape
from lightning_fp8.numerics import microscaling
from lightning_fp8.numerics.tiles import expand_tiles, operand_tiles, tile_amax, tile_scales
from lightning_fp8.recipe import FP8Recipe

Tensor = torch.Tensor


def scaling_mode(recipe: FP8Recipe, role: str, record: bool) -> str:
    """The per-tensor scaling of a cast: "none" for an unscaled role, current scaling outside training (evaluation
    never uses or changes the training state), else the recipe's. (Fine-grained recipes cast with `tiled_cast`.)"""
    if not recipe.uses_scaling_for(role):
        return "none"
    return recipe.scaling if record else "current"


def scaled_cast(
    x: Tensor,
    meta: FP8LinearMeta,
    recipe: FP8Recipe,
    role: str,
    record: bool,
    write_t: bool = False,
    generator: Optional[torch.Generator] = None,
    pad_to: int = 1,
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """Cast `x` (2-D) as `role` under `recipe`: (x_fp8, x_fp8^T or None, scale, scale_inv); x^T's columns (the
    tokens) zero-padded to a multiple of `pad_to`.

    record=True (training) accumulates x's amax into the role's open history slot; record=False (evaluation) leaves
    the state untouched and uses current scaling. x_fp8^T comes back only where the device writes it in the same
    pass (CUDA); elsewhere use x_fp8.t()."""
    fmt = recipe.format_for(role)
    noise = None
    if recipe.rounding_for(role) == "stochastic":
        noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return kernels.scaled_cast(
        x,
        meta.amax_history,
        ROLE_INDEX[role],
        fmt,
        scaling_mode(recipe, role, record),
        recipe.amax_compute_algo == "max",
        recipe.margin,
        recipe.power_of_2_scales,
        write_t=write_t,
        record=record,
        noise=noise,
        pad_to=pad_to,
        history_sized=record and meta.history_sized[ROLE_INDEX[role]],
    )


def tiled_cast(
    x: Tensor,
    meta: FP8LinearMeta,
    recipe: FP8Recipe,
    role: str,
    record: bool,
    layouts: Tuple[bool, bool] = (True, True),
    generator: Optional[torch.Generator] = None,
    pad_to: int = 1,
):
    """Cast `x` (2-D) as `role` under a fine-grained recipe: ((x_q, scales, tensor scale), (x^T_q, scales^T, tensor
    scale^T)), the layouts not asked for (`layouts` = (x, x^T)) as (None, None, None); the tensor scale is None except
    for NVFP4. One op: `lightning_fp8::tiled_cast` (rowwise, blockwise: float32 dequant scales) or
    `lightning_fp8::microscaled_cast` (mxfp8, nvfp4); record=True accumulates x's amax into the role's open history
    slot (the scales never depend on it). x^T's columns (the tokens, where x is an activation) are zero-padded to a
    multiple of `pad_to` (rowwise / blockwise; the microscaled GEMM pads its own operands)."""
    return cast_tiles(x, meta.amax_history, ROLE_INDEX[role], recipe, role, record, layouts, generator, pad_to)


def cast_tiles(
    x: Tensor,
    history: Tensor,
    role_index: int,
    recipe: FP8Recipe,
    role: str,
    record: bool,
    layouts: Tuple[bool, bool] = (True, True),
    generator: Optional[torch.Generator] = None,
    pad_to: int = 1,
):
    """`tiled_cast` on a history tensor (what the fine-grained autograd function calls in backward)."""
    tile, tile_t = operand_tiles(recipe.scaling, recipe.block_size, role)
    tile, tile_t = tile if layouts[0] else (), tile_t if layouts[1] else ()
    stochastic = recipe.rounding_for(role) == "stochastic"
    if recipe.microscaled:
        hadamard = recipe.random_hadamard and role != "weight"  # the weight-gradient GEMM's inputs: x^T and dY^T
        noise = noise_t = None
        if stochastic:
            if tile:
                noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            if tile_t:
                noise_t = torch.rand(transposed_noise_shape(x.shape, hadamard), generator=generator, device=x.device,
                                     dtype=torch.float32)
        return kernels.microscaled_cast(
            x, history, role_index, recipe.scaling, recipe.format_for(role), tile, tile_t, hadamard_t=hadamard,
            noise=noise, noise_t=noise_t, record=record,
        )
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) if stochastic else None
    (q, s), (q_t, s_t) = kernels.tiled_cast(
        x, history, role_index, recipe.format_for(role), tile, tile_t, recipe.margin, recipe.power_of_2_scales,
        record=record, noise=noise, pad_to=pad_to,
    )
    return (q, s, None), (q_t, s_t, None)


def cast_scale(
    x: Tensor, amax: Tensor, state: RoleState, recipe: FP8Recipe, role: str, record: bool, fmt: FP8Format
) -> Tensor:
    """The scale the cast of `x` (amax `amax`) uses under the recipe: observers call it to see what the cast saw.

    Fine-grained recipes: one scale per element of x (its tile's, for the layout of the first GEMM the role feeds:
    x and dy in row tiles, W in its blocks / rows), x's shape (a leading batch shape is flattened into rows). For the
    microscaling recipes, the multiplier each element is cast with: 2^-e of its MX block, 1 / (s * g) of its NVFP4
    block."""
    if recipe.fine_grained:
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        tile, _ = operand_tiles(recipe.scaling, recipe.block_size, role)
        amax_tiles = tile_amax(x2d, tile)
        if recipe.scaling == "mxfp8":
            scales = microscaling.e8m0_reciprocal(microscaling.mx_scales(amax_tiles, fmt))
        elif recipe.scaling == "nvfp4":
            g = microscaling.nvfp4_tensor_scale(amax_tiles.amax() if amax_tiles.numel() else amax)
            scales = (microscaling.nvfp4_block_scales(amax_tiles, g).to(torch.float32) * g).reciprocal()
        else:
            scales = tile_scales(amax_tiles, fmt, recipe.margin, recipe.power_of_2_scales)
        return expand_tiles(scales, tile, x2d.shape).reshape(x.shape)
    return _cast_scale(
        state.amax_history.to(amax.device),
        amax,
        fmt.max,
        scaling_mode(recipe, role, record),
        recipe.amax_compute_algo == "max",
        recipe.margin,
        recipe.power_of_2_scales,
    )


def cast_to_fp8(
    x: Tensor,
    scale: Tensor,
    fmt: FP8Format,
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
    layout: str = "row",
):
    """`quantize` with a known scale and no state (backward's re-cast of the weight with the forward's scale), on
    the fused kernel where available. layout: "row" -> x_fp8; "t" -> x_fp8^T contiguous (2-D x);
    "both" -> (x_fp8, x_fp8^T)."""
    if layout not in ("row", "t", "both"):
        raise ValueError(f"unknown layout {layout!r}; valid: ['row', 't', 'both']")
    if layout != "row" and x.dim() != 2:
        raise ValueError(f"layout={layout!r} needs a 2-D tensor, got shape {tuple(x.shape)}")
    x2d = x if x.dim() == 2 else (x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1))
    noise = torch.rand(x2d.shape, generator=generator, device=x.device) if rounding == "stochastic" else None
    # one `lightning_fp8::fp8_cast` op: the reference on CPU, the Triton kernel on CUDA
    out, out_t, _ = kernels.fp8_cast(
        x2d, scale, fmt, write_row=layout != "t", write_t=layout != "row", compute_amax=False, noise=noise
    )
    if layout == "row":
        return out.reshape(x.shape)
    return out_t if layout == "t" else (out, out_t)


__all__ = ["scaled_cast", "tiled_cast", "cast_tiles", "cast_scale", "cast_to_fp8", "scaling_mode"]
