"""BatchNorm running statistics for eval mode (issue 43): refresh_batchnorm re-estimates them exactly as a
cumulative average with every other module in eval mode; watch_batchnorm_lag measures the lag; the BatchNormRefresh
callback refreshes before validation, into checkpoints and at the end of fit without changing the training run, and
the conversion summary points at it."""
import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fp8 import BatchNormRefresh, FP8Precision, FP8Recipe, convert_to_fp8, fp8_layers, refresh_batchnorm
from lightning_fp8.engine.batchnorm_stats import batchnorm_layers, mean_shift, watch_batchnorm_lag
from lightning_fp8.conversion import conversion_summary


def cnn(momentum: float = 0.1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=momentum), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32, momentum=momentum), nn.ReLU(), nn.Dropout(0.5),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 32), nn.BatchNorm1d(32, momentum=momentum), nn.ReLU(),
        nn.Linear(32, 16),
    )


def images(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g) * 2 + 0.5
    y = (x.mean(dim=(1, 2, 3)) > 0.5).long() + 2 * (x[:, 0].mean(dim=(1, 2)) > x[:, 1].mean(dim=(1, 2))).long()
    return x, y


def test_refresh_is_the_cumulative_average_with_other_modules_in_eval_mode():
    torch.manual_seed(0)
    model = cnn()
    x, _ = images()
    batches = list(x.split(32))
    model.train()
    for b in batches:  # running statistics somewhere else, as after training
        model(b * 3)
    # expected: the first BatchNorm's input is the first convolution's output
    conv = model[0]
    outs = [conv(b).detach() for b in batches]
    mean = torch.stack([o.mean(dim=(0, 2, 3)) for o in outs]).mean(0)
    var = torch.stack([o.var(dim=(0, 2, 3), unbiased=True) for o in outs]).mean(0)
    dropout_mode = model[6].training
    result = refresh_batchnorm(model, batches)
    assert result.batches == 3 and set(result.shift) == {"1", "4", "10"}
    torch.testing.assert_close(model[1].running_mean, mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[1].running_var, var, rtol=1e-5, atol=1e-6)
    assert int(model[1].num_batches_tracked) == 3
    assert all(m.momentum == 0.1 for m in batchnorm_layers(model).values())  # restored
    assert model[6].training == dropout_mode and model.training
    # the last BatchNorm's inputs came with dropout off (eval mode) and the BatchNorms before it normalising with
    # batch statistics (as in training and torch's update_bn)
    probe = copy.deepcopy(model)
    probe.eval()
    probe[1].train()
    probe[4].train()
    feats = [probe[:10](b).detach() for b in batches]
    torch.testing.assert_close(model[10].running_mean, torch.stack([f.mean(0) for f in feats]).mean(0),
                               rtol=1e-5, atol=1e-6)
    # the shift reported is how far the old statistics were (the *3 inputs moved them far)
    assert result.shift[result.worst] > 0.1


def test_refresh_leaves_fp8_scaling_state_alone_and_keeps_old_statistics_without_batches():
    torch.manual_seed(0)
    model = convert_to_fp8(cnn(), FP8Recipe(keep_first_last_in_bf16=False))
    x, _ = images()
    model.train()
    model(x[:32])
    layers = fp8_layers(model)
    assert layers
    before = {n: copy.deepcopy(layer.fp8_meta.state_dict()) for n, layer in layers.items()}
    stats = {n: m.running_mean.clone() for n, m in batchnorm_layers(model).items()}
    with pytest.raises(ValueError, match="no batches"):
        refresh_batchnorm(model, [])
    assert all(torch.equal(stats[n], m.running_mean) for n, m in batchnorm_layers(model).items())
    refresh_batchnorm(model, x.split(32))
    for n, layer in layers.items():
        after = layer.fp8_meta.state_dict()
        assert all(torch.equal(before[n][k], after[k]) for k in before[n]), n


