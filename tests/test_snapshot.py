"""Rollback snapshots (lightning_fp8/engine/snapshot.py): reused host buffers, in-place restores, sharded state kept
sharded, a clear error when the host cannot hold one (issue 12, item 8); one flat host buffer per dtype, pinned in
place with its exact bytes, and a memory check that counts every rank on the node (issue 22, defect 9). The cost:
benchmarks/snapshot_cost.py."""
import gc
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Recipe, convert_to_fp8, fp8_state_dict
from lightning_fp8.engine import FP8TrainingEngine, StabilityConfig
from lightning_fp8.engine import snapshot as snapshot_module
from lightning_fp8.engine.snapshot import (
    PAGE, LocalRanks, Snapshot, SnapshotMemoryError, check_host_memory, local_snapshot_ranks, plan_host_buffers,
)

HAS_CUDA = torch.cuda.is_available()


def _setup(device="cpu"):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    return model, opt, sched


def _train(model, opt, sched, steps, device="cpu"):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, device=device)).pow(2).mean().backward()
        opt.step()
        sched.step()
        for layer in model.modules():
            if hasattr(layer, "close_scaling_step"):
                layer.close_scaling_step()


def _state(model, opt, sched):
    return (
        {k: v.detach().clone() for k, v in {**model.state_dict(), **fp8_state_dict(model)}.items()},
        {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in opt.state},
        [g["lr"] for g in opt.param_groups],
        sched.state_dict(),
    )


def _assert_same(a, b):
    (model_a, opt_a, lr_a, sched_a), (model_b, opt_b, lr_b, sched_b) = a, b
    assert model_a.keys() == model_b.keys() and all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    assert opt_a.keys() == opt_b.keys()
    for p in opt_a:
        assert all(torch.equal(opt_a[p][k], opt_b[p][k]) for k in opt_a[p])
    assert lr_a == lr_b and sched_a == sched_b


def test_buffers_are_allocated_once_and_restores_are_in_place():
    model, opt, sched = _setup()
    _train(model, opt, sched, 2)
    snap = Snapshot()
    snap.capture(2, model, [opt], [sched], {"scaler": {"scale": 1.0}})
    buffers = {k: v.data_ptr() for k, v in snap._host.items()}
    _train(model, opt, sched, 3)
    snap.capture(5, model, [opt], [sched], {"scaler": {"scale": 2.0}})
    assert {k: v.data_ptr() for k, v in snap._host.items()} == buffers  # reused, not reallocated
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
    state = [v for p in opt.state for v in opt.state[p].values()]  # exp_avg, exp_avg_sq, step
    assert snap.nbytes == nbytes(model.parameters()) + nbytes(fp8_state_dict(model).values()) + nbytes(state)
    at_5 = _state(model, opt, sched)
    params = list(model.parameters())
    _train(model, opt, sched, 3)
    assert snap.restore(model, [opt], [sched]) == []
    _assert_same(_state(model, opt, sched), at_5)
    assert all(a is b for a, b in zip(params, model.parameters()))  # the same Parameters, written in place
    assert snap.extra == {"scaler": {"scale": 2.0}}


def test_state_created_after_the_snapshot_is_dropped_on_restore():
    model, opt, sched = _setup()
    snap = Snapshot()
    snap.capture(0, model, [opt], [sched], {})  # before the first step: no optimizer state yet
    before = _state(model, opt, sched)
    _train(model, opt, sched, 2)
    snap.restore(model, [opt], [sched])
    _assert_same(_state(model, opt, sched), before)
    assert len(opt.state) == 0
    _train(model, opt, sched, 1)  # the optimizer initialises its state again


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _storages(snap):
    return {t.untyped_storage().data_ptr() for t in snap._host.values()}


