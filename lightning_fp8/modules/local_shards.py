"""How an FP8 layer computes when tensor parallelism made its parameters DTensors: on its local shards.

Tensor-parallel styles (torch's `ColwiseParallel` / `RowwiseParallel`, and lightning_fp8.distributed's FP8 variants)
turn a linear layer's weight and bias into DTensors and hand it its input laid out as the layer needs:

| layer | weight | input | output (before the style's redistribution) |
|---|---|---|---|
| column-wise | Shard(0): a slice of the output features | Replicate: the whole input | Shard(-1): its slice of the output |
| row-wise | Shard(1): a slice of the input features | Shard(-1): its slice of the input | Partial: a partial sum |
| replicated | Replicate | any layout but Shard(-1) / Partial | the input's layout |

The FP8 forward is local in each case, but DTensor would dispatch every op of it (the casts and GEMMs are custom ops
DTensor has no sharding rule for). So the layer runs its ordinary FP8 forward on the local tensors and wraps the
result back into the DTensor the style expects; autograd follows the same placements (the gradient of a column-wise
layer's input is a partial sum, which the style's redistribution reduces). A row-wise layer's bias is added to the
partial sum as DTensor does for `nn.Linear` (once in total). An input that is not a DTensor is taken as the local
tensor in the layout the layer needs: what lightning_fp8's FP8 sequence-parallel all-gather hands over
(lightning_fp8/distributed/sequence_parallel.py), whose backward reduces the partial input gradient itself.

torch's styles also make every buffer of the layer's submodules a replicated DTensor, the FP8 metadata included;
`localize_fp8_state` turns them back into the local tensors they hold (the engine keeps them identical on every
rank), before anything reads them. torch's `RowwiseParallel` shards the `weight` of every submodule of the layer it is
applied to, and an FP8 layer's metadata submodule (`fp8_meta`) has none: importing this module makes that partition
function pass over FP8 metadata (`_skip_fp8_metadata`, installed once per process), so torch's styles split an FP8
layer exactly as they split nn.Linear, before or after conversion.

What the layer's scales see: each rank records the amax of its own shards; the engine's once-per-iteration MAX
all-reduce of every amax (lightning_fp8/engine/step_closer.py) makes the histories those of the whole tensors, identical on
every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from lightning_fp8.modules.gathered_fp8 import GatheredFP8Input

try:  # DTensor (torch.distributed); absent from builds without distributed support
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except Exception:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

Tensor = torch.Tensor

#: set on a layer by lightning_fp8's tensor-parallel styles: the style, whose `tensor_parallel_layout()` describes it
LAYOUT_ATTR = "_fp8_tensor_parallel"

#: the local computation of a layer: (x, weight, bias) -> output, on local tensors
LocalForward = Callable[[Tensor, Tensor, Optional[Tensor]], Tensor]


@dataclass(frozen=True)
class TensorParallelLayout:
    """How tensor parallelism splits one layer (what the conversion summary reports).

    kind: "colwise", "rowwise" or "replicated"; style: the name of the style that applied it ("ColwiseParallel"
    when only the weight's placement tells); fp8_communication: what the style moves in FP8 (None: nothing; "": a
    style of torch's, whose communication is all in high precision)."""

    kind: str
    style: str
    fp8_communication: Optional[str] = ""

    def describe(self, in_fp8: bool = True) -> str:
        """e.g. "colwise (FP8ColwiseParallel, FP8 all-gather of the sequence-parallel input)"; a layer that does not
        cast its input per tensor in FP8 (`in_fp8=False`: a BF16 fallback, a rowwise or blockwise recipe)
        communicates in high precision whatever its style."""
        if self.fp8_communication is None:
            return f"{self.kind} ({self.style})"
        if self.fp8_communication and in_fp8:
            return f"{self.kind} ({self.style}, FP8 {self.fp8_communication})"
        return f"{self.kind} ({self.style}, high-precision communication)"


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def layout_of(layer: nn.Module) -> Optional[TensorParallelLayout]:
    """The tensor-parallel layout of `layer` (None when its weight is not split by tensor parallelism): what a
    lightning_fp8 style recorded, else what the weight's placement on its tensor-parallel mesh dimension says."""
    style = layer.__dict__.get(LAYOUT_ATTR)
    if style is not None:
        return style.tensor_parallel_layout()
    weight = getattr(layer, "weight", None)
    if not is_dtensor(weight) or not getattr(layer, "_distribute_module_applied", False):
        return None  # FSDP2 alone shards weights as DTensors too: only a tensor-parallel style marks the module
    # under FSDP2 x TP the weight is a 2-D DTensor (data-parallel dimension first): the last dimension is TP's
    placement = weight.placements[-1]
    kinds = {0: "colwise", 1: "rowwise"}
    kind = kinds.get(placement.dim, "sharded") if isinstance(placement, Shard) else "replicated"
    style = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}.get(kind, "a DTensor style")
    return TensorParallelLayout(kind, style)


@torch.no_grad()
def localize_fp8_state(model: nn.Module) -> int:
    """Turn FP8 metadata buffers that a tensor-parallel style made replicated DTensors back into local tensors (the
    values they hold, every rank the same); returns how many buffers changed. Idempotent, no communication."""
    from lightning_fp8.modules.layer_state import FP8LayerState

    changed = 0
    if DTensor is None:
        return changed
    for module in model.modules():
        if isinstance(module, FP8LayerState):
            for name, buffer in list(module._buffers.items()):
                if isinstance(buffer, DTensor):
                    module._buffers[name] = buffer.to_local()
                    changed += 1
    return changed


