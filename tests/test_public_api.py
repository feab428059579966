"""The package layout and the public API surface (docs/architecture.md): public import paths, real constructor
signatures (what help(), IDEs and LightningCLI / jsonargparse read), nothing loose at the top level, and the options
defined once (the parameters of FP8PrecisionCore.__init__; every other list of them is generated or checked here)."""
import inspect
import pathlib

import pytest

import lightning_fp8

PACKAGE = pathlib.Path(lightning_fp8.__file__).parent
#: the top level holds the public entry points and the recipe only (and renamed.py: old public names, for one release)
TOP_LEVEL_MODULES = {"__init__.py", "recipe.py", "presets.py", "fabric.py", "accelerate.py", "cli.py", "state_format.py",
                     "litgpt.py", "renamed.py"}


def test_public_import_paths():
    from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe, convert_to_fp8, fp8_autocast, revert_fp8  # noqa: F401
    from lightning_fp8.accelerate import FP8Accelerator, FP8AcceleratorMixin, FP8Kwargs  # noqa: F401
    from lightning_fp8.callbacks import FP8Calibration, FP8LayerFallback, FP8ScaleMonitor  # noqa: F401
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision  # noqa: F401
    from lightning_fp8.optim import FP8AdamW  # noqa: F401


def test_nothing_loose_at_the_top_level():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL_MODULES


def _options():
    """The one definition of the options: the parameters of FP8PrecisionCore.__init__ (without self)."""
    from lightning_fp8.integrations.plugin_core import FP8PrecisionCore

    return dict(list(inspect.signature(FP8PrecisionCore.__init__).parameters.items())[1:])


@pytest.mark.parametrize("module", ["integrations/lightning.py", "integrations/fabric_plugin.py"])
def test_the_plugins_define_no_constructor(module):
    """The plugins' arguments are FP8PrecisionCore's, not a copy: neither file defines an __init__."""
    import ast

    tree = ast.parse((PACKAGE / module).read_text())
    assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "__init__"]


