"""PyTorch's own transformer layers in FP8: nn.MultiheadAttention's projections (its in_proj_weight rows and its
out_proj, applied functionally by torch) become FP8 layers over the same Parameters, the attention itself stays in the
compute dtype, and nn.TransformerEncoderLayer / DecoderLayer / nn.Transformer convert with unchanged state_dict keys.
Checked against the unconverted modules' outputs, attention weights and gradients."""
import copy

import pytest
import torch
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support.helpers import trainer
from lightning_fp8 import FP8Precision, convert_to_fp8, fp8_autocast, fp8_layers, precision_map, revert_fp8
from lightning_fp8.modules.multihead_attention import FP8MultiheadAttentionProjection, ProjectedMultiheadAttention

E, HEADS = 32, 4


def _inputs(batch_first, self_attention, kdim=E, vdim=E, unbatched=False):
    g = torch.Generator().manual_seed(1)
    shape = lambda n, d: (n, d) if unbatched else ((2, n, d) if batch_first else (n, 2, d))  # noqa: E731
    q = torch.randn(*shape(5, E), generator=g, requires_grad=True)
    if self_attention:
        return q, q, q
    k = torch.randn(*shape(7, kdim), generator=g, requires_grad=True)
    return q, k, (k if kdim == vdim else torch.randn(*shape(7, vdim), generator=g, requires_grad=True))


