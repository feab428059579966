"""The Transformer Engine backend: FP8Precision(backend="transformer_engine") / FP8Kwargs(backend="transformer_engine")
convert with te.Linear, run every step under te.autocast with the recipe mapped from ours, and keep loss scaling, skip
and rollback on top.

The recipe mapping is tested against Transformer Engine's own recipe classes (TE 2.20.2's
`transformer_engine.common.recipe`, a byte-exact copy loaded under a private name: tests/support/te_source.py), and
the calls into te.autocast / te.Linear against TE 2.20.2's signatures, through a stand-in that computes in high
precision (TE's layers need CUDA). What only a GPU with TE can confirm is the `cuda` test at the end
(docs/backends.md)."""
import dataclasses
import pickle

import lightning as L
import pytest
import torch
from torch import nn

from support.helpers import RegressionModule, loader, mlp, trainer
from support.te_source import (DATA_DIR, TE_VERSION, load_api_excerpts, load_recipe_module, pytorch_stand_in,
                               record_hash, recorded_hashes)
from lightning_fp8 import FP8Precision, FP8Recipe, fp8_layers, precision_map
from lightning_fp8.backends import te_recipes
from lightning_fp8.backends import transformer_engine as te_backend
from lightning_fp8.backends.te_recipes import power_of_2_delayed_scale, te_recipe_from
from lightning_fp8.recipe import TorchTooOldError


def _recipe(**kwargs) -> FP8Recipe:
    try:
        return FP8Recipe(**kwargs)
    except TorchTooOldError as err:  # mxfp8 / nvfp4 on an old torch: the recipe itself does not exist there
        pytest.skip(str(err))


@pytest.fixture
def te():
    """TE 2.20.2's transformer_engine.common.recipe (the real classes), loaded under a private module name."""
    return load_recipe_module()


@pytest.fixture
def te_on_cpu(monkeypatch, te):
    """The backend's two imports of Transformer Engine answered without `transformer_engine` in sys.modules: the
    recipe module is TE's own, transformer_engine.pytorch a stand-in with TE's signatures (support/te_source.py)."""
    stand_in = pytorch_stand_in(te)
    monkeypatch.setattr(te_backend, "_te", lambda: stand_in.pytorch)
    monkeypatch.setattr(te_backend, "_te_recipe_module", lambda: te)
    stand_in.recipes = te
    return stand_in


# -- the copies are TE 2.20.2's -------------------------------------------------------------------------------------
def test_the_copies_are_the_pinned_release():
    recorded = recorded_hashes()
    assert record_hash(DATA_DIR / "recipe.py") == recorded["transformer_engine/common/recipe/__init__.py"]
    assert record_hash(DATA_DIR / "LICENSE") == recorded[f"transformer_engine-{TE_VERSION}.dist-info/licenses/LICENSE"]
    assert te_recipes.TESTED_TE_VERSION == TE_VERSION and f"Transformer Engine {TE_VERSION}" in (
        DATA_DIR / "NOTICE").read_text()


# -- every recipe: TE's real recipe object with the right fields, or refused by name ----------------------------------
def _fields(obj):
    """A TE recipe's fields and the quantization parameters TE reads from it, with enums by name and the MMParams /
    QParams as plain dicts (comparable across two loads of TE's module)."""
    def plain(v):
        if hasattr(v, "name") and hasattr(v, "value"):
            return v.name
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return v

    values = {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad", "fp4_quant_fwd_inp",
                 "fp4_quant_fwd_weight", "fp4_quant_bwd_grad"):
        if hasattr(obj, name):
            values[name] = plain(getattr(obj, name))
    return type(obj).__name__, values


def _qparams(power_2_scale=False, random_hadamard_transform=False, stochastic_rounding=False,
             fp4_2d_quantization=False):
    return {"power_2_scale": power_2_scale, "amax_epsilon": 0.0, "random_hadamard_transform": random_hadamard_transform,
            "stochastic_rounding": stochastic_rounding, "fp4_2d_quantization": fp4_2d_quantization}


_NO_ATTENTION = {"fp8_dpa": False, "fp8_mha": False, "backward_override": None}
_SPLIT = {"use_split_accumulator": True}
_FAST = {"use_split_accumulator": False}

