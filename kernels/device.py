"""Which code path a tensor takes on its device: the one place that asks the hardware.

Every dispatch decision of lightning-fp8 that depends on the device reads a `DeviceProfile`: Triton kernel or torch
reference, the CPU twins, the hardware FP8 cast or its integer emulation, `torch._scaled_mm` or the emulated GEMM,
and which scaling kinds the scaled GEMM takes (lightning_fp8/modules/scaled_mm.py). `profile_of(device)` asks the real
device.

Why a simulation: the CUDA branches (the casts CUDA runs, the argument preparation of every scaled GEMM, the
refusals per architecture) would otherwise be reachable only on a GPU. `simulate_cuda((9, 0))` makes CPU and meta
tensors take the paths CUDA takes on a GPU of that compute capability: the torch reference casts instead of the CPU
twins (or the Triton kernels, where the Triton interpreter runs them on CPU), the scaled-GEMM planning for that
architecture, and no host-side shortcut a real CPU may take. What cannot run on CPU is then checked without running
it: scaled-GEMM calls on meta tensors against torch's own checks, Triton kernels compiled for the architecture.
Simulation changes which code runs, never what a result means: values on CPU stay the emulation's, which equal the
GPU's up to summation order.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

#: compute capability from which CUDA GPUs have FP8 tensor cores and an FP8 convert instruction (Ada, sm89)
FP8_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class DeviceProfile:
    """What the code paths depend on about a device: its type, and for CUDA its compute capability."""

    type: str  # "cuda" | "cpu" | "meta" | ...
    capability: Optional[Tuple[int, int]] = None  # CUDA only
    simulated: bool = False  # a CPU / meta tensor taking the CUDA paths (simulate_cuda)
    #: simulated only: whether the simulated machine runs the Triton kernels (CPU tensors need the interpreter)
    triton: bool = True

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def fp8_tensor_cores(self) -> bool:
        """Whether `torch._scaled_mm` multiplies FP8 on this device (CUDA sm89+)."""
        return self.is_cuda and self.capability is not None and self.capability >= FP8_CAPABILITY

    @property
    def hardware_fp8_cast(self) -> bool:
        """Whether the device has an FP8 convert instruction (sm89+): Triton's `.to(tl.float8e4nv)` compiles there
        and nowhere below (sm80/86/87 reject it), so older GPUs take the kernels' integer rounding."""
        return self.is_cuda and self.capability is not None and self.capability >= FP8_CAPABILITY

    @property
    def host_checks_allowed(self) -> bool:
        """Whether code may read a value of this device's tensors on the host (`bool(t)`, `.item()`): free on a real
        CPU, a device-to-host synchronisation everywhere else (and in a simulated CUDA run, which must take the
        CUDA path)."""
        return self.type == "cpu" and not self.simulated

    @property
    def name(self) -> str:
        if self.is_cuda and self.capability is not None:
            major, minor = self.capability
            return f"sm{major}{minor}" + (" (simulated)" if self.simulated else "")
        return self.type


_simulated: Optional[DeviceProfile] = None


def simulated_profile() -> Optional[DeviceProfile]:
    """The CUDA profile CPU / meta tensors take while `simulate_cuda` is active, else None."""
    return _simulated


@contextlib.contextmanager
def simulate_cuda(capability: Tuple[int, int] = (9, 0), triton: bool = True) -> Iterator[DeviceProfile]:
    """Within this block, CPU and meta tensors take the code paths CUDA takes on a GPU of `capability` (see the
    module docstring); `triton=False` simulates a CUDA machine without triton (or LIGHTNING_FP8_DISABLE_TRITON=1),
    where every cast runs its torch reference. CPU tensors run the Triton kernels only under the Triton interpreter
    (TRITON_INTERPRET=1), else the reference. Not thread-local: meant for tests and offline checks, one simulation at
    a time."""
    global _simulated
    if _simulated is not None:
        raise RuntimeError(f"simulate_cuda: already simulating {_simulated.name}; simulations do not nest")
    major, minor = (int(v) for v in capability)
    profile = DeviceProfile("cuda", (major, minor), simulated=True, triton=bool(triton))
    _simulated = profile
    try:
        yield profile
    finally:
        _simulated = None


def profile_of(device) -> DeviceProfile:
    """The profile of `device` (a torch.device, a string, or a tensor's device)."""
    device = torch.device(device)
    if _simulated is not None and device.type in ("cpu", "meta"):
        return _simulated
    if device.type == "cuda":
        return _cuda_profile(device.index if device.index is not None else torch.cuda.current_device())
    return DeviceProfile(device.type)


@functools.lru_cache(maxsize=None)
def _cuda_profile(index: int) -> DeviceProfile:
    if not torch.cuda.is_available():
        return DeviceProfile("cuda")
    return DeviceProfile("cuda", tuple(torch.cuda.get_device_capability(index)))


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast disabled for `device`'s type: the kernels' float32 arithmetic stays float32 whatever region calls
    them. Nothing for meta tensors (which have no autocast; a launch trace runs the implementations on them)."""
    device = torch.device(device)
    if device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def runs_cuda_paths(x: torch.Tensor) -> bool:
    """Whether `x` takes the CUDA code paths: a CUDA tensor, or a CPU / meta tensor under `simulate_cuda`."""
    return profile_of(x.device).is_cuda
