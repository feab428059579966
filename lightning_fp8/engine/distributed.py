"""Cross-rank reductions the engine needs: amax (so every rank computes the same scales) and step flags (so every
rank makes the same skip / rollback decision). No-ops outside an initialised multi-process group.

Sharded parameters (FSDP2's DTensors) are checked through their local shards (`local_shards`): each rank inspects
what it holds and the flag's MAX all-reduce makes the answer global, without a collective per tensor."""
from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


@torch.no_grad()
def all_reduce_max_(tensors: List[torch.Tensor]) -> None:
    """In-place MAX all-reduce of a list of tensors, flattened into one collective."""
    if world_size() == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    backend = dist.get_backend()
    if backend == "nccl" and flat.device.type != "cuda":
        flat = flat.cuda()
    # NaN would win a MAX reduction on some backends; amax slots never hold NaN (see ScalingState.record)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].reshape(t.shape).to(device=t.device, dtype=t.dtype))
        offset += n


def local_shards(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """The part of each tensor this process holds: a DTensor's local shard (FSDP2), else the tensor itself."""
    return [t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t for t in tensors]
