"""Models built on the meta device, then materialized and loaded: the FP8 state is a fresh layer's, never
uninitialized memory or a meta tensor read on the host, and the model computes exactly as one built on the CPU.

Every way a large model is built and loaded: `convert_to_fp8` of a meta model + `load_state_dict(assign=True)`;
`to_empty` + `load_state_dict`; Fabric's `init_module()` over `torch.device("meta")` + an assign load (litgpt's
`merge_lora`); a LightningModule whose `configure_model` builds on meta and loads pretrained weights; transformers'
`from_pretrained` into FP8 layers built by the plugin's `module_init_context`. (FSDP2: `tests/test_distributed.py`,
`test_a_meta_built_sharded_model_resumes_from_a_distributed_checkpoint`.)

And a load that brings the weights without the FP8 state says so, once, naming the layers whose scaling restarts
(plain PyTorch and Fabric), unless that state is loaded too.
"""
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision
from lightning_fp8.modules.layer_state import FP8LayerState
from tests.support.helpers import RegressionModule, loader, trainer

pytestmark = pytest.mark.filterwarnings("ignore::lightning_fp8.modules.gemm.FP8EmulationWarning")

RESTART = "had their weights loaded without their FP8 scaling state"


def _mlp():
    return nn.Sequential(*(m for _ in range(5) for m in (nn.Linear(64, 64), nn.GELU())), nn.Linear(64, 32))


def _steps(model, steps=3, seed=1):
    """Losses of a few AdamW steps (the scaling state evolves: delayed scales from the histories)."""
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    model.train()
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _fresh(meta: FP8LayerState) -> bool:
    return (not meta.amax_history.any() and not meta.overflow_count.any() and not meta.clip_count.any()
            and bool(meta.enabled) and torch.equal(meta.recipe_fp8_max, FP8LayerState(meta.recipe).recipe_fp8_max))


def _copies(weights):
    """What an assign load takes: tensors that become the parameters (trained in place afterwards)."""
    return {k: v.clone() for k, v in weights.items()}


def _reference():
    torch.manual_seed(0)
    model = convert_to_fp8(_mlp(), verbose=False)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_meta_model_converted_and_loaded_with_assign_computes_as_a_cpu_built_one():
    reference, weights = _reference()
    with torch.device("meta"):
        model = _mlp()
    model = convert_to_fp8(model, verbose=False)
    assert all(layer.fp8_meta.is_meta for layer in model.modules() if isinstance(layer, FP8Linear))
    model.load_state_dict(_copies(weights), assign=True)  # raised "Tensor.item() cannot be called on meta tensors"
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers and all(not layer.fp8_meta.is_meta and _fresh(layer.fp8_meta) for layer in layers)
    assert torch.equal(_steps(model), _steps(reference))


def test_to_empty_gives_a_fresh_fp8_state_and_the_model_computes_as_a_cpu_built_one():
    reference, weights = _reference()
    with torch.device("meta"):
        model = convert_to_fp8(_mlp(), verbose=False)
    model.to_empty(device="cpu")  # left amax histories of -1e27, random switches: NaN outputs in 2 of 3 runs
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers and all(_fresh(layer.fp8_meta) and layer.fp8_enabled for layer in layers)
    model.load_state_dict(weights)
    assert torch.equal(_steps(model), _steps(reference))


def test_fabric_init_module_on_meta_then_an_assign_load_as_litgpt_merges():
    """litgpt's merge_lora: `with fabric.init_module(), torch.device("meta"): model = GPT(config)`, then
    `model.load_state_dict(checkpoint, assign=True)`; with the FP8 plugin the model is built of FP8 layers."""
    reference, weights = _reference()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision()])
    with fabric.init_module(), torch.device("meta"):
        model = _mlp()
    model.load_state_dict(_copies(weights), assign=True)
    model = fabric.setup_module(model)
    assert sum(isinstance(m, FP8Linear) and m.fp8_enabled for m in model.modules()) == 4  # first / last in BF16
    out = model(torch.ones(4, 64))
    assert torch.isfinite(out).all()

    fabric_ref = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricFP8Precision()])
    with fabric_ref.init_module():
        direct = _mlp()
    direct.load_state_dict(weights)
    direct = fabric_ref.setup_module(direct)
    assert torch.equal(model(torch.ones(4, 64)), direct(torch.ones(4, 64)))


