"""Triton kernels for the FP8 casts. Imported only when triton is importable (see `lightning_fp8.kernels`).

One kernel, `_cast_kernel`, specialised by constexpr flags, covers every cast FP8Layer needs:

  amax only          (current scaling's first pass; delayed scaling's pre-pass, which exits at once when the
                      role's amax history already sizes the scale: read on device, no host sync)
  scale from state   (SCALE_MODE=1: every program derives the scale from the role's amax history, the pre-pass amax
                      and the recipe constants, exactly as `numerics.scaling.cast_scale`; program 0 writes the scale
                      and its inverse; the cast's own amax is max-accumulated into the history's open slot)
  amax + scale + cast (delayed scaling: the scale is known before the pass, the amax comes out of the same read)
  cast + transpose   (writes x_fp8 row-major and x_fp8^T row-major from one read of x)
  stochastic rounding with a given uniform noise tensor (bit-exact twin of `quantize(..., noise=noise)`) or with
                      in-kernel philox noise (`tl.rand`, tested statistically only)

The torch twins (what each variant must reproduce) are `lightning_fp8.numerics.quantize.quantize` and
`tensor_amax`; `lightning_fp8.kernels.kernel_reference` maps every variant onto them.

Numerics, step by step, exactly as the reference:
  y = float32(x) * scale                          one IEEE float32 multiply (x converted exactly)
  y = clamp(y, -max, max), NaN kept               explicit saturation before the cast
  code = round-to-nearest-even FP8 code of y      hardware cvt (HW_CAST) or an exact integer emulation
amax is max(|x|) computed on the float32 bit patterns as integers: for non-negative floats the integer order
is the float order, and every NaN pattern (sign cleared) sorts above +inf, so NaN propagates exactly like
`torch.amax` and the per-program partial maxima combine with one integer `atomic_max`.

Which rounding runs where (`lightning_fp8.kernels.use_soft_cast`, `hardware_cast_exact`): the hardware cvt only where
Triton compiles it *and* it rounds exactly like the reference, that is sm90+ (H100, B200, RTX 50xx), and sm89 (L4,
L40S, RTX 40xx) with Triton >= 3.9 (3.6 - 3.8 convert float32 there through float16 truncated toward zero,
`cvt.rz.f16.f32`, then round again: 1.0625001 gives 1.0 instead of 1.125); the exact integer emulation everywhere
else (sm80/86/87: A100, A10, RTX 30xx, where `.to(tl.float8e4nv)` does not compile).

The FP8 conversion helpers (`_fp8_code`, `_fp8_value`, `format_constexprs`) are shared with the fused AdamW step
(lightning_fp8/optim/triton_adamw.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_fp8.kernels.device_launch import announce, device_guard
from lightning_fp8.numerics.formats import FP8Format

ROUND_NEAREST = 0
ROUND_NOISE = 1  # stochastic, noise tensor given
ROUND_PHILOX = 2  # stochastic, tl.rand(seed, offset)


@triton.jit
def _soft_fp8_code(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Round-to-nearest-even FP8 code (int32 in 0..255, torch's encoding) of float32 `y`, |y| <= fmt max or NaN.

    Exact integer emulation of the conversion; it does not depend on the hardware's cvt or on the
    interpreter's (which mis-rounds some values)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # subnormal range of the FP8 format: round to a multiple of 2**(1 - BIAS - MANT) with the float adder
    # (adding 2**(that + 23) leaves exactly that spacing; the add rounds to nearest even, the subtract is exact)
    sub_magic: tl.constexpr = 2.0 ** (1 - BIAS - MANT + 23)
    sub_unscale: tl.constexpr = 2.0 ** (BIAS + MANT - 1)
    sub_code = (((mag + sub_magic) - sub_magic) * sub_unscale).to(tl.int32)
    # normal range: drop 23 - MANT mantissa bits, round to nearest even (a carry moves into the exponent)
    SHIFT: tl.constexpr = 23 - MANT
    lsb = (mag_bits >> SHIFT) & 1
    rounded = (mag_bits + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT
    norm_code = rounded - ((127 - BIAS) << MANT)
    smallest_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    code = tl.where(mag < smallest_normal, sub_code, norm_code)
    code = code | sign
    return tl.where(y != y, 0x7F | sign, code)


@triton.jit
def _soft_fp8_decode(code, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 value of a non-negative FP8 magnitude code (0..max_code), exact."""
    exp = code >> MANT
    mant = code & ((1 << MANT) - 1)
    sub_scale: tl.constexpr = 2.0 ** (1 - BIAS - MANT)
    subnormal = mant.to(tl.float32) * sub_scale
    normal = (((exp - BIAS + 127) << 23) | (mant << (23 - MANT))).to(tl.float32, bitcast=True)
    return tl.where(exp == 0, subnormal, normal)


