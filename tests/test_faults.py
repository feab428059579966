"""Fault injection with the defaults a user has (snapshot_every=50) and a real warmup + cosine LR schedule: each
fault at a random step; training must finish with finite weights, counters that say what happened, the LR schedule
restored with the run, and a final validation loss within 1% of the clean run. Repeated faults must end in a clear
error.

The runs are 300 iterations, six snapshot intervals: a rollback loses up to 50 good iterations (the price of the
default interval), and the schedule continues from the restored iteration, so the runs have to be long next to the
interval for 1% to be the right tolerance (with 96 iterations a rollback to the start cost up to 6%)."""
import random

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support.helpers import RegressionModule, trainer
from lightning_fp8 import FP8Precision
from lightning_fp8.engine import FP8DivergenceError

STEPS = 300
WARMUP = 30
LR = 1e-2
SPIKE_WARMUP = 20


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: on a busy 2-core machine OpenMP threads waiting on each other cost more than the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def noisy_regression(n, seed):
    """y = x W + noise: the noise floor (0.25) keeps the final loss away from zero, so 1% is a real tolerance."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(123)) / 32**0.5
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, x @ w + 0.5 * torch.randn(n, 32, generator=g))


TRAIN = DataLoader(noisy_regression(512, 0), batch_size=32)
VAL = noisy_regression(1024, 1).tensors


def warmup_cosine(optimizer):
    """Linear warm-up, then cosine decay to zero: both compute each LR from the current one (chainable), the
    schedulers that drift when a rollback restores the optimizer's LR but not the scheduler."""
    lr_sched = torch.optim.lr_scheduler
    return lr_sched.SequentialLR(
        optimizer,
        [lr_sched.LinearLR(optimizer, 0.1, 1.0, WARMUP), lr_sched.CosineAnnealingLR(optimizer, STEPS - WARMUP)],
        [WARMUP],
    )


def schedule_lr(steps):
    """The schedule's LR after `steps` scheduler steps, from a fresh optimizer."""
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=LR)
    sched = warmup_cosine(opt)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


class Schedule(RegressionModule):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [opt], [{"scheduler": warmup_cosine(opt), "interval": "step"}]


def val_loss(model):
    model.eval()
    with torch.no_grad():
        return nn.functional.mse_loss(model(VAL[0]), VAL[1]).item()


def run(fault_step=None, kind=None, repeat=False, **plugin_kwargs):
    torch.manual_seed(0)
    model = Schedule(lr=LR)
    kwargs = dict(spike_factor=10.0)  # the spike rule is off by default
    kwargs.update(plugin_kwargs)
    plugin = FP8Precision(**kwargs)
    hits = lambda step: fault_step is not None and (step == fault_step or (repeat and step >= fault_step))
    lrs = {}

    class Inject(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]
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
    return model, plugin, lrs


@pytest.fixture(scope="module")
def clean():
    model, plugin, lrs = run()
    assert plugin.skipped_steps == 0 and plugin.rollbacks == 0
    assert [lrs[i] for i in range(STEPS)] == [schedule_lr(i) for i in range(STEPS)]  # (the reference is right)
    return val_loss(model)


@pytest.mark.parametrize(
    "kind, skipped, rollbacks",
    [
        ("inf_grad", 1, 0),  # skipped, nothing to roll back
        ("nan_loss", 1, 1),  # skipped and rolled back
        ("nan_weight", 1, 1),  # NaN forward -> NaN loss: skipped and rolled back to before the corruption
        ("overflow", 1, 0),  # saturating casts hide it from the loss; the amax (and here the gradients) show it
        ("spike", 1, 1),
    ],
)
def test_single_fault_is_survived(clean, kind, skipped, rollbacks):
    rng = random.Random(kind)  # a random step, reproducible per fault kind
    step = rng.randrange(SPIKE_WARMUP + 5, STEPS - 10)
    model, plugin, lrs = run(step, kind)
    assert (plugin.skipped_steps, plugin.rollbacks) == (skipped, rollbacks), plugin.engine.events
    assert all(torch.isfinite(p).all() for p in model.parameters())
    events = plugin.engine.events
    assert events[0]["step"] == step + 1  # engine iterations count from 1
    if kind == "overflow":
        assert events[0]["layers"] == ["net.2.input"]
    # the schedule: Lightning steps its schedulers after every batch, a skipped one too (as with its own AMP); a
    # rollback restores them to the snapshot's iteration, and the batch after it trains with the schedule's LR at the
    # restored iteration, exactly as the clean run's batch after that iteration did
    if rollbacks:
        restored = events[-1]["restored_to_step"]
        assert restored == step // 50 * 50  # the default interval
        assert lrs[step + 1] == schedule_lr(restored)
        shift = step + 1 - restored  # the iterations the rollback undid in the schedule
        assert [lrs[i] for i in range(step + 1, STEPS)] == [schedule_lr(i - shift) for i in range(step + 1, STEPS)]
    else:
        assert [lrs[i] for i in range(STEPS)] == [schedule_lr(i) for i in range(STEPS)]
    final = val_loss(model)
    assert abs(final - clean) <= 0.01 * clean, (final, clean)


def test_repeated_faults_end_in_clear_error_naming_the_layer():
    with pytest.raises(FP8DivergenceError, match=r"net\.2\.input") as err:
        run(30, "overflow", repeat=True, max_consecutive_skips=3, max_rollbacks=2)
    assert "2 rollbacks" in str(err.value)


def test_repeated_nan_losses_end_in_clear_error():
    with pytest.raises(FP8DivergenceError, match="non-finite loss"):
        run(25, "nan_loss", repeat=True, max_rollbacks=3)
