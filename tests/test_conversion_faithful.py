"""Conversion keeps what the user attached to a layer: parametrizations, hooks, requires_grad, weight tying,
attributes; and leaves alone what it cannot convert faithfully, saying why."""
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from lightning_fp8 import FP8Layer, FP8Linear, FP8Recipe, convert_to_fp8, fp8_autocast, precision_map, revert_fp8

NO_FIRST_LAST = FP8Recipe(keep_first_last_in_bf16=False)


def _mlp(norm=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    if norm is not None:
        norm(model[2])
    return model


def _train(model, steps=4, lr=1e-2):
    torch.manual_seed(1)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt


NORMS = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "hook-based weight_norm": lambda m: torch.nn.utils.weight_norm(m),
    "hook-based spectral_norm": lambda m: torch.nn.utils.spectral_norm(m),
}


@pytest.mark.parametrize("norm", list(NORMS))
def test_normalized_linear_converts_underneath_and_trains(norm):
    def converted():
        return convert_to_fp8(_mlp(NORMS[norm]), NO_FIRST_LAST, verbose=False)

    plain = _mlp(NORMS[norm])  # built afresh each time: the hook-based norms cannot be deep-copied
    names = [name for name, _ in plain.named_parameters()]
    keys = list(plain.state_dict())
    model = converted()
    assert isinstance(model[2], FP8Layer) and isinstance(model[2], nn.Linear)
    assert {row.fqn: row.precision for row in precision_map(model)}["2"] == "fp8"
    # the parametrization's Parameters (original0/original1, weight_orig, weight_g/weight_v) stay where they were
    assert [name for name, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    originals = [p for name, p in model[2].named_parameters() if name != "bias"]
    before = [p.detach().clone() for p in originals]

    # with FP8 switched off, the converted model trains exactly like the plain one: the parametrization is in the loop
    with fp8_autocast(enabled=False):
        assert _train(converted())[0] == _train(_mlp(NORMS[norm]))[0]
    losses, opt = _train(model)
    assert len(opt.param_groups[0]["params"]) == len(names)
    assert losses[-1] < losses[0]  # trains for more than one step (no "backward through the graph a second time")
    assert all(not torch.equal(b, p) for b, p in zip(before, originals))  # the originals receive gradients
    reverted = revert_fp8(model)
    assert type(reverted[2]).__name__ == type(plain[2]).__name__ and not isinstance(reverted[2], FP8Layer)
    assert [name for name, _ in reverted.named_parameters()] == names
    plain.load_state_dict(reverted.state_dict())  # the reverted model's state loads into a fresh plain one
    x = torch.randn(3, 32)
    assert torch.equal(plain.eval()(x), reverted.eval()(x))


def test_parametrization_that_changes_the_shape_stays_bf16():
    class Widen(nn.Module):  # (64, 32) stored, (64, 64) used: the layer's GEMM would not see its own features
        def forward(self, w):
            return torch.cat([w, w], dim=1)

    model = _mlp()
    model[2] = nn.Linear(32, 64)
    parametrize.register_parametrization(model[2], "weight", Widen(), unsafe=True)
    row = {r.fqn: r for r in precision_map(model, NO_FIRST_LAST)}["2"]
    assert row.precision == "bf16" and "computes shape (64, 64)" in row.reason
    convert_to_fp8(model, NO_FIRST_LAST, verbose=False)
    assert not isinstance(model[2], FP8Layer)


def test_hooks_flags_and_attributes_survive_conversion_and_revert():
    model = _mlp()
    calls = []
    layer = model[2]
    handle = layer.register_forward_hook(lambda m, i, o: calls.append(("forward", type(m).__name__)))
    layer.register_forward_pre_hook(lambda m, i: calls.append(("pre", type(m).__name__)))
    layer.register_full_backward_hook(lambda m, gi, go: calls.append(("backward", type(m).__name__)))
    layer.register_forward_hook(lambda m, a, k, o: calls.append(("kwargs", type(m).__name__)), with_kwargs=True)
    layer.register_load_state_dict_pre_hook(lambda m, *args: calls.append(("load", type(m).__name__)))
    layer.weight.requires_grad_(False)
    layer.tag = "kept"
    convert_to_fp8(model, NO_FIRST_LAST, verbose=False)
    layer = model[2]
    assert isinstance(layer, FP8Linear) and layer.tag == "kept"
    assert not layer.weight.requires_grad and layer.bias.requires_grad
    model(torch.randn(4, 32, requires_grad=True)).sum().backward()
    model.load_state_dict(model.state_dict())
    assert calls == [("pre", "FP8Linear"), ("forward", "FP8Linear"), ("kwargs", "FP8Linear"), ("backward", "FP8Linear"),
                     ("load", "FP8Linear")]
    assert layer.weight.grad is None and layer.bias.grad is not None
    handle.remove()  # a handle taken before conversion still removes its hook
    calls.clear()
    model(torch.randn(4, 32))
    assert calls == [("pre", "FP8Linear"), ("kwargs", "FP8Linear")]

    revert_fp8(model)
    calls.clear()
    layer = model[2]
    assert type(layer) is nn.Linear and layer.tag == "kept" and not layer.weight.requires_grad
    assert not hasattr(layer, "fp8_meta") and not hasattr(layer, "recipe")
    model(torch.randn(4, 32, requires_grad=True)).sum().backward()
    model.load_state_dict(model.state_dict())  # no FP8 load hook left behind (it would fail on a plain Linear)
    assert calls == [("pre", "Linear"), ("kwargs", "Linear"), ("backward", "Linear"), ("load", "Linear")]


def test_weight_tying_and_shared_modules_survive():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(32, 64)
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)
            self.b.weight = self.a.weight  # tied Parameters
            self.shared = nn.Linear(64, 64)
            self.again = self.shared  # one module under two names
            self.out = nn.Linear(64, 32)

        def forward(self, x):
            h = self.inp(x)
            return self.out(self.again(self.shared(self.b(self.a(h)))))

    model = Tied()
    n_params = len(list(model.parameters()))
    convert_to_fp8(model, verbose=False)
    assert model.a.weight is model.b.weight and isinstance(model.a, FP8Linear) and isinstance(model.b, FP8Linear)
    assert model.shared is model.again and isinstance(model.shared, FP8Linear)
    assert len(list(model.parameters())) == n_params
    model(torch.randn(8, 32)).sum().backward()
    revert_fp8(model)
    assert model.shared is model.again and type(model.shared) is nn.Linear and model.a.weight is model.b.weight


