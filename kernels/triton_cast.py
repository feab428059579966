"""Triton kernels for the FP8 casts. Imported only when triton is importable (see `lightning_fp8.kernels`).

One kernel, `_cast_kernel`, specialised by constexpr flags, covers every cast FP8Linear needs:

  amax only          (current scaling's first pass; delayed scaling's pre-pass, skipped on device once the
                      state is initialised)
  amax + scale + cast (delayed scaling: the scale is known before the pass, the amax comes out of the same read)
  cast + transpose   (writes x_fp8 row-major and x_fp8^T row-major from one read of x)
  stochastic rounding with a given uniform noise tensor (bit-exact twin of `quantize(..., noise=noise)`) or with
                      in-kernel philox noise (`tl.rand`, tested statistically only)

The torch twins (what each variant must reproduce) are `lightning_fp8.numerics.quantize.quantize` and
`tensor_amax`; `lightning_fp8.kernels.reference` maps every variant onto them.

Numerics, step by step, exactly as the reference:
  y = float32(x) * scale                          one IEEE float32 multiply (x converted exactly)
  y = clamp(y, -max, max), NaN kept               explicit saturation before the cast
  code = round-to-nearest-even FP8 code of y      hardware cvt (HW_CAST) or an exact integer emulation
amax is max(|x|) computed on the float32 bit patterns as integers: for non-negative floats the integer order
is the float order, and every NaN pattern (sign cleared) sorts above +inf, so NaN propagates exactly like
`torch.amax` and the per-program partial maxima combine with one integer `atomic_max`.

Nothing here has run on a GPU yet (the machine this was written on has none): the soft-cast variant was checked
bit-exactly under the Triton interpreter on CPU; the hardware-cast variant only where the interpreter's own
fp8 conversion is right. `tests/test_kernels.py -m cuda` is the GPU check.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

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
def _cast_kernel(
    x_ptr, scale_ptr, out_ptr, out_t_ptr, amax_bits_ptr, noise_ptr, seed_ptr, skip_ptr,
    M, N,
    stride_xm, stride_xn, stride_zm, stride_zn,
    FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr, HW_CAST: tl.constexpr,
    WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, COMPUTE_AMAX: tl.constexpr, HAS_SKIP: tl.constexpr,
    ROUNDING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    mask = (rows < rows_limit) & (cols < N)
    x = tl.load(x_ptr + rows * stride_xm + cols * stride_xn, mask=mask, other=0.0).to(tl.float32)

    if COMPUTE_AMAX:
        # |x| as integer bit patterns: order-preserving for non-negative floats, NaN above inf
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        block_max = tl.max(tl.max(bits, axis=1), axis=0)
        tl.atomic_max(amax_bits_ptr, block_max)

    if WRITE_ROW or WRITE_T:
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
            tl.store(out_t_ptr + cols * M + rows, out, mask=mask)


_TL_DTYPES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}
_BIAS = {"e4m3": 7, "e5m2": 15}


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
    """Run `_cast_kernel` on a 2-D tensor of any strides. Returns (out [M,N] uint8 or None, out_t [N,M] uint8 or
    None, amax float32 0-d or None)."""
    assert x.dim() == 2
    m, n = x.shape
    device = x.device
    out = torch.empty((m, n), dtype=torch.uint8, device=device) if write_row else None
    out_t = torch.empty((n, m), dtype=torch.uint8, device=device) if write_t else None
    amax_bits = torch.zeros(1, dtype=torch.int32, device=device) if compute_amax else None
    if noise is not None:
        rounding = ROUND_NOISE
    elif seed is not None:
        rounding = ROUND_PHILOX
    else:
        rounding = ROUND_NEAREST
    if m and n:
        bm, bn = _blocks(m, n, write_t)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        dummy = x  # never dereferenced where a pointer is unused (constexpr-disabled branch)
        _cast_kernel[grid](
            x,
            scale if scale is not None else dummy,
            out if out is not None else dummy,
            out_t if out_t is not None else dummy,
            amax_bits if amax_bits is not None else dummy,
            noise if noise is not None else dummy,
            seed if seed is not None else dummy,
            skip_if.view(torch.uint8) if skip_if is not None else dummy,
            m,
            n,
            x.stride(0),
            x.stride(1),
            noise.stride(0) if noise is not None else 0,
            noise.stride(1) if noise is not None else 0,
            FP8_MAX=fmt.max,
            FP8_DTYPE=_TL_DTYPES[fmt.name],
            MANT=fmt.mantissa_bits,
            BIAS=_BIAS[fmt.name],
            MAX_CODE=fmt.max_code,
            HW_CAST=hw_cast,
            WRITE_ROW=write_row,
            WRITE_T=write_t,
            COMPUTE_AMAX=compute_amax,
            HAS_SKIP=skip_if is not None,
            ROUNDING=rounding,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=4,
        )
    amax = amax_bits.view(torch.float32).reshape(()) if amax_bits is not None else None
    return out, out_t, amax
