"""Shape-aware auto filter: the speed model's decisions, the emulated (CPU) answer, and conversion with it."""
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, FP8Recipe, convert_to_fp8
from lightning_fp8.conversion.roofline import LayerShape, predict
from lightning_fp8.conversion.shape_filter import (
    EMULATED_REASON,
    GPUSpec,
    auto_filter,
    fp8_wins,
    resolve_spec,
    shape_skip_reason,
)


@pytest.mark.parametrize("gpu", ["H100", "H200"])
def test_large_shapes_win_small_lose(gpu):
    assert fp8_wins(16384, 4096, 14336, gpu)[0]
    assert fp8_wins(8192, 8192, 8192, gpu)[0]
    wins, reason = fp8_wins(4096, 1024, 1024, gpu)
    assert not wins and "kept in BF16" in reason and "4096x1024x1024" in reason
    assert not fp8_wins(256, 512, 512, gpu)[0]


def test_speedup_is_bounded_by_the_fp8_rate():
    spec = resolve_spec("H100")[0]
    speedup = predict(LayerShape(65536, 16384, 16384), FP8Recipe(), spec).speedup
    # FP8 can at most double the tensor-core rate; efficiencies make it smaller
    assert 1.0 < speedup < 2.0


def test_speedup_grows_with_tokens():
    spec = resolve_spec("H200")[0]
    ratios = [predict(LayerShape(m, 4096, 4096), FP8Recipe(), spec).speedup for m in (512, 2048, 8192, 32768)]
    assert ratios == sorted(ratios)


def test_min_speedup():
    assert fp8_wins(8192, 8192, 8192, "H100", min_speedup=1.1)[0]
    assert not fp8_wins(8192, 8192, 8192, "H100", min_speedup=3.0)[0]


def test_cpu_is_emulated_and_never_filtered():
    assert fp8_wins(64, 64, 64, "cpu") == (True, EMULATED_REASON)
    assert fp8_wins(64, 64, 64, torch.device("cpu")) == (True, EMULATED_REASON)
    if not torch.cuda.is_available():
        assert fp8_wins(64, 64, 64) == (True, EMULATED_REASON)


def test_unknown_gpu_name_keeps_fp8():
    wins, reason = fp8_wins(64, 64, 64, "Some Future GPU")
    assert wins and "no speed model" in reason


def test_custom_spec():
    spec = GPUSpec("toy", bf16_tflops=100.0, fp8_tflops=200.0, hbm_tbps=1.0)
    assert fp8_wins(16384, 8192, 8192, spec)[0]


def _model():
    return nn.Sequential(
        nn.Linear(4096, 14336),  # big: FP8
        nn.Linear(14336, 4096),  # big: FP8
        nn.Linear(4096, 64),  # small: BF16 on a GPU
        nn.Linear(64, 24),  # 24 is not a multiple of 16
    ).to("meta")


def test_auto_filter_on_a_gpu_spec_keeps_small_layers_in_bf16():
    filt = auto_filter(16384, device="H100")
    model = convert_to_fp8(_model(), module_filter=filt)
    assert isinstance(model[0], FP8Linear) and isinstance(model[1], FP8Linear)
    assert not isinstance(model[2], FP8Linear) and not isinstance(model[3], FP8Linear)
    assert filt.decisions["0"][0] and filt.decisions["1"][0]
    assert not filt.decisions["2"][0] and "kept in BF16" in filt.decisions["2"][1]
    assert "multiples of 16" in filt.decisions["3"][1]
    assert filt.skip_reason(nn.Linear(4096, 64, device="meta"), "x").startswith("kept in BF16")


def test_auto_filter_on_cpu_filters_nothing_but_alignment():
    filt = auto_filter(16384)  # the layers' own device: meta/cpu -> emulated
    model = convert_to_fp8(_model(), module_filter=filt)
    assert [isinstance(m, FP8Linear) for m in model] == [True, True, True, False]
    assert filt.decisions["2"] == (True, EMULATED_REASON)


def test_shape_skip_reason_convention():
    big = nn.Linear(4096, 4096, device="meta")
    assert shape_skip_reason(big, 16384, device="H100") is None
    assert shape_skip_reason(nn.Linear(1024, 1024, device="meta"), 512, device="H100").startswith("kept in BF16")
    assert shape_skip_reason(big, 16, device="cpu") is None


def test_bad_tokens():
    with pytest.raises(ValueError):
        auto_filter(0)