def test_one_host_allocation_per_dtype_reused_and_reallocated_when_the_tensors_change():
    """The host copies of a snapshot's tensors are views into one flat buffer per dtype (not one allocation per
    tensor), each 64-byte aligned and disjoint; an equal set of tensors reuses the buffers, a changed set (AdamW's
    state appears after the first step) gets new ones, and restores are bit-identical (NaN payloads, -0.0)."""
    model, opt, sched = _setup()
    snap = Snapshot()
    snap.capture(0, model, [opt], [sched], {})  # before the first step: parameters and FP8 buffers only
    dtypes = {t.dtype for t in snap._host.values()}
    assert dtypes == {torch.float32, torch.int64, torch.bool} and len(snap._host) == 10
    assert len(_storages(snap)) == len(dtypes)  # one allocation per dtype, not per tensor
    _train(model, opt, sched, 2)
    snap.capture(2, model, [opt], [sched], {})  # AdamW state now exists: the float32 buffer is planned again
    assert len(snap._host) == 10 + 3 * 6 and len(_storages(snap)) == len(dtypes)
    ptrs = {k: v.data_ptr() for k, v in snap._host.items()}
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in snap._host.values())
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))  # no two views overlap
    with torch.no_grad():
        weight = model[1].weight
        weight[0, :3] = torch.tensor([float("nan"), -0.0, 1e-45])  # bits torch.equal would not see
        weight[1, 0] = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    snap.capture(3, model, [opt], [sched], {})
    assert {k: v.data_ptr() for k, v in snap._host.items()} == ptrs  # same tensors: reused, not reallocated
    at_3 = {k: _bits(v) for k, v in {**model.state_dict(), **fp8_state_dict(model)}.items()}
    opt_at_3 = {(id(p), k): _bits(v) for p in opt.state for k, v in opt.state[p].items()}
    _train(model, opt, sched, 2)
    snap.restore(model, [opt], [sched])
    after = {k: _bits(v) for k, v in {**model.state_dict(), **fp8_state_dict(model)}.items()}
    assert after.keys() == at_3.keys() and all(torch.equal(after[k], at_3[k]) for k in at_3)
    assert all(torch.equal(_bits(v), opt_at_3[(id(p), k)]) for p in opt.state for k, v in opt.state[p].items())


def test_a_joining_optimizer_gets_its_own_buffers_and_a_capture_folds_them_back():
    model, opt, sched = _setup()
    late = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, sched, 1)
    late.step()  # momentum buffers exist
    snap = Snapshot()
    snap.capture(1, model, [opt], [sched], {})
    before = _storages(snap)
    snap.add_optimizer(late)
    assert len(_storages(snap)) == len(before) + 1 and before <= _storages(snap)  # float32 momenta: one more buffer
    snap.capture(2, model, [opt, late], [sched], {})
    assert len(_storages(snap)) == 3


def _fake_cudart(calls):
    """Stands for torch.cuda.cudart() on this CPU-only machine: records what would be page-locked."""
    return SimpleNamespace(
        cudaHostRegister=lambda ptr, size, flags: calls.append(("register", ptr, size)) or 0,
        cudaHostUnregister=lambda ptr: calls.append(("unregister", ptr)) or 0,
        cudaGetErrorString=lambda error: f"error {error}",
    )


