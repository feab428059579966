"""FP8Precision with a real Lightning Trainer on CPU."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from support.helpers import RegressionModule, loader, trainer
from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe, fp8_state_dict, precision_map


def _fp8_layers(module):
    return [m for m in module.modules() if isinstance(m, FP8Linear)]


@pytest.mark.parametrize("in_configure_model", [False, True])
def test_fit_validate_test_predict_in_fp8(in_configure_model):
    plugin = FP8Precision()
    model = RegressionModule(build_in_configure_model=in_configure_model)
    seen = {}

    class Spy(Callback):
        def on_validation_batch_end(self, trainer, pl_module, *args):
            seen["val_dtype"] = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None

    t = trainer(plugins=[plugin], max_epochs=2, limit_val_batches=1, callbacks=[Spy()])
    default_dtype = torch.get_default_dtype()
    t.fit(model, loader(), loader(64))
    layers = _fp8_layers(model)
    assert [row.precision for row in precision_map(model)] == ["bf16", "fp8", "fp8", "bf16"]
    assert all(layer.fp8_meta.input.initialized for layer in layers)  # the FP8 path ran and updated scales
    assert all(layer.fp8_meta.grad_output.amax_history.abs().sum() > 0 for layer in layers)
    assert model.losses[-1] < model.losses[0]
    assert torch.get_default_dtype() == default_dtype
    # evaluation in FP8 never touches the training scales
    before = {k: v.clone() for k, v in fp8_state_dict(model).items()}
    assert t.validate(model, loader(64), verbose=False)[0]["val_loss"] > 0
    assert t.test(model, loader(64), verbose=False)[0]["test_loss"] > 0
    preds = t.predict(model, loader(64))
    assert preds[0].dtype == torch.bfloat16
    assert before and all(torch.equal(before[k], v) for k, v in fp8_state_dict(model).items())


def test_eval_can_run_in_bf16():
    plugin = FP8Precision(fp8_eval=False)
    model = RegressionModule()
    t = trainer(plugins=[plugin], max_steps=2)
    t.fit(model, loader())
    with plugin.val_step_context():
        from lightning_fp8.modules.autocast import current_state

        assert current_state().enabled is False
    with plugin.train_step_context():
        assert current_state().enabled is True


class GradSpy(Callback):
    def __init__(self):
        self.norms, self.maxabs = [], []

    def on_train_batch_end(self, trainer, pl_module, *args):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        self.maxabs.append(max(g.abs().max().item() for g in grads))


@pytest.mark.parametrize("loss_scaling", ["none", "dynamic"])
def test_clip_by_norm_acts_on_unscaled_gradients(loss_scaling):
    spy = GradSpy()
    plugin = FP8Precision(loss_scaling=loss_scaling)
    t = trainer(plugins=[plugin], max_steps=4, gradient_clip_val=1e-2, gradient_clip_algorithm="norm", callbacks=[spy])
    t.fit(RegressionModule(), loader())
    # raw gradient norms here are ~1; after clipping the norm of the *unscaled* gradients is the clip value
    # (up to the 1e-6 eps in the clip coefficient and fp32 rounding)
    assert spy.norms == pytest.approx([1e-2] * 4, rel=1e-4)
    if loss_scaling == "dynamic":
        assert plugin.loss_scale == 256.0


def test_clip_by_value():
    spy = GradSpy()
    t = trainer(plugins=[FP8Precision(loss_scaling="dynamic")], max_steps=3, gradient_clip_val=1e-4,
                gradient_clip_algorithm="value", callbacks=[spy])
    t.fit(RegressionModule(), loader())
    assert max(spy.maxabs) <= 1e-4


def test_checkpoint_resume_is_bit_identical(tmp_path):
    """Two epochs straight vs one epoch, checkpoint, a new Trainer resuming for the second epoch."""
    def make():
        torch.manual_seed(0)
        return RegressionModule(), FP8Precision(loss_scaling="dynamic")

    model, plugin = make()
    trainer(plugins=[plugin], max_epochs=2).fit(model, loader())
    straight = model.losses

    model, plugin = make()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(plugins=[plugin], max_epochs=1, enable_checkpointing=True, callbacks=[ckpt]).fit(model, loader())
    first = model.losses
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert not any("fp8_meta" in k for k in saved["state_dict"])  # loads into a plain model too
    assert any(k.endswith("fp8_meta.amax_history") for k in saved["FP8Precision"]["fp8_meta"])
    assert saved["FP8Precision"]["engine"]["scaler"]["scale"] == 256.0

    model, plugin = make()
    trainer(plugins=[plugin], max_epochs=2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "b")]).fit(
        model, loader(), ckpt_path=tmp_path / "last.ckpt"
    )
    resumed = first + model.losses
    assert resumed == straight  # bit-identical floats, not approximately equal


def test_plain_model_loads_lightning_checkpoint(tmp_path):
    model = RegressionModule()
    t = trainer(plugins=[FP8Precision()], max_steps=2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    t.fit(model, loader())
    plain = RegressionModule.load_from_checkpoint(tmp_path / "last.ckpt")
    assert not _fp8_layers(plain)
    assert torch.equal(plain.net[2].weight, model.net[2].weight)


def test_presets():
    assert FP8Precision(preset="conservative").recipe.scaling == "current"
    mellempudi = FP8Precision(preset="mellempudi")
    assert mellempudi.recipe.format == "e5m2" and mellempudi.engine.scaler.mode == "dynamic"
    assert FP8Precision().engine.scaler.mode == "none"  # per-tensor scaled gradients: no loss scaling needed
    assert FP8Precision(compute_dtype="fp16").engine.scaler.mode == "dynamic"
    with pytest.raises(ValueError, match="conservative"):
        FP8Precision(preset="aggressive")
    with pytest.raises(ValueError, match="not both"):
        FP8Precision(preset="default", recipe=FP8Recipe())


def test_conservative_preset_keeps_attention_in_bf16():
    from torch import nn

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(32, 64)
            self.attn = nn.ModuleDict({"q_proj": nn.Linear(64, 64), "o_proj": nn.Linear(64, 64)})
            self.mlp = nn.Linear(64, 64)
            self.head = nn.Linear(64, 32)

    model = FP8Precision(preset="conservative").convert_module(Attn())
    rows = {row.fqn: row for row in precision_map(model)}
    assert rows["attn.q_proj"].precision == "bf16" and "skip pattern" in rows["attn.q_proj"].reason
    assert rows["mlp"].precision == "fp8"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_scaling": "static"}, "dynamic"),
        ({"loss_scaling": -1.0}, "positive"),
        ({"optimizer_state": "int8"}, "fp32"),
        ({"compute_dtype": "fp32"}, "bf16"),
        ({"snapshot_every": 0}, "snapshot_every"),
        ({"spike_factor": 0.5}, "spike_factor"),
    ],
)
def test_bad_configuration_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8Precision(**kwargs)


def test_precision_flag_together_with_plugin_is_rejected():
    with pytest.raises(Exception, match="precision"):
        trainer(precision="bf16-mixed", plugins=[FP8Precision()])


def test_emulation_notice_on_cpu():
    import warnings

    from lightning_fp8.modules import gemm

    gemm._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(plugins=[FP8Precision()], max_steps=2).fit(RegressionModule(), loader())
    notices = [w for w in caught if issubclass(w.category, gemm.FP8EmulationWarning)]
    assert len(notices) == 1 and "emulated" in str(notices[0].message)


def test_counters_are_logged(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    t = trainer(plugins=[FP8Precision()], max_steps=3, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(RegressionModule(), loader())
    assert {"fp8/skipped_steps", "fp8/rollbacks", "fp8/loss_scale"} <= set(t.callback_metrics)


def test_dynamic_loss_scale_grows_after_clean_window():
    plugin = FP8Precision(loss_scaling="dynamic", init_loss_scale=8.0)
    plugin.engine.scaler.growth_interval = 3
    trainer(plugins=[plugin], max_steps=7).fit(RegressionModule(), loader())
    assert plugin.loss_scale == 8.0 * 2**2
