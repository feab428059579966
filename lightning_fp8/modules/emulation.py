"""The FP8 GEMM without FP8 tensor cores: `emulate(operands)`, for every scaling.

Emulation is not a fake: the operands are real FP8 (or FP4) tensors, and every E4M3 / E5M2 / E2M1 value times a
power-of-two scale is exact in BF16 and in float32. Multiplying those exact images with float32 accumulation gives
the scaled GEMM's result up to summation order; scales are applied to the accumulator (per tensor) or to the
operands (per tile, exact for power-of-two scales), and the output is rounded once, as the scaled GEMM does.

Which GEMM runs the products: on a CPU that multiplies BF16 in hardware (AVX512-BF16 or AMX) a BF16 GEMM where that
is exact (a BF16 output, power-of-two scales: see `_bf16_tensorwise`), else float32. Scales that are not powers of
two run the per-K-block definitions of lightning_fp8/numerics (exact semantics, slow) on a CPU, and a float32
dequantization on other devices. The definitions: `numerics.tiles.tiled_gemm_reference`,
`numerics.microscaling.gemm_reference`.
"""
from __future__ import annotations

import collections
import functools
import math
import weakref
from typing import Optional

import torch

from lightning_fp8.kernels.cpu_kernels import memory_bound_threads
from lightning_fp8.kernels.device import profile_of
from lightning_fp8.modules.operand import FP4, GemmRequest
from lightning_fp8.numerics import microscaling
from lightning_fp8.numerics.groups import group_of_rows
from lightning_fp8.numerics.tiles import exact_in_bf16, tiled_gemm_reference, times_tiles

Tensor = torch.Tensor


def emulate(operands: GemmRequest, bf16: Optional[bool] = None) -> Tensor:
    """out = A @ B + bias of `operands`, rounded once to its out_dtype (module docstring).

    bf16: run the products as a BF16 GEMM where exact (True) or in float32 (False); default: BF16 where this CPU
    has it in hardware. The same result up to summation order either way."""
    a, b = operands.a, operands.b
    if (FP4 is not None and a.data.dtype == FP4) or a.scale_inv.dtype == microscaling.E8M0:
        return _microscaled(operands, bf16)
    if a.tile is None and b.tile is None:
        return _tensorwise(operands, bf16)
    return _tiled(operands, bf16)


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies BF16 in hardware (AVX512-BF16 or AMX). Without it (an AVX2-only CPU) torch's BF16
    GEMMs are a slow software fallback and the float32 emulation is the fast one; both give the same result up to
    summation order."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def _use_bf16(bf16: Optional[bool]) -> bool:
    return cpu_has_native_bf16() if bf16 is None else bf16


