"""FP8Precision(backend="transformer_engine") and FP8Kwargs(backend="transformer_engine"): the plugins convert with
Transformer Engine's te.Linear, run every step under te.autocast with the recipe mapped from ours, and keep loss
scaling, skip and rollback on top. TE needs CUDA to install: tested against a stand-in with TE's public API shape
(tests/conftest.py, `te_stand_in`); what only a GPU run with TE can confirm is listed in docs/status.md."""
import lightning as L
import pytest
import torch
from torch import nn

from support.helpers import RegressionModule, loader, mlp, trainer
from lightning_fp8 import FP8Precision, FP8Recipe, fp8_layers, precision_map
from lightning_fp8.backends import transformer_engine as te_backend


def test_lightning_plugin_runs_te_layers_under_te_autocast_with_our_loss_scaling(te_stand_in):
    te_backend._warned.clear()
    plugin = FP8Precision(FP8Recipe(margin=1, amax_history_len=8), backend="transformer_engine",
                          loss_scaling="dynamic", snapshot_every=1)
    model = RegressionModule()
    first_weight = model.net[2].weight
    poisoned = []

    class Poison(L.Callback):  # one non-finite gradient at step 2: the engine skips it and backs the loss scale off
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 2:
                poisoned.append(True)
                pl_module.net[2].weight.grad[0, 0] = float("inf")

    with pytest.warns(UserWarning, match="FP8LayerFallback, FP8Calibration and FP8 all-gather do not see inside"):
        t = trainer(plugins=[plugin], max_steps=4, callbacks=[Poison()])
        t.fit(model, loader())
    assert isinstance(model.net[2], te_stand_in.Linear) and isinstance(model.net[4], te_stand_in.Linear)
    assert model.net[2].weight is first_weight  # the same Parameter: optimizers built before conversion stay valid
    assert type(model.net[0]) is nn.Linear and type(model.net[6]) is nn.Linear  # first and last: the default filter
    assert not fp8_layers(model)
    rows = {r.fqn: r for r in precision_map(model)}
    assert rows["net.2"].precision == "fp8" and "Transformer Engine" in rows["net.2"].reason
    assert "first linear layer" in rows["net.0"].reason
    training_calls = te_stand_in.calls[:8]
    assert all(enabled for enabled, _ in training_calls)  # every training forward inside te.autocast
    recipe = training_calls[0][1]
    assert (recipe.margin, recipe.amax_history_len, recipe.fp8_format) == (1, 8, te_stand_in.Format.HYBRID)
    assert poisoned and plugin.skipped_steps == 1 and plugin.loss_scale == 2.0**7
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fabric_and_accelerate_take_the_same_backend(te_stand_in, fresh_accelerate_state):
    from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(backend="transformer_engine",
                                                                                 fp8_eval=False)])
    model = mlp()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = next(iter(loader()))
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    model.eval()
    model(x)
    assert [enabled for enabled, _ in te_stand_in.calls] == [True, True, False, False]  # fp8_eval=False: eval in BF16

    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(backend="transformer_engine")])
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    assert sum(isinstance(m, te_stand_in.Linear) for m in model.modules()) == 2 and te_stand_in.calls[-1][0]


def test_te_backend_errors_are_said_at_construction(te_stand_in):
    with pytest.raises(ValueError, match="cannot express rounding='stochastic'"):
        FP8Precision(FP8Recipe(rounding="stochastic"), backend="transformer_engine")
    with pytest.raises(ValueError, match="layer_recipes applies to lightning_fp8's own FP8 layers"):
        FP8Precision(backend="transformer_engine", layer_recipes={"*": FP8Recipe(scaling="current")})
    with pytest.raises(ValueError, match="valid choices: \\['lightning_fp8', 'transformer_engine'\\]"):
        FP8Precision(backend="te")


def test_without_te_the_backend_says_how_to_install_it():
    if te_backend.te_available():
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(ImportError, match="Transformer Engine is not installed.*pip install"):
        FP8Precision(backend="transformer_engine")


def test_auto_recipe_that_te_cannot_express_names_auto_and_its_choice(te_stand_in, auto_prefers_candidates):
    """recipe='auto' on sm100 chooses mxfp8 (where the model prefers it), which this TE mapping does not express: the error says that 'auto' chose
    it, on which device, and what to pass instead (before: only "cannot express scaling='mxfp8'", never chosen by
    the user)."""
    from lightning_fp8.kernels.device import simulate_cuda

    with simulate_cuda((10, 0)), pytest.raises(ValueError) as raised:
        FP8Precision(recipe="auto", backend="transformer_engine")
    message = str(raised.value)
    assert "recipe='auto' chose mxfp8 on sm100" in message and "cannot express scaling='mxfp8'" in message
    assert "pass a recipe" in message
    with simulate_cuda((9, 0)):
        FP8Precision(recipe="auto", backend="transformer_engine")  # per-tensor delayed: TE expresses it
