"""The tiled FP8 GEMM (rowwise / blockwise recipes): the per-K-block definition against float64, the fast emulation
against the definition, the `_scaled_mm` path's logic through CPU `_scaled_mm` (rowwise), its refusals, and the
GPU paths (marked cuda)."""
import warnings

import pytest
import torch

from lightning_fp8 import FP8Linear, FP8Recipe
from lightning_fp8.kernels.device import simulate_cuda
from lightning_fp8.modules import gemm
from lightning_fp8.modules.gemm import FP8EmulationWarning
from lightning_fp8.modules.scaled_mm import (
    BLOCK_1x128_1x128,
    BLOCK_1x128_128x128,
    ROWWISE,
    Refusal,
    ScaledMMCall,
    plan_scaled_mm,
    scaling_kind,
    target_for,
)
from lightning_fp8.modules.emulation import emulate
from lightning_fp8.modules.operand import FP8Matrix
from lightning_fp8.numerics import E4M3, E5M2
from lightning_fp8.numerics.tiles import expand_tiles, quantize_tiles, tiled_gemm_reference, transposed

from support.helpers import gemm_request

HAS_CUDA = torch.cuda.is_available()


def emulated_tiled_gemm(a, sa, a_tile, b, sb, b_tile, out_dtype, bias=None, bf16=None):
    return emulate(gemm_request(a, sa, a_tile, b, sb, b_tile, out_dtype, bias), bf16)


def fp8_gemm_tiled(a, sa, a_tile, b, sb, b_tile, out_dtype, bias=None, use_fast_accum=False, backend="auto"):
    return gemm.fp8_gemm(FP8Matrix(a, sa, a_tile), FP8Matrix(b, sb, b_tile), out_dtype, bias, use_fast_accum, backend)


def _operands(m, k, n, a_tile, b_tile, fmt_b=E4M3, seed=0, device="cpu", spread=True):
    """a (M, K) cast with a_tile, b (K, N) cast with b_tile (b is built as b^T (N, K) cast with the transposed tile,
    as the layer does, so it arrives column-major). Rows / columns with very different magnitudes, so the scales
    differ per tile."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    if spread:
        x = x * torch.logspace(-3, 3, m).unsqueeze(1)
        w = w * torch.logspace(2, -2, k).unsqueeze(0)
    qa, sa, _ = quantize_tiles(x.to(device), a_tile, E4M3)
    qbt, sbt, _ = quantize_tiles(w.to(device), transposed(b_tile), fmt_b)
    return qa, sa, qbt.t(), sbt.t()


def _exact(a, sa, a_tile, b, sb, b_tile, bias=None):
    """float64 product of the dequantized operands (every product of FP8 values and power-of-two scales is exact)."""
    a64 = a.double() * expand_tiles(sa.double(), a_tile, a.shape)
    b64 = b.double() * expand_tiles(sb.double(), b_tile, b.shape)
    out = a64 @ b64
    return out + bias.double() if bias is not None else out


CASES = [  # (a_tile, b_tile): forward / dgrad / wgrad of blockwise, and rowwise
    ((1, 128), (128, 128)),
    ((1, 128), (128, 1)),
    ((1, 0), (0, 1)),
    ((1, 32), (32, 32)),
]


@pytest.mark.parametrize("a_tile,b_tile", CASES, ids=str)
@pytest.mark.parametrize("m,k,n", [(64, 384, 96), (70, 300, 130)])  # the second: ragged tiles in every dimension
def test_reference_is_the_exact_product_up_to_float32_accumulation(a_tile, b_tile, m, k, n):
    a, sa, b, sb = _operands(m, k, n, a_tile, b_tile)
    bias = torch.randn(n)
    out = tiled_gemm_reference(a, sa, a_tile, b, sb, b_tile, torch.float32, bias)
    exact = _exact(a, sa, a_tile, b, sb, b_tile, bias)
    bound = k * 2**-23 * (a.double().abs() * expand_tiles(sa.double(), a_tile, a.shape)) @ (
        b.double().abs() * expand_tiles(sb.double(), b_tile, b.shape)) + 2**-23 * bias.double().abs()
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("a_tile,b_tile", CASES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-gemm", "fp32-gemm"])
def test_fast_emulation_equals_the_definition_on_exactly_accumulable_operands(a_tile, b_tile, out_dtype, with_bias, bf16):
    """FP8 values on a 1/8 grid and scales that are powers of two: every partial sum is exact in float32, so the
    fast emulation (dequantize to BF16, one GEMM) and the per-K-block definition must agree bit for bit, bias and
    the single rounding included."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randint(-64, 65, (48, 256), generator=g).float() / 8).to(torch.float8_e4m3fn)
    b = (torch.randint(-64, 65, (256, 40), generator=g).float() / 8).to(torch.float8_e4m3fn)
    # scales 2^-1 or 2^0: partial sums span at most 22 bits, exact in float32 whatever the order
    sa = 2.0 ** torch.randint(-1, 1, tuple(_grid(a_tile, a.shape)), generator=g).float()
    sb = 2.0 ** torch.randint(-1, 1, tuple(_grid(b_tile, b.shape)), generator=g).float()
    bias = torch.randn(40, generator=g).bfloat16().float() if with_bias else None
    fast = emulated_tiled_gemm(a, sa, a_tile, b, sb, b_tile, out_dtype, bias, bf16=bf16)
    ref = tiled_gemm_reference(a, sa, a_tile, b, sb, b_tile, out_dtype, bias)
    assert fast.dtype == out_dtype and torch.equal(fast, ref)
    assert torch.equal(ref, _exact(a, sa, a_tile, b, sb, b_tile, bias).to(out_dtype))


