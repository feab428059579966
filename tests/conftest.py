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


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - approx|)."""
    ref = ref.double()
    noise = (ref - approx.double()).norm()
    return float(20 * torch.log10(ref.norm() / noise))
