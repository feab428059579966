"""Every checkpoint the plugin writes, through Lightning's ModelCheckpoint (the default one and a weights-only one),
loads back through every Lightning path and into a plain model (issue 12, item 5).

Measured before the FP8 metadata left the model's state_dict: `ModelCheckpoint(save_weights_only=True)` skips the
precision plugin's hooks, the checkpoint kept `fp8_meta.*` keys, and `load_from_checkpoint`, `trainer.test(model,
ckpt_path=...)` and `trainer.validate(ckpt_path=...)` failed with "Unexpected key(s)".
"""
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from support.helpers import RegressionModule, loader, mlp, trainer
from lightning_fp8 import FP8Linear, FP8Precision


def _fp8_layers(module):
    return [m for m in module.modules() if isinstance(m, FP8Linear)]


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module", params=["default", "weights_only"])
def fitted(request, tmp_path_factory):
    """A model trained under FP8Precision, checkpointed by the default ModelCheckpoint (Trainer's own) or by
    ModelCheckpoint(save_weights_only=True)."""
    tmp_path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = RegressionModule()
    callbacks = [] if request.param == "default" else [ModelCheckpoint(dirpath=tmp_path, save_weights_only=True)]
    t = trainer(plugins=[FP8Precision()], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path,
                callbacks=callbacks)
    t.fit(model, loader(), loader(64))
    path = t.checkpoint_callback.best_model_path
    test_loss = t.test(model, loader(64), verbose=False)[0]["test_loss"]
    return request.param, t, model, path, test_loss


def test_the_checkpoint_holds_the_plain_models_keys(fitted):
    kind, _, model, path, _ = fitted
    saved = torch.load(path, weights_only=False)
    assert ("FP8Precision" in saved) == (kind == "default")  # weights-only skips the plugin's state
    assert set(saved["state_dict"]) == set(RegressionModule().state_dict())


def test_load_from_checkpoint_gives_the_plain_model(fitted):
    _, _, model, path, _ = fitted
    plain = RegressionModule.load_from_checkpoint(path)
    assert not _fp8_layers(plain)
    assert all(torch.equal(v, _weights(model)[k]) for k, v in _weights(plain).items())


def test_a_plain_torch_model_loads_the_weights(fitted):
    _, _, model, path, _ = fitted
    net = mlp()
    state = torch.load(path, weights_only=False)["state_dict"]
    net.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})  # strict: no extra keys
    assert all(torch.equal(v, model.net.state_dict()[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("fn", ["test", "validate"])
def test_a_fresh_model_under_fp8_tests_and_validates_from_the_checkpoint(fitted, fn):
    """A new Trainer, a new plugin, a new (differently initialised) model: the checkpoint's weights are loaded, the
    model is converted, and the evaluation equals the trained model's (evaluation casts use current scaling, so the
    FP8 metadata a weights-only checkpoint lacks does not change it)."""
    _, _, model, path, test_loss = fitted
    torch.manual_seed(1)
    fresh = RegressionModule()
    t = trainer(plugins=[FP8Precision()])
    result = getattr(t, fn)(fresh, loader(64), ckpt_path=path, verbose=False)[0]
    assert len(_fp8_layers(fresh)) == 2
    assert all(torch.equal(v, _weights(model)[k]) for k, v in _weights(fresh).items())
    assert result["test_loss" if fn == "test" else "val_loss"] == pytest.approx(test_loss, rel=0, abs=0)


def test_the_fitted_trainer_validates_from_the_checkpoint(fitted):
    _, t, model, path, test_loss = fitted
    assert t.validate(model, loader(64), ckpt_path=path, verbose=False)[0]["val_loss"] == test_loss
