"""FP8 all-gather of FP8 layers' weights under FSDP2: each rank casts its shard, the all-gather moves 1 byte/element.

How it plugs into FSDP2 (`torch.distributed.fsdp.fully_shard`), through the all-gather extension FSDP2 offers to
tensor subclasses (the same hooks in torch 2.11 and 2.13):

- `enable_fp8_all_gather(model)`, called after conversion and BEFORE `fully_shard` (FSDP2 reads the extension when
  it shards), wraps the weight of every eligible FP8 layer in an `FP8AllGatherWeight`: the high-precision tensor
  (the fp32 master) behaving as itself everywhere (optimizer, checkpoints, state_dict), plus the two hooks.
- `fsdp_pre_all_gather`, before each unshard: the scale every rank computes identically, `cast_scale` of the
  layer's weight history (identical on all ranks: the engine all-reduces it at each step's close; a layer trained
  without an engine closes its pending step here first, as its forward would) and of the full weight's amax. Then
  the shard is cast straight from its fp32 values (one rounding, the bytes a DDP run's cast of the whole weight
  produces) and handed to FSDP2 as uint8 (collectives do not take float8 dtypes: gloo rejects them).
- The full weight's amax, for all layers in one collective: `precompute_fp8_weight_amaxes(model)` (after the optimizer
  step, as torchao's precompute_float8_dynamic_scale_for_fsdp) takes every layer's shard amax with one fused
  `torch._foreach_norm(inf)` and MAX-all-reduces them as one vector; without that call, the first gather of a forward
  that finds no valid amax agrees those of every layer enabled with it the same way. The gathers then issue none.
  An agreed amax is valid while it is the current weights': no step of an optimizer holding these weights (a global
  optimizer hook counts them) and no write to the shard through this subclass (in place, out=, foreach, through any
  view of it) since. Those inputs are the same on every rank, so every rank decides alike and the collectives stay
  matched; a late or missing call costs a collective, never a stale scale. Backward re-gathers reuse the forward's
  amax (the weights cannot have changed in between).
- `fsdp_post_all_gather` (on the compute stream) ties the scale and amax made on FSDP2's copy-in stream to the
  compute stream (`record_stream`: FSDP2 drops the metadata right after the hook, and their memory must not be reused
  before the compute stream has read it), and wraps the gathered bytes as a `GatheredFP8Weight`
  (lightning_fp8/modules/gathered_fp8.py): the FP8 layer feeds its data and scale to the forward and dgrad GEMMs without
  casting again, and every path that does not compute in FP8 with that cast (fp8_autocast(enabled=False),
  fp8_eval=False, a layer FP8LayerFallback moved to BF16, calibration, a recipe override) gets the exact
  high-precision weight through `_HighPrecisionGather`, one all-gather of the shard in FSDP2's param_dtype: what
  FSDP2 would have gathered without FP8 all-gather.

Which layers: FP8 layers with a per-tensor recipe (delayed or current scaling: one scale for the whole weight can be
agreed before the gather; fine-grained recipes scale tiles and keep their weight gathered in high precision), whose
GEMM reads the weight Parameter itself (FP8Linear; transformers' Conv1D reads it transposed) and whose weight no
other module uses (a tied embedding would read FP8 values). `fp8_all_gather_reason(layer)` says why a layer is not.
Assumes FSDP2's default placement, Shard(0), on a 1-D mesh (HSDP is untested). Under FSDP2 x TP the weight FSDP2
shards is the tensor-parallel shard (a DTensor's local tensor): the all-gather runs over the data-parallel dimension
and the gathered weight is that shard, which the FP8 layer's tensor-parallel forward computes with
(lightning_fp8/modules/local_shards.py).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.modules.autocast import current_state
from lightning_fp8.modules.cast import cast_to_fp8
from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.modules.gathered_fp8 import CastKey, GatheredFP8Weight
from lightning_fp8.modules.local_shards import is_dtensor
from lightning_fp8.numerics.formats import get_format
from lightning_fp8.numerics.scaling import cast_scale
from lightning_fp8.recipe import PER_TENSOR_SCALINGS

aten = torch.ops.aten

#: ops FSDP2 (and checkpoint code) apply to the weight while sharding and saving it, whose result is the same weight
#: (a shard, a copy, a view): they keep the subclass so the sharded parameter still carries the hooks
_PRESERVING_OPS = {
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor, aten.narrow.default,
    aten.copy_.default, aten.view.default, aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.clone.default, aten.detach.default, aten.alias.default,
    aten.chunk.default,
}
#: those of them whose result is a view of the same memory: it shares the shard's write counter (`_writes`)
_VIEW_OPS = {
    aten.slice.Tensor, aten.narrow.default, aten.view.default, aten.as_strided.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.detach.default, aten.alias.default, aten.chunk.default,
}
#: the cast of a layer whose recipe has no per-tensor weight scale (its gathered FP8 copy is never read)
_PLACEHOLDER_CAST = CastKey(fmt="e4m3", scaling="current", algo_max=True, margin=0, power_of_2=False)
#: why a layer was left out of FP8 all-gather (set by enable_fp8_all_gather)
_REASON_ATTR = "_fp8_all_gather_reason"
#: a layer's weight amax agreed ahead of its gather (an _AgreedAmax; precompute_fp8_weight_amaxes or the lazy refresh)
_AMAX_ATTR = "_fp8_all_gather_amax"
#: the layers enable_fp8_all_gather enabled together (one list shared by them): what one agreement covers
_BATCH_ATTR = "_fp8_all_gather_batch"
#: (shard, group ranks) of a layer's last gather: its shard while FSDP2 holds it unsharded, the group FSDP2 gathers on
_SHARD_ATTR = "_fp8_all_gather_shard"
#: set on a layer whose weight gathers in high precision although it is an FP8AllGatherWeight: the conversion rules
#: kept the layer in BF16 after FSDP2 had sharded it (`gather_in_high_precision`)
_HIGH_PRECISION_ATTR = "_fp8_all_gather_high_precision"


class FP8AllGatherWeight(torch.Tensor):
    """A weight (and, once FSDP2 sharded it, this rank's shard of it) whose FSDP2 all-gather moves FP8 bytes.

    Everywhere but FSDP2's all-gather it is the high-precision tensor it wraps: ops run on that tensor (in-place ones
    update it), and it pickles as that tensor, so checkpoints hold plain tensors and load with weights_only=True into
    models with or without FP8 all-gather."""

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, writes: Optional[List[int]] = None) -> "FP8AllGatherWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, writes: Optional[List[int]] = None) -> None:
        self._tensor = tensor
        #: the full weight's amax of the last forward gather, reused by backward re-gathers (same weights)
        self._gathered_amax: Optional[torch.Tensor] = None
        #: how many ops wrote to this memory through the subclass (shared by views of it): an agreed amax is stale
        #: once it changed. (torch's own `_version` is not: DTensor and foreach / fused optimizer steps leave it as is)
        self._writes: List[int] = writes if writes is not None else [0]

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._tensor!r})"

    def __reduce_ex__(self, protocol):
        return self._tensor.__reduce_ex__(protocol)

    def data_ptr(self) -> int:  # frameworks that map parameters by storage address (Accelerate's FSDP2 prepare)
        return self._tensor.data_ptr()

    def untyped_storage(self):
        return self._tensor.untyped_storage()

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_tensor"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(
            FP8AllGatherWeight, lambda t: t._tensor, (args, kwargs or {})
        )
        out = func(*unwrapped_args, **unwrapped_kwargs)
        _count_writes(func, args, kwargs or {})
        if func._schema.name.endswith("_") and args and isinstance(args[0], FP8AllGatherWeight):
            return args[0]  # an in-place op returns its (updated) self
        if func in _PRESERVING_OPS:
            source = next((a for a in pytree.tree_leaves(args) if isinstance(a, FP8AllGatherWeight)), None)
            writes = source._writes if func in _VIEW_OPS and source is not None else None
            return pytree.tree_map_only(torch.Tensor, lambda t: FP8AllGatherWeight(t, writes), out)
        return out

    # -- FSDP2's all-gather extension -------------------------------------------------------------------------------
    @torch.no_grad()
    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride, module: nn.Module, mp_policy):
        """(all-gather inputs, metadata): this shard cast to FP8 with the scale all ranks share, as uint8."""
        layer = module
        if not isinstance(layer, FP8Layer):
            raise RuntimeError(f"lightning_fp8: an FP8AllGatherWeight belongs to a {type(layer).__name__}, not an FP8 layer")
        group = _shard_group(mesh)
        world = dist.get_world_size(group)
        local = self._tensor
        if tuple(local.shape[1:]) != tuple(outer_size[1:]):
            raise NotImplementedError(
                "lightning_fp8: FP8 all-gather supports FSDP2's default Shard(0) placement only; this weight is sharded "
                f"as {tuple(local.shape)} of {tuple(outer_size)}. Use fp8_all_gather=False for this model."
            )
        padded_rows = math.ceil(outer_size[0] / world)
        if _HIGH_PRECISION_ATTR in layer.__dict__:
            # a layer the conversion rules kept in BF16 after it was sharded (built inside configure_model): FSDP2's
            # own gather, in its param_dtype, 2 bytes per element under BF16 mixed precision, never FP8 as well
            dtype = getattr(mp_policy, "param_dtype", None) or local.dtype
            data = local.to(dtype)
            if local.shape[0] != padded_rows:
                data = torch.cat([data, data.new_zeros((padded_rows - local.shape[0], *local.shape[1:]))])
            return (data,), None
        record = layer.training
        autocast_state = current_state()
        if not _in_backward() and layer.fp8_enabled and autocast_state.enabled and not autocast_state.calibrating:
            layer.close_pending_step()  # its FP8 forward does this first: the scale must come from the closed history
        cast_key = CastKey.of(layer.recipe, record)
        if cast_key is None:
            # the layer's recipe became fine-grained after sharding (FP8LayerFallback's escalation): its forward
            # takes the exact high-precision gather instead (the keys cannot match); these bytes go unused
            cast_key = _PLACEHOLDER_CAST
        fmt = get_format(cast_key.fmt)
        layer.__dict__[_SHARD_ATTR] = (self, _group_ranks(group), group)
        amax = self._full_amax(layer, group)
        history_row = layer.fp8_meta.weight.amax_history
        scale = cast_scale(history_row, amax, fmt.max, cast_key.scaling, cast_key.algo_max, cast_key.margin,
                           cast_key.power_of_2)
        if local.shape[0] != padded_rows:  # uneven sharding: every rank sends the padded shard size
            padded = local.new_zeros((padded_rows, *local.shape[1:]))
            padded[: local.shape[0]].copy_(local)
            local = padded
        data = cast_to_fp8(local, scale, fmt)
        meta = _GatherMeta(scale, amax, cast_key, fmt.dtype, group, int(outer_size[0]), padded_rows)
        return (data.view(torch.uint8),), meta

    @torch.no_grad()
    def fsdp_post_all_gather(self, all_gather_outputs: Tuple[torch.Tensor, ...], metadata: "_GatherMeta",
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None):
        """The unsharded weight: a GatheredFP8Weight over the gathered bytes (FSDP2 narrows the padding away)."""
        (data,) = all_gather_outputs
        if metadata is None:  # the high-precision gather (fsdp_pre_all_gather): the gathered rows are the weight
            return None if out is not None else (data, (data,))
        # the scale and amax were made on FSDP2's copy-in stream and are read here on the current one; FSDP2 drops the
        # metadata when this returns, so the caching allocator could hand their memory to the next layer's copy-in
        # before the reads below ran: tie them to this stream
        keep_for_current_stream(metadata.scale, metadata.amax)
        if out is not None:  # FSDP2 re-gathered into the same buffers: only the cast's scale, amax and key can differ
            if is_dtensor(out):  # FSDP2 x TP: FSDP2 hands back the unsharded DTensor over the tensor-parallel mesh
                out = out.to_local()
            out.update(metadata.scale, metadata.amax, metadata.cast_key)
            out._source.shard = self  # the shard FSDP2 holds now (a load may have replaced the tensor object)
            return None
        source = _ShardSource(self, metadata.group, metadata.rows, metadata.padded_rows, param_dtype)
        weight = GatheredFP8Weight(data.view(metadata.fp8_dtype), metadata.scale.clone(), metadata.amax.clone(),
                                  metadata.cast_key, source, param_dtype)
        return weight, (data,)

    def _full_amax(self, layer: FP8Layer, group) -> torch.Tensor:
        """max |W| over every rank's shard, identical on every rank. A forward gather takes the amax agreed for this
        layer's current shard (precompute_fp8_weight_amaxes after the optimizer step); when there is none, or the
        weights changed since (an optimizer step, an in-place write), it agrees the amaxes of every layer enabled
        with it first, in one MAX all-reduce (`_agree_batch`): one collective per forward at most, not one per layer.
        A backward re-gather (weights unchanged since its forward) reuses the forward's."""
        if _in_backward() and self._gathered_amax is not None:
            return self._gathered_amax
        if not _holds(layer, self, group):
            _agree_batch(layer, self, group)
        agreed = layer.__dict__[_AMAX_ATTR]
        keep_for_current_stream(agreed.amax)  # maybe agreed on another stream (after the step): read on this one
        self._gathered_amax = agreed.amax
        return self._gathered_amax


