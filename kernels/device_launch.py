"""Launch every Triton kernel on the device of its tensors.

Triton launches on the *current* CUDA device (and that device's current stream), not on the device of the tensors it
is handed. A layer on cuda:1 while cuda:0 is current (Accelerate's `device_map="auto"`, pipeline stages, a second
model on another GPU) would otherwise run its kernel on cuda:0 with cuda:1's pointers: an illegal address, or with
peer access a kernel on the wrong device's stream, unordered with the work that produced its input.

`device_guard(x)` makes x's device current for the launch and restores the previous one afterwards (what
`torch.cuda.device` does; c10's DeviceGuard does the same for torch's own CUDA ops). CPU tensors (the Triton
interpreter) need nothing. Every `kernel[grid](...)` launch in the package sits inside `with device_guard(t):` for a
tensor `t` it passes to the kernel (a rule the test suite enforces on the sources). This module imports torch only,
so the kernels' callers can use it without triton.

`announce(kernel, reads, writes)` comes right before each launch: it tells the launch recorders of `trace.py` what the
kernel reads and writes (the CUDA contract suite counts launches and the roofline model prices their bytes), and says
whether to launch at all: not on meta tensors, which carry shapes only (a trace of a layer at LLaMA sizes).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, List, Optional, Sequence

import torch


def device_guard(tensor: torch.Tensor) -> ContextManager:
    """The context a kernel reading `tensor` must launch in: `torch.cuda.device(tensor.device)` for a CUDA tensor,
    nothing for a CPU tensor (the interpreter runs on the host)."""
    device = tensor.device
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


#: the active launch recorders (kernels/trace.py): each gets (kernel name, tensors read, tensors written, bytes read)
_observers: List[Callable[[str, Sequence[torch.Tensor], Sequence[torch.Tensor], Optional[int]], None]] = []


def announce(kernel: str, reads: Sequence[Optional[torch.Tensor]], writes: Sequence[Optional[torch.Tensor]],
             read_bytes: Optional[int] = None) -> bool:
    """A Triton kernel named `kernel` is about to launch, reading `reads` and writing `writes` (None entries: unused
    pointers); `read_bytes` overrides the bytes read where the kernel reads less than its tensors (a pass that exits
    early). Returns whether to launch it: False where the tensors are meta (nothing to compute)."""
    reads = [t for t in reads if t is not None]
    writes = [t for t in writes if t is not None]
    for observer in _observers:
        observer(kernel, reads, writes, read_bytes)
    return not any(t.device.type == "meta" for t in (*reads, *writes))
