"""The custom op of fine-grained casts, `lightning_fp8::tiled_cast` (listed with the other ops in ops.py).

One op per tensor: both layouts a tensor's two GEMMs read (x with row tiles for the GEMM that contracts its columns,
x^T with row tiles for the one that contracts its rows), and the amax record, so a fine-grained FP8 layer dispatches
as many ops as a per-tensor one. On CUDA it is the fused Triton kernel of kernels/triton_tiled.py (1xB / BxB tiles:
one launch; rowwise: one launch per layout); elsewhere, and for tiles or inputs the kernel does not take (stochastic
rounding, float64, tiles above 128), the torch reference or its CPU twin.

The scales come back in the layout the scaled GEMM reads (`scale_layout`; lightning_fp8/modules/scaled_mm.py uses
them without a copy), on every path alike, so the fake implementation describes every path. The Python face
(`tiled_cast`) turns that storage back into the per-tile grid of `numerics.tiles.grid_shape` (a view: same memory).

`pad_to` rounds x^T's columns (the tokens, which the weight-gradient GEMM contracts) up to a multiple: zero columns,
so that GEMM gets whole 128-blocks (blockwise) or 16-multiples (rowwise, tensorwise) without a copy. x_fp8 keeps its
rows: the GEMMs that read it take any M.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from lightning_fp8.kernels import cpu_kernels, cpu_twins_enabled_for, kernel_reference, triton_enabled_for, use_soft_cast
from lightning_fp8.kernels.device import autocast_off
from lightning_fp8.numerics.formats import get_format
from lightning_fp8.numerics.tiles import grid_shape

Tensor = torch.Tensor


def _empty(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=x.device)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# -- where the scales live --------------------------------------------------------------------------------------------
def scale_layout(tile: Sequence[int]) -> str:
    """How the scales of `tile` are stored: "transposed" for row tiles (1, c), c >= 2 (the (R, C/c) grid with strides
    (1, R): cuBLASLt's 1x128 layout), "padded" for square tiles (r, r), r >= 2 (a (R/r, L4) buffer, L4 = C/r rounded
    up to 4, padding 1: cuBLASLt's 128x128 layout), "grid" for every other tile (rowwise (1, 0): (R, 1))."""
    r, c = int(tile[0]), int(tile[1])
    if r == 1 and c >= 2:
        return "transposed"
    if r == c and r >= 2:
        return "padded"
    return "grid"


def scale_storage_shape(tile: Sequence[int], shape: Sequence[int]) -> Tuple[int, int]:
    """The shape of the contiguous tensor that holds the scales of `tile` over a tensor of `shape` (scale_layout)."""
    gr, gc = grid_shape(tile, shape)
    layout = scale_layout(tile)
    if layout == "transposed":
        return gc, gr
    if layout == "padded":
        return gr, _round_up(gc, 4)
    return gr, gc


def grid_of_storage(storage: Tensor, tile: Sequence[int], shape: Sequence[int]) -> Tensor:
    """The per-tile grid (`grid_shape(tile, shape)`) that `storage` holds, as a view."""
    layout = scale_layout(tile)
    if layout == "transposed":
        return storage.t()
    if layout == "padded":
        return storage[:, : grid_shape(tile, shape)[1]]
    return storage


def storage_of_grid(grid: Tensor, tile: Sequence[int], shape: Sequence[int]) -> Tensor:
    """A contiguous storage tensor holding `grid` (the reference's and the CPU twin's scales) in `scale_layout`."""
    layout = scale_layout(tile)
    if layout == "transposed":
        return grid.t().contiguous()
    if layout == "padded":
        gr, gc = grid.shape
        pad = _round_up(gc, 4) - gc
        return F.pad(grid, (0, pad), value=1.0) if pad else grid.contiguous()
    return grid.contiguous()


# -- the op -------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("lightning_fp8::tiled_cast", mutates_args=("history",))
def tiled_cast_op(
    x: Tensor,
    history: Tensor,
    role: int,
    fmt: str,
    tile: List[int],
    tile_t: List[int],
    margin: int,
    power_of_2: bool,
    noise: Optional[Tensor],
    record: bool,
    pad_to: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    f = get_format(fmt)
    m, n = x.shape
    m_out = _round_up(m, max(1, pad_to))
    empty8, empty32 = _empty(x, f.dtype), _empty(x, torch.float32)
    if noise is None and triton_enabled_for(x):
        from lightning_fp8.kernels.triton_tiled import kernel_kind, launch_tiled_cast

        kind = kernel_kind(tile, tile_t)
        if kind is not None:
            q, s, q_t, s_t = launch_tiled_cast(
                x, history[role, 0:1] if record else None, f, kind, bool(len(tile)), bool(len(tile_t)), margin,
                power_of_2, m_out, hw_cast=not use_soft_cast(x),
            )
            return (q.view(f.dtype) if q is not None else empty8, s if s is not None else empty32,
                    q_t.view(f.dtype) if q_t is not None else empty8, s_t if s_t is not None else empty32)
    with autocast_off(x.device):  # the reference's float32 arithmetic stays float32
        if m_out != m and len(tile_t):
            # x^T from x with zero rows appended (noise 0 there): exactly what the kernel's masked loads cast
            q, s, _, _ = _reference(x, history, role, f, tile, (), margin, power_of_2, noise, record)
            padded, noise = F.pad(x, (0, 0, 0, m_out - m)), F.pad(noise, (0, 0, 0, m_out - m)) if noise is not None else None
            _, _, q_t, s_t = _reference(padded, history, role, f, (), tile_t, margin, power_of_2, noise,
                                        record and not len(tile))
        else:
            q, s, q_t, s_t = _reference(x, history, role, f, tile, tile_t, margin, power_of_2, noise, record)
    # contiguous outputs in the storage layouts on every path, as the fake implementation says
    return (
        q.contiguous() if q is not None else empty8,
        storage_of_grid(s, tile, (m, n)) if s is not None else empty32,
        q_t.contiguous() if q_t is not None else empty8,
        storage_of_grid(s_t, tile_t, (n, m_out)) if s_t is not None else empty32,
    )


def _reference(x, history, role, f, tile, tile_t, margin, power_of_2, noise, record):
    """The CPU twin where it applies, else the torch reference: per-tile grids."""
    if cpu_twins_enabled_for(x) and noise is None:
        fast = cpu_kernels.tiled_cast_cpu(x, history, role, f, tile, tile_t, margin, power_of_2, record=record)
        if fast is not None:
            return fast
    return kernel_reference.tiled_cast_reference(x, history, role, f, tile, tile_t, margin, power_of_2, noise=noise,
                                          record=record)


@tiled_cast_op.register_fake
def _tiled_cast_fake(x, history, role, fmt, tile, tile_t, margin, power_of_2, noise, record, pad_to=1):
    torch._check(x.dim() == 2, lambda: "tiled_cast expects a 2-D tensor")
    dtype = get_format(fmt).dtype
    m, n = x.shape
    m_out = _round_up(m, max(1, pad_to))
    empty8, empty32 = x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float32)
    if len(tile):
        q, s = x.new_empty((m, n), dtype=dtype), x.new_empty(scale_storage_shape(tile, (m, n)), dtype=torch.float32)
    else:
        q, s = empty8, empty32
    if len(tile_t):
        q_t = x.new_empty((n, m_out), dtype=dtype)
        s_t = x.new_empty(scale_storage_shape(tile_t, (n, m_out)), dtype=torch.float32)
    else:
        q_t, s_t = empty8, empty32
    return q, s, q_t, s_t


def tiled_cast(
    x: Tensor,
    history: Tensor,
    role: int,
    fmt,
    tile: Sequence[int],
    tile_t: Sequence[int],
    margin: int,
    power_of_2: bool,
    *,
    record: bool = True,
    noise: Optional[Tensor] = None,
    pad_to: int = 1,
):
    """Python face of `lightning_fp8::tiled_cast` for a 2-D `x`: ((x_fp8, scale_inv), (x^T_fp8, scale_inv^T)), each
    (None, None) for a cast not asked for (an empty tile). Scales are per-tile dequant scales in the grid shape of
    `numerics.tiles.grid_shape`, views of the GEMM layouts the op stores them in (module docstring). With `pad_to` > 1
    x^T_fp8 has its columns (the tokens) rounded up to a multiple of it, zeros."""
    if x.dim() != 2:
        raise ValueError(f"tiled_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not isinstance(pad_to, int) or pad_to < 1:
        raise ValueError(f"tiled_cast: pad_to must be an int >= 1, got {pad_to!r}")
    name = fmt if isinstance(fmt, str) else fmt.name
    tile, tile_t = [int(v) for v in tile], [int(v) for v in tile_t]
    q, s, q_t, s_t = torch.ops.lightning_fp8.tiled_cast(
        x.detach(), history, role, name, tile, tile_t, margin, power_of_2, noise, record, pad_to,
    )
    m_out, n = _round_up(x.shape[0], pad_to), x.shape[1]
    first = (q, grid_of_storage(s, tile, (x.shape[0], n))) if len(tile) else (None, None)
    second = (q_t, grid_of_storage(s_t, tile_t, (n, m_out))) if len(tile_t) else (None, None)
    return first, second