# -- the weight amaxes, agreed for all layers at once -------------------------------------------------------------
@dataclass
class _AgreedAmax:
    """A layer's full weight amax as every rank of its shard group agreed it, and what it was agreed for: the shard's
    memory (its write counter and the count then) and the number of optimizer steps taken in this process then."""
    amax: torch.Tensor
    group_ranks: Tuple[int, ...]
    writes: List[int]
    write_count: int
    optimizer_steps: int

    def holds_for(self, shard: "FP8AllGatherWeight", group) -> bool:
        """Whether it is still the amax of `shard`, gathered over `group`. Every input is the same on every rank
        (the same ops run on every rank's shard), so every rank decides the same and the collectives stay matched."""
        return (self.writes is shard._writes and self.write_count == shard._writes[0]
                and self.optimizer_steps == _OPTIMIZER_STEPS[0] and self.group_ranks == _group_ranks(group))


#: steps taken in this process by optimizers of FP8-all-gather weights (a global step hook counts them). An optimizer
#: may update a shard without writing through the subclass (FP8AdamW leaves an empty shard alone, a fused kernel may
#: write by pointer), and an empty shard's rank would then miss the change the other ranks see: a step invalidates all
_OPTIMIZER_STEPS = [0]
_STEP_HOOK: List[Any] = []
#: optimizer -> (its parameter count, whether one of them is an FP8-all-gather weight), refreshed when the count changes
_OPTIMIZER_HOLDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: written arguments (index, name) of each op's schema, for `_count_writes`
_WRITTEN_ARGS: Dict[Any, Tuple[Tuple[int, str], ...]] = {}


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    known = _OPTIMIZER_HOLDS.get(optimizer)
    if known is None or known[0] != len(params):
        holds = any(isinstance(p._local_tensor if is_dtensor(p) else p, FP8AllGatherWeight) for p in params)
        known = _OPTIMIZER_HOLDS[optimizer] = (len(params), holds)
    if known[1]:  # another model's optimizer leaves these amaxes valid
        _OPTIMIZER_STEPS[0] += 1


