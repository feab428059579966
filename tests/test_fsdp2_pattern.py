"""The FSDP2 patterns Lightning and Fabric document, unchanged, train in FP8 with FP8 all-gather: `fully_shard` in
`configure_model` (ModelParallelStrategy) or in Fabric's `parallelize_fn`, with no lightning_fp8 line in them.

One rank in this process (FSDP2 over a 1-rank gloo group: the conversion and the all-gather extension are what is
checked), and two ranks through examples/fsdp2_model_parallel.py (meta-device init, Lightning's own launcher)."""
import copy
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from support.helpers import RegressionModule, loader, mlp
from lightning_fp8 import FP8Precision, fp8_layers
from lightning_fp8.distributed import uses_fp8_all_gather

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def one_rank_group():
    """Lightning / Fabric set up a 1-rank gloo group and its environment: both are undone afterwards."""
    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


class ShardedInConfigureModel(RegressionModule):
    """Lightning's documented pattern: the model exists (built in __init__); configure_model only shards it."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def test_lightning_model_parallel_pattern_needs_no_fp8_line(one_rank_group):
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    model = ShardedInConfigureModel()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[FP8Precision()],
                        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    trainer.fit(model, loader())  # before: "already sharded by FSDP2 ... not converted to FP8 yet"
    layers = fp8_layers(model)
    assert sorted(layers) == ["net.2", "net.4"] and all(isinstance(m, FSDPModule) for m in layers.values())
    assert all(uses_fp8_all_gather(layer) for layer in layers.values())
    assert len(model.losses) == 3 and all(torch.isfinite(torch.tensor(model.losses)))
    assert trainer.precision_plugin.engine.layers.keys() == layers.keys()


def test_fabric_parallelize_fn_needs_no_fp8_line(one_rank_group):
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    def parallelize(module, mesh):  # what Fabric's docs show: no lightning_fp8 call in it
        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(module, mesh=mesh["data_parallel"])

    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision()],
                      strategy=ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=1))
    fabric.launch()
    model = fabric.setup(mlp())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in list(loader())[:3]:
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    layers = fp8_layers(model)
    # before: converted by Fabric before parallelize_fn, but gathered in high precision (a warning asked for a line)
    assert len(layers) == 2 and all(uses_fp8_all_gather(layer) for layer in layers.values())
    assert torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_two_ranks_meta_init_fp8_all_gather():
    """examples/fsdp2_model_parallel.py on 2 CPU ranks: the model built on the meta device in __init__, sharded in
    configure_model; every FP8 layer all-gathers in FP8 and the ranks end with identical weights."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "examples/fsdp2_model_parallel.py", "--steps", "6", "--max-chars", "30000",
                           "--batch-size", "4", "--context", "32"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = re.findall(r"rank (\d): (\d+) FP8 layers, (\d+) all-gather their weights in FP8, first loss ([0-9.]+), "
                       r"final loss ([0-9.]+), weights checksum ([-0-9.]+)", proc.stdout)
    assert sorted(r[0] for r in ranks) == ["0", "1"], proc.stdout[-2000:]
    for _, n_fp8, n_gather, first, final, _ in ranks:
        assert int(n_fp8) == int(n_gather) == 7  # 2 blocks x 4 linears + head = 9; first (block 0 qkv), last (head)
        assert float(final) < float(first)
    assert ranks[0][5] == ranks[1][5]  # identical weights on both ranks


