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


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - approx|)."""
    ref = ref.double()
    noise = (ref - approx.double()).norm()
    return float(20 * torch.log10(ref.norm() / noise))