# (FP8Recipe arguments, TE class, the fields and quantization parameters TE's object must hold)
MAPPINGS = [
    ({}, "DelayedScaling", {
        "margin": 0, "fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max",
        "scaling_factor_compute_algo": power_of_2_delayed_scale, "reduce_amax": True, **_NO_ATTENTION}),
    ({"format": "e4m3", "margin": 2, "amax_history_len": 8, "amax_compute_algo": "most_recent",
      "power_of_2_scales": False}, "DelayedScaling", {
        "margin": 2, "fp8_format": "E4M3", "amax_history_len": 8, "amax_compute_algo": "most_recent",
        "scaling_factor_compute_algo": None, "reduce_amax": True, **_NO_ATTENTION}),
    ({"scaling": "current"}, "Float8CurrentScaling", {
        "use_power_2_scales": True, "fp8_format": "HYBRID", "fp8_gemm_fprop": _FAST, "fp8_gemm_dgrad": _SPLIT,
        "fp8_gemm_wgrad": _SPLIT, **_NO_ATTENTION, "fp8_quant_fwd_inp": _qparams(True),
        "fp8_quant_fwd_weight": _qparams(True), "fp8_quant_bwd_grad": _qparams(True)}),
    ({"scaling": "current", "format": "e4m3", "power_of_2_scales": False, "fast_accum_forward": False},
     "Float8CurrentScaling", {
        "use_power_2_scales": False, "fp8_format": "E4M3", "fp8_gemm_fprop": _SPLIT, "fp8_gemm_dgrad": _SPLIT,
        "fp8_gemm_wgrad": _SPLIT, **_NO_ATTENTION, "fp8_quant_fwd_inp": _qparams(),
        "fp8_quant_fwd_weight": _qparams(), "fp8_quant_bwd_grad": _qparams()}),
    ({"scaling": "blockwise"}, "Float8BlockScaling", {
        "use_f32_scales": False, "fp8_format": "E4M3", "x_block_scaling_dim": 1, "w_block_scaling_dim": 2,
        "grad_block_scaling_dim": 1, "fp8_gemm_fprop": _SPLIT, "fp8_gemm_dgrad": _SPLIT, "fp8_gemm_wgrad": _SPLIT,
        **_NO_ATTENTION, "fp8_quant_fwd_inp": _qparams(True), "fp8_quant_fwd_weight": _qparams(True),
        "fp8_quant_bwd_grad": _qparams(True)}),
    ({"scaling": "blockwise", "format": "hybrid", "power_of_2_scales": False}, "Float8BlockScaling", {
        "use_f32_scales": True, "fp8_format": "HYBRID", "x_block_scaling_dim": 1, "w_block_scaling_dim": 2,
        "grad_block_scaling_dim": 1, "fp8_gemm_fprop": _SPLIT, "fp8_gemm_dgrad": _SPLIT, "fp8_gemm_wgrad": _SPLIT,
        **_NO_ATTENTION, "fp8_quant_fwd_inp": _qparams(), "fp8_quant_fwd_weight": _qparams(),
        "fp8_quant_bwd_grad": _qparams()}),
    ({"scaling": "mxfp8"}, "MXFP8BlockScaling", {
        "margin": 0, "fp8_format": "E4M3", **_NO_ATTENTION, "enable_2d_quantization": False}),
    # nvfp4's defaults: stochastic rounding of the gradients only, the random Hadamard transform on the weight-gradient
    # GEMM's operands (TE applies it to the column-wise copies of the input and the gradient, which that GEMM reads),
    # 16 x 16 weight blocks; TE derives its per-tensor quantization parameters from the fields in __post_init__
    ({"scaling": "nvfp4"}, "NVFP4BlockScaling", {
        "disable_rht": False, "disable_stochastic_rounding": False, "disable_2d_quantization": False,
        "row_scaled_activation": False, "nvfp4_4over6": "none", "nvfp4_4over6_e4m3_use_256": "all",
        "nvfp4_4over6_err_mode": "MAE", "fp4_format": "E2M1", "fp8_format": "E4M3", **_NO_ATTENTION,
        "fp4_quant_fwd_inp": _qparams(random_hadamard_transform=True),
        "fp4_quant_fwd_weight": _qparams(fp4_2d_quantization=True),
        "fp4_quant_bwd_grad": _qparams(random_hadamard_transform=True, stochastic_rounding=True)}),
    ({"scaling": "nvfp4", "rounding": "nearest", "random_hadamard": False}, "NVFP4BlockScaling", {
        "disable_rht": True, "disable_stochastic_rounding": True, "disable_2d_quantization": False,
        "row_scaled_activation": False, "nvfp4_4over6": "none", "nvfp4_4over6_e4m3_use_256": "all",
        "nvfp4_4over6_err_mode": "MAE", "fp4_format": "E2M1", "fp8_format": "E4M3", **_NO_ATTENTION,
        "fp4_quant_fwd_inp": _qparams(), "fp4_quant_fwd_weight": _qparams(fp4_2d_quantization=True),
        "fp4_quant_bwd_grad": _qparams()}),
]


