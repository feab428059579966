"""Train transformers' ResNet-18 on scikit-learn's handwritten digits with FP8Precision, Lightning's way.

An ordinary LightningModule around `ResNetForImageClassification` (basic blocks, depths 2-2-2-2, widths 64-512: a
ResNet-18, 20 convolutions). The FP8-specific part is the Trainer's plugin and the two callbacks:

    python examples/resnet_digits.py                        # FP8Precision(): the default recipe
    python examples/resnet_digits.py --preset mellempudi    # Mellempudi et al.: E5M2, stochastic rounding
    python examples/resnet_digits.py --epochs 20 --seed 1

The data ships with scikit-learn (`load_digits`: 1797 real 8x8 handwritten digits, no download), upscaled to 32x32
(--image-size) and split 75 / 25 with a fixed permutation. The convolutions in FP8: 17 of the 20 (the stem has 3
input channels, not a multiple of 16; the first and last convertible ones stay in BF16 by the first/last rule); the
classifier (512 -> 10) is not 16-aligned. The conversion summary at fit start lists them, FP8ScaleMonitor logs every
FP8 layer's scales and quantization statistics to the logger (and `fp8_history.jsonl`, which `lightning-fp8 report`
turns into an HTML page), FP8LayerFallback moves a layer that cannot live in FP8 to a finer scaling, then to BF16.

Needs transformers and scikit-learn (both in lightning-fp8's `dev` extra). On a CPU the FP8 GEMMs are emulated and
BF16 convolutions are slow without BF16 hardware: expect seconds per step at the default batch size.
benchmarks/resnet_digits.py compares FP8 with high precision over several seeds.
"""
from __future__ import annotations

import argparse
import math
from typing import Dict, List, Optional, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_fp8 import FP8Precision, precision_map
from lightning_fp8.callbacks import FP8LayerFallback, FP8ScaleMonitor


def digits(image_size: int = 32, split_seed: int = 0,
           test_fraction: float = 0.25) -> Tuple[TensorDataset, TensorDataset]:
    """(train, test) of scikit-learn's digits as 3-channel `image_size` images, standardized, split by a fixed
    permutation (the same split whatever the training seed)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8), values 0..16
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = ((x - x.mean()) / x.std()).expand(-1, 3, -1, -1).contiguous()
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def resnet18(num_labels: int = 10):
    """transformers' ResNet-18 (what torchvision's resnet18 is, built from a config: no download)."""
    import transformers

    config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                       num_labels=num_labels)
    return transformers.ResNetForImageClassification(config)


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warmup, then cosine decay to zero at `total` (runs are compared at their end)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


class DigitsClassifier(L.LightningModule):
    def __init__(self, lr: float = 2e-3, weight_decay: float = 5e-4, total_steps: int = 1000, warmup: int = 20,
                 image_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = resnet18()
        # lets conversion trace the forward to find the first and last layers (and Lightning size its summary)
        self.example_input_array = torch.zeros(1, 3, image_size, image_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x).float()
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, hp.total_steps, hp.warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--preset", default="default", help="FP8Precision preset: default, conservative, mellempudi")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps (-1: all epochs)")
    p.add_argument("--limit-val-batches", type=lambda v: float(v) if "." in v else int(v), default=1.0,
                   help="validation batches per check: a count (2) or a fraction (0.5)")
    p.add_argument("--log-dir", default="lightning_logs_resnet_digits")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    train, test = digits(args.image_size)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(args.seed))
    test_loader = DataLoader(test, batch_size=4 * args.batch_size)
    steps = args.epochs * (len(train) // args.batch_size)
    if args.max_steps > 0:
        steps = min(steps, args.max_steps)
    module = DigitsClassifier(lr=args.lr, total_steps=steps, image_size=args.image_size)
    trainer = L.Trainer(
        accelerator="auto", devices=1, max_epochs=args.epochs, max_steps=args.max_steps,
        plugins=[FP8Precision(preset=args.preset)],
        callbacks=[FP8ScaleMonitor(), FP8LayerFallback()],
        logger=CSVLogger(args.log_dir, name="resnet_digits"), log_every_n_steps=10,
        limit_val_batches=args.limit_val_batches, enable_model_summary=False,
    )
    trainer.fit(module, train_loader, test_loader)
    rows = precision_map(module)
    convs = [r for r in rows if r.family == "convolution"]
    fp8_convs = sum(r.precision == "fp8" for r in convs)
    metrics = trainer.validate(module, test_loader, verbose=False)[0]
    print(f"test accuracy {metrics['val_acc']:.4f}; {fp8_convs} of {len(convs)} convolutions in FP8; "
          f"skipped steps {trainer.precision_plugin.skipped_steps}, rollbacks {trainer.precision_plugin.rollbacks}")
    return {"accuracy": float(metrics["val_acc"]), "fp8_convolutions": fp8_convs, "convolutions": len(convs)}


if __name__ == "__main__":
    main()
