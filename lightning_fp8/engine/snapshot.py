"""Rollback snapshots: the last known-good training state in host memory, cheap enough to take often (`snapshot_every`).

What a snapshot holds (everything an iteration can change): every parameter and persistent buffer of the model (the
FP8 metadata included: its buffers are persistent in `FP8LayerState`, only the layer's state_dict leaves them out),
the state and hyperparameters (learning rate included) of every optimizer, the state of every LR scheduler, and the
engine's own extra state (the loss scaler). Restoring copies the values back into the live tensors in place, so
optimizer references to Parameters, weight tying and sharded (DTensor) parameters stay as they are.

Why it is cheap:
- host memory is one flat buffer per dtype (`HostBufferPlan`: every tensor of that dtype a view at a 64-byte aligned
  offset), allocated at the first snapshot and reused by every later one that holds the same tensors; a snapshot
  whose tensors changed (optimizer state created after the first one, an optimizer joining) allocates again;
- on CUDA the device-to-host copies are issued with `non_blocking=True` on a side stream, after that stream waited
  for the main stream, and an event marks their end. Nothing waits for them on the host: the forward and backward
  of the next iteration overlap the copies, and only the next in-place update of what is being copied (the
  optimizer step, a restore) waits for the event, on the device (`fence`). Buffers, which the forward itself
  updates in place (batch-norm statistics, FP8 amax histories), are first cloned on the main stream (they are small)
  and the clones copied;
- sharded parameters and optimizer state (DTensor, as FSDP2 produces) are copied as their local shards
  (`to_local()`): every rank holds its own shard on the host, sharded state stays sharded, and a restore rebuilds
  DTensors with their original mesh and placements where it has to create a tensor;
- before allocating, the host bytes the new buffers take, times the ranks on this node that take snapshots too
  (`local_snapshot_ranks`), are compared with the node's available host memory (psutil), and a
  `SnapshotMemoryError` names them and what to do instead of letting the processes be killed.

Why the buffers are pinned by registration and not with `pin_memory=True`: the copies can only overlap the training
step from page-locked ("pinned") host memory, and torch's pinned allocator (the caching host allocator behind
`pin_memory=True`) rounds every request up to the next power of two and page-locks the whole rounded block (with
cudaHostAlloc, or cudaHostRegister of the rounded size); it never splits a block, and only requests above the
allocator settings `pinned_max_round_threshold_mb` / `pinned_max_cached_size_mb` (unlimited by default) keep their
size. Through it, a snapshot could lock up to twice the bytes of the state it holds, per tensor or as one flat
buffer. So each flat buffer is allocated by torch's ordinary host allocator, which takes the bytes asked for, and
page-locked in place with `cudaHostRegister` (through `torch.cuda.cudart()`; torch's own asynchronous checkpoint
stager pins its host copies the same way): the pinned bytes are the buffer's bytes, in whole pages. Such a buffer
is outside the caching allocator, which therefore does not keep it alive for copies still in flight: the snapshot
keeps the last event of every device stream that copies to or from it, and waits for them before it unpins and frees
a buffer (only when its tensors changed, or the snapshot is dropped).

On CPU there is nothing to overlap with and nothing to pin: each tensor is copied synchronously (a memcpy) into its
view of the reused buffer while the engine waits, so a snapshot costs one pass over the state and no allocation
after the first.
"""
from __future__ import annotations

import copy
import mmap
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

try:  # DTensor (sharded tensors, FSDP2); absent from builds without torch.distributed
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

Key = Tuple[Any, ...]


class SnapshotMemoryError(MemoryError):
    """The host cannot hold (or pin) a rollback snapshot; the message names the bytes per rank, the ranks counted on
    this node, the memory available and what to change."""


