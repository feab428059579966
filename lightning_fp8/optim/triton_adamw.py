"""Fused Triton kernel for the FP8AdamW step (CUDA, opt-in: FP8AdamW(..., backend="triton")).

One launch steps every parameter of a param group that the kernel covers, per device (multi-tensor, as torch's
fused Adam): a Triton launch costs host time whatever its size, and a model has hundreds of parameters. The launch
gets a per-tensor table (int64: each tensor's addresses, numel and first block in the grid; float64: the step size and
sqrt of the second bias correction, which differ between tensors whose step counts differ), copied to the device in
one transfer; a program finds its tensor by a binary search over the first-block row (ceil(log2(n)) loads from a
table of a few KiB) and casts the addresses to typed pointers. Where every address is 16-byte aligned and every
numel a multiple of 16 (the usual case), ALIGNED tells the compiler so (what Triton's argument specialisation tells
a kernel launched per tensor), so loads and stores stay vectorised.

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
would store a NaN moment as -448 * s.

Division and square root use the correctly rounded forms (div_rn, sqrt_rn) as torch does on CUDA; scalar
coefficients (1 - beta1, 1 - lr * wd, ...) are computed in Python double precision as torch does, then passed.

One step from the same state matches the reference, NaN and inf gradients included: parameters to float32 rounding,
scales, and the stored codes. The multi-tensor launch is bit-identical to one launch per parameter (masked tails,
different step counts, NaN and inf in one tensor), and there is one launch per (param group, device).
"""
from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from lightning_fp8.kernels import use_soft_cast
from lightning_fp8.kernels.device_launch import announce, device_guard
from lightning_fp8.kernels.triton_cast import _fp8_code, _fp8_value, format_constexprs
from lightning_fp8.numerics.formats import E4M3
from lightning_fp8.optim import moment_storage as _state
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
    kernel free of NaN-dropping float min/max."""
    clamped = tl.minimum(tl.maximum(y, -FMT_MAX, propagate_nan=tl.PropagateNan.ALL), FMT_MAX,
                         propagate_nan=tl.PropagateNan.ALL)
    return tl.where(y != y, y, clamped)


#: rows of the per-tensor table the kernel reads (int64, [len(_TABLE_ROWS), n_tensors]): the tensors' addresses, each
#: tensor's element count, and the index of its first block in the launch's grid
_TABLE_ROWS = ("param", "grad", "exp_avg", "exp_avg_scale_inv", "exp_avg_sq", "exp_avg_sq_scale_inv", "numel",
               "first_block")
_PARAM, _GRAD, _M, _M_SINV, _V, _V_SINV, _NUMEL, _FIRST_BLOCK = (tl.constexpr(i) for i in range(len(_TABLE_ROWS)))


@triton.jit
def _fp8_adamw_block_kernel(
    table_ptr, coef_ptr, n_tensors, search_steps,
    one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, decay_factor,
    DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, V_FP8: tl.constexpr,
    M_MAX: tl.constexpr, V_MAX: tl.constexpr, BLOCK: tl.constexpr, FLT_MAX: tl.constexpr,
    FP8_DTYPE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, HAS_INF: tl.constexpr,
    HW_CAST: tl.constexpr, ALIGNED: tl.constexpr,
):
    # table_ptr: int64 [len(_TABLE_ROWS), n_tensors]; coef_ptr: float64 [2, n_tensors], each tensor's step size
    # (lr / bias_correction1) and sqrt(bias_correction2), which differ where the tensors' step counts do. The
    # moments hold E4M3 codes as uint8; the second one float16 unless V_FP8.
    pid = tl.program_id(0).to(tl.int64)
    # the tensor this block belongs to: the last one whose first block is <= pid, by binary search over the
    # non-decreasing first-block row (search_steps = ceil(log2(n_tensors)); every tensor has at least one block)
    first_row = table_ptr + _FIRST_BLOCK * n_tensors
    lo = pid * 0
    hi = lo + n_tensors
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        below = tl.load(first_row + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    t = lo
    block = pid - tl.load(first_row + t)
    numel = tl.load(table_ptr + _NUMEL * n_tensors + t)
    p_ptr = tl.load(table_ptr + _PARAM * n_tensors + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(table_ptr + _GRAD * n_tensors + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(table_ptr + _M * n_tensors + t).to(tl.pointer_type(tl.uint8))
    m_sinv_ptr = tl.load(table_ptr + _M_SINV * n_tensors + t).to(tl.pointer_type(tl.float32)) + block
    v_sinv_ptr = tl.load(table_ptr + _V_SINV * n_tensors + t).to(tl.pointer_type(tl.float32)) + block
    if V_FP8:
        v_ptr = tl.load(table_ptr + _V * n_tensors + t).to(tl.pointer_type(tl.uint8))
    else:
        v_ptr = tl.load(table_ptr + _V * n_tensors + t).to(tl.pointer_type(tl.float16))
    if ALIGNED:
        # every address 16-byte aligned and every numel a multiple of 16 (checked on the host): what Triton's
        # argument specialisation tells a kernel launched per tensor, so the loads and stores stay vectorised
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        numel = tl.multiple_of(numel, 16)
    step_size = tl.load(coef_ptr + t).to(tl.float32)
    bias_correction2_sqrt = tl.load(coef_ptr + n_tensors + t).to(tl.float32)

    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    m_code = tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = _fp8_value(m_code, FP8_DTYPE, MANT, BIAS, MAX_CODE, HAS_INF, HW_CAST) * tl.load(m_sinv_ptr)
    if V_FP8:
        v_code = tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32)
        root = _fp8_value(v_code, FP8_DTYPE, MANT, BIAS, MAX_CODE, HAS_INF, HW_CAST) * tl.load(v_sinv_ptr)
        v = root * root
    else:
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(v_sinv_ptr)

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
    tl.store(m_sinv_ptr, tl.math.div_rn(1.0, m_scale))
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
    tl.store(v_sinv_ptr, tl.math.div_rn(1.0, v_scale))


def supports(param: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> bool:
    """Whether the fused kernel covers this parameter (else the torch reference runs). The device is the caller's
    question (FP8AdamW asks for CUDA; the interpreter tests step CPU tensors)."""
    bs = group["block_size"]
    return (
        param.dtype == torch.float32
        and param.is_contiguous()
        and param.numel() > 0
        and param.grad is not None
        and param.grad.dtype == torch.float32
        and param.grad.is_contiguous()
        and group["master_weights"] == "fp32"
        and (group["exp_avg_sq_dtype"] == "fp16"
             or (group["exp_avg_sq_dtype"] == "fp8" and _state.FP8_SQRT_V_ROUNDING == "nearest"))
        and "exp_avg_scale_inv" in state
        and bs & (bs - 1) == 0
        and bs <= 8192
    )


def _float64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _launch_table(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], states: Sequence[Dict[str, Any]],
                  lr: float, beta1: float, beta2: float,
                  block_size: int) -> Tuple[torch.Tensor, torch.Tensor, int, bool]:
    """The kernel's per-tensor tables on the parameters' device, both views of one int64 [len(_TABLE_ROWS) + 2, n]
    tensor copied in one transfer: the int64 rows of `_TABLE_ROWS`, and float64 [2, n] (step size,
    sqrt(bias_correction2)); with the grid size and whether every address is 16-byte aligned and every numel a
    multiple of 16 (the kernel's ALIGNED)."""
    rows: List[List[int]] = [[] for _ in range(len(_TABLE_ROWS) + 2)]
    blocks = 0
    for p, g, s in zip(params, grads, states):
        step = float(s["step"])
        tensors = (p, g, s["exp_avg"], s["exp_avg_scale_inv"], s["exp_avg_sq"], s["exp_avg_sq_scale_inv"])
        for row, t in zip(rows, tensors):
            row.append(t.data_ptr())
        rows[6].append(p.numel())
        rows[7].append(blocks)
        # Python double precision as torch computes them; the kernel rounds each to float32 once, as Triton rounds
        # a float argument
        rows[8].append(_float64_bits(lr / (1 - beta1**step)))
        rows[9].append(_float64_bits((1 - beta2**step) ** 0.5))
        blocks += triton.cdiv(p.numel(), block_size)
    aligned = all(address % 16 == 0 for row in rows[:6] for address in row) and all(k % 16 == 0 for k in rows[6])
    # one host-to-device copy (from pinned memory, so the host does not wait for the device); on CPU the
    # interpreter reads the host table itself
    device = params[0].device
    table = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    return table, table[len(_TABLE_ROWS):].view(torch.float64), blocks, aligned


@torch.no_grad()
def adamw_multi_step_triton_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                             states: Sequence[Dict[str, Any]], group: Dict[str, Any], *,
                             hw_cast: Optional[bool] = None) -> None:
    """The fused twin of reference.adamw_step_ for several parameters of one param group on one device, in one
    launch (each `supports`-accepted; `grads[i]` is `params[i]`'s gradient); the kernel finds its tensor in a
    per-tensor table of addresses.
    Per-tensor values that may differ (step counts, hence the bias corrections) travel in the table; the group's
    hyperparameters are scalars. `hw_cast`: the FP8 conversion (None: the hardware cvt unless `use_soft_cast`, as
    the casts choose; the interpreter tests force either)."""
    if not params:
        return
    device = params[0].device
    if any(p.device != device for p in params):
        raise ValueError("adamw_multi_step_triton_ steps the tensors of one device per launch; group them by device")
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    v_fp8 = group["exp_avg_sq_dtype"] == "fp8"
    bs = group["block_size"]
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)  # CPU tensors, as in torch: one host op, no device sync
    table, coef, blocks, aligned = _launch_table(params, grads, states, lr, beta1, beta2, bs)
    exp_avg = [s["exp_avg"] for s in states]
    exp_avg_sq = [s["exp_avg_sq"] for s in states]
    scales = [s[k] for s in states for k in ("exp_avg_scale_inv", "exp_avg_sq_scale_inv")]
    with device_guard(table):
        if not announce("fp8_adamw", [table, *params, *grads, *exp_avg, *exp_avg_sq, *scales],
                        [*params, *exp_avg, *exp_avg_sq, *scales]):
            return
        _fp8_adamw_block_kernel[(blocks,)](
            table, coef, len(params), (len(params) - 1).bit_length(),
            1 - beta1, beta2, 1 - beta2, float(group["eps"]), wd, 1 - lr * wd,
            DECOUPLED=bool(group["decoupled_weight_decay"]), MAXIMIZE=bool(group["maximize"]), HAS_WD=wd != 0,
            V_FP8=v_fp8, M_MAX=E4M3.max, V_MAX=E4M3.max if v_fp8 else FP16_STORAGE.max, BLOCK=bs,
            FLT_MAX=torch.finfo(torch.float32).max,
            **format_constexprs(E4M3), HAS_INF=E4M3.has_inf,
            HW_CAST=not use_soft_cast(params[0]) if hw_cast is None else hw_cast, ALIGNED=aligned,
        )


def adamw_step_triton_(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any], *,
                       hw_cast: Optional[bool] = None) -> None:
    """One parameter's fused step: `adamw_multi_step_triton_` with a table of one tensor."""
    adamw_multi_step_triton_([param], [grad], [state], group, hw_cast=hw_cast)
