"""The roofline model (lightning_fp8/conversion/roofline.py) and the shape filter that uses it.

The model's numbers are predictions, so these tests check what the model is made of: the kernels it times are the
ones the layer launches (the launch budgets' instrument), each GEMM at its operand dtype's rate with its real FLOPs,
the ceilings that follow from the stated peaks, and that the filter acts on the prediction with the reason."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Recipe
from lightning_fp8.conversion.roofline import (
    LayerShape,
    bf16_launches,
    fp8_launches,
    kernel_seconds,
    predict,
    te_launches,
)
from lightning_fp8.conversion.shape_filter import GPUSpec, auto_filter, fp8_wins, spec_for_name
from lightning_fp8.kernels.trace import Launch
from lightning_fp8.modules.linear import FP8Linear

pytest.importorskip("triton")

H100, B200 = spec_for_name("H100"), spec_for_name("B200")
HEADLINE = LayerShape(16384, 4096, 14336)


def test_the_model_times_the_kernels_the_layer_launches():
    """The FP8 step is the recorded launch sequence of tests/test_launch_budget.py under the engine (no scale close
    of the layer's own, no delayed pre-pass); BF16 is nn.Linear's three GEMMs, at 2*M*K*N FLOPs each."""
    from test_launch_budget import EXPECTED_UNDER_ENGINE

    forward, backward = EXPECTED_UNDER_ENGINE["delayed"]
    names = [launch.name for launch in fp8_launches(LayerShape(8192, 4096, 4096), FP8Recipe(), (9, 0))]
    assert names == forward + backward
    bf16 = bf16_launches(HEADLINE)
    assert [launch.flops for launch in bf16] == [2 * 16384 * 4096 * 14336] * 3
    assert {launch.operand_dtype for launch in bf16} == {"bfloat16"}


def test_gemms_run_at_their_operand_dtypes_rate():
    fp8 = [launch for launch in fp8_launches(HEADLINE, FP8Recipe(), (9, 0)) if launch.is_gemm]
    assert len(fp8) == 3 and all(launch.operand_dtype.startswith("float8") for launch in fp8)
    assert all(launch.flops == 2 * 16384 * 4096 * 14336 for launch in fp8)
    # (the nvfp4 casts' random Hadamard transform is a float32 matmul of its own: a GEMM at the BF16 rate's tensor
    # cores in the model: optimistic, float32 runs at the TF32 rate at best)
    nvfp4 = [launch for launch in fp8_launches(HEADLINE, FP8Recipe(scaling="nvfp4"), (10, 0))
             if launch.name == "_scaled_mm_v2"]
    assert [launch.operand_dtype for launch in nvfp4] == ["float4_e2m1fn_x2"] * 3
    # packed FP4 holds two elements per byte along K: the FLOPs count the elements
    assert all(launch.flops == 2 * 16384 * 4096 * 14336 for launch in nvfp4)
    gemm = nvfp4[0]
    assert kernel_seconds(gemm, B200) == pytest.approx(gemm.flops / (9000e12 * B200.fp8_efficiency))
    with pytest.raises(ValueError, match="no float4_e2m1fn_x2 tensor-core rate"):
        kernel_seconds(gemm, H100)


def test_tiny_kernels_cost_the_minimum_kernel_time_and_eager_steps_their_launches():
    tiny = Launch("triton", "amax", 4, 4)
    assert kernel_seconds(tiny, H100) == pytest.approx(2e-6)
    small = LayerShape(256, 512, 512)
    prediction = predict(small, FP8Recipe(), H100)
    assert prediction.fp8_s == pytest.approx(len(prediction.kernels) * H100.launch_s)  # launch-bound
    assert prediction.bf16_s == pytest.approx(3 * H100.launch_s)


def test_per_tensor_speedup_is_below_the_gemm_ceiling_the_efficiencies_set():
    """With FP8 GEMMs assumed at 0.65 of a doubled peak and BF16 at 0.80, no per-tensor step can beat
    2 x 0.65 / 0.80 = 1.63x; the casts take the rest (benchmarks/results/roofline.md names them)."""
    ceiling = 2 * H100.fp8_efficiency / H100.bf16_efficiency
    for recipe in (FP8Recipe(), FP8Recipe(scaling="current"), FP8Recipe(scaling="blockwise", format="e4m3")):
        speedup = predict(HEADLINE, recipe, H100).speedup
        assert 1.3 < speedup < ceiling


def test_transformer_engines_structure_has_one_cast_per_operand_and_three_gemms():
    delayed = te_launches(HEADLINE, FP8Recipe())
    assert [launch.name for launch in delayed] == ["cast_transpose"] * 3 + ["gemm"] * 3
    current = te_launches(HEADLINE, FP8Recipe(scaling="current"))
    assert [launch.name for launch in current].count("amax") == 3
    # ours differs from it by the backward's weight re-cast and the delayed pre-passes: within 5% at this shape
    ours, te = predict(HEADLINE, FP8Recipe(), H100), predict(HEADLINE, FP8Recipe(), H100, delayed)
    assert te.fp8_s <= ours.fp8_s < 1.05 * te.fp8_s


def test_a_recipe_the_gpu_emulates_is_predicted_slower_and_kept_in_bf16():
    """Blockwise GEMMs run natively on sm90 only: on a B200 the recorded step holds the emulated GEMM (dequantize
    and a BF16 matmul), which the model prices, and the filter keeps the layer in BF16 saying why."""
    recipe = FP8Recipe(scaling="blockwise", format="e4m3")
    names = [launch.name for launch in fp8_launches(HEADLINE, recipe, (10, 0))]
    assert "mm" in names and "_scaled_mm_v2" not in names
    wins, reason = fp8_wins(16384, 4096, 14336, "B200", recipe=recipe)
    assert not wins
    assert "kept in BF16" in reason and "blockwise scaling" in reason and "roofline model" in reason
    assert fp8_wins(16384, 4096, 14336, "H100", recipe=recipe)[0]


def test_the_auto_filter_passes_its_recipe_to_the_model():
    model = nn.Sequential(nn.Linear(4096, 14336), nn.Linear(14336, 4096)).to("meta")
    keep_all = auto_filter(16384, device="B200", recipe=FP8Recipe(scaling="blockwise", format="e4m3"))
    convert_all = auto_filter(16384, device="B200")
    assert [keep_all(module, name) for name, module in model.named_children()] == [False, False]
    assert [convert_all(module, name) for name, module in model.named_children()] == [True, True]
    assert "blockwise scaling" in keep_all.decisions["0"][1]


def test_a_spec_without_a_capability_defaults_to_hopper():
    spec = GPUSpec("custom", bf16_tflops=500.0, fp8_tflops=1000.0, hbm_tbps=2.0)
    assert spec.capability == (9, 0)
    assert fp8_wins(16384, 8192, 8192, spec)[0]


def test_conversion_of_a_real_module_is_unchanged_by_recording_it():
    """The model records on meta tensors under a simulated GPU: nothing of it leaks into later real layers."""
    fp8_launches(LayerShape(64, 128, 128), FP8Recipe(), (9, 0))
    layer = FP8Linear.from_linear(nn.Linear(32, 32), FP8Recipe())
    out = layer(torch.randn(16, 32))
    assert out.device.type == "cpu" and torch.isfinite(out).all()


def test_the_filter_works_inside_a_simulation_of_the_same_gpu_and_says_why_not_inside_another():
    """The model records under `simulate_cuda`, which does not nest: converting a model inside a simulation (as the
    contract suite does) records under that one, and a simulation of another GPU is refused with the reason."""
    from lightning_fp8.conversion.roofline import fp8_launches
    from lightning_fp8.kernels.device import simulate_cuda

    shape = LayerShape(4096, 1024, 3072)
    fp8_launches.cache_clear()
    with simulate_cuda((9, 0)):
        assert fp8_wins(4096, 1024, 3072, "H100")[1].startswith("FP8 faster")
        fp8_launches.cache_clear()
        with pytest.raises(RuntimeError, match="inside a simulation of"):
            fp8_launches(shape, FP8Recipe(), (10, 0))


# -- recipe="auto" consults the model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "no_triton"])
@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0), (12, 1)], ids=lambda c: f"sm{c[0]}{c[1]}")
def test_auto_recipe_picks_nothing_the_model_predicts_slower_than_per_tensor_scaling(capability, triton):
    """recipe="auto" on a simulated Blackwell (sm100 / sm103, sm120 / sm121) with and without the Triton casts: the
    recipe it picks is predicted by the roofline model (on the family's GPU, at presets.REFERENCE_SHAPE) no slower
    than per-tensor delayed scaling, and, with the Triton casts a GPU machine runs, faster than BF16; the reason names
    the model's figures (each candidate's and per-tensor's speedup, the shape, the GPU)."""
    from lightning_fp8.conversion.shape_filter import spec_for_capability
    from lightning_fp8.kernels.device import simulate_cuda
    from lightning_fp8.presets import REFERENCE_SHAPE, auto_recipe, candidates

    spec = spec_for_capability(capability)
    shape = LayerShape(*REFERENCE_SHAPE)
    with simulate_cuda(capability, triton=triton):
        choice = auto_recipe()
        speedups = {name: predict(shape, recipe, spec).speedup
                    for name, recipe in (("per-tensor delayed", FP8Recipe()),) + candidates(capability[0])}
        chosen = predict(shape, choice.recipe, spec).speedup
    assert chosen >= speedups["per-tensor delayed"], (choice, speedups)
    if triton:
        assert chosen > 1.0, (choice, speedups)
    for name, speedup in speedups.items():
        assert f"{name} {speedup:.2f}x" in choice.reason or f"{name} predicted {speedup:.2f}x" in choice.reason or (
            f"{name} scaling: predicted {speedup:.2f}x" in choice.reason), (name, choice.reason)
    assert f"16384x4096x14336 on {spec.name}" in choice.reason and "roofline model" in choice.reason


def test_auto_recipe_takes_a_candidate_the_model_predicts_no_slower(auto_prefers_candidates):
    """The other branch of the decision: where the model predicts the architecture's candidate at least as fast as
    per-tensor scaling (here a model that prices per-tensor scaling's step double: tests/conftest.py), auto takes it
    and says so with both figures."""
    from lightning_fp8 import presets
    from lightning_fp8.kernels.device import simulate_cuda

    with simulate_cuda((10, 0)):
        choice = presets.auto_recipe()
    assert choice.recipe == FP8Recipe(scaling="mxfp8"), choice
    assert choice.reason.startswith("mxfp8 predicted") and "vs per-tensor delayed" in choice.reason


def test_auto_recipe_is_decided_once_per_capability():
    """auto runs at plugin construction: the model is consulted once per (capability, triton, GPU) and cached."""
    import time

    from lightning_fp8.kernels.device import simulate_cuda
    from lightning_fp8.presets import auto_recipe

    with simulate_cuda((10, 0)):
        first = auto_recipe()
        start = time.perf_counter()
        for _ in range(100):
            assert auto_recipe() == first
        assert time.perf_counter() - start < 0.5
