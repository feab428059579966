"""An ordinary trl SFT script (trl/scripts/sft.py's pattern: `TrlParser`, `SFTConfig`, `SFTTrainer`), with no FP8 code
and no lightning_fp8 import.

trl's `SFTTrainer` is a transformers `Trainer`: it builds its own `accelerate.Accelerator`, and FP8 comes from the
launcher:

    python -m lightning_fp8.accelerate launch --mixed_precision fp8 examples/trl_sft.py --output_dir out    # FP8
    python examples/trl_sft.py --output_dir out                                                             # BF16
    python -m lightning_fp8.accelerate launch --mixed_precision fp8 examples/trl_sft.py --output_dir out --bf16 true
                                                                                        # BF16: the --bf16 you typed

`SFTConfig` turns bf16 on by default; under `--mixed_precision fp8` the launch's FP8 wins over that default, and one
line says so (docs/accelerate.md, "Which precision wins"). On a machine without a GPU add `--use_cpu true` (trl's bf16
default asks for one otherwise). Options also come from a YAML file: `--config sft.yaml`, as with trl's own scripts.

The model is a small Llama built from a config, the tokenizer a character-level one built in memory, the data lines of
the Python standard library's source (present wherever Python is): no download.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer, TrlParser


@dataclass
class ScriptArguments:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_samples: int = 256
    sample_chars: int = 48


def stdlib_lines(count: int, width: int) -> list:
    """`count` non-blank lines of the standard library's .py files, in a fixed order, each cut to `width` characters."""
    root = sysconfig.get_paths()["stdlib"]
    lines = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                lines += [line.strip()[:width] for line in f if line.strip()]
            if len(lines) >= count:
                break
    return lines[:count]


def char_tokenizer(texts: list) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (a BPE model with no merges) over the characters of `texts`."""
    chars = sorted(set("".join(texts)))
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main(script_args: ScriptArguments, training_args: SFTConfig) -> None:
    texts = stdlib_lines(script_args.num_samples, script_args.sample_chars)
    tokenizer = char_tokenizer(texts)
    config = LlamaConfig(vocab_size=-(-len(tokenizer) // 16) * 16, hidden_size=script_args.hidden_size,  # padded
                         intermediate_size=2 * script_args.hidden_size, num_hidden_layers=script_args.num_hidden_layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config),
        args=training_args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"mixed_precision={trainer.accelerator.mixed_precision} accelerator={type(trainer.accelerator).__name__} "
              f"steps={trainer.state.global_step} last_loss={losses[-1]:.4f}")


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig))
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args)
