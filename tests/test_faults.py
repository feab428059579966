"""Fault injection: each fault at a random step; training must finish with finite weights, counters that say what
happened, and a final validation loss within 1% of the clean run. Repeated faults must end in a clear error."""
import random

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import RegressionModule, trainer
from lightning_fp8 import FP8Precision
from lightning_fp8.engine import FP8DivergenceError

STEPS = 96  # 6 epochs x 16 batches
SPIKE_WARMUP = 20


def noisy_regression(n, seed):
    """y = x W + noise: the noise floor (0.25) keeps the final loss away from zero, so 1% is a real tolerance."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(123)) / 32**0.5
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, x @ w + 0.5 * torch.randn(n, 32, generator=g))


TRAIN = DataLoader(noisy_regression(512, 0), batch_size=32)
VAL = noisy_regression(1024, 1).tensors


class Schedule(RegressionModule):
    """AdamW with LR decaying linearly to zero (docs/measuring.md: compare runs whose LR decays to zero)."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / STEPS))
        return [opt], [{"scheduler": sched, "interval": "step"}]


def val_loss(model):
    model.eval()
    with torch.no_grad():
        return nn.functional.mse_loss(model(VAL[0]), VAL[1]).item()


def run(fault_step=None, kind=None, repeat=False, **plugin_kwargs):
    torch.manual_seed(0)
    model = Schedule(lr=3e-3)
    kwargs = dict(snapshot_every=1, spike_factor=10.0)
    kwargs.update(plugin_kwargs)
    plugin = FP8Precision(**kwargs)
    hits = lambda step: fault_step is not None and (step == fault_step or (repeat and step >= fault_step))

    class Inject(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if kind == "nan_weight" and hits(trainer.global_step):
                with torch.no_grad():
                    pl_module.net[2].weight[0, 0] = float("nan")

        def on_after_backward(self, trainer, pl_module):
            if kind == "inf_grad" and hits(trainer.global_step):
                pl_module.net[4].weight.grad[1, 1] = float("inf")

    def fault(module, x, y):
        step = module.trainer.global_step
        if kind == "nan_loss" and hits(step):
            return x * float("nan"), y
        if kind == "spike" and hits(step):
            # a corrupted batch: finite, with a loss ~1e4x the running mean. (Corrupting the inputs instead does
            # not spike: FP8 delayed scaling saturates the huge activations at the previous steps' amax.)
            return x, y * 100.0
        return x, y

    def overflow_hook(mod, inputs, output):
        step = model.trainer.global_step
        if kind == "overflow" and hits(step):
            return output * float("inf")  # the activation entering FP8 layer net.2 overflows
        return output

    model.fault = fault
    model.net[1].register_forward_hook(overflow_hook)
    t = trainer(plugins=[plugin], max_steps=STEPS, max_epochs=-1, callbacks=[Inject()])
    t.fit(model, TRAIN)
    return model, plugin


@pytest.fixture(scope="module")
def clean():
    model, plugin = run()
    assert plugin.skipped_steps == 0 and plugin.rollbacks == 0
    return val_loss(model)


@pytest.mark.parametrize(
    "kind, skipped, rollbacks",
    [
        ("inf_grad", 1, 0),  # skipped, nothing to roll back
        ("nan_loss", 1, 1),  # skipped and rolled back
        ("nan_weight", 1, 1),  # NaN forward -> NaN loss: skipped and rolled back to before the corruption
        ("overflow", 1, 0),  # saturating casts keep the loss finite: only the amax reveals the overflow
        ("spike", 1, 1),
    ],
)
def test_single_fault_is_survived(clean, kind, skipped, rollbacks):
    rng = random.Random(kind)  # a random step, reproducible per fault kind
    step = rng.randrange(SPIKE_WARMUP + 5, STEPS - 10)
    model, plugin = run(step, kind)
    assert (plugin.skipped_steps, plugin.rollbacks) == (skipped, rollbacks), plugin.engine.events
    assert all(torch.isfinite(p).all() for p in model.parameters())
    events = plugin.engine.events
    assert events[0]["step"] == step + 1  # engine steps count from 1
    if kind == "overflow":
        assert events[0]["layers"] == ["net.2.input"]
    final = val_loss(model)
    # 1% of the clean run: losing one batch (and, for rollbacks, nothing else: snapshot_every=1) barely moves a
    # run whose LR decays to zero
    assert abs(final - clean) <= 0.01 * clean, (final, clean)


def test_repeated_faults_end_in_clear_error_naming_the_layer():
    with pytest.raises(FP8DivergenceError, match=r"net\.2\.input") as err:
        run(30, "overflow", repeat=True, max_consecutive_skips=3, max_rollbacks=2)
    assert "2 rollbacks" in str(err.value)


def test_repeated_nan_losses_end_in_clear_error():
    with pytest.raises(FP8DivergenceError, match="non-finite loss"):
        run(25, "nan_loss", repeat=True, max_rollbacks=3)
