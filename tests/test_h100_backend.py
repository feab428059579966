"""FP8Recipe(backend="h100") / "rtx4060": the bits an H100 PCIe / RTX 4060 returns for the calls the GPU path plans
(lightning_fp8/modules/gpu_model.py), computed by mmaemu on the CPU.

The reference each test compares with is the GPU path itself: a simulated sm90 (sm89) runs the real planning and the
real `ScaledMMCall.launch`, with `torch._scaled_mm` answered by mmaemu's model of that GPU's `torch._scaled_mm`, so
"what the backend computes" is checked against "what the GPU path would return on that GPU". Shapes are small
(mmaemu's model computes in float64, ~10^7 products a second here).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_fp8 import FP8Linear, FP8Recipe
from lightning_fp8.kernels.device import simulate_cuda
from lightning_fp8.modules.gemm import fp8_gemm, record_gemms
from lightning_fp8.modules.gpu_model import (
    MODELLED,
    MODELLED_GPUS,
    SplitKUnknownError,
    UnmodelledGemmError,
    known_splits,
    modelled_call,
)
from lightning_fp8.modules.operand import FP8Matrix
from lightning_fp8.recipe import BACKEND_CHOICES

mmaemu = pytest.importorskip("mmaemu", reason="the GPU-model backends need mmaemu (pip install 'lightning-fp8[h100]')")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _step(layer, x, dtype):
    """One training forward + backward; returns (y, dx, dW) as the layer produced them."""
    x = x.detach().clone().requires_grad_()
    if dtype == torch.bfloat16:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    else:
        y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, layer.weight.grad


@pytest.fixture
def gpu_path_on(monkeypatch):
    """Make `torch._scaled_mm`, as the GPU path's `ScaledMMCall.launch` calls it, return what mmaemu's `profile` model
    of the GPU returns (every planned call of a simulated GPU then runs through it: CPU tensors, tensorwise scales)."""
    from lightning_fp8.modules.scaled_mm import _cpu_scaled_mm_runs

    assert _cpu_scaled_mm_runs("tensorwise"), "torch's CPU build runs tensorwise _scaled_mm (torch >= 2.8)"
    calls = []

    def use(profile):
        def scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, **kwargs):
            calls.append((tuple(mat_a.shape), tuple(mat_b.shape), use_fast_accum))
            return mmaemu.scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                                    use_fast_accum=use_fast_accum, profile=profile)

        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
        return calls

    return use


@pytest.mark.parametrize("backend, scaling, dtype, bias", [
    ("h100", "delayed", torch.bfloat16, False),
    ("h100", "current", torch.bfloat16, False),
    ("h100", "delayed", torch.float32, True),   # float32 GEMM outputs: the bias is added after the GEMM
    ("rtx4060", "current", torch.bfloat16, False),
])
def test_a_training_step_has_the_gpus_bits(gpu_path_on, backend, scaling, dtype, bias):
    """Forward, input gradient and weight gradient of an FP8Linear training step (48 tokens, 64 -> 40: K and N padded
    to 16 by the plan) under the GPU-model backend equal, bit for bit, the GPU path of a simulated sm90 / sm89 whose
    `torch._scaled_mm` is mmaemu's model of that GPU; fast accumulation in the forward GEMM only."""
    gpu = MODELLED_GPUS[backend]
    calls = gpu_path_on(gpu.profile_no_workspace)
    torch.manual_seed(0)
    x = torch.randn(48, 64) * 3
    results = {}
    for path in ("gpu", "backend"):
        torch.manual_seed(1)
        recipe = FP8Recipe(scaling=scaling, backend="auto" if path == "gpu" else backend)
        layer = FP8Linear(64, 40, bias=bias, recipe=recipe)
        if bias:
            torch.nn.init.normal_(layer.bias)
        with known_splits(no_workspace=True):
            if path == "gpu":
                with simulate_cuda(gpu.capability, triton=False):
                    results[path] = _step(layer, x, dtype)
            else:
                results[path] = _step(layer, x, dtype)
    assert [fast for *_, fast in calls] == [True, False, False], "fast accumulation in the forward GEMM only"
    for gpu_result, backend_result in zip(results["gpu"], results["backend"]):
        assert gpu_result.dtype == backend_result.dtype
        assert torch.equal(gpu_result.view(torch.uint8), backend_result.view(torch.uint8))


def _operands(m, k, n, a_dtype=E4, b_dtype=E4, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 4).to(a_dtype)
    b = (torch.randn(n, k, generator=g) * 4).to(b_dtype).t()  # column-major, as the layers hand it over
    return FP8Matrix(a, torch.tensor(0.25)), FP8Matrix(b, torch.tensor(2.0))


