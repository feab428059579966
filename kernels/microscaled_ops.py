"""The custom op of the microscaling casts (MXFP8, NVFP4), `lightning_fp8::microscaled_cast`.

  lightning_fp8::microscaled_cast(x, history!, role, scaling, fmt, tile, tile_t, hadamard_t, noise?, noise_t?, record)
      -> (x_q, block scales of x_q, tensor scale of x_q, x^T_q, block scales of x^T_q, tensor scale of x^T_q)

One op per tensor, as `tiled_cast` (kernels/tiled_ops.py): both layouts a tensor's two GEMMs read, and the record of
its amax into history[role, 0] (NaN / inf kept raw: the engine's overflow detection reads it). A layout not asked for
(an empty tile) comes back as empty tensors. The op returns E8M0 scales and packed FP4 data as their bytes (uint8), and
`microscaled_cast` views them as `torch.float8_e8m0fnu` / `torch.float4_e2m1fn_x2`: inductor refuses to functionalize a
mutating op with outputs of those dtypes ("auto_functionalized_v2 was not removed"), and a dtype view is free.

- scaling "mxfp8": x_q in `fmt` (E4M3 / E5M2), block scales E8M0 (`torch.float8_e8m0fnu`) in grid layout
  (`numerics.tiles.grid_shape`), tensor scales empty;
- scaling "nvfp4": x_q packed FP4 (`torch.float4_e2m1fn_x2`, two per byte along the last dimension), block scales
  E4M3, tensor scale float32 0-d; `hadamard_t`: x^T is the random Hadamard transform of x^T along its last
  dimension (the tokens, zero-padded to a multiple of 16: x^T_q is (N, ceil16(M) / 2)) before it is quantized, as
  the NVFP4 weight-gradient GEMM reads it. `noise` / `noise_t` (uniform [0, 1) in each layout's unpacked shape):
  stochastic rounding.

What it computes is `numerics.microscaling` (the definition); every device runs that torch code (there is no fused
GPU kernel: on a GPU each cast is a chain of elementwise launches).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from lightning_fp8.kernels.device import autocast_off
from lightning_fp8.numerics import microscaling
from lightning_fp8.numerics.formats import E2M1, E4M3, get_format
from lightning_fp8.numerics.tiles import grid_shape

Tensor = torch.Tensor
SCALINGS = ("mxfp8", "nvfp4")


def _empty(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=x.device)


def _padded16(n: int) -> int:
    return -(-n // microscaling.HADAMARD_SIZE) * microscaling.HADAMARD_SIZE


def _cast(x: Tensor, scaling: str, fmt: str, tile: Sequence[int], noise: Optional[Tensor]):
    """(x_q, block scales, tensor scale or empty, amax) of one layout."""
    if scaling == "mxfp8":
        q, s, amax = microscaling.quantize_mx(x, tile, get_format(fmt))
        return q, s, _empty(x, torch.float32), amax
    q, s, g, amax = microscaling.quantize_nvfp4(x, tile, noise)
    return q, s, g, amax


@torch.library.custom_op("lightning_fp8::microscaled_cast", mutates_args=("history",))
def microscaled_cast_op(
    x: Tensor,
    history: Tensor,
    role: int,
    scaling: str,
    fmt: str,
    tile: List[int],
    tile_t: List[int],
    hadamard_t: bool,
    noise: Optional[Tensor],
    noise_t: Optional[Tensor],
    record: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if scaling not in SCALINGS:
        raise ValueError(f"microscaled_cast: unknown scaling {scaling!r}; valid: {list(SCALINGS)}")
    with autocast_off(x.device):
        outputs = []
        amax = None
        for layout_tile, source, layout_noise in ((tile, x, noise), (tile_t, None, noise_t)):
            if not len(layout_tile):
                outputs.append((None, None, None))
                continue
            if source is None:  # x^T: the Hadamard transform along the tokens where asked
                source = microscaling.hadamard_transform(x.t()) if hadamard_t else x.t()
            q, s, g, layout_amax = _cast(source, scaling, fmt, layout_tile, layout_noise)
            outputs.append((q.contiguous(), s.contiguous(), g))
            if amax is None and source is x:
                amax = layout_amax
        if record:
            if amax is None:  # only x^T was cast (and maybe transformed): the amax of x itself
                amax = x.detach().abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
            slot = history[role, 0]
            slot.copy_(torch.maximum(slot, amax))  # torch.maximum propagates NaN
    data_dtype, scale_dtype = _op_dtypes(scaling, fmt)
    result = []
    for q, s, g in outputs:
        result += [q.view(data_dtype) if q is not None else _empty(x, data_dtype),
                   s.view(scale_dtype) if s is not None else _empty(x, scale_dtype),
                   g if g is not None and g.numel() else _empty(x, torch.float32)]
    return tuple(result)  # type: ignore[return-value]


def _dtypes(scaling: str, fmt: str) -> Tuple[torch.dtype, torch.dtype]:
    """(data dtype, block-scale dtype) of a microscaled cast."""
    if scaling == "mxfp8":
        return get_format(fmt).dtype, microscaling.E8M0
    return E2M1.dtype, E4M3.dtype


def _op_dtypes(scaling: str, fmt: str) -> Tuple[torch.dtype, torch.dtype]:
    """The dtypes the op returns them in: E8M0 and packed FP4 as their bytes (module docstring)."""
    data, scale = _dtypes(scaling, fmt)
    as_bytes = lambda d: torch.uint8 if d in (microscaling.E8M0, E2M1.dtype) else d  # noqa: E731
    return as_bytes(data), as_bytes(scale)


@microscaled_cast_op.register_fake
def _microscaled_cast_fake(x, history, role, scaling, fmt, tile, tile_t, hadamard_t, noise, noise_t, record):
    torch._check(x.dim() == 2, lambda: "microscaled_cast expects a 2-D tensor")
    data_dtype, scale_dtype = _op_dtypes(scaling, fmt)
    m, n = x.shape
    result = []
    for layout_tile, (rows, cols) in ((tile, (m, n)), (tile_t, (n, _padded16(m) if hadamard_t else m))):
        if not len(layout_tile):
            result += [x.new_empty((0,), dtype=data_dtype), x.new_empty((0,), dtype=scale_dtype),
                       x.new_empty((0,), dtype=torch.float32)]
            continue
        packed_cols = -(-cols // 2) if scaling == "nvfp4" else cols
        result += [x.new_empty((rows, packed_cols), dtype=data_dtype),
                   x.new_empty(grid_shape(layout_tile, (rows, cols)), dtype=scale_dtype),
                   x.new_empty((), dtype=torch.float32) if scaling == "nvfp4" else x.new_empty((0,), dtype=torch.float32)]
    return tuple(result)


#: one cast layout: (data, block scales, tensor scale or None); (None, None, None) for a layout not asked for
Cast = Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]


def microscaled_cast(
    x: Tensor,
    history: Tensor,
    role: int,
    scaling: str,
    fmt,
    tile: Sequence[int],
    tile_t: Sequence[int],
    *,
    hadamard_t: bool = False,
    noise: Optional[Tensor] = None,
    noise_t: Optional[Tensor] = None,
    record: bool = True,
) -> Tuple[Cast, Cast]:
    """Python face of `lightning_fp8::microscaled_cast` for a 2-D `x`: ((x_q, scales, tensor scale), (x^T_q, scales^T,
    tensor scale^T)); a layout not asked for (an empty tile) is (None, None, None), a tensor scale None for MXFP8."""
    if x.dim() != 2:
        raise ValueError(f"microscaled_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    name = fmt if isinstance(fmt, str) else fmt.name
    q, s, g, q_t, s_t, g_t = torch.ops.lightning_fp8.microscaled_cast(
        x.detach(), history, role, scaling, name, [int(v) for v in tile], [int(v) for v in tile_t], hadamard_t, noise,
        noise_t, record,
    )
    tensor_scale = lambda t: t if t.numel() else None  # noqa: E731
    data_dtype, scale_dtype = _dtypes(scaling, name)
    first = (q.view(data_dtype), s.view(scale_dtype), tensor_scale(g)) if len(tile) else (None, None, None)
    second = (q_t.view(data_dtype), s_t.view(scale_dtype), tensor_scale(g_t)) if len(tile_t) else (None, None, None)
    return first, second


def transposed_noise_shape(shape: Sequence[int], hadamard_t: bool) -> Tuple[int, int]:
    """The unpacked shape of x^T's cast (the noise of its stochastic rounding): (N, M), or (N, ceil16(M)) after the
    Hadamard transform."""
    m, n = int(shape[0]), int(shape[1])
    return n, (_padded16(m) if hadamard_t else m)


__all__ = ["microscaled_cast", "microscaled_cast_op", "transposed_noise_shape", "Cast", "SCALINGS"]
