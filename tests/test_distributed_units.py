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
    from lightning_fp8.modules.gathered_fp8 import CastKey

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


# -- a one-rank gloo group: DTensor losses, torch's styles on FP8 layers ------------------------------------------
@pytest.fixture
def gloo_one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_engine_takes_a_dtensor_loss_by_the_value_every_rank_holds(gloo_one_rank):
    """A loss computed under torch's loss_parallel() is a replicated DTensor: the engine records its local value
    (before: `aten.cat.default got mixed torch.Tensor and DTensor` when the decision's flags were read); a NaN one
    still skips the step and rolls back. A DTensor that is not replicated everywhere is read whole (full_tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lightning_fp8 import FP8Recipe
    from lightning_fp8.engine.iteration_checks import plain_value
    from lightning_fp8.engine.engine import FP8TrainingEngine

    mesh = init_device_mesh("cpu", (1,))
    model = convert_to_fp8(_mlp(), FP8Recipe(keep_first_last_in_bf16=False), verbose=False)
    engine = FP8TrainingEngine(FP8Recipe(keep_first_last_in_bf16=False))
    engine.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.track([optimizer])
    for step in range(3):
        engine.begin_iteration()
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
            loss = model(torch.randn(8, 32)).float().pow(2).mean()
        if step == 1:
            loss = loss + float("nan")
        loss = DTensor.from_local(loss, mesh, (Replicate(),), run_check=False)
        engine.scale_loss(loss).backward()
        engine.step(optimizer, optimizer.step)
        optimizer.zero_grad()
    engine.end_iteration()
    assert engine.step_count == 3 and engine.skipped_steps == 1 and engine.rollbacks == 1
    sharded = DTensor.from_local(torch.arange(4.0), mesh, (Shard(0),), run_check=False)
    assert torch.equal(plain_value(sharded), torch.arange(4.0)) and not hasattr(plain_value(sharded), "placements")


def test_torch_rowwise_parallel_splits_an_fp8_layer_as_it_splits_nn_linear(gloo_one_rank):
    """torch's RowwiseParallel on a converted layer (the FP8 metadata submodule holds no weight to shard): the same
    parameters and outputs as lightning_fp8's FP8RowwiseParallel. Before: "torch's RowwiseParallel was applied to an
    FP8 layer"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_fp8 import FP8Recipe
    from lightning_fp8.distributed import FP8ColwiseParallel, FP8RowwiseParallel

    mesh = init_device_mesh("cpu", (1,))
    recipe = FP8Recipe(keep_first_last_in_bf16=False)
    plain = convert_to_fp8(_mlp(), recipe, verbose=False)
    fp8 = convert_to_fp8(_mlp(), recipe, verbose=False)
    parallelize_module(plain, mesh, {"2": ColwiseParallel(), "4": RowwiseParallel()})
    parallelize_module(fp8, mesh, {"2": FP8ColwiseParallel(), "4": FP8RowwiseParallel()})
    assert plain[4].weight.placements == fp8[4].weight.placements
    assert type(plain[4].fp8_meta.weight).__name__ == "RoleState"  # the metadata's role view, left alone
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
        assert torch.equal(plain(x), fp8(x))


def test_the_conversion_summary_is_logged_once_per_set_of_layers():
    """A model summarized when its inner model was converted (convert_for_fsdp in configure_model, then the
    strategy's conversion of the LightningModule) is not summarized again; another model is."""
    from lightning_fp8.integrations.plugin_core import FP8PrecisionCore

    logged = []
    core = FP8PrecisionCore(example_input=torch.zeros(1, 32))  # first / last traced at conversion: summary there
    core._rank_zero_info = lambda message: logged.append(message)
    inner = _mlp()
    core.convert_module(inner)
    core.convert_module(nn.Sequential(inner))  # the wrapper holds the same FP8 layers
    assert sum("linear layers run in FP8" in m for m in logged) == 1
    core.convert_module(_mlp())
    assert sum("linear layers run in FP8" in m for m in logged) == 2
    core._summary_deferred = True  # the Lightning plugin, from before configure_model to the strategy's conversion
    assert core.log_summary(_mlp()) is False


def test_linear_layers_built_in_module_init_context_are_fp8_layers_decided_by_the_rules():
    """Inside the plugins' module_init_context `nn.Linear(...)` builds an FP8Linear (as Lightning's TE plugin builds
    te.Linear); isinstance checks against nn.Linear hold for every linear layer, and a class derived inside is a plain
    nn.Linear subclass. The next conversion decides those layers with every rule: the same FP8 layers, reasons and
    weights as converting the same model built outside."""
    from lightning_fp8 import fp8_layers, precision_map
    from lightning_fp8.conversion.built_layers import BUILT_UNDECIDED_ATTR as CONSTRUCTED_ATTR
    from lightning_fp8.modules.linear import FP8Linear

    original = nn.Linear
    before = nn.Linear(4, 4)
    plugin = FabricFP8Precision(example_input=torch.zeros(1, 32))  # first / last decided at conversion
    with plugin.module_init_context():
        assert torch.nn.Linear is not original
        torch.manual_seed(0)
        built = _mlp()
        assert isinstance(built[0], FP8Linear) and built[0].__dict__[CONSTRUCTED_ATTR]
        assert isinstance(before, nn.Linear) and isinstance(built[0], nn.Linear) and issubclass(FP8Linear, nn.Linear)

        class Derived(nn.Linear):
            pass

        assert type(Derived(4, 4)) is Derived
    assert torch.nn.Linear is original and nn.Linear is original
    plugin.convert_module(built)
    reference = FabricFP8Precision(example_input=torch.zeros(1, 32)).convert_module(_mlp())
    rows, expected = precision_map(built), precision_map(reference)
    assert [(r.fqn, r.precision, r.reason) for r in rows] == [(r.fqn, r.precision, r.reason) for r in expected]
    assert sorted(fp8_layers(built)) == ["2", "4"] and type(built[0]) is original
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), reference.parameters()))
