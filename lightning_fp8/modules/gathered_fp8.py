"""GatheredFP8Weight / GatheredFP8Input: an operand that reaches an FP8 layer already cast to FP8, with its scale.

Two producers cast a layer's operand before the layer runs, so that the bytes that travel between ranks are FP8:
FSDP2's FP8 all-gather of a weight (GatheredFP8Weight) and tensor parallelism's FP8 all-gather of a sequence-parallel
input (GatheredFP8Input, lightning_fp8/distributed/sequence_parallel.py). Both are a `GatheredFP8Tensor`; what follows
says "weight", and holds for an input the same way (its role is "input", its GEMMs forward and wgrad).

Why it exists: under FSDP2 with FP8 all-gather (lightning_fp8/distributed/all_gather.py) every rank casts its shard
of a weight to FP8 with one scale all ranks agree on, and the all-gather moves the FP8 bytes. The unsharded weight
FSDP2 then puts on the layer for forward and backward is FP8 already: casting it again would round twice, and
dequantizing it for a high-precision computation would compute from FP8-rounded values (FP8's rounding error in
every value: a silent wrong answer). So the weight carries what each consumer needs and nothing reads it by
accident:

- the FP8 data and its quantization scale: what the forward GEMM and the dgrad GEMM take directly
  (`fp8_operands`, `dgrad_operand`);
- the full weight's amax, which a training cast records into the layer's history as `scaled_cast` would;
- the parameters of the cast that produced it (`CastKey`), so the layer can tell whether it is the cast its recipe
  asks for in this forward (a recipe override, an eval forward of a training gather, a recipe made finer at run
  time all differ);
- a source of the exact high-precision weight (a high-precision all-gather), which every other path uses:
  `resolve` hands it out where the forward will not compute in FP8 with that cast.

Any op on it other than a view raises: code that reads the weight without asking for one of the two forms would
otherwise get a quietly dequantized result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch
import torch.utils._pytree as pytree

from lightning_fp8.modules.cast import scaling_mode
from lightning_fp8.recipe import PER_TENSOR_SCALINGS, FP8Recipe

Tensor = torch.Tensor
aten = torch.ops.aten

#: the ops that only view the data (FSDP2 builds the unsharded parameter with as_strided and detach)
_VIEW_OPS = {aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default, aten._unsafe_view.default}


@dataclass(frozen=True)
class CastKey:
    """Everything a per-tensor weight cast depends on besides the history and the amax: two casts with equal keys,
    history and amax produce the same bytes."""

    fmt: str
    scaling: str  # "delayed" | "current" | "none" (the mode of this cast: evaluation casts use "current")
    algo_max: bool
    margin: int
    power_of_2: bool

    @staticmethod
    def of(recipe: FP8Recipe, record: bool, role: str = "weight") -> Optional["CastKey"]:
        """The key of the cast of `role` ("weight" or "input") `recipe` makes (record: a training cast); None for
        recipes that do not scale it per tensor."""
        if recipe.scaling not in PER_TENSOR_SCALINGS:
            return None
        return CastKey(
            fmt=recipe.format_for(role).name,
            scaling=scaling_mode(recipe, role, record),
            algo_max=recipe.amax_compute_algo == "max",
            margin=recipe.margin,
            power_of_2=recipe.power_of_2_scales,
        )


class HighPrecisionSource(Protocol):
    """Where a precast operand's exact high-precision values come from (its producer provides it)."""

    def high_precision(self, weight: "GatheredFP8Tensor") -> Tensor:
        """The whole weight in `weight.dtype`, differentiable: its gradient is `weight`'s gradient."""

    def local_high_precision(self) -> Tensor:
        """The part of the weight this process holds, without communication (what observers sample)."""


