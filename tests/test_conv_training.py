"""FP8 convolutions in training under the Lightning plugin: FP8ScaleMonitor samples them, FP8LayerFallback moves one
to BF16 (and escalates one to blockwise scaling first, which runs the fine-grained convolution), checkpoints carry
their FP8 state and a resumed run has the same precision map; the Lightning example trains transformers' ResNet-18."""
import importlib.util
import json
import math
import pathlib

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support.helpers import trainer
from lightning_fp8 import FP8Conv2d, FP8Precision, fp8_layers, precision_map
from lightning_fp8.callbacks import FP8LayerFallback, FP8ScaleMonitor

ROLES = ("input", "weight", "grad_output")
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "resnet_digits.py"


class ConvNet(L.LightningModule):
    """Six convolutions: the stem (3 channels) and the first and last convertible ones stay in BF16, net.4, net.6
    (stride 2) and net.8 (1x1) run in FP8; the classifier (32 -> 10) is unaligned."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )
        self.example_input_array = torch.zeros(1, 3, 8, 8)
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def images(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)),
                      batch_size=8)


class GrowWeight(Callback):
    """Planted fault: multiply one layer's weight by `factor` before each of `steps` optimizer steps."""

    def __init__(self, fqn, start, steps, factor):
        self.fqn, self.start, self.steps, self.factor = fqn, start, steps, factor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.start <= trainer.global_step < self.start + self.steps:
            with torch.no_grad():
                pl_module.get_submodule(self.fqn).weight.mul_(self.factor)


def test_monitor_fallback_and_checkpoints_see_the_convolutions(tmp_path):
    """net.6's weight grows x30 per step for 4 steps from step 2: its weight cast overflows, and so does the input of
    the layers after it; the fallback moves net.6, where the overflow originates, to BF16. The monitor's history holds every FP8
    convolution's statistics; the checkpoint holds their FP8 state, and a resumed run has the same precision map."""
    torch.manual_seed(0)
    model = ConvNet()
    fallback = FP8LayerFallback(escalate_to=None)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    t = trainer(plugins=[FP8Precision()], max_steps=9, max_epochs=-1, logger=CSVLogger(tmp_path, name="run"),
                log_every_n_steps=1, enable_checkpointing=True,
                callbacks=[GrowWeight("net.6", 2, 4, 30.0), FP8ScaleMonitor(log_every_n_steps=1), fallback, ckpt])
    t.fit(model, images())
    layers = fp8_layers(model)
    assert list(layers) == ["net.4", "net.6", "net.8"] and all(isinstance(m, FP8Conv2d) for m in layers.values())
    rows = {r.fqn: r for r in precision_map(model)}
    assert [f for f, r in rows.items() if r.precision == "fp8"] == ["net.4", "net.8"]
    assert rows["net.6"].reason.startswith("FP8 overflow originated here") and "weight" in rows["net.6"].reason
    assert [(e["kind"], e["layers"]) for e in fallback.events] == [("fallback", ["net.6"])]
    assert all(math.isfinite(loss) for loss in model.losses)

    with open(tmp_path / "run" / "version_0" / "fp8_history.jsonl") as f:
        records = [json.loads(line) for line in f]
    stats = [r for r in records if r["type"] == "stats"]
    first = stats[0]["layers"]
    assert set(first) == {"net.4", "net.6", "net.8"}
    for fqn in first:
        for role in ROLES:
            assert first[fqn][role]["scale"] > 0 and 15.0 < first[fqn][role]["sqnr_db"] < 40.0

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    meta = saved["FP8Precision"]["fp8_meta"]
    assert {k.split(".fp8_meta.")[0] for k in meta} == {"net.4", "net.6", "net.8"}
    history = meta["net.4.fp8_meta.amax_history"]  # [3 roles, open step + 16 completed], 9 steps so far
    assert history.shape == (3, 17) and bool(history[:, 1:10].gt(0).all()) and not history[:, 10:].any()
    assert set(saved["state_dict"]) == set(ConvNet().state_dict())  # the plain model's keys

    torch.manual_seed(0)
    resumed = ConvNet()
    t2 = trainer(plugins=[FP8Precision()], max_steps=10, max_epochs=-1, callbacks=[FP8LayerFallback(escalate_to=None)])
    t2.fit(resumed, images(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert [(r.fqn, r.precision, r.reason) for r in precision_map(resumed)] == [
        (r.fqn, r.precision, r.reason) for r in rows.values()]
    restored = fp8_layers(resumed)["net.4"].fp8_meta.amax_history
    assert restored[:, 2:11].equal(history[:, 1:10])  # loaded, then one more step pushed it by one slot


def plant_outlier_channel(conv: nn.Conv2d, channel: int = 3, factor: float = 1e6) -> None:
    """Multiply one input channel of `conv` by `factor`, its weights held at zero (lightning_fp8/demo/planted.py's
    fault for a convolution): a per-tensor input scale sized for it flushes the other channels to zero."""
    with torch.no_grad():
        conv.weight[:, channel] = 0.0

    def scale(module, args):
        x = args[0].clone()
        x[:, channel] = x[:, channel] * factor
        return (x,)

    def keep_zero(grad):
        grad = grad.clone()
        grad[:, channel] = 0.0
        return grad

    conv.register_forward_pre_hook(scale)
    conv.weight.register_hook(keep_zero)


def test_a_flushed_convolution_escalates_to_blockwise_scaling_and_keeps_training():
    """The default fallback escalates net.4 (a x1e6 input channel flushes the others) to blockwise scaling: the
    layer then runs the fine-grained convolution (tile-scaled GEMMs on the unfolded input) in the same run."""
    torch.manual_seed(0)
    model = ConvNet()
    plant_outlier_channel(model.net[4])
    fallback = FP8LayerFallback(check_every_n_steps=1)
    trainer(plugins=[FP8Precision()], callbacks=[fallback], max_steps=6, max_epochs=-1).fit(model, images())
    assert list(fallback.escalations) == ["net.4"]
    info = fallback.escalations["net.4"]
    assert info["from"] == "delayed" and info["to"] == "blockwise" and info["rule"] == "underflow"
    layer = fp8_layers(model)["net.4"]
    assert layer.recipe.scaling == "blockwise"
    assert all(math.isfinite(loss) for loss in model.losses)
    assert {r.fqn: r.scaling for r in precision_map(model)}["net.6"] == "delayed"


def test_the_lightning_example_trains_resnet18_on_the_digits(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("resnet_digits_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--max-steps", "1", "--epochs", "1", "--batch-size", "4", "--image-size", "8",
                           "--limit-val-batches", "1", "--log-dir", str(tmp_path)])
    assert result["convolutions"] == 20 and result["fp8_convolutions"] == 17
    assert 0.0 <= result["accuracy"] <= 1.0
    history = list(tmp_path.glob("resnet_digits/version_0/fp8_history.jsonl"))
    assert history and '"type":"stats"' in history[0].read_text()