def test_pinned_buffers_are_page_locked_in_place_with_their_exact_bytes(monkeypatch):
    """Where the state is on a GPU the flat buffers are page-locked in place (cudaHostRegister) with exactly their
    bytes, once per buffer, and unpinned when replaced or dropped; the memory check counts those bytes in whole pages,
    never a power-of-two rounding (torch's pinned allocator, behind pin_memory=True, rounds each request up to one:
    that is what the registration avoids)."""
    calls, checked = [], []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _fake_cudart(calls))
    monkeypatch.setattr(snapshot_module, "pinned_for", lambda device: True)  # as if the state lived on a GPU
    monkeypatch.setattr(snapshot_module, "check_host_memory", lambda new, total, ranks: checked.append(new))
    model, opt, sched = _setup()
    snap = Snapshot()
    snap.capture(0, model, [opt], [sched], {})
    buffers = list(snap._buffers.values())
    assert [c[0] for c in calls] == ["register"] * 3 and all(b.plan.pinned for b in buffers)
    assert sorted(c[1:] for c in calls) == sorted((b.flat.data_ptr(), b.plan.nbytes) for b in buffers)
    assert checked == [sum(-(-b.plan.nbytes // PAGE) * PAGE for b in buffers)] == [snap.host_bytes]
    fp32 = snap._buffers[("capture", torch.float32, True)]
    tensors = [t for t in snap._host.values() if t.dtype == torch.float32]
    assert fp32.plan.nbytes == 4 * (fp32.plan.slots[-1][2] + tensors[-1].numel())  # ends with the last tensor
    state_bytes = 4 * sum(t.numel() for t in tensors)
    assert state_bytes <= fp32.plan.nbytes < state_bytes + 64 * len(tensors)  # 64-byte alignment, nothing more
    old_fp32 = fp32.flat.data_ptr()
    calls.clear()
    snap.capture(0, model, [opt], [sched], {})
    assert calls == []  # the same tensors: nothing registered again
    _train(model, opt, sched, 1)
    snap.capture(1, model, [opt], [sched], {})  # AdamW state joins the float32 buffer: it is replaced
    new_fp32 = snap._buffers[("capture", torch.float32, True)]
    assert calls == [("unregister", old_fp32), ("register", new_fp32.flat.data_ptr(), new_fp32.plan.nbytes)]
    registered = {c[1] for c in calls if c[0] == "register"} | {b.flat.data_ptr() for b in snap._buffers.values()}
    calls.clear()
    del snap, fp32, new_fp32, buffers
    gc.collect()
    assert sorted(c[1] for c in calls if c[0] == "unregister") == sorted(registered)  # every pinned buffer unpinned


def test_a_buffer_the_driver_cannot_pin_is_a_clear_error(monkeypatch):
    fake = _fake_cudart([])
    fake.cudaHostRegister = lambda ptr, size, flags: 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(snapshot_module, "pinned_for", lambda device: True)
    model, opt, sched = _setup()
    pattern = r"could not page-lock .* \(cudaHostRegister: error 2\).*max_rollbacks=0"
    with pytest.raises(SnapshotMemoryError, match=pattern):
        Snapshot().capture(0, model, [opt], [sched], {})


def test_the_memory_check_counts_every_rank_on_the_node(monkeypatch):
    """Every rank on the node allocates its own snapshot out of the same memory: the check multiplies the bytes of
    one rank by the ranks on the node and names both, and what to do."""
    import psutil

    model, opt, sched = _setup()
    _train(model, opt, sched, 1)
    per_rank = Snapshot()
    per_rank.capture(1, model, [opt], [sched], {})
    need = per_rank.host_bytes
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=3 * need))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    Snapshot().capture(1, model, [opt], [sched], {})  # three ranks fit exactly
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(SnapshotMemoryError) as err:
        Snapshot().capture(1, model, [opt], [sched], {})
    message = str(err.value)
    assert f"0.00 GiB ({need} bytes) of host memory per rank" in message
    assert f"4 rank(s) on this node take one (LOCAL_WORLD_SIZE): 0.00 GiB ({4 * need} bytes) for the node" in message
    assert f"only 0.00 GiB ({3 * need} bytes) is available" in message
    assert all(fix in message for fix in ("max_rollbacks=0", "optimizer_state='fp8'", "FSDP2", "snapshot_every"))


def test_a_llama_7b_adamw_snapshot_is_counted_as_its_state_not_a_power_of_two(monkeypatch):
    """LLaMA-7B shapes (meta tensors: nothing allocated): the float32 parameters and AdamW moments are 75.3 GiB; one
    buffer each through torch's pinned allocator would take 99.0 GiB, one flat buffer through it 128 GiB. The plan
    takes the state's bytes, and 8 ranks on the node need 8 times that."""
    import psutil

    d, ffn, vocab, layers = 4096, 11008, 32000, 32
    shapes = [(vocab, d), (vocab, d), (d,)] + [(d, d)] * 4 * layers + [(ffn, d), (d, ffn), (ffn, d)] * layers
    shapes += [(d,)] * 2 * layers
    state = [(("p", i, name), torch.empty(s, device="meta")) for i, s in enumerate(shapes) for name in "pmv"]
    state_bytes = sum(t.numel() * 4 for _, t in state)
    (plan,) = plan_host_buffers(state)
    assert plan.dtype == torch.float32 and round(state_bytes / 2**30, 1) == 75.3
    power_of_two = sum(1 << (t.numel() * 4 - 1).bit_length() for _, t in state)
    assert round(power_of_two / 2**30, 1) == 99.0 and 1 << (state_bytes - 1).bit_length() == 128 * 2**30
    assert state_bytes <= plan.host_bytes <= state_bytes + 64 * len(state) + PAGE
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * plan.host_bytes))
    check_host_memory(plan.host_bytes, plan.host_bytes, LocalRanks(8, "LOCAL_WORLD_SIZE"))  # fits exactly
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * plan.host_bytes - 1))
    with pytest.raises(SnapshotMemoryError, match=r"75\.3. GiB .* per rank .* 8 rank\(s\) on this node .* 602\."):
        check_host_memory(plan.host_bytes, plan.host_bytes, LocalRanks(8, "LOCAL_WORLD_SIZE"))


