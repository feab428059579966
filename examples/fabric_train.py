"""Lightning Fabric in FP8: `Fabric(plugins=lightning_fp8.fabric.FP8Precision())` around an ordinary Fabric loop.

    python examples/fabric_train.py [--steps 200] [--save ckpt.pt]

The loop is what Fabric documents (setup, backward, clip_gradients, optimizer.step, an LR scheduler, fabric.save);
the plugin converts the model at `fabric.setup`, scales the loss in `fabric.backward`, skips non-finite steps and rolls
back a diverging run in `optimizer.step()`. Two FP8-aware lines: `register_lr_scheduler` (Fabric does not show a
plugin its schedulers, and a rollback must restore the schedule too) and `error_if_nonfinite=False` in clipping (a
non-finite norm is the engine's to skip). Saving the plugin with the checkpoint keeps the loss scale and every
layer's FP8 scales. The model is the demo's char-GPT on the Python standard library's text.
"""
from __future__ import annotations

import argparse
import math

import lightning as L
import torch

from lightning_fp8.demo.data import batches, fixed_val_batches, load_corpus
from lightning_fp8.demo.gpt import GPT, GPTConfig
from lightning_fp8.fabric import FP8Precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--max-chars", type=int, default=400_000)
    p.add_argument("--save", default=None, help="fabric.save() the model, optimizer and FP8 state here at the end")
    args = p.parse_args()

    precision = FP8Precision()
    fabric = L.Fabric(accelerator="auto", devices=1, plugins=[precision])
    fabric.seed_everything(0)
    corpus = load_corpus(max_chars=args.max_chars)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=64, n_layers=2, n_heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    precision.register_lr_scheduler(scheduler)
    model, optimizer = fabric.setup(model, optimizer)

    for x, y in batches(corpus.train, args.batch_size, args.context, args.steps, seed=0):
        x, y = fabric.to_device((x, y))
        loss = model.loss(x, y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    model.eval()
    with torch.no_grad():
        val = [model.loss(*fabric.to_device(b)).item() for b in fixed_val_batches(corpus.val, args.batch_size,
                                                                                  args.context, 4)]
    fabric.print(f"final val loss {sum(val) / len(val):.4f}, {precision.skipped_steps} skipped steps, "
                 f"{precision.rollbacks} rollbacks, loss dtype {loss.dtype}")
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "fp8": precision})


if __name__ == "__main__":
    main()
