"""What a piece of code launches on a GPU, recorded without one: every kernel with the bytes it moves and its FLOPs.

`record_launches()` counts, inside its block, every operator that becomes a kernel launch on the device:

- aten operators (a TorchDispatchMode sees each one): one launch each, except those that launch nothing (views,
  allocations without a fill, `detach` / `detach_`); GEMMs (`mm`, `addmm`, `_scaled_mm`, ...) carry 2*M*K*N FLOPs;
  every launch's bytes are those of its tensor arguments read and its results written;
- composite operators are decomposed into the operators that run: below autograd (inside a custom op's
  implementation) the mode sees `to`, `contiguous`, `reshape`, `matmul`, `isfinite`, `repeat_interleave`, ... as
  one call, which is either nothing (`to` of a tensor already of that dtype and device, `reshape` of a view-able
  tensor) or a copy / several kernels. Each is run through its CompositeImplicitAutograd decomposition under the
  mode, so a copy counts as the `_to_copy` / `clone` it is and a view as nothing;
- lightning_fp8's custom ops are not one opaque call here: their Python implementation runs under the same mode, so
  the operators and Triton kernels inside are counted one by one (what the GPU launches), on every device;
- Triton kernels, at their launch site (`device_launch.announce`, which each launcher calls before `kernel[grid](...)`), with
  the bytes the launcher says the kernel reads and writes;
- host-side operators are not launches: where the block runs on a device (any operator touched a tensor not on the
  CPU: CUDA, or meta under `device.simulate_cuda`), an operator all of whose tensors are CPU tensors runs on the host
  (a table or a matrix built there) and is left out of the launches (kept in `launches.host_ops`); the copy of such a
  tensor to the device is a launch (`Launch.host_to_device`). A block that touches CPU tensors only (the CPU run
  itself, or the Triton interpreter on CPU tensors) counts every operator.

Run it under `device.simulate_cuda` on meta tensors and the code takes the CUDA paths with shapes only: the Triton
launchers record and skip their kernels, the scaled-GEMM calls run torch's meta checks: what launch budgets are
counted with. A count, not a profile: what runs, not how long it takes.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Set

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fp8.kernels import interpreter_enabled, device_launch

aten = torch.ops.aten

#: operators that launch no kernel: allocations without a fill, views whose schema does not say so (`_unsafe_view`:
#: what `reshape` returns over the copy it made), and bookkeeping
_NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "detach_", "lift_fresh",
    "alias", "_unsafe_view",
    "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "set_",
    "record_stream", "_has_compatible_shallow_copy_type",
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit",  # profiler ranges
}
#: GEMM operators (their FLOPs: `_gemm_flops`)
_GEMMS = {"mm", "addmm", "_scaled_mm", "_scaled_mm_v2", "bmm", "baddbmm", "matmul", "_grouped_mm",
          "_scaled_grouped_mm"}
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
    #: a copy of a host (CPU) tensor to the device (`_to_copy` / `copy_` from the CPU): a tensor built on the host
    host_to_device: bool = False

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


class Launches(list):
    """The launches of a `record_launches` block, in order (a list of `Launch`). `host_ops`: the operators that ran on
    the host (CPU tensors only) while the block ran on a device: no launch, but host time and, where their result
    goes to the device, a host-to-device copy (which is in the list)."""

    def __init__(self) -> None:
        super().__init__()
        self.host_ops: List[Launch] = []


_CIA = torch._C.DispatchKey.CompositeImplicitAutograd


def _decomposes(func) -> bool:
    """Whether `func` is a composite operator (a CompositeImplicitAutograd kernel: it runs other operators, and no
    kernel of its own)."""
    return _CIA in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _CIA)


class _Recorder(TorchDispatchMode):
    def __init__(self, launches: List[Launch], devices: List[Set[str]]) -> None:
        super().__init__()
        self.launches = launches
        #: per launch, the device types of the tensors it touched (host operators are told apart at the block's end)
        self.devices = devices

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace == "lightning_fp8":
            impl = _implementation(func)
            with self:  # the implementation's own operators and launches are what the GPU runs
                return impl(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and _decomposes(func):
            with self:  # the operators it runs (a copy, several kernels, or nothing but views)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
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
        read_devices = {t.device.type for t in inputs}
        write_devices = {t.device.type for t in written}
        h2d = name in ("_to_copy", "copy_") and read_devices == {"cpu"} and bool(write_devices - {"cpu"})
        self.launches.append(Launch("aten", name, sum(map(_nbytes, inputs)), sum(map(_nbytes, written)),
                                    _gemm_flops(name, args) if gemm else 0,
                                    _gemm_operand_dtype(name, args) if gemm else "", h2d))
        self.devices.append(read_devices | write_devices)
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
def record_launches() -> Iterator[Launches]:
    """Every kernel launch inside the block (module docstring), in order. Host operators are told apart when the
    block ends: read the list after it."""
    launches = Launches()
    devices: List[Set[str]] = []

    def on_triton(kernel: str, reads, writes, read_bytes: Optional[int]) -> None:
        read = sum(map(_nbytes, reads)) if read_bytes is None else int(read_bytes)
        launches.append(Launch("triton", kernel, read, sum(map(_nbytes, writes))))
        devices.append({t.device.type for t in (*reads, *writes)})

    device_launch._observers.append(on_triton)
    try:
        with _Recorder(launches, devices):
            yield launches
    finally:
        device_launch._observers.remove(on_triton)
        _leave_out_host_ops(launches, devices)


def _leave_out_host_ops(launches: Launches, devices: List[Set[str]]) -> None:
    """Where the block ran on a device, move the aten operators that touched CPU tensors only to `launches.host_ops`.
    A Triton kernel is always a launch (on CPU tensors it is the interpreter standing in for the device)."""
    if not any(d - {"cpu"} for d in devices):
        return  # a CPU run: every operator is a launch
    on_host = [launch.source == "aten" and not d - {"cpu"} for launch, d in zip(launches, devices)]
    launches.host_ops.extend(launch for launch, host in zip(launches, on_host) if host)
    launches[:] = [launch for launch, host in zip(launches, on_host) if not host]