def _grid(tile, shape):
    from lightning_fp8.numerics.tiles import grid_shape

    return grid_shape(tile, shape)


@pytest.mark.parametrize("a_tile,b_tile", CASES[:3], ids=str)
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-gemm", "fp32-gemm"])
def test_fast_emulation_on_random_operands_differs_only_by_summation_order(a_tile, b_tile, bf16):
    a, sa, b, sb = _operands(128, 512, 96, a_tile, b_tile, seed=5)
    fast = emulated_tiled_gemm(a, sa, a_tile, b, sb, b_tile, torch.bfloat16, bf16=bf16).float()
    ref = tiled_gemm_reference(a, sa, a_tile, b, sb, b_tile, torch.float32)
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-30)
    assert ((fast - ref).abs() <= ulp).all()  # within one bf16 rounding of the float32 definition


def test_non_power_of_two_scales_run_the_definition():
    a, sa, b, sb = _operands(32, 256, 24, (1, 128), (128, 128), seed=6)
    sa, sb = sa * 1.37, sb * 0.71
    out = emulated_tiled_gemm(a, sa, (1, 128), b, sb, (128, 128), torch.bfloat16)
    assert torch.equal(out, tiled_gemm_reference(a, sa, (1, 128), b, sb, (128, 128), torch.bfloat16))


def _kind(a, a_tile, b, b_tile):
    one = torch.tensor(1.0)
    return scaling_kind(gemm_request(a, one, a_tile, b, one, b_tile, torch.bfloat16))


