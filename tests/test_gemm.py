"""FP8 GEMM backends: emulation, the `_scaled_mm` path (layouts, padding, bias rules), the custom op under
torch.compile, and the optional Transformer Engine backend's error paths.

Tolerances:
- emulated GEMM vs a float64 product of the same FP8 values: rtol 1e-5 (float32 accumulation over K <= 512
  terms; the FP8 products themselves are exact in float32).
- `_scaled_mm` path vs emulation: float32 output: rtol 1e-6 (summation order only); bf16 output: two bf16 ulps
  (rtol 2**-7: each side rounds once, and `_scaled_mm` adds the bias already rounded to bf16), plus
  atol 2**-8 * max|bias| for that bias rounding.
(torch.compile of whole FP8 models: tests/test_compile.py.)

(Length: every GEMM path with its own tolerance, plus the TE stand-in fixture.)
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, FP8Recipe
from lightning_fp8.kernels.device import simulate_cuda
from lightning_fp8.modules import gemm as gemm_module
from lightning_fp8.modules.emulation import _bf16_tensorwise, emulate, fp8_bf16_image
from lightning_fp8.modules.gemm import FP8EmulationWarning
from lightning_fp8.modules.operand import FP8Matrix, GemmRequest
from lightning_fp8.modules.scaled_mm import Refusal, ScaledMMCall, plan_scaled_mm, target_for
from lightning_fp8.numerics import E4M3, quantize


def _ops(a, sa, b, sb, out_dtype, bias=None, fast_accum=False):
    """A per-tensor GEMM request: FP8 a (M, K), b (K, N) with their dequant scales."""
    return GemmRequest(FP8Matrix(a, sa), FP8Matrix(b, sb), out_dtype, bias, fast_accum)


def emulated_gemm(a, sa, b, sb, out_dtype, bias=None):
    return emulate(_ops(a, sa, b, sb, out_dtype, bias))


def _bf16_gemm(a, sa, b, sb, bias):
    return _bf16_tensorwise(_ops(a, sa, b, sb, torch.bfloat16, bias))


def fp8_gemm(a, sa, b, sb, out_dtype, bias=None, use_fast_accum=False, backend="auto"):
    return gemm_module.fp8_gemm(FP8Matrix(a, sa), FP8Matrix(b, sb), out_dtype, bias, use_fast_accum, backend)

HAS_CUDA = torch.cuda.is_available()
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype).to(device)


def _ref(a, sa, b, sb, bias=None):
    out = (a.double() @ b.double()) * (float(sa) * float(sb))
    return out + bias.double() if bias is not None else out


# ------------------------------------------------------------------------------------------------------------------
# emulation and the custom op
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("da,db", [(E4, E4), (E5, E4), (E4, E5), (E5, E5)])
def test_emulated_gemm_matches_float64(da, db):
    a, b = _fp8((24, 512), da, 0), _fp8((512, 40), db, 1)
    sa, sb = torch.tensor(0.125), torch.tensor(3.0)
    bias = torch.randn(40)
    out = emulated_gemm(a, sa, b, sb, torch.float32, bias)
    torch.testing.assert_close(out.double(), _ref(a, sa, b, sb, bias), rtol=1e-5, atol=1e-5)


def test_fp8_gemm_any_layout_and_dtypes():
    a, b = _fp8((48, 32), E4, 2), _fp8((16, 32), E4, 3).t()  # b column-major
    sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = fp8_gemm(a, sa, b, sb, out_dtype=out_dtype, backend="emulated")
        assert out.dtype == out_dtype and out.shape == (48, 16)
    at = a.t().contiguous().t()  # same values, column-major
    assert torch.equal(fp8_gemm(at, sa, b, sb, torch.float32, backend="emulated"),
                       fp8_gemm(a, sa, b, sb, torch.float32, backend="emulated"))


def test_fp8_gemm_is_a_custom_op_with_fake_impl():
    a, b = _fp8((32, 48), E4, 4), _fp8((48, 16), E4, 5)
    args = (a, torch.tensor(1.0), [], None, b, torch.tensor(0.5), [], None, torch.bfloat16, torch.randn(16), False,
            "emulated", False)
    # ("test_schema" is left out: it runs arithmetic on the inputs that CPU float8 tensors do not implement)
    torch.library.opcheck(torch.ops.lightning_fp8.fp8_gemm.default, args, test_utils=("test_faketensor",))


def test_fp8_gemm_traces_without_graph_breaks():
    def f(a, b, sa, sb):
        return fp8_gemm(a, sa, b.t(), sb, torch.float32, backend="auto").relu().sum()

    a, b, sa, sb = _fp8((32, 64), E4, 8), _fp8((16, 64), E4, 9), torch.tensor(0.5), torch.tensor(0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FP8EmulationWarning)
        explained = torch._dynamo.explain(f)(a, b, sa, sb)
        assert explained.graph_break_count == 0
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(a, b, sa, sb), f(a, b, sa, sb))


# ------------------------------------------------------------------------------------------------------------------
# the _scaled_mm path's layout / padding / bias logic, run through CPU _scaled_mm (slow there: small shapes only)
# ------------------------------------------------------------------------------------------------------------------
def _check_scaled_mm_path(a, b, sa, sb, out_dtype, bias, arch=(9, 0)):
    call = plan_scaled_mm(_ops(a, sa, b, sb, out_dtype, bias), target_for(arch))
    assert isinstance(call, ScaledMMCall), call
    out = call.launch()
    ref = emulated_gemm(a, sa, b, sb, out_dtype, bias)
    assert out.dtype == out_dtype and out.shape == ref.shape and out.is_contiguous()
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        # each side rounds once to bf16 (<= 1 ulp apart, rtol 2**-8), and _scaled_mm adds a bias already rounded
        # to bf16, which can push the result across one more rounding boundary: 2 ulps
        atol = 2**-8 * (bias.abs().max().item() if bias is not None else 0.0) + 1e-3
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=atol)


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch without _scaled_mm")
@pytest.mark.parametrize("m,k,n", [(32, 48, 16), (5, 20, 24), (17, 33, 7), (1, 16, 16)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_path_pads_and_fixes_layouts(m, k, n, out_dtype, with_bias):
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("no _scaled_mm")
    a = _fp8((m, k), E4, m + k)
    b = _fp8((n, k), E5 if m % 2 else E4, n).t()  # column-major as FP8Linear passes W^T
    bias = torch.randn(n) if with_bias else None
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    try:
        _check_scaled_mm_path(a, b, sa, sb, out_dtype, bias)
    except (RuntimeError, NotImplementedError) as err:  # a CPU build without FP8 matmul support
        pytest.skip(f"CPU _scaled_mm unavailable: {err}")
    # a row-major b and a transposed a: copied into the layouts _scaled_mm needs
    _check_scaled_mm_path(a.t().contiguous().t(), b.contiguous(), sa, sb, out_dtype, bias)


def test_e5m2_times_e5m2_is_emulated():
    a, b = _fp8((16, 16), E5, 1), _fp8((16, 16), E5, 2)
    one = torch.tensor(1.0)
    plan = plan_scaled_mm(_ops(a, one, b, one, torch.float32, None), target_for((9, 0)))
    assert isinstance(plan, Refusal) and "two e5m2" in plan.reason
    import lightning_fp8.modules.gemm as gemm

    gemm._warned.clear()
    with simulate_cuda((9, 0)), pytest.warns(FP8EmulationWarning, match="two e5m2"):
        out = fp8_gemm(a, one, b, one, torch.float32)
    assert torch.equal(out, emulated_gemm(a, one, b, one, torch.float32))
    e4 = b.to(torch.float32).to(E4)
    assert isinstance(plan_scaled_mm(_ops(a, one, e4, one, torch.float32, None),
                                     target_for((9, 0))), ScaledMMCall)


def test_scaled_mm_backend_requires_capable_gpu():
    with pytest.raises(RuntimeError, match="compute capability"):
        fp8_gemm(_fp8((16, 16), E4, 1), torch.tensor(1.0), _fp8((16, 16), E4, 2), torch.tensor(1.0),
                 torch.float32, backend="scaled_mm")


# ------------------------------------------------------------------------------------------------------------------
# CUDA (unverified until a GPU session runs `pytest -m cuda`)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (128, 4096, 1024), (4096, 1024, 4096), (77, 1000, 24), (1, 64, 48)])
@pytest.mark.parametrize("da,db", [(E4, E4), (E5, E4), (E4, E5)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cuda_scaled_mm_vs_emulation(m, k, n, da, db, out_dtype, with_bias, fast_accum):
    from lightning_fp8.kernels.device import profile_of

    if not profile_of(torch.device("cuda")).fp8_tensor_cores:
        pytest.skip("GPU without FP8 tensor cores")
    a = _fp8((m, k), da, 1, "cuda")
    b = _fp8((n, k), db, 2, "cuda").t()
    sa, sb = torch.tensor(2.0**-3, device="cuda"), torch.tensor(0.75, device="cuda")
    bias = torch.randn(n, device="cuda") if with_bias else None
    out = fp8_gemm(a, sa, b, sb, out_dtype, bias=bias, use_fast_accum=fast_accum, backend="scaled_mm")
    ref = emulated_gemm(a, sa, b, sb, torch.float32, bias)
    assert out.dtype == out_dtype and out.shape == (m, n)
    # bf16-level tolerance: one output rounding, bf16 bias, accumulation order (fast accum: looser)
    scale = ref.abs().max().item() + 1e-6
    tol = (2**-7 if out_dtype != torch.float32 else 1e-5) + (2**-6 if fast_accum else 0.0)
    assert (out.float() - ref).abs().max().item() <= tol * scale


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_fp8linear_close_to_bf16():
    torch.manual_seed(0)
    lin = nn.Linear(1024, 2048).cuda()
    fp8 = FP8Linear.from_linear(copy.deepcopy(lin), FP8Recipe())
    x = torch.randn(8, 256, 1024, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = lin(x)
        y = fp8(x2)
    y_ref.float().square().mean().backward()
    y.float().square().mean().backward()

    def sqnr(a, b):
        return 10 * torch.log10(b.float().square().mean() / (a.float() - b.float()).square().mean()).item()

    assert sqnr(y, y_ref) > 25 and sqnr(x2.grad, x.grad) > 20 and sqnr(fp8.weight.grad, lin.weight.grad) > 20


# ------------------------------------------------------------------------------------------------------------------
# The BF16 emulation is faithful (lightning_fp8/modules/gemm.py, `_bf16_gemm`)
# ------------------------------------------------------------------------------------------------------------------
def _grid_fp8(shape, dtype, seed):
    """FP8 values that are multiples of 1/8 in [-16, 16]: products and sums of 64 of them are exact in float32, so
    a float32 GEMM of them is exact and any rounding difference is the emulation's, not the summation order's."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-128, 129, shape, generator=g).float() / 8).to(dtype)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_emulation_rounds_once_like_scaled_mm(fmt, with_bias):
    """With power-of-two scales and a bf16 output, the BF16-GEMM emulation gives round_bf16(acc * sa * sb + bias)
    exactly, the one rounding `_scaled_mm` makes: bit-identical to the float32 emulation where the accumulation is
    exact. (A bias added after a bf16 GEMM would round twice: that differs here in hundreds of elements.)"""
    a, b = _grid_fp8((64, 64), torch.float8_e4m3fn, 0), _grid_fp8((64, 48), fmt, 1)
    sa, sb = torch.tensor(2.0**-5), torch.tensor(2.0**3)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(2)).bfloat16() if with_bias else None
    exact = (a.double() @ b.double()) * (sa.double() * sb.double())
    if with_bias:
        exact = exact + bias.double()
    out = _bf16_gemm(a, sa, b, sb, bias)  # the BF16 path itself, whether or not this CPU picks it (gemm.py)
    assert torch.equal(out, exact.to(torch.bfloat16))
    assert torch.equal(emulated_gemm(a, sa, b, sb, torch.bfloat16, bias), out)  # the path this CPU picks
    assert torch.equal(out, emulated_gemm(a, sa, b, sb, torch.float32, bias).to(torch.bfloat16))
    if with_bias:
        twice = ((a.double() @ b.double()) * (sa.double() * sb.double())).to(torch.bfloat16).double() + bias.double()
        assert (twice.to(torch.bfloat16) != out).sum() > 0  # the double rounding this avoids