def parallel_forward(layer: nn.Module, x: Tensor, weight: Tensor, bias: Optional[Tensor], forward: LocalForward) -> Tensor:
    """`layer`'s forward when its weight is a DTensor: `forward` on the local tensors, the output as a DTensor laid
    out as the table in the module docstring says."""
    if isinstance(layer.fp8_meta.amax_history, DTensor):
        localize_fp8_state(layer)
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"lightning_fp8: an FP8 layer's weight is a DTensor on a {mesh.ndim}-D mesh in forward; tensor "
            "parallelism over one mesh dimension is supported (FSDP2 x TP: FSDP2 presents the TP-sharded weight)."
        )
    (placement,) = weight.placements
    if isinstance(placement, Shard) and placement.dim in (0, -2):
        return _colwise(x, weight, bias, forward, layer)
    if isinstance(placement, Shard) and placement.dim in (1, -1):
        return _rowwise(x, weight, bias, forward, layer)
    if isinstance(placement, Replicate):
        return _replicated(x, weight, bias, forward, layer)
    raise NotImplementedError(f"lightning_fp8: FP8 layers do not support a weight placed as {placement}")


def refuse_gathered_input(x: Tensor, layer: nn.Module, why: str) -> None:
    """An input sequence parallelism all-gathered in FP8 may only be read by column-wise FP8 layers (their input
    gradients are partial sums, which the gather's backward reduce-scatters): raise anywhere else."""
    local = x._local_tensor if is_dtensor(x) else x
    if isinstance(local, GatheredFP8Input):
        raise RuntimeError(
            f"lightning_fp8: an input all-gathered in FP8 by FP8ColwiseParallel / PrepareFP8ModuleInput reached "
            f"{type(layer).__name__}, which {why}. Only FP8 layers parallelized with FP8ColwiseParallel may read it (the "
            "gather's backward reduce-scatters their partial input gradients); use torch's PrepareModuleInput / "
            "ColwiseParallel for the module whose input other layers read."
        )


def _local_input(x: Tensor, placement, grad_placement) -> Tensor:
    """x as the local tensor of `placement` (a DTensor is redistributed first if it is laid out otherwise)."""
    if not is_dtensor(x):
        return x
    if tuple(x.placements) != (placement,):
        x = x.redistribute(placements=(placement,))
    return x.to_local(grad_placements=(grad_placement,))


def _colwise(x: Tensor, weight, bias, forward: LocalForward, layer: nn.Module) -> Tensor:
    mesh = weight.device_mesh
    if is_dtensor(x):  # a DTensor over an FP8-gathered input: torch's ColwiseParallel would all-reduce its gradient too
        refuse_gathered_input(x, layer, "torch's ColwiseParallel parallelizes")
    # every rank reads the whole input; its gradient is this rank's share of dx (a partial sum)
    x_local = _local_input(x, Replicate(), Partial())
    out = forward(x_local, weight.to_local(), bias.to_local() if bias is not None else None)
    return DTensor.from_local(out, mesh, (Shard(out.dim() - 1),), run_check=False)


def _rowwise(x: Tensor, weight, bias, forward: LocalForward, layer: nn.Module) -> Tensor:
    refuse_gathered_input(x, layer, "is row-wise parallel")
    mesh = weight.device_mesh
    last = x.dim() - 1
    x_local = _local_input(x, Shard(last), Shard(last))
    out = DTensor.from_local(forward(x_local, weight.to_local(), None), mesh, (Partial(),), run_check=False)
    return out + bias if bias is not None else out  # DTensor adds a replicated bias to a partial sum once in total


def _replicated(x: Tensor, weight, bias, forward: LocalForward, layer: nn.Module) -> Tensor:
    refuse_gathered_input(x, layer, "holds a replicated weight")
    if not is_dtensor(x):
        return forward(x, weight.to_local(), bias.to_local() if bias is not None else None)
    (placement,) = x.placements
    if placement.is_partial() or (isinstance(placement, Shard) and placement.dim in (-1, x.dim() - 1)):
        placement = Replicate()  # the contracted dimension cannot stay split (or summed) across ranks
    x_local = _local_input(x, placement, placement)
    out = forward(x_local, weight.to_local(), bias.to_local() if bias is not None else None)
    return DTensor.from_local(out, weight.device_mesh, (placement,), run_check=False)


def _skip_fp8_metadata() -> None:
    """Make torch's `RowwiseParallel._partition_linear_fn` leave FP8 metadata submodules alone (see the module
    docstring). distribute_module calls the partition function for the layer (name "") and for each of its
    submodules; for the layer itself nothing changes. Idempotent."""
    try:
        from torch.distributed.tensor.parallel import RowwiseParallel
    except Exception:  # pragma: no cover - builds without torch.distributed
        return
    original = getattr(RowwiseParallel, "_partition_linear_fn", None)
    if original is None or getattr(original, "_lightning_fp8", False):
        return

    def _partition_linear_fn(self, name, module, device_mesh):
        from lightning_fp8.modules.layer_state import FP8LayerState

        if isinstance(module, FP8LayerState):
            return None  # the FP8 layer's scaling state: nothing to shard (the engine keeps it equal on every rank)
        return original(self, name, module, device_mesh)

    _partition_linear_fn._lightning_fp8 = True  # type: ignore[attr-defined]
    _partition_linear_fn.__wrapped__ = original  # type: ignore[attr-defined]
    RowwiseParallel._partition_linear_fn = _partition_linear_fn


_skip_fp8_metadata()