def test_local_ranks_come_from_local_world_size_then_torch_distributed(one_rank_group, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert local_snapshot_ranks(on_cuda=False) == LocalRanks(3, "LOCAL_WORLD_SIZE")  # the launcher's count wins
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_snapshot_ranks(on_cuda=False).count == 1  # torch.distributed: world size 1
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 16)  # e.g. Lightning's launcher, 2 nodes x 8 GPUs
    assert local_snapshot_ranks(on_cuda=False).count == 16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    ranks = local_snapshot_ranks(on_cuda=True)
    assert ranks.count == 8 and "one rank per GPU" in ranks.source


def test_without_a_launcher_or_process_group_one_rank_is_counted(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_snapshot_ranks(on_cuda=False).count == 1


def test_a_snapshot_the_host_cannot_hold_is_a_clear_error(monkeypatch):
    import psutil

    model, opt, sched = _setup()
    _train(model, opt, sched, 1)
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1000))
    with pytest.raises(SnapshotMemoryError, match=r"only 0\.00 GiB \(1000 bytes\) is available") as err:
        Snapshot().capture(1, model, [opt], [sched], {})
    assert "max_rollbacks=0" in str(err.value)
    assert int(str(err.value).split("GiB (")[1].split(" bytes")[0]) > 3 * needed // 2  # parameters + Adam state
    # max_rollbacks=0: no rollback can happen, so the engine takes no snapshot and needs no host memory for one
    engine = FP8TrainingEngine(FP8Recipe(), StabilityConfig(max_rollbacks=0))
    engine.attach(model)
    opt.zero_grad()
    engine.scale_loss(model(torch.randn(4, 16)).pow(2).mean()).backward()
    assert engine.step(opt, opt.step).stepped and engine.snapshot_step is None


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    path = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):  # the FileStore deletes it itself once nothing holds the store any more
            os.unlink(path)


def test_sharded_state_stays_sharded(one_rank_group):
    """FSDP2 (`fully_shard`) parameters and optimizer state are DTensors: the snapshot holds their local shards as
    plain host tensors, restores write into the shards in place, and state it has to recreate comes back as DTensors
    with the original mesh and placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    snap = Snapshot()
    snap.capture(1, model, [opt], [], {})
    assert all(type(t) is torch.Tensor for t in snap._host.values())
    weight = model[0].weight
    expected = (weight.to_local().clone(), {k: v.to_local().clone() for k, v in opt.state[weight].items() if isinstance(v, DTensor)})
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.state.clear()  # forces the restore to recreate the state tensors
    snap.restore(model, [opt], [])
    assert isinstance(model[0].weight, DTensor) and torch.equal(model[0].weight.to_local(), expected[0])
    for name, local in expected[1].items():
        restored = opt.state[weight][name]
        assert isinstance(restored, DTensor) and restored.placements == weight.placements
        assert torch.equal(restored.to_local(), local)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()  # trains on from the restored state


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_copies_are_pinned_asynchronous_and_ordered_before_the_next_update():
    model, opt, sched = _setup("cuda")
    _train(model, opt, sched, 2, "cuda")
    snap = Snapshot()
    snap.capture(2, model, [opt], [sched], {})
    assert all(t.is_pinned() for t in snap._host.values() if t.dim() > 0)  # 0-d: AdamW's step counters live on CPU
    pinned = {t.untyped_storage().data_ptr() for t in snap._host.values() if t.is_pinned()}
    assert len(pinned) == len({t.dtype for t in snap._host.values() if t.is_pinned()})  # one buffer per dtype
    assert snap.host_bytes < 1.01 * snap.nbytes + 4 * PAGE  # page-locked in place: no power-of-two rounding
    at_2 = _state(model, opt, sched)
    snap.fence()  # what the engine does before the optimizer step
    _train(model, opt, sched, 1, "cuda")
    snap.restore(model, [opt], [sched])
    torch.cuda.synchronize()
    _assert_same(_state(model, opt, sched), at_2)
    old = snap._host[("model", "0.weight")]
    snap.capture(3, model, [], [], {})  # fewer tensors: the float32 buffer is replaced and the old one unpinned
    assert not old.is_pinned() and snap._host[("model", "0.weight")].is_pinned()