class GatheredFP8Tensor(Tensor):
    """An operand already cast to FP8: data + scale, presenting the shape and dtype of the high-precision tensor (so
    autograd gives it an ordinary gradient). See the module docstring for who reads what."""

    #: the tensor role of the layer this operand is cast for (its cast key and history row)
    ROLE = "weight"
    #: what the error of a foreign read calls it
    DESCRIPTION = "an FP8-precast tensor"
    #: what the error of a foreign read tells the user to do
    REMEDY = ""

    _data: Tensor
    _scale: Tensor
    _amax: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, amax: Tensor, cast_key: CastKey, source: HighPrecisionSource,
                dtype: torch.dtype, requires_grad: bool = False) -> "GatheredFP8Tensor":
        return Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
            device=data.device, requires_grad=requires_grad,
        )

    def __init__(self, data: Tensor, scale: Tensor, amax: Tensor, cast_key: CastKey, source: HighPrecisionSource,
                 dtype: torch.dtype, requires_grad: bool = False) -> None:
        self._data = data
        # float32 0-d tensors shared by every view of this weight: FSDP2 re-gathers into the same buffers before
        # backward and updates them in place (`update`), so every view sees the cast its data holds
        self._scale = scale
        self._amax = amax
        self.cast_key = cast_key
        self._source = source

    def __repr__(self) -> str:  # no data access: printing must not fail
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, fp8={self._data.dtype}, dtype={self.dtype}, "
                f"cast={self.cast_key})")

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_amax"], (type(self), self.cast_key, self._source, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        cls, cast_key, source, dtype = meta
        return cls(inner["_data"], inner["_scale"], inner["_amax"], cast_key, source, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEW_OPS and isinstance(args[0], GatheredFP8Tensor):
            src = args[0]
            return type(src)(func(src._data, *args[1:], **kwargs), src._scale, src._amax, src.cast_key, src._source,
                             src.dtype)
        found = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, GatheredFP8Tensor)]
        raise RuntimeError(
            f"lightning_fp8: {func} was called on {found[0].DESCRIPTION} ({type(found[0]).__name__}). Such a tensor is "
            "only read by the FP8 layers it was cast for (FP8 GEMMs, or the exact high-precision values for every "
            f"other path); reading it elsewhere would see FP8-rounded values. {found[0].REMEDY}"
        )

    # -- what the FP8 layer reads ----------------------------------------------------------------------------------
    def matches(self, recipe: FP8Recipe, record: bool) -> bool:
        """Whether this is the cast `recipe` would make of this role in this forward (training: record=True)."""
        return CastKey.of(recipe, record, self.ROLE) == self.cast_key

    def resolve(self, recipe: FP8Recipe, record: bool, fp8: bool) -> Tensor:
        """This weight where the forward computes in FP8 with the same cast (fp8=True and `matches`); otherwise the
        exact high-precision weight (one high-precision all-gather), never the FP8 values dequantized."""
        if fp8 and self.matches(recipe, record):
            return self
        return self._source.high_precision(self)

    def observed(self) -> Tensor:
        """What observers sample for the weight: this process's part of it in high precision (no communication)."""
        return self._source.local_high_precision()

    @torch.no_grad()
    def fp8_operands(self, meta, record: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """(data in FP8, scale, scale_inv) for the forward GEMM, as `scaled_cast` returns them; record=True accumulates
        the full tensor's amax into the open history slot of its role (`ROLE`) in the layer state `meta`, as the cast
        op would have."""
        if record:
            slot = meta.role(self.ROLE).amax_history[0]
            slot.copy_(torch.maximum(slot, self._amax))  # torch.maximum propagates NaN, as the cast op's record does
        scale = self._scale.clone()  # copies: autograd saves them, and a re-gather updates the originals in place
        return self._data, scale, scale.reciprocal()

    def dgrad_operand(self, layout_t: bool) -> Tuple[Tensor, Tensor]:
        """(W in FP8 in the layout the dgrad GEMM reads, scale_inv) from the data gathered for this pass: column-major
        (a transposed copy, 1 byte per element) where the device's GEMM wants it (layout_t), else the data as is."""
        data = self._data.t().contiguous().t() if layout_t else self._data
        return data, self._scale.reciprocal()

    @torch.no_grad()
    def update(self, scale: Tensor, amax: Tensor, cast_key: CastKey) -> None:
        """Adopt the scale, amax and cast of data re-gathered into this weight's buffers (FSDP2's later unshards)."""
        self._scale.copy_(scale)
        self._amax.copy_(amax)
        self.cast_key = cast_key


class GatheredFP8Weight(GatheredFP8Tensor):
    """A weight FSDP2 all-gathered in FP8 (lightning_fp8/distributed/all_gather.py)."""

    ROLE = "weight"
    DESCRIPTION = "a weight that FSDP2 all-gathered in FP8"
    REMEDY = ("If a module other than its FP8 layer uses this weight (weight tying), or you need the weight during "
              "forward, turn FP8 all-gather off for it (fp8_all_gather=False, or keep the layer out of FP8).")


class GatheredFP8Input(GatheredFP8Tensor):
    """A sequence-parallel input tensor parallelism all-gathered in FP8 (lightning_fp8/distributed/sequence_parallel.py):
    the whole sequence, cast once with one scale every rank of the tensor-parallel group agreed on."""

    ROLE = "input"
    DESCRIPTION = "an input that sequence parallelism all-gathered in FP8"
    REMEDY = ("Only FP8 layers may read the input FP8ColwiseParallel / PrepareFP8ModuleInput gathers; where other "
              "code reads it, use torch's ColwiseParallel / PrepareModuleInput for that module (a high-precision "
              "all-gather).")


def resolve_gathered(tensor: Tensor, recipe: FP8Recipe, record: bool, fp8: bool) -> Tensor:
    """`tensor` unless it is a precast operand that this forward cannot consume as it is (see `resolve`)."""
    if isinstance(tensor, GatheredFP8Tensor):
        return tensor.resolve(recipe, record, fp8)
    return tensor


def observed_weight(tensor: Tensor) -> Tensor:
    """What an observer samples for `tensor` (a precast operand's high-precision local part)."""
    return tensor.observed() if isinstance(tensor, GatheredFP8Tensor) else tensor
