"""Convolutions in conversion: what converts by default and why the others stay in BF16 (channels not multiples of
16, depthwise, transposed and 3-D convolutions, recurrent layers, subclasses with their own forward, lazy modules),
the first/last rule over convolutions, the conversion summary, and transformers' ResNet-18 (the issue's model)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8 import FP8Conv1d, FP8Conv2d, FP8Layer, FP8Linear, FP8Recipe, convert_to_fp8, precision_map, revert_fp8
from lightning_fp8.conversion import auto_filter, conversion_summary
from lightning_fp8.conversion.shape_filter import CONVOLUTION_NOTE

transformers = pytest.importorskip("transformers")

NO_FIRST_LAST = FP8Recipe(keep_first_last_in_bf16=False)


class StandardizedConv(nn.Conv2d):
    """A convolution with its own forward (weight standardization): converting it would drop that forward."""

    def forward(self, x):
        w = self.weight
        return self._conv_forward(x, (w - w.mean()) / (w.std() + 1e-5), self.bias)


def _zoo():
    return nn.ModuleDict({
        "stem": nn.Conv2d(3, 32, 3),
        "aligned": nn.Conv2d(32, 64, 3, padding=1),
        "depthwise": nn.Conv2d(64, 64, 3, groups=64),
        "grouped": nn.Conv2d(64, 64, 3, groups=4),  # 16 channels per group
        "grouped_narrow": nn.Conv2d(64, 64, 1, groups=8),  # 8 per group
        "unaligned_out": nn.Conv2d(64, 40, 1),
        "reflect": nn.Conv2d(32, 32, 3, padding=1, padding_mode="reflect"),
        "circular_same": nn.Conv2d(32, 32, 5, padding="same", padding_mode="circular"),
        "conv1d": nn.Conv1d(32, 64, 3),
        "transposed": nn.ConvTranspose2d(64, 64, 2),
        "conv3d": nn.Conv3d(16, 16, 3),
        "lstm": nn.LSTM(32, 64),
        "gru": nn.GRU(32, 48, num_layers=2, bidirectional=True),
        "standardized": StandardizedConv(32, 32, 3),
        "lazy": nn.LazyConv2d(32, 3),
    })


def _as_preview(precision: str) -> str:
    """What a preview (`precision_map` before `convert_to_fp8`) says of a layer that converted to `precision`."""
    return "would-fp8" if precision == "fp8" else precision


def test_every_convolution_converts_or_says_why_not():
    model = _zoo()
    preview = {r.fqn: r for r in precision_map(model, NO_FIRST_LAST)}
    convert_to_fp8(model, NO_FIRST_LAST, verbose=False)
    rows = {r.fqn: r for r in precision_map(model)}
    assert {f: r.precision for f, r in preview.items()} == {f: _as_preview(r.precision) for f, r in rows.items()}
    fp8 = sorted(f for f, r in rows.items() if r.precision == "fp8")
    assert fp8 == ["aligned", "circular_same", "conv1d", "grouped", "reflect"]
    assert type(model["aligned"]) is FP8Conv2d and type(model["conv1d"]) is FP8Conv1d
    assert isinstance(model["grouped"], nn.Conv2d) and model["grouped"].groups == 4
    reasons = {f: r.reason for f, r in rows.items() if r.precision != "fp8"}
    assert reasons["stem"] == "in/out channels 3x32 are not multiples of 16 (FP8 GEMMs need 16-aligned dimensions)"
    assert reasons["depthwise"].startswith("depthwise convolution (groups=64): each channel is its own GEMM of K = 9")
    assert reasons["grouped_narrow"].startswith("in/out channels per group 8x8 are not multiples of 16")
    assert reasons["unaligned_out"].startswith("in/out channels 64x40 are not multiples of 16")
    assert reasons["transposed"].startswith("transposed convolution: no FP8 path")
    assert reasons["conv3d"].startswith("3-D convolution: no FP8 path")
    assert reasons["lstm"].startswith("recurrent layer (LSTM): its input and hidden projections run inside one fused")
    assert reasons["gru"].startswith("recurrent layer (GRU)")
    assert "replaces Conv2d.forward or _conv_forward" in reasons["standardized"]
    assert reasons["lazy"].startswith("LazyConv2d not initialized yet")
    # what the summary counts: multiply-adds per output position for convolutions, per token for recurrent layers
    assert rows["aligned"].flops_per_token == 32 * 9 * 64 and rows["grouped"].flops_per_token == 16 * 9 * 64
    assert rows["lstm"].family == "recurrent" and rows["lstm"].flops_per_token == 4 * 64 * (32 + 64)
    assert rows["gru"].flops_per_token == 2 * 3 * 48 * (32 + 48) + 2 * 3 * 48 * (96 + 48)
    text = conversion_summary(model).text()
    assert "5 of 13 convolutions run in FP8" in text and "lstm: recurrent layer (LSTM)" in text


def test_converted_convolutions_keep_parameters_and_revert_to_their_class():
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv1d(32, 32, 1))
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    convert_to_fp8(model, NO_FIRST_LAST, verbose=False)
    assert isinstance(model[0], FP8Conv2d) and isinstance(model[0], nn.Conv2d)
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    revert_fp8(model)
    assert type(model[0]) is nn.Conv2d and type(model[2]) is nn.Conv1d
    assert [id(p) for p in model.parameters()] == params
    assert model[0].padding == (1, 1) and model[2].kernel_size == (1,)


def test_each_fp8_convolution_runs_its_three_gemms_per_group_in_fp8():
    from support.hf_models import CountFP8Gemms

    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1, groups=2))
    convert_to_fp8(model, NO_FIRST_LAST, verbose=False)
    counter = CountFP8Gemms()
    with counter:
        model(torch.randn(2, 16, 6, 6, requires_grad=True)).sum().backward()
    assert counter.count == 3 + 3 * 2  # forward, input gradient, weight gradient; one GEMM per group


def test_first_and_last_convolutions_stay_in_bf16_in_forward_order():
    """The stem here is 16-aligned, so it is the first convolution; the head is an aligned linear: the last layer."""
    model = nn.Sequential(nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.ReLU(), nn.Conv2d(32, 32, 1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 16))
    rows = {r.fqn: r for r in precision_map(model, example_input=torch.zeros(1, 16, 8, 8))}
    assert rows["0"].reason == "first convolution kept in BF16 (recipe.keep_first_last_in_bf16; forward order, traced)"
    assert rows["7"].reason == "last linear layer kept in BF16 (recipe.keep_first_last_in_bf16; forward order, traced)"
    assert rows["2"].precision == rows["4"].precision == "would-fp8"  # a preview: the model is not converted


def test_shape_filter_leaves_convolutions_to_the_default_rules():
    """The shape filter's speed model takes tokens per step as the GEMM's M, which a convolution does not have."""
    model = nn.Sequential(nn.Conv2d(32, 32, 3), nn.Conv2d(32, 20, 1))
    chosen = auto_filter(tokens_per_batch=4096, device="H100")
    convert_to_fp8(model, module_filter=chosen, verbose=False)
    assert isinstance(model[0], FP8Conv2d) and chosen.decisions["0"] == (True, CONVOLUTION_NOTE)
    assert not isinstance(model[1], FP8Layer) and "not multiples of 16" in chosen.decisions["1"][1]


def _resnet18():
    config = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                       num_labels=10)
    return transformers.ResNetForImageClassification(config)


def test_transformers_resnet18_runs_17_of_its_20_convolutions_in_fp8():
    """The issue's model: the stem (3 input channels), the first and last convertible convolutions (first/last rule,
    found by a traced forward of a 224 x 224 example image on the meta device) and the classifier (512 -> 10) stay in
    BF16; every other convolution is an FP8Conv2d (tests/test_conv_training.py trains it)."""
    torch.manual_seed(0)
    model = _resnet18()
    preview = {r.fqn: (r.precision, r.reason) for r in precision_map(model)}
    convert_to_fp8(model, verbose=False)
    rows = {r.fqn: r for r in precision_map(model)}
    assert {f: _as_preview(r.precision) for f, r in rows.items()} == {f: p for f, (p, _) in preview.items()}
    convs = [r for r in rows.values() if r.family == "convolution"]
    assert len(convs) == 20 and sum(r.precision == "fp8" for r in convs) == 17
    bf16 = {f: r.reason for f, r in rows.items() if r.precision == "bf16"}
    assert bf16 == {
        "resnet.embedder.embedder.convolution":
            "in/out channels 3x64 are not multiples of 16 (FP8 GEMMs need 16-aligned dimensions)",
        "resnet.encoder.stages.0.layers.0.layer.0.convolution":
            "first convolution kept in BF16 (recipe.keep_first_last_in_bf16; forward order, traced)",
        "resnet.encoder.stages.3.layers.1.layer.1.convolution":
            "last convolution kept in BF16 (recipe.keep_first_last_in_bf16; forward order, traced)",
        "classifier.1": "in/out features 512x10 are not multiples of 16 (FP8 GEMMs need 16-aligned dimensions)",
    }
    assert all(isinstance(model.get_submodule(r.fqn), FP8Conv2d) for r in convs if r.precision == "fp8")


def _recipe_with_scaling(scaling, **kwargs):
    """An FP8Recipe whose scaling is one FP8 convolutions have no path for (as a scaling another version of FP8Recipe
    accepts would be): set past the recipe's own validation."""
    recipe = FP8Recipe(**kwargs)
    object.__setattr__(recipe, "scaling", scaling)
    return recipe


