"""FP8Precision(optimizer_state="fp8"): the user's AdamW becomes FP8AdamW, their LR scheduler keeps working."""
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from support.helpers import RegressionModule, loader, trainer
from lightning_fp8 import FP8Precision
from lightning_fp8.optim import FP8AdamW


class Scheduled(RegressionModule):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class LRSpy(Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_adamw_becomes_fp8adamw_and_scheduler_follows():
    spy = LRSpy()
    model = Scheduled()
    t = trainer(plugins=[FP8Precision(optimizer_state="fp8")], max_steps=8, callbacks=[spy])
    t.fit(model, loader())
    assert isinstance(t.optimizers[0], FP8AdamW)
    assert t.lr_scheduler_configs[0].scheduler.optimizer is t.optimizers[0]
    assert spy.lrs == pytest.approx([1e-2] * 3 + [5e-3] * 3 + [2.5e-3] * 2)
    assert model.losses[-1] < model.losses[0]


def test_fp8_optimizer_state_resumes_from_checkpoint(tmp_path):
    def run(max_epochs, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        model = Scheduled()
        t = trainer(plugins=[FP8Precision(optimizer_state="fp8")], max_epochs=max_epochs, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=tmp_path / str(max_epochs), save_last=True), *callbacks])
        t.fit(model, loader(), ckpt_path=ckpt_path)
        return model.losses

    straight = run(2)
    first = run(1)
    assert first + run(2, ckpt_path=tmp_path / "1" / "last.ckpt") == straight


def test_other_optimizers_stay_with_a_clear_message():
    class SGDModule(RegressionModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    t = trainer(plugins=[FP8Precision(optimizer_state="fp8")], max_steps=2)
    with pytest.warns(UserWarning, match="SGD"):
        t.fit(SGDModule(), loader())
    assert isinstance(t.optimizers[0], torch.optim.SGD)
