"""Every state lightning_fp8 saves carries its format version and loads with torch.load(weights_only=True); a state
written in a newer format is refused by name instead of misread (lightning_fp8/state_format.py). Old, unversioned
states keep loading: tests/test_golden_checkpoints.py."""
import copy

import lightning as L
import pytest
import torch
from support.helpers import RegressionModule, loader, mlp, trainer

from lightning_fp8 import FP8LayerFallback, FP8Precision, FP8ScaleMonitor, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.optim import FP8AdamW
from lightning_fp8.state_format import FORMAT_VERSION_KEY


def _lightning_checkpoint(tmp_path):
    fit = trainer(max_steps=2, plugins=FP8Precision(optimizer_state="fp8"), default_root_dir=tmp_path,
                  callbacks=[FP8LayerFallback(), FP8ScaleMonitor()])
    fit.fit(RegressionModule(), loader())
    path = tmp_path / "run.ckpt"
    fit.save_checkpoint(path)
    return path


def test_a_lightning_checkpoint_is_versioned_and_loads_weights_only(tmp_path):
    checkpoint = torch.load(_lightning_checkpoint(tmp_path), weights_only=True)
    plugin = checkpoint["FP8Precision"]
    assert plugin[FORMAT_VERSION_KEY] == 1 and plugin["engine"][FORMAT_VERSION_KEY] == 1
    assert plugin["fp8_meta"]._metadata[""][FORMAT_VERSION_KEY] == 1 and len(plugin["fp8_meta"]) > 0
    assert checkpoint["optimizer_states"][0][FORMAT_VERSION_KEY] == 1  # FP8AdamW
    assert checkpoint["callbacks"]["FP8ScaleMonitor"][FORMAT_VERSION_KEY] == 1
    assert checkpoint["callbacks"]["FP8LayerFallback"]["version"] == 1


@pytest.mark.parametrize("where", ["plugin", "engine", "optimizer"])
def test_a_newer_format_is_refused_by_name(tmp_path, where):
    path = _lightning_checkpoint(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    target = {"plugin": checkpoint["FP8Precision"], "engine": checkpoint["FP8Precision"]["engine"],
              "optimizer": checkpoint["optimizer_states"][0]}[where]
    target[FORMAT_VERSION_KEY] = 99
    torch.save(checkpoint, path)
    resumed = trainer(max_steps=4, plugins=FP8Precision(optimizer_state="fp8"), default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="format version 99 by a newer lightning_fp8"):
        resumed.fit(RegressionModule(), loader(), ckpt_path=str(path))


def test_fp8_state_dict_is_versioned_without_adding_entries(tmp_path):
    torch.manual_seed(0)
    model = convert_to_fp8(mlp(), recipe=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(8, 32)).float().sum().backward()
    state = fp8_state_dict(model)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    torch.save(state, tmp_path / "fp8.pt")
    loaded = torch.load(tmp_path / "fp8.pt", weights_only=True)
    assert loaded._metadata[""][FORMAT_VERSION_KEY] == 1
    load_fp8_state_dict(model, loaded)
    newer = copy.copy(loaded)
    newer._metadata = {"": {FORMAT_VERSION_KEY: 2}}
    with pytest.raises(ValueError, match="format version 2"):
        load_fp8_state_dict(model, newer)


def test_fabric_and_fp8adamw_states_are_versioned(tmp_path):
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    plugin = FabricFP8Precision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model = mlp()
    optimizer = FP8AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(16, 32)
    fabric.backward(model(x).float().square().mean())
    optimizer.step()
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "fp8": plugin})
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["fp8"][FORMAT_VERSION_KEY] == 1 and saved["optimizer"][FORMAT_VERSION_KEY] == 1
