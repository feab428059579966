"""CommBytes: counts the bytes every collective of a process moves, at the c10d dispatcher, whatever issued it.

Every ProcessGroup collective goes through a `c10d::*` dispatcher op (`allreduce_`, `_allgather_base_`,
`_reduce_scatter_base_`, `alltoall_base_`, ...), whether it comes from Python (`dist.all_reduce`, FSDP2, a DDP
comm hook) or from C++ (DDP's reducer); DTensor's redistributions (tensor parallelism) use the functional collectives
instead, `_c10d_functional::*` ops (`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce`, ...), which run
the process group directly: both namespaces are counted, each op under its own name. A TorchDispatchMode sees each
with its real tensors (the mechanism of torch's own `CommDebugMode`, which counts calls only), so the bytes are
counted, not estimated. Users can check their own runs with it:

    with CommBytes() as counter:
        ... one training step ...
    counter.table()          # {(op, dtype): {"calls", "numel", "bytes", "bus_bytes"}}
    counter.total("bus_bytes", ops=("_allgather_base_",))

Per call and per rank: `bytes` is the payload this rank contributes (all-reduce: the buffer; all-gather: its
input shard; reduce-scatter and all-to-all: its whole input). `bus_bytes` is what this rank sends with the
bandwidth-optimal algorithm (NCCL-tests' "bus bandwidth" factors): all-reduce 2(W-1)/W x buffer, all-gather
(W-1) x input, reduce-scatter and all-to-all (W-1)/W x input, broadcast 1 x buffer. Compare collectives of different
kinds on bus bytes: an all-reduce moves its buffer twice. Timing runs must not use the mode (it costs Python time
per op). Collectives issued from threads other than the one that entered the mode are not seen.

`peak_allocated_bytes(fn)` measures the other cost of a communication path, the memory it allocates: the peak of the
CPU allocator's running total while `fn` runs (e.g. the comm hook's and the reduce-scatter's temporaries).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: c10d op -> (index of the argument holding this rank's contribution, bus factor as a function of W)
_COLLECTIVES = {
    "allreduce_": (0, lambda w: 2 * (w - 1) / w),
    "allreduce_coalesced_": (0, lambda w: 2 * (w - 1) / w),
    "_allgather_base_": (1, lambda w: w - 1),
    "allgather_": (1, lambda w: w - 1),
    "allgather_into_tensor_coalesced_": (1, lambda w: w - 1),
    "_reduce_scatter_base_": (1, lambda w: (w - 1) / w),
    "reduce_scatter_": (1, lambda w: (w - 1) / w),
    "reduce_scatter_tensor_coalesced_": (1, lambda w: (w - 1) / w),
    "alltoall_base_": (1, lambda w: (w - 1) / w),
    "alltoall_": (1, lambda w: (w - 1) / w),
    "broadcast_": (0, lambda w: 1.0),
    "reduce_": (0, lambda w: 1.0),
}

#: the functional collectives (`_c10d_functional::*`): op -> (index of this rank's contribution, bus factor of W);
#: the group is their last argument (its name; all_gather / reduce_scatter also pass its size)
_FUNCTIONAL_COLLECTIVES = {
    "all_reduce": (0, lambda w: 2 * (w - 1) / w),
    "all_reduce_": (0, lambda w: 2 * (w - 1) / w),
    "all_reduce_coalesced": (0, lambda w: 2 * (w - 1) / w),
    "all_gather_into_tensor": (0, lambda w: w - 1),
    "all_gather_into_tensor_coalesced": (0, lambda w: w - 1),
    "reduce_scatter_tensor": (0, lambda w: (w - 1) / w),
    "reduce_scatter_tensor_coalesced": (0, lambda w: (w - 1) / w),
    "all_to_all_single": (0, lambda w: (w - 1) / w),
    "broadcast": (0, lambda w: 1.0),
    "broadcast_": (0, lambda w: 1.0),
}

Key = Tuple[str, str]


def _tensors(obj) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _group_size(args) -> int:
    for arg in args:  # the ProcessGroup argument arrives as a ScriptObject at the dispatcher
        if isinstance(arg, torch.ScriptObject):
            return torch.distributed.ProcessGroup.unbox(arg).size()
    raise RuntimeError("CommBytes: a c10d collective without a process group argument")


def _functional_group_size(args) -> int:
    """The group of a functional collective: its name is the last string argument."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = [arg for arg in args if isinstance(arg, str)][-1]
    return _resolve_process_group(name).size()


class CommBytes(TorchDispatchMode):
    """Counts calls, elements, payload bytes and bus bytes of every c10d collective, per (op, dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: Dict[Key, Dict[str, float]] = defaultdict(lambda: {"calls": 0, "numel": 0, "bytes": 0, "bus_bytes": 0.0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        tensors, factor = None, 0.0
        if func.namespace == "c10d" and name in _COLLECTIVES:
            index, bus_factor = _COLLECTIVES[name]
            tensors = list(_tensors(args[index]))
            factor = bus_factor(_group_size(args))
        elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL_COLLECTIVES:
            index, bus_factor = _FUNCTIONAL_COLLECTIVES[name]
            tensors = list(_tensors(args[index]))
            factor = bus_factor(_functional_group_size(args))
        if tensors is not None:
            for i, t in enumerate(tensors):
                record = self.records[(name, str(t.dtype).replace("torch.", ""))]
                record["calls"] += 1 if i == 0 else 0
                record["numel"] += t.numel()
                record["bytes"] += t.numel() * t.element_size()
                record["bus_bytes"] += t.numel() * t.element_size() * factor
        return func(*args, **(kwargs or {}))

    def table(self) -> Dict[Key, Dict[str, float]]:
        return {key: dict(value) for key, value in sorted(self.records.items())}

    def total(self, field: str = "bus_bytes", ops: Optional[Iterable[str]] = None, dtypes: Optional[Sequence[str]] = None) -> float:
        """Sum of `field` over the records of `ops` (all if None) and `dtypes` (all if None)."""
        wanted = set(ops) if ops is not None else None
        return sum(v[field] for (op, dtype), v in self.records.items()
                   if (wanted is None or op in wanted) and (dtypes is None or dtype in dtypes))

    def reset(self) -> None:
        self.records.clear()

    def format(self) -> str:
        return "\n".join(
            f"{op:28s} {dtype:14s} calls={v['calls']:4d} numel={v['numel']:10d} bytes={v['bytes']:11d} "
            f"bus_bytes={v['bus_bytes']:13.0f}" for (op, dtype), v in self.table().items()
        )


def peak_allocated_bytes(fn: Callable[[], Any]) -> Tuple[int, Any]:
    """(peak, fn's result): the most bytes that tensors allocated while `fn` runs held at once, on the CPU allocator
    (tensors that existed before are not counted; what `fn` returns counts while it is alive inside `fn`). From the
    profiler's allocation events (`profile_memory=True`), which see every allocation of the c10 CPU allocator,
    including temporaries inside an operator; allocations of other threads and other devices are not counted, and
    neither is memory that libraries allocate outside the c10 allocator (gloo's own buffers). A measuring tool:
    slow, not for training runs."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    allocations = [e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                   if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu"]
    allocations.sort(key=lambda e: e.start_time_ns)
    current = peak = 0
    for event in allocations:  # a running total of our own: the allocator's counts what existed before too
        current += event.extra_fields.alloc_size
        peak = max(peak, current)
    return peak, result
