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
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """Cast `x` (2-D) as `role` under `recipe`: (x_fp8, x_fp8^T or None, scale, scale_inv).

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
    """Cast `x` (2-D) as `role` under a fine-grained recipe: ((x_fp8, scale_inv), (x^T_fp8, scale_inv^T)), the
    layouts not asked for (`layouts` = (x, x^T)) as (None, None). One `lightning_fp8::tiled_cast` op; record=True
    accumulates x's amax into the role's open history slot (the scales never depend on it); x^T's columns padded to a
    multiple of `pad_to` (zeros)."""
    tile, tile_t = operand_tiles(recipe.scaling, recipe.block_size, role)
    noise = None
    if recipe.rounding_for(role) == "stochastic":
        noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return kernels.tiled_cast(
        x, meta.amax_history, ROLE_INDEX[role], recipe.format_for(role), tile if layouts[0] else (),
        tile_t if layouts[1] else (), recipe.margin, recipe.power_of_2_scales, record=record, noise=noise,
        pad_to=pad_to,
    )


def cast_scale(
    x: Tensor, amax: Tensor, state: RoleState, recipe: FP8Recipe, role: str, record: bool, fmt: FP8Format
) -> Tensor:
    """The scale the cast of `x` (amax `amax`) uses under the recipe: observers call it to see what the cast saw.

    Fine-grained recipes: one scale per element of x (its tile's, for the layout of the first GEMM the role feeds:
    x and dy in row tiles, W in its blocks / rows), x's shape (a leading batch shape is flattened into rows)."""
    if recipe.fine_grained:
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        tile, _ = operand_tiles(recipe.scaling, recipe.block_size, role)
        scales = tile_scales(tile_amax(x2d, tile), fmt, recipe.margin, recipe.power_of_2_scales)
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


__all__ = ["scaled_cast", "tiled_cast", "cast_scale", "cast_to_fp8", "scaling_mode"]
