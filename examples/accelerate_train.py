"""Train the demo char-GPT with Hugging Face Accelerate; FP8 comes from the launcher, not from the script.

This is an ordinary Accelerate script. The one FP8-specific line is `FP8Accelerator()` instead of `Accelerator()`;
the precision comes from wherever Accelerate reads it:

    python -m lightning_fp8.accelerate launch --mixed_precision fp8 examples/accelerate_train.py
    ACCELERATE_MIXED_PRECISION=fp8 python examples/accelerate_train.py
    python examples/accelerate_train.py --mixed-precision fp8
    ACCELERATE_USE_CPU=1 python -m lightning_fp8.accelerate launch --multi_gpu --num_processes 2 \
        --mixed_precision fp8 examples/accelerate_train.py              # 2 CPU processes (gloo)

With `--mixed_precision bf16` (or "no") the same script is a plain Accelerate baseline. The corpus is the text of
CPython's standard library (lightning_fp8.demo.data; no download), or any text file given with --data.
The learning rate warms up and decays to zero (cosine), so runs can be compared at their final validation loss.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs
from lightning_fp8.conversion.convert import precision_map
from lightning_fp8.demo.data import fixed_val_batches, load_corpus
from lightning_fp8.demo.gpt import GPT, GPTConfig


class RandomWindows(Dataset):
    """`n` (input, target) windows of the corpus at reproducible random offsets."""

    def __init__(self, ids: torch.Tensor, context: int, n: int, seed: int) -> None:
        self.ids, self.context = ids, context
        self.starts = torch.randint(0, len(ids) - context - 1, (n,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s = int(self.starts[i])
        return self.ids[s : s + self.context], self.ids[s + 1 : s + self.context + 1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per process per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps before the cosine decay")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="a text file (default: the Python standard library's source)")
    p.add_argument("--max-chars", type=int, default=1_000_000)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16", "fp8"],
                   help="overrides the launcher / ACCELERATE_MIXED_PRECISION (default: take it from there)")
    p.add_argument("--loss-scaling", default="auto", help='FP8 loss scaling: "auto", "dynamic", "none" or a number')
    p.add_argument("--save-dir", default=None, help="save_state() here at the end")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, val) -> float:
    model.eval()
    total = 0.0
    for x, y in val:
        logits = model(x)
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    model.train()
    return total / len(val)


def main() -> None:
    args = parse_args()
    loss_scaling = args.loss_scaling
    if loss_scaling not in ("auto", "dynamic", "none"):
        loss_scaling = float(loss_scaling)
    accelerator = FP8Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.grad_accum,
        kwargs_handlers=[FP8Kwargs(loss_scaling=loss_scaling)],  # used only when mixed precision is fp8
    )
    torch.manual_seed(args.seed)
    corpus = load_corpus(args.data, max_chars=args.max_chars)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model, n_layers=args.n_layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    # a prepared scheduler steps num_processes times per optimizer step (Accelerate's convention: the schedule is
    # written in batches of the unsharded data loader)
    total, warmup = args.steps * accelerator.num_processes, args.warmup * accelerator.num_processes

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    windows = args.steps * args.grad_accum * args.batch_size * accelerator.num_processes
    train = DataLoader(RandomWindows(corpus.train, args.context, windows, args.seed), batch_size=args.batch_size)
    val = fixed_val_batches(corpus.val, args.batch_size, args.context, args.val_batches)
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, train, scheduler)
    val = [(x.to(accelerator.device), y.to(accelerator.device)) for x, y in val]

    unwrapped = accelerator.unwrap_model(model)
    rows = precision_map(unwrapped)
    accelerator.print(
        f"mixed_precision={accelerator.mixed_precision} processes={accelerator.num_processes} "
        f"device={accelerator.device} linears in fp8: {sum(r.precision == 'fp8' for r in rows)}/{len(rows)}"
    )
    start, step = time.time(), 0
    for x, y in train:
        with accelerator.accumulate(model):
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                accelerator.print(
                    f"step {step:5d}  train loss {loss.item():.4f}  val loss {evaluate(model, val):.4f}  "
                    f"lr {scheduler.get_last_lr()[0]:.2e}  {time.time() - start:.0f}s"
                )
    val_loss = evaluate(model, val)
    if args.save_dir:
        accelerator.save_state(args.save_dir)
    accelerator.print(f"final val loss {val_loss:.4f}")
    accelerator.print(
        f"fp8 counters: skipped_steps={accelerator.skipped_steps} rollbacks={accelerator.rollbacks} "
        f"loss_scale={accelerator.loss_scale:g}"
    )


if __name__ == "__main__":
    main()