def test_watch_batchnorm_lag_measures_the_running_mean_against_the_batch_before_the_update():
    model = cnn()
    bn = model[1]
    bn.running_mean.fill_(1.0)
    x, _ = images(32)
    with watch_batchnorm_lag(model) as lag:
        model.train()
        out = model[0](x).detach()
        model(x)
    mean, var = out.mean(dim=(0, 2, 3)), out.var(dim=(0, 2, 3), unbiased=False)
    assert lag["1"] == pytest.approx(mean_shift(torch.ones(16), mean, var, bn.eps), rel=1e-5)
    assert set(lag) == {"1", "4", "10"}
    with watch_batchnorm_lag(model) as lag:
        model.eval()
        model(x)
    assert lag == {}  # eval mode: nothing to lag behind


class Classifier(L.LightningModule):
    def __init__(self, momentum: float):
        super().__init__()
        torch.manual_seed(0)
        self.model = cnn(momentum)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)  # constant: the case the callback is for


def fit(tmp_path, callbacks, plugins, momentum=0.1, max_epochs=3):
    """Fit the classifier: `plugins` None is bf16-mixed."""
    x, y = images(192)
    train = DataLoader(TensorDataset(x[:160], y[:160]), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    val = DataLoader(TensorDataset(x[160:], y[160:]), batch_size=32)
    module = Classifier(momentum)
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path),
                        log_every_n_steps=1, callbacks=callbacks, plugins=plugins, enable_progress_bar=False,
                        precision=None if plugins else "bf16-mixed",
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, train, val)
    return module, trainer


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_callback_refreshes_checkpoints_and_the_final_model_without_changing_training(tmp_path, precision):
    def plugin():
        return [FP8Precision(FP8Recipe(keep_first_last_in_bf16=False))] if precision == "fp8" else None

    refresh = BatchNormRefresh()
    every_step = ModelCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=2, save_top_k=-1)
    on_val = ModelCheckpoint(dirpath=tmp_path / "val", monitor="val_acc", mode="max", save_top_k=-1)
    module, trainer = fit(tmp_path / "a", [refresh, every_step, on_val], plugin(), momentum=0.01, max_epochs=2)
    plain, _ = fit(tmp_path / "b", [], plugin(), momentum=0.01, max_epochs=2)
    # no backward, no optimizer step, RNG streams restored: the training run is the one without the callback
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    # at the end of fit: a cumulative average over the 5 training batches (num_batches_tracked counts them), not
    # the lagging momentum-0.01 average the plain run keeps
    final = batchnorm_layers(module)
    assert all(int(m.num_batches_tracked) == 5 for m in final.values())
    assert all(int(m.num_batches_tracked) == 10 for m in batchnorm_layers(plain).values())
    assert refresh.last_refresh.batches == 5 and refresh.last_refresh.shift[refresh.last_refresh.worst] > 0
    # checkpoints saved between validations (every 2 steps) and after validation both hold refreshed statistics
    step_ckpts = sorted((tmp_path / "steps").glob("*.ckpt"))
    val_ckpts = sorted((tmp_path / "val").glob("*.ckpt"))
    assert len(step_ckpts) >= 3 and len(val_ckpts) == 2
    for path in step_ckpts + val_ckpts:
        state = torch.load(path, weights_only=False)["state_dict"]
        assert int(state["model.1.num_batches_tracked"]) == 5, path.name
    # the lag was logged while training
    metrics = (tmp_path / "a").rglob("metrics.csv")
    header = next(iter(metrics)).read_text().splitlines()[0]
    assert "batchnorm/lag" in header and "batchnorm/lag_layer_mean" in header
    assert refresh.last_lag and set(refresh.last_lag) == set(final)


def test_callback_validation_sees_refreshed_statistics(tmp_path):
    """Validation after a refresh normalises with the refreshed statistics: the logged accuracy is the one the model
    scores in eval mode with them (momentum 0.01: without the refresh the statistics would still be near their
    initial values)."""
    refresh = BatchNormRefresh(before_checkpoint=False, at_fit_end=False)
    module, trainer = fit(tmp_path, [refresh], [FP8Precision(FP8Recipe(keep_first_last_in_bf16=False))],
                          momentum=0.01, max_epochs=1)
    assert refresh.last_refresh is not None and refresh.last_refresh.batches == 5
    x, y = images(192)
    module.eval()
    with trainer.precision_plugin.val_step_context():
        acc = (module(x[160:]).argmax(-1) == y[160:]).float().mean()
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(float(acc), abs=1e-6)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="num_batches"):
        BatchNormRefresh(num_batches=0)
    with pytest.raises(ValueError, match="check_every"):
        BatchNormRefresh(check_every=-1)


