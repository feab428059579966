"""FP8Calibration: scales initialised from N batches before the first step, equal to delayed scaling over them."""
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support.helpers import RegressionModule, loader, trainer
from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe
from lightning_fp8.modules.autocast import current_state
from lightning_fp8.callbacks import FP8Calibration
from lightning_fp8.numerics import E4M3, scale_from_amax


def fp8_layers(module):
    return {fqn: m for fqn, m in module.named_modules() if isinstance(m, FP8Linear)}


class FirstBatch(Callback):
    """Snapshot of every FP8 layer's scaling state (and the batch) when the first training batch starts."""

    def __init__(self):
        self.state, self.batch, self.first_loss, self.metrics = None, None, None, None

    def on_train_start(self, trainer, pl_module):
        self.metrics = dict(trainer.callback_metrics)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.state is None:
            self.batch = [t.clone() for t in batch]
            self.state = {
                (fqn, role): {k: v.detach().clone() for k, v in getattr(layer.fp8_meta, role).state_dict().items()}
                for fqn, layer in fp8_layers(pl_module).items()
                for role in ("input", "weight", "grad_output")
            }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first_loss is None:
            self.first_loss = float(outputs["loss"])


class RecordCalibrationAmax(Callback):
    """Amax of each FP8 layer's input, per call, while the calibration pass runs (pre-hooks added after conversion)."""

    def __init__(self):
        self.amaxes = {}

    def on_fit_start(self, trainer, pl_module):
        for fqn, layer in fp8_layers(pl_module).items():
            def hook(module, args, fqn=fqn):
                if current_state().calibrating:
                    self.amaxes.setdefault(fqn, []).append(args[0].detach().abs().amax().float())
            layer.register_forward_pre_hook(hook)


def test_calibration_is_delayed_scaling_over_the_calibration_batches():
    torch.manual_seed(0)
    model = RegressionModule()
    amax = RecordCalibrationAmax()
    first = FirstBatch()
    calib = FP8Calibration(num_batches=4)
    t = trainer(plugins=[FP8Precision()], max_steps=1, callbacks=[amax, calib, first])
    t.fit(model, loader())
    assert calib.calibrated_batches == 4
    layers = fp8_layers(model)
    assert list(layers) == ["net.2", "net.4"]
    for fqn in layers:
        seen = torch.stack(amax.amaxes[fqn])
        assert seen.numel() == 4
        inp = first.state[(fqn, "input")]
        # the history holds the four batch amaxes, newest first, and slot 0 is open for the first step
        assert torch.equal(inp["amax_history"][1:5], seen.flip(0))
        assert inp["amax_history"][0] == 0 and not inp["amax_history"][5:].any()
        pow2 = FP8Recipe().power_of_2_scales
        expected = scale_from_amax(seen.max(), E4M3.max, 0, torch.tensor(1.0), pow2)
        assert torch.equal(inp["scale"], expected) and inp["scale"] != 1.0
        assert bool(inp["initialized"])
        w = first.state[(fqn, "weight")]
        entries = w["amax_history"][1:5]
        assert bool(w["initialized"]) and (entries == entries[0]).all() and entries[0] > 0  # same weight, 4 batches
        assert torch.equal(w["scale"], scale_from_amax(entries[0], E4M3.max, 0, torch.tensor(1.0), pow2))
        # gradients have no forward pass to calibrate on: they start with current scaling on the first step
        assert not bool(first.state[(fqn, "grad_output")]["initialized"])
    # the calibration's self.log calls were dropped
    assert "train_loss" not in first.metrics


