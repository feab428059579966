"""torch.compile of converted models: one graph, no break, the same training as eager.

Tolerances: with the `aot_eager` backend the compiled graph runs the same kernels in the same order as eager, so
losses, weights and FP8 state are compared bit for bit. Inductor fuses and reorders the non-FP8 ops around the
layers (layer norm, softmax, GELU in BF16), which moves values by BF16 ulps; one step is compared with rtol 2e-2 on
the loss and the gradients' relative L2 error below 3e-2 (a BF16 ulp is 2^-8 = 3.9e-3; errors compound through the
layers and an FP8 cast can round a moved value to the next FP8 code, 2^-3 apart for E4M3).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.helpers import RegressionModule, loader, trainer
from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe, convert_to_fp8, fp8_layers, fp8_state_dict
from lightning_fp8.demo.gpt import GPT, GPTConfig
from lightning_fp8.engine import FP8TrainingEngine

VOCAB = 64


def _gpt(scaling):
    torch.manual_seed(0)
    return convert_to_fp8(GPT(GPTConfig(vocab_size=VOCAB, context=16, d_model=64, n_layers=2, n_heads=2)),
                          FP8Recipe(scaling=scaling))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16), generator=g)) for _ in range(n)]


def _loss(model, idx, tgt):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tgt.reshape(-1))


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_a_converted_gpt_is_one_graph(scaling):
    """The training forward of a converted 2-block GPT: one graph, no break (was 18 graphs, 17 breaks)."""
    model = _gpt(scaling)
    idx, tgt = _batches(1)[0]
    _loss(model, idx, tgt).backward()  # a step first: the state is then the steady one
    explained = torch._dynamo.explain(lambda i, t: _loss(model, i, t))(idx, tgt)
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_count == 1
    assert len(fp8_layers(model)) == 7  # 8 block linears, the first kept in BF16 by the default filter


def _train(model, compiled, engine, steps=3, backend="aot_eager"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if engine:
        eng = FP8TrainingEngine(FP8Recipe())
        eng.attach(model)
    fwd = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    losses = []
    for idx, tgt in _batches(steps):
        loss = _loss(fwd, idx, tgt)
        if engine:
            eng.scale_loss(loss).backward()
            eng.step(opt, opt.step)
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("engine", [True, False], ids=["engine", "plain"])
def test_fullgraph_training_equals_eager(scaling, engine):
    """Forward, backward (the gradient casts update the state inside the compiled backward) and optimizer steps
    through the engine, or the layers' own lazy step close without one."""
    eager, compiled = _gpt(scaling), _gpt(scaling)
    losses_eager = _train(eager, False, engine)
    losses_compiled = _train(compiled, True, engine)
    assert torch.equal(losses_eager, losses_compiled)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(a, b)
    meta_eager, meta_compiled = fp8_state_dict(eager), fp8_state_dict(compiled)
    for key, value in meta_eager.items():
        assert torch.equal(value, meta_compiled[key]), key
    assert all(layer.fp8_meta.amax_history[:, 1].gt(0).all() for layer in fp8_layers(compiled).values())


def test_inductor_fullgraph_step_is_eager_within_bf16_tolerance():
    torch.manual_seed(0)
    base = nn.Sequential(FP8Linear(64, 128), nn.GELU(), FP8Linear(128, 64))
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    x = torch.randn(32, 64)
    outs = []
    for model, fwd in ((eager, eager), (compiled, torch.compile(compiled, fullgraph=True))):
        for _ in range(2):  # the second step runs on delayed scales
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fwd(x).float().square().mean()
            loss.backward()
        outs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_e, grads_e), (loss_c, grads_c) = outs
    torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=0)
    for ge, gc in zip(grads_e, grads_c):
        assert ((gc - ge).norm() / ge.norm()).item() < 3e-2


class CompiledNet(RegressionModule):
    """The way to compile under Lightning: compile the network the LightningModule calls. (Compiling the whole
    LightningModule fails inside Lightning's own `self.log` with torch 2.13 and Lightning 2.6, with or without FP8.)"""

    def __init__(self):
        super().__init__()
        self.net = torch.compile(self.net, backend="aot_eager", fullgraph=True)


def test_compiled_network_under_the_lightning_plugin():
    torch.manual_seed(0)
    eager_model, compiled_model = RegressionModule(), CompiledNet()
    compiled_model.net._orig_mod.load_state_dict(eager_model.net.state_dict())
    for model in (eager_model, compiled_model):
        trainer(plugins=[FP8Precision()], max_steps=4).fit(model, loader())
    layers = fp8_layers(compiled_model)
    assert len(layers) == 2 and all(layer.fp8_meta.amax_history[:, 1].gt(0).all() for layer in layers.values())
    assert compiled_model.losses == eager_model.losses
