"""precision_map's dry-run preview, the first/last rule over layers sharing an input, the conversion summary, and
the precision map's account of modules conversion leaves alone."""
import logging
import lightning as L
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Layer, FP8Recipe, convert_to_fp8, precision_map, revert_fp8
from lightning_fp8.conversion import auto_filter, conversion_summary
from lightning_fp8.conversion.summary import log_conversion_summary


class Attention(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 8, dim=-1)
        return self.o(a @ self.v(x))


class TinyTransformer(nn.Module):
    def __init__(self, d=64, classes=10):
        super().__init__()
        self.head = nn.Linear(d, classes)  # registered first, runs last: only a traced forward gets it right
        self.blocks = nn.ModuleList([Attention(d), Attention(d)])
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x + self.mlp(x))


def _bf16(rows):
    return [row.fqn for row in rows if row.precision == "bf16"]


def test_first_group_is_the_layers_that_share_the_first_input_and_last_is_by_forward_order():
    model = TinyTransformer(classes=16)
    rows = precision_map(model, example_input=torch.randn(2, 5, 64))
    assert all(row.preview for row in rows)
    assert _bf16(rows) == ["head", "blocks.0.q", "blocks.0.k", "blocks.0.v"]
    assert "first linear layer kept in BF16" in {r.fqn: r.reason for r in rows}["blocks.0.q"]
    assert "reads the same input as blocks.0.q" in {r.fqn: r.reason for r in rows}["blocks.0.k"]
    # the preview is what conversion does ("would-fp8" there, "fp8" once done)
    assert {r.precision for r in rows} == {"bf16", "would-fp8"}
    convert_to_fp8(model, example_input=torch.randn(2, 5, 64), verbose=False)
    after = precision_map(model)
    assert [(r.fqn, r.precision) for r in after] == [(r.fqn, r.precision.replace("would-", "")) for r in rows]
    assert [r.reason for r in after if r.precision == "bf16"] == [r.reason for r in rows if r.precision == "bf16"]


def test_first_and_last_count_only_layers_that_would_otherwise_convert():
    model = TinyTransformer(classes=10)  # head 64 -> 10 is not 16-aligned: mlp.2 is the last convertible layer
    rows = {r.fqn: r for r in precision_map(model, example_input=torch.randn(2, 5, 64))}
    assert "multiples of 16" in rows["head"].reason
    assert "last linear layer kept in BF16" in rows["mlp.2"].reason
    assert rows["mlp.0"].precision == "would-fp8"

    class MHABlock(nn.Module):  # torchvision's ViT layout: an nn.MultiheadAttention ahead of the MLP
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
            self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64)

        def forward(self, x):
            x = self.attn(x, x, x, need_weights=False)[0]
            return self.fc3(self.fc2(self.fc1(x)))

    rows = {r.fqn: r for r in precision_map(MHABlock(), example_input=torch.randn(2, 5, 64))}
    # the attention's q, k and v projections read one tensor: they are the first group; its out_proj converts
    assert all("first linear layer" in rows[f"attn.{p}"].reason or "reads the same input" in rows[f"attn.{p}"].reason
               for p in ("q_proj", "k_proj", "v_proj"))
    assert rows["attn.out_proj"].precision == rows["fc1"].precision == rows["fc2"].precision == "would-fp8"
    block = MHABlock()  # with attention projections that cannot run in FP8, the attention stays torch's own
    block.attn = nn.MultiheadAttention(40, 4, batch_first=True)
    block.fc1 = nn.Linear(40, 128)
    rows = {r.fqn: r for r in precision_map(block, example_input=torch.randn(2, 5, 40))}
    assert "multiples of 16" in rows["attn"].reason and "multiples of 16" in rows["attn.out_proj"].reason
    assert "first linear layer" in rows["fc2"].reason  # fc1 (40 -> 128) cannot convert either


def test_without_an_example_input_the_module_order_is_used_and_said():
    rows = {r.fqn: r for r in precision_map(TinyTransformer(classes=16))}
    assert "first linear layer" in rows["head"].reason and "module order" in rows["head"].reason
    assert "no example input" in rows["head"].reason and rows["blocks.0.k"].precision == "would-fp8"


def test_lightning_example_input_array_is_traced():
    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = TinyTransformer(classes=16)
            self.example_input_array = torch.randn(2, 5, 64)

        def forward(self, x):
            return self.net(x)

    assert _bf16(precision_map(Module())) == ["net.head", "net.blocks.0.q", "net.blocks.0.k", "net.blocks.0.v"]