ALIGNMENT = 64  # bytes: torch's CPU allocator aligns every allocation so; each view in a flat buffer starts aligned too
PAGE = mmap.PAGESIZE  # the host allocator maps, and registration page-locks, whole pages
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context (torch's stager uses it too)


@dataclass(frozen=True)
class HostBufferPlan:
    """One flat host buffer: the tensors of one dtype (and pinning) of one capture, each a view at an aligned offset.

    Two plans are equal when they hold the same tensors (keys, shapes) at the same offsets: a later snapshot with an
    equal plan reuses the buffer as it is."""

    dtype: torch.dtype
    pinned: bool
    slots: Tuple[Tuple[Key, torch.Size, int], ...]  # (key, shape, offset in elements)
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def host_bytes(self) -> int:
        """What the allocation takes from the host: whole pages (pinned: exactly the pages registration locks)."""
        return -(-self.nbytes // PAGE) * PAGE


def pinned_for(device: torch.device) -> bool:
    """Whether the host copy of a tensor on `device` is page-locked: on CUDA, so the copies can run asynchronously
    (from pageable memory a device-to-host copy returns only when done); CPU tensors are copied by a memcpy."""
    return device.type == "cuda"


def plan_host_buffers(tensors: Sequence[Tuple[Key, torch.Tensor]]) -> List[HostBufferPlan]:
    """One plan per (dtype, pinned) among `tensors` (local tensors: shapes and dtypes are all it reads, so meta
    tensors plan too), tensors in the order given; pinned where `pinned_for` says so."""
    groups: Dict[Tuple[torch.dtype, bool], List[Tuple[Key, torch.Size, int]]] = {}
    ends: Dict[Tuple[torch.dtype, bool], int] = {}
    for key, t in tensors:
        group = (t.dtype, pinned_for(t.device))
        step = max(1, ALIGNMENT // t.dtype.itemsize)
        offset = -(-ends.get(group, 0) // step) * step
        groups.setdefault(group, []).append((key, t.shape, offset))
        ends[group] = offset + t.numel()
    return [HostBufferPlan(dtype, pinned, tuple(slots), ends[(dtype, pinned)])
            for (dtype, pinned), slots in groups.items()]


class _HostBuffer:
    """The allocation of one `HostBufferPlan`: a flat host tensor (torch's host allocator: exactly its bytes, no
    power-of-two rounding), page-locked in place when the plan is pinned, and the views the snapshot copies into.

    `last_use` holds, per device, an event recorded after the last copies to or from the buffer on that device's
    streams; releasing the buffer waits for them first (the caching host allocator that would otherwise keep the
    memory alive for copies in flight does not own this buffer)."""

    def __init__(self, plan: HostBufferPlan) -> None:
        self.plan = plan
        self.last_use: Dict[torch.device, Any] = {}
        self.flat: Optional[torch.Tensor] = torch.empty(plan.numel, dtype=plan.dtype, device="cpu")
        self._unpin: Optional[weakref.finalize] = None
        if plan.pinned and plan.nbytes:  # registering 0 bytes is an error in CUDA; nothing to pin then
            self._unpin = _pin(self.flat, plan.nbytes, self.last_use)
        self.views: Dict[Key, torch.Tensor] = {
            key: self.flat[offset:offset + shape.numel()].view(shape) for key, shape, offset in plan.slots
        }

    def release(self) -> None:
        """Wait for copies still using the buffer, unpin it, and let it go."""
        if self._unpin is not None:
            self._unpin()
        self.views.clear()
        self.flat = None


def _pin(flat: torch.Tensor, nbytes: int, last_use: Dict[torch.device, Any]) -> weakref.finalize:
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(flat.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    if int(error) != 0:
        raise SnapshotMemoryError(
            f"lightning_fp8: could not page-lock {_gib(nbytes)} of host memory for a rollback snapshot "
            f"(cudaHostRegister: {cudart.cudaGetErrorString(error)}). Pinned memory can be limited apart from free "
            "memory (WSL, a locked-memory limit in a container). Turn rollbacks off with max_rollbacks=0, or hold less "
            "optimizer state (optimizer_state='fp8')."
        )
    unpin = weakref.finalize(flat, _unpin, flat.data_ptr(), last_use)
    unpin.atexit = False  # at interpreter exit the CUDA context may be gone already; the process frees everything
    return unpin


def _unpin(ptr: int, last_use: Dict[torch.device, Any]) -> None:
    for event in last_use.values():
        event.synchronize()  # a copy into or out of these pages may still be in flight
    last_use.clear()
    error = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(error) != 0:
        warnings.warn(f"lightning_fp8: unpinning a rollback snapshot buffer failed (cudaHostUnregister: {int(error)})")


@dataclass
class _TensorSpec:
    """How to rebuild a live tensor from its host copy when there is no live tensor to copy into."""

    device: torch.device
    mesh: Any = None
    placements: Any = None
    shape: Optional[torch.Size] = None
    stride: Optional[Tuple[int, ...]] = None


@dataclass
class _OptimizerRecord:
    groups: List[Dict[str, Any]]  # hyperparameters of each param group (no "params")
    state: List[Optional[Dict[str, Any]]]  # per parameter, in param-group order: None or key -> ("t", Key) | ("v", value)


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The storage this process holds: a DTensor's local shard, else the tensor itself (detached, same storage)."""
    return t.to_local().detach() if is_dtensor(t) else t.detach()


def model_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_buffer) of every parameter and persistent buffer, each tensor once."""
    seen: set = set()
    out: List[Tuple[str, torch.Tensor, bool]] = []
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p, False))
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{module_name}.{name}" if module_name else name, buf, True))
    return out


def optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class Snapshot:
    """The state of one iteration (`step`), in reused host buffers. `capture` overwrites it; `restore` writes it back."""

    def __init__(self) -> None:
        self.step = -1
        self._buffers: Dict[Tuple[Any, torch.dtype, bool], _HostBuffer] = {}  # (part, dtype, pinned) -> buffer
        self._host: Dict[Key, torch.Tensor] = {}  # key -> its view in a buffer
        self._joined = 0  # parts added by add_optimizer
        self._specs: Dict[Key, _TensorSpec] = {}
        self._model: List[Tuple[Key, str]] = []
        self._optimizers: Dict[int, _OptimizerRecord] = {}
        self._schedulers: Dict[int, Dict[str, Any]] = {}
        self.extra: Dict[str, Any] = {}
        self._pending: Dict[torch.device, torch.cuda.Event] = {}
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}

    # -- what it holds ----------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of state held (parameters, buffers and optimizer state; schedulers and the extra state are tiny)."""
        return sum(t.numel() * t.element_size() for t in self._host.values())

    @property
    def host_bytes(self) -> int:
        """Host memory the buffers take (alignment padding and whole pages included): what the memory check counts."""
        return sum(b.plan.host_bytes for b in self._buffers.values())

    def holds_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        return id(optimizer) in self._optimizers

    # -- capture ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, step: int, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                schedulers: Sequence[Any], extra: Dict[str, Any]) -> None:
        copies: List[Tuple[Key, torch.Tensor, bool]] = []
        self._model = []
        for name, tensor, is_buffer in model_tensors(model):
            key = ("model", name)
            self._model.append((key, name))
            copies.append((key, tensor, is_buffer))
        records = {}
        for index, opt in enumerate(optimizers):
            records[id(opt)] = self._optimizer_record(("opt", index), opt, copies)
        self._copy(copies, part="capture")
        self._optimizers = records
        self._schedulers = {id(s): copy.deepcopy(s.state_dict()) for s in schedulers}
        self.extra = copy.deepcopy(extra)
        self.step = step

    @torch.no_grad()
    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Add an optimizer that has not stepped yet: its state now is its state at this snapshot's step."""
        copies: List[Tuple[Key, torch.Tensor, bool]] = []
        record = self._optimizer_record(("opt", "joined", len(self._optimizers)), optimizer, copies)
        self._joined += 1
        self._copy(copies, part=("joined", self._joined))
        self._optimizers[id(optimizer)] = record

    def add_scheduler(self, scheduler: Any) -> None:
        self._schedulers[id(scheduler)] = copy.deepcopy(scheduler.state_dict())

    def capture_schedules(self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> None:
        """Take the LR schedulers' states and the optimizers' hyperparameters again (small host objects): frameworks
        step their schedulers after the optimizers, so the schedule of an iteration is complete only then."""
        for opt in optimizers:
            record = self._optimizers.get(id(opt))
            if record is not None:
                record.groups = _groups(opt)
        self._schedulers = {id(s): copy.deepcopy(s.state_dict()) for s in schedulers}

    def restore_schedules(self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> None:
        """Write back only the schedule: the LR schedulers' states and the optimizers' hyperparameters (after a
        rollback, once the framework has stepped its schedulers for the rejected iteration)."""
        for opt in optimizers:
            record = self._optimizers.get(id(opt))
            if record is not None:
                for group, saved in zip(opt.param_groups, record.groups):
                    for name, value in saved.items():
                        group[name] = copy.deepcopy(value)
        for scheduler in schedulers:
            state = self._schedulers.get(id(scheduler))
            if state is not None:
                scheduler.load_state_dict(copy.deepcopy(state))

    def _optimizer_record(self, prefix: Key, opt: torch.optim.Optimizer, copies: list) -> _OptimizerRecord:
        groups = _groups(opt)
        states: List[Optional[Dict[str, Any]]] = []
        for j, p in enumerate(optimizer_params(opt)):
            live = opt.state.get(p)
            if not live:
                states.append(None)
                continue
            entry: Dict[str, Any] = {}
            for name, value in live.items():
                if isinstance(value, torch.Tensor):
                    key = (*prefix, j, name)
                    copies.append((key, value, False))
                    entry[name] = ("t", key)
                else:
                    entry[name] = ("v", copy.deepcopy(value))
            states.append(entry)
        return _OptimizerRecord(groups, states)

    def _copy(self, copies: List[Tuple[Key, torch.Tensor, bool]], part: Any) -> None:
        """Copy each live tensor into its view of a host buffer of `part` ("capture": the whole snapshot, which
        replaces every other part; an optimizer joining: its own part, added)."""
        self.fence()  # an earlier restore or capture may still be reading / writing these buffers on a device
        sources = [(key, local_tensor(t), t) for key, t, _ in copies]
        self._prepare_buffers(part, [(key, src) for key, src, _ in sources])
        by_device: Dict[torch.device, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        for (key, src, live), (_, _, is_buffer) in zip(sources, copies):
            self._specs[key] = _spec(live)
            host = self._host[key]
            if src.device.type != "cuda":
                host.copy_(src)
                continue
            if is_buffer:
                src = src.clone()  # the forward updates buffers in place: copy a still image of them
            by_device.setdefault(src.device, []).append((host, src))
        for device, pairs in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for host, src in pairs:
                    host.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # the allocator keeps a clone's memory until the copy is done
                event = torch.cuda.Event()
                event.record(stream)
            self._pending[device] = event
            self._used_by(device, event)

    def _prepare_buffers(self, part: Any, sources: List[Tuple[Key, torch.Tensor]]) -> None:
        """Reuse the buffers whose plan is unchanged; release the others (a capture releases every other part too);
        check the host memory, then allocate what is new."""
        plans = {(part, plan.dtype, plan.pinned): plan for plan in plan_host_buffers(sources)}
        replaces_all = part == "capture"
        for name in [n for n in self._buffers if (replaces_all or n[0] == part)]:
            if plans.get(name) != self._buffers[name].plan:
                self._buffers.pop(name).release()
        new = {name: plan for name, plan in plans.items() if name not in self._buffers}
        if new:
            new_bytes = sum(plan.host_bytes for plan in new.values())
            on_cuda = any(plan.pinned for plan in new.values())
            check_host_memory(new_bytes, self.host_bytes + new_bytes, local_snapshot_ranks(on_cuda))
            for name, plan in new.items():
                self._buffers[name] = _HostBuffer(plan)
        self._host = {key: view for buffer in self._buffers.values() for key, view in buffer.views.items()}
        self._specs = {key: spec for key, spec in self._specs.items() if key in self._host}

    def _used_by(self, device: torch.device, event: Any) -> None:
        """`event` follows the latest copies between `device` and the pinned buffers (see _HostBuffer). One event per
        device covers both streams: a capture's side stream first waits for the current stream, and a restore's
        current stream first waits for the capture's event (fence)."""
        for buffer in self._buffers.values():
            if buffer.plan.pinned:
                buffer.last_use[device] = event

    # -- ordering with the training step ------------------------------------------------------------------------------
    def fence(self) -> None:
        """Make the devices' current streams wait (on the device, no host sync) for copies still in flight: call before
        anything updates the copied tensors in place (the optimizer step, a restore)."""
        for device, event in self._pending.items():
            torch.cuda.current_stream(device).wait_event(event)
        self._pending.clear()

    # -- restore ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def restore(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> List[Any]:
        """Write the snapshot back in place; returns the optimizers and schedulers it holds no state for."""
        self.fence()
        live = {name: t for name, t, _ in model_tensors(model)}
        for key, name in self._model:
            if name in live:
                local_tensor(live[name]).copy_(self._host[key], non_blocking=True)
        missing: List[Any] = []
        for opt in optimizers:
            record = self._optimizers.get(id(opt))
            if record is None:
                missing.append(opt)
                continue
            self._restore_optimizer(opt, record)
        devices = {t.device for t in [*live.values(), *_optimizer_tensors(optimizers)] if t.device.type == "cuda"}
        for device in devices:  # the copies out of pinned buffers just issued: a release waits for them
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._used_by(device, event)
        for scheduler in schedulers:
            state = self._schedulers.get(id(scheduler))
            if state is None:
                missing.append(scheduler)
                continue
            scheduler.load_state_dict(copy.deepcopy(state))
        for module in model.modules():  # buffers written in place: python-side mirrors must follow
            sync = getattr(module, "sync_precision_flag", None)
            if callable(sync):
                sync()
        return missing

    def _restore_optimizer(self, opt: torch.optim.Optimizer, record: _OptimizerRecord) -> None:
        for group, saved in zip(opt.param_groups, record.groups):
            for name, value in saved.items():
                group[name] = copy.deepcopy(value)
        for p, saved in zip(optimizer_params(opt), record.state):
            if saved is None:
                opt.state.pop(p, None)  # no state at the snapshot: the optimizer initialises it again
                continue
            current = opt.state.get(p) or {}
            state: Dict[str, Any] = {}
            for name, (kind, item) in saved.items():
                if kind == "v":
                    state[name] = copy.deepcopy(item)
                    continue
                host, target = self._host[item], current.get(name)
                if isinstance(target, torch.Tensor) and _fits(local_tensor(target), host):
                    local_tensor(target).copy_(host, non_blocking=True)
                    state[name] = target
                else:
                    state[name] = _materialize(host, self._specs[item])
            opt.state[p] = state


@dataclass(frozen=True)
class LocalRanks:
    """How many processes on this node take a snapshot like this one (each allocates its own), and how we know."""

    count: int
    source: str


def local_snapshot_ranks(on_cuda: bool) -> LocalRanks:
    """The ranks on this node that take snapshots: every rank runs the engine and snapshots its own state (its shards
    under FSDP2), at the same iteration.

    Which source wins, first that applies:
    1. `LOCAL_WORLD_SIZE`: set by the launcher that started the processes on this node (torchrun /
       torch.distributed.run, `accelerate launch`), the exact count;
    2. torch.distributed, when initialized without it (Lightning's own launcher sets no LOCAL_WORLD_SIZE): its world
       size, which is the local one on a single node; with the state on CUDA, capped at this node's GPUs (one process
       per GPU), so a multi-node world is not counted as if on one node;
    3. otherwise this process alone.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value.strip().isdigit() and int(value) >= 1:
        return LocalRanks(int(value), "LOCAL_WORLD_SIZE")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if on_cuda and torch.cuda.is_available() and world > torch.cuda.device_count():
            gpus = torch.cuda.device_count()
            return LocalRanks(gpus, f"torch.distributed world size {world}, at most one rank per GPU: {gpus} GPUs here")
        return LocalRanks(world, "torch.distributed world size; LOCAL_WORLD_SIZE is not set")
    return LocalRanks(1, "this process alone: no LOCAL_WORLD_SIZE, torch.distributed not initialized")


def check_host_memory(new_bytes: int, total_bytes: int, ranks: Optional[LocalRanks] = None) -> None:
    """Raise SnapshotMemoryError when the node cannot give every rank `new_bytes` more host memory.

    `new_bytes` / `total_bytes`: host bytes this rank is about to allocate / will hold (what the allocations take:
    `HostBufferPlan.host_bytes`). Each of `ranks` (default: `local_snapshot_ranks`) takes a snapshot of about the same
    size at the same iteration, out of the same node-wide memory, so the node needs `new_bytes` times their count.
    The ranks reach that iteration together (within the skew of the step's collectives) and each reads the available
    memory before allocating, so each sees the node before the others' buffers (which take a while to fill and pin)
    take it; a rank far behind the others would count their buffers twice and refuse."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with lightning
        return
    ranks = ranks or local_snapshot_ranks(on_cuda=False)
    available = psutil.virtual_memory().available
    node_bytes = new_bytes * ranks.count
    if node_bytes > available:
        raise SnapshotMemoryError(
            f"lightning_fp8: a rollback snapshot needs {_gib(total_bytes)} of host memory per rank ({_gib(new_bytes)} "
            f"of it not allocated yet: this rank's parameters, buffers and optimizer state), and {ranks.count} "
            f"rank(s) on this node take one ({ranks.source}): {_gib(node_bytes)} for the node, but only "
            f"{_gib(available)} is available. To fit: turn rollbacks off with max_rollbacks=0 (no snapshots are taken "
            "then; a run that needs a rollback stops with FP8DivergenceError instead); hold fewer state bytes per "
            "rank: optimizer_state='fp8' (FP8AdamW, about 3 instead of 8 bytes of AdamW state per parameter), or "
            "shard the state across ranks (FSDP2: each rank snapshots only its shards); or free host memory. "
            "snapshot_every sets how often the snapshot is refreshed, not its size. If the rank count is wrong, set "
            "LOCAL_WORLD_SIZE to the number of training processes on this node."
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def _optimizer_tensors(optimizers: Sequence[torch.optim.Optimizer]) -> List[torch.Tensor]:
    return [local_tensor(v) for opt in optimizers for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def _groups(opt: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    return [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in opt.param_groups]


def _spec(t: torch.Tensor) -> _TensorSpec:
    if is_dtensor(t):
        return _TensorSpec(t.device, t.device_mesh, t.placements, t.shape, t.stride())
    return _TensorSpec(t.device)


def _fits(target: torch.Tensor, host: torch.Tensor) -> bool:
    return target.shape == host.shape and target.dtype == host.dtype


def _materialize(host: torch.Tensor, spec: _TensorSpec) -> torch.Tensor:
    local = host.to(spec.device, copy=True)
    if spec.mesh is not None:
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
    return local
