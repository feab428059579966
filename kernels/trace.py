"""What a piece of code launches on a GPU, recorded without one: every kernel with the bytes it moves and its FLOPs.

`record_launches()` counts, inside its block, every operator that becomes a kernel launch on CUDA:

- aten operators (a TorchDispatchMode sees each one): one launch each, except those that launch nothing (views,
  allocations without a fill, `detach`); GEMMs (`mm`, `addmm`, `_scaled_mm`, ...) carry 2*M*K*N FLOPs; every
  launch's bytes are those of its tensor arguments read and its results written;
- lightning_fp8's custom ops are not one opaque call here: their Python implementation runs under the same mode, so
  the operators and Triton kernels inside are counted one by one (what the GPU launches), on every device;
- Triton kernels, at their launch site (`launch.announce`, which each launcher calls before `kernel[grid](...)`), with
  the bytes the launcher says the kernel reads and writes.

Run it under `device.simulate_cuda` on meta tensors and the code takes the CUDA paths with shapes only: the Triton
launchers record and skip their kernels, the scaled-GEMM calls run torch's meta checks: what launch budgets are
counted with. A count, not a profile: what runs, not how long it takes.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fp8.kernels import interpreter_enabled, launch

aten = torch.ops.aten

#: operators that launch no kernel: allocations without a fill, and bookkeeping
_NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh", "alias",
    "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "set_",
    "record_stream", "_has_compatible_shallow_copy_type",
}
#: GEMM operators (their FLOPs: `_gemm_flops`)
_GEMMS = {"mm", "addmm", "_scaled_mm", "_scaled_mm_v2", "bmm", "baddbmm", "matmul"}
#: in-place operators whose first argument is written without being read
_WRITE_ONLY_SELF = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: where it comes from ("aten" operator, "triton" kernel), its name, bytes and FLOPs."""

    source: str
    name: str
    bytes_read: int
    bytes_written: int
    flops: int = 0
    #: a GEMM's first operand dtype ("float8_e4m3fn", "float4_e2m1fn_x2", "bfloat16", ...): which tensor-core rate
    #: runs it; "" for other kernels
    operand_dtype: str = ""

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def is_gemm(self) -> bool:
        return self.flops > 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_view(func) -> bool:
    schema = func._schema
    return bool(schema.returns) and schema.returns[0].alias_info is not None and not schema.is_mutable


def _tensors(tree) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _gemm_flops(name: str, args: Sequence) -> int:
    if name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    batch = a.shape[0] if a.dim() == 3 else 1
    k = a.shape[-1] * (2 if a.dtype == _FP4 else 1)  # packed FP4: two elements per byte along K
    return 2 * batch * a.shape[-2] * k * b.shape[-1]


_FP4 = getattr(torch, "float4_e2m1fn_x2", None)


def _gemm_operand_dtype(name: str, args: Sequence) -> str:
    a = args[1] if name in ("addmm", "baddbmm") else args[0]
    return str(a.dtype).replace("torch.", "")


class _Recorder(TorchDispatchMode):
    def __init__(self, launches: List[Launch]) -> None:
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace == "lightning_fp8":
            impl = _implementation(func)
            with self:  # the implementation's own operators and launches are what the GPU runs
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if _is_view(func) or name in _NO_KERNEL or _inside_triton_interpreter():
            return out
        written = _tensors(out)
        inputs = _tensors((args, kwargs))
        if name in _WRITE_ONLY_SELF and inputs:
            inputs = inputs[1:]
        if func._schema.is_mutable and not written:
            written = [a for a in _tensors(args[:1])]
        gemm = name in _GEMMS
        self.launches.append(Launch("aten", name, sum(map(_nbytes, inputs)), sum(map(_nbytes, written)),
                                    _gemm_flops(name, args) if gemm else 0,
                                    _gemm_operand_dtype(name, args) if gemm else ""))
        return out


def _inside_triton_interpreter() -> bool:
    """Whether the operator comes from Triton's interpreter moving a kernel's arguments (TRITON_INTERPRET=1, CPU
    tests): part of the Triton launch already recorded, nothing a GPU runs."""
    if not interpreter_enabled():
        return False
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton."):
            return True
        frame = frame.f_back
    return False


def _implementation(func):
    """The Python function behind a lightning_fp8 custom op (torch.library's CustomOpDef)."""
    from torch._library.custom_ops import OPDEFS

    return OPDEFS[f"{func.namespace}::{func.overloadpacket.__name__}"]._init_fn


@contextlib.contextmanager
def record_launches() -> Iterator[List[Launch]]:
    """Every kernel launch inside the block (module docstring), in order."""
    launches: List[Launch] = []

    def on_triton(kernel: str, reads, writes, read_bytes: Optional[int]) -> None:
        read = sum(map(_nbytes, reads)) if read_bytes is None else int(read_bytes)
        launches.append(Launch("triton", kernel, read, sum(map(_nbytes, writes))))

    launch._observers.append(on_triton)
    try:
        with _Recorder(launches):
            yield launches
    finally:
        launch._observers.remove(on_triton)


__all__ = ["Launch", "record_launches"]