@pytest.mark.parametrize("kwargs,te_class,expected", MAPPINGS, ids=[
    "delayed", "delayed-e4m3-margin-history-exact", "current", "current-e4m3-exact-split", "blockwise",
    "blockwise-hybrid-fp32-scales", "mxfp8", "nvfp4", "nvfp4-nearest-no-rht"])
def test_every_recipe_builds_te_s_own_recipe_with_the_right_fields(te, kwargs, te_class, expected):
    built = te_recipe_from(_recipe(**kwargs), te)
    assert type(built) is getattr(te, te_class)
    assert _fields(built) == (te_class, expected)


REFUSALS = [  # (FP8Recipe arguments, the fields named with their values, the valid choices given for the first)
    ({"scaling": "rowwise"}, ["scaling='rowwise'"], "['delayed', 'current', 'blockwise', 'mxfp8', 'nvfp4']"),
    ({"format": "e5m2"}, ["format='e5m2'"], "['hybrid', 'e4m3']"),
    ({"scaling": "blockwise", "format": "e5m2"}, ["format='e5m2'"], "['hybrid', 'e4m3']"),
    ({"rounding": "stochastic"}, ["rounding='stochastic'"], "['nearest'] with scaling='delayed'"),
    ({"scaling": "mxfp8", "rounding": "stochastic"}, ["rounding='stochastic'"], "['nearest'] with scaling='mxfp8'"),
    ({"scaling": "current", "margin": 1}, ["margin=1"], "[0] with scaling='current', or scaling='delayed'"),
    ({"scaling": "blockwise", "margin": 2}, ["margin=2"], "[0] with scaling='blockwise', or scaling='delayed'"),
    ({"scaling": "blockwise", "block_size": 64}, ["block_size=64"], "[128]"),
    ({"fast_accum_forward": False}, ["fast_accum_forward=False"], "[True] with scaling='delayed', or scaling='current'"),
    ({"weight_grad": "high_precision"}, ["weight_grad='high_precision'"], "['quantized']"),
    ({"scaling": "nvfp4", "weight_grad": "high_precision"}, ["weight_grad='high_precision'"], "['quantized']"),
    ({"backend": "emulated"}, ["backend='emulated'"], "['auto', 'scaled_mm']"),
    ({"backend": "h100"}, ["backend='h100'"], "['auto', 'scaled_mm']"),  # a GPU's bits computed anywhere: emulated too
    # the mellempudi preset: three fields at once, each named
    ({"format": "e5m2", "scaling": "current", "rounding": "stochastic", "scale_gradients": False},
     ["format='e5m2'", "rounding='stochastic'", "scale_gradients=False"], "['hybrid', 'e4m3']"),
]


@pytest.mark.parametrize("kwargs,named,valid", REFUSALS, ids=[
    "rowwise", "e5m2", "blockwise-e5m2", "stochastic", "mxfp8-stochastic", "current-margin", "blockwise-margin",
    "block-size", "delayed-exact-accumulation", "wgrad-bf16", "nvfp4-wgrad-bf16", "emulated", "h100-model",
    "mellempudi"])
def test_what_te_cannot_express_is_refused_naming_the_field_and_the_valid_choices(te, kwargs, named, valid):
    with pytest.raises(ValueError) as raised:
        te_recipe_from(_recipe(**kwargs), te)
    message = str(raised.value)
    assert message.startswith(f"the Transformer Engine backend cannot express {named[0]} (")
    assert all(field in message for field in named) and f"valid choices: {valid})" in message
    assert "use backend='lightning_fp8'" in message


def test_every_fp8recipe_field_has_its_te_mapping_said():
    """A new FP8Recipe field fails here until te_recipes.FIELD_MAPPING (and docs/backends.md) says what TE does
    with it."""
    assert set(te_recipes.FIELD_MAPPING) == {f.name for f in dataclasses.fields(FP8Recipe)}


