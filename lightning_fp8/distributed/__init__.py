"""Scale-out on the engines users already run: FSDP2 (`fully_shard`) with FP8 weight all-gather, and FP8 gradient
communication for DDP and FSDP2 (docs/distributed.md).

    all_gather.py      FP8AllGatherWeight, enable_fp8_all_gather: FSDP2 gathers FP8 layers' weights as FP8 bytes;
                       precompute_fp8_weight_amaxes: their scales' amaxes agreed in one all-reduce per iteration
    fp8_reduce.py      the FP8 reduction of gradients with a scale shared across ranks (FP8-LM's automatic scaling)
    comm_hook.py       FP8CommState, fp8_comm_hook: that reduction as a DDP comm hook (bf16_comm_hook: the BF16 baseline)
    reduce_scatter.py  FP8ReduceScatter, enable_fp8_reduce_scatter: the same as FSDP2's reduce-scatter
    sharding.py        is the model sharded, may it still be converted
    tensor_parallel.py FP8ColwiseParallel, FP8RowwiseParallel, PrepareFP8ModuleInput: tensor-parallel styles for FP8
                       layers (drop-ins for torch's in a parallelize_module plan)
    sequence_parallel.py the FP8 all-gather of sequence-parallel activations and the reduce-scatters around it
    comm_bytes.py      CommBytes: the bytes each collective moves, counted at the c10d dispatcher

The adapters (Lightning, Fabric, Accelerate) call these for `fp8_all_gather=True` and `gradient_communication="fp8"`;
plain PyTorch users call them directly:

    from lightning_fp8.distributed import FP8CommState, fp8_comm_hook
    ddp_model.register_comm_hook(FP8CommState(), fp8_comm_hook)
"""
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

__all__ = [
    "FP8AllGatherWeight",
    "enable_fp8_all_gather",
    "fp8_all_gather_reason",
    "precompute_fp8_weight_amaxes",
    "uses_fp8_all_gather",
    "FP8CommState",
    "fp8_comm_hook",
    "bf16_comm_hook",
    "FP8ReduceScatter",
    "enable_fp8_reduce_scatter",
    "CommBytes",
    "is_fsdp_sharded",
    "FP8ColwiseParallel",
    "FP8RowwiseParallel",
    "PrepareFP8ModuleInput",
]
