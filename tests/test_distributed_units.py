"""Single-process parts of the FSDP2 / FP8 communication work: options, the pieces that need no process group.
(The multi-process behaviour: tests/test_distributed.py.)"""
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Precision, convert_to_fp8
from lightning_fp8.accelerate import FP8Kwargs
from lightning_fp8.distributed import FP8AllGatherWeight, FP8CommState, enable_fp8_all_gather, uses_fp8_all_gather
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
from lightning_fp8.fabric import load_checkpoint
from lightning_fp8.integrations.accelerate.accelerator import check_fsdp_version
from lightning_fp8.modules.autocast import fp8_autocast


@pytest.mark.parametrize("make", [FP8Precision, FabricFP8Precision, FP8Kwargs])
def test_distributed_options_validated_with_the_valid_choices(make):
    with pytest.raises(ValueError, match=r"\['bf16', 'fp8'\]"):
        make(gradient_communication="fp16")
    with pytest.raises(ValueError, match="fp8_all_gather"):
        make(fp8_all_gather="yes")
    options = make(gradient_communication="fp8", fp8_all_gather=False)
    options = getattr(options, "options", options)
    assert options.gradient_communication == "fp8" and options.fp8_all_gather is False


def test_distributed_defaults():
    options = FP8Precision().options
    assert options.fp8_all_gather is True and options.gradient_communication == "bf16"


@pytest.mark.parametrize("kwargs, match", [({"fmt": "e3m4"}, "e4m3"), ({"scaling": "per_layer"}, "per_tensor"),
                                           ({"algorithm": "ring"}, "all_to_all"), ({"margin": -1}, "margin")])
def test_comm_state_bad_values_name_the_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8CommState(**kwargs)


def test_comm_state_auto_algorithm():
    assert FP8CommState().resolved_algorithm(2) == "all_gather"
    assert FP8CommState().resolved_algorithm(8) == "all_to_all"


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 32))


def test_fp8_all_gather_weight_is_its_tensor_outside_fsdp():
    """Enabled but never sharded (a model built for FSDP2, evaluated in one process): the same results, plain
    checkpoints (weights_only loading works, a model without FP8 all-gather loads them)."""
    plain, wrapped = convert_to_fp8(_mlp(), verbose=False), convert_to_fp8(_mlp(), verbose=False)
    decisions = enable_fp8_all_gather(wrapped)
    assert [fqn for fqn, reason in decisions.items() if reason is None] == ["2", "4"]  # the middle two are FP8
    assert uses_fp8_all_gather(wrapped[2]) and isinstance(wrapped[2].weight, FP8AllGatherWeight)
    assert enable_fp8_all_gather(wrapped) == decisions  # a second call changes nothing
    x = torch.randn(8, 32)
    for model in (plain, wrapped):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
            model.out = model(x)
        model.out.float().sum().backward()
    assert torch.equal(plain.out, wrapped.out)
    assert torch.equal(plain[2].weight.grad, wrapped[2].weight.grad)
    buffer = io.BytesIO()
    torch.save(wrapped.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert type(state["2.weight"]) is torch.Tensor
    _mlp().load_state_dict(state)


class _FakeFabric:
    """What Fabric's ModelParallelStrategy does to the non-module entries of `state` on a sharded load."""

    def __init__(self, saved):
        self.saved = saved

    def load(self, path, state, strict=True):
        for key in list(state):
            if not isinstance(state[key], (nn.Module, torch.optim.Optimizer)):
                state[key] = self.saved[key]
        return {}


def test_fabric_load_checkpoint_restores_what_a_sharded_load_drops():
    trained = FabricFP8Precision()
    trained.engine.step_count, trained.engine.skipped_steps = 7, 2
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scheduler.step()
    saved = {"fp8": trained.state_dict(), "scheduler": scheduler.state_dict(), "epoch": 3}
    fresh = FabricFP8Precision()
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), step_size=1)
    state = {"fp8": fresh, "scheduler": fresh_scheduler, "epoch": 0}
    load_checkpoint(_FakeFabric(saved), "unused", state)
    assert state["fp8"] is fresh and fresh.engine.step_count == 7 and fresh.engine.skipped_steps == 2
    assert state["scheduler"] is fresh_scheduler and fresh_scheduler.last_epoch == 1
    assert state["epoch"] == 3


def test_accelerate_refuses_fsdp1():
    from accelerate.utils import DistributedType

    with pytest.raises(NotImplementedError, match="fsdp_version=2"):
        check_fsdp_version(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))
    check_fsdp_version(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True))