def _watch_optimizer_steps() -> None:
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_count_optimizer_step))


def _count_writes(func, args, kwargs) -> None:
    """Count a write to every FP8AllGatherWeight `func` writes to (in-place ops, out= arguments, foreach lists)."""
    written = _WRITTEN_ARGS.get(func)
    if written is None:
        schema = getattr(func, "_schema", None)
        written = tuple((i, a.name) for i, a in enumerate(schema.arguments if schema is not None else ())
                        if a.alias_info is not None and a.alias_info.is_write)
        _WRITTEN_ARGS[func] = written
    for index, name in written:
        value = args[index] if index < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, FP8AllGatherWeight):
                t._writes[0] += 1


def _group_ranks(group) -> Tuple[int, ...]:
    """The global ranks of `group`: what an agreement records (groups do not deep-copy) and compares."""
    return tuple(dist.get_process_group_ranks(group))


def _fsdp_group(weight: torch.Tensor):
    """The group FSDP2 shards `weight` (its sharded DTensor parameter) over: the first mesh dimension that shards it
    (1-D FSDP: the mesh; FSDP2 x TP: the data-parallel dimension before the tensor-parallel one; HSDP: the shard
    dimension after the replicate one). None when it is not a sharded DTensor."""
    if not is_dtensor(weight):
        return None
    dims = [i for i, p in enumerate(weight.placements) if not (p.is_replicate() or p.is_partial())]
    if not dims:
        return None
    mesh = weight.device_mesh
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group(dims[0])