def test_conversion_summary_points_batchnorm_models_at_the_refresh():
    model = convert_to_fp8(cnn())
    assert "3 BatchNorm layers" in conversion_summary(model).text()
    assert "BatchNormRefresh" in conversion_summary(model).text()
    no_bn = convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)))
    assert "BatchNorm" not in conversion_summary(no_bn).text()


class CountBatches(L.Callback):
    def __init__(self):
        self.per_epoch = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.per_epoch[trainer.current_epoch] = self.per_epoch.get(trainer.current_epoch, 0) + 1


def test_mid_epoch_refresh_keeps_the_epoch_of_a_persistent_worker_loader(tmp_path):
    """Validation in the middle of the epoch refreshes from a loader whose workers persist: a second iter() of such
    a loader resets the epoch's own iterator, so the refresh reads a single-process twin and every epoch still sees
    all its batches."""
    x, y = images(192)
    train = DataLoader(TensorDataset(x[:160], y[:160]), batch_size=32, shuffle=True, num_workers=1,
                       persistent_workers=True)
    val = DataLoader(TensorDataset(x[160:], y[160:]), batch_size=32)
    refresh, count = BatchNormRefresh(), CountBatches()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        val_check_interval=2, callbacks=[refresh, count], enable_progress_bar=False,
                        enable_model_summary=False, plugins=[FP8Precision(FP8Recipe(keep_first_last_in_bf16=False))],
                        default_root_dir=tmp_path)
    trainer.fit(Classifier(0.1), train, val)
    assert count.per_epoch == {0: 5, 1: 5}
    assert refresh.last_refresh is not None and refresh.last_refresh.batches == 5


def test_true_half_precision_inputs_are_converted_as_lightnings_loops_do(tmp_path):
    """precision="bf16-true": the weights are bf16, so the refresh's batches go through the plugin's convert_input
    as training's do (a float32 batch into bf16 weights raised at the first validation)."""
    x, y = images(192)
    train = DataLoader(TensorDataset(x[:160], y[:160]), batch_size=32)
    val = DataLoader(TensorDataset(x[160:], y[160:]), batch_size=32)
    refresh = BatchNormRefresh()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        precision="bf16-true", callbacks=[refresh], enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(Classifier(0.1), train, val)
    assert refresh.last_refresh is not None and refresh.last_refresh.batches == 5


class FrozenFirstBatchNorm(Classifier):
    """Keeps the first BatchNorm in eval mode while training, as a frozen pretrained backbone is kept."""

    def on_train_epoch_start(self):
        self.model[1].eval()


def test_a_batchnorm_layer_kept_in_eval_mode_keeps_its_statistics_and_training_is_unchanged(tmp_path):
    def run(callbacks):
        torch.manual_seed(0)
        module = FrozenFirstBatchNorm(0.1)
        module.model[1].running_mean.fill_(0.25)  # "pretrained" statistics
        x, y = images(192)
        train = DataLoader(TensorDataset(x[:160], y[:160]), batch_size=32, shuffle=True,
                           generator=torch.Generator().manual_seed(1))
        val = DataLoader(TensorDataset(x[160:], y[160:]), batch_size=32)
        L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                  plugins=[FP8Precision(FP8Recipe(keep_first_last_in_bf16=False))],
                  default_root_dir=tmp_path).fit(module, train, val)
        return module

    refresh = BatchNormRefresh()
    refreshed, plain = run([refresh]), run([])
    assert set(refresh.last_refresh.shift) == {"model.4", "model.10"}  # not the frozen one
    assert torch.equal(refreshed.model[1].running_mean, torch.full((16,), 0.25))
    for (name, p), q in zip(refreshed.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_the_lag_is_logged_at_the_step_it_was_measured(tmp_path):
    """With the trainer's default-style interval (every 2 steps here) each measurement lands at its own step."""
    x, y = images(192)
    train = DataLoader(TensorDataset(x[:160], y[:160]), batch_size=32)
    refresh = BatchNormRefresh()
    logger = CSVLogger(tmp_path)
    L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=2,
              enable_checkpointing=False, callbacks=[refresh], enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=tmp_path).fit(Classifier(0.1), train)
    import csv

    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    lag_steps = [int(r["step"]) for r in rows if r.get("batchnorm/lag")]
    assert lag_steps == [0, 2, 4, 6, 8]


