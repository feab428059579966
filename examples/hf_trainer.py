"""An ordinary transformers `Trainer` script (run_clm.py's pattern), with no FP8 code and no lightning_fp8 import.

transformers' Trainer builds its own `accelerate.Accelerator` inside `Trainer.__init__`; FP8 comes from the launcher:

    python -m lightning_fp8.accelerate launch --mixed_precision fp8 examples/hf_trainer.py --output_dir out   # FP8
    python examples/hf_trainer.py --output_dir out --bf16                                                      # BF16
    ACCELERATE_USE_CPU=1 python -m lightning_fp8.accelerate launch --multi_gpu --num_processes 2 \\
        --mixed_precision fp8 examples/hf_trainer.py --output_dir out                                        # 2 ranks

Without the launcher, one line before the TrainingArguments are parsed does the same (docs/accelerate.md):

    import lightning_fp8.accelerate; lightning_fp8.accelerate.enable_fp8()

(do not pass --bf16 / --fp16 with FP8: an explicit precision wins, and a warning says so.) Checkpoints
(`--save_steps`, `--resume_from_checkpoint`) carry the FP8 state (scaler.pt). The model is a small GPT-2 trained on
characters of the Python standard library's source (no download); every TrainingArguments flag works as usual.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments, set_seed


@dataclass
class ModelArguments:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    block_size: int = 64
    max_chars: int = 400_000


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
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    text = stdlib_text(model_args.max_chars)
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(ids))
    config = GPT2Config(vocab_size=len(chars), n_positions=model_args.block_size, n_embd=model_args.n_embd,
                        n_layer=model_args.n_layer, n_head=model_args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training_args,
                      train_dataset=Windows(ids[:split], model_args.block_size),
                      eval_dataset=Windows(ids[split:], model_args.block_size))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"mixed_precision={trainer.accelerator.mixed_precision} accelerator={type(trainer.accelerator).__name__} "
              f"steps={trainer.state.global_step} eval_loss={metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
