"""LightningCLI (jsonargparse) builds FP8Precision from a command line and a YAML file; values that would silently mean
something else are refused where they are written."""
import sys
from unittest import mock

import pytest
from lightning.pytorch.cli import LightningCLI

from support.helpers import RegressionModule, loader
from lightning_fp8 import FP8Precision, FP8Recipe


class _Module(RegressionModule):
    def train_dataloader(self):
        return loader()


def _cli(args):
    with mock.patch.object(sys, "argv", ["train.py"]):  # LightningCLI also reads sys.argv (pytest's here)
        return LightningCLI(_Module, run=False, save_config_callback=None, args=args,
                            trainer_defaults=dict(accelerator="cpu", logger=False, enable_checkpointing=False,
                                                  enable_progress_bar=False, enable_model_summary=False))


def test_command_line_static_loss_scale_is_a_float():
    # Union[str, float] keeps "1024" a string in jsonargparse: the options' validation reads it as the float it spells
    cli = _cli(["--trainer.plugins=lightning_fp8.FP8Precision", "--trainer.plugins.loss_scaling=1024"])
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, FP8Precision)
    assert plugin.options.loss_scaling == 1024.0 and plugin.engine.scaler.scale == 1024.0


def test_yaml_config_with_a_recipe(tmp_path):
    config = tmp_path / "fp8.yaml"
    config.write_text(
        "trainer:\n"
        "  plugins:\n"
        "    class_path: lightning_fp8.FP8Precision\n"
        "    init_args:\n"
        "      loss_scaling: '2048'\n"
        "      fp8_eval: false\n"
        "      recipe:\n"
        "        class_path: lightning_fp8.FP8Recipe\n"
        "        init_args: {scaling: current, margin: 1}\n"
    )
    plugin = _cli([f"--config={config}"]).trainer.precision_plugin
    assert plugin.engine.scaler.scale == 2048.0 and plugin.fp8_eval is False
    assert plugin.recipe.scaling == "current" and plugin.recipe.margin == 1


def test_help_lists_every_option_with_its_description(capsys):
    """The plugin defines no constructor: jsonargparse reads the arguments and their descriptions from
    FP8PrecisionCore.__init__, the one definition of the options."""
    from lightning_fp8.integrations.plugin_core import OPTION_NAMES

    with pytest.raises(SystemExit):
        _cli(["--trainer.plugins.help", "lightning_fp8.FP8Precision"])
    text = " ".join(capsys.readouterr().out.split())
    for name in OPTION_NAMES:
        assert f"--trainer.plugins.{name}" in text, name
    assert "clean iterations in a row after which the dynamic loss scale doubles. (type: int, default: 1000)" in text


@pytest.mark.parametrize("name", ["fp8_eval", "fp8_all_gather"])
def test_string_booleans_are_refused(name):
    with pytest.raises(ValueError, match=f"{name} must be True or False, got 'no'"):
        FP8Precision(**{name: "no"})


def test_recipe_values_the_hardware_cannot_take_are_refused_at_construction():
    with pytest.raises(ValueError, match="valid choices: 128, or another power of two >= 16"):
        FP8Recipe(scaling="blockwise", block_size=100)
    with pytest.raises(ValueError, match="keep_first_last_in_bf16 must be True or False"):
        FP8Recipe(keep_first_last_in_bf16="false")
    assert FP8Recipe(scaling="blockwise", block_size=64).block_size == 64  # emulated sizes stay available
