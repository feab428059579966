"""Triton kernels of the microscaling casts (`lightning_fp8::microscaled_cast`, kernels/microscaled_ops.py): each
tensor read once per pass, both layouts its two GEMMs read written in the same pass, already in the scaled GEMM's
layouts (data padded to K % 32 and N % 16 with zeros, block scales swizzled into cuBLASLt's 128 x 4 tiles, the
per-tile grid after them). Imported only when triton is importable.

  `_mx_cast_kernel`      MXFP8 (1 launch): each program reads a 64 x 64 tile of x, takes the amax of every 1 x 32
                         block of its rows (x's blocks) and every 32 x 1 block of its columns (x^T's), derives the
                         E8M0 scales from the amaxes' bits, casts the tile twice (x * 2^-e, exact) and writes x_q,
                         x^T_q (through `tl.trans`), both scale layouts of both, and the tile's amax into the role's
                         history slot (integer atomic max: NaN wins).
  `_nvfp4_amax_kernel`   NVFP4 pass 1 (a fixed number of programs, each writing its own partial maxima: no zeroed
                         buffer): the amax of x and, where x^T is Hadamard-transformed, the amax of the transform (the
                         16-token butterflies on the tile in registers); program 0 advances the stochastic-rounding
                         stream's offset by the cast's draws (no other program touches it).
  `_nvfp4_cast_kernel`   NVFP4 pass 2: every program reduces the partials to the two tensor scales (program 0 stores
                         them and records x's amax), then casts its 64 x 64 tile: x in 1 x 16 (or 16 x 16) blocks, and
                         x^T (transformed in registers where asked) in 1 x 16 blocks along the tokens; E4M3 block
                         scales, FP4 codes by comparisons (nearest even), or stochastically with `tl.rand` on the
                         stream's (seed, offset + element index), packed two per byte.

The twins they reproduce bit for bit (tests/test_microscaled_kernels.py, under the interpreter): `numerics.microscaling`
through `kernels.kernel_reference.microscaled_cast_reference`. Where the arithmetic is the same IEEE operations in the same
order (the E8M0 exponent from the amax bits is frexp's exact answer; the block scales' two divisions; the Hadamard
butterflies in the definition's order, the sign flipped on the bits), so are the bits; the FP8 conversions are the
hardware's or the exact integer rounding (`triton_cast._fp8_code`, `use_soft_cast`: the interpreter mis-rounds some).
A NaN element of an FP4 layout is the code 0, of an MX NaN block 0x7F (as the reference's cast gives).

The programs cover x up to round_up(M, 128) x round_up(N, 128): every byte of every output buffer is written (the
swizzled layout's padding to 128 rows and 4 blocks included), so the outputs are allocated, never filled.
"""
from __future__ import annotations

import struct
from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_fp8.kernels.device_launch import announce, device_guard
from lightning_fp8.kernels.microscaled_ops import Layout, stochastic_rounding_offsets
from lightning_fp8.kernels.triton_cast import _fp8_code, _fp8_value, format_constexprs
from lightning_fp8.numerics import microscaling
from lightning_fp8.numerics.formats import E4M3, FP8Format

BLOCK = 64
#: programs of NVFP4's amax pass (each writes one partial maximum per amax)
PARTIALS = 256
_COVER = 128  # the programs cover x to multiples of 128 (the swizzled layout's rows, and its 4 blocks of 32)


