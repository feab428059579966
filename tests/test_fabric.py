"""lightning_fp8.fabric.FP8Precision: a Fabric loop with backward, clipping, skip on overflow, save/load."""
import lightning as L
import pytest
import torch
from torch import nn

from support.helpers import loader, mlp
from lightning_fp8 import FP8Linear
from lightning_fp8.fabric import FP8Precision


def _loop(fabric, model, optimizer, steps, inject_inf_at=None, clip=None):
    losses = []
    for i, (x, y) in enumerate(loader()):
        if i == steps:
            break
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if inject_inf_at == i:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if clip is not None:
            # error_if_nonfinite=False: a non-finite norm is the engine's to handle (the step is skipped)
            fabric.clip_gradients(model, optimizer, max_norm=clip, error_if_nonfinite=False)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _setup(plugin, seed=0):
    torch.manual_seed(seed)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, model, optimizer


def test_fabric_trains_in_fp8_and_skips_nonfinite_steps():
    plugin = FP8Precision(loss_scaling="dynamic")
    fabric, model, optimizer = _setup(plugin)
    before = [p.detach().clone() for p in model.parameters()]
    losses = _loop(fabric, model, optimizer, 6, inject_inf_at=0, clip=1.0)
    # the first and the last layer stay in BF16 (decided at the first forward, by its trace)
    assert sum(isinstance(m, FP8Linear) and m.fp8_enabled for m in model.modules()) == 2
    assert plugin.skipped_steps == 1 and plugin.loss_scale == 128.0  # backed off once
    assert losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with fabric.autocast():
        out = model(torch.randn(4, 32))
    assert out.dtype == torch.float32  # the module's outputs, as Fabric's bf16-mixed hands them back


def test_fabric_save_and_load_resumes_identically(tmp_path):
    plugin = FP8Precision(loss_scaling="dynamic")
    fabric, model, optimizer = _setup(plugin)
    _loop(fabric, model, optimizer, 3)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "fp8": plugin})
    expected = _loop(fabric, model, optimizer, 4)

    plugin2 = FP8Precision(loss_scaling="dynamic")
    fabric2, model2, optimizer2 = _setup(plugin2, seed=1)
    fabric2.load(tmp_path / "ckpt.pt", {"model": model2, "optimizer": optimizer2, "fp8": plugin2})
    assert plugin2.engine.step_count == 3
    assert _loop(fabric2, model2, optimizer2, 4) == expected


def test_fabric_rejects_fp8_optimizer_state():
    with pytest.raises(ValueError, match="FP8AdamW"):
        FP8Precision(optimizer_state="fp8")


def test_a_second_model_set_up_leaves_the_first_one_updating_its_scales_and_says_so():
    """The engine protects one model: a second `fabric.setup` must not leave the first model's FP8 layers with no
    scale updates at all (the engine had switched their own close off), and must say what is covered."""
    plugin = FP8Precision(loss_scaling="dynamic")
    fabric, first, opt_first = _setup(plugin)
    torch.manual_seed(1)
    second = mlp()
    opt_second = torch.optim.AdamW(second.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="covers only that model"):
        second, opt_second = fabric.setup(second, opt_second)
    layer = next(m for m in first.modules() if isinstance(m, FP8Linear) and m.fp8_enabled)
    history_before = layer.fp8_meta.amax_history.clone()
    _loop(fabric, first, opt_first, 3)
    _loop(fabric, second, opt_second, 3)
    assert not torch.equal(layer.fp8_meta.amax_history, history_before)  # the first model's scales still move
    assert layer.fp8_meta.amax_history[:, 1:].gt(0).any()  # closed steps entered its history
    assert sum(isinstance(m, FP8Linear) and m.fp8_enabled for m in second.modules()) == 2


def test_outputs_come_back_in_float32_as_with_fabrics_bf16_mixed():
    """Fabric's own "bf16-mixed" hands module outputs back in float32 (Precision.convert_output), so a user's loss is
    computed in float32; the FP8 plugin follows the same convention (before: the last layer's BF16)."""
    x = torch.randn(8, 32)
    dtypes = {}
    for name, kwargs in (("bf16-mixed", dict(precision="bf16-mixed")), ("fp8", dict(plugins=[FP8Precision()]))):
        torch.manual_seed(0)
        fabric = L.Fabric(accelerator="cpu", devices=1, **kwargs)
        model = fabric.setup(mlp())
        out = model(x)
        dtypes[name] = (out.dtype, out.requires_grad)
        nested = fabric.setup(_TwoOutputs())({"x": x})
        assert nested["a"].dtype == nested["pair"][1].dtype == out.dtype and nested["ids"].dtype == torch.long
    assert dtypes["fp8"] == dtypes["bf16-mixed"] == (torch.float32, True)


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, batch):
        x = batch["x"]
        return {"a": self.a(x), "pair": (x, self.b(x)), "ids": torch.arange(3)}


def test_fp8_eval_false_evaluates_in_the_compute_dtype():
    """fp8_eval=False: forwards of the module in eval mode skip FP8 (before, Fabric ran them in FP8 regardless)."""
    from lightning_fp8 import fp8_autocast

    x = torch.randn(8, 32)
    outs = {}
    for fp8_eval in (False, True):
        torch.manual_seed(0)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FP8Precision(fp8_eval=fp8_eval)])
        model = fabric.setup(mlp()).eval()
        with torch.no_grad():
            outs[fp8_eval] = model(x)
            with fabric.autocast(), fp8_autocast(enabled=False):
                outs["reference"] = model.module(x).float()
    assert torch.equal(outs[False], outs["reference"]) and not torch.equal(outs[True], outs["reference"])


def test_the_parallelize_conversion_is_installed_with_the_plugins_and_removed_with_them():
    """Fabric's ModelParallelStrategy.setup_module is wrapped (conversion before the parallelize function) while an FP8
    plugin exists, and is Fabric's own again once the last one is gone: never patched process-wide for good."""
    import gc

    from lightning.fabric.strategies import ModelParallelStrategy

    gc.collect()
    own = ModelParallelStrategy.setup_module
    assert not hasattr(own, "__wrapped__")
    first, second = FP8Precision(), FP8Precision()
    assert ModelParallelStrategy.setup_module.__wrapped__ is own
    del first
    gc.collect()
    assert ModelParallelStrategy.setup_module.__wrapped__ is own
    del second
    gc.collect()
    assert ModelParallelStrategy.setup_module is own