@triton.jit
def _soft_fp8_value(code, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, HAS_INF: tl.constexpr):
    """float32 value of a whole FP8 code (int32 in 0..255, torch's encoding), exact: sign, zeros, subnormals, and the
    codes above the largest finite one (E4M3: 0x7F is NaN; E5M2: 0x7C is inf, the codes above it NaN)."""
    mag_code = code & 0x7F
    mag = _soft_fp8_decode(tl.minimum(mag_code, MAX_CODE), MANT, BIAS)
    if HAS_INF:
        mag = tl.where(mag_code == MAX_CODE + 1, float("inf"), mag)
        mag = tl.where(mag_code > MAX_CODE + 1, float("nan"), mag)
    else:
        mag = tl.where(mag_code > MAX_CODE, float("nan"), mag)
    # the sign as a bit: Triton 3.6 negates a float as 0 - x, which turns -0 into +0
    return (mag.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_value(code, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
               HAS_INF: tl.constexpr, HW_CAST: tl.constexpr):
    """float32 value of a whole FP8 code (sign and specials included): the hardware conversion or the exact one."""
    if HW_CAST:
        return code.to(tl.uint8).to(FP8_DTYPE, bitcast=True).to(tl.float32)
    else:
        return _soft_fp8_value(code, MANT, BIAS, MAX_CODE, HAS_INF)


@triton.jit
def _fp8_code(y, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, HW_CAST: tl.constexpr):
    if HW_CAST:
        return y.to(FP8_DTYPE).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        return _soft_fp8_code(y, MANT, BIAS)


@triton.jit
def _fp8_decode(code, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, HW_CAST: tl.constexpr):
    if HW_CAST:
        return code.to(tl.uint8).to(FP8_DTYPE, bitcast=True).to(tl.float32)
    else:
        return _soft_fp8_decode(code, MANT, BIAS)


@triton.jit
def _usable(a):
    return (a == a) & (tl.abs(a) < float("inf")) & (a > 0)


@triton.jit
def _scale_from_amax(amax, fallback, FP8_MAX: tl.constexpr, MARGIN_DIV: tl.constexpr, POW2: tl.constexpr):
    """`numerics.scaling.scale_from_amax` for one float32 amax: (fp8_max / amax) / 2**margin, clamped to the float32
    maximum, optionally rounded down to a power of two (clearing the mantissa bits of a positive normal float is
    frexp's exact answer); `fallback` where amax is 0, inf or NaN."""
    safe = tl.where(_usable(amax), amax, 1.0)
    zero = safe * 0.0  # safe is finite: constants of safe's shape and dtype, for the IEEE (round-to-nearest) divisions
    scale = tl.div_rn(tl.div_rn(zero + FP8_MAX, safe), zero + MARGIN_DIV)
    scale = tl.minimum(scale, 3.4028234663852886e38)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(_usable(amax), scale, fallback)


@triton.jit
def _scale_from_amax_rt(amax, fallback, fp8_max, margin_div, pow2):
    """`_scale_from_amax` with run-time (tensor) constants: one role's row of a recipe-constants table."""
    safe = tl.where(_usable(amax), amax, 1.0)
    scale = tl.div_rn(tl.div_rn(fp8_max + safe * 0.0, safe), margin_div + safe * 0.0)
    scale = tl.minimum(scale, 3.4028234663852886e38)
    scale = tl.where(pow2, (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True), scale)
    return tl.where(_usable(amax), scale, fallback)


@triton.jit
def _partials_max(partials_ptr, num_partials, PARTIALS_BLOCK: tl.constexpr):
    """The amax bits of the pre-pass: the max of its programs' partial maxima (no zeroed buffer, no atomics)."""
    offs = tl.arange(0, PARTIALS_BLOCK)
    return tl.max(tl.load(partials_ptr + offs, mask=offs < num_partials, other=0), axis=0)


@triton.jit
def _derived_scale(
    hist_ptr, partials_ptr, num_partials,
    HIST_LEN: tl.constexpr, HIST_BLOCK: tl.constexpr, SCALING: tl.constexpr, ALGO_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr, MARGIN_DIV: tl.constexpr, POW2: tl.constexpr, HAS_CUR: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr,
):
    """`numerics.scaling.cast_scale`: SCALING 1 delayed, 2 current, 3 none (scale 1). The current amax comes from the
    pre-pass's partial maxima (HAS_CUR; every delayed and current cast has the pre-pass), else it is 0."""
    if SCALING == 3:
        return 1.0
    offs = tl.arange(0, HIST_BLOCK)
    h = tl.load(hist_ptr + offs, mask=offs < HIST_LEN, other=0.0)
    last = tl.sum(tl.where(offs == 1, h, 0.0), axis=0)
    previous = _scale_from_amax(last, 1.0, FP8_MAX, MARGIN_DIV, POW2)
    if HAS_CUR:
        cur = _partials_max(partials_ptr, num_partials, PARTIALS_BLOCK).to(tl.float32, bitcast=True)
    else:
        cur = last * 0.0
    current = _scale_from_amax(cur, previous, FP8_MAX, MARGIN_DIV, POW2)
    if SCALING == 2:
        return current
    if ALGO_MAX:
        ref = tl.max(tl.where((offs >= 1) & (offs < HIST_LEN), h, 0.0), axis=0)
    else:
        ref = last
    return _scale_from_amax(ref, current, FP8_MAX, MARGIN_DIV, POW2)


@triton.jit
def _history_ref(hist_ptr, HIST_LEN: tl.constexpr, HIST_BLOCK: tl.constexpr, ALGO_MAX: tl.constexpr):
    """`numerics.scaling.reference_amax` of the role's history row: what sizes a delayed scale (0: nothing yet)."""
    hoffs = tl.arange(0, HIST_BLOCK)
    h = tl.load(hist_ptr + hoffs, mask=hoffs < HIST_LEN, other=0.0)
    if ALGO_MAX:
        return tl.max(tl.where((hoffs >= 1) & (hoffs < HIST_LEN), h, 0.0), axis=0)
    else:
        return tl.sum(tl.where(hoffs == 1, h, 0.0), axis=0)


@triton.jit
def _amax_partials_kernel(
    x_ptr, partials_ptr, hist_ptr, M, N, stride_xm, stride_xn,
    SKIP_IF_HISTORY: tl.constexpr, HIST_LEN: tl.constexpr, HIST_BLOCK: tl.constexpr, ALGO_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The scaled cast's pre-pass: each of a fixed number of programs (<= PARTIALS_BLOCK) takes every P-th tile and
    writes the max |x| bits of its tiles to its own slot, which the cast kernel reduces; every slot is written, so
    nothing needs zeroing first. With SKIP_IF_HISTORY (delayed scaling) it reads nothing once the history sizes the
    scale."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    if SKIP_IF_HISTORY:
        tiles = tl.where(_history_ref(hist_ptr, HIST_LEN, HIST_BLOCK, ALGO_MAX) > 0, 0, tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for t in range(pid, tiles, num_programs):
        rows = ((t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = ((t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
        acc = tl.maximum(acc, x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.store(partials_ptr + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _cast_kernel(
    x_ptr, scale_ptr, out_ptr, out_t_ptr, amax_bits_ptr, noise_ptr, seed_ptr, skip_ptr,
    hist_ptr, hist_bits_ptr, partials_ptr, scale_out_ptr, scale_inv_out_ptr,
    M, N, M_OUT, num_partials,
    stride_xm, stride_xn, stride_zm, stride_zn,
    FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, COMPUTE_AMAX: tl.constexpr, HAS_SKIP: tl.constexpr,
    ROUNDING: tl.constexpr,
    SCALE_MODE: tl.constexpr, SKIP_IF_HISTORY: tl.constexpr, RECORD: tl.constexpr, RECORD_CUR: tl.constexpr,
    HIST_LEN: tl.constexpr, HIST_BLOCK: tl.constexpr, SCALING: tl.constexpr, ALGO_MAX: tl.constexpr,
    MARGIN_DIV: tl.constexpr, POW2: tl.constexpr, HAS_CUR: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = offs_m[:, None]
    cols = offs_n[None, :]
    rows_limit = M
    if HAS_SKIP:
        # delayed scaling's pre-pass: nothing to read once the state has a scale (flag read on device, no sync)
        rows_limit = tl.where(tl.load(skip_ptr) != 0, 0, M)
    if SKIP_IF_HISTORY:
        # the same, with the flag derived from the role's amax history: a reference amax sizes the scale
        rows_limit = tl.where(_history_ref(hist_ptr, HIST_LEN, HIST_BLOCK, ALGO_MAX) > 0, 0, M)
    mask = (rows < rows_limit) & (cols < N)
    x = tl.load(x_ptr + rows * stride_xm + cols * stride_xn, mask=mask, other=0.0).to(tl.float32)

    if COMPUTE_AMAX or RECORD:
        # |x| as integer bit patterns: order-preserving for non-negative floats, NaN above inf
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        block_max = tl.max(tl.max(bits, axis=1), axis=0)
        if COMPUTE_AMAX:
            tl.atomic_max(amax_bits_ptr, block_max)
        if RECORD:
            # the history's open slot holds a non-negative float (or NaN): its bit pattern orders the same way
            tl.atomic_max(hist_bits_ptr, block_max)
    if RECORD_CUR:
        if pid == 0:  # the pre-pass measured this tensor's amax already (current scaling)
            tl.atomic_max(hist_bits_ptr, _partials_max(partials_ptr, num_partials, PARTIALS_BLOCK))

    if WRITE_ROW or WRITE_T:
        if SCALE_MODE == 1:
            scale = _derived_scale(hist_ptr, partials_ptr, num_partials, HIST_LEN, HIST_BLOCK, SCALING, ALGO_MAX,
                                   FP8_MAX, MARGIN_DIV, POW2, HAS_CUR, PARTIALS_BLOCK)
            if pid == 0:
                tl.store(scale_out_ptr, scale)
                tl.store(scale_inv_out_ptr, tl.div_rn(scale * 0.0 + 1.0, scale))
        else:
            scale = tl.load(scale_ptr)
        y = x * scale
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
        code = _fp8_code(y, FP8_DTYPE, MANT, BIAS, HW_CAST)
        if ROUNDING != 0:
            # stochastic rounding on the FP8 codes, the same steps as quantize._stochastic_round
            if ROUNDING == 1:
                noise = tl.load(noise_ptr + rows * stride_zm + cols * stride_zn, mask=mask, other=0.0)
            else:
                seed = tl.load(seed_ptr)
                noise = tl.rand(seed, (rows * N + cols).to(tl.uint32))
            sign = code & 0x80
            mag_code = code & 0x7F
            magnitude = tl.abs(y)
            nearest_mag = tl.abs(_fp8_decode(mag_code, FP8_DTYPE, MANT, BIAS, HW_CAST))
            other_code = tl.where(nearest_mag > magnitude, mag_code - 1, mag_code + 1)
            other_code = tl.minimum(tl.maximum(other_code, 0), MAX_CODE)
            other_mag = _fp8_decode(other_code, FP8_DTYPE, MANT, BIAS, HW_CAST)
            lo = tl.minimum(nearest_mag, other_mag)
            hi = tl.maximum(nearest_mag, other_mag)
            gap = hi - lo
            p_up = tl.where(gap > 0, tl.div_rn(magnitude - lo, tl.where(gap > 0, gap, 1.0)), 0.0)
            round_up = noise < p_up
            lo_code = tl.minimum(mag_code, other_code)
            hi_code = tl.maximum(mag_code, other_code)
            chosen = tl.where(round_up, hi_code, lo_code)
            chosen = tl.where(nearest_mag == magnitude, mag_code, chosen)
            code = tl.where(y != y, code, chosen | sign)
        out = code.to(tl.uint8)
        if WRITE_ROW:
            tl.store(out_ptr + rows * N + cols, out, mask=mask)
        if WRITE_T:
            # x^T's row length is M_OUT >= M: the token columns past M are written as zeros (x was loaded as 0 there),
            # by the blocks that already hold them (BLOCK_M is a multiple of the padding: `launch_scaled_cast`)
            tl.store(out_t_ptr + cols * M_OUT + rows, out, mask=(rows < M_OUT) & (cols < N))


_TL_DTYPES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
_BIAS = {"e4m3": 7, "e5m2": 15}


def format_constexprs(fmt: FP8Format) -> dict:
    """The constexprs that describe an FP8 format to `_fp8_code` / `_fp8_value` (shared with optim/triton_adamw.py)."""
    return dict(FP8_DTYPE=_TL_DTYPES[fmt.name], MANT=fmt.mantissa_bits, BIAS=_BIAS[fmt.name], MAX_CODE=fmt.max_code)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _blocks(m: int, n: int, transpose: bool):
    if transpose:
        bn = min(64, max(16, _next_pow2(n)))
        bm = min(64, max(16, _next_pow2(m)))
    else:
        bn = min(256, max(16, _next_pow2(n)))
        bm = min(max(1, 4096 // bn), max(1, _next_pow2(m)))
    return bm, bn


def _launch(x, fmt, *, scale=None, out=None, out_t=None, amax_bits=None, noise=None, seed=None, skip_if=None,
            hist=None, partials=None, scale_out=None, scale_inv_out=None, hw_cast=True, compute_amax=False,
            scale_mode=0, skip_if_history=False, record=False, record_cur=False, scaling=1, algo_max=True,
            margin=0, power_of_2=False):
    m, n = x.shape
    m_out = out_t.shape[1] if out_t is not None else m
    if not (m and n):
        return
    if noise is not None:
        rounding = ROUND_NOISE
    elif seed is not None:
        rounding = ROUND_PHILOX
    else:
        rounding = ROUND_NEAREST
    bm, bn = _blocks(m, n, out_t is not None)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    dummy = x  # never dereferenced where a pointer is unused (constexpr-disabled branch)
    hist_len = hist.numel() if hist is not None else 1
    reads_x = skip_if is None and not skip_if_history
    with device_guard(x):
        if not announce("cast", [x if reads_x else None, noise, hist, scale], [out, out_t, amax_bits, scale_out]):
            return
        _cast_kernel[grid](
            x,
            scale if scale is not None else dummy,
            out if out is not None else dummy,
            out_t if out_t is not None else dummy,
            amax_bits if amax_bits is not None else dummy,
            noise if noise is not None else dummy,
            seed if seed is not None else dummy,
            skip_if.view(torch.uint8) if skip_if is not None else dummy,
            hist if hist is not None else dummy,
            hist.view(torch.int32) if hist is not None else dummy,
            partials if partials is not None else dummy,
            scale_out if scale_out is not None else dummy,
            scale_inv_out if scale_inv_out is not None else dummy,
            m,
            n,
            m_out,
            partials.numel() if partials is not None else 0,
            x.stride(0),
            x.stride(1),
            noise.stride(0) if noise is not None else 0,
            noise.stride(1) if noise is not None else 0,
            FP8_MAX=fmt.max,
            **format_constexprs(fmt),
            HW_CAST=hw_cast,
            WRITE_ROW=out is not None,
            WRITE_T=out_t is not None,
            COMPUTE_AMAX=compute_amax,
            HAS_SKIP=skip_if is not None,
            ROUNDING=rounding,
            SCALE_MODE=scale_mode,
            SKIP_IF_HISTORY=skip_if_history,
            RECORD=record,
            RECORD_CUR=record_cur,
            HIST_LEN=hist_len,
            HIST_BLOCK=_next_pow2(max(hist_len, 2)),
            SCALING=scaling,
            ALGO_MAX=algo_max,
            MARGIN_DIV=float(2.0**margin),
            POW2=power_of_2,
            HAS_CUR=partials is not None,
            PARTIALS_BLOCK=PARTIALS,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=4,
        )


#: programs of the scaled cast's amax pre-pass (each writes one partial maximum; the cast kernel reduces them)
PARTIALS = 256


def _launch_partials(x, partials, hist, skip_if_history: bool, algo_max: bool) -> None:
    m, n = x.shape
    bm, bn = _blocks(m, n, False)
    hist_len = hist.numel()
    with device_guard(x):
        if not announce("amax", [x if not skip_if_history else None], [partials]):
            return
        _amax_partials_kernel[(partials.numel(),)](
            x, partials, hist, m, n, x.stride(0), x.stride(1), SKIP_IF_HISTORY=skip_if_history, HIST_LEN=hist_len,
            HIST_BLOCK=_next_pow2(max(hist_len, 2)), ALGO_MAX=algo_max, BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
        )


def launch_cast(
    x: torch.Tensor,
    scale: Optional[torch.Tensor],
    fmt: FP8Format,
    *,
    write_row: bool,
    write_t: bool,
    compute_amax: bool,
    noise: Optional[torch.Tensor] = None,
    seed: Optional[torch.Tensor] = None,
    skip_if: Optional[torch.Tensor] = None,
    hw_cast: bool = True,
):
    """Run `_cast_kernel` with a given scale on a 2-D tensor of any strides. Returns (out [M,N] uint8 or None,
    out_t [N,M] uint8 or None, amax float32 0-d or None)."""
    assert x.dim() == 2
    m, n = x.shape
    device = x.device
    out = torch.empty((m, n), dtype=torch.uint8, device=device) if write_row else None
    out_t = torch.empty((n, m), dtype=torch.uint8, device=device) if write_t else None
    amax_bits = torch.zeros(1, dtype=torch.int32, device=device) if compute_amax else None
    _launch(x, fmt, scale=scale, out=out, out_t=out_t, amax_bits=amax_bits, noise=noise, seed=seed, skip_if=skip_if,
            hw_cast=hw_cast, compute_amax=compute_amax)
    amax = amax_bits.view(torch.float32).reshape(()) if amax_bits is not None else None
    return out, out_t, amax


_SCALING_CODES = {"delayed": 1, "current": 2, "none": 3}


def launch_scaled_cast(
    x: torch.Tensor,
    hist: torch.Tensor,
    fmt: FP8Format,
    scaling: str,
    algo_max: bool,
    margin: int,
    power_of_2: bool,
    *,
    write_t: bool,
    record: bool,
    noise: Optional[torch.Tensor] = None,
    seed: Optional[torch.Tensor] = None,
    hw_cast: bool = True,
    pad_to: int = 1,
    history_sized: bool = False,
):
    """The state-driven cast of a 2-D tensor (twin: `kernel_reference.scaled_cast_reference`). `hist` is the role's
    contiguous [L+1] float32 amax history row (its slot 0 receives this tensor's amax when `record`). `pad_to`
    (a power of two <= 16): x^T's rows are M rounded up to it, the extra columns zeros (the weight-gradient GEMM
    contracts the tokens, which torch's scaled GEMM takes in multiples of 16).

    Launches: current scaling 2 (the amax pre-pass, then the cast); delayed scaling 2 (a pre-pass that reads
    nothing once the history sizes the scale, then the cast), 1 when the caller knows the history sizes the scale
    (`history_sized`: the cast then derives the scale from the history alone, the same scale); no scaling 1. Nothing else: the outputs
    are allocated, never filled (the kernels write every element). Returns (out uint8 [M,N], out_t uint8 [N,M'] or
    None, scale 0-d, scale_inv 0-d)."""
    assert x.dim() == 2 and hist.dim() == 1 and hist.is_contiguous()
    m, n = x.shape
    device = x.device
    code = _SCALING_CODES[scaling]
    out = torch.empty((m, n), dtype=torch.uint8, device=device)
    assert pad_to in (1, 2, 4, 8, 16), pad_to  # the cast's row blocks (16 or more) then cover the padding
    m_out = -(-m // pad_to) * pad_to if n else m
    out_t = torch.empty((n, m_out), dtype=torch.uint8, device=device) if write_t else None
    if not (m and n):  # nothing to launch: the scale of an empty tensor is 1 (its amax is 0)
        one = torch.ones((), dtype=torch.float32, device=device)
        return out, out_t, one, one.clone()
    scale_out = torch.empty((), dtype=torch.float32, device=device)
    scale_inv_out = torch.empty((), dtype=torch.float32, device=device)
    consts = dict(hist=hist, scaling=code, algo_max=algo_max, margin=margin, power_of_2=power_of_2)
    partials = None
    if code == 2 or (code == 1 and not history_sized):
        bm, bn = _blocks(m, n, False)
        partials = torch.empty((min(PARTIALS, triton.cdiv(m, bm) * triton.cdiv(n, bn)),), dtype=torch.int32,
                               device=device)
        _launch_partials(x, partials, hist, skip_if_history=(code == 1), algo_max=algo_max)
    _launch(x, fmt, out=out, out_t=out_t, noise=noise, seed=seed, partials=partials, scale_out=scale_out,
            scale_inv_out=scale_inv_out, hw_cast=hw_cast, scale_mode=1, record=record and code != 2,
            record_cur=record and code == 2, **consts)
    return out, out_t, scale_out, scale_inv_out
