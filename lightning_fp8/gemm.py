"""FP8 GEMM backends: `torch._scaled_mm` where the hardware has FP8 tensor cores, emulation elsewhere.

Emulation is not a fake: its operands are real FP8 tensors. Every E4M3/E5M2 value is exact in float32, so
converting them and multiplying in float32 gives the FP8 GEMM's result up to summation order; the two dequant scales
are applied to the float32 accumulator and the output is rounded once, as `_scaled_mm` does.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F


class FP8EmulationWarning(UserWarning):
    """FP8 GEMMs are emulated (no FP8 tensor cores here): numerics are FP8, speed is not."""


_warned_devices: set = set()


def scaled_mm_supported(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability 8.9 or newer)."""
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
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """out = (a * a_scale_inv) @ (b * b_scale_inv) + bias, for FP8 `a` (M, K) and `b` (K, N) in any layout."""
    resolved = resolve_backend(backend, a.device)
    if resolved == "scaled_mm" and b.shape[1] % 16 == 0:  # K is padded below; N cannot be
        return _scaled_mm_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum)
    return emulated_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)


def emulated_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias=None) -> torch.Tensor:
    """float32 product of the exact float32 images of the FP8 operands, scaled once, rounded once."""
    acc = torch.mm(a.to(torch.float32), b.to(torch.float32))
    out = acc * (a_scale_inv * b_scale_inv)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _scaled_mm_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, use_fast_accum) -> torch.Tensor:
    # _scaled_mm wants `a` row-major and `b` column-major; the inner dimension a multiple of 16 (zero padding is
    # exact: padded products are zero).
    k = a.shape[1]
    pad = (-k) % 16
    if pad:
        a = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
        b = F.pad(b.view(torch.uint8).t(), (0, pad)).view(b.dtype).t()
    a = a.contiguous()
    if not (b.stride(0) == 1 and b.stride(1) == b.shape[0]):
        b = b.t().contiguous().t()
    bias_arg = bias.to(out_dtype) if (bias is not None and out_dtype != torch.float32) else None
    out = torch._scaled_mm(
        a,
        b,
        scale_a=a_scale_inv.to(torch.float32).reshape(()),
        scale_b=b_scale_inv.to(torch.float32).reshape(()),
        bias=bias_arg,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )
    if bias is not None and bias_arg is None:
        out = out + bias.to(out_dtype)
    return out