@pytest.mark.parametrize("path", ["lightning_fp8", "lightning_fp8.fabric"])
def test_plugin_signatures_list_every_option(path):
    """What help(), IDEs and LightningCLI / jsonargparse read: every option, recipe first (positional or keyword),
    the rest keyword-only, with the core's defaults and resolvable types."""
    import importlib
    import typing

    plugin = importlib.import_module(path).FP8Precision
    assert "__init__" not in vars(plugin)
    params = inspect.signature(plugin).parameters
    options = _options()
    assert list(params) == list(options)
    assert [(p.kind, p.default) for p in params.values()] == [(p.kind, p.default) for p in options.values()]
    assert params["recipe"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert {p.kind for name, p in params.items() if name != "recipe"} == {inspect.Parameter.KEYWORD_ONLY}
    hints = typing.get_type_hints(plugin.__init__)  # what jsonargparse resolves
    assert hints["growth_interval"] is int and hints["spike_factor"] == typing.Optional[float]


def test_fp8_kwargs_fields_are_the_options():
    import dataclasses
    import typing

    from lightning_fp8.accelerate import FP8Kwargs
    from lightning_fp8.integrations.plugin_core import FP8Options, FP8PrecisionCore

    hints = typing.get_type_hints(FP8PrecisionCore.__init__)
    for record in (FP8Kwargs, FP8Options):
        fields = dataclasses.fields(record)
        assert [(f.name, f.default) for f in fields] == [(name, p.default) for name, p in _options().items()], record
        assert all(f.kw_only for f in fields) and {f.name: f.type for f in fields} == {
            name: hints[name] for name in _options()}


def test_stability_config_fields_are_options_with_the_same_defaults():
    import dataclasses

    from lightning_fp8.engine import StabilityConfig

    options = _options()
    for field in dataclasses.fields(StabilityConfig):
        assert field.name in options and field.default == options[field.name].default, field.name


def test_lightning_plugin_is_the_fabric_plugin_behind_lightnings_precision():
    """class FP8Precision(Precision, FabricFP8Precision), as Lightning's TransformerEnginePrecision: the Lightning hooks
    the plugin relies on are its own, and forward_context is the core's FP8 context (Fabric's starts an iteration)."""
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision

    from lightning_fp8 import FP8Precision
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
    from lightning_fp8.integrations.plugin_core import EngineCounters, FP8PrecisionCore

    assert FP8Precision.__mro__[:6] == (FP8Precision, Precision, FabricFP8Precision, FP8PrecisionCore, EngineCounters,
                                        FabricPrecision)
    own = vars(FP8Precision)
    for hook in ("connect", "convert_input", "module_init_context", "pre_backward", "optimizer_step", "clip_gradients",
                 "train_step_context", "val_step_context", "test_step_context", "predict_step_context"):
        assert hook in own, hook
    assert FP8Precision.forward_context is FP8PrecisionCore.forward_context
    assert FP8Precision.convert_output is FabricPrecision.convert_output
    assert FP8Precision.convert_module is FP8PrecisionCore.convert_module
    assert FP8Precision.state_dict is FP8PrecisionCore.state_dict


def test_only_the_fabric_plugin_refuses_fp8_optimizer_state():
    from lightning_fp8 import FP8Precision
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    with pytest.raises(ValueError, match=r"lightning_fp8.fabric.FP8Precision\(optimizer_state='fp8'\) is not supported"):
        FabricFP8Precision(optimizer_state="fp8")
    assert FP8Precision(optimizer_state="fp8").optimizer_state == "fp8"


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


def test_renamed_public_names_still_work_for_one_release():
    """Names users may have used before the rename (issue 45) keep working, each with a FutureWarning naming the new
    one: FP8LinearMeta, FP8Layer.update_scales / autoupdate_scales, FP8TrainingEngine.update_scales."""
    import torch

    from lightning_fp8 import FP8Linear, FP8Recipe, modules
    from lightning_fp8.engine import FP8TrainingEngine
    from lightning_fp8.modules.layer_state import FP8LayerState

    with pytest.warns(FutureWarning, match="FP8LayerState"):
        assert modules.FP8LinearMeta is FP8LayerState
    with pytest.warns(FutureWarning, match="FP8LayerState"):
        from lightning_fp8.modules.layer_state import FP8LinearMeta  # noqa: F401
    layer = FP8Linear(16, 16)
    layer.fp8_meta.amax_history[0, 0] = 3.0
    with pytest.warns(FutureWarning, match="close_scaling_step"):
        layer.update_scales()
    assert layer.fp8_meta.input.amax_history[1].item() == 3.0  # the step was closed: slot 0 moved into the history
    with pytest.warns(FutureWarning, match="closes_own_steps"):
        layer.autoupdate_scales = False
    assert layer.closes_own_steps is False
    engine = FP8TrainingEngine(FP8Recipe())
    engine.attach(torch.nn.Sequential(layer))
    layer.fp8_meta.amax_history[0, 0] = 5.0
    with pytest.warns(FutureWarning, match="close_scaling_step"):
        engine.update_scales()
    assert layer.fp8_meta.input.amax_history[1].item() == 5.0


#: the public surface (docs/api.md): the names a user imports, per public module; every other module is internal and
#: declares no __all__. A change here is an API change: update docs/api.md with it.
PUBLIC_API = {
    "lightning_fp8": ["FP8Recipe", "FP8Precision", "FP8Linear", "FP8Conv1d", "FP8Conv2d", "FP8Layer", "convert_to_fp8",
                      "revert_fp8", "precision_map", "fp8_layers", "fp8_state_dict", "load_fp8_state_dict",
                      "fp8_autocast", "FP8ScaleMonitor", "FP8LayerFallback", "FP8Calibration", "BatchNormRefresh",
                      "refresh_batchnorm", "FP8EmulationWarning",
                      "FP8DivergenceError"],
    "lightning_fp8.fabric": ["FP8Precision", "load_checkpoint"],
    "lightning_fp8.accelerate": ["FP8Accelerator", "FP8AcceleratorMixin", "FP8Kwargs", "FP8AcceleratedOptimizer",
                                 "enable_fp8", "main"],
    "lightning_fp8.litgpt": ["main", "fp8_fabrics"],
    "lightning_fp8.callbacks": ["FP8ScaleMonitor", "FP8LayerFallback", "FP8Calibration", "is_calibrating",
                                "BatchNormRefresh"],
    "lightning_fp8.optim": ["FP8AdamW", "state_bytes_per_param"],
    "lightning_fp8.distributed": ["FP8ColwiseParallel", "FP8RowwiseParallel", "PrepareFP8ModuleInput",
                                  "enable_fp8_all_gather", "precompute_fp8_weight_amaxes", "uses_fp8_all_gather",
                                  "fp8_all_gather_reason", "enable_fp8_reduce_scatter", "fp8_comm_hook",
                                  "bf16_comm_hook", "FP8CommState", "CommBytes"],
    "lightning_fp8.report": ["write_report", "main"],
    "lightning_fp8.conversion": ["register_linear_kind", "LinearKind", "ModuleFilter", "auto_filter", "AutoShapeFilter",
                                 "LayerPrecision", "conversion_summary"],
    "lightning_fp8.engine": ["FP8TrainingEngine", "StabilityConfig", "FP8DivergenceError"],
}


def test_the_public_surface_is_pinned_and_internals_declare_none():
    """One __all__ per public module, listing what a user calls (all of it importable), and none anywhere else: an
    internal module's names are not API."""
    import ast
    import importlib

    for module, names in PUBLIC_API.items():
        loaded = importlib.import_module(module)
        assert list(loaded.__all__) == names, module
        assert all(hasattr(loaded, name) for name in names), module
    public_files = {module.replace(".", "/") for module in PUBLIC_API}
    declaring = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "kernels").rglob("*.py")]):
        rel = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().removesuffix("/__init__")
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
               for node in tree.body) and rel not in public_files:
            declaring.append(rel)
    assert declaring == []
