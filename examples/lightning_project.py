"""A Lightning project in FP8: the plugin, the three callbacks, the logger of your choice, then the HTML report.

    python examples/lightning_project.py [--steps 200] [--out lightning_logs_fp8]
    lightning-fp8 report <the printed log dir>          # the same report, from the command line

The LightningModule is the demo's char-GPT (lightning_fp8/demo/module.py) on the text of the Python standard library;
nothing in it knows about FP8. FP8 comes from `Trainer(plugins=FP8Precision())`; FP8Calibration initialises the
scales from a few real batches, FP8ScaleMonitor logs per-layer health (4 columns per layer in metrics.csv by default;
everything in fp8_history.jsonl), FP8LayerFallback moves a layer that cannot live in FP8 to BF16. At the end the
script prints the precision map and writes fp8_report.html next to metrics.csv.
"""
from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_fp8 import FP8Precision, precision_map
from lightning_fp8.callbacks import FP8Calibration, FP8LayerFallback, FP8ScaleMonitor
from lightning_fp8.demo.data import batches, fixed_val_batches, load_corpus
from lightning_fp8.demo.gpt import GPTConfig
from lightning_fp8.demo.module import CharGPTModule
from lightning_fp8.report import write_report


class Batches(IterableDataset):
    def __init__(self, *args):
        self.args = args

    def __iter__(self):
        return batches(*self.args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--max-chars", type=int, default=400_000)
    p.add_argument("--out", default="lightning_logs_fp8")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    corpus = load_corpus(max_chars=args.max_chars)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model, n_layers=2, n_heads=4)
    module = CharGPTModule(cfg, lr=3e-3, max_steps=args.steps, warmup_steps=max(1, args.steps // 10))
    trainer = L.Trainer(
        accelerator="auto", devices=1, max_steps=args.steps, plugins=[FP8Precision()],
        callbacks=[FP8Calibration(num_batches=2), FP8ScaleMonitor(log_every_n_steps=10), FP8LayerFallback()],
        logger=CSVLogger(args.out, name="char_gpt"), log_every_n_steps=10, gradient_clip_val=1.0,
        val_check_interval=args.steps, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False,
    )
    train = DataLoader(Batches(corpus.train, args.batch_size, args.context, args.steps, 0), batch_size=None)
    val = DataLoader(fixed_val_batches(corpus.val, args.batch_size, args.context, 4), batch_size=None)
    trainer.fit(module, train, val)

    for row in precision_map(module):
        print(f"  {row.fqn:<22} {row.precision:<5} {row.reason}")
    plugin = trainer.precision_plugin
    print(f"final val loss {module.val_losses[-1]:.4f}, {plugin.skipped_steps} skipped steps, "
          f"{plugin.rollbacks} rollbacks")
    print(f"report: {write_report(trainer.log_dir)}")


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
