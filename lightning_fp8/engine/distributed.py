"""Cross-rank reductions the engine needs: amax (so every rank computes the same scales) and step flags (so every
rank makes the same skip / rollback decision). No-ops outside an initialised multi-process group.

Sharded parameters (FSDP2's DTensors) are checked through their local shards (`local_shards`): each rank inspects
what it holds and the flag's MAX all-reduce makes the answer global, without a collective per tensor.

The reductions leave nothing behind when they return. Gloo runs every collective, synchronous ones included, on one
of its worker threads, and that thread keeps the finished work (which holds our buffer) for a moment
after the caller's `wait()` has returned. While C++ holds a tensor, torch keeps its Python object alive; whoever drops
the last C++ reference must take the GIL to release that Python object. If the worker thread drops it while the
interpreter is finalizing, taking the GIL ends the thread from inside a C++ destructor: `terminate called without an
active exception`, exit code -6, after training had finished. The engine's reductions are the last collectives of
every training step, and so can be the last of a script: `all_reduce_max_` waits until the backend has let go of its
buffer (usually it already has).
"""
from __future__ import annotations

import sys
import time
import warnings
from typing import Callable, Iterable, List, Optional

import torch
import torch.distributed as dist

from lightning_fp8.engine.host_reads import to_host

#: how long `all_reduce_max_` waits for the backend's worker thread to release the reduced buffer
RELEASE_TIMEOUT_S = 1.0
_RELEASE_POLL_S = 5e-5


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


@torch.no_grad()
def all_reduce_max_(tensors: List[torch.Tensor]) -> None:
    """In-place MAX all-reduce of a list of tensors, flattened into one collective. Returns once the backend no longer
    holds the flattened buffer (see the module docstring)."""
    if world_size() == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    backend = dist.get_backend()
    if backend == "nccl" and flat.device.type != "cuda":
        flat = flat.cuda()
    # NaN would win a MAX reduction on some backends; amax slots never hold NaN (see ScalingState.record)
    if flat.device.type == "cpu" and "gloo" in backend and _release_wait.enabled:
        if not run_and_wait_for_release(flat, lambda buffer: dist.all_reduce(buffer, op=dist.ReduceOp.MAX)):
            _release_wait.give_up()
    else:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    on_host = flat
    if flat.device.type != "cpu" and any(t.device.type == "cpu" for t in tensors):
        on_host = torch.tensor(to_host(flat, "flags reduced across ranks"))  # NCCL reduced host flags on the GPU
    offset = 0
    for t in tensors:
        n = t.numel()
        source = on_host if t.device.type == "cpu" else flat
        t.copy_(source[offset : offset + n].reshape(t.shape).to(device=t.device, dtype=t.dtype))
        offset += n


def max_across_ranks(values: List[float]) -> List[float]:
    """The element-wise MAX of host values over every rank (one collective; the values themselves on one rank)."""
    if world_size() == 1:
        return list(values)
    flags = torch.tensor(values, dtype=torch.float32)
    all_reduce_max_([flags])
    return flags.tolist()  # a CPU tensor (NCCL's result came back through to_host): no device to wait for


def local_shards(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """The part of each tensor this process holds: a DTensor's local shard (FSDP2), else the tensor itself."""
    return [t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t for t in tensors]


class _ReleaseWait:
    """Whether `all_reduce_max_` still waits: a backend that kept a buffer for RELEASE_TIMEOUT_S would keep the next
    ones too, and a wait that long every step would cost more than the abort it prevents."""

    enabled = True

    def give_up(self) -> None:
        self.enabled = False
        warnings.warn(
            f"lightning_fp8: the gloo process group still held a reduced buffer {RELEASE_TIMEOUT_S:g} s after the "
            "collective returned; lightning_fp8 stops waiting for it. A process may then abort at exit ('terminate "
            "called without an active exception'): end the process group before the script ends "
            "(torch.distributed.barrier(); torch.distributed.destroy_process_group()).",
            RuntimeWarning,
            stacklevel=3,
        )


_release_wait = _ReleaseWait()


def run_and_wait_for_release(
    buffer: torch.Tensor, collective: Callable[[torch.Tensor], object], timeout_s: Optional[float] = None
) -> bool:
    """Run the synchronous `collective(buffer)`, then wait until no C++ owner holds `buffer` any more. torch adds one
    reference to a tensor's Python object while C++ also holds the tensor and removes it, under the GIL, when C++ lets
    go, so the Python reference count says when the backend's worker thread is done with the buffer. Sleeping
    releases the GIL, which that thread needs. Returns False if the buffer is still held after `timeout_s` (default
    RELEASE_TIMEOUT_S; nothing more is done then: training is unaffected, only the abort at exit stays possible)."""
    timeout_s = RELEASE_TIMEOUT_S if timeout_s is None else timeout_s
    references_of_ours = sys.getrefcount(buffer)  # counted in this frame, before and after: the same local names
    collective(buffer)
    deadline = None
    while sys.getrefcount(buffer) > references_of_ours:
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout_s
        elif now > deadline:
            return False
        time.sleep(_RELEASE_POLL_S)
    return True