def test_a_copied_state_dict_with_a_wrapper_prefix_gets_the_refreshed_statistics():
    from lightning_fp8.callbacks.batchnorm_refresh import patch_state_dict

    module = Classifier(0.1)
    saved = {f"_forward_module.{k}": v.clone() for k, v in module.state_dict().items()}
    for m in batchnorm_layers(module).values():
        m.running_mean.add_(1.0)
    assert patch_state_dict(saved, module, ["model.1", "model.4"]) == 6
    assert torch.equal(saved["_forward_module.model.1.running_mean"], module.model[1].running_mean)
    assert not torch.equal(saved["_forward_module.model.10.running_mean"], module.model[10].running_mean)


class FailsAtStep3(Classifier):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_checkpoint_saved_because_the_run_failed_is_not_refreshed(tmp_path):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    x, y = images(192)
    train = DataLoader(TensorDataset(x[:160], y[:160]), batch_size=32)
    refresh = BatchNormRefresh()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        callbacks=[refresh, OnExceptionCheckpoint(tmp_path)], enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(FailsAtStep3(0.1), train)
    assert (tmp_path / "on_exception.ckpt").exists()
    assert refresh.last_refresh is None


DDP_SCRIPT = '''
import json, sys, warnings
import torch
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.callbacks import ModelCheckpoint
from support.process_group import process_group_ended
from test_batchnorm_refresh import Classifier, images
from lightning_fp8 import BatchNormRefresh, FP8Precision, FP8Recipe
import lightning_fp8.callbacks.batchnorm_refresh as callback_module

local = []  # this rank's own estimate of the first BatchNorm's mean at each refresh, before the ranks average


def recording(model, *args, **kwargs):
    result = refresh(model, *args, **kwargs)
    local.append(model.model[1].running_mean.tolist())
    return result


refresh, callback_module.refresh_batchnorm = callback_module.refresh_batchnorm, recording
out = sys.argv[1]
x, y = images(192)
callback = BatchNormRefresh()
trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=2, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, plugins=[FP8Precision(FP8Recipe(keep_first_last_in_bf16=False))],
                    callbacks=[callback, ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1)])
module = Classifier(0.01)
with process_group_ended():
    trainer.fit(module, DataLoader(TensorDataset(x[:160], y[:160]), batch_size=32, shuffle=True),
                DataLoader(TensorDataset(x[160:], y[160:]), batch_size=32))
    stats = {{name: [b.tolist() for b in (m.running_mean, m.running_var)]
              for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}}
    json.dump({{"stats": stats, "batches": callback.last_refresh.batches, "local": local[-1],
               "weight": module.model[3].weight.detach().sum().item()}},
              open(f"{{out}}/rank{{trainer.global_rank}}.json", "w"))
'''


@pytest.mark.timeout(300)
def test_ddp_ranks_average_their_statistics_and_checkpoints_hold_them(tmp_path):
    """2 CPU processes (gloo), each refreshing from its own shard of the data (3 batches): both ranks end with the
    average of their own estimates (not rank 0's, which DDP's buffer broadcast alone would give), the same weights,
    and the last checkpoint rank 0 wrote holds those statistics."""
    import json
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "ddp_refresh.py"
    script.write_text(DDP_SCRIPT.format(tests=tests))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["batches"] == r1["batches"] == 3
    assert r0["stats"] == r1["stats"] and r0["weight"] == r1["weight"]
    average = [(a + b) / 2 for a, b in zip(r0["local"], r1["local"])]
    assert r0["local"] != r1["local"]
    torch.testing.assert_close(torch.tensor(r0["stats"]["model.1"][0]), torch.tensor(average))
    last = torch.load(tmp_path / "epoch=1-step=6.ckpt", weights_only=False)["state_dict"]
    assert last["model.1.running_mean"].tolist() == r0["stats"]["model.1"][0]
