"""FP8 on the distributed engines users already run: FP8 weight all-gather under FSDP2 (`fully_shard`), FP8 gradient
communication for DDP and FSDP2, and tensor-parallel styles for FP8 layers. The adapters call these for
`fp8_all_gather=True` and `gradient_communication="fp8"`; plain PyTorch users call them directly."""
from lightning_fp8.distributed.all_gather import (
    FP8AllGatherWeight,
    enable_fp8_all_gather,
    fp8_all_gather_reason,
    precompute_fp8_weight_amaxes,
    uses_fp8_all_gather,
)
from lightning_fp8.distributed.comm_bytes import CommBytes
from lightning_fp8.distributed.comm_hook import FP8CommState, bf16_comm_hook, fp8_comm_hook
from lightning_fp8.distributed.reduce_scatter import FP8ReduceScatter, enable_fp8_reduce_scatter
from lightning_fp8.distributed.sharding import is_fsdp_sharded
from lightning_fp8.distributed.tensor_parallel import FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput

__all__ = ["FP8ColwiseParallel", "FP8RowwiseParallel", "PrepareFP8ModuleInput", "enable_fp8_all_gather",
           "precompute_fp8_weight_amaxes", "uses_fp8_all_gather", "fp8_all_gather_reason", "enable_fp8_reduce_scatter",
           "fp8_comm_hook", "bf16_comm_hook", "FP8CommState", "CommBytes"]