def _shard_and_group(layer: nn.Module) -> Tuple[Optional["FP8AllGatherWeight"], Optional[Tuple[int, ...]], Any]:
    """(this rank's shard of `layer`'s weight, the ranks of the group FSDP2 gathers it over, that group), or (None,
    None, None): the sharded parameter while FSDP2 holds it sharded, else the shard and group of its last gather.
    The group object itself travels with the layer, never through a cache keyed by ranks (a process group destroyed
    and created again over the same ranks would leave a dead object there)."""
    weight = layer.__dict__.get("_parameters", {}).get("weight")
    recorded = layer.__dict__.get(_SHARD_ATTR)
    if weight is not None and is_dtensor(weight) and isinstance(weight._local_tensor, FP8AllGatherWeight):
        if recorded is not None and recorded[0] is weight._local_tensor:
            return recorded
        group = _fsdp_group(weight)
        return (weight._local_tensor, _group_ranks(group), group) if group is not None else (None, None, None)
    return recorded if recorded is not None else (None, None, None)


def _local_amaxes(shards: List[torch.Tensor]) -> torch.Tensor:
    """max |shard| of each shard as one float32 vector (0 for an empty shard, as tensor_amax; NaN and inf kept): one
    fused kernel (`torch._foreach_norm`, ord=inf) for all of them rather than one reduction per layer."""
    nonempty = [i for i, t in enumerate(shards) if t.numel() > 0]
    values = [torch.zeros((), dtype=torch.float32, device=shards[0].device)] * len(shards)
    if nonempty:
        for i, norm in zip(nonempty, torch._foreach_norm([shards[i] for i in nonempty], ord=math.inf)):
            values[i] = norm.to(torch.float32)  # a no-op for float32 masters
    return torch.stack(values)