def test_tracing_leaves_no_state_behind():
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), nn.Linear(64, 64), nn.Linear(64, 64))
    torch.nn.utils.spectral_norm(model[3])  # stores its computed weight as a plain attribute at every forward
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 64)
    rng = torch.get_rng_state()
    precision_map(model, example_input=x)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and model.training and model[3].weight.device.type == "cpu"


def test_preview_with_a_recipe_or_filter_and_no_side_effects():
    model = TinyTransformer(classes=16)
    rows = precision_map(model, FP8Recipe(keep_first_last_in_bf16=False, skip_patterns=("mlp.*",)))
    assert _bf16(rows) == ["mlp.0", "mlp.2"]
    rows = precision_map(model, module_filter=auto_filter(4096, device="H100"))
    assert all(r.precision == "bf16" and "shape filter" in r.reason for r in rows)  # 64-wide layers lose on an H100
    assert not any(hasattr(m, "_fp8_skip_reason") for m in model.modules())
    convert_to_fp8(model, verbose=False)
    with pytest.raises(ValueError, match="converted already"):
        precision_map(model, FP8Recipe())


def test_summary_counts_linear_flops_and_is_logged_by_convert(caplog):
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 10))
    summary = conversion_summary(model)
    assert summary.preview and summary.linear_flops == 32 * 64 + 64 * 128 + 128 * 64 + 64 * 10
    with caplog.at_level(logging.INFO, logger="lightning_fp8"):
        convert_to_fp8(model)
    summary = conversion_summary(model)
    # 0 is first, 3 (64 -> 10) is unaligned, so 2 is last: only 1 converts
    assert summary.fp8_flops == 64 * 128 and not summary.preview
    assert f"1 of 4 linear layers run in FP8: {64 * 128 / summary.linear_flops:.1%}" in caplog.text
    assert "revert_fp8" in caplog.text
    assert summary.warning() is not None and "Linear x3" in summary.warning()  # 40% < half: worth a warning


def test_conv_model_warns_from_convert_to_fp8():
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.Flatten(), nn.Linear(16, 10))
    with pytest.warns(UserWarning, match="no layer runs in FP8") as caught:
        convert_to_fp8(model)
    assert "Conv2d x2" in str(caught[0].message)
    assert not any(row.preview for row in precision_map(model))  # converted, though nothing could convert


def test_layers_converted_by_other_libraries_are_reported_in_fp8():
    class LayerNormLinear(nn.Module):  # Transformer Engine's fused module, detected by package and name
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 64))
            self.in_features = self.out_features = 64

    LayerNormLinear.__module__ = "transformer_engine.pytorch.module.layernorm_linear"
    model = nn.Sequential(LayerNormLinear(), nn.Linear(64, 64))
    rows = {r.fqn: r for r in precision_map(model)}
    assert rows["0"].precision == "fp8" and "Transformer Engine" in rows["0"].reason
    assert rows["0"].flops_per_token == 64 * 64


