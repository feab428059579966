"""The FP8 GEMM: `fp8_gemm(a, b, out_dtype, ...)`, one `torch.library` custom op (`lightning_fp8::fp8_gemm`) for
every scaling, and which implementation runs it.

Where the device has FP8 tensor cores (CUDA sm89+), the call `scaled_mm.plan_scaled_mm` prepares for that
architecture runs (torch's scaled GEMM). Where the planner knows in advance that the architecture, the torch version
or the request rules it out, the GEMM is emulated (modules/emulation.py) after a one-time `FP8EmulationWarning`
naming the reason. A planned call that torch refuses at run time is a planner bug or a torch / cuBLASLt the rules do
not describe: it raises `FP8GemmRefusedError` naming the call, unless the recipe opts in to emulate it
(`FP8Recipe(allow_emulation=True)`). Without FP8 tensor cores (CPU, older GPUs) every GEMM is emulated. The backends
that reproduce a specific GPU's bits on any device (`FP8Recipe(backend="h100")`, "rtx4060") compute the call planned
for that GPU through its model (modules/gpu_model.py).

Being one custom op with a fake implementation, `torch.compile` traces the GEMM as one opaque node whatever the
backend, and a count of dispatched ops counts GEMM launches.

Under `kernels.device.simulate_cuda` (tests), CPU tensors take the CUDA branch: the call is planned for the simulated
architecture and run through torch's CPU scaled GEMM where that exists (tensorwise, rowwise), else emulated; every
requested GEMM can be recorded (`record_gemms`) to be planned for any architecture and replayed on meta tensors.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Iterator, List, Optional, Sequence

import torch

from lightning_fp8.kernels.device import autocast_off, profile_of
from lightning_fp8.modules.emulation import cpu_has_native_bf16, emulate, emulate_grouped
from lightning_fp8.modules.gpu_model import MODELLED_GPUS, run_on_gpu_model
from lightning_fp8.modules.operand import FP8Matrix, GemmRequest
from lightning_fp8.modules.scaled_mm import Refusal, ScaledMMCall, ScaledMMTarget, plan_scaled_mm

Tensor = torch.Tensor


class FP8EmulationWarning(UserWarning):
    """FP8 GEMMs are emulated (no FP8 tensor cores here, or a GEMM the GPU cannot take): numerics are FP8, speed is
    not."""


class FP8GemmRefusedError(RuntimeError):
    """torch refused a scaled-GEMM call that the planner issued for this GPU (see `FP8Recipe.allow_emulation`)."""


#: keys of the emulation warnings given (each once per process)
_warned: set = set()


def resolve_backend(requested: str, device: torch.device) -> str:
    """"scaled_mm", "emulated" or a modelled GPU ("h100", "rtx4060": modules/gpu_model.py) for `device` under
    FP8Recipe.backend `requested`; warns once per device kind when "auto" emulates, and raises when "scaled_mm" is
    asked of a device without FP8 tensor cores."""
    if requested in MODELLED_GPUS:
        return requested
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
    and the training frameworks (the user's line that ran the layer)."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"lightning_fp8: {message}", FP8EmulationWarning, stacklevel=_user_stacklevel())


#: packages whose frames a warning skips to reach the user's code
_LIBRARY_PACKAGES = ("lightning_fp8", "torch", "lightning", "lightning_fabric", "pytorch_lightning", "accelerate",
                     "transformers", "peft", "contextlib", "functools")


def _user_stacklevel() -> int:
    frame, level = sys._getframe(2), 2
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _LIBRARY_PACKAGES:
            return level
        frame, level = frame.f_back, level + 1
    return 2


# -- recording requests (the CUDA contract suite) ---------------------------------------------------------------------
_recorders: List[List[GemmRequest]] = []


@contextlib.contextmanager
def record_gemms() -> Iterator[List[GemmRequest]]:
    """Every FP8 GEMM requested inside the block (real, fake or meta tensors), as the layer passed it."""
    records: List[GemmRequest] = []
    _recorders.append(records)
    try:
        yield records
    finally:
        _recorders.remove(records)


# -- the op -----------------------------------------------------------------------------------------------------------
def fp8_gemm(
    a: FP8Matrix,
    b: FP8Matrix,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    use_fast_accum: bool = False,
    backend: str = "auto",
    allow_emulation: bool = False,
    *,
    offsets: Optional[Tensor] = None,
) -> Tensor:
    """out = A @ B + bias for A (M, K) and B (K, N) with their scales (FP8Matrix), rounded once to out_dtype.

    backend: FP8Recipe.backend ("auto", "scaled_mm", "emulated", "h100", "rtx4060"); allow_emulation:
    FP8Recipe.allow_emulation (module docstring). offsets: a grouped GEMM's groups (GemmRequest.offsets: B (E, K, N)
    over A's grouped rows, or a grouped contraction giving (E, M, N)). The op has no autograd formula: the layers'
    autograd function computes every gradient itself."""
    if _recorders:
        for records in _recorders:
            records.append(GemmRequest(a, b, out_dtype, bias, use_fast_accum, offsets))
    return torch.ops.lightning_fp8.fp8_gemm(
        a.data, a.scale_inv, _tile_arg(a.tile), a.tensor_scale, b.data, b.scale_inv, _tile_arg(b.tile),
        b.tensor_scale, out_dtype, bias, use_fast_accum, backend, allow_emulation, offsets,
    )


def _tile_arg(tile) -> List[int]:
    return [] if tile is None else [int(tile[0]), int(tile[1])]


def _tile(arg: Sequence[int]):
    return None if len(arg) == 0 else (int(arg[0]), int(arg[1]))


@torch.library.custom_op("lightning_fp8::fp8_gemm", mutates_args=())
def _fp8_gemm_op(
    a: Tensor,
    a_scale_inv: Tensor,
    a_tile: List[int],
    a_tensor_scale: Optional[Tensor],
    b: Tensor,
    b_scale_inv: Tensor,
    b_tile: List[int],
    b_tensor_scale: Optional[Tensor],
    out_dtype: torch.dtype,
    bias: Optional[Tensor],
    use_fast_accum: bool,
    backend: str,
    allow_emulation: bool,
    offsets: Optional[Tensor] = None,
) -> Tensor:
    # the body of the op is the whole GEMM (torch.library takes flat tensors, so `fp8_gemm` above flattens the
    # operands and this rebuilds them): the planned scaled GEMM where the device takes it, else the emulation
    request = GemmRequest(FP8Matrix(a, a_scale_inv, _tile(a_tile), a_tensor_scale),
                          FP8Matrix(b, b_scale_inv, _tile(b_tile), b_tensor_scale), out_dtype, bias, use_fast_accum,
                          offsets)
    device = request.a.data.device
    profile = profile_of(device)
    plan = None
    resolved = resolve_backend(backend, device)
    if resolved == "scaled_mm":
        plan = plan_scaled_mm(request, ScaledMMTarget.of(profile))
    # the ops inside run in the dtypes written here, whatever autocast region the op is called from
    with autocast_off(device):
        if resolved in MODELLED_GPUS:
            return run_on_gpu_model(request, resolved)
        if isinstance(plan, Refusal):
            if not plan.quiet:
                warn_emulation(f"{plan.reason}; this GEMM is emulated (exact FP8 values, float32 accumulation): "
                               "numerics are FP8, speed is not.", key=("plan", profile.name, plan.reason))
        elif isinstance(plan, ScaledMMCall) and (not profile.simulated or plan.runs_on_cpu or device.type == "meta"):
            out = _launch(plan, allow_emulation)
            if out is not None:
                return out
        return emulate_grouped(request) if request.offsets is not None else emulate(request)


@_fp8_gemm_op.register_fake
def _fp8_gemm_fake(a, a_scale_inv, a_tile, a_tensor_scale, b, b_scale_inv, b_tile, b_tensor_scale, out_dtype, bias,
                   use_fast_accum, backend, allow_emulation, offsets=None):
    torch._check(a.dim() == 2 and b.dim() in (2, 3), lambda: "fp8_gemm expects a 2-D A and a 2-D or 3-D B")
    torch._check(a.shape[1] == b.shape[-2], lambda: f"fp8_gemm: inner dimensions differ: {a.shape} @ {b.shape}")
    if b.dim() == 3:
        torch._check(offsets is not None, lambda: "fp8_gemm: a 3-D B needs offsets (one group per matrix)")
        return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)
    if offsets is not None:  # a grouped contraction: one output matrix per group
        return a.new_empty((offsets.shape[0], a.shape[0], b.shape[1]), dtype=out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


#: signatures of planned calls torch refused at run time and that are emulated by opt-in, with the reason
_emulated_refusals: dict = {}


def _launch(plan: ScaledMMCall, allow_emulation: bool) -> Optional[Tensor]:
    """Run a planned call. Where torch refuses it: FP8GemmRefusedError naming the call, or, with allow_emulation,
    None (the caller emulates; the signature is remembered and warned about once). Failures of the device itself
    (out of memory, a CUDA error) propagate as they are: they say nothing about the call."""
    key = plan.signature()
    if key in _emulated_refusals:
        return None
    try:
        return plan.launch()
    except _DEVICE_FAILURES:
        raise
    except (RuntimeError, NotImplementedError, ValueError) as error:
        if _is_device_failure(error):
            raise
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if not allow_emulation:
            raise FP8GemmRefusedError(
                f"lightning_fp8: torch refused the {plan.describe()} that lightning_fp8 planned for "
                f"{plan.target.name}: {message}. This is a lightning_fp8 planning rule that does not hold for this "
                f"torch / cuBLASLt (please report it with this message). To train anyway with such GEMMs emulated "
                f"(exact FP8 values, float32 products, many times slower), use FP8Recipe(allow_emulation=True)."
            ) from error
        reason = f"torch refused the {plan.describe()} on {plan.target.name}: {message}"
        _emulated_refusals[key] = reason
        warn_emulation(f"{reason}; such GEMMs are emulated (FP8Recipe(allow_emulation=True)).", key=key)
        return None


_DEVICE_FAILURES = tuple(t for t in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if t is not None)


def _is_device_failure(error: BaseException) -> bool:
    text = str(error)
    return "CUDA error" in text or "CUBLAS_STATUS_EXECUTION_FAILED" in text or "out of memory" in text


# -- the weight gradient in the compute dtype -------------------------------------------------------------------------
def high_precision_gemm(a: Tensor, b: Tensor, out_dtype: torch.dtype, offsets: Optional[Tensor] = None) -> Tensor:
    """a @ b in the compute dtype: the weight-gradient GEMM of FP8Recipe(weight_grad="high_precision"). The operands
    in `out_dtype` (BF16 under autocast), products accumulated in float32, one rounding: a BF16 GEMM where the device
    multiplies BF16 natively, else the same operands multiplied in float32 and rounded once (equal up to summation
    order; a CPU without BF16 hardware runs BF16 GEMMs in a slow software fallback). offsets: a grouped contraction
    (an experts layer's weight gradient: one (M, N) product per group of a's columns and b's rows)."""
    a, b = a.to(out_dtype), b.to(out_dtype)
    software_bf16 = out_dtype != torch.float32 and a.device.type == "cpu" and not cpu_has_native_bf16()
    if offsets is not None:
        if software_bf16 or out_dtype not in (torch.bfloat16, torch.float32):  # torch's grouped GEMM: bf16, float32
            return torch._grouped_mm(a.to(torch.float32), b.to(torch.float32), offs=offsets).to(out_dtype)
        return torch._grouped_mm(a, b, offs=offsets)
    if software_bf16:
        return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(out_dtype)
    return torch.mm(a, b)