class _MetaBuiltModule(RegressionModule):
    """configure_model builds the network on the meta device and loads pretrained weights into it with assign=True
    (the large-model pattern: no memory for an initialization that the load overwrites)."""

    def __init__(self, weights):
        super().__init__(build_in_configure_model=True)
        self.pretrained = weights

    def configure_model(self):
        if self.net is None:
            with torch.device("meta"):
                self.net = _regression_mlp()
            # assign=True makes the loaded tensors the parameters: give it copies (training updates them in place)
            self.net.load_state_dict({k: v.clone() for k, v in self.pretrained.items()}, assign=True)


def _regression_mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 32))


def test_lightning_configure_model_on_meta_with_a_pretrained_load_trains_as_a_cpu_built_model():
    from lightning_fp8 import FP8Precision

    torch.manual_seed(0)
    weights = {k: v.clone() for k, v in _regression_mlp().state_dict().items()}
    meta_built = _MetaBuiltModule(weights)
    trainer(plugins=[FP8Precision()], max_steps=4).fit(meta_built, loader())

    direct = RegressionModule()
    direct.net = _regression_mlp()
    direct.net.load_state_dict(weights)
    trainer(plugins=[FP8Precision()], max_steps=4).fit(direct, loader())
    assert sum(isinstance(m, FP8Linear) for m in meta_built.modules()) == 2
    assert meta_built.losses == direct.losses and all(map(lambda v: v == v, meta_built.losses))


def test_from_pretrained_into_fp8_layers_built_by_the_plugin_matches_converting_afterwards(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_fp8.integrations.plugin_core import FP8PrecisionCore

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    reference = convert_to_fp8(transformers.LlamaForCausalLM.from_pretrained(tmp_path), verbose=False)
    core = FP8PrecisionCore()
    with core.module_init_context():  # what configure_model / init_module run under with the plugin
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    model = core.convert_module(model)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert layers and not any(layer.fp8_meta.is_meta for layer in layers)
    x = torch.randint(0, 128, (2, 16))
    reference.train()
    model.train()
    for _ in range(2):
        assert torch.equal(model(x).logits, reference(x).logits)


# -- a load without the FP8 state says so --------------------------------------------------------------------------
def _restart_warnings(caught):
    return [str(w.message) for w in caught if RESTART in str(w.message)]


def test_weights_loaded_without_the_fp8_state_say_which_layers_restart_their_scaling_once():
    trained, _ = _reference()
    _steps(trained)
    weights = trained.state_dict()  # an FP8 model's state_dict never holds the FP8 state
    torch.manual_seed(0)
    resumed = convert_to_fp8(_mlp(), verbose=False)
    resumed.load_state_dict(weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(resumed, steps=2)
    said = _restart_warnings(caught)
    assert len(said) == 1, said
    converted = [name for name, m in resumed.named_modules() if isinstance(m, FP8Linear)]
    assert f"{len(converted)} FP8 layer(s)" in said[0] and all(name in said[0] for name in converted)
    assert "fp8_state_dict" in said[0]


def test_no_word_when_the_fp8_state_is_loaded_with_the_weights_or_the_model_is_evaluated():
    trained, _ = _reference()
    _steps(trained)
    torch.manual_seed(0)
    resumed = convert_to_fp8(_mlp(), verbose=False)
    resumed.load_state_dict(trained.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.eval()
        resumed(torch.ones(2, 64))  # evaluation: nothing trains with the restarted scaling yet
        load_fp8_state_dict(resumed, fp8_state_dict(trained))
        _steps(resumed, steps=1)
    assert not _restart_warnings(caught)


def _fabric_run(tmp_path, save_plugin: bool):
    plugin = FabricFP8Precision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(2):
        fabric.backward(model(torch.randn(8, 64)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": model, "optimizer": optimizer}
    if save_plugin:
        state["fp8"] = plugin
    fabric.save(tmp_path / "ckpt", state)

    plugin_b = FabricFP8Precision()
    fabric_b = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin_b])
    model_b = _mlp()
    optimizer_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2)
    model_b, optimizer_b = fabric_b.setup(model_b, optimizer_b)
    state_b = {"model": model_b, "optimizer": optimizer_b}
    if save_plugin:
        state_b["fp8"] = plugin_b
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric_b.load(tmp_path / "ckpt", state_b)
        fabric_b.backward(model_b(torch.randn(8, 64)).square().mean())
        optimizer_b.step()
    return _restart_warnings(caught)


def test_a_fabric_checkpoint_without_the_plugin_says_the_scaling_restarts(tmp_path):
    said = _fabric_run(tmp_path, save_plugin=False)
    assert len(said) == 1 and "fabric.save" in said[0]


def test_a_fabric_checkpoint_with_the_plugin_resumes_without_a_word(tmp_path):
    assert _fabric_run(tmp_path, save_plugin=True) == []
