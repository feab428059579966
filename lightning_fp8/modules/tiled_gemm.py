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

The microscaled GEMMs (MXFP8: E8M0 scales; NVFP4: packed FP4 operands, E4M3 block scales and a float32 tensor scale
per operand, `a_tensor_scale` / `b_tensor_scale`) go through the same op; their definition is
`numerics.microscaling.gemm_reference`. Their emulation dequantizes exactly as well: an MX value is an FP8 value
times a power of two, an NVFP4 value an FP4 value (two significant bits) times an E4M3 scale (four), exact in BF16
and in float32, and the tensor scales multiply the float32 accumulator before the one rounding, as cuBLASLt does.

Registered as a custom op with a fake implementation, so `torch.compile` traces it as one node.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from lightning_fp8.kernels.device import profile_of
from lightning_fp8.modules import gemm
from lightning_fp8.modules.gemm import cpu_has_native_bf16, fp8_bf16_image, run_gemm
from lightning_fp8.modules.scaled_mm import GemmOperands
from lightning_fp8.numerics import microscaling
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
    a_tensor_scale: Optional[Tensor] = None,
    b_tensor_scale: Optional[Tensor] = None,
) -> Tensor:
    """out = dequant(a) @ dequant(b) + bias for FP8 a (M, K) with tiles `a_tile` = (rows, K block) and b (K, N)
    with tiles `b_tile` = (K block, cols), any layout; scales are per-tile dequant scales in grid layout
    (`numerics.tiles.grid_shape`): float32, or E8M0 (MXFP8), or E4M3 with the operands' float32 tensor scales
    (NVFP4, packed FP4 operands: a (M, K/2), b (K/2, N)). No autograd formula: the layer's autograd function owns the
    gradients."""
    if gemm._recorders:
        gemm.record(GemmOperands(a, a_scale_inv, _tile(a_tile), b, b_scale_inv, _tile(b_tile), out_dtype, bias,
                                 use_fast_accum, a_tensor_scale, b_tensor_scale))
    return torch.ops.lightning_fp8.fp8_gemm_tiled(
        a, a_scale_inv, [int(v) for v in a_tile], b, b_scale_inv, [int(v) for v in b_tile], out_dtype, bias,
        use_fast_accum, backend, a_tensor_scale, b_tensor_scale,
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
    a_tensor_scale: Optional[Tensor] = None,
    b_tensor_scale: Optional[Tensor] = None,
) -> Tensor:
    operands = GemmOperands(a, a_scale_inv, _tile(a_tile), b, b_scale_inv, _tile(b_tile), out_dtype, bias,
                            use_fast_accum, a_tensor_scale, b_tensor_scale)
    return run_gemm(operands, backend, _emulate_tiled)


def _tile(tile: Sequence[int]) -> Tuple[int, int]:
    return int(tile[0]), int(tile[1])


def _emulate_tiled(operands: GemmOperands) -> Tensor:
    if operands.a.dtype == microscaling.E2M1.dtype or operands.a_scale_inv.dtype == microscaling.E8M0:
        return emulated_microscaled_gemm(operands)
    return emulated_tiled_gemm(operands.a, operands.a_scale_inv, operands.a_tile, operands.b, operands.b_scale_inv,
                               operands.b_tile, operands.out_dtype, operands.bias)


@_fp8_gemm_tiled_op.register_fake
def _fp8_gemm_tiled_fake(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, out_dtype, bias, use_fast_accum, backend,
                         a_tensor_scale=None, b_tensor_scale=None):
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


def emulated_microscaled_gemm(operands: GemmOperands, bf16: Optional[bool] = None) -> Tensor:
    """An MXFP8 / NVFP4 GEMM without their tensor cores (module docstring): each operand's exact values times its
    block scales, one GEMM with float32 accumulation, times the tensor scales (NVFP4), plus bias, rounded once. The
    same as `numerics.microscaling.gemm_reference` up to summation order (where no dequantized value leaves BF16's
    exponent range: MX scales within 2^+-100, which the layer's values never leave; otherwise the per-block
    definition runs)."""
    a, b = operands.a, operands.b
    host = profile_of(a.device).host_checks_allowed
    mx = a.dtype != microscaling.E2M1.dtype
    if mx and host and not (exact_in_bf16(operands.a_scale_inv.float()) and exact_in_bf16(operands.b_scale_inv.float())):
        return microscaling.gemm_reference(a, operands.a_scale_inv, operands.a_tile, b, operands.b_scale_inv,
                                           operands.b_tile, operands.out_dtype, operands.bias)
    if bf16 is None:
        bf16 = cpu_has_native_bf16()
    # NVFP4 multiplies the accumulator by its tensor scales before the one rounding: a float32 GEMM
    dtype = torch.bfloat16 if (mx and host and bf16 and operands.out_dtype == torch.bfloat16) else torch.float32
    a_values, b_values = _microscaled_values(a, 1, dtype), _microscaled_values(b, 0, dtype)
    k = min(a_values.shape[1], b_values.shape[0])  # an odd K: the packed operands' zero padding, dropped
    a_img = times_tiles(a_values[:, :k], operands.a_scale_inv.to(dtype), operands.a_tile)
    b_img = times_tiles(b_values[:k, :], operands.b_scale_inv.to(dtype), operands.b_tile)
    if mx and dtype == torch.bfloat16:  # the FP8 path's exact BF16 GEMM (bias added before the one rounding)
        return torch.mm(a_img, b_img) if operands.bias is None else torch.addmm(
            operands.bias.to(torch.bfloat16), a_img, b_img)
    out = torch.mm(a_img, b_img).to(torch.float32)
    if not mx:
        out = out * microscaling._tensor_scale_product(operands.a_tensor_scale, operands.b_tensor_scale, out)
    if operands.bias is not None:
        out = out + operands.bias.to(torch.float32)
    return out.to(operands.out_dtype)


def _microscaled_values(x: Tensor, contraction_dim: int, dtype: torch.dtype) -> Tensor:
    if x.dtype == microscaling.E2M1.dtype:
        return microscaling.operand_values(x, contraction_dim).to(dtype)
    return (fp8_bf16_image(x) if x.device.type == "cpu" else x).to(dtype)


__all__ = ["fp8_gemm_tiled", "emulated_tiled_gemm", "emulated_microscaled_gemm", "dequantized"]