def test_a_scaling_convolutions_have_no_path_for_keeps_them_in_bf16_and_the_layer_refuses_it():
    """Convolutions run delayed / current (per-tensor path) and rowwise / blockwise (tiled path) only. Before, the
    layer dispatched on `recipe.fine_grained` alone, so any other scaling silently took the per-tensor path; now
    conversion keeps such a convolution in BF16 with the reason (whatever the filter or a layer_recipes entry
    says), and an FP8 convolution handed one refuses it, naming the valid choices."""
    unknown = _recipe_with_scaling("nvfp4", keep_first_last_in_bf16=False)
    why = ("FP8Recipe.scaling='nvfp4': nn.Conv2d has no FP8 path for it (valid choices: ['delayed', 'current', "
           "'rowwise', 'blockwise'])")
    for kwargs in ({}, {"module_filter": lambda m, fqn: True}):
        model = nn.Sequential(nn.Conv2d(32, 64, 3), nn.Conv2d(64, 64, 1))
        convert_to_fp8(model, unknown, verbose=False, **kwargs)
        assert {r.fqn: (r.precision, r.reason) for r in precision_map(model)} == {"0": ("bf16", why),
                                                                                 "1": ("bf16", why)}
    model = nn.Sequential(nn.Conv2d(32, 64, 3), nn.Conv2d(64, 64, 1))
    convert_to_fp8(model, NO_FIRST_LAST, layer_recipes={"1": unknown}, verbose=False)
    rows = {r.fqn: (r.precision, r.reason) for r in precision_map(model)}
    assert rows["0"][0] == "fp8" and rows["1"] == ("bf16", why)
    layer = FP8Conv2d.from_conv(nn.Conv2d(32, 64, 3), unknown)
    with pytest.raises(ValueError, match=r"scaling='nvfp4' has no convolution path; valid choices: \['delayed', "
                                         r"'current', 'rowwise', 'blockwise'\]"):
        layer(torch.randn(1, 32, 5, 5))


