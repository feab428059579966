"""Sequence parallelism in FP8: the activation all-gather moves FP8 bytes, cast once with a scale the ranks agree on.

Sequence parallelism (Megatron-LM's; torch's `SequenceParallel` + `ColwiseParallel(input_layouts=Shard(1))`) keeps the
activations between tensor-parallel blocks split along the sequence. The column-wise layers that follow need the whole
sequence: forward all-gathers it, backward reduce-scatters the input gradient (each rank's share of dx is a partial
sum over its output columns). torch moves both in the activation's dtype (float32 under autocast: LayerNorm runs in
float32). Here the forward gather moves FP8 (`gather_in_fp8`):

1. each rank casts its slice once, with the scale of the consuming FP8 layer's input role (`numerics.scaling.cast_scale`:
   its delayed scale when its amax history holds a completed step, else its slice's own amax);
2. one all-gather moves the FP8 bytes with each rank's scale and amax appended (8 bytes per rank);
3. every rank holds every slice and every scale. The scales are equal wherever they come from the history: the
   engine's once-per-iteration MAX all-reduce of all amaxes (lightning_fp8/engine/step_closer.py, one collective for every
   layer and role) leaves identical histories on every rank, and the gathered amax each rank records is the same.
   Where a rank's scale differs (no completed step yet, or current scaling), every slice is brought to the smallest
   scale, the one the whole tensor's amax gives, so the result is the whole tensor cast with one scale: a slice cast
   with a larger scale is re-rounded (with power-of-two scales, the default, that is exact for every value that stays
   a normal FP8 number). No collective is issued for the scale;
4. the FP8 layer consumes the gathered bytes as its input operand (`GatheredFP8Input`, lightning_fp8/modules/gathered_fp8.py)
   for its forward and weight-gradient GEMMs, and records the gathered amax into its history, as its own cast would.

Backward reduce-scatters the input gradient in the gradient's dtype, or in FP8 with `gradient_communication="fp8"`
(the FP8 reduction of fp8_reduce.py: a scale shared by a 4-byte MAX all-reduce, an all-to-all of FP8 chunks, a float32
sum). The row-wise layer's output reduce-scatter (forward) has an FP8 variant of the same reduction
(`reduce_scatter_output`); its backward all-gathers the output gradient in high precision.

A gathered input may only be read by column-wise FP8 layers (`FP8ColwiseParallel`): their input gradients are partial
sums, which is what the backward reduce-scatter adds up. Any other reader gets an error naming the cause
(lightning_fp8/modules/local_shards.py, lightning_fp8/modules/gathered_fp8.py). A layer that does not compute in FP8 with
the gathered cast (BF16 fallback, a recipe override, calibration) gets the exact high-precision input instead, from a
second all-gather in high precision.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_fp8.distributed.comm_hook import FP8CommState
from lightning_fp8.distributed.reduce_scatter import FP8ReduceScatter
from lightning_fp8.modules.cast import cast_to_fp8
from lightning_fp8.modules.gathered_fp8 import CastKey, GatheredFP8Input
from lightning_fp8.numerics.formats import get_format
from lightning_fp8.numerics.quantize import quantize, tensor_amax
from lightning_fp8.numerics.scaling import cast_scale

Tensor = torch.Tensor

#: how the reduce-scatters of tensor parallelism move their bytes (the values of `gradient_communication`)
REDUCE_PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class SequenceComm:
    """Where and how one sequence-parallel collective runs: the tensor-parallel group, the sequence dimension of the
    local tensor (non-negative), and the precision of the reduce-scatter ("bf16": the tensor's own dtype; "fp8")."""

    group: Any
    seq_dim: int
    reduce: str = "bf16"

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)


# -- collectives along the sequence ----------------------------------------------------------------------------------
def _sequence_first(x: Tensor, seq_dim: int) -> Tensor:
    return x.movedim(seq_dim, 0).contiguous()


def all_gather_sequence(x: Tensor, comm: SequenceComm) -> Tensor:
    """The whole sequence from every rank's slice (dim `comm.seq_dim`), in `x`'s dtype; no autograd."""
    local = _sequence_first(x, comm.seq_dim)
    out = local.new_empty((comm.world * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=comm.group)
    return out.movedim(0, comm.seq_dim).contiguous()


def reduce_scatter_sequence(x: Tensor, comm: SequenceComm, fp8_state: Optional[FP8CommState] = None) -> Tensor:
    """This rank's slice (dim `comm.seq_dim`) of the sum over ranks of `x`; in `x`'s dtype, or in FP8 when
    `comm.reduce == "fp8"` (a float32 sum of FP8 chunks cast with one shared scale); no autograd."""
    full = _sequence_first(x, comm.seq_dim)
    rows = full.shape[0] // comm.world
    out = full.new_empty((rows, *full.shape[1:]))
    if comm.reduce == "fp8":
        FP8ReduceScatter(fp8_state)(out, full, comm.group, dist.ReduceOp.SUM)
    else:
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=comm.group)
    return out.movedim(0, comm.seq_dim).contiguous()


