"""The FSDP2 patterns Lightning and Fabric document, unchanged, train in FP8 with FP8 all-gather: `fully_shard` in
`configure_model` (ModelParallelStrategy) or in Fabric's `parallelize_fn`, with no lightning_fp8 line in them.

One rank in this process (FSDP2 over a 1-rank gloo group: the conversion and the all-gather extension are what is
checked), and two ranks through examples/fsdp2_model_parallel.py (meta-device init, Lightning's own launcher)."""
import os
import re
import subprocess
import sys

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