@pytest.mark.parametrize("recipe, why", [
    (FP8Recipe(scaling="mxfp8", keep_first_last_in_bf16=False), "FP8Recipe.scaling='mxfp8'"),
    (FP8Recipe(scaling="nvfp4", keep_first_last_in_bf16=False), "FP8Recipe.scaling='nvfp4'"),
    (FP8Recipe(weight_grad="high_precision", keep_first_last_in_bf16=False), "FP8Recipe.weight_grad='high_precision'"),
])
def test_microscaled_recipes_and_high_precision_weight_gradients_keep_convolutions_in_bf16(recipe, why):
    """The recipes of docs/numerics.md's MXFP8 / NVFP4 section and weight_grad="high_precision" have no convolution
    path (FP8Conv2d.fp8_scalings, fp8_weight_grads): a convolution stays BF16 with the reason, next to linears that
    run them, and an FP8 convolution handed such a recipe refuses it instead of computing something else."""
    model = nn.Sequential(nn.Conv2d(32, 64, 3), nn.Flatten(), nn.Linear(64 * 9, 64))
    convert_to_fp8(model, recipe, verbose=False)
    rows = {r.fqn: r for r in precision_map(model)}
    assert rows["0"].precision == "bf16" and rows["0"].reason.startswith(why + ": nn.Conv2d has no FP8 path")
    assert rows["2"].precision == "fp8"
    layer = FP8Conv2d.from_conv(nn.Conv2d(32, 64, 3), recipe)
    with pytest.raises(ValueError, match="has no convolution path; valid choices"):
        layer(torch.randn(1, 32, 5, 5))