def test_scaled_mm_kind():
    a8 = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    b8 = torch.zeros(384, 128, dtype=torch.float8_e4m3fn)
    assert _kind(a8, (1, 0), b8, (0, 1)) == ROWWISE
    assert _kind(a8, (1, 128), b8, (128, 128)) == BLOCK_1x128_128x128
    assert _kind(a8, (1, 128), b8, (128, 1)) == BLOCK_1x128_1x128
    assert _kind(a8, (1, 32), b8, (32, 32)) is None  # GPU blockwise GEMMs take 128 only
    # kinds a target refuses, with the reason
    one = torch.tensor(1.0)
    def blockwise(m, k):
        return gemm_request(a8[:m, :k], torch.ones(m, -(-k // 128)), (1, 128), b8[:k], torch.ones(-(-k // 128), 1),
                            (128, 128), torch.bfloat16, None, False)

    # the token count (M) is free up to cuBLASLt's multiple of 4 for 1x128 scales (it was refused unless a multiple
    # of 128: every blockwise layer at a token count like 100 ran emulated); the contraction must be whole blocks
    assert isinstance(plan_scaled_mm(blockwise(100, 384), target_for((9, 0))), ScaledMMCall)
    assert "multiple of 4" in plan_scaled_mm(blockwise(102, 384), target_for((9, 0))).reason
    assert "K (the contraction)" in plan_scaled_mm(blockwise(100, 300), target_for((9, 0))).reason
    e5 = gemm_request(a8.to(torch.float8_e5m2), one, (1, 0), b8.to(torch.float8_e5m2), one, (0, 1), torch.bfloat16,
                      None, False)
    assert "two e5m2" in plan_scaled_mm(e5, target_for((9, 0))).reason


@pytest.mark.parametrize("m,k,n", [(32, 48, 16), (17, 33, 7), (5, 20, 24)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rowwise_scaled_mm_path_through_cpu_scaled_mm(m, k, n, with_bias):
    """The CUDA path's layout fixes, K / N padding and bias, run through CPU `_scaled_mm` with rowwise scales."""
    a, sa, b, sb = _operands(m, k, n, (1, 0), (0, 1), fmt_b=E5M2 if m % 2 else E4M3, seed=m)
    bias = torch.randn(n) if with_bias else None

    def planned(a, b):
        call = plan_scaled_mm(gemm_request(a, sa, (1, 0), b, sb, (0, 1), torch.bfloat16, bias, False),
                              target_for((9, 0)))
        assert isinstance(call, ScaledMMCall), call
        return call.launch()

    out = planned(a, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n) and out.is_contiguous()
    ref = emulated_tiled_gemm(a, sa, (1, 0), b, sb, (0, 1), torch.float32, bias)
    atol = 2**-8 * (bias.abs().max().item() if bias is not None else 0.0)
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=atol + 1e-6 * ref.abs().max().item())
    # row-major b / transposed a are copied into the layouts _scaled_mm needs
    assert torch.equal(planned(a.t().contiguous().t(), b.contiguous()), out)


def test_what_the_gpu_refuses_is_emulated_with_one_warning():
    """Blockwise scales on an sm89 GPU (cuBLASLt's block scale modes are sm90's): the op emulates them, with one
    FP8EmulationWarning per reason naming it. A float32 rowwise output on sm89's CUTLASS kernel follows the installed
    torch's rules (scaled_mm.TORCH_RULES): refused and emulated with a warning naming what the kernel writes where
    that torch's kernel writes bf16 / fp16 only (2.13), planned and run natively where it writes float32 (2.14 on)."""
    a, sa, b, sb = _operands(128, 256, 128, (1, 128), (128, 128))
    gemm._warned.clear()
    with simulate_cuda((8, 9)):
        with pytest.warns(FP8EmulationWarning, match="sm90 only"):
            out = fp8_gemm_tiled(a, sa, (1, 128), b, sb, (128, 128), torch.bfloat16)
        assert torch.equal(out, emulated_tiled_gemm(a, sa, (1, 128), b, sb, (128, 128), torch.bfloat16))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once only
            fp8_gemm_tiled(a, sa, (1, 128), b, sb, (128, 128), torch.bfloat16)
        a, sa, b, sb = _operands(32, 48, 16, (1, 0), (0, 1))
        sm89 = target_for((8, 9))
        written = sm89.cutlass_rowwise_out_dtypes
        if torch.float32 in written:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FP8EmulationWarning)  # native: nothing to warn about
                out = fp8_gemm_tiled(a, sa, (1, 0), b, sb, (0, 1), torch.float32)
            torch.testing.assert_close(out, emulated_tiled_gemm(a, sa, (1, 0), b, sb, (0, 1), torch.float32))
        else:
            names = " / ".join({torch.bfloat16: "bf16", torch.float16: "fp16"}[d] for d in written)
            with pytest.warns(FP8EmulationWarning, match=f"writes {names} only in {sm89.torch_name}"):
                fp8_gemm_tiled(a, sa, (1, 0), b, sb, (0, 1), torch.float32)
    gemm._warned.clear()


def test_tiled_gemm_is_a_custom_op_that_compiles_whole():
    a, sa, b, sb = _operands(64, 256, 32, (1, 128), (128, 128))

    def f(a, sa, b, sb):
        return fp8_gemm_tiled(a, sa, (1, 128), b, sb, (128, 128), torch.bfloat16) * 2

    explained = torch._dynamo.explain(f)(a, sa, b, sb)
    assert explained.graph_break_count == 0
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(a, sa, b, sb), f(a, sa, b, sb))


# ------------------------------------------------------------------------------------------------------------------
# CUDA (unverified until a GPU session runs `pytest -m cuda`)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("a_tile,b_tile", CASES[:3], ids=str)
@pytest.mark.parametrize("m,k,n", [(256, 512, 768), (128, 128, 256), (4096, 1024, 2816), (77, 300, 130)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_cuda_tiled_gemm_vs_definition(a_tile, b_tile, m, k, n, out_dtype, with_bias):
    from lightning_fp8.kernels.device import profile_of

    if not profile_of(torch.device("cuda")).fp8_tensor_cores:
        pytest.skip("GPU without FP8 tensor cores")
    a, sa, b, sb = _operands(m, k, n, a_tile, b_tile, device="cuda")
    bias = torch.randn(n, device="cuda") if with_bias else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FP8EmulationWarning)
        out = fp8_gemm_tiled(a, sa, a_tile, b, sb, b_tile, out_dtype, bias, False, "scaled_mm")
    ref = tiled_gemm_reference(a.cpu(), sa.cpu(), a_tile, b.cpu(), sb.cpu(), b_tile, torch.float32,
                               bias.cpu() if bias is not None else None)
    assert out.dtype == out_dtype and out.shape == (m, n)
    # one output rounding, a bias rounded to bf16 (rowwise), and the GPU's reduced-precision accumulation inside a
    # K block: relative to the magnitude of the row x column products
    mag = (a.float().abs().cpu() * expand_tiles(sa.cpu(), a_tile, a.shape)) @ (
        b.float().abs().cpu() * expand_tiles(sb.cpu(), b_tile, b.shape))
    tol = (2**-7 if out_dtype != torch.float32 else 2**-12) * (mag + (bias.abs().cpu() if bias is not None else 0))
    assert ((out.float().cpu() - ref).abs() <= tol + 1e-6).all()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_cuda_fine_grained_linear_matches_cpu_emulation(scaling):
    """The same layer on the GPU (library GEMMs) and on CPU (emulation): forward and both gradients within BF16
    accumulation differences; and the outlier case keeps its weight gradient on the GPU too."""
    torch.manual_seed(0)
    x = torch.randn(4, 256, 1024)
    x[..., 3] *= 1e6
    dy = torch.randn(4, 256, 2048)
    grads = {}
    for device in ("cpu", "cuda"):
        layer = FP8Linear(1024, 2048, recipe=FP8Recipe(scaling=scaling)).to(device)
        torch.manual_seed(1)
        torch.nn.init.normal_(layer.weight, std=0.02)
        xi = x.to(device).requires_grad_()
        with warnings.catch_warnings(), torch.autocast(device, dtype=torch.bfloat16):
            warnings.simplefilter("ignore", FP8EmulationWarning)
            y = layer(xi)
        y.float().backward(dy.to(device))
        grads[device] = (y.float().cpu(), xi.grad.cpu(), layer.weight.grad.cpu())
    for cpu_t, gpu_t in zip(grads["cpu"], grads["cuda"]):
        err = (gpu_t - cpu_t).norm() / cpu_t.norm()
        assert err < 2e-2, err
    w_other = torch.cat([grads["cuda"][2][:, :3], grads["cuda"][2][:, 4:]], 1)
    assert torch.isfinite(w_other).all() and w_other.abs().sum() > 0


@pytest.mark.parametrize("tile", [(1, 0), (1, 128), (128, 128), (128, 1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantized_operands_are_the_fp8_values_times_their_tile_scales(tile, dtype):
    """The emulation's dequantization (a blocked view times the scales where the tiles divide the operand, through
    the transpose for a transposed operand; expanded scales for ragged tiles) is element for element the product the
    definition takes."""
    from lightning_fp8.modules.emulation import dequantized
    from lightning_fp8.numerics.tiles import grid_shape

    g = torch.Generator().manual_seed(7)
    for shape in ((256, 384), (200, 300)):
        x = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
        for operand, name in ((x, "row-major"), (x.t().contiguous().t(), "transposed view")):
            scale = 2.0 ** torch.randint(-8, 8, grid_shape(tile, shape), generator=g).float()
            want = (operand.to(torch.float32) * expand_tiles(scale, tile, shape)).to(dtype)
            got = dequantized(operand, scale, tile, dtype)
            assert got.dtype == dtype and torch.equal(got, want), (shape, name)
