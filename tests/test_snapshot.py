"""Rollback snapshots (lightning_fp8/engine/snapshot.py): reused host buffers, in-place restores, sharded state kept
sharded, a clear error when the host cannot hold one (issue 12, item 8). The cost: benchmarks/snapshot_cost.py."""
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Recipe, convert_to_fp8, fp8_state_dict
from lightning_fp8.engine import FP8TrainingEngine, StabilityConfig
from lightning_fp8.engine.snapshot import Snapshot, SnapshotMemoryError

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
            if hasattr(layer, "update_scales"):
                layer.update_scales()


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
    assert all(t.is_pinned() for t in snap._host.values() if t.dim() > 0)
    at_2 = _state(model, opt, sched)
    snap.fence()  # what the engine does before the optimizer step
    _train(model, opt, sched, 1, "cuda")
    snap.restore(model, [opt], [sched])
    torch.cuda.synchronize()
    _assert_same(_state(model, opt, sched), at_2)