def test_conv1d_without_transformers_and_lookalikes_are_named(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from support.hf_models import gpt2

    import lightning_fp8.modules.hf_conv1d as hf_conv1d

    class Conv1D(nn.Module):  # a vendored copy of GPT-2's layer: not the class FP8Conv1D extends
        def __init__(self, nf, nx):
            super().__init__()
            self.nf, self.nx = nf, nx
            self.weight = nn.Parameter(torch.randn(nx, nf))

    rows = {r.fqn: r for r in precision_map(nn.Sequential(nn.Linear(64, 64), Conv1D(64, 64)))}
    assert rows["1"].precision == "bf16" and "is not transformers.pytorch_utils.Conv1D" in rows["1"].reason

    monkeypatch.setattr(hf_conv1d, "FP8Conv1D", None)
    monkeypatch.setattr(hf_conv1d, "IMPORT_ERROR", "ModuleNotFoundError: No module named 'transformers'")
    model = gpt2()
    rows = [r for r in precision_map(model) if r.module_type == "Conv1D"]
    assert len(rows) == 8 and all("needs transformers" in r.reason for r in rows)
    convert_to_fp8(model, verbose=False)
    assert not any(isinstance(m, FP8Layer) and isinstance(m, transformers.pytorch_utils.Conv1D) for m in model.modules())


def test_only_the_conv1d_module_imports_transformers_and_it_is_guarded():
    """transformers is optional (torchmetrics imports it when it is installed, so a subprocess cannot show its
    absence): no module of the package imports it at import time except modules/hf_conv1d.py, inside a try (the
    absent case is test_conv1d_without_transformers_and_lookalikes_are_named); the others import it inside the
    function that needs it, which runs only for a transformers model or Trainer (modules/grouped_linear.py registering its
    implementation, the Accelerate adapter's look at a Trainer's arguments)."""
    import ast
    import pathlib

    import lightning_fp8

    at_import = []
    for path in pathlib.Path(lightning_fp8.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        in_functions = {id(node) for function in ast.walk(tree)
                        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(function)}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(name.split(".")[0] in ("transformers", "peft") for name in names) and id(node) not in in_functions:
                at_import.append(path.name)
    assert at_import == ["hf_conv1d.py"]
    source = (pathlib.Path(lightning_fp8.__file__).parent / "modules" / "hf_conv1d.py").read_text()
    assert "try:  # transformers is optional\n    from transformers.pytorch_utils import Conv1D" in source


# -- a preview is visibly a preview -------------------------------------------------------------------------------
def test_a_preview_says_would_fp8_and_only_a_converted_layer_says_fp8():
    """Before conversion nothing runs in FP8: a row conversion would make FP8 reads "would-fp8" (and `preview`), so
    `row.precision == "fp8"` is true of converted layers only; `row.fp8` answers "FP8 now or once converted"."""
    model = TinyTransformer(classes=16)
    x = torch.randn(2, 5, 64)
    rows = {r.fqn: r for r in precision_map(model, example_input=x)}
    assert rows["blocks.0.o"].precision == "would-fp8" and rows["blocks.0.o"].preview and rows["blocks.0.o"].fp8
    assert rows["blocks.0.o"].reason.startswith("would be converted (preview")
    assert rows["head"].precision == "bf16" and not rows["head"].fp8
    assert not [r for r in rows.values() if r.precision == "fp8"]
    printed = repr(list(rows.values()))  # what `print(precision_map(model))` shows
    assert "precision='would-fp8'" in printed and "precision='fp8'" not in printed
    preview_summary = conversion_summary(model)  # counts what would convert, and says "would"
    convert_to_fp8(model, example_input=x, verbose=False)
    after = {r.fqn: r for r in precision_map(model)}
    assert after["blocks.0.o"].precision == "fp8" and not after["blocks.0.o"].preview and after["blocks.0.o"].fp8
    assert sum(r.flops_per_token for r in rows.values() if r.fp8) == conversion_summary(model).fp8_flops > 0
    assert preview_summary.preview and preview_summary.fp8_flops > 0  # "would-fp8" rows count as FP8 in a preview
    assert "would run in FP8" in preview_summary.text() and "would" not in conversion_summary(model).text()


# -- one conversion summary per model -----------------------------------------------------------------------------
def test_the_summary_is_logged_once_per_model(caplog):
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32))
    with caplog.at_level(logging.INFO, logger="lightning_fp8"):
        convert_to_fp8(model)
        convert_to_fp8(model)  # a no-op: nothing new to say
        log_conversion_summary(model)  # what an adapter does with a model converted already
    assert sum("linear layers run in FP8" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_fp8"):
        revert_fp8(model)
        convert_to_fp8(model)  # converted anew: said again
        model.append(nn.Linear(32, 32))  # a changed conversion: said again
        convert_to_fp8(model)
        log_conversion_summary(model, once=False)  # asked for explicitly
    assert sum("linear layers run in FP8" in r.getMessage() for r in caplog.records) == 3


# -- the first/last rule groups projections that read one input, traced or not ------------------------------------
class NamedAttention(nn.Module):
    """An attention block whose projections carry the names of one model family."""

    def __init__(self, names, d=64):
        super().__init__()
        self.names = names
        for name in names:
            setattr(self, name, nn.Linear(d, d))

    def forward(self, x):
        q, k, v = (getattr(self, name)(x) for name in self.names[:3])
        a = torch.softmax(q @ k.transpose(-1, -2) / 8, dim=-1) @ v
        return getattr(self, self.names[3])(a) if len(self.names) > 3 else a


class NamedModel(nn.Module):
    def __init__(self, names, d=64, head=True):
        super().__init__()
        self.layers = nn.ModuleList([NamedAttention(names, d), NamedAttention(names, d)])
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 16) if head else None

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        x = x + self.mlp(x)
        return self.head(x) if self.head is not None else x