def _all_reduce_max(tensor: torch.Tensor, group) -> None:
    """The amax agreement's collective (one place, so tests can count it)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


@torch.no_grad()
def _agree(items: List[Tuple[nn.Module, "FP8AllGatherWeight"]], group) -> None:
    """Agree the full weight amax of each (layer, shard) over `group`: one MAX all-reduce of their local amaxes."""
    _watch_optimizer_steps()
    amaxes = _local_amaxes([shard._tensor for _, shard in items])
    amaxes = torch.where(torch.isnan(amaxes), math.inf, amaxes)  # NaN can lose a MAX reduction (gloo drops it); inf wins
    _all_reduce_max(amaxes, group)
    ranks, steps = _group_ranks(group), _OPTIMIZER_STEPS[0]
    for i, (layer, shard) in enumerate(items):
        layer.__dict__[_AMAX_ATTR] = _AgreedAmax(amaxes[i], ranks, shard._writes, shard._writes[0], steps)


def _agree_batch(layer: nn.Module, shard: "FP8AllGatherWeight", group) -> None:
    """A gather found no amax agreed for `layer`'s current weights: agree the amaxes of every layer enabled together
    with it (and gathered over the same group) at once, so the gathers of the others in this forward need none."""
    ranks = _group_ranks(group)
    items = [(layer, shard)]
    for other in layer.__dict__.get(_BATCH_ATTR, ()):
        if other is layer:
            continue
        other_shard, other_ranks, _ = _shard_and_group(other)
        if other_shard is not None and other_ranks == ranks:
            items.append((other, other_shard))
    _agree(items, group)


@torch.no_grad()
def precompute_fp8_weight_amaxes(model: nn.Module, always: bool = False) -> int:
    """Agree the weight amax of every FP8-all-gather layer of `model` now: one MAX all-reduce per shard group (one
    under FSDP2 and FSDP2 x TP), so the forward's gathers need no collective. Call it on every rank after the optimizer
    step (as torchao's precompute_float8_dynamic_scale_for_fsdp); the engine does, at each iteration's close.
    Returns the number of layers agreed: 0, and no collective, when every amax agreed before still holds (a skipped
    step), unless `always`: the engine agrees at every close regardless, so that every rank's agreements restart
    from the same point each iteration even if some write reached only some ranks' shards (an uneven in-place load:
    a rank with an empty shard sees no write), which would otherwise split the ranks on whether to agree.

    Optional: without it the first gather of a forward agrees them all the same way (from FSDP2's copy-in stream).
    An agreed amax is used only while it is the current weights' (no optimizer step and no write to the shard
    since), so a late or missing call costs a collective, never a stale scale. Weights must change alike on every
    rank (as optimizer steps, loads and rollbacks do): a write to one rank's shard alone makes that rank agree alone."""
    by_group: Dict[Tuple[int, ...], Tuple[Any, List[Tuple[nn.Module, FP8AllGatherWeight]]]] = {}
    for layer in fp8_layers(model).values():
        if _BATCH_ATTR not in layer.__dict__:
            continue
        shard, ranks, group = _shard_and_group(layer)
        if shard is not None:
            by_group.setdefault(ranks, (group, []))[1].append((layer, shard))
    agreed = 0
    for group, items in by_group.values():
        if not always and all(_holds(layer, shard, group) for layer, shard in items):
            continue  # nothing changed since the last agreement (a skipped step): no collective
        _agree(items, group)
        agreed += len(items)
    return agreed


