"""The custom op of fine-grained casts, `lightning_fp8::tiled_cast` (listed with the other ops in ops.py).

One op per tensor: both layouts a tensor's two GEMMs read (x with row tiles for the GEMM that contracts its columns,
x^T with row tiles for the one that contracts its rows), and the amax record, so a fine-grained FP8 layer dispatches
as many ops as a per-tensor one (tests/test_finegrained.py counts them).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from lightning_fp8.kernels import cpu, cpu_twins_enabled_for, reference
from lightning_fp8.numerics.formats import get_format
from lightning_fp8.numerics.tiles import grid_shape

Tensor = torch.Tensor


def _empty(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=x.device)


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
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    f = get_format(fmt)
    with torch.autocast(x.device.type, enabled=False):  # the reference's float32 arithmetic stays float32
        fast = None
        if cpu_twins_enabled_for(x) and noise is None:
            fast = cpu.tiled_cast_cpu(x, history, role, f, tile, tile_t, margin, power_of_2, record=record)
        q, s, q_t, s_t = fast if fast is not None else reference.tiled_cast_reference(
            x, history, role, f, tile, tile_t, margin, power_of_2, noise=noise, record=record
        )
    # contiguous outputs on every path, as the fake implementation says (the CPU twin follows x's layout)
    empty_scale = _empty(x, torch.float32)
    return (
        q.contiguous() if q is not None else _empty(x, f.dtype),
        s.contiguous() if s is not None else empty_scale,
        q_t.contiguous() if q_t is not None else _empty(x, f.dtype),
        s_t.contiguous() if s_t is not None else empty_scale,
    )


@tiled_cast_op.register_fake
def _tiled_cast_fake(x, history, role, fmt, tile, tile_t, margin, power_of_2, noise, record):
    torch._check(x.dim() == 2, lambda: "tiled_cast expects a 2-D tensor")
    dtype = get_format(fmt).dtype
    m, n = x.shape
    empty8, empty32 = x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float32)
    if len(tile):
        q, s = x.new_empty((m, n), dtype=dtype), x.new_empty(grid_shape(tile, (m, n)), dtype=torch.float32)
    else:
        q, s = empty8, empty32
    if len(tile_t):
        q_t, s_t = x.new_empty((n, m), dtype=dtype), x.new_empty(grid_shape(tile_t, (n, m)), dtype=torch.float32)
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
):
    """Python face of `lightning_fp8::tiled_cast` for a 2-D `x`: (x_fp8, scale_inv, x^T_fp8, scale_inv^T), None for
    a cast not asked for (an empty tile). Scales are per tile (`numerics.tiles.grid_shape`), dequant scales."""
    if x.dim() != 2:
        raise ValueError(f"tiled_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    name = fmt if isinstance(fmt, str) else fmt.name
    q, s, q_t, s_t = torch.ops.lightning_fp8.tiled_cast(
        x.detach(), history, role, name, [int(v) for v in tile], [int(v) for v in tile_t], margin, power_of_2,
        noise, record,
    )
    return (q, s) if len(tile) else (None, None), (q_t, s_t) if len(tile_t) else (None, None)


__all__ = ["tiled_cast", "tiled_cast_op"]
