"""The GEMM of two tile-scaled FP8 operands (rowwise / blockwise recipes): `lightning_fp8::fp8_gemm_tiled`.

What it computes is defined once, in `numerics.tiles.tiled_gemm_reference`: per K block, the partial product of the
exact FP8 values accumulated in float32, scaled by its rows' and columns' dequant scales, summed in float32, plus
bias, rounded once. Backends, fastest first:

- `torch._scaled_mm` (CUDA): rowwise scales (scale_a (M, 1), scale_b (1, N); torch >= 2.5 on sm89+, bf16 / fp16
  output in torch 2.11) and DeepSeek-style blockwise scales (1x128 x 128x128 and 1x128 x 1x128; sm90 with cuBLASLt
  >= 12.9: torch 2.11 on cu130 has it, see docs/numerics.md for what each torch version takes). A combination the
  installed torch / GPU refuses raises before launching; it is then emulated, with a one-time FP8EmulationWarning
  naming torch's reason.
- emulation: each operand dequantized (its FP8 values times its tile scales) and one GEMM with float32
  accumulation. With power-of-two scales (the default) every dequantized value is exact in BF16 and every product
  exact in float32, so this differs from the per-K-block definition only in summation order (a test checks both);
  on a CPU with hardware BF16 (AVX512-BF16 / AMX) it then runs as a BF16 GEMM for a BF16 output, elsewhere in
  float32 (`gemm.cpu_has_native_bf16`). Scales that are not powers of two run the per-K-block
  definition itself on CPU (exact semantics, slow), and a float32 dequantization on CUDA (each dequantized value
  rounded once more, docs/numerics.md).

Registered as a custom op with a fake implementation, so `torch.compile` traces it as one node.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from lightning_fp8.modules.gemm import FP8EmulationWarning, cpu_has_native_bf16, fp8_bf16_image, resolve_backend
from lightning_fp8.numerics.tiles import exact_in_bf16, tile_extent, tiled_gemm_reference, times_tiles

Tensor = torch.Tensor

#: kinds of `_scaled_mm` call torch or the GPU refused here, with the reason (warned once each)
_refused: dict = {}


def fp8_gemm_tiled(
    a: Tensor,
    a_scale_inv: Tensor,
    a_tile: Sequence[int],
    b: Tensor,
    b_scale_inv: Tensor,
    b_tile: Sequence[int],
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    use_fast_accum: bool = False,
    backend: str = "auto",
) -> Tensor:
    """out = dequant(a) @ dequant(b) + bias for FP8 a (M, K) with tiles `a_tile` = (rows, K block) and b (K, N)
    with tiles `b_tile` = (K block, cols), any layout; scales are per-tile dequant scales in grid layout
    (`numerics.tiles.grid_shape`). No autograd formula: the layer's autograd function owns the gradients."""
    return torch.ops.lightning_fp8.fp8_gemm_tiled(
        a, a_scale_inv, [int(v) for v in a_tile], b, b_scale_inv, [int(v) for v in b_tile], out_dtype, bias,
        use_fast_accum, backend,
    )


@torch.library.custom_op("lightning_fp8::fp8_gemm_tiled", mutates_args=())
def _fp8_gemm_tiled_op(
    a: Tensor,
    a_scale_inv: Tensor,
    a_tile: List[int],
    b: Tensor,
    b_scale_inv: Tensor,
    b_tile: List[int],
    out_dtype: torch.dtype,
    bias: Optional[Tensor],
    use_fast_accum: bool,
    backend: str,
) -> Tensor:
    resolved = resolve_backend(backend, a.device)
    with torch.autocast(a.device.type, enabled=False):
        if resolved == "scaled_mm":
            out = scaled_mm_tiled(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias, use_fast_accum)
            if out is not None:
                return out
        return emulated_tiled_gemm(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias)