def _holds(layer: nn.Module, shard: "FP8AllGatherWeight", group) -> bool:
    agreed = layer.__dict__.get(_AMAX_ATTR)
    return agreed is not None and agreed.holds_for(shard, group)


@dataclass
class _GatherMeta:
    scale: torch.Tensor
    amax: torch.Tensor
    cast_key: CastKey
    fp8_dtype: torch.dtype
    group: Any
    rows: int
    padded_rows: int


class _ShardSource:
    """The exact high-precision weight behind a GatheredFP8Weight: a high-precision all-gather of this rank's shard."""

    def __init__(self, shard: FP8AllGatherWeight, group, rows: int, padded_rows: int, dtype: torch.dtype) -> None:
        self.shard, self.group, self.rows, self.padded_rows, self.dtype = shard, group, rows, padded_rows, dtype

    def high_precision(self, weight: GatheredFP8Weight) -> torch.Tensor:
        return _HighPrecisionGather.apply(weight, self)

    def local_high_precision(self) -> torch.Tensor:
        return self.shard._tensor

    @torch.no_grad()
    def gather(self) -> torch.Tensor:
        local = self.shard._tensor.to(self.dtype)
        world = dist.get_world_size(self.group)
        padded = local.new_zeros((self.padded_rows, *local.shape[1:]))
        padded[: local.shape[0]].copy_(local)
        out = local.new_empty((world * self.padded_rows, *local.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=self.group)
        return out[: self.rows]


class _HighPrecisionGather(torch.autograd.Function):
    """The high-precision weight from the shards, standing in for the precast weight in autograd: its gradient is the
    gradient of the unsharded parameter, which FSDP2 reduce-scatters as usual."""

    @staticmethod
    def forward(ctx, weight: GatheredFP8Weight, source: _ShardSource) -> torch.Tensor:
        return source.gather()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def keep_for_current_stream(*tensors: torch.Tensor) -> None:
    """Keep the memory of CUDA tensors allocated on another stream from being reused before the work queued on the
    current stream (which reads them) has run: `record_stream`. CPU tensors have no streams."""
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))


def _in_backward() -> bool:
    """Whether a backward pass is running (FSDP2 re-gathers the weights for it)."""
    return torch._C._current_graph_task_id() != -1


