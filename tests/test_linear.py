"""FP8Linear: accuracy (SQNR), memory held for backward, state_dict, precision switches."""
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.helpers import sqnr_db
from lightning_fp8 import FP8Linear, FP8Recipe, fp8_autocast, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.numerics import scale_from_amax

# (tokens, in_features, out_features): a GPT-2-small MLP up-projection and attention projection, a larger FFN
SHAPES = [(512, 768, 3072), (256, 1024, 1024), (256, 2048, 512)]


def _run(layer, x):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    grad_out = torch.randn_like(y) * 1e-2
    y.backward(grad_out)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sqnr_against_fp32_linear(shape, scaling):
    """Thresholds are torchao's published ones: output >= 25 dB, gradients >= 20 dB (E5M2 has one mantissa bit
    less than E4M3, so the gradient GEMMs lose ~6 dB)."""
    m, k, n = shape
    ref = nn.Linear(k, n)
    fp8 = FP8Linear.from_linear(nn.Linear(k, n), FP8Recipe(scaling=scaling))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(m, k)
    torch.manual_seed(1)
    y_ref, dx_ref, dw_ref = _run(ref, x)
    torch.manual_seed(1)
    y, dx, dw = _run(fp8, x)
    assert sqnr_db(y_ref, y) >= 25
    assert sqnr_db(dx_ref, dx) >= 20
    assert sqnr_db(dw_ref, dw) >= 20
    assert torch.allclose(fp8.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-6)


def test_output_dtype_follows_autocast_and_grads_follow_inputs():
    layer = FP8Linear(64, 32)
    x = torch.randn(2, 8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8, 32)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert layer(x).dtype == torch.float32  # no autocast: input dtype


def _saved_bytes(layer, x):
    """Bytes of tensors saved for backward that are new allocations: a saved Parameter, or a view of one (nn.Linear
    saves weight.t()), shares the Parameter's storage and is not counted; each new storage is counted once."""
    param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen = set()
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_storages and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
    return total


def test_saves_input_in_fp8_for_backward():
    """Counting only new allocations, FP8Linear holds <= 0.55x what a BF16 nn.Linear holds for backward.
    Measured: 0.17x against nn.Linear under autocast (which saves bf16 copies of x and of the weight), 0.50x against
    an nn.Linear with bf16 parameters (which saves x in bf16 only)."""
    k, n = 1024, 4096
    x = torch.randn(8, 256, k, requires_grad=True)
    bf16 = _saved_bytes(nn.Linear(k, n), x)
    fp8 = _saved_bytes(FP8Linear(k, n), x)
    assert bf16 >= x.numel() * 2  # bf16 copy of x (and of the weight, under autocast)
    assert fp8 <= 0.55 * bf16, (fp8, bf16)
    # and for a layer whose parameters are already BF16 (no autocast weight copy): x in bf16 vs x in fp8
    x16 = x.detach().bfloat16().requires_grad_(True)
    bf16_params = _saved_bytes(nn.Linear(k, n, dtype=torch.bfloat16), x16)
    fp8_params = _saved_bytes(FP8Linear(k, n, dtype=torch.bfloat16), x16)
    assert fp8_params <= 0.55 * bf16_params, (fp8_params, bf16_params)


def test_disabled_layer_is_exactly_nn_linear():
    layer = FP8Linear(32, 16)
    x = torch.randn(4, 32)
    layer.fp8_enabled = False
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.fp8_enabled = True
    assert not torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with fp8_autocast(enabled=False):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast(enabled=False):
        assert layer(x).dtype == torch.bfloat16


def test_fp8_autocast_recipe_override():
    layer = FP8Linear(32, 16)
    x = torch.randn(4, 32)
    with fp8_autocast(recipe=FP8Recipe(format="e5m2")):
        y5 = layer.eval()(x)
    y4 = layer(x)
    assert not torch.equal(y4, y5)
    with pytest.raises(TypeError):
        with fp8_autocast(recipe="hybrid"):
            pass


def _train_steps(layer, steps=3):
    for _ in range(steps):
        layer(torch.randn(8, layer.in_features)).sum().backward()


