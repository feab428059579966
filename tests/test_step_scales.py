"""The scaling state through real training: what a skipped step, a recomputing forward, a recipe override, an
unscaled gradient and a loss-scale change do to the scales. Each test is the regression test of a defect that
gave a silently wrong scale."""
import math

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support.helpers import RegressionModule, loader, trainer
from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe, fp8_autocast, fp8_layers


class Fault(Callback):
    """At optimizer step `at`: the batch's inputs x1e4 (finite, huge activations) and an inf in one gradient, so
    the step is rejected."""

    def __init__(self, at):
        self.at = at

    def on_fit_start(self, trainer, pl_module):
        pl_module.fault = lambda m, x, y: (x * 1e4, y) if trainer.global_step == self.at else (x, y)

        def poison(grad):
            if trainer.global_step == self.at:
                grad = grad.clone()
                grad[0, 0] = float("inf")
            return grad

        pl_module.net[6].weight.register_hook(poison)


class InputScales(Callback):
    def __init__(self):
        self.scales = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.scales[trainer.global_step] = pl_module.net[2].fp8_meta.input.scale.item()


def test_a_skipped_step_leaves_no_trace_in_the_delayed_scales():
    """Measured before the fix: the rejected batch's amaxes entered the history and net.2's input scale fell by
    ~1e4 for the 16 steps of the history. Now the steps after the rejected one cast exactly as before it."""
    torch.manual_seed(0)
    model = RegressionModule()
    plugin, scales = FP8Precision(), InputScales()  # defaults: delayed scaling, history 16, snapshot_every 50
    trainer(plugins=[plugin], max_steps=12, max_epochs=-1, callbacks=[Fault(at=6), scales]).fit(model, loader())
    assert plugin.skipped_steps == 1 and plugin.engine.events[0]["kind"] == "skip"
    assert scales.scales[7] == scales.scales[6]  # the rejected step changed nothing
    history = model.net[2].fp8_meta.input.amax_history
    assert history.max().item() < 100  # normal amaxes are O(1..10); the x1e4 batch's never entered


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.block = nn.Sequential(FP8Linear(32, 64), nn.GELU(), FP8Linear(64, 32))
        self.use_reentrant = use_reentrant
        self.use_checkpoint = True

    def forward(self, x):
        if self.use_checkpoint:
            return checkpoint.checkpoint(self.block, x, use_reentrant=self.use_reentrant)
        return self.block(x)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_the_forwards_scales(use_reentrant):
    """The recomputing forward runs inside backward; it used to close the scaling step (plain-PyTorch mode), so the
    recomputed casts used other scales than the forward's. Now checkpointed training equals plain training bit for
    bit: same gradients, same histories."""
    torch.manual_seed(0)
    ref = Checkpointed(use_reentrant)
    ref.use_checkpoint = False
    ckpt = Checkpointed(use_reentrant)
    ckpt.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = (torch.randn(16, 32, generator=g) * (1 + step)).requires_grad_()  # growing: each close changes scales
        grads = []
        for model in (ref, ckpt):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads):
            assert torch.equal(a, b)
    for a, b in zip(fp8_layers(ref).values(), fp8_layers(ckpt).values()):
        assert torch.equal(a.fp8_meta.amax_history, b.fp8_meta.amax_history)
        assert torch.equal(a.fp8_meta.clip_count, b.fp8_meta.clip_count)


def test_recipe_override_casts_with_scales_of_its_own_format():
    """An E5M2 layer trained under fp8_autocast(recipe=E4M3): its scales used to be sized for 57344 while the casts
    were E4M3, saturating nearly everything at 448. The output now tracks a BF16 linear."""
    torch.manual_seed(0)
    layer = FP8Linear(64, 64, recipe=FP8Recipe(format="e5m2"))
    ref = nn.Linear(64, 64)
    ref.load_state_dict(layer.state_dict())
    override = FP8Recipe(format="e4m3")
    for _ in range(3):
        x = torch.randn(32, 64)
        with fp8_autocast(recipe=override):
            out = layer(x)
        out.sum().backward()
    with torch.no_grad():
        error = (out - ref(x)).norm() / ref(x).norm()
    assert error < 0.1  # E4M3's own error is ~3%; saturated casts gave ~100%


def test_unscaled_gradient_saturation_backs_the_loss_scale_off():
    """The mellempudi preset casts gradients with scale 1: a gradient beyond E5M2's 57344 used to be clipped and only
    counted as a clip, so the loss scale kept growing (measured: 2^30 kept). Saturation of an unscaled role is an
    overflow: the step is skipped and the loss scale backs off until the gradients fit."""
    torch.manual_seed(0)
    plugin = FP8Precision(preset="mellempudi", init_loss_scale=2.0**30)
    trainer(plugins=[plugin], max_steps=30, max_epochs=-1).fit(RegressionModule(), loader())
    assert plugin.loss_scale < 2.0**30
    assert plugin.skipped_steps >= 1
    reasons = [e["reason"] for e in plugin.engine.events if e["kind"] == "skip"]
    assert any("grad_output" in r for r in reasons), reasons


class GradClips(Callback):
    def __init__(self):
        self.clips = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clips.append(sum(int(layer.fp8_meta.grad_output.clip_count) for layer in fp8_layers(pl_module).values()))


def test_delayed_gradient_scales_follow_a_loss_scale_change():
    """FP16 compute with dynamic loss scaling and delayed gradient scales: every doubling of the loss scale doubles
    the gradients' amax, which the history had not seen, so the next gradient casts clipped (measured here: 4 clips
    per layer in 16 steps). The history now follows the loss scale. The run repeats one batch with LR 0, so the
    loss scale is the only thing that changes the gradients."""
    torch.manual_seed(0)
    x, y = next(iter(loader()))
    same_batch = DataLoader(TensorDataset(x.repeat(16, 1), y.repeat(16, 1)), batch_size=len(x))
    plugin = FP8Precision(compute_dtype="fp16", loss_scaling="dynamic", growth_interval=3, init_loss_scale=4.0)
    clips = GradClips()
    trainer(plugins=[plugin], max_steps=16, max_epochs=-1, callbacks=[clips]).fit(RegressionModule(lr=0.0), same_batch)
    assert plugin.loss_scale == 4.0 * 2**5  # five doublings
    assert clips.clips[-1] == 0


def test_bias_gradient_has_the_bias_dtype():
    layer = FP8Linear(32, 16)
    layer.bias.data = layer.bias.data.to(torch.bfloat16)
    layer(torch.randn(8, 32)).float().sum().backward()
    assert layer.bias.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.float32
    assert math.isfinite(layer.bias.grad.float().sum().item())
