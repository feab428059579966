"""FP8Conv1d / FP8Conv2d numerics: forward, input gradient and weight gradient equal their definition (the FP8 casts
of the GEMM operands, products summed in float32, rounded once) for strides, padding (every mode, "same" included),
dilation, groups, 1x1, Conv1d and channels-last input; the Mellempudi recipe's stochastic gradient rounding; the
fine-grained recipes; what backward keeps; what a disabled layer computes.

The reference is torch's own convolution in float64 on the dequantized FP8 operands (exact: every FP8 value times a
power-of-two scale is a float64), so it is the definition. The tolerance is not tuned: it is the textbook bound of
a float32 sum of n terms in any order, |error| <= n u / (1 - n u) * sum |terms| (u = 2**-24), with sum |terms| the
same convolution of the operands' magnitudes, plus one rounding of the result to its dtype."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8 import FP8Conv1d, FP8Conv2d, FP8Recipe, fp8_autocast
from lightning_fp8.numerics import E4M3, E5M2, quantize, scale_from_amax
from lightning_fp8.numerics.tiles import dequantize_tiles, operand_tiles, quantize_tiles
from lightning_fp8.presets import get_preset

U32 = 2.0**-24
U16 = 2.0**-8  # bf16's unit roundoff


def _fp8(t, fmt, scaled=True):
    """t cast with current per-tensor power-of-two scaling (the recipe defaults), dequantized, float64."""
    if not scaled:
        return quantize(t, torch.ones(()), fmt).double()
    scale = scale_from_amax(t.detach().abs().max().float(), fmt.max, 0, 1.0, True)
    return quantize(t.detach(), scale, fmt).double() / scale.double()


def _reference(conv, xq, wq, gq, bias):
    """(y, dx, dw, db) of `conv`'s geometry in float64 on the given operands (torch's convolution and its autograd)."""
    ref = copy.deepcopy(conv).double()
    with torch.no_grad():
        ref.weight.copy_(wq)
        if ref.bias is not None:
            ref.bias.copy_(bias)
    x = xq.clone().requires_grad_(True)
    y = ref(x)
    y.backward(gq)
    return y.detach(), x.grad, ref.weight.grad, None if ref.bias is None else ref.bias.grad


def _within(actual, ref, magnitude, n_terms, rounding=0.0):
    gamma = n_terms * U32 / (1 - n_terms * U32)
    bound = gamma * magnitude + rounding * ref.abs() + 1e-300
    err = (actual.double() - ref).abs()
    assert (err <= bound).all(), f"max error / bound {float((err / bound).max()):.3g}"


def _check_definition(conv, fp8_layer, x, dy, recipe, autocast=False):
    """Run the FP8 layer and compare its three GEMMs with their definition."""
    fmt_x, fmt_w, fmt_g = (recipe.format_for(r) for r in ("input", "weight", "grad_output"))
    xin = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fp8_layer(xin)
    y.backward(dy)
    xq, wq, gq = _fp8(x, fmt_x), _fp8(conv.weight, fmt_w), _fp8(dy, fmt_g)
    bias = conv.bias.detach().double() if conv.bias is not None else None
    y_ref, dx_ref, dw_ref, db_ref = _reference(conv, xq, wq, gq, bias)
    y_mag, dx_mag, dw_mag, _ = _reference(conv, xq.abs(), wq.abs(), gq.abs(), bias.abs() if bias is not None else None)
    groups = conv.groups
    k = conv.in_channels // groups * int(torch.tensor(conv.kernel_size).prod())
    taps = int(torch.tensor(conv.kernel_size).prod())
    positions = y.numel() // y.shape[1]
    rounding = U16 if autocast else 0.0
    assert y.shape == y_ref.shape and y.dtype == (torch.bfloat16 if autocast else x.dtype)
    _within(y, y_ref, y_mag, k + 1, rounding)
    _within(xin.grad, dx_ref, dx_mag, conv.out_channels // groups * taps, rounding)
    _within(fp8_layer.weight.grad, dw_ref, dw_mag, positions, rounding)
    if db_ref is not None:  # the bias gradient sums the unquantized gradient, as FP8Linear's does
        dims = [0] + list(range(2, dy.dim()))
        torch.testing.assert_close(fp8_layer.bias.grad, dy.float().sum(dims), rtol=1e-5, atol=1e-6)
    return y


# (name, convolution, input shape)
GEOMETRIES = [
    ("3x3", lambda: nn.Conv2d(32, 48, 3, padding=1), (2, 32, 9, 7)),
    ("stride2", lambda: nn.Conv2d(32, 16, 3, stride=2, padding=1), (2, 32, 9, 8)),
    ("stride2_no_pad_leftover", lambda: nn.Conv2d(16, 16, 3, stride=2, bias=False), (2, 16, 10, 9)),
    ("dilation_same", lambda: nn.Conv2d(16, 32, 3, padding="same", dilation=2), (2, 16, 8, 8)),
    ("even_kernel_same", lambda: nn.Conv2d(16, 16, 4, padding="same"), (2, 16, 7, 6)),
    ("groups", lambda: nn.Conv2d(32, 64, 3, padding=1, groups=2), (2, 32, 6, 6)),
    ("groups_stride2", lambda: nn.Conv2d(64, 32, 3, stride=2, padding=1, groups=2), (2, 64, 7, 7)),
    ("pointwise", lambda: nn.Conv2d(32, 16, 1), (2, 32, 5, 5)),
    ("pointwise_stride2", lambda: nn.Conv2d(32, 64, 1, stride=2, bias=False), (2, 32, 7, 7)),
    ("pad_beyond_reach", lambda: nn.Conv2d(16, 16, 1, padding=1), (2, 16, 4, 4)),
    ("reflect", lambda: nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect"), (2, 16, 6, 6)),
    ("replicate", lambda: nn.Conv2d(16, 16, 3, padding=(1, 2), padding_mode="replicate"), (2, 16, 6, 6)),
    ("circular_dilated", lambda: nn.Conv2d(16, 16, 3, padding=2, dilation=2, padding_mode="circular"), (2, 16, 6, 6)),
    ("conv1d", lambda: nn.Conv1d(16, 32, 5, stride=2, padding=2), (3, 16, 21)),
    ("conv1d_groups_dilation", lambda: nn.Conv1d(32, 32, 3, padding=2, dilation=2, groups=2), (3, 32, 12)),
]


@pytest.mark.parametrize("name,build,shape", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
def test_fp8_conv_equals_its_definition(name, build, shape):
    torch.manual_seed(0)
    conv = build()
    recipe = FP8Recipe(scaling="current")
    fp8 = (FP8Conv1d if isinstance(conv, nn.Conv1d) else FP8Conv2d).from_conv(copy.deepcopy(conv), recipe)
    x = torch.randn(shape)
    y_shape = conv(x).shape
    dy = torch.randn(y_shape) * 1e-2
    y = _check_definition(conv, fp8, x, dy, recipe)
    assert y.is_contiguous()  # the layout nn.Conv gives a contiguous input's output


def test_channels_last_input_equals_the_definition_and_stays_channels_last():
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1)
    recipe = FP8Recipe(scaling="current")
    fp8 = FP8Conv2d.from_conv(copy.deepcopy(conv), recipe)
    x = torch.randn(2, 32, 8, 8).contiguous(memory_format=torch.channels_last)
    dy = (torch.randn(2, 32, 8, 8) * 1e-2).contiguous(memory_format=torch.channels_last)
    y = _check_definition(conv, fp8, x, dy, recipe)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert conv(x).is_contiguous(memory_format=torch.channels_last)  # as nn.Conv2d's output


@pytest.mark.parametrize("stride", [1, 2])
def test_under_bf16_autocast_every_gemm_is_rounded_once_to_bf16(stride):
    """Both input-gradient forms (a convolution of dy at stride 1, col2im when strided) round once to the compute
    dtype, like the forward and weight-gradient GEMMs."""
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, stride=stride, padding=1)
    recipe = FP8Recipe(scaling="current")
    fp8 = FP8Conv2d.from_conv(copy.deepcopy(conv), recipe)
    x = torch.randn(2, 32, 8, 8)
    dy = (torch.randn(conv(x).shape) * 1e-2).to(torch.bfloat16)
    _check_definition(conv, fp8, x, dy, recipe, autocast=True)
    assert fp8.weight.grad.dtype == torch.float32


def test_mellempudi_recipe_e5m2_everywhere_with_stochastic_gradient_rounding():
    """The `mellempudi` preset: E5M2 operands, gradients unscaled (loss scaling instead) and rounded stochastically
    with noise drawn when backward starts, reproduced here from the same seed."""
    torch.manual_seed(0)
    recipe = get_preset("mellempudi")
    conv = nn.Conv2d(16, 32, 3, padding=1)
    fp8 = FP8Conv2d.from_conv(copy.deepcopy(conv), recipe)
    x = torch.randn(2, 16, 6, 6, requires_grad=True)
    y = fp8(x)
    dy = torch.randn(y.shape) * 1e-3
    torch.manual_seed(7)
    y.backward(dy)
    torch.manual_seed(7)
    dy2d = dy.permute(0, 2, 3, 1).reshape(-1, 32)  # the GEMM's (N*Ho*Wo, O) operand the noise is drawn for
    noise = torch.rand(dy2d.shape)
    gq = quantize(dy2d, torch.ones(()), E5M2, "stochastic", noise=noise).double()
    gq = gq.view(2, 6, 6, 32).permute(0, 3, 1, 2)
    nearest = _fp8(dy, E5M2, scaled=False)
    assert not torch.equal(gq, nearest)  # the rounding is stochastic indeed
    xq, wq = _fp8(x, E5M2), _fp8(conv.weight, E5M2)
    y_ref, dx_ref, dw_ref, _ = _reference(conv, xq, wq, gq, conv.bias.detach().double())
    _, dx_mag, dw_mag, _ = _reference(conv, xq.abs(), wq.abs(), gq.abs(), conv.bias.detach().double().abs())
    _within(x.grad, dx_ref, dx_mag, 32 * 9)
    _within(fp8.weight.grad, dw_ref, dw_mag, 2 * 36)


def _cols(x, conv):
    """The unfolded input in the layer's column order (kh, kw, c), built with torch's own unfold."""
    n, c = x.shape[:2]
    kh, kw = conv.kernel_size
    u = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)  # (N, C*kh*kw, L), (c, kh, kw) order
    return u.view(n, c, kh * kw, -1).permute(0, 3, 2, 1).reshape(-1, kh * kw * c)


def _fold(dcols, x_shape, conv):
    n, c, h, w = x_shape
    kh, kw = conv.kernel_size
    u = dcols.view(n, -1, kh * kw, c).permute(0, 3, 2, 1).reshape(n, c * kh * kw, -1)
    return F.fold(u, (h, w), conv.kernel_size, conv.dilation, conv.padding, conv.stride)


def _tiled(t, tile):
    q, scale_inv, _ = quantize_tiles(t.detach().float(), tile, E4M3)
    return dequantize_tiles(q, scale_inv, tile).double()


@pytest.mark.parametrize("scaling,block,groups,dilation",
                         [("rowwise", 128, 1, 1), ("blockwise", 32, 1, 1), ("blockwise", 32, 2, 2)])
def test_fine_grained_conv_equals_its_definition(scaling, block, groups, dilation):
    """Rowwise / blockwise scales are per tile of the GEMM operands, so the definition unfolds first (torch's unfold,
    columns in the layer's (kh, kw, c) order) and casts the unfolded matrices tile by tile, each group's on its own
    (its GEMMs are its own); the input gradient folds the columns' gradient back (torch's fold)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 48, 3, stride=2, padding=1, groups=groups, dilation=dilation)
    recipe = FP8Recipe(scaling=scaling, block_size=block)
    fp8 = FP8Conv2d.from_conv(copy.deepcopy(conv), recipe)
    x = torch.randn(2, 32, 9, 9, requires_grad=True)
    y = fp8(x)
    dy = torch.randn(y.shape) * 1e-2
    y.backward(dy)
    x_tile, x_tile_t = operand_tiles(scaling, block, "input")
    w_tile, w_tile_t = operand_tiles(scaling, block, "weight")
    g_tile, g_tile_t = operand_tiles(scaling, block, "grad_output")
    n, _, ho, wo = y.shape
    cg, og = 32 // groups, 48 // groups
    as_nchw = lambda t: t.view(n, ho, wo, -1).permute(0, 3, 1, 2)  # noqa: E731
    dw_layer = fp8.weight.grad.permute(0, 2, 3, 1)
    for g in range(groups):
        ins, outs = slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)
        cols = _cols(x.detach()[:, ins], conv)
        wm = conv.weight.detach()[outs].permute(0, 2, 3, 1).reshape(og, -1)
        g2d = dy[:, outs].permute(0, 2, 3, 1).reshape(-1, og)
        b = conv.bias.detach()[outs].double()

        def gemms(cols, wm, g2d, bias, q):
            y = q(cols, x_tile) @ q(wm, w_tile).t() + bias
            dcols = q(g2d, g_tile) @ q(wm.t(), w_tile_t).t()
            dw = q(g2d.t(), g_tile_t) @ q(cols.t(), x_tile_t).t()
            return y, _fold(dcols, (n, cg, 9, 9), conv), dw

        y_ref, dx_ref, dw_ref = gemms(cols, wm, g2d, b, _tiled)
        y_mag, dx_mag, dw_mag = gemms(cols, wm, g2d, b.abs(), lambda t, tile: _tiled(t, tile).abs())
        _within(y[:, outs], as_nchw(y_ref), as_nchw(y_mag), wm.shape[1] + 1)
        _within(x.grad[:, ins], dx_ref, dx_mag, og * 9)
        _within(dw_layer[outs].reshape(og, -1), dw_ref, dw_mag, n * ho * wo)