def test_bf16_emulation_on_random_operands_differs_from_float32_only_by_summation_order():
    a = quantize(torch.randn(128, 512) * 40, torch.tensor(1.0), E4M3)
    b = quantize(torch.randn(512, 96) * 40, torch.tensor(1.0), E4M3)
    sa, sb = torch.tensor(2.0**-4), torch.tensor(0.5)
    fast = _bf16_gemm(a, sa, b, sb, None).float()
    ref = emulated_gemm(a, sa, b, sb, torch.float32)
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-30)
    assert ((fast - ref).abs() <= ulp).all()  # within one bf16 rounding of the float32 result
    assert (fast != ref.bfloat16().float()).float().mean() < 0.01  # and equal to its rounding nearly everywhere


def test_non_power_of_two_scales_use_the_float32_emulation():
    a = quantize(torch.randn(32, 64), torch.tensor(1.0), E4M3)
    b = quantize(torch.randn(64, 16), torch.tensor(1.0), E4M3)
    sa, sb = torch.tensor(0.3), torch.tensor(1.7)
    ref = (torch.mm(a.float(), b.float()) * (sa * sb)).bfloat16()
    assert torch.equal(emulated_gemm(a, sa, b, sb, torch.bfloat16), ref)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_bf16_image_is_exact_for_every_code(fmt):
    codes = torch.arange(256, dtype=torch.uint8).view(fmt)
    for x in (codes, codes.reshape(16, 16), codes.reshape(16, 16).t()):  # contiguous and transposed layouts
        image = fp8_bf16_image(x)
        assert image.dtype == torch.bfloat16 and image.shape == x.shape and image.stride() == x.stride()
        want, got = x.float(), image.float()
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_float32_operands_of_the_emulation_are_exact_for_every_code(fmt):
    """The float32 emulation widens its FP8 operands through the BF16 table (faster than torch's float8 -> float32
    loop on CPU): every code, odd element counts and transposed views give torch's own conversion."""
    from lightning_fp8.modules.emulation import _float32_image

    codes = torch.arange(256, dtype=torch.uint8).view(fmt)
    for x in (codes, codes.reshape(16, 16), codes.reshape(16, 16).t(), codes[:255]):
        got, want = _float32_image(x), x.to(torch.float32)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got[~torch.isnan(want)], want[~torch.isnan(want)])


def test_emulation_warnings_point_at_the_users_line():
    """The one-time notice names the line of the user's code that ran the layer (or called backward), not a file
    inside torch or this library."""
    import lightning_fp8.modules.gemm as gemm

    gemm._warned.clear()
    layer = FP8Linear(32, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(4, 32)).sum().backward()
        with simulate_cuda((8, 9)):
            FP8Linear(128, 128, recipe=FP8Recipe(scaling="blockwise"))(torch.randn(128, 128))
    notices = [w for w in caught if issubclass(w.category, FP8EmulationWarning)]
    assert len(notices) == 2 and "no FP8 tensor cores" in str(notices[0].message)
    assert "sm90 only" in str(notices[1].message)
    assert all(w.filename == __file__ for w in notices), [(w.filename, w.lineno) for w in notices]
