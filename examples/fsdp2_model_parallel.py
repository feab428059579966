"""FSDP2 with Lightning's ModelParallelStrategy, written as Lightning documents it, trained in FP8.

The LightningModule builds its model in `__init__` (on the meta device: `trainer.init_module(empty_init=True)`, so a
large model is never materialized whole) and shards it with `fully_shard` in `configure_model`. The only FP8 line is
the plugin: it converts the model (FP8 layers, FP8 all-gather of their weights) right before `configure_model` runs,
so nothing in the module mentions FP8 (docs/distributed.md, "FSDP2").

    python examples/fsdp2_model_parallel.py                     # 2 CPU processes (gloo), started by Lightning
    python examples/fsdp2_model_parallel.py --devices 4 --accelerator cuda

Each rank prints its FP8 layer count, how many of them all-gather their weights in FP8, its final training loss and a
checksum of the full weights (equal on every rank). The model is the demo's small GPT on the text of the Python
standard library (lightning_fp8.demo; no download).
"""
from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from lightning_fp8 import FP8Precision, fp8_layers
from lightning_fp8.demo.data import batches, load_corpus
from lightning_fp8.demo.gpt import GPT, GPTConfig
from lightning_fp8.distributed import uses_fp8_all_gather


class LanguageModel(L.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float, steps: int) -> None:
        super().__init__()
        self.model = GPT(cfg)
        self.lr, self.steps = lr, steps
        self.losses = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model.loss(x, y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.1)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / self.steps))
        return [optimizer], [{"scheduler": decay, "interval": "step"}]


class Batches(torch.utils.data.IterableDataset):
    def __init__(self, ids, batch_size, context, steps, seed):
        self.args = (ids, batch_size, context, steps, seed)

    def __iter__(self):
        return batches(*self.args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--max-chars", type=int, default=300_000)
    args = p.parse_args()

    corpus = load_corpus(max_chars=args.max_chars)
    strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        plugins=[FP8Precision()], max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    L.seed_everything(0, verbose=False)
    with trainer.init_module(empty_init=True):
        model = LanguageModel(GPTConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model,
                                        n_layers=2, n_heads=4), lr=3e-3, steps=args.steps)
    # every rank reads other windows of the corpus (seed per rank), as a distributed sampler would give it
    data = Batches(corpus.train, args.batch_size, args.context, args.steps, seed=trainer.global_rank)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))

    layers = fp8_layers(model)
    full = torch.cat([p.full_tensor().detach().reshape(-1).float() for p in model.parameters()])
    print(f"rank {trainer.global_rank}: {len(layers)} FP8 layers, "
          f"{sum(uses_fp8_all_gather(layer) for layer in layers.values())} all-gather their weights in FP8, "
          f"first loss {model.losses[0]:.4f}, final loss {model.losses[-1]:.4f}, "
          f"weights checksum {float(full.double().sum()):.6f}", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # gloo aborts at interpreter exit otherwise (docs/plugin.md)


if __name__ == "__main__":
    main()