def test_te_s_environment_variables_do_not_change_the_recipe_built(te):
    """TE reads NVTE_* variables for some defaults: the mapping passes those fields itself."""
    environ = {"NVTE_BACKWARD_OVERRIDE": "dequantized", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1",
               "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1", "NVTE_NVFP4_DISABLE_RHT": "1",
               "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "1",
               "NVTE_NVFP4_4OVER6": "all"}
    te_env = load_recipe_module(environ)
    defaults = te_env.NVFP4BlockScaling()
    assert defaults.backward_override == "dequantized" and defaults.disable_rht and defaults.nvfp4_4over6 == "all"
    assert te_env.Float8BlockScaling().fp8_quant_fwd_inp.power_2_scale is False  # the variables act on TE's defaults
    for kwargs, _, _ in MAPPINGS:
        recipe = _recipe(**kwargs)
        assert _fields(te_recipe_from(recipe, te_env)) == _fields(te_recipe_from(recipe, te))


def test_the_same_fp8recipe_builds_equal_te_recipes_that_pickle(te):
    """TE sets a layer's FP8 state up again when the recipe in autocast does not compare equal to its last one, and
    pickles the recipe into its checkpoints (module/base.py in TE)."""
    for kwargs, _, _ in MAPPINGS:
        recipe = _recipe(**kwargs)
        first, second = te_recipe_from(recipe, te), te_recipe_from(recipe, te)
        assert first == second and pickle.loads(pickle.dumps(first)) == first


def test_an_older_te_without_a_recipe_class_or_field_is_said_by_name(te):
    import types

    older = types.SimpleNamespace(**{k: v for k, v in vars(te).items() if k != "NVFP4BlockScaling"})
    with pytest.raises(ValueError, match=r"cannot express scaling='nvfp4' with the installed Transformer Engine: it "
                                         r"has no NVFP4BlockScaling recipe \(.*tested against Transformer Engine 2.20.2\)"):
        te_recipe_from(_recipe(scaling="nvfp4"), older)

    @te.dataclass(repr=False)
    class DelayedScaling(te.Recipe):  # TE's recipe before scaling_factor_compute_algo (and the rest) existed
        margin: int = 0
        fp8_format: te.Format = te.Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"

    older.DelayedScaling = DelayedScaling
    with pytest.raises(ValueError, match="its DelayedScaling takes no scaling_factor_compute_algo"):
        te_recipe_from(FP8Recipe(), older)
    exact = te_recipe_from(FP8Recipe(power_of_2_scales=False, margin=1), older)  # TE's own scale rule: expressible
    assert type(exact) is DelayedScaling and (exact.margin, exact.amax_history_len) == (1, 16)


def test_power_of_2_scales_run_through_te_s_own_delayed_scale_update(te):
    """TE's `_compute_scaling_factor` (quantization.py) calls the recipe's scaling_factor_compute_algo: with
    FP8Recipe(power_of_2_scales=True) the new scale is TE's own (power_of_2_scales=False) rounded down to a power of
    two, and where the amax is 0, inf or NaN both keep the previous scale."""
    api = load_api_excerpts()
    amax = torch.tensor([3.0, 1e-3, 672.0, 1e-40, 0.0, float("inf"), float("nan")])
    previous = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    exact = api._compute_scaling_factor(amax, previous.clone(), 448.0, te_recipe_from(
        FP8Recipe(margin=1, power_of_2_scales=False), te))
    power_of_2 = api._compute_scaling_factor(amax, previous.clone(), 448.0, te_recipe_from(FP8Recipe(margin=1), te))
    usable = slice(0, 4)
    mantissa, _ = torch.frexp(power_of_2[usable])
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.all((power_of_2[usable] <= exact[usable]) & (exact[usable] < 2 * power_of_2[usable]))
    assert power_of_2[3] == 2.0**127  # 448 / 1e-40 overflows float32: TE takes float32's max, rounded down here
    assert torch.equal(power_of_2[4:], previous[4:]) and torch.equal(exact[4:], previous[4:])


