"""LightningModule for the char-GPT demo: warmup + cosine decay to zero, fixed validation set.

The LR decays to zero because short runs at a constant LR are chaotic: a tiny perturbation (of Adam's eps, say) moves
the final loss as much as a change of precision does, so a precision comparison must end with the LR at zero to mean
anything.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import lightning as L
import torch

from lightning_fp8.demo.gpt import GPT, GPTConfig


class CharGPTModule(L.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float = 3e-3, max_steps: int = 600, warmup_steps: int = 30, weight_decay: float = 0.1):
        super().__init__()
        self.cfg = cfg
        self.lr, self.max_steps, self.warmup_steps, self.weight_decay = lr, max_steps, warmup_steps, weight_decay
        self.model = GPT(cfg)
        self.train_losses: List[float] = []
        self.val_losses: List[float] = []
        self._val_sum = 0.0
        self._val_n = 0

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(*batch)
        self.train_losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sum, self._val_n = 0.0, 0

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self.model.loss(*batch)
        self._val_sum += loss.item()
        self._val_n += 1
        self.log("val_loss", loss, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self._val_n:
            self.val_losses.append(self._val_sum / self._val_n)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.95),
        )

        def schedule(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
            return 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return [opt], [{"scheduler": sched, "interval": "step"}]