def test_state_dict_round_trip_is_exact_and_loads_weights_only():
    layer = FP8Linear(32, 16)
    _train_steps(layer)
    sd = layer.state_dict()
    assert set(sd) == {"weight", "bias"}  # the keys of nn.Linear: loads into a plain nn.Linear
    nn.Linear(32, 16).load_state_dict(sd)
    meta = fp8_state_dict(layer)
    assert set(meta) == {"fp8_meta.amax_history", "fp8_meta.overflow_count", "fp8_meta.clip_count", "fp8_meta.enabled"}
    buf = io.BytesIO()
    torch.save({"model": sd, "fp8": meta}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    other = FP8Linear(32, 16)
    other.load_state_dict(loaded["model"])
    load_fp8_state_dict(other, loaded["fp8"])
    for key, value in layer.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), key
    other_meta = fp8_state_dict(other)
    for key, value in meta.items():
        assert torch.equal(value, other_meta[key]), key


def test_state_dict_with_fp8_metadata_from_an_earlier_version_still_loads():
    layer = FP8Linear(32, 16)
    _train_steps(layer)
    old_format = {**layer.state_dict(), **fp8_state_dict(layer)}
    other = FP8Linear(32, 16)
    other.load_state_dict(old_format)  # strict
    assert torch.equal(other.fp8_meta.input.amax_history, layer.fp8_meta.input.amax_history)


def test_plain_linear_checkpoint_loads_into_fp8_linear():
    plain = nn.Linear(32, 16)
    layer = FP8Linear(32, 16)
    layer.load_state_dict(plain.state_dict())  # strict: missing FP8 metadata is initialised, not an error
    assert torch.equal(layer.weight, plain.weight)
    assert layer.fp8_meta.input.scale.item() == 1.0 and layer.fp8_enabled


def test_precision_switch_survives_checkpoint():
    layer = FP8Linear(32, 16)
    layer.fp8_enabled = False
    other = FP8Linear(32, 16)
    load_fp8_state_dict(other, fp8_state_dict(layer))
    assert other.fp8_enabled is False


def test_delayed_scales_update_once_per_step():
    layer = FP8Linear(32, 16)
    x = torch.randn(8, 32) * 10
    layer(x).sum().backward()
    assert not layer.fp8_meta.input.initialized  # first step: current scaling, nothing updated yet
    layer(x).sum().backward()  # the second forward closes step 1
    state = layer.fp8_meta.input
    expected = scale_from_amax(x.abs().max(), 448.0, 0, 1.0, layer.recipe.power_of_2_scales)
    assert state.initialized and state.scale.item() == expected.item()
    assert state.amax_history[1].item() == x.abs().max().item()


def test_eval_forward_does_not_touch_scaling_state():
    layer = FP8Linear(32, 16)
    _train_steps(layer, 2)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(4, 32) * 100)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


def test_from_linear_reuses_parameters():
    linear = nn.Linear(32, 16)
    layer = FP8Linear.from_linear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias


def test_calibration_observes_amax_without_counting_clips_and_survives_nesting():
    layer = FP8Linear(32, 16)
    x = torch.randn(8, 32) * 1000  # far beyond 448 at the initial scale of 1, but nothing is cast
    with fp8_autocast(calibrating=True), fp8_autocast(enabled=True):  # a nested step context keeps calibrating
        y = layer(x)
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))  # high precision while calibrating
    state = layer.fp8_meta.input
    assert state.amax_history[0].item() == x.abs().max().item()
    assert state.clip_count.item() == 0 and state.overflow_count.item() == 0
    layer.reset_fp8_state()
    assert state.amax_history.abs().sum() == 0 and not state.initialized


def test_frozen_weight_still_gets_input_gradient_and_saves_less():
    layer = FP8Linear(64, 32)
    layer.weight.requires_grad_(False)
    x = torch.randn(16, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and layer.weight.grad is None
    # no transposed copy of x is kept when no weight gradient will be computed
    x3 = torch.randn(4, 64, 64, requires_grad=True)
    assert _saved_bytes(layer, x3) < _saved_bytes(FP8Linear(64, 32), x3)
