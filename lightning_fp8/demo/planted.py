"""A char-GPT with a planted outlier channel: the failure fine-grained scaling and FP8LayerFallback's escalation are
for, small enough to train on a CPU.

One input channel of one linear layer is multiplied by 1e6 ("massive activations" of large language models) and its
weight column is held at zero, so in exact arithmetic (and in BF16) the channel changes nothing; a per-tensor FP8
scale sized for it flushes every other input channel of that layer to zero (the weight gradient of the other
channels: 0 dB), while the loss still falls. The data is a noisy walk over a small vocabulary: learnable, generated,
the same for every run.
"""
from __future__ import annotations

from typing import List, Tuple

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_fp8.demo.gpt import GPTConfig
from lightning_fp8.demo.module import CharGPTModule

VOCAB, CONTEXT, BATCH, STEPS = 48, 32, 16, 90
OUTLIER_CHANNEL = 7
PLANTED_LAYER = "model.blocks.0.fc2"


def plant_outlier(layer: nn.Linear, channel: int = OUTLIER_CHANNEL, factor: float = 1e6) -> None:
    """Multiply one input channel of `layer` by `factor`, its weight column held at zero (module docstring)."""
    with torch.no_grad():
        layer.weight[:, channel] = 0.0

    def scale(module, args):
        x = args[0].clone()
        x[..., channel] = x[..., channel] * factor
        return (x,)

    def keep_zero(grad):
        grad = grad.clone()
        grad[:, channel] = 0.0
        return grad

    layer.register_forward_pre_hook(scale)
    layer.weight.register_hook(keep_zero)


class PlantedGPT(CharGPTModule):
    """The demo's char-GPT (2 blocks, d_model 32, MLP 512 wide: small GEMMs) with a x1e6 channel planted in the input
    of blocks.0.fc2 (512 inputs: four 1x128 tiles)."""

    def __init__(self, steps: int = STEPS):
        super().__init__(GPTConfig(vocab_size=VOCAB, context=CONTEXT, d_model=32, n_layers=2, n_heads=2, mlp_ratio=16),
                         lr=3e-3, max_steps=steps, warmup_steps=10)
        plant_outlier(self.model.blocks[0].fc2)


Batch = Tuple[torch.Tensor, torch.Tensor]


def walk_data(seed: int, steps: int = STEPS) -> Tuple[List[Batch], List[Batch]]:
    """(training batches drawn with `seed`, one fixed validation batch) of the noisy-walk sequence."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.cumsum(torch.randint(-2, 3, (60_000,), generator=g), 0).remainder(VOCAB)

    def window(starts):
        return (torch.stack([ids[s: s + CONTEXT] for s in starts]), torch.stack([ids[s + 1: s + CONTEXT + 1] for s in starts]))

    gb = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - CONTEXT - 1, (steps, BATCH), generator=gb).tolist()
    return [window(row) for row in starts], [window(list(range(0, BATCH * 997, 997)))]


def fit_planted(seed: int, steps: int = STEPS, **trainer_kwargs) -> Tuple[PlantedGPT, float]:
    """Train the planted GPT for `steps` (LR warmup, cosine to zero); returns (module, final val loss)."""
    L.seed_everything(seed, verbose=False)
    module = PlantedGPT(steps)
    train, val = walk_data(seed, steps)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=steps,
                        check_val_every_n_epoch=None, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(module, DataLoader(train, batch_size=None), DataLoader(val, batch_size=None))
    return module, module.val_losses[-1]
