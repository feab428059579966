"""FP8 GEMM backends: `torch._scaled_mm` where the hardware has FP8 tensor cores, emulation elsewhere.

Emulation is not a fake: its operands are real FP8 tensors. Every E4M3/E5M2 value is exact in float32 and in BF16,
so multiplying their images with float32 accumulation gives the FP8 GEMM's result up to summation order; the two
dequant scales are applied to the accumulator and the output is rounded once, as `_scaled_mm` does. On CPU a
bf16-output GEMM with power-of-two scales runs as a BF16 GEMM (exact for these operands, see `_bf16_gemm`), the
rest in float32.

The GEMM is registered as the custom op `lightning_fp8::fp8_gemm` (with a fake implementation), so
`torch.compile` traces it as one opaque node on every backend instead of breaking the graph on the backend
choice, the once-only warning or the layout fix-ups.

`torch._scaled_mm` contract (torch 2.4 .. 2.13, checked against `meta_scaled_mm` and the CUDA checks):
  - mat1 (M, K) row-major, mat2 (K, N) column-major; K and N multiples of 16 (M free);
  - both operands float8 (e4m3fn / e5m2), never both e5m2 ("Multiplication of two Float8_e5m2 matrices is not
    supported");
  - tensor-wise scales: float32, one element each, the *dequant* scales (x ~= x_fp8 * scale);
  - out_dtype bfloat16 / float16 / float32; bias (N,) only for a bf16/fp16 output and of the output's dtype
    (no bias with a float32 output);
  - use_fast_accum=True trades accumulation precision for speed: fine for the forward GEMM, not for gradients.
This module pads K and N with zeros (exact: padded products are zero), fixes layouts with one copy where needed,
adds a float32-output bias after the GEMM, and emulates the e5m2 x e5m2 product.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class FP8EmulationWarning(UserWarning):
    """FP8 GEMMs are emulated (no FP8 tensor cores here): numerics are FP8, speed is not."""


_warned_devices: set = set()
_warned_e5m2 = False

#: out_dtypes `_scaled_mm` produces directly
_SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def scaled_mm_supported(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability 8.9 or newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_backend(requested: str, device: torch.device) -> str:
    """Pick "scaled_mm" or "emulated" for `device`; warn once per device kind when emulating."""
    if requested == "scaled_mm":
        if not scaled_mm_supported(device):
            raise RuntimeError(
                f"FP8Recipe(backend='scaled_mm') needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper), "
                f"but the tensors are on {device}; use backend='auto' or 'emulated'."
            )
        return "scaled_mm"
    if requested == "emulated":
        return "emulated"
    if scaled_mm_supported(device):
        return "scaled_mm"
    key = device.type if device.type != "cuda" else f"cuda:{torch.cuda.get_device_capability(device)}"
    if key not in _warned_devices:
        _warned_devices.add(key)
        warnings.warn(
            f"lightning_fp8: no FP8 tensor cores on {device} (they need CUDA compute capability >= 8.9); "
            "FP8 GEMMs are emulated: operands are real FP8 casts, products run in float32. Numerics match FP8, "
            "speed does not.",
            FP8EmulationWarning,
            stacklevel=3,
        )
    return "emulated"


def fp8_gemm(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    use_fast_accum: bool = False,
    backend: str = "auto",
) -> Tensor:
    """out = (a * a_scale_inv) @ (b * b_scale_inv) + bias, for FP8 `a` (M, K) and `b` (K, N) in any layout.

    Scales are the dequant scales (1 / the quantization scale), float32 scalars. The op has no autograd formula:
    FP8Linear's autograd function computes every gradient (the bias gradient included) itself."""
    return torch.ops.lightning_fp8.fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum, backend)


@torch.library.custom_op("lightning_fp8::fp8_gemm", mutates_args=())
def _fp8_gemm_op(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    out_dtype: torch.dtype,
    bias: Optional[Tensor],
    use_fast_accum: bool,
    backend: str,
) -> Tensor:
    resolved = resolve_backend(backend, a.device)
    # the ops inside must run in the dtypes written here, whatever autocast region the op is called from
    with torch.autocast(a.device.type, enabled=False):
        if resolved == "scaled_mm" and _scaled_mm_applies(a, b):
            return _scaled_mm_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum)
        return emulated_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