def test_post_all_gather_ties_the_copy_in_streams_scale_and_amax_to_the_compute_stream(monkeypatch):
    """FSDP2 calls fsdp_pre_all_gather on its copy-in stream (the scale and amax are allocated there) and
    fsdp_post_all_gather on the compute stream, and drops the metadata right after the hook: the hook must tie both
    tensors to the compute stream (record_stream) before their memory can be reused; on both paths (first gather and
    a re-gather into the same buffers). What only a GPU shows: the race itself, under NCCL and prefetch."""
    from lightning_fp8.distributed import all_gather
    from lightning_fp8.modules.precast import CastKey

    kept = []
    monkeypatch.setattr(all_gather, "keep_for_current_stream", lambda *tensors: kept.append(tensors))
    weight = FP8AllGatherWeight(torch.randn(8, 16))
    key = CastKey(fmt="e4m3", scaling="delayed", algo_max=True, margin=0, power_of_2=True)
    meta = all_gather._GatherMeta(torch.tensor(4.0), torch.tensor(2.0), key, torch.float8_e4m3fn, None, 8, 8)
    data = torch.zeros(8, 16, dtype=torch.uint8)
    gathered, _ = weight.fsdp_post_all_gather((data,), meta, torch.float32)
    assert len(kept) == 1 and kept[0][0] is meta.scale and kept[0][1] is meta.amax
    again = all_gather._GatherMeta(torch.tensor(8.0), torch.tensor(1.0), key, torch.float8_e4m3fn, None, 8, 8)
    weight.fsdp_post_all_gather((data,), again, torch.float32, out=gathered)
    assert len(kept) == 2 and kept[1][0] is again.scale and kept[1][1] is again.amax


def test_keep_for_current_stream_records_cuda_tensors_on_the_current_stream(monkeypatch):
    from lightning_fp8.distributed.all_gather import keep_for_current_stream

    class CudaTensor:  # a stand-in: a CPU build has no CUDA tensors
        is_cuda, device = True, "cuda:1"

        def __init__(self):
            self.recorded = []

        def record_stream(self, stream):
            self.recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"current stream of {device}")
    cuda_tensor, cpu_tensor = CudaTensor(), torch.ones(1)
    keep_for_current_stream(cuda_tensor, cpu_tensor)
    assert cuda_tensor.recorded == ["current stream of cuda:1"]


def test_agreed_weight_amaxes_are_each_shards_tensor_amax_from_one_fused_kernel():
    """The batched agreement's local amaxes (torch._foreach_norm, ord=inf) equal tensor_amax shard by shard: an empty
    shard 0, NaN and inf kept (the agreement then turns NaN into inf, as the per-layer all-reduce did), bf16 exact."""
    from lightning_fp8.distributed.all_gather import _local_amaxes
    from lightning_fp8.numerics.quantize import tensor_amax

    shards = [torch.randn(3, 4), torch.empty(0, 4), torch.tensor([[1.0, float("nan")]]),
              torch.randn(5, 2).bfloat16(), torch.tensor([[float("-inf"), 2.0]])]
    amaxes = _local_amaxes(shards)
    assert amaxes.dtype == torch.float32 and amaxes.shape == (5,)
    for amax, shard in zip(amaxes, shards):
        assert torch.equal(amax, tensor_amax(shard)) or (amax.isnan() and tensor_amax(shard).isnan())


def test_writes_to_an_fp8_all_gather_weight_are_counted_through_views_not_copies():
    """What invalidates an agreed amax besides an optimizer step: any op that writes to the shard through the
    subclass (in place, out=, foreach lists), also through a view of it (FSDP2's narrowed padded shard, `.detach()`,
    a state-dict tensor); a copy has a counter of its own. torch's _version misses DTensor and foreach steps."""
    weight = FP8AllGatherWeight(torch.randn(4, 4))
    writes = weight._writes
    view = weight.detach().narrow(0, 0, 2)
    assert view._writes is writes
    copy = weight.clone()
    assert copy._writes is not writes
    weight.mul_(2.0)
    view.copy_(torch.zeros(2, 4))
    torch._foreach_add_([weight], [torch.ones(4, 4)])
    torch.add(torch.ones(4, 4), 1.0, out=weight)
    assert writes[0] == 4 and copy._writes[0] == 0
    weight.sum(), weight.abs()  # reads count nothing
    assert writes[0] == 4
