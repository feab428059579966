"""The Triton kernel of a mixture-of-experts layer's per-group cast (`lightning_fp8::grouped_cast`): x (M, C), rows
sorted by expert, cast with one scale per (expert, column) over the expert's rows, written transposed, x^T (C, M):
what the experts' weight-gradient GEMM reads. Imported only when triton is importable.

The twin it must reproduce bit for bit: `kernels.kernel_reference.grouped_cast_reference` (numerics/groups.py
`quantize_groups`). One launch: a program per (strip of BLOCK_C columns, expert) reduces its strip over the expert's
rows (the expert's bounds read from the offsets on the device: no host read), writes the strip's dequant scales and
casts the strip into x^T (a second pass over the strip, mostly from L2), as `_colwise_kernel` does for a whole column
(kernels/triton_tiled.py); one more program row writes the zeros of the rows past the last offset. The numerics are
those of the tiled kernels: amax over the float32 bit patterns with the sign cleared (NaN above inf), the scale of
`_scale_from_amax`, saturation with NaN kept, the FP8 rounding of `_fp8_code`; the tensor's amax max-accumulated into
the role's open history slot (integer atomic max, NaN wins).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from lightning_fp8.kernels.device_launch import announce, device_guard
from lightning_fp8.kernels.triton_cast import _scale_from_amax, format_constexprs
from lightning_fp8.kernels.triton_tiled import _abs_bits, _saturated_codes
from lightning_fp8.numerics.formats import FP8Format

_BLOCK_R = 64
_BLOCK_C = 64


@triton.jit
def _grouped_colwise_kernel(
    x_ptr, offsets_ptr, qt_ptr, st_ptr, hist_bits_ptr,
    M, N, G, stride_xm, stride_xn,
    FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr, MARGIN_DIV: tl.constexpr, POW2: tl.constexpr,
    RECORD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    cols = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    in_n = cols < N
    g = tl.program_id(1)
    last_end = tl.load(offsets_ptr + G - 1).to(tl.int64)
    if g == G:  # the rows past the last offset: zeros in x^T
        for r0 in range(last_end, M, BLOCK_R):
            rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            zeros = tl.zeros([BLOCK_C, BLOCK_R], dtype=tl.uint8)
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], zeros, mask=in_n[:, None] & (rows[None, :] < M))
    else:
        end = tl.load(offsets_ptr + g).to(tl.int64)
        start = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_C], dtype=tl.int32)
        for r0 in range(start, end, BLOCK_R):
            rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            mask = (rows[:, None] < end) & in_n[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.max(_abs_bits(x.to(tl.float32)), axis=0))
        scale = _scale_from_amax(acc.to(tl.float32, bitcast=True), 1.0, FP8_MAX, MARGIN_DIV, POW2)
        tl.store(st_ptr + g * N + cols, tl.div_rn(scale * 0.0 + 1.0, scale), mask=in_n)
        if RECORD:
            tl.atomic_max(hist_bits_ptr, tl.max(acc, axis=0))
        for r0 in range(start, end, BLOCK_R):
            rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            in_rows = rows < end
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                        mask=in_rows[:, None] & in_n[None, :], other=0.0).to(tl.float32)
            codes_t = _saturated_codes(x, scale[None, :], FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(codes_t),
                     mask=in_n[:, None] & in_rows[None, :])


def launch_grouped_cast(x: torch.Tensor, hist_slot: Optional[torch.Tensor], fmt: FP8Format, offsets: torch.Tensor,
                        margin: int, power_of_2: bool, hw_cast: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-group cast of a 2-D `x` (module docstring): (x^T codes uint8 (C, M), dequant scales (E, C));
    `hist_slot`: the role's open history slot (a 1-element float32 view) to max-accumulate x's amax into, or None."""
    m, n = x.shape
    groups = offsets.shape[0]
    qt = torch.empty((n, m), dtype=torch.uint8, device=x.device)
    st = torch.empty((groups, n), dtype=torch.float32, device=x.device)
    if not (m and n and groups):
        return qt.zero_(), st.fill_(1.0)
    offsets = offsets.to(torch.int32).contiguous()
    hist_bits = hist_slot.view(torch.int32) if hist_slot is not None else x
    with device_guard(x):
        if announce("grouped_colwise", [x, x, offsets], [qt, st]):
            _grouped_colwise_kernel[(triton.cdiv(n, _BLOCK_C), groups + 1)](
                x, offsets, qt, st, hist_bits, m, n, groups, x.stride(0), x.stride(1), **format_constexprs(fmt),
                HW_CAST=hw_cast, MARGIN_DIV=float(2.0**margin), POW2=power_of_2, FP8_MAX=fmt.max,
                RECORD=hist_slot is not None, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, num_warps=4,
            )
    return qt, st