def _shard_group(mesh):
    """The process group FSDP2 shards over (a 1-D mesh's group; for a 2-D HSDP mesh, its shard dimension)."""
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group(mesh.ndim - 1)


# -- model level --------------------------------------------------------------------------------------------------
def fp8_all_gather_reason(layer: nn.Module) -> Optional[str]:
    """Why `layer` gathers its weight in high precision (None: it gathers in FP8, or enable_fp8_all_gather has not run)."""
    return layer.__dict__.get(_REASON_ATTR)


def _ineligible_reason(layer: FP8Layer, fqn: str, users: Dict[int, int]) -> Optional[str]:
    weight = layer.weight
    if layer.recipe.scaling not in PER_TENSOR_SCALINGS:
        return (f"recipe scaling {layer.recipe.scaling!r} scales tiles of the weight: FP8 all-gather needs one scale "
                "per tensor (delayed or current scaling)")
    if layer.fp8_weight() is not weight:
        return "its GEMM reads the weight transposed (fp8_weight() is not the weight Parameter)"
    if users.get(id(weight), 0) > 1:
        return "its weight is shared with another module (tied weights would read FP8 values)"
    if weight.dim() != 2 or not weight.is_floating_point():
        return f"weight of shape {tuple(weight.shape)} / {weight.dtype} is not a 2-D floating-point matrix"
    return None


def explain_high_precision_gather(layer: FP8Layer, fqn: str, users: Dict[int, int]) -> None:
    """Why a layer built with an FP8 all-gather weight gathers in high precision after all (its weight was replaced
    after it was built: tied to another module's, or assigned), recorded as `fp8_all_gather_reason` reads it.
    `users`: how many modules use each Parameter (id -> count)."""
    if _REASON_ATTR not in layer.__dict__:
        layer.__dict__[_REASON_ATTR] = (_ineligible_reason(layer, fqn, users)
                                        or "its weight was replaced after the layer was built (FP8 all-gather is "
                                           "installed on the weight a layer is built with)")


def enable_fp8_all_gather(model: nn.Module) -> Dict[str, Optional[str]]:
    """Make FSDP2 all-gather the weights of `model`'s FP8 layers in FP8. Call after conversion, before `fully_shard`.

    Returns {layer fqn: None (FP8 all-gather) or the reason it stays in high precision}. Calling it again is a
    no-op for layers already enabled. The weight Parameters are replaced by new Parameters over the same data
    (FSDP2 replaces them again when it shards), so build optimizers afterwards, as FSDP2 requires anyway."""
    from lightning_fp8.distributed.sharding import is_fsdp_sharded

    if is_fsdp_sharded(model):
        raise RuntimeError(
            "lightning_fp8: enable_fp8_all_gather must run before fully_shard: FSDP2 reads the weights' all-gather "
            "extension when it shards them. Convert and enable first, then call fully_shard."
        )
    users: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        users[id(p)] = users.get(id(p), 0) + 1
    decisions: Dict[str, Optional[str]] = {}
    batch: List[nn.Module] = []  # the layers enabled here: one amax agreement covers them all
    for fqn, layer in fp8_layers(model).items():
        decisions[fqn] = enable_fp8_all_gather_layer(layer, batch, users, fqn)
    return decisions


def enable_fp8_all_gather_layer(layer: FP8Layer, batch: List[nn.Module], users: Optional[Dict[int, int]] = None,
                                fqn: str = "") -> Optional[str]:
    """`enable_fp8_all_gather` for one FP8 layer, joining `batch` (the layers whose weight amaxes one agreement
    covers; share one list between the layers of a model). `users`: how many modules use each Parameter (id -> count),
    for the tied-weights rule; default: the layer's own. Returns None (FP8 all-gather) or the reason it is not."""
    if uses_fp8_all_gather(layer):
        return None
    if users is None:
        users = {id(p): 1 for p in layer.parameters()}
    reason = _ineligible_reason(layer, fqn, users)
    if reason is not None:
        layer.__dict__[_REASON_ATTR] = reason
        return reason
    layer.__dict__.pop(_REASON_ATTR, None)
    weight = layer.weight
    layer.weight = nn.Parameter(_with_fp8_all_gather(weight.detach()), requires_grad=weight.requires_grad)
    layer.__dict__[_BATCH_ATTR] = batch
    batch.append(layer)
    _watch_optimizer_steps()
    return None


