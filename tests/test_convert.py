"""convert_to_fp8 / revert_fp8: default filter with reasons, user filter, idempotence, Parameters kept."""
import copy

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, FP8Recipe, convert_to_fp8, fp8_autocast, fp8_state_dict, precision_map, revert_fp8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.qkv = nn.Linear(64, 192)
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)
        self.odd = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model():
    return nn.Sequential(nn.Linear(64, 64), Block(), nn.Linear(64, 128))


def _reasons(model):
    return {row.fqn: (row.precision, row.reason) for row in precision_map(model)}


def test_default_filter_converts_and_records_every_skip_reason():
    model = convert_to_fp8(_model())
    rows = _reasons(model)
    assert rows["1.qkv"] == ("fp8", "converted")
    assert rows["1.fc1"][0] == rows["1.fc2"][0] == "fp8"
    assert "first linear" in rows["0"][1]
    assert "last linear" in rows["2"][1]
    assert "multiples of 16" in rows["1.odd"][1]
    # nn.MultiheadAttention's projections are layers of their own (tests/test_attention.py)
    assert rows["1.attn.q_proj"] == rows["1.attn.out_proj"] == ("fp8", "converted")
    assert all(reason for _, reason in rows.values())


def test_skip_patterns_and_first_last_switch():
    model = convert_to_fp8(_model(), FP8Recipe(skip_patterns=("*.qkv",), keep_first_last_in_bf16=False))
    rows = _reasons(model)
    assert rows["1.qkv"] == ("bf16", "name matches skip pattern '*.qkv'")
    assert rows["0"][0] == rows["2"][0] == "fp8"


def test_user_filter_replaces_default():
    model = convert_to_fp8(_model(), module_filter=lambda module, fqn: fqn.endswith("fc1"))
    rows = _reasons(model)
    assert [fqn for fqn, (p, _) in rows.items() if p == "fp8"] == ["1.fc1"]
    assert rows["1.fc2"][1] == "excluded by module_filter"


def test_convert_twice_is_noop_and_parameters_survive():
    model = _model()
    params = {name: p for name, p in model.named_parameters()}
    convert_to_fp8(model)
    layer = model[1].fc1
    convert_to_fp8(model)
    assert model[1].fc1 is layer
    assert {name: p for name, p in model.named_parameters()} == params
    # the state_dict keys are exactly those of the unconverted model; FP8 metadata travels in fp8_state_dict
    assert set(model.state_dict()) == set(_model().state_dict())
    assert "1.fc1.fp8_meta.amax_history" in fp8_state_dict(model)


def test_revert_restores_plain_linears():
    model = convert_to_fp8(_model())
    x = torch.randn(2, 64)
    revert_fp8(model)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    # a reverted model is an unconverted one: precision_map previews what conversion would do
    assert all(row.preview for row in precision_map(model))
    assert model(x).shape == (2, 128)


def test_bare_linear_and_invalid_recipe():
    layer = convert_to_fp8(nn.Linear(32, 32), FP8Recipe(keep_first_last_in_bf16=False))
    assert isinstance(layer, FP8Linear)
    with pytest.raises(TypeError):
        convert_to_fp8(_model(), recipe="hybrid")


def _fit(model, steps=60):
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    y = x @ torch.randn(32, 32) / 4
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


def test_converted_model_trains_like_fp32():
    """All three layers in FP8, 60 Adam steps of a linear regression.

    Measured: fp32 reaches 0.17, FP8 0.21 (1.23x), from 2.05 at the first step. FP8 is expected to be slower on such a
    precise target: E4M3 weights have 3 mantissa bits, so Adam updates smaller than half a quantization step reach
    the forward only once they accumulate. The test asks for real progress (loss below a quarter of the start)
    and at most 1.5x the fp32 loss; a wrong transpose or scale in a gradient GEMM stalls far above both.
    With fp8_autocast(enabled=False) the same model reproduces fp32 exactly (checked below)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    fp8 = convert_to_fp8(copy.deepcopy(ref), FP8Recipe(keep_first_last_in_bf16=False))
    assert sum(isinstance(m, FP8Linear) for m in fp8.modules()) == 3
    with fp8_autocast(enabled=False):
        assert _fit(copy.deepcopy(fp8)) == _fit(copy.deepcopy(ref))
    (_, ref_loss), (fp8_start, fp8_loss) = _fit(ref), _fit(fp8)
    assert fp8_loss < 0.25 * fp8_start
    assert fp8_loss <= 1.5 * ref_loss


def test_filter_object_explains_its_skips():
    class OnlyWide:
        def __call__(self, module, fqn):
            return self.skip_reason(module, fqn) is None

        def skip_reason(self, module, fqn):
            return None if module.out_features >= 256 else f"{module.out_features} outputs: too narrow to win in FP8"

    rows = _reasons(convert_to_fp8(_model(), module_filter=OnlyWide()))
    assert rows["1.fc1"] == ("fp8", "converted")
    assert rows["1.fc2"] == ("bf16", "64 outputs: too narrow to win in FP8")
