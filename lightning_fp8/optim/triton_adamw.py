"""Fused Triton kernel for the FP8AdamW step of one parameter (CUDA, opt-in: FP8AdamW(..., backend="triton")).

One program per quantization block: it reads the parameter, the gradient and the block's stored moments once,
does the AdamW math in float32 (the same formula and order as reference.py), writes the parameter, and
re-quantizes the moments with the block's new amax, which it has in registers, so the scale costs no extra pass.
The torch reference (reference.py) is the definition; this kernel must match it up to float32 rounding of the
fused multiply-adds (which can move a stored FP8 code by one step now and then).

Covered: float32 parameters (master_weights="fp32"), exp_avg_sq_dtype "fp16" (and "fp8" with the ablation
switch state.FP8_SQRT_V_ROUNDING = "nearest"; the kernel rounds sqrt(v) to nearest), block_size a power of two
<= 8192, contiguous tensors. Everything else (stochastically rounded second moments and low-precision master
weights, which draw from the seeded torch generator; CPU tensors) falls back to the torch reference per
parameter, so the two backends produce the same results wherever they both apply.

The FP8 moments are read and written as their uint8 codes and converted by the cast kernel's helpers
(kernels/triton_cast.py), chosen as for the casts (`lightning_fp8.kernels.use_soft_cast`): the hardware cvt where it
compiles and rounds like the reference (sm90+, sm89 with Triton >= 3.9), the exact integer rounding elsewhere. sm80/86/87 (A100, A10, RTX 30xx)
cannot compile an e4m3 conversion at all, so without the integer variant the kernel would not run there.

Non-finite values are kept as the reference keeps them: a NaN moment stays NaN, a block holding NaN or inf gets
scale 1 (`_block_scale`: an integer max over the bit patterns, as the cast kernel's amax; `_saturate`: NaN
selected around the clamp). Float tl.max / tl.maximum / tl.minimum return the other operand for a NaN on a GPU, which
stored a NaN moment as -448 * s before.

Division and square root use the correctly rounded forms (div_rn, sqrt_rn) as torch does on CUDA; scalar
coefficients (1 - beta1, 1 - lr * wd, ...) are computed in Python double precision as torch does, then passed.

Verification status: NOT run on a GPU (none was available while writing it). Under the Triton interpreter on
CPU (tests/test_optim.py::test_interp_fused_adamw_step_matches_reference) one step from the same state matches the
reference, also with NaN and inf gradients: parameters to float32 rounding, scales, and the stored codes (with the
hardware-conversion variant, except where the interpreter's own float8 conversion mis-rounds: it halves values
that should round up to a power of two, see docs/numerics.md). The hardware float8 conversion is checked by
tests/test_optim.py -m cuda only; tests/test_triton_compile.py compiles both variants for every architecture.
Launches are per parameter, not one multi-tensor launch; that is the next step if the launch count shows up.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import triton
import triton.language as tl

from lightning_fp8.kernels import use_soft_cast
from lightning_fp8.kernels.launch import device_guard
from lightning_fp8.kernels.triton_cast import _fp8_code, _fp8_value, format_constexprs
from lightning_fp8.numerics.formats import E4M3
from lightning_fp8.optim import state as _state
from lightning_fp8.optim.blockwise import FP16_STORAGE


@triton.jit
def _block_scale(values, mask, FMT_MAX: tl.constexpr, FLT_MAX: tl.constexpr):
    """The block's quantization scale, blockwise.quantize_blockwise's rule: FMT_MAX / amax, 1 for a block that is all
    zeros or holds inf or NaN. The amax is a max over the float32 bit patterns with the sign cleared, as integers (the
    cast kernel's way): for non-negative floats integer order is float order and every NaN sorts above inf, so NaN
    propagates like torch.amax; a float tl.max drops NaN on a GPU."""
    bits = tl.where(mask, values.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    amax = tl.max(bits, axis=0).to(tl.float32, bitcast=True)
    ok = (amax > 0) & (amax < float("inf"))
    scale = tl.minimum(tl.math.div_rn(FMT_MAX, tl.where(ok, amax, 1.0)), FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(ok, scale, 1.0)


@triton.jit
def _saturate(y, FMT_MAX: tl.constexpr):
    """Clamp to +-FMT_MAX with NaN kept, bit for bit (numerics.quantize.saturate): on a GPU tl.minimum / tl.maximum
    return the other operand for a NaN, so NaN is selected around them; the NaN-propagating forms keep the compiled
    kernel free of NaN-dropping float min/max (tests/test_triton_compile.py reads its PTX)."""
    clamped = tl.minimum(tl.maximum(y, -FMT_MAX, propagate_nan=tl.PropagateNan.ALL), FMT_MAX,
                         propagate_nan=tl.PropagateNan.ALL)
    return tl.where(y != y, y, clamped)


@triton.jit
def _fp8_adamw_block_kernel(
    p_ptr, g_ptr, m_ptr, m_sinv_ptr, v_ptr, v_sinv_ptr,
    numel,
    one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor, step_size, bias_correction2_sqrt,
    DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, V_FP8: tl.constexpr,
    M_MAX: tl.constexpr, V_MAX: tl.constexpr, BLOCK: tl.constexpr, FLT_MAX: tl.constexpr,
    FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, HAS_INF: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    # m_ptr (and v_ptr when V_FP8) hold E4M3 codes as uint8; v_ptr holds float16 otherwise
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    m_code = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = _fp8_value(m_code, FP8_DTYPE, MANT, BIAS, MAX_CODE, HAS_INF, HW_CAST) * tl.load(m_sinv_ptr + pid)
    if V_FP8:
        v_code = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
        root = _fp8_value(v_code, FP8_DTYPE, MANT, BIAS, MAX_CODE, HAS_INF, HW_CAST) * tl.load(v_sinv_ptr + pid)
        v = root * root
    else:
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(v_sinv_ptr + pid)

    if HAS_WD:
        if DECOUPLED:
            p = p * decay_factor
        else:
            g = g + weight_decay * p
    m = m + one_minus_beta1 * (g - m)  # torch's lerp(m, g, w) for w < 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.math.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.math.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)

    # re-quantize the moments: scale = max / amax (1 for an all-zero or non-finite block), saturate, cast; NaN stays
    # NaN throughout, as in the reference
    m_scale = _block_scale(m, mask, M_MAX, FLT_MAX)
    m_q = _saturate(m * m_scale, M_MAX)
    tl.store(m_ptr + offs, _fp8_code(m_q, FP8_DTYPE, MANT, BIAS, HW_CAST).to(tl.uint8), mask=mask)
    tl.store(m_sinv_ptr + pid, tl.math.div_rn(1.0, m_scale))
    if V_FP8:
        vs = tl.sqrt_rn(v)
    else:
        vs = v
    v_scale = _block_scale(vs, mask, V_MAX, FLT_MAX)
    v_q = _saturate(vs * v_scale, V_MAX)
    if V_FP8:
        tl.store(v_ptr + offs, _fp8_code(v_q, FP8_DTYPE, MANT, BIAS, HW_CAST).to(tl.uint8), mask=mask)
    else:
        tl.store(v_ptr + offs, v_q.to(tl.float16), mask=mask)
    tl.store(v_sinv_ptr + pid, tl.math.div_rn(1.0, v_scale))


def supports(param: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> bool:
    """Whether the fused kernel covers this parameter (else the torch reference runs)."""
    bs = group["block_size"]
    return (
        param.is_cuda
        and param.dtype == torch.float32
        and param.is_contiguous()
        and param.grad is not None
        and param.grad.is_contiguous()
        and group["master_weights"] == "fp32"
        and (group["exp_avg_sq_dtype"] == "fp16"
             or (group["exp_avg_sq_dtype"] == "fp8" and _state.FP8_SQRT_V_ROUNDING == "nearest"))
        and "exp_avg_scale_inv" in state
        and bs & (bs - 1) == 0
        and bs <= 8192
    )


@torch.no_grad()
def adamw_step_triton_(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], *,
                       hw_cast: Optional[bool] = None) -> None:
    """The fused twin of reference.adamw_step_ for a parameter `supports` accepts. `hw_cast`: the FP8 conversion
    (None: the hardware cvt unless `use_soft_cast(param)`, as the casts choose; the interpreter tests force either)."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    state["step"] += 1
    step = float(state["step"])  # CPU tensor: no device sync
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    wd = float(group["weight_decay"])
    v_fp8 = group["exp_avg_sq_dtype"] == "fp8"
    numel = param.numel()
    bs = group["block_size"]
    grid = (triton.cdiv(numel, bs),)
    exp_avg_sq = state["exp_avg_sq"].view(torch.uint8) if v_fp8 else state["exp_avg_sq"]
    with device_guard(param):
        _fp8_adamw_block_kernel[grid](
            param, grad, state["exp_avg"].view(torch.uint8), state["exp_avg_scale_inv"], exp_avg_sq,
            state["exp_avg_sq_scale_inv"],
            numel,
            1 - beta1, beta2, 1 - beta2, float(group["eps"]), wd, 1 - lr * wd, lr / bias_correction1,
            bias_correction2**0.5,
            DECOUPLED=bool(group["decoupled_weight_decay"]), MAXIMIZE=bool(group["maximize"]), HAS_WD=wd != 0,
            V_FP8=v_fp8, M_MAX=E4M3.max, V_MAX=E4M3.max if v_fp8 else FP16_STORAGE.max, BLOCK=bs,
            FLT_MAX=torch.finfo(torch.float32).max,
            **format_constexprs(E4M3), HAS_INF=E4M3.has_inf,
            HW_CAST=not use_soft_cast(param) if hw_cast is None else hw_cast,
        )


__all__ = ["supports", "adamw_step_triton_"]
