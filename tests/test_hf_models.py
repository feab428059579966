"""Real Hugging Face model classes from small configs (no downloads) under the Lightning plugin: what converts (the
preview agrees with the conversion), that the converted layers really run FP8 GEMMs, that they train, and that a
trained model exports exactly like an untrained one."""
import logging

import pytest
import torch
from support.hf_models import CountFP8Gemms, HFModule, batch_for, bert, fit, gpt2, llama, resnet, t5, transformers, vit

from lightning_fp8 import FP8Layer, convert_to_fp8, precision_map, revert_fp8
from lightning_fp8.modules.hf_conv1d import FP8Conv1D

# model -> (the layers the first/last rule keeps in BF16: first group, last group)
FIRST_LAST = {
    gpt2: (["transformer.h.0.attn.c_attn"], ["lm_head"]),
    llama: (["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"],
            ["lm_head"]),
    # the classifier (64 -> 3) is not 16-aligned, so the pooler is the last layer that would otherwise convert
    bert: (["bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.key",
            "bert.encoder.layer.0.attention.self.value"], ["bert.pooler.dense"]),
    t5: (["encoder.block.0.layer.0.SelfAttention.q", "encoder.block.0.layer.0.SelfAttention.k",
          "encoder.block.0.layer.0.SelfAttention.v"], ["lm_head"]),
}


def _vit_first_last(model):
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    qkv = [n for n in names if n.split(".")[-1] in ("query", "key", "value", "q_proj", "k_proj", "v_proj")][:3]
    fc2 = [n for n in names if n != "classifier"][-1]  # the classifier (64 -> 10) is not 16-aligned
    return qkv, [fc2]


@pytest.mark.parametrize("build", [gpt2, llama, bert, t5, vit], ids=lambda b: b.__name__)
def test_model_converts_as_previewed_runs_fp8_gemms_and_trains(build):
    torch.manual_seed(0)
    model = build()
    first, last = FIRST_LAST[build] if build in FIRST_LAST else _vit_first_last(model)
    preview = {row.fqn: row for row in precision_map(model)}
    assert all(row.preview for row in preview.values())
    for fqn in first + last:
        assert preview[fqn].precision == "bf16" and "linear layer" in preview[fqn].reason, fqn
    assert "first linear layer kept in BF16" in preview[first[0]].reason and "traced" in preview[first[0]].reason
    assert "last linear layer kept in BF16" in preview[last[0]].reason
    params = dict(model.named_parameters())
    keys = list(model.state_dict())

    module = HFModule(model, lr=3e-3)
    batch = batch_for(model)
    gemms = CountFP8Gemms()
    fit(module, [batch] * 4, callbacks=[gemms.during_first_step()])  # the same batch: the loss must go down

    rows = {row.fqn.removeprefix("model."): row for row in precision_map(module) if row.fqn.startswith("model.")}
    # the preview says "would-fp8" where conversion then says "fp8": what it would do, visibly not done yet
    assert {fqn: row.precision for fqn, row in rows.items()} == {
        fqn: "fp8" if row.precision == "would-fp8" else row.precision for fqn, row in preview.items()}
    assert "fp8" not in {row.precision for row in preview.values()}
    n_fp8 = sum(isinstance(m, FP8Layer) and m.fp8_enabled for m in model.modules())
    assert n_fp8 == sum(row.precision == "fp8" for row in rows.values()) > 0
    assert gemms.count == 3 * n_fp8  # forward, input-gradient and weight-gradient GEMM of every FP8 layer
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys
    assert all(torch.isfinite(torch.tensor(module.losses))) and module.losses[-1] < module.losses[0]


def test_gpt2_conv1d_layers_are_fp8_conv1d_with_the_same_parameters():
    model = gpt2()
    conv_names = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    weights = {n: model.get_submodule(n).weight for n in conv_names}
    convert_to_fp8(model, verbose=False)
    assert len(conv_names) == 8
    for name in conv_names:
        layer = model.get_submodule(name)
        assert isinstance(layer, transformers.pytorch_utils.Conv1D)  # still a Conv1D for code that checks
        assert layer.weight is weights[name] and layer.weight.shape == (layer.nx, layer.nf)
        assert isinstance(layer, FP8Conv1D) == (name != "transformer.h.0.attn.c_attn")
    revert_fp8(model)
    assert [n for n, m in model.named_modules() if type(m) is transformers.pytorch_utils.Conv1D] == conv_names


@pytest.mark.parametrize("build", [llama, gpt2, t5], ids=lambda b: b.__name__)
def test_save_pretrained_after_fp8_training_matches_an_untrained_export(build, tmp_path, caplog, capsys):
    from safetensors import safe_open

    torch.manual_seed(0)
    model = build()
    module = HFModule(model)
    fit(module, [batch_for(model, seed=i) for i in range(3)])
    assert any(isinstance(m, FP8Layer) for m in model.modules())  # stays converted after fit (docs/models.md)
    model.save_pretrained(tmp_path / "trained")
    build().save_pretrained(tmp_path / "untrained")

    def keys(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return sorted(f.keys())

    assert keys(tmp_path / "trained") == keys(tmp_path / "untrained")
    capsys.readouterr()
    with caplog.at_level(logging.INFO):
        loaded, info = type(model).from_pretrained(tmp_path / "trained", output_loading_info=True)
    printed = capsys.readouterr()
    assert info["unexpected_keys"] in ([], set()) and info["missing_keys"] in ([], set())
    assert "unexpected" not in (printed.out + printed.err + caplog.text).lower()

    # leaving FP8: revert_fp8 gives back the original classes with the trained Parameters
    revert_fp8(model)
    assert not any(isinstance(m, FP8Layer) for m in model.modules())
    batch = batch_for(model, seed=9)
    with torch.no_grad():
        assert torch.equal(model.eval()(**batch).logits, loaded.eval()(**batch).logits)


def test_from_pretrained_would_report_fp8_metadata_as_unexpected(tmp_path):
    """The check above can fail: FP8 metadata in an export shows up as unexpected keys."""
    model = llama(layers=1)
    state = dict(model.state_dict())
    state["model.layers.0.mlp.up_proj.fp8_meta.input.scale"] = torch.ones(())
    model.save_pretrained(tmp_path, state_dict=state)
    _, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert "model.layers.0.mlp.up_proj.fp8_meta.input.scale" in info["unexpected_keys"]


def test_model_with_nothing_in_fp8_warns_at_fit_start_naming_what_it_found():
    """A bottleneck ResNet this narrow has no 16-aligned convolution but one 1x1 shortcut (the first, kept in BF16)
    and an unaligned classifier: nothing converts, and fit start says so, naming what the model is made of."""
    model = resnet()
    module = HFModule(model)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]  # rank-zero logging
    levels = [logger.level for logger in loggers]  # (another test may have quietened them)
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with pytest.warns(UserWarning, match="no layer runs in FP8") as caught:
            fit(module, [batch_for(model)])
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    message = str([w for w in caught if "no layer runs in FP8" in str(w.message)][0].message)
    assert "Conv2d x" in message and "BatchNorm2d x" in message and "Linear x1" in message
    summary = "\n".join(r.getMessage() for r in records if "lightning_fp8" in r.getMessage())
    assert "0 of 1 linear layers run in FP8" in summary and "0 of 8 convolutions run in FP8" in summary
    assert "in/out channels 16x4 are not multiples of 16" in summary
    assert "shortcut.convolution: first convolution kept in BF16 (recipe.keep_first_last_in_bf16; forward order, traced)" in summary