def test_the_profile_decides_recorded_splits_and_known_splits_override_them():
    """Shapes in the H100's recorded table take its decision (16 x 5760 x 64: split in two), a call's known split
    overrides it, and the override is what is computed (the result equals mmaemu's for that split). K = 5760 is past
    the planner's FAST_ACCUM_MAX_K: the forward GEMM that asks for fast accumulation is planned (and so modelled) with
    slow accumulation, whose two chains give the same bits as one on these operands (the recorded table has no
    fast-accumulation split below K = 4096 to tell them apart)."""
    from lightning_fp8.modules.scaled_mm import FAST_ACCUM_MAX_K

    a, b = _operands(16, 5760, 64)
    call = modelled_call(_request(a, b, torch.float32, fast=True), "h100")
    assert 5760 >= FAST_ACCUM_MAX_K and call.use_fast_accum is False
    args = (call.mat_a, call.mat_b, call.scale_a, call.scale_b)
    plan = mmaemu.explain(*args, out_dtype=torch.float32, use_fast_accum=False)
    assert plan.split.source == "table" and plan.split.S == 2
    decided = fp8_gemm(a, b, torch.float32, use_fast_accum=True, backend="h100")
    assert torch.equal(decided, mmaemu.scaled_mm(*args, out_dtype=torch.float32, use_fast_accum=False))
    with known_splits({(16, 5760, 64): 1}):
        unsplit = fp8_gemm(a, b, torch.float32, use_fast_accum=True, backend="h100")
    assert torch.equal(unsplit, mmaemu.scaled_mm(*args, out_dtype=torch.float32, use_fast_accum=False, splitk=1))


def _request(a, b, out_dtype, bias=None, fast=False):
    from lightning_fp8.modules.operand import GemmRequest

    return GemmRequest(a, b, out_dtype, bias, fast)


def test_an_unknown_split_raises_with_the_models_explanation_until_it_is_known():
    a, b = _operands(32, 64, 48)
    with pytest.raises(SplitKUnknownError) as error:
        fp8_gemm(a, b, torch.bfloat16, backend="h100")
    text = str(error.value)
    for part in ("H100 PCIe", "split-K decision unknown for M=32 N=48 K=64", "known_splits({(32, 64, 48): 1})",
                 "known_splits(no_workspace=True)", "CUBLASLT_WORKSPACE_SIZE=0"):
        assert part in text, (part, text)
    with known_splits({(32, 64, 48): 1}):
        known = fp8_gemm(a, b, torch.bfloat16, backend="h100")
    with known_splits(no_workspace=True):
        assert torch.equal(fp8_gemm(a, b, torch.bfloat16, backend="h100"), known)
    with pytest.raises(ValueError, match="a split is 1"):
        with known_splits({(32, 64, 48): 2}):
            pass


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_other_scalings_are_refused_naming_what_is_modelled(scaling):
    layer = FP8Linear(128, 128, bias=False, recipe=FP8Recipe(scaling=scaling, backend="h100"))
    with pytest.raises(UnmodelledGemmError) as error:
        layer(torch.randn(64, 128))
    assert MODELLED in str(error.value) and "not modelled" in str(error.value)


def test_a_bias_inside_a_bf16_gemm_is_refused_and_the_model_is_never_asked():
    layer = FP8Linear(64, 48, recipe=FP8Recipe(backend="h100"))
    with pytest.raises(UnmodelledGemmError, match="bias to the scaled GEMM") as error:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.randn(32, 64))
    assert "bias=False or float32 compute" in str(error.value)


def test_a_gemm_without_a_scaled_gemm_on_that_gpu_is_refused():
    a, b = _operands(32, 64, 48, E5, E5)  # two e5m2 operands: no scaled GEMM multiplies them
    with pytest.raises(UnmodelledGemmError, match="e5m2"):
        fp8_gemm(a, b, torch.bfloat16, backend="h100")


def test_the_backend_names_are_recipe_choices_and_a_wrong_one_names_them():
    assert set(MODELLED_GPUS) <= set(BACKEND_CHOICES)
    with pytest.raises(ValueError, match="'h100', 'rtx4060'"):
        FP8Recipe(backend="h200")


def test_meta_tensors_get_shapes_only():
    a = FP8Matrix(torch.empty(32, 64, dtype=E4, device="meta"), torch.tensor(1.0, device="meta"))
    b = FP8Matrix(torch.empty(48, 64, dtype=E4, device="meta").t(), torch.tensor(1.0, device="meta"))
    out = fp8_gemm(a, b, torch.bfloat16, backend="h100")
    assert out.device.type == "meta" and out.shape == (32, 48)


def test_the_core_never_imports_mmaemu_and_the_backend_says_how_to_install_it():
    """The default backends never import mmaemu; asking for a modelled GPU without it names the extra to install."""
    code = textwrap.dedent("""
        import sys, torch
        from lightning_fp8 import FP8Linear, FP8Recipe
        layer = FP8Linear(64, 48, bias=False, recipe=FP8Recipe())
        layer(torch.randn(32, 64, requires_grad=True)).sum().backward()
        assert "mmaemu" not in sys.modules, "the default backend imported mmaemu"
        sys.modules["mmaemu"] = None  # as if not installed
        try:
            FP8Linear(64, 48, bias=False, recipe=FP8Recipe(backend="h100"))(torch.randn(32, 64))
        except ImportError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pip install 'lightning-fp8[h100]'" in result.stdout


def test_a_grouped_gemm_is_refused():
    """Mixture-of-experts GEMMs (a request with group offsets) are not modelled: refused before any planning."""
    from types import SimpleNamespace

    with pytest.raises(UnmodelledGemmError, match="grouped GEMM"):
        modelled_call(SimpleNamespace(offsets=torch.tensor([16, 32])), "h100")