# -- shared pieces ----------------------------------------------------------------------------------------------------
@triton.jit
def _abs_bits(x):
    """|x| as int32 bit patterns: integer order is float order for non-negative floats, NaN above inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _swizzled(rows, blocks, NB4):
    """Offset of scale (row, block) in the swizzled layout of a layout with NB4 (a multiple of 4) blocks per row."""
    r = rows % 128
    return ((rows // 128) * (NB4 // 4) + blocks // 4) * 512 + (r % 32) * 16 + (r // 32) * 4 + blocks % 4


@triton.jit
def _store_scales(s_ptr, codes, rows, blocks, R, NB, R128, NB4, GRID_OFF, grid_rows, GRID_ROWS, GRID_LD, grid_codes):
    """Store a program's block scales: `codes` (rows x blocks, one per row) in the swizzled layout (zeros outside the
    layout: rows >= R or blocks >= NB), and `grid_codes` at (grid_rows, blocks) of the per-tile grid after it."""
    inside = (rows[:, None] < R) & (blocks[None, :] < NB)
    swz = _swizzled(rows[:, None], blocks[None, :], NB4)
    tl.store(s_ptr + swz, tl.where(inside, codes, 0).to(tl.uint8),
             mask=(rows[:, None] < R128) & (blocks[None, :] < NB4))
    tl.store(s_ptr + GRID_OFF + grid_rows[:, None] * GRID_LD + blocks[None, :], grid_codes.to(tl.uint8),
             mask=(grid_rows[:, None] < GRID_ROWS) & (blocks[None, :] < NB))


# -- MXFP8 ------------------------------------------------------------------------------------------------------------
@triton.jit
def _e8m0_code(bits, E_F: tl.constexpr, MB_F: tl.constexpr):
    """The E8M0 code (int32 0..255) of blocks whose amax has these bits: e = the smallest integer with amax <= fmt.max
    * 2^e, from the biased exponent and the mantissa bits (frexp's exponent and the comparison of the mantissas),
    clamped to [-127, 127]; 255 for inf / NaN. (A subnormal or zero amax clamps to -127.)"""
    biased = bits >> 23
    e = biased - 126 - E_F + ((bits & 0x7FFFFF) > MB_F).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(biased == 255, 255, e + 127)


@triton.jit
def _e8m0_multiplier(code):
    """2^-e of each E8M0 code in float32 (2^-127 is subnormal there); NaN for 255."""
    bits = tl.where(code == 254, 0x00400000, (254 - code) << 23)
    return tl.where(code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _mx_codes(y, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
              HW_CAST: tl.constexpr):
    """FP8 codes of x * 2^-e: clamped (a no-op for finite blocks: no element of an MX block saturates), rounded to
    nearest even; 0x7F (NaN) in a NaN block."""
    nan = y != y
    y = tl.where(nan, 0.0, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    return tl.where(nan, 0x7F, _fp8_code(y, FP8_DTYPE, MANT, BIAS, HW_CAST) & 0xFF)


@triton.jit
def _mx_cast_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, hist_bits_ptr,
    M, N, stride_xm, stride_xn,
    Q_ROWS, Q_LD, NB, NB4, S_OFF, M128,
    QT_ROWS, QT_LD, NBT, NBT4, ST_OFF, N128,
    FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr, E_F: tl.constexpr, MB_F: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, RECORD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    if RECORD:
        if (pid_m * BLOCK_M < M) & (pid_n * BLOCK_N < N):
            tl.atomic_max(hist_bits_ptr, tl.max(tl.max(bits, axis=1), axis=0))
    if WRITE_ROW:
        # x's blocks: 32 consecutive columns of a row
        code = _e8m0_code(tl.max(tl.reshape(bits, (BLOCK_M, BLOCK_N // 32, 32)), axis=2), E_F, MB_F)
        y = tl.reshape(x, (BLOCK_M, BLOCK_N // 32, 32)) * _e8m0_multiplier(code)[:, :, None]
        q = _mx_codes(tl.reshape(y, (BLOCK_M, BLOCK_N)), FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST)
        q = tl.where(mask, q, 0)  # the padding stays zero (a NaN block's NaN ends at the layout's edge)
        tl.store(q_ptr + rows[:, None] * Q_LD + cols[None, :], q.to(tl.uint8),
                 mask=(rows[:, None] < Q_ROWS) & (cols[None, :] < Q_LD))
        blocks = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
        _store_scales(s_ptr, code, rows, blocks, M, NB, M128, NB4, S_OFF, rows, M, NB, code)
    if WRITE_T:
        # x^T's blocks: 32 consecutive rows of a column of x
        code_t = _e8m0_code(tl.max(tl.reshape(bits, (BLOCK_M // 32, 32, BLOCK_N)), axis=1), E_F, MB_F)
        y_t = tl.reshape(x, (BLOCK_M // 32, 32, BLOCK_N)) * _e8m0_multiplier(code_t)[:, None, :]
        q_t = tl.where(mask, _mx_codes(tl.reshape(y_t, (BLOCK_M, BLOCK_N)), FP8_MAX, FP8_DTYPE, MANT, BIAS, HW_CAST), 0)
        tl.store(qt_ptr + cols[:, None] * QT_LD + rows[None, :], tl.trans(q_t).to(tl.uint8),
                 mask=(cols[:, None] < QT_ROWS) & (rows[None, :] < QT_LD))
        blocks_t = pid_m * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)
        codes_t = tl.trans(code_t)  # (x^T rows, blocks)
        _store_scales(st_ptr, codes_t, cols, blocks_t, N, NBT, N128, NBT4, ST_OFF, cols, N, NBT, codes_t)


def _frexp_constants(value: float):
    """(frexp exponent, float32 mantissa bits) of a normal float32 value: the constants of `_e8m0_code`."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits >> 23) & 0xFF) - 126, bits & 0x7FFFFF


def _alloc(layout: Optional[Layout], device, data_dtype):
    if layout is None:
        return None, None
    return (torch.empty(layout.storage_shape, dtype=data_dtype, device=device),
            torch.empty((layout.scale_numel,), dtype=torch.uint8, device=device))


def _layout_args(layout: Optional[Layout]):
    """(storage rows, storage row length, blocks per row, padded to 4, grid offset, rows padded to 128) of a layout
    (placeholders where it is not written)."""
    if layout is None:
        return 0, 0, 0, 0, 0, 0
    rows, ld = layout.storage_shape
    blocks4 = -(-layout.blocks // 4) * 4
    return rows, ld, layout.blocks, blocks4, layout.swizzled_numel, -(-layout.rows // _COVER) * _COVER


def _grid(m: int, n: int):
    cover = lambda v: -(-v // _COVER) * _COVER  # noqa: E731
    return triton.cdiv(cover(m), BLOCK), triton.cdiv(cover(n), BLOCK)


def launch_mx_cast(x: torch.Tensor, hist_slot: Optional[torch.Tensor], fmt: FP8Format, row: Optional[Layout],
                   col: Optional[Layout], hw_cast: bool):
    """The MXFP8 cast of a 2-D `x` (any strides) into the storage of kernels/microscaled_ops.py: ((data, scales, None)
    of x, of x^T), (None, None, None) for a layout not written. `hist_slot`: the role's open history slot (a 1-element
    float32 view) to max-accumulate x's amax into, or None."""
    m, n = x.shape
    q, s = _alloc(row, x.device, torch.uint8)
    qt, st = _alloc(col, x.device, torch.uint8)
    if m and n:
        e_f, mb_f = _frexp_constants(fmt.max)
        dummy = x
        with device_guard(x):
            if announce("mx_cast", [x], [q, s, qt, st]):
                _mx_cast_kernel[_grid(m, n)](
                    x, q if q is not None else dummy, s if s is not None else dummy,
                    qt if qt is not None else dummy, st if st is not None else dummy,
                    hist_slot.view(torch.int32) if hist_slot is not None else dummy,
                    m, n, x.stride(0), x.stride(1), *_layout_args(row), *_layout_args(col),
                    FP8_MAX=fmt.max, **format_constexprs(fmt), HW_CAST=hw_cast, E_F=e_f, MB_F=mb_f,
                    WRITE_ROW=row is not None, WRITE_T=col is not None, RECORD=hist_slot is not None,
                    BLOCK_M=BLOCK, BLOCK_N=BLOCK, num_warps=8,
                )
    else:
        _fill_empty(q, s, qt, st)
    view = lambda t: t.view(fmt.dtype) if t is not None else None  # noqa: E731
    return (view(q), s, None), (view(qt), st, None)


def _fill_empty(*tensors) -> None:
    """An empty x (no tokens, or no features) still has padded storage: zeros (what the kernel would write)."""
    for t in tensors:
        if t is not None and t.numel():
            t.zero_()


# -- NVFP4 ------------------------------------------------------------------------------------------------------------
@triton.jit
def _butterfly(x, A: tl.constexpr, H: tl.constexpr):
    """(a, b) -> (a + b, a - b) on the pairs H apart within runs of 2H of x's elements (flat, A runs)."""
    pairs = tl.permute(tl.reshape(x, (A, 2, H)), (0, 2, 1))
    a, b = tl.split(pairs)
    return tl.permute(tl.join(a + b, a - b), (0, 2, 1))


@triton.jit
def _hadamard16(x, R: tl.constexpr, C: tl.constexpr, SIGNS: tl.constexpr):
    """x (R, C) times the random Hadamard transform along its rows' runs of 16 (numerics.microscaling
    `hadamard_transform`, the same float32 operations in the same order): the signs (on the bits), butterflies on pairs
    1, 2, 4, 8 apart, times 1/4."""
    t = tl.arange(0, C) % 16
    flip = ((SIGNS >> t) & 1) << 31
    y = (x.to(tl.int32, bitcast=True) ^ flip[None, :]).to(tl.float32, bitcast=True)
    a, b = tl.split(tl.reshape(y, (R * C // 2, 2)))
    y = tl.reshape(tl.join(a + b, a - b), (R * C,))
    y = tl.reshape(_butterfly(y, R * C // 4, 2), (R * C,))
    y = tl.reshape(_butterfly(y, R * C // 8, 4), (R * C,))
    y = tl.reshape(_butterfly(y, R * C // 16, 8), (R, C))
    return y * 0.25


@triton.jit
def _nvfp4_amax_kernel(
    x_ptr, part_ptr, rng_ptr, M, N, stride_xm, stride_xn, n_draws,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, ADVANCE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Partial maxima of |x| (part[pid]) and, HADAMARD, of |x^T H| (part[num_programs + pid]) over every P-th tile."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    for t in range(pid, tiles, programs):
        rows = ((t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = ((t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
        x = x.to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
        if HADAMARD:
            acc_t = tl.maximum(acc_t, _abs_bits(_hadamard16(tl.trans(x), BLOCK_N, BLOCK_M, SIGNS)))
    tl.store(part_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))
    if HADAMARD:
        tl.store(part_ptr + programs + pid, tl.max(tl.max(acc_t, axis=1), axis=0))
    if ADVANCE:
        if pid == 0:  # the stream's offset, read and advanced by this program alone; the cast reads it next
            tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + n_draws)


@triton.jit
def _tensor_scale(amax):
    """NVFP4's float32 decode scale g = amax / (6 * 448) (IEEE division); 1 for 0, NaN for inf / NaN. (Constants are
    made from a finite value: inf * 0 is a NaN whose sign differs between devices.)"""
    finite = amax < float("inf")  # False for NaN too
    safe = tl.where(finite, amax, 0.0)
    g = tl.div_rn(safe, safe * 0.0 + 2688.0)
    g = tl.where(safe > 0, g, 1.0)
    return tl.where(finite, g, float("nan"))


@triton.jit
def _block_scales(block_bits, g, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                  MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr):
    """(E4M3 code, its float32 value) of each block: e4m3(clamp(amax / 6 / g, 2^-9, 448)); a NaN scale (an inf / NaN
    tensor: g is NaN) is the code 0x7F."""
    amax = block_bits.to(tl.float32, bitcast=True)
    finite = amax < float("inf")
    safe = tl.where(finite, amax, 0.0)
    six = safe * 0.0 + 6.0
    s = tl.div_rn(tl.div_rn(safe, six), six * 0.0 + g)
    nan = (s != s) | (amax != amax) | (amax == float("inf"))
    s = tl.where(nan, 1.0, tl.minimum(tl.maximum(s, 0.001953125), 448.0))
    code = tl.where(nan, 0x7F, _fp8_code(s, FP8_DTYPE, MANT, BIAS, HW_CAST) & 0xFF)
    return code, _fp8_value(code, FP8_DTYPE, MANT, BIAS, MAX_CODE, False, HW_CAST)


@triton.jit
def _fp4_magnitude(code):
    """The magnitude of E2M1 code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    return tl.where(code < 5, code.to(tl.float32) * 0.5, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0)))


@triton.jit
def _fp4_codes(v, u, STOCHASTIC: tl.constexpr):
    """E2M1 codes (int32 0..15, sign in bit 3) of float32 values (numerics.microscaling `fp4_codes`): clamped to
    [-6, 6], to nearest even (the thresholds counted), or with the uniform `u` to a neighbour; NaN -> 0."""
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -6.0), 6.0))
    m = tl.abs(v)
    if STOCHASTIC:
        lower = ((m >= 0.5).to(tl.int32) + (m >= 1.0).to(tl.int32) + (m >= 1.5).to(tl.int32)
                 + (m >= 2.0).to(tl.int32) + (m >= 3.0).to(tl.int32) + (m >= 4.0).to(tl.int32)
                 + (m >= 6.0).to(tl.int32))
        upper = tl.minimum(lower + 1, 7)
        lo = _fp4_magnitude(lower)
        hi = _fp4_magnitude(upper)
        gap = tl.where(hi > lo, hi - lo, 1.0)
        up = (u < tl.div_rn(m - lo, gap)) & (hi > lo)
        code = tl.where(up, upper, lower)
    else:
        code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
                + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
                + (m > 5.0).to(tl.int32))
    code = code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)
    return tl.where(v != v, 0, code)


@triton.jit
def _packed(codes, R: tl.constexpr, C: tl.constexpr):
    """Codes (R, C) two per byte along the rows, the first in the low nibble: (R, C // 2) uint8."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _nvfp4_layout(v, noise_offsets, seed, STOCHASTIC: tl.constexpr):
    """FP4 codes of a layout's scaled values, with the stream's numbers at `noise_offsets` where stochastic."""
    if STOCHASTIC:
        u = tl.rand(seed, noise_offsets)
    else:
        u = v
    return _fp4_codes(v, u, STOCHASTIC)


@triton.jit
def _nvfp4_cast_kernel(
    x_ptr, part_ptr, n_partials, rng_ptr, hist_bits_ptr,
    q_ptr, s_ptr, g_ptr, qt_ptr, st_ptr, gt_ptr,
    M, N, stride_xm, stride_xn,
    Q_ROWS, Q_LD, NB, NB4, S_OFF, M128,
    QT_ROWS, QT_LD, NBT, NBT4, ST_OFF, N128,
    COLS_T, ROW_START, COL_START, N_DRAWS,
    FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
    HW_CAST: tl.constexpr, WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, RECORD: tl.constexpr,
    HADAMARD: tl.constexpr, SIGNS: tl.constexpr, SQUARE: tl.constexpr, STOCHASTIC: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs = tl.arange(0, PARTIALS_BLOCK)
    amax_bits = tl.max(tl.load(part_ptr + offs, mask=offs < n_partials, other=0), axis=0)
    if HADAMARD:
        amax_t_bits = tl.max(tl.load(part_ptr + n_partials + offs, mask=offs < n_partials, other=0), axis=0)
    else:
        amax_t_bits = amax_bits
    g = _tensor_scale(amax_bits.to(tl.float32, bitcast=True))
    g_t = _tensor_scale(amax_t_bits.to(tl.float32, bitcast=True))
    if (pid_m == 0) & (pid_n == 0):
        if WRITE_ROW:
            tl.store(g_ptr, g)
        if WRITE_T:
            tl.store(gt_ptr, g_t)
        if RECORD:
            tl.atomic_max(hist_bits_ptr, amax_bits)
    seed = 0
    base = 0
    if STOCHASTIC:
        seed = tl.load(rng_ptr)
        base = tl.load(rng_ptr + 1) - N_DRAWS  # the amax pass advanced the offset past this cast's draws
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    if SQUARE:  # 16 x 16 blocks (weights): one scale per block, shared by x's layout and x^T's
        block_bits = tl.max(tl.max(tl.reshape(bits, (BLOCK_M // 16, 16, BLOCK_N // 16, 16)), axis=3), axis=1)
    if WRITE_ROW:
        if SQUARE:
            code, value = _block_scales(block_bits, g, FP8_DTYPE, MANT, BIAS, MAX_CODE, HW_CAST)
            decode = tl.broadcast_to((value * g)[:, None, :, None], (BLOCK_M // 16, 16, BLOCK_N // 16, 16))
            v = tl.reshape(tl.div_rn(tl.reshape(x, (BLOCK_M // 16, 16, BLOCK_N // 16, 16)), decode),
                           (BLOCK_M, BLOCK_N))
            per_row = tl.reshape(tl.broadcast_to(code[:, None, :], (BLOCK_M // 16, 16, BLOCK_N // 16)),
                                 (BLOCK_M, BLOCK_N // 16))
            grid_rows = pid_m * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
            grid_codes = code
            grid_count = (M + 15) // 16
        else:
            code, value = _block_scales(tl.max(tl.reshape(bits, (BLOCK_M, BLOCK_N // 16, 16)), axis=2), g,
                                        FP8_DTYPE, MANT, BIAS, MAX_CODE, HW_CAST)
            decode = tl.broadcast_to((value * g)[:, :, None], (BLOCK_M, BLOCK_N // 16, 16))
            v = tl.reshape(tl.div_rn(tl.reshape(x, (BLOCK_M, BLOCK_N // 16, 16)), decode), (BLOCK_M, BLOCK_N))
            per_row = code
            grid_rows = rows
            grid_codes = code
            grid_count = M
        codes = _nvfp4_layout(v, base + ROW_START + rows[:, None] * N + cols[None, :], seed,
                              STOCHASTIC)
        codes = tl.where(mask, codes, 0)  # the padding stays zero
        byte_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(q_ptr + rows[:, None] * Q_LD + byte_cols[None, :], _packed(codes, BLOCK_M, BLOCK_N),
                 mask=(rows[:, None] < Q_ROWS) & (byte_cols[None, :] < Q_LD))
        blocks = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        _store_scales(s_ptr, per_row, rows, blocks, M, NB, M128, NB4, S_OFF, grid_rows, grid_count, NB, grid_codes)
    if WRITE_T:
        xt = tl.trans(x)  # (features, tokens): x^T's rows
        if HADAMARD:
            xt = _hadamard16(xt, BLOCK_N, BLOCK_M, SIGNS)
        if SQUARE:
            code_t, value_t = _block_scales(tl.trans(block_bits), g_t, FP8_DTYPE, MANT, BIAS, MAX_CODE, HW_CAST)
            decode_t = tl.broadcast_to((value_t * g_t)[:, None, :, None], (BLOCK_N // 16, 16, BLOCK_M // 16, 16))
            v_t = tl.reshape(tl.div_rn(tl.reshape(xt, (BLOCK_N // 16, 16, BLOCK_M // 16, 16)), decode_t),
                             (BLOCK_N, BLOCK_M))
            per_row_t = tl.reshape(tl.broadcast_to(code_t[:, None, :], (BLOCK_N // 16, 16, BLOCK_M // 16)),
                                   (BLOCK_N, BLOCK_M // 16))
            grid_rows_t = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
            grid_count_t = (N + 15) // 16
        else:
            code_t, value_t = _block_scales(tl.max(tl.reshape(_abs_bits(xt), (BLOCK_N, BLOCK_M // 16, 16)), axis=2),
                                            g_t, FP8_DTYPE, MANT, BIAS, MAX_CODE, HW_CAST)
            decode_t = tl.broadcast_to((value_t * g_t)[:, :, None], (BLOCK_N, BLOCK_M // 16, 16))
            v_t = tl.reshape(tl.div_rn(tl.reshape(xt, (BLOCK_N, BLOCK_M // 16, 16)), decode_t), (BLOCK_N, BLOCK_M))
            per_row_t = code_t
            grid_rows_t = cols
            grid_count_t = N
        codes_t = _nvfp4_layout(v_t, base + COL_START + cols[:, None] * COLS_T + rows[None, :],
                                seed, STOCHASTIC)
        # outside the layout (the transform of zero tokens past ceil16(M) gives -0s): the zero padding
        codes_t = tl.where((cols[:, None] < N) & (rows[None, :] < COLS_T), codes_t, 0)
        byte_rows = pid_m * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
        tl.store(qt_ptr + cols[:, None] * QT_LD + byte_rows[None, :], _packed(codes_t, BLOCK_N, BLOCK_M),
                 mask=(cols[:, None] < QT_ROWS) & (byte_rows[None, :] < QT_LD))
        blocks_t = pid_m * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
        _store_scales(st_ptr, per_row_t, cols, blocks_t, N, NBT, N128, NBT4, ST_OFF, grid_rows_t, grid_count_t, NBT,
                      code_t)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def launch_nvfp4_cast(x: torch.Tensor, hist_slot: Optional[torch.Tensor], rng_state: Optional[torch.Tensor],
                      row: Optional[Layout], col: Optional[Layout], hadamard_t: bool, hw_cast: bool):
    """The NVFP4 cast of a 2-D `x` (any strides) into the storage of kernels/microscaled_ops.py: ((data, scales, tensor
    scale) of x, of x^T), (None, None, None) for a layout not written. Two launches (the amax pass, the cast).
    `rng_state` (int64 [seed, offset]): stochastic rounding from that stream, its offset advanced by the draws."""
    m, n = x.shape
    device = x.device
    q, s = _alloc(row, device, torch.uint8)
    qt, st = _alloc(col, device, torch.uint8)
    g = torch.empty((), dtype=torch.float32, device=device) if row is not None else None
    g_t = torch.empty((), dtype=torch.float32, device=device) if col is not None else None
    square = (row or col).tile == (16, 16)
    hadamard = hadamard_t and col is not None
    stochastic = rng_state is not None
    starts = stochastic_rounding_offsets((row, col))
    if not (m and n):
        _fill_empty(q, s, qt, st)
        for scale in (g, g_t):
            if scale is not None:
                scale.fill_(1.0)  # the tensor scale of an all-zero tensor
        return (q, s, g), (qt, st, g_t)
    tiles = triton.cdiv(m, BLOCK) * triton.cdiv(n, BLOCK)
    programs = min(PARTIALS, tiles)
    partials = torch.empty((2 * programs if hadamard else programs,), dtype=torch.int32, device=device)
    signs = microscaling.hadamard_sign_mask()
    dummy = x
    with device_guard(x):
        if announce("nvfp4_amax", [x, rng_state], [partials, rng_state]):
            _nvfp4_amax_kernel[(programs,)](
                x, partials, rng_state if stochastic else dummy, m, n, x.stride(0), x.stride(1), starts[-1],
                HADAMARD=hadamard, SIGNS=signs, ADVANCE=stochastic, BLOCK_M=BLOCK, BLOCK_N=BLOCK, num_warps=8,
            )
        if announce("nvfp4_cast", [x, partials, rng_state], [q, s, g, qt, st, g_t]):
            _nvfp4_cast_kernel[_grid(m, n)](
                x, partials, programs, rng_state if stochastic else dummy,
                hist_slot.view(torch.int32) if hist_slot is not None else dummy,
                q if q is not None else dummy, s if s is not None else dummy, g if g is not None else dummy,
                qt if qt is not None else dummy, st if st is not None else dummy, g_t if g_t is not None else dummy,
                m, n, x.stride(0), x.stride(1), *_layout_args(row), *_layout_args(col),
                col.cols if col is not None else 0, starts[0], starts[1], starts[-1],
                **format_constexprs(E4M3), HW_CAST=hw_cast, WRITE_ROW=row is not None, WRITE_T=col is not None,
                RECORD=hist_slot is not None, HADAMARD=hadamard, SIGNS=signs, SQUARE=square, STOCHASTIC=stochastic,
                PARTIALS_BLOCK=_next_pow2(max(programs, 2)), BLOCK_M=BLOCK, BLOCK_N=BLOCK, num_warps=8,
            )
    return (q, s, g), (qt, st, g_t)