# -- the calls into transformer_engine.pytorch, against TE 2.20.2's signatures ------------------------------------
def test_te_autocast_and_convert_to_te_call_te_with_its_signatures(te_on_cpu):
    import inspect

    api = load_api_excerpts()
    assert inspect.signature(te_on_cpu.autocast) == inspect.signature(api.autocast)
    assert inspect.signature(te_on_cpu.Linear) == inspect.signature(api.Linear)
    with te_backend.te_autocast(FP8Recipe(scaling="current")):
        assert te_on_cpu.state["enabled"] and type(te_on_cpu.state["recipe"]) is te_on_cpu.recipes.Float8CurrentScaling
    assert not te_on_cpu.state["enabled"]
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    weight = model[0].weight
    te_backend.convert_to_te(model)
    assert isinstance(model[0], te_on_cpu.Linear) and model[0].weight is weight
    assert type(model[2]) is nn.Linear  # 10 output features: not 16-aligned, left alone

    # TE releases with fp8_autocast(fp8_recipe=...) only: the same call through TE 2.20.2's fp8_autocast signature
    entered = []

    def fp8_autocast(*args, **kwargs):
        bound = inspect.signature(api.fp8_autocast).bind(*args, **kwargs)
        entered.append(bound.arguments)
        return te_on_cpu.autocast(enabled=bound.arguments["enabled"], recipe=bound.arguments["fp8_recipe"])

    del te_on_cpu.pytorch.autocast
    te_on_cpu.pytorch.fp8_autocast = fp8_autocast
    with te_backend.te_autocast(FP8Recipe(), enabled=False):
        pass
    assert entered[0]["enabled"] is False and type(entered[0]["fp8_recipe"]) is te_on_cpu.recipes.DelayedScaling


# -- the plugins ----------------------------------------------------------------------------------------------------
def test_lightning_plugin_runs_te_layers_under_te_autocast_with_our_loss_scaling(te_on_cpu):
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
    assert isinstance(model.net[2], te_on_cpu.Linear) and isinstance(model.net[4], te_on_cpu.Linear)
    assert model.net[2].weight is first_weight  # the same Parameter: optimizers built before conversion stay valid
    assert type(model.net[0]) is nn.Linear and type(model.net[6]) is nn.Linear  # first and last: the default filter
    assert not fp8_layers(model)
    rows = {r.fqn: r for r in precision_map(model)}
    assert rows["net.2"].precision == "fp8" and "Transformer Engine" in rows["net.2"].reason
    assert "first linear layer" in rows["net.0"].reason
    training_calls = te_on_cpu.calls[:8]
    assert all(enabled for enabled, _ in training_calls)  # every training forward inside te.autocast
    recipe = training_calls[0][1]
    assert type(recipe) is te_on_cpu.recipes.DelayedScaling
    assert (recipe.margin, recipe.amax_history_len, recipe.fp8_format) == (1, 8, te_on_cpu.recipes.Format.HYBRID)
    assert recipe.scaling_factor_compute_algo is power_of_2_delayed_scale
    assert poisoned and plugin.skipped_steps == 1 and plugin.loss_scale == 2.0**7
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fabric_and_accelerate_take_the_same_backend(te_on_cpu, fresh_accelerate_state):
    from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(
        FP8Recipe(scaling="blockwise"), backend="transformer_engine", fp8_eval=False)])
    model = mlp()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = next(iter(loader()))
    fabric.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    model.eval()
    model(x)
    assert [enabled for enabled, _ in te_on_cpu.calls] == [True, True, False, False]  # fp8_eval=False: eval in BF16
    assert type(te_on_cpu.calls[0][1]) is te_on_cpu.recipes.Float8BlockScaling

    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(backend="transformer_engine")])
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    assert sum(isinstance(m, te_on_cpu.Linear) for m in model.modules()) == 2 and te_on_cpu.calls[-1][0]
    assert type(te_on_cpu.calls[-1][1]) is te_on_cpu.recipes.DelayedScaling


def test_te_backend_errors_are_said_at_construction(te_on_cpu):
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
    for call in (lambda: te_backend.convert_to_te(nn.Sequential(nn.Linear(16, 16))),
                 lambda: te_backend.te_recipe(FP8Recipe()),
                 lambda: te_backend.te_autocast(FP8Recipe()).__enter__()):
        with pytest.raises(ImportError, match="Transformer Engine is not installed.*pip install"):
            call()


