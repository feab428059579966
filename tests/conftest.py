import logging
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


@pytest.fixture(autouse=True)
def _lightning_logs_reach_caplog(monkeypatch):
    """Lightning's "lightning.fabric" / "lightning.pytorch" loggers stop propagating to the root logger when they are
    first imported while the root has no handler (outside pytest's capture, e.g. by an earlier test's import in the
    same worker): `caplog` then misses what the Fabric plugin logs through Lightning's rank_zero_info, and a test
    reading it passes or fails by test order. Every test sees them propagate."""
    for name in ("lightning.fabric", "lightning.pytorch"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
    yield


@pytest.fixture(autouse=True)
def _rank_zero_in_this_process(monkeypatch):
    """Lightning's strategies set the process-wide `rank_zero_only.rank` to their global rank at setup and never set
    it back: a test that sets up a strategy of another rank in this worker would silence every rank_zero_info /
    rank_zero_warn of the tests after it. Every test starts as rank 0 (the rank the single test process is)."""
    import sys

    for name in ("lightning.fabric.utilities.rank_zero", "lightning_utilities.core.rank_zero"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module.rank_zero_only, "rank"):
            monkeypatch.setattr(module.rank_zero_only, "rank", 0)
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
