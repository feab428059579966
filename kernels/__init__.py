"""Device kernels of lightning-fp8 (shipped as `lightning_fp8.kernels`): the FP8 casts as torch custom ops.

Importing this package never imports triton: the Triton kernels load on first use, only where triton is importable.
Without triton (or without CUDA) every op runs its torch twin, defined by `lightning_fp8.numerics`.

Switches (environment variables, read at call time):
  LIGHTNING_FP8_DISABLE_TRITON=1   never use the Triton kernels (the torch reference everywhere)
  LIGHTNING_FP8_SOFT_CAST=1        use the kernels' exact integer FP8 rounding instead of the hardware cvt
  LIGHTNING_FP8_CPU_REFERENCE=1    run the torch reference on CPU instead of the CPU twins (kernels/cpu_kernels.py)
  LIGHTNING_FP8_TRITON_RAND=1      stochastic rounding draws its noise inside the kernel (tl.rand) instead of
                                   reading a torch.rand tensor: saves 8 bytes/element, not bit-identical to the
                                   reference path
  TRITON_INTERPRET=1               (triton's own) kernels run on CPU tensors in triton's interpreter; used by the
                                   CPU tests. Must be set before the kernels are first imported.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from lightning_fp8.kernels.device import profile_of, simulated_profile

#: dtypes the cast kernels read (anything else goes through the reference)
KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when `import triton` works here (it is not a dependency of lightning-fp8)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return True


def triton_disabled() -> bool:
    return _env_flag("LIGHTNING_FP8_DISABLE_TRITON")


def interpreter_enabled() -> bool:
    return _env_flag("TRITON_INTERPRET")


def triton_enabled_for(x: torch.Tensor) -> bool:
    """Whether the ops run `x` through the Triton kernel: a dtype the kernel reads, triton importable and not
    disabled, and a CUDA tensor, or a CPU tensor under the Triton interpreter (where a simulated CUDA machine has
    triton, `device.simulate_cuda`), or a meta tensor of a simulated CUDA machine with triton (shapes only)."""
    if x.dtype not in KERNEL_INPUT_DTYPES or triton_disabled():
        return False
    if x.device.type == "cuda":
        return triton_available()
    simulated = simulated_profile()
    if simulated is not None and not simulated.triton:
        return False
    if x.device.type == "cpu":
        return interpreter_enabled() and triton_available()
    return x.device.type == "meta" and simulated is not None


def fused_cast_enabled_for(x: torch.Tensor) -> bool:
    """Whether `scaled_cast` takes the fused path for `x`: CUDA only (the interpreter is for tests, which call
    the ops directly)."""
    return x.device.type == "cuda" and triton_enabled_for(x)


def cpu_twins_enabled_for(x: torch.Tensor) -> bool:
    """Whether the ops run `x` through the CPU twins of kernels/cpu_kernels.py (a real CPU, not forced to the reference, not
    taking a simulated CUDA machine's paths: CUDA runs the reference where it has no Triton kernel)."""
    return x.device.type == "cpu" and simulated_profile() is None and not _env_flag("LIGHTNING_FP8_CPU_REFERENCE")


def use_soft_cast(x: torch.Tensor) -> bool:
    """Exact integer FP8 rounding instead of the hardware cvt: on GPUs without an FP8 convert instruction (below
    sm89: Triton refuses `.to(tl.float8e4nv)` there), on sm89 with a Triton that converts float32 through float16
    there (two roundings: 3.6 does, 3.9 does not), under the interpreter (its fp8 conversion mis-rounds values that
    round up across a power of two), or when asked."""
    if x.device.type != "cuda" or _env_flag("LIGHTNING_FP8_SOFT_CAST"):
        return True
    return not hardware_cast_exact(profile_of(x.device).capability, triton_version())


def hardware_cast_exact(capability, version) -> bool:
    """Whether Triton's hardware FP8 conversion compiles on `capability` and rounds float32 once, as torch's cast
    does: sm89+, and on sm89 only from Triton 3.9 (earlier ones go through float16 there)."""
    if capability is None or tuple(capability) < (8, 9):
        return False
    return tuple(capability) != (8, 9) or tuple(version) >= (3, 9)


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple:
    """(major, minor) of the installed triton; (0, 0) without one."""
    if not triton_available():
        return (0, 0)
    import triton

    parts = triton.__version__.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def in_kernel_rand() -> bool:
    return _env_flag("LIGHTNING_FP8_TRITON_RAND")


from lightning_fp8.kernels.ops import fp8_amax, fp8_cast, materializes_transpose, scaled_cast  # noqa: E402
from lightning_fp8.kernels.tiled_ops import tiled_cast  # noqa: E402
from lightning_fp8.kernels.microscaled_ops import microscaled_cast  # noqa: E402
from lightning_fp8.kernels.grouped_ops import grouped_cast  # noqa: E402