@_fp8_gemm_op.register_fake
def _fp8_gemm_fake(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum, backend):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "fp8_gemm expects 2-D operands")
    torch._check(a.shape[1] == b.shape[0], lambda: f"fp8_gemm: inner dimensions differ: {a.shape} @ {b.shape}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def emulated_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None) -> Tensor:
    """The FP8 GEMM without FP8 tensor cores: the product of the exact images of the FP8 operands, accumulated in
    float32, scaled and rounded once to out_dtype, as `_scaled_mm` computes it (up to summation order).

    Two ways, the same result: a BF16 GEMM where that is faithful (CPU, a bf16 output, power-of-two scales; see
    `_bf16_gemm`), else a float32 GEMM."""
    if (out_dtype == torch.bfloat16 and a.device.type == "cpu" and cpu_has_native_bf16()
            and _is_power_of_2(a_scale_inv) and _is_power_of_2(b_scale_inv)):
        return _bf16_gemm(a, a_scale_inv, b, b_scale_inv, bias)
    acc = torch.mm(_float32_image(a), _float32_image(b))
    out = acc * (a_scale_inv.to(torch.float32) * b_scale_inv.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _float32_image(x: Tensor) -> Tensor:
    """x's values in float32. On CPU through the BF16 table lookup (`fp8_bf16_image`, exact) and a vectorised
    widening: about 3x faster than torch's float8 -> float32 conversion, a scalar loop on CPU (2.3 vs 7.9 ms for
    1024x2816 codes on the development machine), which was a third of the emulated FP8Linear's time."""
    if x.device.type == "cpu" and x.dtype in _BF16_OF_CODE:
        return fp8_bf16_image(x).to(torch.float32)
    return x.to(torch.float32)


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies BF16 in hardware (AVX512-BF16 or AMX). Without it (an AVX2-only CPU) torch's BF16
    GEMMs are a slow fallback, 40-80x slower than float32 measured on an AMD EPYC, and the float32 emulation is the
    fast one; both give the same result up to summation order."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def _is_power_of_2(scale: Tensor) -> bool:
    value = float(scale)  # a CPU scalar: no device to synchronise with
    if not (value > 0 and math.isfinite(value)):
        return False
    mantissa, _ = math.frexp(value)
    return mantissa == 0.5


def _bf16_gemm(a, a_scale_inv, b, b_scale_inv, bias) -> Tensor:
    """Why a BF16 GEMM is exact here: every FP8 value is exact in BF16 (`fp8_bf16_image`); this CPU's BF16 GEMMs
    multiply exactly and accumulate in float32, like the tensor cores; and with power-of-two scales the final scaling
    commutes with the one rounding to BF16: round(acc) * 2^k == round(acc * 2^k) (outside BF16's subnormal range).
    So the result equals the float32 emulation's up to summation order, the same difference a GPU has. A bias is
    added before the rounding (addmm with the bias divided by the scale, exact for a power of two), as `_scaled_mm`
    adds it in its float32 epilogue."""
    a_img, b_img = fp8_bf16_image(a), fp8_bf16_image(b)
    scale = a_scale_inv.to(torch.float32) * b_scale_inv.to(torch.float32)
    if bias is None:
        out = torch.mm(a_img, b_img)
    else:
        out = torch.addmm(bias.to(torch.bfloat16) / scale, a_img, b_img)
    return out.mul_(scale)


#: BF16 value of every FP8 code, per format (a NaN code maps to NaN), and the same for every pair of codes (two
#: BF16 values packed in one int32, first element in the low half, as they lie in memory): one gather per two elements
_BF16_OF_CODE = {
    dtype: torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.bfloat16)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
}
_BF16_OF_CODE_PAIR: dict = {}


def _pair_table(dtype: torch.dtype) -> Tensor:
    table = _BF16_OF_CODE_PAIR.get(dtype)
    if table is None:
        single = _BF16_OF_CODE[dtype]
        codes = torch.arange(65536, dtype=torch.int32)
        low, high = single[(codes & 0xFF).long()], single[(codes >> 8).long()]
        table = _BF16_OF_CODE_PAIR[dtype] = torch.stack([low, high], dim=-1).view(torch.int32).reshape(-1)
    return table


def fp8_bf16_image(x: Tensor) -> Tensor:
    """The BF16 tensor with exactly x's values (every FP8 value is exact in BF16), fast on CPU.

    torch's own float8 -> bf16 conversion is a scalar loop on CPU (about 4 ns per element here); looking the codes up
    in a table is a vectorised gather: two codes at a time (a uint16) in a 65536-entry table of BF16 pairs, about
    0.35 ns per element on one thread of the development machine. A transposed view is converted through its
    contiguous storage and comes back with the same strides, so no copy is made for layout."""
    if x.dtype not in _BF16_OF_CODE:
        raise TypeError(f"fp8_bf16_image expects a float8 tensor, got {x.dtype}")
    if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
        return fp8_bf16_image(x.t()).t()
    codes = x.contiguous().view(torch.uint8).reshape(-1)
    if codes.numel() % 2 == 0 and x.device.type == "cpu":
        pairs = codes.view(torch.uint16).to(torch.int32)
        return _pair_table(x.dtype).index_select(0, pairs).view(torch.bfloat16).reshape(x.shape)
    return _BF16_OF_CODE[x.dtype].to(x.device).index_select(0, codes.to(torch.int32)).reshape(x.shape)


def _scaled_mm_applies(a: Tensor, b: Tensor) -> bool:
    """Cases `_scaled_mm` cannot take (emulated instead): empty operands, e5m2 x e5m2."""
    global _warned_e5m2
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        if not _warned_e5m2:
            _warned_e5m2 = True
            warnings.warn(
                "lightning_fp8: torch._scaled_mm cannot multiply two e5m2 matrices (a cuBLASLt restriction); this "
                "GEMM (format='e5m2' recipe, gradient GEMM) is emulated and runs at float32 speed.",
                FP8EmulationWarning,
                stacklevel=3,
            )
        return False
    return True


def _is_row_major(t: Tensor) -> bool:
    # _scaled_mm's own test: stride[0] > stride[1] and stride[1] == 1
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]) and t.stride(0) > t.stride(1)