class Patchify(nn.Linear):
    """A ViT patch embedding written as a linear over flattened p x p patches: a convolution with stride = kernel,
    and an nn.Linear subclass with its own forward."""

    def __init__(self, channels, dim, p):
        super().__init__(channels * p * p, dim)
        self.p = p

    def forward(self, x):
        return super().forward(F.unfold(x, self.p, stride=self.p).transpose(1, 2))


class FP8Patchify(FP8Linear):
    """Its FP8 layer: the same unfold, then FP8Linear's GEMMs."""

    def forward(self, x):
        return super().forward(F.unfold(x, self.p, stride=self.p).transpose(1, 2))


class FP8StandardizedConv(FP8Conv2d, StandardizedConv):
    """StandardizedConv's FP8 layer: FP8Conv2d's GEMMs on the standardized weight."""

    def fp8_weight(self):
        w = self.weight
        return (w - w.mean()) / (w.std() + 1e-5)


def _with_patch(layer, module):
    layer.p = module.p
    return layer


def test_registered_kinds_of_subclasses_with_their_own_forward_convert_and_count_as_their_family(monkeypatch):
    """A user's kind for a convolution (or linear) subclass with its own forward: before, linear_kind returned None
    for any nn.Conv2d / nn.Linear subclass that replaced forward, before registered kinds were consulted, skipped every
    registered kind of family "convolution", and family() called a converted non-FP8ConvNd layer "linear"."""
    from lightning_fp8.conversion import layer_kinds

    monkeypatch.setattr(layer_kinds, "_KINDS", list(layer_kinds._KINDS))  # register_linear_kind's additions end with the test
    here = __name__
    layer_kinds.register_linear_kind(layer_kinds.LinearKind(
        label="standardized conv", source=f"{here}.StandardizedConv", fp8_class=f"{here}:FP8StandardizedConv",
        features=layer_kinds._conv_features, build=lambda cls, m, r: cls.from_conv(m, r), family="convolution",
        weight_shape=layer_kinds._conv_weight_shape))
    layer_kinds.register_linear_kind(layer_kinds.LinearKind(
        label="patchify", source=f"{here}.Patchify", fp8_class=f"{here}:FP8Patchify",
        features=lambda m: (m.in_features, m.out_features),
        build=lambda cls, m, r: _with_patch(cls.from_linear(m, r), m), family="convolution"))
    torch.manual_seed(0)
    model = nn.ModuleDict({"patch": Patchify(16, 32, 2), "std": StandardizedConv(32, 32, 3),
                           "grouped_narrow": StandardizedConv(32, 32, 1, groups=4)})
    images, maps = torch.randn(2, 16, 8, 8), torch.randn(2, 32, 6, 6)
    reference = model["patch"](images), model["std"](maps)
    convert_to_fp8(model, NO_FIRST_LAST, verbose=False)
    rows = {r.fqn: r for r in precision_map(model)}
    assert isinstance(model["patch"], FP8Patchify) and isinstance(model["std"], FP8StandardizedConv)
    assert {f: (r.precision, r.family) for f, r in rows.items()} == {
        "patch": ("fp8", "convolution"), "std": ("fp8", "convolution"), "grouped_narrow": ("bf16", "convolution")}
    assert rows["grouped_narrow"].reason.startswith("in/out channels per group 8x8 are not multiples of 16")
    assert rows["patch"].module_type == "patchify" and layer_kinds.family(model["patch"]) == "convolution"
    outputs = model["patch"](images), model["std"](maps)
    for out, ref in zip(outputs, reference):  # the subclasses' own computation, in FP8 (E4M3: ~3 % relative error)
        assert out.shape == ref.shape and ((out - ref).norm() / ref.norm()).item() < 0.1
