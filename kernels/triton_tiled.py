"""Triton kernels of the fine-grained casts (`lightning_fp8::tiled_cast`): one scale per tile, both layouts a layer's
GEMMs read, the scales already in the layout the scaled GEMM takes. Imported only when triton is importable.

Two kernel families (the twin they must reproduce bit for bit: `kernels.kernel_reference.tiled_cast_reference`, i.e.
`numerics.tiles.quantize_tiles`):

  `_block_cast_kernel`   1xB tiles (activations, gradients) or BxB tiles (weights), B a power of two <= 128.
                         One program per BxB block of x: it reads the block once, takes the amax of every row and
                         every column of it (1xB: the tiles of x and of x^T) or of the whole block (BxB: one scale
                         for x's block and x^T's), and writes x_fp8, x^T_fp8 (through `tl.trans`: coalesced stores) and
                         both scale tensors. One launch, one read of x, no float32 temporary.
  `_colwise_kernel` +    rowwise (1 x whole row) for x and x^T: a row's scale needs the whole row and a column's the
  `_rowwise_cast_kernel` whole column, so no single pass can cast both. The first kernel reduces every column of x to
                         its amax (x^T's scales, written as outputs, and a K-vector of amaxes); the second takes each
                         block of rows, reduces them (x's scales), and casts every element twice, once with its row's
                         scale and once with its column's. Two launches, x read three times (the second pass over a
                         row block mostly from L2). One layout: one launch (x^T alone: `_colwise_kernel` casts the
                         column strip it has just reduced, a second pass over the strip).

Numerics, as the reference: amax as a max over the float32 bit patterns with the sign cleared (NaN above inf, so a
tile holding NaN gets scale 1 like `tile_scales`), scale = fp8_max / amax / 2**margin in IEEE float32, clamped,
optionally floored to a power of two, 1 for an amax of 0, inf or NaN; dequant scale its IEEE reciprocal;
y = float32(x) * scale, saturated with NaN kept, rounded to FP8 (`triton_cast._fp8_code`: the hardware cvt or the
exact integer rounding). The tensor's amax is max-accumulated into the role's open history slot (integer atomic max,
NaN wins, as `torch.maximum`).

Layouts (what `tiled_ops.scale_layout` promises and lightning_fp8/modules/scaled_mm.py consumes without a copy): the
1xB scales of an (R, C) operand are stored as a contiguous (C/B, R) tensor, i.e. the (R, C/B) grid with strides
(1, R) that cuBLASLt reads for VEC128 scales; BxB scales as a contiguous (R/B, L4) buffer, L4 = C/B rounded up to 4,
its padding set to 1 (cuBLASLt's 128x128 layout, strides (1, L4) once transposed); rowwise scales (R, 1). Token
padding: `m_out` > M adds zero columns to x^T_fp8 (the tokens of the weight-gradient GEMM, which contracts them), so
that GEMM gets whole blocks without a copy; x_fp8 keeps its M rows (the GEMMs where M is free).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from lightning_fp8.kernels.device_launch import announce, device_guard
from lightning_fp8.kernels.triton_cast import _fp8_code, _scale_from_amax, format_constexprs
from lightning_fp8.numerics.formats import FP8Format

#: largest tile edge the block kernel takes (a BxB float32 block lives in registers)
MAX_BLOCK = 128
_ROWWISE_BLOCK_R = 16
_ROWWISE_BLOCK_C = 128
_COLWISE_BLOCK_R = 64


@triton.jit
def _saturated_codes(x, scale, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr,
                     BIAS: tl.constexpr, HW_CAST: tl.constexpr):
    y = x * scale
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    return _fp8_code(y, FP8_DTYPE, MANT, BIAS, HW_CAST).to(tl.uint8)


@triton.jit
def _abs_bits(x):
    """|x| as int32 bit patterns: integer order is float order for non-negative floats, NaN above inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _block_cast_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, hist_bits_ptr,
    M, N, M_OUT, stride_xm, stride_xn,
    S_LD, ST_LD, S_PAD, ST_PAD,
    FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr, MARGIN_DIV: tl.constexpr, POW2: tl.constexpr,
    SQUARE: tl.constexpr, WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, RECORD: tl.constexpr,
    B: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * B + tl.arange(0, B)).to(tl.int64)
    cols = (pid_n * B + tl.arange(0, B)).to(tl.int64)
    in_x = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=in_x, other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    in_m = rows < M
    out_cols = cols < N
    out_mask = in_m[:, None] & out_cols[None, :]
    out_mask_t = out_cols[:, None] & (rows < M_OUT)[None, :]  # x^T's token columns, padded to M_OUT
    if SQUARE:
        # one scale for the block, shared by x's tile and x^T's
        block_bits = tl.max(tl.max(bits, axis=1), axis=0)
        scale = _scale_from_amax(block_bits.to(tl.float32, bitcast=True), 1.0, FP8_MAX, MARGIN_DIV, POW2)
        scale_inv = tl.div_rn(scale * 0.0 + 1.0, scale)
        codes = _saturated_codes(x, scale, FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
        if WRITE_ROW:
            tl.store(q_ptr + rows[:, None] * N + cols[None, :], codes, mask=out_mask)
            if pid_m * B < M:  # (blocks of padding tokens exist in x^T only)
                tl.store(s_ptr + pid_m * S_LD + pid_n, scale_inv)
                if pid_n == tl.num_programs(1) - 1:  # cuBLASLt's padding of the block-column dimension: scale 1
                    pad = pid_n + 1 + tl.arange(0, 4)
                    tl.store(s_ptr + pid_m * S_LD + pad, scale_inv * 0.0 + 1.0, mask=pad < S_PAD)
        if WRITE_T:
            tl.store(qt_ptr + cols[:, None] * M_OUT + rows[None, :], tl.trans(codes), mask=out_mask_t)
            tl.store(st_ptr + pid_n * ST_LD + pid_m, scale_inv)
            if pid_m == tl.num_programs(0) - 1:
                pad = pid_m + 1 + tl.arange(0, 4)
                tl.store(st_ptr + pid_n * ST_LD + pad, scale_inv * 0.0 + 1.0, mask=pad < ST_PAD)
        if RECORD:
            tl.atomic_max(hist_bits_ptr, block_bits)
    else:
        # 1xB tiles: x's tiles are the block's rows, x^T's its columns
        row_bits = tl.max(bits, axis=1)
        col_bits = tl.max(bits, axis=0)
        if WRITE_ROW:
            row_scale = _scale_from_amax(row_bits.to(tl.float32, bitcast=True), 1.0, FP8_MAX, MARGIN_DIV, POW2)
            codes = _saturated_codes(x, row_scale[:, None], FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
            tl.store(q_ptr + rows[:, None] * N + cols[None, :], codes, mask=out_mask)
            # (R, C/B) grid with strides (1, R): stored as its contiguous transpose
            tl.store(s_ptr + pid_n * M + rows, tl.div_rn(row_scale * 0.0 + 1.0, row_scale), mask=in_m)
        if WRITE_T:
            col_scale = _scale_from_amax(col_bits.to(tl.float32, bitcast=True), 1.0, FP8_MAX, MARGIN_DIV, POW2)
            codes_t = _saturated_codes(x, col_scale[None, :], FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
            tl.store(qt_ptr + cols[:, None] * M_OUT + rows[None, :], tl.trans(codes_t), mask=out_mask_t)
            tl.store(st_ptr + pid_m * N + cols, tl.div_rn(col_scale * 0.0 + 1.0, col_scale), mask=out_cols)
        if RECORD:
            tl.atomic_max(hist_bits_ptr, tl.max(row_bits, axis=0))


@triton.jit
def _colwise_kernel(
    x_ptr, col_amax_ptr, st_ptr, qt_ptr, hist_bits_ptr,
    M, N, M_OUT, stride_xm, stride_xn,
    FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr, MARGIN_DIV: tl.constexpr, POW2: tl.constexpr,
    CAST: tl.constexpr, RECORD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Each program owns BLOCK_C columns of x: their amaxes (x^T's rowwise scales), then (CAST) a second pass over
    the same strip casting it into x^T; else the amaxes are left for `_rowwise_cast_kernel`."""
    cols = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    in_n = cols < N
    acc = tl.zeros([BLOCK_C], dtype=tl.int32)
    for r0 in range(0, M, BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (rows[:, None] < M) & in_n[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.max(_abs_bits(x.to(tl.float32)), axis=0))
    scale = _scale_from_amax(acc.to(tl.float32, bitcast=True), 1.0, FP8_MAX, MARGIN_DIV, POW2)
    tl.store(st_ptr + cols, tl.div_rn(scale * 0.0 + 1.0, scale), mask=in_n)
    if RECORD:
        tl.atomic_max(hist_bits_ptr, tl.max(acc, axis=0))
    if CAST:
        for r0 in range(0, M_OUT, BLOCK_R):
            rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                        mask=(rows[:, None] < M) & in_n[None, :], other=0.0).to(tl.float32)
            codes_t = _saturated_codes(x, scale[None, :], FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
            tl.store(qt_ptr + cols[:, None] * M_OUT + rows[None, :], tl.trans(codes_t),
                     mask=in_n[:, None] & (rows[None, :] < M_OUT))
    else:
        tl.store(col_amax_ptr + cols, acc, mask=in_n)


@triton.jit
def _rowwise_cast_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, col_amax_ptr, hist_bits_ptr,
    M, N, M_OUT, stride_xm, stride_xn,
    FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr, MARGIN_DIV: tl.constexpr, POW2: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, RECORD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_m = rows < M
    out_rows = rows < M_OUT  # x^T's token columns, padded to M_OUT
    row_scale = tl.zeros([BLOCK_R], dtype=tl.float32) + 1.0
    if WRITE_ROW:
        acc = tl.zeros([BLOCK_R], dtype=tl.int32)
        for c0 in range(0, N, BLOCK_C):
            cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
            mask = in_m[:, None] & (cols[None, :] < N)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.max(_abs_bits(x.to(tl.float32)), axis=1))
        row_scale = _scale_from_amax(acc.to(tl.float32, bitcast=True), 1.0, FP8_MAX, MARGIN_DIV, POW2)
        tl.store(s_ptr + rows, tl.div_rn(row_scale * 0.0 + 1.0, row_scale), mask=in_m)
        if RECORD:
            tl.atomic_max(hist_bits_ptr, tl.max(acc, axis=0))
    for c0 in range(0, N, BLOCK_C):
        cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
        in_n = cols < N
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                    mask=in_m[:, None] & in_n[None, :], other=0.0).to(tl.float32)
        if WRITE_ROW:
            codes = _saturated_codes(x, row_scale[:, None], FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
            tl.store(q_ptr + rows[:, None] * N + cols[None, :], codes, mask=in_m[:, None] & in_n[None, :])
        if WRITE_T:
            col_bits = tl.load(col_amax_ptr + cols, mask=in_n, other=0)
            col_scale = _scale_from_amax(col_bits.to(tl.float32, bitcast=True), 1.0, FP8_MAX, MARGIN_DIV, POW2)
            codes_t = _saturated_codes(x, col_scale[None, :], FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
            tl.store(qt_ptr + cols[:, None] * M_OUT + rows[None, :], tl.trans(codes_t),
                     mask=in_n[:, None] & out_rows[None, :])


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def kernel_kind(tile: Sequence[int], tile_t: Sequence[int]) -> Optional[Tuple[str, int]]:
    """("rowwise", 0), ("1xB", B) or ("BxB", B) when the kernels take this pair of tiles (an empty tile: that layout
    is not cast), else None (the op runs the reference)."""
    tiles = {tuple(int(v) for v in t) for t in (tile, tile_t) if len(t)}
    if len(tiles) != 1:
        return None
    (r, c), = tiles
    if (r, c) == (1, 0):
        return "rowwise", 0
    if c < 16 or c > MAX_BLOCK or c & (c - 1):
        return None
    if r == 1:
        return "1xB", c
    if r == c:
        return "BxB", c
    return None


def launch_tiled_cast(
    x: torch.Tensor,
    hist_slot: Optional[torch.Tensor],
    fmt: FP8Format,
    kind: Tuple[str, int],
    write_row: bool,
    write_t: bool,
    margin: int,
    power_of_2: bool,
    m_out: int,
    hw_cast: bool,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The fused cast of a 2-D `x` (module docstring): (q uint8 [M, N] or None, its scales in storage layout,
    q^T uint8 [N, m_out] or None, its scales; m_out >= M: x^T's token columns padded with zeros). `hist_slot`: the role's open history slot (a 1-element float32 view)
    to max-accumulate x's amax into, or None."""
    name, b = kind
    m, n = x.shape
    device = x.device
    q = torch.empty((m, n), dtype=torch.uint8, device=device) if write_row else None
    qt = torch.empty((n, m_out), dtype=torch.uint8, device=device) if write_t else None
    hist_bits = hist_slot.view(torch.int32) if hist_slot is not None else x
    common = dict(FP8_MAX=fmt.max, MARGIN_DIV=float(2.0**margin), POW2=power_of_2)
    record = hist_slot is not None
    if name == "rowwise":
        # one scale per row, none where a row is empty (the reference's and the fake impl's (m, 0) / (n, 0))
        s = torch.empty((m, 1 if n else 0), dtype=torch.float32, device=device) if write_row else None
        st = torch.empty((n, 1 if m_out else 0), dtype=torch.float32, device=device) if write_t else None
        if not (m and n):
            return q, s, qt, st
        col_amax = torch.empty((n,), dtype=torch.int32, device=device) if (write_t and write_row) else None
        with device_guard(x):
            if write_t:
                # both layouts: the column amaxes for the row kernel; x^T only: the column strips cast here
                reads = [x, x if not write_row else None]
                if announce("colwise", reads, [col_amax, st, None if write_row else qt]):
                    _colwise_kernel[(triton.cdiv(n, _ROWWISE_BLOCK_C),)](
                        x, col_amax if col_amax is not None else x, st, qt, hist_bits, m, n, m_out,
                        x.stride(0), x.stride(1), **format_constexprs(fmt), HW_CAST=hw_cast, CAST=not write_row,
                        RECORD=record and not write_row, BLOCK_R=_COLWISE_BLOCK_R, BLOCK_C=_ROWWISE_BLOCK_C,
                        num_warps=4, **common,
                    )
            if write_row:
                reads = [x, x, col_amax]  # each row block is read twice: its amaxes, then the cast
                if announce("rowwise_cast", reads, [q, s, qt]):
                    _rowwise_cast_kernel[(triton.cdiv(max(m, m_out), _ROWWISE_BLOCK_R),)](
                        x, q, s, qt if qt is not None else x, col_amax if col_amax is not None else x, hist_bits,
                        m, n, m_out, x.stride(0), x.stride(1), **format_constexprs(fmt), HW_CAST=hw_cast,
                        WRITE_ROW=True, WRITE_T=write_t, RECORD=record, BLOCK_R=_ROWWISE_BLOCK_R,
                        BLOCK_C=_ROWWISE_BLOCK_C, num_warps=4, **common,
                    )
        return q, s, qt, st
    square = name == "BxB"
    gm, gn = triton.cdiv(max(m, m_out), b), triton.cdiv(n, b)
    if square:
        s_pad, st_pad = _round_up(gn, 4), _round_up(gm, 4)
        s = torch.empty((triton.cdiv(m, b), s_pad), dtype=torch.float32, device=device) if write_row else None
        st = torch.empty((gn, st_pad), dtype=torch.float32, device=device) if write_t else None
    else:
        s_pad = st_pad = 0
        s = torch.empty((gn, m), dtype=torch.float32, device=device) if write_row else None
        st = torch.empty((gm, n), dtype=torch.float32, device=device) if write_t else None
    if not (m and n):
        return q, s, qt, st
    with device_guard(x):
        if announce("block_cast", [x], [q, s, qt, st]):
            _block_cast_kernel[(gm, gn)](
                x, q if q is not None else x, s if s is not None else x, qt if qt is not None else x,
                st if st is not None else x, hist_bits, m, n, m_out, x.stride(0), x.stride(1),
                s_pad, st_pad, s_pad, st_pad,
                **format_constexprs(fmt), HW_CAST=hw_cast, SQUARE=square, WRITE_ROW=write_row, WRITE_T=write_t,
                RECORD=record, B=b, num_warps=8 if b >= 128 else 4, **common,
            )
    return q, s, qt, st