CASES = {
    "self, batch_first, weights averaged": (dict(batch_first=True), True, dict()),
    "self, seq first, causal mask, no weights": (dict(), True, dict(attn_mask="causal", need_weights=False)),
    "self, is_causal hint, no weights": (dict(batch_first=True), True, dict(attn_mask="causal", is_causal=True, need_weights=False)),
    "cross, padding mask, per-head weights": (dict(batch_first=True), False, dict(key_padding_mask=True, average_attn_weights=False)),
    "cross, kdim/vdim, float mask": (dict(kdim=16, vdim=48), False, dict(attn_mask="float")),
    "bias_kv, zero attn, no bias": (dict(add_bias_kv=True, add_zero_attn=True, bias=False), False, dict(key_padding_mask=True)),
    "unbatched": (dict(), True, dict(unbatched=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_projected_attention_computes_what_torch_does(case):
    """The restructured attention (FP8 off) against nn.MultiheadAttention itself: outputs, weights, gradients."""
    kwargs, self_attention, call = CASES[case]
    call = dict(call)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, HEADS, **kwargs)
    with torch.no_grad():  # non-zero biases, so their rows are checked too
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_()
    mha = copy.deepcopy(ref)
    wrapper = nn.Sequential(nn.Linear(16, 16), mha)  # convert_to_fp8 exposes the projections of a model's attentions
    convert_to_fp8(wrapper, recipe=None, module_filter=lambda m, fqn: True, verbose=False)
    assert isinstance(mha, ProjectedMultiheadAttention) and isinstance(mha.q_proj, FP8MultiheadAttentionProjection)
    q, k, v = _inputs(kwargs.get("batch_first", False), self_attention, kwargs.get("kdim", E), kwargs.get("vdim", E),
                      call.pop("unbatched", False))
    tgt, src = (q.shape[-2] if kwargs.get("batch_first") or q.dim() == 2 else q.shape[0]), None
    src = k.shape[-2] if kwargs.get("batch_first") or k.dim() == 2 else k.shape[0]
    if call.get("attn_mask") == "causal":
        call["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(tgt)
    elif call.get("attn_mask") == "float":
        call["attn_mask"] = torch.randn(tgt, src)
    if call.get("key_padding_mask"):
        call["key_padding_mask"] = torch.tensor([[False] * (src - 2) + [True] * 2, [False] * src])
    outs = []
    for module in (ref, mha):
        for t in (q, k, v):
            t.grad = None
        with fp8_autocast(enabled=False):
            out, weights = module(q, k, v, **call)
        out.square().sum().backward()
        outs.append((out, weights, q.grad.clone(), [p.grad.clone() for p in module.parameters()]))
        module.zero_grad()
    (o1, w1, g1, p1), (o2, w2, g2, p2) = outs
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    assert (w1 is None) == (w2 is None)
    if w1 is not None:
        torch.testing.assert_close(w2, w1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-5)
    for a, b in zip(p2, p1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_attention_projections_in_fp8_same_parameters_and_keys():
    torch.manual_seed(0)
    ref = nn.TransformerDecoderLayer(E, HEADS, dim_feedforward=64, dropout=0.0, batch_first=True)
    layer = copy.deepcopy(ref)
    keys, params = list(layer.state_dict()), [id(p) for p in layer.parameters()]
    x, memory = torch.randn(2, 6, E), torch.randn(2, 9, E)
    convert_to_fp8(layer, module_filter=lambda m, fqn: True, verbose=False)
    assert sorted(fp8_layers(layer)) == sorted(
        [f"{a}.{p}" for a in ("self_attn", "multihead_attn") for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
        + ["linear1", "linear2"])
    assert list(layer.state_dict()) == keys and [id(p) for p in layer.parameters()] == params
    out = layer(x, memory, tgt_mask=nn.Transformer.generate_square_subsequent_mask(6))
    expected = ref(x, memory, tgt_mask=nn.Transformer.generate_square_subsequent_mask(6))
    error = (out - expected).norm() / expected.norm()
    assert 0 < error < 0.05  # FP8 (E4M3) projections: a few percent, not zero (they did run in FP8)
    out.square().sum().backward()
    assert layer.self_attn.in_proj_weight.grad.abs().sum() > 0 and layer.multihead_attn.out_proj.weight.grad is not None
    layer.load_state_dict(ref.state_dict())  # loads into the converted layer, strictly
    revert_fp8(layer)
    assert type(layer.self_attn) is nn.MultiheadAttention and list(layer.self_attn._modules) == ["out_proj"]
    assert list(layer.state_dict()) == keys


def test_encoder_fast_path_does_not_bypass_fp8():
    """nn.TransformerEncoderLayer's inference fast path (eval, no grad, no autocast) reads the Parameters directly;
    a converted encoder runs its FP8 modules instead."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, 64, dropout=0.0, batch_first=True), 2,
                                    enable_nested_tensor=False)
    convert_to_fp8(encoder, module_filter=lambda m, fqn: True, verbose=False)
    calls = []
    original = FP8MultiheadAttentionProjection.forward
    FP8MultiheadAttentionProjection.forward = lambda self, x: calls.append(1) or original(self, x)
    try:
        with torch.no_grad():
            encoder.eval()(torch.randn(2, 5, E))
    finally:
        FP8MultiheadAttentionProjection.forward = original
    assert len(calls) == 6 and torch.backends.mha.get_fastpath_enabled()
    assert isinstance(encoder, nn.TransformerEncoder) and isinstance(encoder.layers[0], nn.TransformerEncoderLayer)


class _ExampleTransformer(LightningTransformer):
    """Lightning's example LightningTransformer (lightning.pytorch.demos) with 16-aligned sizes (its defaults, 200 wide,
    are not: nothing of it can run an FP8 GEMM) on random tokens instead of WikiText-2 (no download here)."""

    def __init__(self):
        super().__init__(vocab_size=128)
        self.model = Transformer(vocab_size=128, ninp=64, nhead=2, nhid=128, nlayers=2)

    def prepare_data(self):
        pass

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 128, (4, 8), generator=g)
        return DataLoader(TensorDataset(tokens, tokens.roll(-1, dims=1)), batch_size=2)


def test_lightnings_example_transformer_trains_with_every_aligned_projection_in_fp8():
    torch.manual_seed(0)
    module = _ExampleTransformer()
    t = trainer(plugins=[FP8Precision()], max_steps=2)
    t.fit(module)
    rows = precision_map(module)
    fp8 = [r.fqn for r in rows if r.precision == "fp8"]
    bf16 = {r.fqn: r.reason for r in rows if r.precision == "bf16"}
    # 2 encoder layers x (q, k, v, out_proj, linear1, linear2) + 2 decoder layers x (2 attentions x 4 + 2) + the
    # vocabulary projection: 33 linear layers; the default filter keeps the first group (the first attention's q, k
    # and v: one input, though no forward is traced here) and the last in BF16
    assert len(rows) == 33 and len(fp8) == 29, bf16
    first = [f"model.transformer.encoder.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert set(bf16) == {*first, "model.decoder"}
    assert all("first" in bf16[f] or "last" in bf16[f] for f in bf16)
    assert "the input projections of one nn.MultiheadAttention" in bf16[first[1]]
    assert all(torch.isfinite(p).all() for p in module.parameters())