# -- the FP8 all-gather --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputCast:
    """The cast of the gathered input: the FP8 layer whose input scale it uses and the key of that cast."""

    layer: Any  # FP8Layer (not imported: modules must not import distributed, and this keeps the type loose)
    key: CastKey


def gather_in_fp8(x_local: Tensor, cast: InputCast, comm: SequenceComm) -> GatheredFP8Input:
    """The whole sequence from every rank's slice `x_local`, cast to FP8 once with one agreed scale (see the module
    docstring), as the input operand of column-wise FP8 layers. Differentiable: backward reduce-scatters the input
    gradient (`comm.reduce`)."""
    return _FP8SequenceGather.apply(x_local, cast, comm)


class _FP8SequenceGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local: Tensor, cast: InputCast, comm: SequenceComm) -> GatheredFP8Input:
        ctx.comm = comm
        layer, key = cast.layer, cast.key
        fmt = get_format(key.fmt)
        history = layer.fp8_meta.input.amax_history
        amax = tensor_amax(x_local).reshape(())
        amax = torch.where(torch.isnan(amax), math.inf, amax)  # NaN could lose the MAX below; inf is an overflow too
        scale = cast_scale(history, amax, fmt.max, key.scaling, key.algo_max, key.margin, key.power_of_2)
        local = _sequence_first(x_local.detach(), comm.seq_dim)
        data = cast_to_fp8(local, scale, fmt).view(torch.uint8).reshape(-1)
        meta = torch.stack([scale.to(torch.float32), amax]).view(torch.uint8)
        payload = torch.cat([data, meta])
        world = comm.world
        received = payload.new_empty(world * payload.numel())
        dist.all_gather_into_tensor(received, payload, group=comm.group)
        received = received.view(world, -1)
        n = data.numel()
        metas = received[:, n:].contiguous().view(torch.float32)  # [world, 2]: each rank's scale and amax
        scales, amaxes = metas[:, 0], metas[:, 1]
        common = scales.min()  # the scale of the largest amax: every rank's values fit
        values = received[:, :n].view(fmt.dtype)
        # slices cast with another scale than the common one are re-rounded to it; a ratio of 1 changes nothing
        values = quantize(values.to(torch.float32), (common / scales).reshape(world, 1), fmt)
        gathered = values.reshape(world * local.shape[0], *local.shape[1:]).movedim(0, comm.seq_dim).contiguous()
        source = _SequenceSource(x_local.detach(), comm)
        return GatheredFP8Input(gathered, common, amaxes.max(), key, source, x_local.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # the readers are column-wise layers: each rank's gradient is a partial sum; add them up, keep this slice
        return reduce_scatter_sequence(grad, ctx.comm), None, None


class _SequenceSource:
    """The exact high-precision input behind a GatheredFP8Input: a high-precision all-gather of this rank's slice."""

    def __init__(self, x_local: Tensor, comm: SequenceComm) -> None:
        self.x_local, self.comm = x_local, comm

    def high_precision(self, gathered: GatheredFP8Input) -> Tensor:
        return _HighPrecisionSequenceGather.apply(gathered, self)

    def local_high_precision(self) -> Tensor:
        return self.x_local


class _HighPrecisionSequenceGather(torch.autograd.Function):
    """The high-precision input standing in for the FP8 one in autograd: its gradient is the FP8 input's, which the
    FP8 gather's backward reduce-scatters."""

    @staticmethod
    def forward(ctx, gathered: GatheredFP8Input, source: _SequenceSource) -> Tensor:
        return all_gather_sequence(source.x_local, source.comm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


# -- the row-wise output's reduce-scatter in FP8 ------------------------------------------------------------------
def reduce_scatter_output(partial: Tensor, comm: SequenceComm) -> Tensor:
    """This rank's sequence slice of the sum of every rank's `partial` (a row-wise layer's output), reduced in FP8;
    backward all-gathers the output gradient in high precision."""
    return _OutputReduceScatter.apply(partial, comm)


class _OutputReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: Tensor, comm: SequenceComm) -> Tensor:
        ctx.comm = comm
        return reduce_scatter_sequence(partial.detach(), comm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_gather_sequence(grad, ctx.comm), None
