"""First and last layers when no example input traces the forward at conversion.

- The module order is a guess, corrected where the model's structure says otherwise: an output head (its weight the
  shape of an embedding table, outside the repeated blocks, or tied to it) reads what the model computes last
  wherever it is registered (litgpt's GPT registers `lm_head` before its blocks); the reasons say the order is a guess.
- Fabric and Accelerate trace the model's first forward on the meta device before it computes, and decide then
  (until then the guessed first / last layers are FP8 layers switched off); `FP8Precision(example_input=...)` traces
  at conversion instead.
"""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Layer, precision_map
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

pytestmark = pytest.mark.filterwarnings("ignore::lightning_fp8.modules.gemm.FP8EmulationWarning")


class HeadFirst(nn.Module):
    """Registers its output layer before the body it reads from (as litgpt's GPT registers lm_head first)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, x):
        return self.out(self.body(x))


def _fp8(model):
    return sorted(row.fqn.replace("_forward_module.", "") for row in precision_map(model) if row.precision == "fp8")


def _reason(model, name):
    return next(row.reason for row in precision_map(model) if row.fqn.endswith(name))


def _tiny_gpt():
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, padded_vocab_size=128, block_size=32,
                           intermediate_size=128, bias=False)
    return litgpt.GPT(config)


def test_module_order_counts_an_output_head_registered_first_as_last_and_says_it_guessed():
    rows = {row.fqn: row for row in precision_map(_tiny_gpt())}
    assert rows["lm_head"].precision == "bf16" and rows["lm_head"].reason.startswith("last linear layer")
    assert "lm_head counted last: its weight has the shape of the embedding table transformer.wte" in rows["lm_head"].reason
    assert rows["transformer.h.0.attn.qkv"].reason.startswith("first linear layer")
    assert "module order, a guess" in rows["transformer.h.0.attn.qkv"].reason
    # block 1's MLP output (last by registration, and of the same shape as the table inside the blocks) converts
    assert rows["transformer.h.1.mlp.proj"].precision == "would-fp8"
    assert rows["transformer.h.1.mlp.fc"].precision == "would-fp8"


def test_fabric_decides_first_and_last_on_the_first_forward_before_it_computes():
    plugin = FabricFP8Precision()
    # what the plugin hands Lightning's rank-zero logging, recorded before it (whether Lightning then shows it depends
    # on process-wide state earlier tests in a worker can leave: its rank, which logger its utilities write to)
    said = []
    log_through_lightning = plugin._rank_zero_info
    plugin._rank_zero_info = lambda message: (said.append(message), log_through_lightning(message))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = fabric.setup_module(HeadFirst())
    # until the first forward: the module order's guess, out first and body.4 last, both FP8 layers switched off
    assert _fp8(model) == ["body.0", "body.2"]
    assert isinstance(model.out, FP8Layer) and "a guess" in _reason(model, "out")
    assert not any("run in FP8" in m for m in said)  # the summary waits for the decision
    computed = {}  # which layers computed in FP8 in the first real forward (the meta trace is not recorded)

    def record(name):
        def hook(layer, args):
            if not args[0].is_meta:  # (the hook moves with a layer made plain again)
                computed.setdefault(name, isinstance(layer, FP8Layer) and layer.fp8_enabled)
        return hook

    for name, layer in model.named_modules():
        if isinstance(layer, FP8Layer):
            layer.register_forward_pre_hook(record(name))
    model(torch.randn(4, 32))
    assert sorted(name for name, fp8 in computed.items() if fp8) == ["_forward_module.body.2", "_forward_module.body.4"]
    assert _fp8(model) == ["body.2", "body.4"]
    assert not isinstance(model.out, FP8Layer) and not isinstance(model.body[0], FP8Layer)  # plain again, as traced
    assert _reason(model, "body.0").startswith("first linear layer") and "traced" in _reason(model, "body.0")
    assert _reason(model, "out").startswith("last linear layer") and "traced" in _reason(model, "out")
    assert sum("run in FP8" in m for m in said) == 1


def test_fabric_traces_a_given_example_input_at_conversion():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision(example_input=torch.zeros(1, 32))])
    model = fabric.setup_module(HeadFirst())
    assert _fp8(model) == ["body.2", "body.4"] and not isinstance(model.out, FP8Layer)


def test_litgpt_gpt_in_a_fabric_loop_keeps_block_0s_qkv_and_lm_head_in_bf16():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision()])
    model = _tiny_gpt()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, 128, (2, 16))
    fabric.backward(model(x).float().logsumexp(-1).mean())
    optimizer.step()
    expected = ["transformer.h.0.attn.proj", "transformer.h.0.mlp.fc", "transformer.h.0.mlp.proj",
                "transformer.h.1.attn.proj", "transformer.h.1.attn.qkv", "transformer.h.1.mlp.fc",
                "transformer.h.1.mlp.proj"]
    assert _fp8(model) == expected
    assert "traced" in _reason(model, "lm_head") and "traced" in _reason(model, "h.0.attn.qkv")


@pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py
def test_accelerate_decides_on_the_first_forward_too():
    from lightning_fp8.accelerate import FP8Accelerator

    accelerator = FP8Accelerator(mixed_precision="fp8", cpu=True)
    model = accelerator.prepare(HeadFirst())
    model(torch.randn(4, 32)).sum().backward()
    assert _fp8(model) == ["body.2", "body.4"]
