"""The package layout and the public API surface (docs/architecture.md): public import paths, real constructor
signatures (what help(), IDEs and LightningCLI / jsonargparse read), and nothing loose at the top level."""
import inspect
import pathlib

import pytest

import lightning_fp8

PACKAGE = pathlib.Path(lightning_fp8.__file__).parent
#: the top level holds the public entry points and the recipe only
TOP_LEVEL_MODULES = {"__init__.py", "recipe.py", "presets.py", "fabric.py", "accelerate.py", "cli.py"}


def test_public_import_paths():
    from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe, convert_to_fp8, fp8_autocast, revert_fp8  # noqa: F401
    from lightning_fp8.accelerate import FP8Accelerator, FP8AcceleratorMixin, FP8Kwargs  # noqa: F401
    from lightning_fp8.callbacks import FP8Calibration, FP8LayerFallback, FP8ScaleMonitor  # noqa: F401
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision  # noqa: F401
    from lightning_fp8.optim import FP8AdamW  # noqa: F401


def test_nothing_loose_at_the_top_level():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL_MODULES


@pytest.mark.parametrize("path", ["lightning_fp8", "lightning_fp8.fabric"])
def test_plugin_constructors_list_their_arguments(path):
    import importlib

    from lightning_fp8.integrations._options import option_names

    plugin = importlib.import_module(path).FP8Precision
    params = inspect.signature(plugin).parameters
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_POSITIONAL not in kinds and inspect.Parameter.VAR_KEYWORD not in kinds
    assert tuple(params) == option_names()
    for knob in ("growth_interval", "spike_window", "spike_warmup", "check_weights_every", "init_loss_scale"):
        assert params[knob].default is not inspect.Parameter.empty, knob
    hints = __import__("typing").get_type_hints(plugin.__init__)  # what jsonargparse resolves
    assert hints["growth_interval"] is int and hints["spike_factor"] == __import__("typing").Optional[float]


def test_every_stability_knob_reaches_the_engine():
    import dataclasses

    from lightning_fp8 import FP8Precision
    from lightning_fp8.engine import StabilityConfig

    values = {"growth_interval": 7, "spike_window": 9, "spike_warmup": 3, "check_weights_every": 5, "init_loss_scale": 64.0,
              "snapshot_every": 11, "max_consecutive_skips": 4, "max_rollbacks": 2, "rollback_window": 99,
              "spike_factor": 3.0, "loss_scaling": "dynamic"}
    assert set(values) == {f.name for f in dataclasses.fields(StabilityConfig)}
    config = FP8Precision(**values).engine.config
    for name, value in values.items():
        assert getattr(config, name) == value, name
