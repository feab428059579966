"""An ordinary Hugging Face Accelerate training script, with no FP8 code and no lightning_fp8 import.

It builds `accelerate.Accelerator()`, as scripts written for Accelerate do (run_clm_no_trainer.py's pattern: prepare,
accumulate, backward, clip, step, a scheduler, evaluation). FP8 comes from the launcher alone:

    python -m lightning_fp8.accelerate launch --mixed_precision fp8 examples/accelerate_unchanged.py      # FP8
    python -m lightning_fp8.accelerate launch --mixed_precision bf16 examples/accelerate_unchanged.py     # BF16
    ACCELERATE_USE_CPU=1 python -m lightning_fp8.accelerate launch --multi_gpu --num_processes 2 \\
        --mixed_precision fp8 examples/accelerate_unchanged.py                                          # 2 CPU ranks

Under `--mixed_precision fp8` the launcher makes the script's Accelerator run FP8 on lightning_fp8's engine
(docs/accelerate.md, "Unchanged scripts"). The model is a small GPT-2 (transformers) trained on characters of the
Python standard library's source (present wherever Python is; no download); the learning rate warms up and decays
linearly to zero, so runs compare at their final evaluation loss.
"""
from __future__ import annotations

import argparse
import os
import sysconfig

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup


def stdlib_text(max_chars: int) -> str:
    """The first `max_chars` characters of the standard library's .py files, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    parts, size = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
            size += len(parts[-1])
            if size >= max_chars:
                break
    return "".join(parts)[:max_chars]


class Windows(Dataset):
    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int):
        chunk = self.ids[i * self.block: (i + 1) * self.block]
        return {"input_ids": chunk, "labels": chunk}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=400_000)
    p.add_argument("--output-dir", default=None, help="accelerator.save_state() here at the end")
    args = p.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    set_seed(args.seed)
    text = stdlib_text(args.max_chars)
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(ids))
    train = DataLoader(Windows(ids[:split], args.block_size), batch_size=args.batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(args.seed))
    evaluation = DataLoader(Windows(ids[split:], args.block_size), batch_size=args.batch_size)
    config = GPT2Config(vocab_size=len(chars), n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.steps // 10, args.steps)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)

    step = 0
    model.train()
    while step < args.steps:
        for batch in train:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step == args.steps:
                    break

    model.eval()
    losses = []
    with torch.no_grad():
        for batch in evaluation:
            losses.append(accelerator.gather_for_metrics(model(**batch).loss.reshape(1)))
    eval_loss = torch.cat(losses).float().mean().item()
    accelerator.print(f"mixed_precision={accelerator.mixed_precision} accelerator={type(accelerator).__name__} "
                      f"steps={step} eval_loss={eval_loss:.4f}")
    if args.output_dir:
        accelerator.save_state(args.output_dir)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