def test_saves_the_input_in_fp8_for_backward():
    """A 3x3 FP8 convolution keeps its input in FP8 (1 byte per element, with its zero border), not the unfolded
    input (9 bytes) nor the float32 input nn.Conv2d keeps (4 bytes)."""
    conv = FP8Conv2d.from_conv(nn.Conv2d(32, 32, 3, padding=1), FP8Recipe())
    x = torch.randn(4, 32, 16, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        conv(x)
    params = {p.untyped_storage().data_ptr() for p in conv.parameters()}
    new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
           if t.untyped_storage().data_ptr() not in params}
    assert sum(new.values()) <= 4 * 32 * 18 * 18 + 64  # the padded FP8 input and the scales' bytes
    assert any(t.dtype == torch.float8_e4m3fn and t.shape == (4, 18, 18, 32) for t in saved)


def test_disabled_or_autocast_off_layer_is_exactly_nn_conv():
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 32, 3, padding=1, groups=2)
    fp8 = FP8Conv2d.from_conv(copy.deepcopy(conv))
    x = torch.randn(2, 16, 8, 8)
    with fp8_autocast(enabled=False):
        assert torch.equal(fp8(x), conv(x))
    fp8.fp8_enabled = False
    assert torch.equal(fp8(x), conv(x))
    fp8.fp8_enabled = True
    assert not torch.equal(fp8(x), conv(x))  # in FP8 it differs: the operands are cast


