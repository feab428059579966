"""LightningCLI with FP8: the plugin, its recipe and the callbacks come from a YAML file (examples/lightning_cli.yaml).

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --trainer.plugins.loss_scaling=1024

Every FP8Precision argument is a typed keyword (help: `python examples/lightning_cli.py fit --help`); a numeric
loss_scaling written as text is its number, and a value the plugin cannot take fails when the config is read, with
the valid choices. The model and data are the demo's char-GPT on the Python standard library's text.
"""
from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, IterableDataset

from lightning_fp8.demo.data import batches, fixed_val_batches, load_corpus
from lightning_fp8.demo.gpt import GPTConfig
from lightning_fp8.demo.module import CharGPTModule


class _Batches(IterableDataset):
    def __init__(self, *args):
        self.args = args

    def __iter__(self):
        return batches(*self.args)


class CharData(L.LightningDataModule):
    def __init__(self, batch_size: int = 16, context: int = 64, steps: int = 200, max_chars: int = 400_000):
        super().__init__()
        self.batch_size, self.context, self.steps = batch_size, context, steps
        self.corpus = load_corpus(max_chars=max_chars)

    def train_dataloader(self):
        return DataLoader(_Batches(self.corpus.train, self.batch_size, self.context, self.steps, 0), batch_size=None)

    def val_dataloader(self):
        return DataLoader(fixed_val_batches(self.corpus.val, self.batch_size, self.context, 4), batch_size=None)


class CharGPT(CharGPTModule):
    def __init__(self, vocab_size: int = 128, context: int = 64, d_model: int = 64, n_layers: int = 2,
                 lr: float = 3e-3, max_steps: int = 200):
        super().__init__(GPTConfig(vocab_size=vocab_size, context=context, d_model=d_model, n_layers=n_layers,
                                   n_heads=4), lr=lr, max_steps=max_steps, warmup_steps=max(1, max_steps // 10))


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.context", "model.context")
        parser.link_arguments("data.steps", "model.max_steps")
        parser.link_arguments("data.steps", "trainer.max_steps")
        parser.link_arguments("data.steps", "trainer.val_check_interval")  # validate once, at the end


def main() -> None:
    cli = CLI(CharGPT, CharData, save_config_callback=None)  # logger: false, so no run directory to save it in
    if cli.subcommand == "fit":
        plugin = cli.trainer.precision_plugin
        print(f"final val loss {cli.model.val_losses[-1]:.4f}, loss scale {plugin.loss_scale:g}, "
              f"{plugin.skipped_steps} skipped steps")


if __name__ == "__main__":
    main()
