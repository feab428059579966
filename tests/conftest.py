import warnings

import pytest
import torch

from lightning_fp8.modules.gemm import FP8EmulationWarning


@pytest.fixture(autouse=True)
def _quiet_and_seeded():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FP8EmulationWarning)
        yield


@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    """Accelerate's AcceleratorState / GradientState are process-wide singletons: a test that builds an Accelerator
    starts from none and leaves none behind."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def te_stand_in(monkeypatch):
    """A stand-in for the part of Transformer Engine's public API the TE backend uses (TE 2.x's names and signatures:
    `transformer_engine.pytorch.Linear(in_features, out_features, bias=True, params_dtype=None, device=None)`,
    `transformer_engine.pytorch.autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None)`,
    `transformer_engine.common.recipe.{Format, DelayedScaling, Float8CurrentScaling}`). TE needs CUDA to install, so
    its numerics are not here: the Linear computes in high precision and records whether te.autocast was on."""
    import enum
    import sys
    import types
    from dataclasses import dataclass

    import torch.nn.functional as F
    from torch import nn

    class Format(enum.Enum):
        E4M3 = "e4m3"
        E5M2 = "e5m2"
        HYBRID = "hybrid"

    @dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"

    @dataclass
    class Float8CurrentScaling:
        fp8_format: Format = Format.HYBRID

    state = {"enabled": False, "recipe": None}
    calls = []

    class _Autocast:
        def __init__(self, enabled, recipe):
            self.enabled, self.recipe = enabled, recipe

        def __enter__(self):
            self.saved = dict(state)
            state.update(enabled=self.enabled, recipe=self.recipe)

        def __exit__(self, *exc):
            state.update(self.saved)
            return False

    def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        return _Autocast(enabled, recipe)

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__()
            self.in_features, self.out_features = in_features, out_features
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device)) if bias else None
            nn.init.normal_(self.weight, std=0.02)

        def forward(self, x):
            calls.append((state["enabled"], state["recipe"]))
            return F.linear(x, self.weight, self.bias)

    Linear.__module__ = "transformer_engine.pytorch.module.linear"
    te_pkg, te_pt, te_common, te_recipe = (types.ModuleType(n) for n in (
        "transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
        "transformer_engine.common.recipe"))
    te_recipe.Format, te_recipe.DelayedScaling, te_recipe.Float8CurrentScaling = Format, DelayedScaling, Float8CurrentScaling
    te_pt.autocast, te_pt.Linear = autocast, Linear
    for name, mod in (("transformer_engine", te_pkg), ("transformer_engine.pytorch", te_pt),
                      ("transformer_engine.common", te_common), ("transformer_engine.common.recipe", te_recipe)):
        monkeypatch.setitem(sys.modules, name, mod)
    return types.SimpleNamespace(Linear=Linear, Format=Format, calls=calls, state=state)


@pytest.fixture
def auto_prefers_candidates(monkeypatch):
    """A roofline model that prices per-tensor scaling's step double, so that recipe="auto" takes the architecture's
    candidate (sm100: mxfp8). The real model predicts mxfp8 a hair slower than per-tensor scaling on B200 (and auto
    then keeps per-tensor scaling, tests/test_roofline.py); tests of what happens *after* auto chose another recipe
    (the summary, checkpoints, a resume on another GPU, a backend that cannot express it) use this one."""
    import dataclasses

    from lightning_fp8 import presets
    from lightning_fp8.conversion import roofline
    from lightning_fp8.recipe import FP8Recipe

    real_predict = roofline.predict

    def predict_reference_slower(shape, recipe, spec, launches=None, compiled=False):
        p = real_predict(shape, recipe, spec, launches, compiled)
        return dataclasses.replace(p, fp8_s=p.fp8_s * 2) if recipe == FP8Recipe() else p

    monkeypatch.setattr(roofline, "predict", predict_reference_slower)
    presets._decide.cache_clear()
    presets._modelled.cache_clear()
    yield
    presets._decide.cache_clear()
    presets._modelled.cache_clear()
