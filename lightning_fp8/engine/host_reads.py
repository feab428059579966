"""The engine's reads of device values on the host: each one a device-to-host synchronisation on a GPU.

The engine decides on the host (skip the step or not, roll back or not, which layers overflowed), from values the
device computed: whether a gradient is inf / NaN, the loss, the open amax slots, whether the weights are finite. Each
such read waits for the device to finish everything queued before it. Every one of them goes through `to_host`, so
they can be counted (`count_host_reads`); their number per iteration is part of the engine's contract. Nothing else
in the engine, the layers or the kernels may read a device value on the host, implicitly (`.item()`, `bool(t)`,
`nonzero`) or otherwise.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

_counters: List[List[str]] = []


def to_host(tensor: torch.Tensor, why: str) -> List[float]:
    """The values of `tensor`, flattened, as Python numbers (a copy that waits for the device where the tensor is on
    one). Python numbers, not a CPU tensor: whatever the engine then does with them reads nothing from a device,
    and a test can count every other read as one. `why` names the read in the counts."""
    for counter in _counters:
        counter.append(why)
    if hasattr(tensor, "full_tensor"):  # a DTensor (FSDP2: the norm of sharded gradients): its global value
        tensor = tensor.full_tensor()
    return tensor.detach().reshape(-1).tolist()


@contextlib.contextmanager
def count_host_reads() -> Iterator[List[str]]:
    """The reasons of every `to_host` call inside the block, in order."""
    reads: List[str] = []
    _counters.append(reads)
    try:
        yield reads
    finally:
        _counters.remove(reads)
