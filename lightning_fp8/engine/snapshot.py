"""Rollback snapshots: the last known-good training state in host memory, cheap enough to take every 50 iterations.

What a snapshot holds (everything an iteration can change): every parameter and persistent buffer of the model (the
FP8 metadata included: its buffers are persistent in `FP8LinearMeta`, only the layer's state_dict leaves them out),
the state and hyperparameters (learning rate included) of every optimizer, the state of every LR scheduler, and the
engine's own extra state (the loss scaler). Restoring copies the values back into the live tensors in place, so
optimizer references to Parameters, weight tying and sharded (DTensor) parameters stay as they are.

Why it is cheap (issue 12, item 8; measured in benchmarks/results/snapshot_cost.md):
- host buffers are allocated once and reused by every later snapshot (pinned when the state lives on a GPU);
- on CUDA the device-to-host copies are issued with `non_blocking=True` on a side stream, after that stream waited
  for the main stream, and an event marks their end. Nothing waits for them on the host: the forward and backward
  of the next iteration overlap the copies, and only the next in-place update of what is being copied (the
  optimizer step, a restore) waits for the event, on the device (`fence`). Buffers, which the forward itself
  updates in place (batch-norm statistics, FP8 amax histories), are first cloned on the main stream (they are small)
  and the clones copied;
- sharded parameters and optimizer state (DTensor, as FSDP2 produces) are copied as their local shards
  (`to_local()`): every rank holds its own shard on the host, sharded state stays sharded, and a restore rebuilds
  DTensors with their original mesh and placements where it has to create a tensor;
- before allocating, the bytes the snapshot needs are compared with the host memory available (psutil), and a
  `SnapshotMemoryError` names both instead of letting the process be killed.

On CPU there is nothing to overlap with: each tensor is copied synchronously (a memcpy) into its reused buffer while
the engine waits, so a snapshot costs one pass over the state and no allocation after the first.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

try:  # DTensor (sharded tensors, FSDP2); absent from builds without torch.distributed
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

Key = Tuple[Any, ...]


class SnapshotMemoryError(MemoryError):
    """The host cannot hold a rollback snapshot; the message names the bytes needed and available."""


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
        self._host: Dict[Key, torch.Tensor] = {}
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
        """Host bytes held (parameters, buffers and optimizer state; schedulers and the extra state are tiny)."""
        return sum(t.numel() * t.element_size() for t in self._host.values())

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
        self._copy(copies, drop_others=True)
        self._optimizers = records
        self._schedulers = {id(s): copy.deepcopy(s.state_dict()) for s in schedulers}
        self.extra = copy.deepcopy(extra)
        self.step = step

    @torch.no_grad()
    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Add an optimizer that has not stepped yet: its state now is its state at this snapshot's step."""
        copies: List[Tuple[Key, torch.Tensor, bool]] = []
        record = self._optimizer_record(("opt", "joined", len(self._optimizers)), optimizer, copies)
        self._copy(copies, drop_others=False)
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

    def _copy(self, copies: List[Tuple[Key, torch.Tensor, bool]], drop_others: bool) -> None:
        """Copy each live tensor into its host buffer (allocated on first use, reused after)."""
        self.fence()  # an earlier restore or capture may still be reading / writing these buffers on a device
        wanted = {key for key, _, _ in copies}
        if drop_others:
            for key in [k for k in self._host if k not in wanted]:
                del self._host[key]
                self._specs.pop(key, None)
        sources = [(key, local_tensor(t), t) for key, t, _ in copies]
        self._allocate(sources)
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

    def _allocate(self, sources: Iterable[Tuple[Key, torch.Tensor, torch.Tensor]]) -> None:
        new = []
        for key, src, _ in sources:
            host = self._host.get(key)
            if host is None or host.shape != src.shape or host.dtype != src.dtype:
                new.append((key, src))
        if not new:
            return
        needed = sum(src.numel() * src.element_size() for _, src in new)
        check_host_memory(needed, self.nbytes + needed)
        for key, src in new:
            pin = src.device.type == "cuda"
            self._host[key] = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)

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


def check_host_memory(new_bytes: int, total_bytes: int) -> None:
    """Raise SnapshotMemoryError when `new_bytes` more host memory than is available would be needed."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with lightning
        return
    available = psutil.virtual_memory().available
    if new_bytes > available:
        raise SnapshotMemoryError(
            f"lightning_fp8: a rollback snapshot needs {_gib(total_bytes)} of host memory (parameters, buffers and "
            f"optimizer state of this process; {_gib(new_bytes)} of it not allocated yet) and only {_gib(available)} "
            "is available. Free host memory, or turn rollbacks off with max_rollbacks=0 (no snapshots are taken then; "
            "a run that needs a rollback stops with FP8DivergenceError instead)."
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


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


__all__ = ["Snapshot", "SnapshotMemoryError", "check_host_memory", "model_tensors", "local_tensor", "is_dtensor"]
