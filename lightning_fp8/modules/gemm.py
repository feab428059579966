"""FP8 GEMM backends: torch's scaled GEMM where the GPU has FP8 tensor cores, emulation elsewhere.

Which GEMM runs (`run_gemm`, shared by the per-tensor op here and the tiled op in tiled_gemm.py): on a device with FP8
tensor cores (CUDA sm89+), the call `scaled_mm.plan_scaled_mm` prepares for that architecture (layouts, padding,
scale layouts, bias; lightning_fp8/modules/scaled_mm.py has the rules); where the architecture, the torch version or
the request rules that out, the emulation, with a one-time `FP8EmulationWarning` naming the reason, attributed to
the user's line that ran the layer.

Emulation is not a fake: its operands are real FP8 tensors. Every E4M3/E5M2 value is exact in float32 and in BF16,
so multiplying their images with float32 accumulation gives the FP8 GEMM's result up to summation order; the two
dequant scales are applied to the accumulator and the output is rounded once, as the scaled GEMM does. On CPU a
bf16-output GEMM with power-of-two scales runs as a BF16 GEMM where the CPU has BF16 hardware (exact for these
operands, see `_bf16_gemm`), the rest in float32.

The GEMM is registered as the custom op `lightning_fp8::fp8_gemm` (with a fake implementation), so
`torch.compile` traces it as one opaque node on every backend instead of breaking the graph on the backend
choice, the once-only warning or the layout fix-ups.

Under `kernels.device.simulate_cuda` (tests), CPU tensors take the CUDA branch: the call is planned for the simulated
architecture and run through torch's CPU scaled GEMM where that exists (tensorwise, rowwise), else emulated; every
requested GEMM can be recorded (`record_gemms`), planned for any architecture and replayed on meta tensors
(tests/test_cuda_contract.py).
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from lightning_fp8.kernels.device import DeviceProfile, autocast_off, profile_of
from lightning_fp8.modules.scaled_mm import GemmOperands, Refusal, ScaledMMCall, ScaledMMTarget, plan_scaled_mm

Tensor = torch.Tensor


class FP8EmulationWarning(UserWarning):
    """FP8 GEMMs are emulated (no FP8 tensor cores here): numerics are FP8, speed is not."""


#: keys of the emulation warnings given (each once per process)
_warned: set = set()


def scaled_mm_supported(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability 8.9 or newer), or a simulated one."""
    return profile_of(device).fp8_tensor_cores


def resolve_backend(requested: str, device: torch.device) -> str:
    """Pick "scaled_mm" or "emulated" for `device`; warn once per device kind when emulating."""
    profile = profile_of(device)
    if requested == "scaled_mm":
        if not profile.fp8_tensor_cores:
            raise RuntimeError(
                f"FP8Recipe(backend='scaled_mm') needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper), "
                f"but the tensors are on {device} ({profile.name}); use backend='auto' or 'emulated'."
            )
        return "scaled_mm"
    if requested == "emulated":
        return "emulated"
    if profile.fp8_tensor_cores:
        return "scaled_mm"
    warn_emulation(
        f"no FP8 tensor cores on {profile.name} (they need CUDA compute capability >= 8.9); "
        "FP8 GEMMs are emulated: operands are real FP8 casts, products run in float32. Numerics match FP8, "
        "speed does not.",
        key=("device", profile.name),
    )
    return "emulated"


