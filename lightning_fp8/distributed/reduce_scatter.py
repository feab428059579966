"""FP8 gradient reduce-scatter for FSDP2, through `FSDPModule.set_custom_reduce_scatter` (torch 2.11 and 2.13).

FSDP2 reduce-scatters each unit's gradients as one flat buffer (W contiguous shards, the unit's parameters padded
to whole shards) in `reduce_dtype`, then hands every rank its shard. `FP8ReduceScatter` does the same in FP8
(numerics: fp8_reduce.py): one scale for the buffer, agreed by a MAX all-reduce of the ranks' amaxes; the buffer
cast to FP8 and moved by an all-to-all of uint8 chunks (each rank receives its shard from every rank: (W-1)/W x N
bytes sent, half of a BF16 reduce-scatter's); a float32 sum of what arrived; FSDP2's reduce op applied (AVG, or SUM
when FSDP2 divides by itself). Non-finite gradients on any rank make every rank's shard NaN (the engine skips).

Memory: the uint8 send and receive buffers, N bytes each for a unit of N gradient elements, and float32 temporaries
of O(fp8_reduce.CHUNK) elements whatever N: the received values are decoded and summed over the ranks a block of
columns at a time (fp8_reduce.decode_sum_into), written straight into FSDP2's output.

One scale per call, not per parameter: the buffer's parameter boundaries are FSDP2's private layout. FSDP2 calls it
synchronously in its reduce-scatter stream; nothing here synchronises with the host.

Limits, each an error rather than a wrong result: reduce ops other than AVG and SUM (FSDP2 uses PREMUL_SUM when
`set_gradient_divide_factor` is given a factor other than the world size); on torch 2.13, modules whose parameters
form several groups (`shard_placement_fn` with per-parameter meshes) are refused by FSDP2 itself. HSDP's extra
all-reduce across replicas stays in reduce_dtype (untested).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_fp8.distributed.comm_hook import FP8CommState
from lightning_fp8.distributed.fp8_reduce import decode_sum_into, encode_into, local_amaxes, shared_scales
from lightning_fp8.distributed.sharding import fsdp_modules
from lightning_fp8.numerics.formats import get_format


class FP8ReduceScatter:
    """FSDP2's ReduceScatter comm (duck-typed: FSDP2 calls only `allocate` and `__call__`; its base class is private)."""

    def __init__(self, state: Optional[FP8CommState] = None) -> None:
        self.state = state if state is not None else FP8CommState()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise NotImplementedError(
                f"lightning_fp8: FP8 reduce-scatter supports FSDP2's AVG and SUM reductions, not {op} (FSDP2 uses "
                "PREMUL_SUM after set_gradient_divide_factor). Use gradient_communication='bf16' with a divide factor."
            )
        fmt = get_format(self.state.fmt)
        world = group.size()
        scales, nonfinite = shared_scales(local_amaxes([input_tensor]), fmt, self.state.margin, group)
        scale = scales[0]
        flat = input_tensor.reshape(-1)
        sent = encode_into(torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device), flat, scale, fmt)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        del sent
        # decoded, summed over the ranks in float32, divided and written a block of columns at a time
        decode_sum_into(output_tensor, received, world, scale, fmt, divisor=world if op == dist.ReduceOp.AVG else None,
                        nonfinite=nonfinite)
        return None


def enable_fp8_reduce_scatter(model: nn.Module, state: Optional[FP8CommState] = None) -> int:
    """Install `FP8ReduceScatter` on every FSDP2 unit of `model` (after `fully_shard`); returns how many."""
    comm = FP8ReduceScatter(state)
    units = fsdp_modules(model)
    for unit in units:
        try:
            unit.set_custom_reduce_scatter(comm)
        except ValueError as error:  # torch 2.13: several parameter groups in one unit
            raise NotImplementedError(
                f"lightning_fp8: FSDP2 refused a custom reduce-scatter for {type(unit).__name__} ({error}); use "
                "gradient_communication='bf16' for this model."
            ) from error
    return len(units)