def _is_col_major(t: Tensor) -> bool:
    # stride[0] == 1 and stride[1] > 1
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0]) and t.stride(1) > 1


def _row_major(t: Tensor) -> Tensor:
    if _is_row_major(t):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _col_major(t: Tensor) -> Tensor:
    if _is_col_major(t):
        return t
    return _row_major(t.t()).t()


def _pad_cols(t: Tensor, pad: int) -> Tensor:
    """Zero-pad the last dimension of a 2-D FP8 tensor (byte 0 is +0.0 in both formats); row-major result."""
    return F.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)


def _scaled_mm_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum) -> Tensor:
    m, k = a.shape
    n = b.shape[1]
    pad_k = (-k) % 16
    pad_n = (-n) % 16
    if pad_k:
        a = _pad_cols(a, pad_k)  # (M, K+pad) row-major
    a = _row_major(a)
    if pad_k or pad_n:
        bt = b.t()  # (N, K)
        if pad_k:
            bt = _pad_cols(bt, pad_k)
        if pad_n:
            bt = F.pad(bt.view(torch.uint8), (0, 0, 0, pad_n)).view(b.dtype)
        b = _row_major(bt).t()  # (K+pad_k, N+pad_n) column-major
    b = _col_major(b)
    mm_dtype = out_dtype if out_dtype in _SCALED_MM_OUT_DTYPES else torch.float32
    bias_arg = None
    if bias is not None and mm_dtype != torch.float32:
        bias_arg = bias.to(mm_dtype)
        if pad_n:
            bias_arg = F.pad(bias_arg, (0, pad_n))
    out = torch._scaled_mm(
        a,
        b,
        scale_a=a_scale_inv.to(torch.float32).reshape(()),
        scale_b=b_scale_inv.to(torch.float32).reshape(()),
        bias=bias_arg,
        out_dtype=mm_dtype,
        use_fast_accum=use_fast_accum,
    )
    if pad_n:
        out = out[:, :n]
    if bias is not None and bias_arg is None:
        out = out + bias.to(mm_dtype)
    if out.dtype != out_dtype or pad_n:
        out = out.to(out_dtype).contiguous()
    return out


__all__ = ["fp8_gemm", "emulated_gemm", "cpu_has_native_bf16", "fp8_bf16_image", "resolve_backend", "scaled_mm_supported", "FP8EmulationWarning"]