def test_auto_recipe_maps_to_te_and_an_older_te_is_said_with_auto_s_choice(te_on_cpu, auto_prefers_candidates,
                                                                           monkeypatch):
    """recipe='auto' on sm100 chooses mxfp8 (where the model prefers it): TE's MXFP8BlockScaling. A TE without that
    class: the error says that 'auto' chose it, on which device, and what to pass instead."""
    import types

    from lightning_fp8.kernels.device import simulate_cuda

    with simulate_cuda((10, 0)):
        plugin = FP8Precision(recipe="auto", backend="transformer_engine")
    assert type(te_backend.te_recipe(plugin.recipe)) is te_on_cpu.recipes.MXFP8BlockScaling
    older = types.SimpleNamespace(**{k: v for k, v in vars(te_on_cpu.recipes).items() if k != "MXFP8BlockScaling"})
    monkeypatch.setattr(te_backend, "_te_recipe_module", lambda: older)
    with simulate_cuda((10, 0)), pytest.raises(ValueError) as raised:
        FP8Precision(recipe="auto", backend="transformer_engine")
    message = str(raised.value)
    assert "recipe='auto' chose mxfp8 on sm100" in message and "has no MXFP8BlockScaling recipe" in message
    assert "pass a recipe" in message
    with simulate_cuda((9, 0)):
        FP8Precision(recipe="auto", backend="transformer_engine")  # per-tensor delayed: TE expresses it


# -- on a GPU with Transformer Engine installed -----------------------------------------------------------------------
@pytest.mark.cuda
def test_te_runs_every_mapped_recipe_the_gpu_takes_and_quantizes_current_scaling_as_we_do():
    """Real TE on a GPU: te.autocast accepts each mapped recipe the GPU supports (TE checks it on entry), te.Linear
    trains on the original Parameters, and under current scaling with exact accumulation TE's forward equals
    lightning_fp8's FP8Linear up to accumulation order and BF16 rounding (the same FP8 operands, if the mapping of
    power_of_2_scales is right)."""
    if not torch.cuda.is_available() or not te_backend.te_available():
        pytest.skip("needs a CUDA GPU with Transformer Engine installed")
    import transformer_engine.pytorch as te_pt

    from lightning_fp8 import convert_to_fp8

    available = {"delayed": te_pt.is_fp8_available(), "current": te_pt.is_fp8_available(),
                 "blockwise": te_pt.is_fp8_block_scaling_available(), "mxfp8": te_pt.is_mxfp8_available(),
                 "nvfp4": te_pt.is_nvfp4_available()}
    ran = []
    for kwargs, _, _ in MAPPINGS:
        recipe = _recipe(**kwargs)
        if not available[recipe.scaling]:
            continue
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.GELU(), nn.Linear(256, 256, bias=False)).cuda()
        weights = [layer.weight for layer in (model[0], model[2])]
        te_backend.convert_to_te(model, recipe)
        x = torch.randn(128, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16), te_backend.te_autocast(recipe):
            model(x).float().square().mean().backward()
        assert [model[0].weight, model[2].weight] == weights
        assert all(w.grad is not None and torch.isfinite(w.grad).all() for w in weights)
        ran.append(recipe.scaling)
    assert ran, "the GPU takes none of the mapped recipes"

    recipe = FP8Recipe(scaling="current", fast_accum_forward=False, keep_first_last_in_bf16=False)
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(256, 256, bias=False)).cuda()
    theirs = nn.Sequential(nn.Linear(256, 256, bias=False)).cuda()
    with torch.no_grad():  # values BF16 holds exactly: a cast through BF16 first (either library's) changes nothing
        ours[0].weight.copy_(ours[0].weight.bfloat16().float())
    theirs[0].weight = nn.Parameter(ours[0].weight.detach().clone())
    convert_to_fp8(ours, recipe)
    te_backend.convert_to_te(theirs, recipe)
    x = torch.randn(128, 256, device="cuda").bfloat16().float()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        from lightning_fp8 import fp8_autocast

        with fp8_autocast():
            y_ours = ours(x).float()
        with te_backend.te_autocast(recipe):
            y_theirs = theirs(x).float()
    # the same FP8 operands, accumulated in float32 in two orders (K u each, u = 2**-24, bounded with |x| |W|^T
    # doubled for the operands' rounding), each result rounded to BF16 once (half an ulp: 2**-9 relative)
    magnitude = 2 * (x.abs() @ ours[0].weight.detach().abs().t())
    bound = 2.0**-9 * (y_ours.abs() + y_theirs.abs()) + 2 * 256 * 2.0**-24 * magnitude
    assert torch.all((y_ours - y_theirs).abs() <= bound)