def test_unbatched_input_and_eval_forward_leave_the_state_alone():
    conv = FP8Conv2d.from_conv(nn.Conv2d(16, 16, 3, padding=1))
    history = conv.fp8_meta.amax_history.clone()
    conv.eval()
    y = conv(torch.randn(16, 5, 5))
    assert y.shape == (16, 5, 5)
    assert torch.equal(conv.fp8_meta.amax_history, history)  # evaluation casts use current scaling, record nothing
    conv.train()
    conv(torch.randn(1, 16, 5, 5))
    # a training forward records the input's and the weight's amax (the gradient's comes with backward)
    assert conv.fp8_meta.amax_history[:2, 0].gt(0).all() and conv.fp8_meta.amax_history[2, 0] == 0


# ------------------------------------------------------------------------------------------------------------------
# CUDA (unverified until a GPU session runs `pytest -m cuda`): the same definitions through torch._scaled_mm
# ------------------------------------------------------------------------------------------------------------------
CUDA_GEOMETRIES = [g for g in GEOMETRIES if g[0] in ("3x3", "stride2", "groups", "pointwise_stride2", "conv1d")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,build,shape", CUDA_GEOMETRIES, ids=[g[0] for g in CUDA_GEOMETRIES])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_scaled_mm_conv_equals_its_definition(name, build, shape, channels_last):
    """On FP8 tensor cores every GEMM of the convolution (the unfolded operands in the layouts _scaled_mm takes: the
    column-major im2col and weight matrices, which tests/test_cuda_contract.py checks on CPU, and dy^T from the
    Triton cast where triton is installed) equals the definition within the float32 summation bound (fast
    accumulation off: it accumulates in less than float32)."""
    from lightning_fp8.kernels.device import profile_of

    if not profile_of(torch.device("cuda")).fp8_tensor_cores:
        pytest.skip("GPU without FP8 tensor cores")
    torch.manual_seed(0)
    conv = build().cuda()
    recipe = FP8Recipe(scaling="current", backend="scaled_mm", fast_accum_forward=False)
    fp8 = (FP8Conv1d if isinstance(conv, nn.Conv1d) else FP8Conv2d).from_conv(copy.deepcopy(conv), recipe)
    x = torch.randn(shape, device="cuda")
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    dy = torch.randn(conv(x).shape, device="cuda") * 1e-2
    _check_definition(conv, fp8, x, dy, recipe)
