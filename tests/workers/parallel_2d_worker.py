"""Run by tests/test_parallel_2d.py (4 CPU ranks, gloo): FSDP2 over the data-parallel mesh dimension x tensor
parallelism over the other (2 x 2), in ONE launch. Tiny model (the 4 processes share 2 cores).

    python tests/workers/parallel_2d_worker.py OUT_DIR [scenario ...]  # forks its 4 ranks (launch_forked)
    python -m torch.distributed.run --nproc_per_node 4 tests/workers/parallel_2d_worker.py OUT_DIR [scenario ...]

The mesh is (data_parallel, tensor_parallel) = (2, 2): ranks {0, 1} and {2, 3} are the tensor-parallel groups, each
reading its own batches. Each scenario writes OUT_DIR/<scenario>.rank<r>.pt (or .error).
"""
import os
import sys
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
from support.parallel_training import (  # noqa: E402
    CFG, STEPS, full_weights, inf_gradient_on_rank_1, nan_loss_on_rank_0, run_scenarios, schedule,
)
from support.torchrun_launch import launch_forked  # noqa: E402

from lightning_fp8 import FP8Precision, fp8_state_dict  # noqa: E402
from lightning_fp8.demo.parallel_gpt import ParallelGPT, parallelize_gpt  # noqa: E402

OUT = sys.argv[1]
CKPT_STEP = 4  # the checkpoint after both faults (support/parallel_training.py); two steps resumed




def batch(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.context + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]










def summary(engine, model) -> dict:
    return {"fp8": {k: v.clone() for k, v in fp8_state_dict(model).items()},
            "skips": [e["step"] for e in engine.events if e["kind"] == "skip"],
            "rollbacks": [e["step"] for e in engine.events if e["kind"] == "rollback"],
            "loss_scale": engine.loss_scale}


def parallelize_2d(model: nn.Module, mesh) -> nn.Module:
    """The documented order: the tensor-parallel plan, then FSDP2 over the data-parallel dimension. No lightning_fp8
    line: the plugins convert with FP8 all-gather weights before configure_model / the parallelize function."""
    parallelize_gpt(model, mesh["tensor_parallel"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


# -- Lightning --------------------------------------------------------------------------------------------------
class GPTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = ParallelGPT(CFG)
        self.losses = []

    def configure_model(self) -> None:
        parallelize_2d(self.model, self.device_mesh)

    def training_step(self, _, __):
        x, y = batch(self.trainer.global_step, self.device_mesh["data_parallel"].get_local_rank())
        loss = self.model.loss(x, y)
        self.losses.append(float(loss.detach()))
        return nan_loss_on_rank_0(loss, self.trainer.global_step)

    def on_after_backward(self) -> None:
        inf_gradient_on_rank_1(self.model, self.trainer.global_step)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}]


def trainer(plugin, callbacks=()):
    return L.Trainer(
        accelerator="cpu", devices=4, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        plugins=[plugin], max_steps=STEPS, logger=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, gradient_clip_val=1.0,
        num_sanity_val_steps=0,
    )


def lightning_2d():
    """ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2) + FP8Precision (FP8 all-gather, FP8
    tensor-parallel styles): 6 steps with a skip and a rollback injected on one rank each, a distributed checkpoint
    at step 4 by a real ModelCheckpoint; a fresh Trainer resumes from it and trains steps 5-6."""
    ckpt_dir = os.path.join(OUT, "lightning_2d_ckpt")
    plugin = FP8Precision(loss_scaling="dynamic")
    module = GPTModule()
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=CKPT_STEP, save_top_k=-1)
    from lightning_fp8.distributed import all_gather, uses_fp8_all_gather

    from lightning.fabric.utilities import rank_zero

    agreements, real = [], all_gather._all_reduce_max  # the weight-amax all-reduces of FP8 all-gather, counted
    all_gather._all_reduce_max = lambda amaxes, group: (agreements.append(amaxes.numel()), real(amaxes, group))
    logged, info = [], rank_zero.rank_zero_info  # what the plugin logs (on every rank; rank 0 prints it)
    rank_zero.rank_zero_info = lambda message, *args, **kwargs: logged.append(str(message))
    try:
        trainer(plugin, [callback]).fit(module, DataLoader(list(range(4 * STEPS)), batch_size=1))
    finally:
        all_gather._all_reduce_max = real
        rank_zero.rank_zero_info = info
    fc1 = module.model.blocks[1].mlp.fc1
    result = {"losses": module.losses, "weights": full_weights(module.model), **summary(plugin.engine, module.model),
              "fc1_placements": str(fc1.weight.placements), "fc1_local": type(fc1.weight.to_local()).__name__,
              "amax_all_reduces": agreements, "summaries": sum("linear layers run in FP8" in m for m in logged),
              "fp8_all_gather_layers": sum(uses_fp8_all_gather(m) for m in module.model.modules())}
    path = os.path.join(ckpt_dir, sorted(f for f in os.listdir(ckpt_dir) if f"step={CKPT_STEP}" in f)[0])
    result["ckpt_is_dir"] = os.path.isdir(path)
    plugin_b = FP8Precision(loss_scaling="dynamic")
    resumed = GPTModule()
    trainer(plugin_b).fit(resumed, DataLoader(list(range(4 * STEPS)), batch_size=1), ckpt_path=path)
    result.update({"resumed_losses": resumed.losses, "resumed_weights": full_weights(resumed.model),
                   "resumed": summary(plugin_b.engine, resumed.model)})
    return result


# -- Fabric -----------------------------------------------------------------------------------------------------
def fabric_2d():
    """Fabric's ModelParallelStrategy over the same 2 x 2 mesh with gradient_communication="fp8" (FSDP2's FP8
    reduce-scatter and the styles' FP8 reduce-scatters): fabric.save at step 2, two more steps; a fresh setup
    resumes with lightning_fp8.fabric.load_checkpoint and trains the same two steps."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
    from lightning_fp8.fabric import load_checkpoint

    save_step, steps = 2, 4

    def build():
        plugin = FabricFP8Precision(loss_scaling="dynamic", gradient_communication="fp8")
        strategy = FabricModelParallel(parallelize_2d, data_parallel_size=2, tensor_parallel_size=2)
        fabric = Fabric(accelerator="cpu", devices=4, plugins=[plugin], strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup_module(ParallelGPT(CFG))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        return fabric, plugin, model, optimizer

    def train(fabric, model, optimizer, steps):
        losses = []
        dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()
        for step in steps:
            x, y = batch(step, dp_rank)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    fabric, plugin, model, optimizer = build()
    losses = train(fabric, model, optimizer, range(save_step))
    path = os.path.join(OUT, "fabric_2d_ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "fp8": plugin})
    losses += train(fabric, model, optimizer, range(save_step, steps))
    comm = model.module.blocks[0]._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
    result = {"losses": losses, "weights": full_weights(model.module), **summary(plugin.engine, model.module),
              "fsdp_comm": type(comm).__name__}
    fabric_b, plugin_b, model_b, optimizer_b = build()
    state = {"model": model_b, "optimizer": optimizer_b, "fp8": plugin_b}
    load_checkpoint(fabric_b, path, state)
    resumed = train(fabric_b, model_b, optimizer_b, range(save_step, steps))
    result.update({"resumed_losses": resumed, "resumed_weights": full_weights(model_b.module),
                   "resumed": summary(plugin_b.engine, model_b.module)})
    return result


SCENARIOS = {"lightning_2d": lightning_2d, "fabric_2d": fabric_2d}


def main() -> None:
    run_scenarios(SCENARIOS, OUT)


if __name__ == "__main__":
    launch_forked(main, 4)