def growing_batches(n_batches=8, batch_size=32, d=32):
    """Regression batches whose magnitude grows batch after batch (x1 ... x3.1): without calibration each early
    step meets larger activations than the delayed scale has seen."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(d, d, generator=g) / d**0.5
    xs = [torch.randn(batch_size, d, generator=g) * (1 + 0.3 * k) for k in range(n_batches)]
    x = torch.cat(xs)
    return DataLoader(TensorDataset(x, x @ w), batch_size=batch_size, shuffle=False)


def input_clips(model):
    return sum(int(layer.fp8_meta.input.clip_count) for layer in fp8_layers(model).values())


def run(calibrate, steps=8):
    torch.manual_seed(0)
    model = RegressionModule(lr=1e-3)  # slow weight growth: the activations grow with the data
    first = FirstBatch()
    callbacks = ([FP8Calibration(num_batches=8)] if calibrate else []) + [first]
    clips = {}

    class Clips(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clips.setdefault("start", input_clips(pl_module))

    t = trainer(plugins=[FP8Precision()], max_steps=steps, callbacks=callbacks + [Clips()])
    t.fit(model, growing_batches())
    return first.first_loss, input_clips(model) - clips["start"], first.batch


def test_first_step_is_no_worse_and_early_steps_do_not_clip():
    loss_cal, clips_cal, batch_cal = run(True)
    loss_plain, clips_plain, batch_plain = run(False)
    assert all(torch.equal(a, b) for a, b in zip(batch_cal, batch_plain))  # same data, same initial weights
    # step 1 without calibration casts with current scaling (exact per-tensor scale); with calibration it uses the
    # calibrated delayed scale: FP8's relative precision does not depend on the scale, so the loss is the same
    assert loss_cal <= loss_plain * 1.01, (loss_cal, loss_plain)
    # the later steps: without calibration the delayed scale lags behind the growing activations and clips; with
    # it the history has seen them. Measured here: 0 vs 3 clipped casts with the default power-of-two scales (1 vs 11
    # with exact scales, which leave no headroom above the amax)
    assert clips_plain >= 3 and clips_cal == 0, (clips_cal, clips_plain)


class BNModule(RegressionModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64),
            nn.GELU(), nn.Linear(64, 32),
        )


@pytest.mark.parametrize("loader_generator", [False, True], ids=["global-rng", "loader-generator"])
def test_calibration_leaves_no_trace_besides_the_scales(loader_generator):
    """Shuffled data: the first training batch is the same with and without calibration (the RNG is restored, the
    global one and a DataLoader's own `generator=`, whose state calibration's iterator advanced until the fix);
    BatchNorm running statistics are those of a run without calibration; the mode is train."""

    def fit(calibrate):
        torch.manual_seed(0)
        model = BNModule()
        first = FirstBatch()
        stats = {}

        class BN(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if not stats:
                    stats["mean"] = pl_module.net[1].running_mean.clone()
                    stats["training"] = pl_module.training

        generator = torch.Generator().manual_seed(5) if loader_generator else None
        data = DataLoader(loader().dataset, batch_size=32, shuffle=True, generator=generator)
        callbacks = ([FP8Calibration(num_batches=3)] if calibrate else []) + [first, BN()]
        trainer(plugins=[FP8Precision()], max_steps=1, callbacks=callbacks).fit(model, data)
        return first, stats

    with_cal, bn_cal = fit(True)
    without, bn_plain = fit(False)
    assert all(torch.equal(a, b) for a, b in zip(with_cal.batch, without.batch))
    assert torch.equal(bn_cal["mean"], bn_plain["mean"]) and bn_cal["training"]
    assert bool(with_cal.state[("net.3", "input")]["initialized"])
    assert not bool(without.state[("net.3", "input")]["initialized"])


def test_calibration_is_skipped_where_it_has_nothing_to_do():
    calib = FP8Calibration(num_batches=2)
    trainer(plugins=[FP8Precision(recipe=FP8Recipe(scaling="current"))], max_steps=1, callbacks=[calib]).fit(
        RegressionModule(), loader()
    )
    assert calib.calibrated_batches == 0
    with pytest.raises(ValueError, match="num_batches"):
        FP8Calibration(num_batches=0)


class CountingModule(RegressionModule):
    """A training step with the side effects users write: a torchmetrics metric updated per batch and logged per
    epoch, a direct logger call, and a list guarded with is_calibrating()."""

    def __init__(self):
        super().__init__()
        from torchmetrics.aggregation import SumMetric

        self.seen = SumMetric()
        self.guarded = []
        self.calibrating_seen = []

    def training_step(self, batch, batch_idx):
        from lightning_fp8.callbacks import is_calibrating

        loss = super().training_step(batch, batch_idx)
        self.seen.update(batch[0].shape[0])
        self.log("seen", self.seen, on_step=False, on_epoch=True)
        self.calibrating_seen.append(is_calibrating())
        if not is_calibrating():
            self.guarded.append(batch_idx)
        if self.logger is not None:
            self.logger.log_metrics({"direct": float(batch_idx)}, step=self.global_step)
        return loss


def test_calibration_leaves_user_metrics_and_logs_alone(tmp_path):
    """4 calibration batches, then 3 training steps: the epoch's torchmetrics metric counts the 3 training batches
    only (its state is restored after the pass), direct logger calls of the pass are dropped, and is_calibrating()
    lets the training step keep its own side effects out of the pass. What the pass cannot undo (an unguarded list)
    runs once per calibration batch, as documented."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    model = CountingModule()
    calib = FP8Calibration(num_batches=4)
    t = trainer(plugins=[FP8Precision()], max_steps=3, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=1,
                callbacks=[calib])
    t.fit(model, loader())
    assert calib.calibrated_batches == 4
    assert float(t.callback_metrics["seen"]) == 3 * 32  # 7 * 32 if the calibration batches were counted
    assert model.calibrating_seen == [True] * 4 + [False] * 3 and model.guarded == [0, 1, 2]
    assert len(model.losses) == 4 + 3  # the unguarded list: once per calibration batch, then once per step
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        direct = [row["direct"] for row in csv.DictReader(f) if row.get("direct")]
    assert [float(v) for v in direct] == [0.0, 1.0, 2.0]  # the training steps' calls only