@_fp8_gemm_tiled_op.register_fake
def _fp8_gemm_tiled_fake(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias, use_fast_accum, backend):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "fp8_gemm_tiled expects 2-D operands")
    torch._check(a.shape[1] == b.shape[0], lambda: f"fp8_gemm_tiled: inner dimensions differ: {a.shape} @ {b.shape}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


# -- emulation ------------------------------------------------------------------------------------------------------
def dequantized(x: Tensor, scale_inv: Tensor, tile: Sequence[int], dtype: torch.dtype) -> Tensor:
    """x's FP8 values times their tile's dequant scale, in dtype (exact in BF16 for power-of-two scales)."""
    if x.device.type == "cpu":
        image = fp8_bf16_image(x).to(dtype)  # exact, and fast on CPU (torch's float8 conversion is a scalar loop)
    else:
        image = x.to(dtype)
    return times_tiles(image, scale_inv.to(dtype), tile)


def emulated_tiled_gemm(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias=None,
                        bf16: Optional[bool] = None) -> Tensor:
    """The tiled FP8 GEMM without FP8 tensor cores (module docstring): dequantize, one GEMM, round once.

    bf16: run the CPU's BF16 GEMM (True) or a float32 one (False) for a BF16 output with exact scales; default: BF16
    where the CPU has it in hardware. The same result up to summation order either way (tests run both)."""
    if a.device.type == "cpu" and not (exact_in_bf16(a_scale_inv) and exact_in_bf16(b_scale_inv)):
        return tiled_gemm_reference(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias)
    if bf16 is None:
        bf16 = cpu_has_native_bf16()
    if out_dtype == torch.bfloat16 and a.device.type == "cpu" and bf16:
        # every dequantized value exact in BF16; this CPU's BF16 GEMMs accumulate in float32 and round once, and
        # addmm adds the bias before that rounding (tests/test_gemm.py proves both for the per-tensor emulation)
        a16, b16 = dequantized(a, a_scale_inv, a_tile, torch.bfloat16), dequantized(b, b_scale_inv, b_tile, torch.bfloat16)
        if bias is None:
            return torch.mm(a16, b16)
        return torch.addmm(bias.to(torch.bfloat16), a16, b16)
    a32, b32 = dequantized(a, a_scale_inv, a_tile, torch.float32), dequantized(b, b_scale_inv, b_tile, torch.float32)
    out = torch.mm(a32, b32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


# -- torch._scaled_mm -----------------------------------------------------------------------------------------------
def scaled_mm_kind(a: Tensor, a_tile: Sequence[int], b: Tensor, b_tile: Sequence[int]) -> Optional[str]:
    """"rowwise", "blockwise" (1x128 x 128x128 or 1x128 x 1x128) or None: what `_scaled_mm` can take."""
    m, k = a.shape
    n = b.shape[1]
    if a.numel() == 0 or b.numel() == 0 or (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2):
        return None
    ar, ak = tile_extent(a_tile, (m, k))
    bk, bc = tile_extent(b_tile, (k, n))
    if ar == 1 and ak == k and bk == k and bc == 1:
        return "rowwise"
    if ar == 1 and ak == 128 and bk == 128 and bc in (128, 1) and m % 128 == 0 and n % 128 == 0 and k % 128 == 0:
        return "blockwise"
    return None


def scaled_mm_tiled(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias, use_fast_accum) -> Optional[Tensor]:
    """The GEMM on `torch._scaled_mm`, or None where torch / the GPU cannot take it (then emulate). Device-agnostic
    (the CPU build runs the rowwise form, which is how the CPU tests check layouts, padding and bias)."""
    kind = scaled_mm_kind(a, a_tile, b, b_tile)
    if kind is None:
        return None
    if kind == "rowwise" and out_dtype not in (torch.bfloat16, torch.float16):
        _refuse(("rowwise", "out_dtype"), "rowwise _scaled_mm produces bf16 / fp16 only (torch 2.11)")
        return None
    key = (kind, a.device.type, a.dtype, b.dtype, out_dtype)
    if key in _refused:
        return None
    try:
        if kind == "rowwise":
            return _rowwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum)
        return _blockwise(a, a_scale_inv, b, b_scale_inv, b_tile, out_dtype, bias)
    except (RuntimeError, NotImplementedError, ValueError) as error:  # raised by torch's checks, before any launch
        _refuse(key, f"torch._scaled_mm refused {kind} scales here ({str(error).splitlines()[0]})")
        return None


def _refuse(key, reason: str) -> None:
    if key not in _refused:
        _refused[key] = reason
        warnings.warn(f"lightning_fp8: {reason}; these GEMMs are emulated (exact FP8 values, float32 accumulation): "
                      "numerics are FP8, speed is not.", FP8EmulationWarning, stacklevel=4)


def _row_major(t: Tensor) -> Tensor:
    return t if (t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])) else t.contiguous()


def _col_major(t: Tensor) -> Tensor:
    return t if (t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0])) else t.t().contiguous().t()


def _pad_to(t: Tensor, rows: int, cols: int) -> Tensor:
    """Zero-pad a 2-D FP8 tensor (byte 0 is +0.0 in both formats) to (rows, cols), row-major."""
    pad_r, pad_c = rows - t.shape[0], cols - t.shape[1]
    if not (pad_r or pad_c):
        return t
    return F.pad(t.contiguous().view(torch.uint8), (0, pad_c, 0, pad_r)).view(t.dtype)


def _rowwise(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum) -> Tensor:
    m, k = a.shape
    n = b.shape[1]
    k16, n16 = -(-k // 16) * 16, -(-n // 16) * 16
    a = _row_major(_pad_to(a, m, k16))
    b = _col_major(_pad_to(b.t(), n16, k16).t() if (k16 != k or n16 != n) else b)
    scale_a = a_scale_inv.to(torch.float32).reshape(m, 1).contiguous()
    scale_b = b_scale_inv.to(torch.float32).reshape(1, n)
    if n16 != n:
        scale_b = F.pad(scale_b, (0, n16 - n), value=1.0)
    bias_arg = None
    if bias is not None:
        bias_arg = bias.to(out_dtype)
        if n16 != n:
            bias_arg = F.pad(bias_arg, (0, n16 - n))
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b.contiguous(), bias=bias_arg, out_dtype=out_dtype,
                           use_fast_accum=use_fast_accum)
    return out[:, :n].contiguous() if n16 != n else out


def _blockwise(a, a_scale_inv, b, b_scale_inv, b_tile, out_dtype, bias) -> Tensor:
    # torch's layouts (ScaledBlas.cpp): 1x128 scales of a outer-dim-major (M, K/128) with strides (1, M); b's 128x128
    # scales (K/128, N/128) with strides (1, K/128); b's 1x128 (along K) scales (K/128, N) row-major. Fast
    # accumulation is refused with 128x128 scales; a bias is added in float32 before the one rounding.
    scale_a = a_scale_inv.to(torch.float32).t().contiguous().t()
    scale_b = b_scale_inv.to(torch.float32)
    scale_b = scale_b.t().contiguous().t() if b_tile[1] != 1 else scale_b.contiguous()
    mm_dtype = torch.float32 if bias is not None else out_dtype
    out = torch._scaled_mm(_row_major(a), _col_major(b), scale_a=scale_a, scale_b=scale_b, out_dtype=mm_dtype,
                           use_fast_accum=False)
    if bias is not None:
        out = (out + bias.to(torch.float32)).to(out_dtype)
    return out


__all__ = ["fp8_gemm_tiled", "emulated_tiled_gemm", "scaled_mm_tiled", "scaled_mm_kind", "dequantized"]