def warn_emulation(message: str, key) -> None:
    """One FP8EmulationWarning per `key` for the process, attributed to the first frame outside this library, torch
    and the training frameworks: the user's line that ran the layer (or called backward / fit)."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"lightning_fp8: {message}", FP8EmulationWarning, stacklevel=_user_stacklevel())


#: packages whose frames a warning skips to reach the user's code
_LIBRARY_PACKAGES = ("lightning_fp8", "torch", "lightning", "lightning_fabric", "pytorch_lightning", "accelerate",
                     "transformers", "peft", "contextlib", "functools")


def _user_stacklevel() -> int:
    frame, level = sys._getframe(2), 2  # 1: warn_emulation's caller's frame is level 2 for warnings.warn
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _LIBRARY_PACKAGES:
            return level
        frame, level = frame.f_back, level + 1
    return 2


_recorders: List[List[GemmOperands]] = []


@contextlib.contextmanager
def record_gemms() -> Iterator[List[GemmOperands]]:
    """Every FP8 GEMM requested inside the block (per-tensor and tiled; real, fake or meta tensors), as the layer
    passed it: what the CUDA contract suite plans and checks per architecture (tests/test_cuda_contract.py)."""
    records: List[GemmOperands] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


def record(operands: GemmOperands) -> None:
    """Hand a GEMM request to the active `record_gemms` blocks (none: nothing happens)."""
    for records in _recorders:
        records.append(operands)


#: scaled-GEMM signatures torch or the GPU library refused at run time (then emulated), with the reason
_runtime_refusals: dict = {}


def run_gemm(operands: GemmOperands, backend: str, emulate: Callable[[GemmOperands], Tensor]) -> Tensor:
    """The FP8 GEMM `operands` asks for, on the scaled GEMM where the device takes it, else `emulate(operands)`."""
    profile = profile_of(operands.a.device)
    plan = None
    if resolve_backend(backend, operands.a.device) == "scaled_mm":
        plan = plan_scaled_mm(operands, ScaledMMTarget.of(profile))
    # the ops inside must run in the dtypes written here, whatever autocast region the op is called from
    with autocast_off(operands.a.device):
        if isinstance(plan, Refusal):
            if not plan.quiet:
                warn_emulation(f"{plan.reason}; this GEMM is emulated (exact FP8 values, float32 accumulation): "
                               "numerics are FP8, speed is not.", key=("plan", profile.name, plan.reason))
        elif isinstance(plan, ScaledMMCall) and (not profile.simulated or plan.runs_on_cpu
                                                 or operands.a.device.type == "meta"):
            out = _launch(plan, operands, profile)
            if out is not None:
                return out
        return emulate(operands)


def _launch(plan: ScaledMMCall, operands: GemmOperands, profile: DeviceProfile) -> Optional[Tensor]:
    """Run a planned call; None where torch or the GPU library refuses this exact signature (remembered, warned once,
    then emulated). Failures of the device itself (out of memory, a CUDA error) propagate: they say nothing about
    whether the call is supported, and a transient one must not turn a GEMM kind to emulation for the whole run."""
    key = _signature(plan, operands)
    if key in _runtime_refusals:
        return None
    try:
        return plan.launch()
    except _DEVICE_FAILURES:
        raise
    except (RuntimeError, NotImplementedError, ValueError) as error:
        if _is_device_failure(error):
            raise
        reason = f"torch refused this {plan.kind} scaled GEMM on {profile.name}: {str(error).splitlines()[0]}"
        _runtime_refusals[key] = reason
        warn_emulation(f"{reason}; such GEMMs are emulated (exact FP8 values, float32 accumulation).", key=key)
        return None


_DEVICE_FAILURES = tuple(t for t in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if t is not None)


def _is_device_failure(error: BaseException) -> bool:
    text = str(error)
    return "CUDA error" in text or "CUBLAS_STATUS_EXECUTION_FAILED" in text or "out of memory" in text


def _signature(plan: ScaledMMCall, operands: GemmOperands) -> Tuple:
    def spec(t: Optional[Tensor]):
        return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)

    return (plan.target, plan.api, plan.kind, spec(plan.mat_a), spec(plan.mat_b), spec(plan.scale_a),
            spec(plan.scale_b), spec(plan.bias), plan.out_dtype, plan.use_fast_accum, operands.out_dtype,
            operands.bias is not None)


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
    if _recorders:
        record(GemmOperands(a, a_scale_inv, None, b, b_scale_inv, None, out_dtype, bias, use_fast_accum))
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
    operands = GemmOperands(a, a_scale_inv, None, b, b_scale_inv, None, out_dtype, bias, use_fast_accum)
    return run_gemm(operands, backend, _emulate_tensorwise)


def _emulate_tensorwise(operands: GemmOperands) -> Tensor:
    return emulated_gemm(operands.a, operands.a_scale_inv, operands.b, operands.b_scale_inv, operands.out_dtype,
                         operands.bias)


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
    if (out_dtype == torch.bfloat16 and profile_of(a.device).host_checks_allowed and cpu_has_native_bf16()
            and _is_power_of_2(a_scale_inv) and _is_power_of_2(b_scale_inv)):
        return _bf16_gemm(a, a_scale_inv, b, b_scale_inv, bias)
    acc = torch.mm(_float32_image(a), _float32_image(b))
    out = acc * (a_scale_inv.to(torch.float32) * b_scale_inv.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def high_precision_gemm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b in the compute dtype: the weight-gradient GEMM of weight_grad="high_precision" (torchao's `*_with_gw_hp`).
    The operands in `out_dtype` (BF16 under autocast), products accumulated in float32, one rounding to `out_dtype`:
    a BF16 GEMM where the device multiplies BF16 natively (CUDA, a CPU with BF16 hardware), else the same operands
    multiplied in float32 and rounded once (equal up to summation order; an AVX2 CPU's BF16 GEMM is ~150x slower)."""
    a, b = a.to(out_dtype), b.to(out_dtype)
    if out_dtype != torch.float32 and a.device.type == "cpu" and not cpu_has_native_bf16():
        return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(out_dtype)
    return torch.mm(a, b)


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


__all__ = ["fp8_gemm", "emulated_gemm", "high_precision_gemm", "run_gemm", "record_gemms", "record", "warn_emulation", "cpu_has_native_bf16",
           "fp8_bf16_image", "resolve_backend", "scaled_mm_supported", "FP8EmulationWarning"]
