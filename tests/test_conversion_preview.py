"""precision_map's dry-run preview, the first/last rule over layers sharing an input, the conversion summary, and
the precision map's account of modules conversion leaves alone."""
import logging
import lightning as L
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Layer, FP8Recipe, convert_to_fp8, precision_map
from lightning_fp8.conversion import auto_filter, conversion_summary


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
    # the preview is what conversion does
    convert_to_fp8(model, example_input=torch.randn(2, 5, 64), verbose=False)
    after = precision_map(model)
    assert [(r.fqn, r.precision) for r in after] == [(r.fqn, r.precision) for r in rows]
    assert [r.reason for r in after if r.precision == "bf16"] == [r.reason for r in rows if r.precision == "bf16"]


def test_first_and_last_count_only_layers_that_would_otherwise_convert():
    model = TinyTransformer(classes=10)  # head 64 -> 10 is not 16-aligned: mlp.2 is the last convertible layer
    rows = {r.fqn: r for r in precision_map(model, example_input=torch.randn(2, 5, 64))}
    assert "multiples of 16" in rows["head"].reason
    assert "last linear layer kept in BF16" in rows["mlp.2"].reason
    assert rows["mlp.0"].precision == "fp8"

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
    assert rows["attn.out_proj"].precision == rows["fc1"].precision == rows["fc2"].precision == "fp8"
    block = MHABlock()  # with attention projections that cannot run in FP8, the attention stays torch's own
    block.attn = nn.MultiheadAttention(40, 4, batch_first=True)
    block.fc1 = nn.Linear(40, 128)
    rows = {r.fqn: r for r in precision_map(block, example_input=torch.randn(2, 5, 40))}
    assert "multiples of 16" in rows["attn"].reason and "multiples of 16" in rows["attn.out_proj"].reason
    assert "first linear layer" in rows["fc2"].reason  # fc1 (40 -> 128) cannot convert either


def test_without_an_example_input_the_module_order_is_used_and_said():
    rows = {r.fqn: r for r in precision_map(TinyTransformer(classes=16))}
    assert "first linear layer" in rows["head"].reason and "module order" in rows["head"].reason
    assert "no example input" in rows["head"].reason and rows["blocks.0.k"].precision == "fp8"


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
    absence): no module of the package imports it except modules/hf_conv1d.py, inside a try (the absent case is
    test_conv1d_without_transformers_and_lookalikes_are_named)."""
    import ast
    import pathlib

    import lightning_fp8

    importers = []
    for path in pathlib.Path(lightning_fp8.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(name.split(".")[0] in ("transformers", "peft") for name in names):
                importers.append(path.name)
    assert importers == ["hf_conv1d.py"]
    source = (pathlib.Path(lightning_fp8.__file__).parent / "modules" / "hf_conv1d.py").read_text()
    assert "try:  # transformers is optional\n    from transformers.pytorch_utils import Conv1D" in source