class BuiltAndShardedInConfigureModel(RegressionModule):
    """The large-model form: nothing built in __init__, the model built and sharded in configure_model, no
    lightning_fp8 line."""

    def __init__(self):
        super().__init__(build_in_configure_model=True)

    def configure_model(self):
        if self.net is not None:
            return
        self.net = mlp(self.d, self.hidden)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def test_lightning_model_built_inside_configure_model_is_built_in_fp8(one_rank_group):
    """Its nn.Linear layers are built as FP8 layers with FP8 all-gather weights (the plugin's module_init_context,
    as Lightning's TransformerEnginePrecision builds te.Linear); the first / last rule decides them after sharding,
    in module order, and the two it keeps in BF16 gather their weights in high precision only. Before: "already
    sharded by FSDP2 ... not converted to FP8 yet"."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_fp8 import precision_map
    from lightning_fp8.distributed import fp8_all_gather_reason

    torch.manual_seed(0)
    model = BuiltAndShardedInConfigureModel()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[FP8Precision()],
                        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    trainer.fit(model, loader())
    assert nn.Linear is torch.nn.modules.linear.Linear  # the context is over
    rows = {row.fqn: row for row in precision_map(model)}
    assert [fqn for fqn, row in rows.items() if row.precision == "fp8"] == ["net.2", "net.4"]
    for fqn, which in (("net.0", "first"), ("net.6", "last")):
        assert rows[fqn].reason.startswith(f"{which} linear layer kept in BF16")
        assert "module order, a guess: the layers were built and sharded inside configure_model" in rows[fqn].reason
    layers = fp8_layers(model)
    assert sorted(layers) == ["net.0", "net.2", "net.4", "net.6"]  # all built as FP8 layers, all sharded
    assert [fqn for fqn, layer in layers.items() if uses_fp8_all_gather(layer)] == ["net.2", "net.4"]
    assert fp8_all_gather_reason(layers["net.0"]) == "computes in BF16: kept there by the conversion rules"
    assert len(model.losses) == 3 and all(torch.isfinite(torch.tensor(model.losses)))
    assert trainer.precision_plugin.engine.layers.keys() == layers.keys()


@pytest.fixture
def gloo_one_rank():
    """A one-rank gloo process group for raw FSDP2 / DTensor, ended afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fp8_all_gather_is_asked_of_the_layer_while_fsdp2_holds_the_weight_unsharded(gloo_one_rank):
    """After the forward of a unit with reshard_after_forward=False (Fabric's example does this for its last block;
    FSDP2 never reshards the root after forward) the layer's weight is the gathered GatheredFP8Weight: the layer still
    says it all-gathers in FP8, and the plugin's check does not warn. A layer marked to gather in high precision
    hands its forward a plain high-precision weight and says so."""
    from lightning_fp8 import convert_to_fp8
    from lightning_fp8.distributed import enable_fp8_all_gather, fp8_all_gather_reason
    from lightning_fp8.distributed.all_gather import gather_in_high_precision
    from lightning_fp8.integrations._distributed import warn_if_gathered_in_high_precision
    from lightning_fp8.modules.autocast import fp8_autocast
    from lightning_fp8.modules.gathered_fp8 import GatheredFP8Weight

    torch.manual_seed(0)
    model = convert_to_fp8(mlp(), verbose=False)
    reference = copy.deepcopy(model)
    reference[4].fp8_enabled = False
    enable_fp8_all_gather(model)
    gather_in_high_precision(model[4], "computes in BF16: kept there by the conversion rules")
    model[4].fp8_enabled = False
    for layer in (model[2], model[4]):
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(model)
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
        out = model(x)
        assert torch.equal(out, reference(x))  # the FP8 gather's bytes and the high-precision gather: exact
    assert isinstance(model[2].weight, GatheredFP8Weight) and uses_fp8_all_gather(model[2])  # unsharded, FP8
    assert type(model[4].weight) is nn.Parameter and not uses_fp8_all_gather(model[4])  # unsharded, high precision
    assert fp8_all_gather_reason(model[4]) == "computes in BF16: kept there by the conversion rules"
    warned = []
    core = SimpleNamespace(options=SimpleNamespace(fp8_all_gather=True), _rank_zero_warn=warned.append)
    warn_if_gathered_in_high_precision(core, model)
    assert warned == []
    out.float().sum().backward()
    assert model[4].weight.grad is not None and torch.isfinite(model[4].weight.grad.full_tensor()).all()