NAMING_STYLES = {
    "q/k/v": ("q", "k", "v", "o"),
    "hf q_proj": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "llama wq": ("wq", "wk", "wv", "wo"),
    "bert query": ("query", "key", "value", "dense"),
    "diffusers to_q": ("to_q", "to_k", "to_v", "to_out"),
}


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "module order"])
@pytest.mark.parametrize("style", list(NAMING_STYLES))
def test_the_first_attentions_q_k_v_stay_bf16_together_in_every_naming_style(style, traced):
    names = NAMING_STYLES[style]
    model = NamedModel(names)
    rows = {r.fqn: r for r in precision_map(model, example_input=torch.randn(2, 5, 64) if traced else None)}
    first = [f"layers.0.{name}" for name in names[:3]]
    assert _bf16(rows.values()) == [*first, "head"]
    assert "first linear layer kept in BF16" in rows[first[0]].reason
    how = "forward order, traced" if traced else "module order"
    for fqn in first[1:]:
        assert f"reads the same input as {first[0]}" in rows[fqn].reason and how in rows[fqn].reason
        assert ("by name" in rows[fqn].reason) == (not traced)  # without a trace, the names say it
    assert rows[f"layers.0.{names[3]}"].precision == rows[f"layers.1.{names[0]}"].precision == "would-fp8"
    convert_to_fp8(model, example_input=torch.randn(2, 5, 64) if traced else None, verbose=False)
    assert [fqn for fqn, r in ((r.fqn, r) for r in precision_map(model)) if r.precision == "bf16"] == [*first, "head"]


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "module order"])
def test_the_last_layer_takes_the_projections_that_share_its_input_with_it(traced):
    """A model ending in an attention without output projection: v runs (and is registered) last, and q and k read
    its input: the three stay BF16 as the last group."""
    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)
            self.mid = nn.Linear(64, 64)
            self.attn = NamedAttention(("q_proj", "k_proj", "v_proj"))

        def forward(self, x):
            return self.attn(self.mid(self.fc(x)))

    rows = {r.fqn: r for r in precision_map(Pool(), example_input=torch.randn(2, 5, 64) if traced else None)}
    assert _bf16(rows.values()) == ["fc", "attn.q_proj", "attn.k_proj", "attn.v_proj"]
    assert "last linear layer kept in BF16" in rows["attn.v_proj"].reason
    assert "reads the same input as attn.v_proj" in rows["attn.q_proj"].reason
    assert rows["mid"].precision == "would-fp8"


def test_untraced_grouping_needs_siblings_of_one_family_and_one_role_each():
    """Names that only look alike stay layers of their own: a fused query_key_value, q and k under different
    parents, a q with a key (two families)."""
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.query_key_value = nn.Linear(64, 192)
            self.a, self.b = nn.Module(), nn.Module()
            self.a.q, self.b.k = nn.Linear(64, 64), nn.Linear(64, 64)
            self.q_proj, self.key = nn.Linear(64, 64), nn.Linear(64, 64)

    rows = {r.fqn: r for r in precision_map(Odd())}
    assert _bf16(rows.values()) == ["query_key_value", "key"]  # first and last, each alone
    from lightning_fp8.conversion.first_last import sibling_groups

    assert sibling_groups(Odd(), ["query_key_value", "a.q", "b.k", "q_proj", "key"]) == ({}, {})
    index, notes = sibling_groups(NamedModel(NAMING_STYLES["hf q_proj"]), ["layers.0.k_proj", "layers.0.q_proj",
                                                                          "layers.0.o_proj"])
    assert index["layers.0.q_proj"] == ["layers.0.k_proj", "layers.0.q_proj"]  # in the order given
    assert "layers.0.o_proj" not in index and "by name" in notes["layers.0.k_proj"]


class MHAModel(nn.Module):
    def __init__(self, d=64, layers=2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 16)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "module order"])
def test_multihead_attention_projections_stay_bf16_together(traced):
    model = MHAModel()
    rows = {r.fqn: r for r in precision_map(model, example_input=torch.randn(2, 5, 64) if traced else None)}
    first = [f"encoder.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert _bf16(rows.values()) == [*first, "head"]
    if not traced:
        assert "the input projections of one nn.MultiheadAttention" in rows[first[2]].reason
    convert_to_fp8(model, example_input=torch.randn(2, 5, 64) if traced else None, verbose=False)
    assert [r.fqn for r in precision_map(model) if r.precision == "bf16"] == [*first, "head"]


def test_which_multihead_attention_projections_share_their_input():
    """What conversion/torch_transformer.py tells the untraced rule: self-attention q, k, v; a decoder's cross-attention
    (query from the decoder, key and value from the memory) k and v; separate kdim / vdim: k and v when equal."""
    from lightning_fp8.conversion.torch_transformer import expose_projections, shared_input_projections

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.TransformerDecoderLayer(64, 4, 128, batch_first=True)
            self.cross = nn.MultiheadAttention(64, 4, kdim=32, vdim=32)
            self.mixed = nn.MultiheadAttention(64, 4, kdim=32, vdim=48)

    model = Model()
    expose_projections(model)
    assert shared_input_projections(model) == [
        ["decoder.self_attn.q_proj", "decoder.self_attn.k_proj", "decoder.self_attn.v_proj"],
        ["decoder.multihead_attn.k_proj", "decoder.multihead_attn.v_proj"],
        ["cross.k_proj", "cross.v_proj"],
    ]
