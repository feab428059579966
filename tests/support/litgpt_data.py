"""Local data for litgpt's commands in tests, no download and no litdata: `LocalTextBytes`, a pretraining data module
over a text file (its UTF-8 bytes are the tokens, vocabulary 256), and `make_checkpoint_dir`, a litgpt checkpoint
directory (random weights, a byte-level tokenizer) that `finetune_lora` and `merge_lora` accept."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader

from litgpt.data import DataModule
from litgpt.tokenizer import Tokenizer


@dataclass
class LocalTextBytes(DataModule):
    """Fixed-length windows of a local text file's bytes (train: the first 90 %, val: the rest), for `litgpt pretrain
    --data support.litgpt_data.LocalTextBytes --data.path FILE`."""

    path: Path
    seed: int = 42

    tokenizer: Optional[Tokenizer] = field(default=None, init=False, repr=False)
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()

    def connect(self, tokenizer: Optional[Tokenizer] = None, batch_size: int = 1, max_seq_length: int = -1) -> None:
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length + 1  # the next token as well

    def _windows(self, data: torch.Tensor) -> torch.Tensor:
        n = len(data) // self.max_seq_length
        return data[: n * self.max_seq_length].view(n, self.max_seq_length)

    def setup(self, stage: str = "") -> None:
        data = torch.frombuffer(bytearray(Path(self.path).read_bytes()), dtype=torch.uint8).long()
        split = int(len(data) * 0.9)
        self.train_windows, self.val_windows = self._windows(data[:split]), self._windows(data[split:])

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(self.train_windows, self.batch_size, self.seed)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_windows, batch_size=self.batch_size, drop_last=True)


class ResumableLoader(DataLoader):
    """Shuffled batches in an order fixed by (seed, epoch) that a checkpoint resumes where it left them: its
    `state_dict` is what litgpt's `fabric.save` stores for its train dataloader (as litdata's StreamingDataLoader)."""

    def __init__(self, windows: torch.Tensor, batch_size: int, seed: int) -> None:
        super().__init__(windows, batch_size=batch_size, drop_last=True)
        self.seed, self.epoch, self.served = seed, 0, 0

    def __iter__(self):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for index in range(self.served, len(order) // self.batch_size):
            self.served = index + 1
            yield self.dataset[order[index * self.batch_size:(index + 1) * self.batch_size]]
        self.epoch, self.served = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.served = state["epoch"], state["served"]


def write_byte_tokenizer(directory: Path) -> None:
    """A Hugging Face `tokenizer.json` whose tokens are the 256 bytes (byte-level BPE without merges) plus "<s>"
    (256) and "</s>" (257), and the `tokenizer_config.json` litgpt's Tokenizer reads them from."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_to_unicode)}
    vocab["<s>"], vocab["</s>"] = 256, 257
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}))


def _byte_of(ch: str) -> int:
    """The byte a character of GPT-2's byte-level alphabet stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def make_checkpoint_dir(directory: Path, config, seed: int = 0) -> Path:
    """A litgpt checkpoint directory for `config` (a `litgpt.Config`): `lit_model.pth` (a plain GPT's random
    weights), `model_config.yaml` and the byte tokenizer."""
    from litgpt.model import GPT
    from litgpt.utils import save_config

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    torch.save(GPT(config).state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    write_byte_tokenizer(directory)
    return directory
