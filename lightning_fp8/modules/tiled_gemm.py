"""The GEMM of two tile-scaled FP8 operands (rowwise / blockwise recipes): `lightning_fp8::fp8_gemm_tiled`.

What it computes is defined once, in `numerics.tiles.tiled_gemm_reference`: per K block, the partial product of the
exact FP8 values accumulated in float32, scaled by its rows' and columns' dequant scales, summed in float32, plus
bias, rounded once. Which GEMM runs is decided as for the per-tensor op (`gemm.run_gemm`): torch's scaled GEMM on
GPUs whose architecture takes the scaling (rowwise: sm89+; DeepSeek-style blockwise 1x128 x 128x128 and 1x128 x
1x128: sm90; the rules and the scale layouts: lightning_fp8/modules/scaled_mm.py), else emulation with a one-time
FP8EmulationWarning naming why:

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

from typing import List, Optional, Sequence, Tuple

import torch

from lightning_fp8.kernels.device import profile_of
from lightning_fp8.modules import gemm
from lightning_fp8.modules.gemm import cpu_has_native_bf16, fp8_bf16_image, run_gemm
from lightning_fp8.modules.scaled_mm import GemmOperands
from lightning_fp8.numerics.tiles import exact_in_bf16, tiled_gemm_reference, times_tiles

Tensor = torch.Tensor


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
    if gemm._recorders:
        gemm.record(GemmOperands(a, a_scale_inv, _tile(a_tile), b, b_scale_inv, _tile(b_tile), out_dtype, bias,
                                 use_fast_accum))
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
    operands = GemmOperands(a, a_scale_inv, _tile(a_tile), b, b_scale_inv, _tile(b_tile), out_dtype, bias,
                            use_fast_accum)
    return run_gemm(operands, backend, _emulate_tiled)


def _tile(tile: Sequence[int]) -> Tuple[int, int]:
    return int(tile[0]), int(tile[1])


def _emulate_tiled(operands: GemmOperands) -> Tensor:
    return emulated_tiled_gemm(operands.a, operands.a_scale_inv, operands.a_tile, operands.b, operands.b_scale_inv,
                               operands.b_tile, operands.out_dtype, operands.bias)


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
    host = profile_of(a.device).host_checks_allowed  # a real CPU: reading the scales costs no synchronisation
    if host and not (exact_in_bf16(a_scale_inv) and exact_in_bf16(b_scale_inv)):
        return tiled_gemm_reference(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias)
    if bf16 is None:
        bf16 = cpu_has_native_bf16()
    if out_dtype == torch.bfloat16 and host and bf16:
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


__all__ = ["fp8_gemm_tiled", "emulated_tiled_gemm", "dequantized"]