def test_a_linear_subclass_that_keeps_the_forward_stays_an_instance_of_its_class():
    class InitOnly(nn.Linear):  # like transformers' EsmFoldLinear: its own init and methods, nn.Linear's forward
        def describe(self):
            return f"{self.in_features}->{self.out_features}"

    model = nn.Sequential(nn.Linear(32, 64), InitOnly(64, 64), nn.Linear(64, 32))
    parametrizations.weight_norm(model[1])
    convert_to_fp8(model, NO_FIRST_LAST, verbose=False)
    assert isinstance(model[1], FP8Layer) and isinstance(model[1], InitOnly) and model[1].describe() == "64->64"
    assert {r.fqn: r.module_type for r in precision_map(model)}["1"] == "nn.Linear"
    model(torch.randn(4, 32)).sum().backward()
    revert_fp8(model)
    assert parametrize.type_before_parametrizations(model[1]) is InitOnly and not isinstance(model[1], FP8Layer)


def test_layers_conversion_would_change_are_left_alone_with_a_reason():
    class Scaled(nn.Linear):  # a subclass with its own forward computes something else than nn.Linear
        def forward(self, x):
            return 2 * super().forward(x)

    class Float8Linear(nn.Linear):  # what torchao's converted layers look like, detected by name and package
        def forward(self, x):
            return super().forward(x)

    class FbgemmFp8Linear(nn.Linear):  # transformers' own FP8 integrations, detected by class name
        def forward(self, x):
            return super().forward(x)

    Float8Linear.__module__ = "torchao.float8.float8_linear"
    FbgemmFp8Linear.__module__ = "transformers.integrations.fbgemm_fp8"
    model = nn.Sequential(nn.Linear(32, 64), Scaled(64, 64), Float8Linear(64, 64), nn.Linear(64, 64),
                          nn.LazyLinear(64), nn.Conv1d(64, 64, 3), FbgemmFp8Linear(64, 64), nn.Linear(64, 32))
    wrapped = model[3]
    original_forward = wrapped.forward
    wrapped.forward = lambda x: original_forward(x) + 1  # replaced on the instance (as device-map hooks do)
    convert_to_fp8(model, verbose=False)
    rows = {row.fqn: row for row in precision_map(model)}
    assert type(model[1]) is Scaled and "replaces nn.Linear.forward" in rows["1"].reason
    assert rows["2"].precision == "fp8" and "converted to FP8 by torchao" in rows["2"].reason
    assert not isinstance(model[3], FP8Layer) and "replaced on the instance" in rows["3"].reason
    assert "LazyLinear not initialized" in rows["4"].reason
    assert rows["5"].precision == "bf16" and rows["5"].reason.startswith("convolution")
    assert rows["6"].precision == "fp8" and "converted to FP8 by transformers" in rows["6"].reason
    assert not any(isinstance(m, FP8Layer) for m in model)


def test_multihead_attention_fused_projection_is_named():
    """An attention whose projections cannot run in FP8 (40 wide: not 16-aligned) stays
    torch's own: its fused input projection and its functional out_proj are named, with why."""
    model = nn.Sequential(nn.Linear(32, 40), nn.MultiheadAttention(40, 4), nn.Linear(40, 64))
    rows = {row.fqn: row for row in precision_map(model)}
    assert rows["1"].precision == "bf16" and "in_proj_weight" in rows["1"].reason and "16" in rows["1"].reason
    assert rows["1"].flops_per_token == 3 * 40 * 40
    assert "multiples of 16" in rows["1.out_proj"].reason
    model = nn.Sequential(nn.Linear(32, 64), nn.MultiheadAttention(64, 4), nn.Linear(64, 64))
    rows = {row.fqn: row for row in precision_map(model)}
    assert [rows[f"1.{p}"].flops_per_token for p in ("q_proj", "k_proj", "v_proj", "out_proj")] == [64 * 64] * 4