def disable_fp8_all_gather(model: nn.Module) -> int:
    """Undo `enable_fp8_all_gather` on a model FSDP2 did not shard (the plugins enable it before the user's sharding
    code runs, which may apply tensor parallelism alone): the weights become plain Parameters over the same data again
    (a tensor-parallel DTensor keeps its placements), so no op goes through the all-gather subclass for nothing. Before
    the optimizer is built (the Parameters are new objects). Returns how many layers changed."""
    from lightning_fp8.distributed.sharding import is_fsdp_sharded

    if is_fsdp_sharded(model):
        raise RuntimeError("lightning_fp8: disable_fp8_all_gather is for models FSDP2 did not shard")
    changed = 0
    for layer in fp8_layers(model).values():
        weight = layer.__dict__.get("_parameters", {}).get("weight")
        local = weight.to_local() if is_dtensor(weight) else weight
        for attr in (_BATCH_ATTR, _AMAX_ATTR, _SHARD_ATTR, _HIGH_PRECISION_ATTR):
            layer.__dict__.pop(attr, None)
        if not isinstance(local, FP8AllGatherWeight):
            continue
        if is_dtensor(weight):
            from torch.distributed.tensor import DTensor

            plain = DTensor.from_local(local._tensor, weight.device_mesh, weight.placements, run_check=False,
                                       shape=weight.shape, stride=weight.stride())
        else:
            plain = local._tensor
        layer.weight = nn.Parameter(plain, requires_grad=weight.requires_grad)
        changed += 1
    return changed


def gather_in_high_precision(layer: FP8Layer, reason: str) -> None:
    """An FP8-all-gather layer that will not compute in FP8 from its first forward on (the conversion rules kept it in
    BF16 after FSDP2 had sharded it, so it could not be given back its plain class): FSDP2 gathers its weight in
    high precision (its param_dtype), not in FP8 and then again in high precision as a BF16 fallback's would be.
    Decided before the first all-gather and fixed from then on (FSDP2 sizes its buffers at the first gather);
    `fp8_all_gather_reason(layer)` returns `reason`. If the layer is switched to FP8 later, it casts the gathered
    high-precision weight itself."""
    layer.__dict__[_HIGH_PRECISION_ATTR] = True
    layer.__dict__[_REASON_ATTR] = reason
    batch = layer.__dict__.pop(_BATCH_ATTR, None)
    if batch is not None and layer in batch:
        batch.remove(layer)


def _with_fp8_all_gather(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as an FP8AllGatherWeight; a weight tensor parallelism split already (a DTensor) keeps its placements
    and gets its local shard wrapped, which is what FSDP2 shards further (FSDP2 x TP)."""
    if is_dtensor(weight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(FP8AllGatherWeight(weight.to_local()), weight.device_mesh, weight.placements,
                                  run_check=False, shape=weight.shape, stride=weight.stride())
    return FP8AllGatherWeight(weight)


def uses_fp8_all_gather(layer: nn.Module) -> bool:
    """Whether FSDP2 gathers `layer`'s weight in FP8: asked of the layer, whatever state FSDP2 holds the weight in at
    the moment. Sharded, the weight is an FP8AllGatherWeight; gathered (between a forward and its backward, or after
    a forward of a unit with `reshard_after_forward=False`, or of the root unit, which FSDP2 never reshards after
    forward) it is the GatheredFP8Weight that gather produced, or the high-precision tensor of a layer kept in BF16
    (`gather_in_high_precision`: False)."""
    if _HIGH_PRECISION_ATTR in layer.__dict__:
        return False
    weight = layer.__dict__.get("_parameters", {}).get("weight")
    if weight is None:
        return False
    local = weight.to_local() if is_dtensor(weight) else weight
    if isinstance(local, FP8AllGatherWeight):
        return True
    # unsharded by FSDP2: the FP8 gather's output, on a layer enabled for it
    return isinstance(local, GatheredFP8Weight) and _BATCH_ATTR in layer.__dict__