# -- per-tensor scales ------------------------------------------------------------------------------------------------
def _tensorwise(operands: GemmRequest, bf16: Optional[bool]) -> Tensor:
    a, b, out_dtype, bias = operands.a, operands.b, operands.out_dtype, operands.bias
    if (out_dtype == torch.bfloat16 and profile_of(a.data.device).host_checks_allowed and _use_bf16(bf16)
            and _is_power_of_2(a.scale_inv) and _is_power_of_2(b.scale_inv)):
        return _bf16_tensorwise(operands)
    acc = torch.mm(_float32_image(a.data), _float32_image(b.data))
    out = acc * (a.scale_inv.to(torch.float32) * b.scale_inv.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _bf16_tensorwise(operands: GemmRequest) -> Tensor:
    """Why a BF16 GEMM is exact here: every FP8 value is exact in BF16 (`fp8_bf16_image`); this CPU's BF16 GEMMs
    multiply exactly and accumulate in float32, like the tensor cores; and with power-of-two scales the scaling
    commutes with every rounding: round(acc) * 2^k == round(acc * 2^k) (outside BF16's subnormal range).

    So the combined scale s = scale_a * scale_b goes into B's image (its table, `fp8_bf16_image(..., scale=s)`: no
    pass of its own) where that changes no rounding: every nonzero |B value * s| and every nonzero partial sum (a
    multiple of 2^-32 * s, the finest grid of a product of two FP8 values) stays a normal number and far from
    overflow, which s in [2^-94, 2^60] guarantees. Elsewhere the output is scaled after the GEMM. A bias is added
    before the one rounding (addmm), as the scaled GEMM adds it in its float32 epilogue."""
    a, b, bias = operands.a, operands.b, operands.bias
    scale = float(a.scale_inv) * float(b.scale_inv)  # powers of two: the product is exact
    a_img = fp8_bf16_image(a.data)
    if _FOLDABLE[0] <= scale <= _FOLDABLE[1]:
        b_img = fp8_bf16_image(b.data, scale=scale)
        if bias is None:
            return torch.mm(a_img, b_img)
        return torch.addmm(bias.to(torch.bfloat16), a_img, b_img)
    b_img = fp8_bf16_image(b.data)
    if bias is None:
        out = torch.mm(a_img, b_img)
    else:  # the bias divided by the scale: exact for a power of two
        out = torch.addmm(bias.to(torch.bfloat16) / scale, a_img, b_img)
    return out.mul_(scale)


#: the power-of-two scales `_bf16_tensorwise` folds into an operand's image (its docstring says why)
_FOLDABLE = (2.0**-94, 2.0**60)


def _is_power_of_2(scale: Tensor) -> bool:
    value = float(scale)  # a CPU scalar: no device to synchronise with
    if not (value > 0 and math.isfinite(value)):
        return False
    mantissa, _ = math.frexp(value)
    return mantissa == 0.5


# -- per-tile scales (rowwise, blockwise) -----------------------------------------------------------------------------
def dequantized(data: Tensor, scale_inv: Tensor, tile, dtype: torch.dtype) -> Tensor:
    """The FP8 values times their tile's dequant scale, in dtype (exact in BF16 for power-of-two scales)."""
    image = fp8_bf16_image(data).to(dtype) if data.device.type == "cpu" else data.to(dtype)
    return times_tiles(image, scale_inv.to(dtype), tile)


def _tiled(operands: GemmRequest, bf16: Optional[bool]) -> Tensor:
    a, b, out_dtype, bias = operands.a, operands.b, operands.out_dtype, operands.bias
    host = profile_of(a.data.device).host_checks_allowed  # a real CPU: reading the scales costs no synchronisation
    if host and not (exact_in_bf16(a.scale_inv) and exact_in_bf16(b.scale_inv)):
        return tiled_gemm_reference(a.data, a.scale_inv, a.tile, b.data, b.scale_inv, b.tile, out_dtype, bias)
    if out_dtype == torch.bfloat16 and host and _use_bf16(bf16):
        # every dequantized value exact in BF16; this CPU's BF16 GEMMs accumulate in float32 and round once, and
        # addmm adds the bias before that rounding
        a16 = dequantized(a.data, a.scale_inv, a.tile, torch.bfloat16)
        b16 = dequantized(b.data, b.scale_inv, b.tile, torch.bfloat16)
        return torch.mm(a16, b16) if bias is None else torch.addmm(bias.to(torch.bfloat16), a16, b16)
    out = torch.mm(dequantized(a.data, a.scale_inv, a.tile, torch.float32),
                   dequantized(b.data, b.scale_inv, b.tile, torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


# -- microscaled (MXFP8, NVFP4) ---------------------------------------------------------------------------------------
def _microscaled(operands: GemmRequest, bf16: Optional[bool]) -> Tensor:
    """Each operand's exact values times its block scales, one GEMM with float32 accumulation, times the tensor scales
    (NVFP4), plus bias, rounded once: `microscaling.gemm_reference` up to summation order where no dequantized value
    leaves BF16's exponent range (MX scales within 2^+-100; otherwise the per-block definition runs)."""
    a, b = operands.a, operands.b
    host = profile_of(a.data.device).host_checks_allowed
    mx = FP4 is None or a.data.dtype != FP4
    if mx and host and not (exact_in_bf16(a.scale_inv.float()) and exact_in_bf16(b.scale_inv.float())):
        return microscaling.gemm_reference(a.data, a.scale_inv, a.tile, b.data, b.scale_inv, b.tile,
                                           operands.out_dtype, operands.bias)
    # NVFP4 multiplies the accumulator by its tensor scales before the one rounding: a float32 GEMM
    dtype = torch.bfloat16 if (mx and host and _use_bf16(bf16) and operands.out_dtype == torch.bfloat16) else torch.float32
    a_values, b_values = _microscaled_values(a.data, 1, dtype), _microscaled_values(b.data, 0, dtype)
    k = min(a_values.shape[1], b_values.shape[0])  # an odd K: the packed operands' zero padding, dropped
    a_img = times_tiles(a_values[:, :k], a.scale_inv.to(dtype), a.tile)
    b_img = times_tiles(b_values[:k, :], b.scale_inv.to(dtype), b.tile)
    if mx and dtype == torch.bfloat16:  # exact BF16 GEMM, bias added before the one rounding
        return torch.mm(a_img, b_img) if operands.bias is None else torch.addmm(
            operands.bias.to(torch.bfloat16), a_img, b_img)
    out = torch.mm(a_img, b_img).to(torch.float32)
    if not mx:
        out = out * microscaling._tensor_scale_product(a.tensor_scale, b.tensor_scale, out)
    if operands.bias is not None:
        out = out + operands.bias.to(torch.float32)
    return out.to(operands.out_dtype)


def _microscaled_values(x: Tensor, contraction_dim: int, dtype: torch.dtype) -> Tensor:
    if FP4 is not None and x.dtype == FP4:
        return microscaling.operand_values(x, contraction_dim).to(dtype)
    return (fp8_bf16_image(x) if x.device.type == "cpu" else x).to(dtype)


# -- exact images of FP8 values ---------------------------------------------------------------------------------------
def _float32_image(x: Tensor) -> Tensor:
    """x's values in float32; on CPU through the exact BF16 table lookup, which is faster than torch's own float8
    conversion there (a scalar loop)."""
    if x.device.type == "cpu" and x.dtype in _BF16_OF_CODE:
        return fp8_bf16_image(x).to(torch.float32)
    return x.to(torch.float32)


#: BF16 value of every FP8 code, per format (a NaN code maps to NaN), and the same for every pair of codes (two
#: BF16 values packed in one int32, first element in the low half, as they lie in memory): one gather per two elements.
#: Pair tables of values times a power-of-two scale (`fp8_bf16_image(..., scale=)`) are kept for the last few scales.
_BF16_OF_CODE = {
    dtype: torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.bfloat16)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
}
_BF16_OF_CODE_PAIR: "collections.OrderedDict" = collections.OrderedDict()
_PAIR_TABLES_KEPT = 16


def _pair_table(dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    key = (dtype, scale)
    table = _BF16_OF_CODE_PAIR.get(key)
    if table is None:
        single = _BF16_OF_CODE[dtype] if scale == 1.0 else _BF16_OF_CODE[dtype] * scale  # exact: see the caller
        codes = torch.arange(65536, dtype=torch.int32)
        low, high = single[(codes & 0xFF).long()], single[(codes >> 8).long()]
        table = _BF16_OF_CODE_PAIR[key] = torch.stack([low, high], dim=-1).view(torch.int32).reshape(-1)
        while len(_BF16_OF_CODE_PAIR) > _PAIR_TABLES_KEPT:
            _BF16_OF_CODE_PAIR.popitem(last=False)
    else:
        _BF16_OF_CODE_PAIR.move_to_end(key)
    return table


def fp8_bf16_image(x: Tensor, scale: float = 1.0) -> Tensor:
    """The BF16 tensor with exactly x's values (every FP8 value is exact in BF16), times `scale`, a power of two that
    keeps every nonzero value a normal BF16 number (the caller's to ensure: then the product is exact too).

    Why a table: torch's float8 -> bf16 conversion is a scalar loop on CPU; looking the codes up two at a time (a
    uint16) in a 65536-entry table of BF16 pairs is a vectorised gather. A transposed view is converted through its
    contiguous storage and comes back with the same strides (no copy for layout). The last unscaled images made on a
    CPU are remembered with the FP8 tensor they came from (weakly: they go when it goes, and a write to it makes them
    stale), so a tensor two GEMMs read, as the output gradient is by the input- and the weight-gradient GEMMs, is
    converted once."""
    if x.dtype not in _BF16_OF_CODE:
        raise TypeError(f"fp8_bf16_image expects a float8 tensor, got {x.dtype}")
    if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
        return fp8_bf16_image(x.t(), scale).t()
    # (an inference tensor, made under torch.inference_mode as Lightning's evaluation loops run, has no version
    # counter to key the cache by: not cached)
    cache = scale == 1.0 and x.device.type == "cpu" and not x.is_inference()
    if cache:
        image = _recent_image(x)
        if image is not None:
            return image
    codes = x.contiguous().view(torch.uint8).reshape(-1)
    if codes.numel() % 2 == 0 and x.device.type == "cpu":
        table = _pair_table(x.dtype, scale)
        with memory_bound_threads("image", codes.numel()):
            pairs = codes.view(torch.uint16).to(torch.int32)
            image = table.index_select(0, pairs).view(torch.bfloat16).reshape(x.shape)
    else:
        single = _BF16_OF_CODE[x.dtype].to(x.device)
        image = (single if scale == 1.0 else single * scale).index_select(0, codes.to(torch.int32)).reshape(x.shape)
    if cache:
        _remember_image(x, image)
    return image


#: (weak reference to the FP8 tensor's base, its version, the view's layout, the image), most recent last
_recent_images: list = []
_IMAGES_KEPT = 2


def _image_key(x: Tensor):
    base = x if x._base is None else x._base
    return base, (base._version, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)


def _recent_image(x: Tensor) -> Optional[Tensor]:
    base, key = _image_key(x)
    for ref, known, image in _recent_images:
        if ref() is base and known == key:
            return image
    return None


def _remember_image(x: Tensor, image: Tensor) -> None:
    base, key = _image_key(x)
    _recent_images[:] = [entry for entry in _recent_images if entry[0]() is not None][-(_IMAGES_KEPT - 1):]
    _recent_images.append((weakref.ref(base), key, image))


# -- grouped GEMMs (mixture-of-experts layers) ----------------------------------------------------------------------
def emulate_grouped(operands: GemmRequest) -> Tensor:
    """A grouped GEMM (`GemmRequest.offsets`, rowwise scales: numerics/groups.py) without FP8 tensor cores: the exact
    FP8 values multiplied per group by torch's grouped GEMM in float32, then each output scaled by its row's and
    column's dequant scales and rounded once (`numerics.groups.grouped_gemm_reference` up to summation order). Rows
    past the last offset come out zero."""
    a, b, offsets = operands.a, operands.b, operands.offsets
    a32, b32 = a.data.to(torch.float32), b.data.to(torch.float32)
    if operands.grouped == "rows":  # a (M, K) with (M, 1) scales, b (E, K, N) with (E, 1, N)
        rows = a32.shape[0]
        groups = group_of_rows(offsets, rows)
        in_group = (groups < offsets.shape[0]).unsqueeze(1)
        out = torch._grouped_mm(a32, b32, offs=offsets) if rows else a32.new_zeros((0, b32.shape[2]))
        col_scale = torch.cat([b.scale_inv.reshape(offsets.shape[0], -1), b.scale_inv.new_zeros(1, b32.shape[2])])
        out = torch.where(in_group, out, torch.zeros_like(out)) * a.scale_inv.reshape(rows, 1) * col_scale[groups]
        return out.to(operands.out_dtype)
    # the contraction grouped: a (M, T) with (E, M, 1) scales, b (T, N) with (E, 1, N); out (E, M, N). torch's grouped
    # GEMM wants 16-byte strides: the token dimension is zero-padded past the last group to a multiple of 4
    tokens = a32.shape[1]
    pad = -tokens % 4
    a32 = torch.nn.functional.pad(a32, (0, pad)).contiguous()
    b32 = torch.nn.functional.pad(b32, (0, 0, 0, pad)).contiguous()
    out = torch._grouped_mm(a32, b32, offs=offsets)
    return (out * a.scale_inv * b.scale_inv).to(operands.out_dtype)
