"""The Blackwell-era recipes in training: FP8Recipe(scaling="mxfp8" | "nvfp4"), weight_grad="high_precision" with every
scaling, the per-device choices (recipe="auto" through the Lightning, Fabric and Accelerate plugins; FP8LayerFallback's
ladder), the NVFP4 scope rule, checkpoints that resume each layer's recipe, FP8AdamW state. Devices other than this
CPU are simulated (`kernels.device.simulate_cuda`): the code paths of that GPU, emulated GEMMs."""
import logging
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from support.helpers import DispatchCount, RegressionModule, loader, sqnr_db, trainer
from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe, convert_to_fp8, fp8_layers, precision_map
from lightning_fp8.callbacks import FP8LayerFallback
from lightning_fp8.callbacks.fallback_escalation import escalation_target, ladder_for
from lightning_fp8.demo.gpt import GPT, GPTConfig
from lightning_fp8.kernels.device import profile_of, simulate_cuda
from lightning_fp8.presets import auto_recipe

SCALINGS = ["delayed", "current", "rowwise", "blockwise", "mxfp8", "nvfp4"]


@pytest.fixture(autouse=True)
def _quiet_emulation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _layer_grads(recipe, x, dy, seed=0, weight_mask=None):
    torch.manual_seed(seed)
    layer = FP8Linear(x.shape[1], dy.shape[1], recipe=recipe)
    if weight_mask is not None:
        with torch.no_grad():
            layer.weight.mul_(weight_mask)
    ref = nn.Linear(x.shape[1], dy.shape[1]).double()
    ref.load_state_dict(layer.state_dict())
    xs = [x.clone().requires_grad_(True), x.double().requires_grad_(True)]
    outs = []
    for module, xi in ((layer, xs[0]), (ref, xs[1])):
        y = module(xi)
        y.backward(dy.to(y.dtype))
        outs.append((y.detach(), xi.grad, module.weight.grad))
    return layer, outs


def test_each_gemm_of_the_microscaled_layers_is_as_accurate_as_its_format():
    """y, dx and dW against float64. On ordinary inputs mxfp8 equals blockwise (the same E4M3 elements: with
    power-of-two scales and no saturation a value's mantissa does not depend on its scale, docs/numerics.md); where
    the magnitude changes within a 128-tile (groups of 32 input channels 2^16 apart, the output reading only the small
    ones: the large ones' weight columns are zero), MX's 1x32 blocks keep the small groups out of E4M3's subnormals
    and blockwise's 1x128 tiles do not. nvfp4 is less close (FP4 elements: 1 mantissa bit; E2M1's
    rounding error alone bounds it near 17 dB) but above 12 dB."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 320, generator=g) * torch.exp2(torch.randint(-4, 5, (128, 1), generator=g).float())
    dy = torch.randn(128, 192, generator=g)
    small = torch.tensor([False, True] * 5).repeat_interleave(32)  # 32-channel groups, every other one 2^16 smaller
    sqnr = {}
    for case, inputs, mask in (("ordinary", x, None), ("groups", x * torch.where(small, 2.0**-16, 1.0), small.float())):
        for scaling in ("blockwise", "mxfp8", "nvfp4"):
            _, ((y, dx, dw), (ry, rdx, rdw)) = _layer_grads(FP8Recipe(scaling=scaling), inputs, dy, weight_mask=mask)
            sqnr[case, scaling] = [sqnr_db(r, a) for r, a in ((ry, y), (rdx, dx), (rdw, dw))]
    for i in range(3):
        assert abs(sqnr["ordinary", "mxfp8"][i] - sqnr["ordinary", "blockwise"][i]) < 1e-3, sqnr
        assert 12.0 < sqnr["ordinary", "nvfp4"][i] < sqnr["ordinary", "mxfp8"][i], sqnr
    # forward reads x in 1x128 / 1x32 tiles along the channels: that is where the groups show
    assert sqnr["groups", "mxfp8"][0] > sqnr["groups", "blockwise"][0] + 3.0, sqnr


@pytest.mark.parametrize("scaling", SCALINGS)
def test_high_precision_weight_gradient_is_the_bf16_gemm_with_every_scaling(scaling):
    """weight_grad="high_precision": dW = dY^T @ x on BF16 operands with float32 accumulation, rounded once to BF16
    (nn.Linear's weight gradient under autocast), whatever the scaling; x is kept for backward in high precision and
    nothing is cast for that GEMM; the other two GEMMs stay quantized."""
    torch.manual_seed(0)
    layer = FP8Linear(96, 64, recipe=FP8Recipe(scaling=scaling, weight_grad="high_precision"))
    quantized = FP8Linear(96, 64, recipe=FP8Recipe(scaling=scaling))
    quantized.load_state_dict(layer.state_dict())
    x = torch.randn(48, 96)
    dy = torch.randn(48, 64)
    saved = []
    for module in (layer, quantized):
        xi = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = module(xi)
        y.backward(dy.to(y.dtype))
    bf16 = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    exact = bf16(dy).t() @ bf16(x)
    bound = 2.0**-8 * exact.abs() + 96 * 2.0**-23 * (bf16(dy).abs().t() @ bf16(x).abs())  # one rounding + order
    assert ((layer.weight.grad.double() - exact).abs() <= bound).all()
    assert not torch.equal(layer.weight.grad, quantized.weight.grad)  # the switch changed the GEMM
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in saved[: len(saved) // 2])


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_saved_for_backward_is_the_quantized_input_and_the_weights_transpose(scaling):
    """Backward keeps x^T as cast (its logical view: the padding of the storage it lies in is not counted here) and
    W^T as the forward's weight cast wrote it (1 byte per weight element for MXFP8, half for NVFP4, plus the scales),
    as per-tensor recipes do: no weight cast in backward."""
    layer = FP8Linear(256, 512, recipe=FP8Recipe(scaling=scaling))
    x = torch.randn(100, 256, requires_grad=True)  # 100 tokens: NVFP4's Hadamard transform pads them to 112
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x).float().sum().backward()
    others = [t for t in saved if all(t is not p for p in layer.parameters())]
    nbytes = sum(t.numel() * t.element_size() for t in others)
    if scaling == "mxfp8":
        assert {t.dtype for t in others} == {torch.float8_e4m3fn, torch.float8_e8m0fnu}
        # x^T in E4M3, one E8M0 per 32 tokens (4 per row: 100 = 3 x 32 + 4); W^T (in, out) in E4M3, one E8M0 per 32
        assert nbytes == x.numel() + 256 * 4 + 256 * 512 + 256 * 512 // 32
    else:
        assert {t.dtype for t in others} == {torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float32}
        # x^T H in FP4, E4M3 per 16, the tensor scale; W^T in FP4, E4M3 per 16 x 16 block, the tensor scale
        assert nbytes == 256 * 112 // 2 + 256 * 112 // 16 + 4 + 256 * 512 // 2 + 256 * 512 // 256 + 4


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_one_cast_op_per_tensor_and_three_gemm_ops(scaling):
    layer = FP8Linear(256, 512, recipe=FP8Recipe(scaling=scaling))
    x = torch.randn(128, 256, requires_grad=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()

    step()
    with DispatchCount() as count:
        step()
    # x (both layouts), W (both layouts: W^T is kept for backward), dY (both layouts)
    assert count.of("lightning_fp8.microscaled_cast") == 3
    assert count.of("lightning_fp8.fp8_gemm") == 3 and count.of("lightning_fp8.tiled_cast") == 0


def test_nvfp4_gradients_round_stochastically_and_reproducibly():
    x, dy = torch.randn(64, 96), torch.randn(64, 32)
    grads = [_layer_grads(FP8Recipe(scaling="nvfp4"), x, dy, seed)[1][0][1] for seed in (0, 0, 1)]
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])  # the seed decides the draws
    nearest = _layer_grads(FP8Recipe(scaling="nvfp4", rounding="nearest"), x, dy)[1][0][1]
    assert not torch.equal(nearest, grads[0])


def test_nvfp4_keeps_its_last_blocks_in_bf16_by_a_named_rule():
    def converted(recipe, n_layers=7):
        torch.manual_seed(0)
        model = convert_to_fp8(GPT(GPTConfig(vocab_size=64, n_layers=n_layers, d_model=32, n_heads=2)), recipe,
                               verbose=False)
        return {r.fqn: r for r in precision_map(model)}

    rows = converted(FP8Recipe(scaling="nvfp4"))  # 0.15 of 7 blocks: the last one
    tail = [fqn for fqn, r in rows.items() if "keep_last_blocks_in_bf16" in r.reason]
    assert tail == [f"blocks.6.{name}" for name in ("qkv", "proj", "fc1", "fc2")]
    assert all(rows[fqn].precision == "bf16" and "last 1 of 7 blocks" in rows[fqn].reason for fqn in tail)
    assert rows["blocks.5.fc2"].precision == "fp8" and rows["blocks.5.fc2"].recipe == "nvfp4"
    assert rows["head"].precision == "bf16"  # the head: the first / last rule
    assert len([r for r in converted(FP8Recipe(scaling="nvfp4", keep_last_blocks_in_bf16=0.3)).values()
                if "keep_last_blocks_in_bf16" in r.reason]) == 8  # configurable: 2 blocks
    assert not any("keep_last_blocks" in r.reason for r in converted(FP8Recipe(scaling="mxfp8")).values())
    assert not any("keep_last_blocks" in r.reason for r in converted(FP8Recipe(scaling="nvfp4"), 2).values())


def test_auto_recipe_per_compute_capability():
    """What the real roofline model decides: on Ampere, Ada and Hopper per-tensor scaling; on Blackwell too, since
    the model predicts mxfp8 a hair slower than per-tensor scaling at the reference shape (tests/test_roofline.py
    checks the rule against the model's figures on every Blackwell)."""
    expected = {(8, 0): "delayed", (8, 9): "delayed", (9, 0): "delayed", (10, 0): "delayed", (10, 3): "delayed",
                (12, 0): "delayed"}
    for capability, scaling in expected.items():
        with simulate_cuda(capability):
            choice = auto_recipe()
            assert choice.recipe.scaling == scaling and choice.device.startswith(f"sm{capability[0]}{capability[1]}")
            assert choice.reason and auto_recipe() == choice  # the same device, the same recipe
    assert auto_recipe("cpu").recipe == FP8Recipe() and "no FP8 tensor cores" in auto_recipe("cpu").reason
    with pytest.raises(ValueError, match="'auto'"):
        FP8Precision(recipe="automatic")
    with pytest.raises(ValueError, match="not both"):
        FP8Precision(recipe="auto", preset="default")


def test_auto_recipe_through_lightning_is_logged_checkpointed_and_resumed(tmp_path, caplog, auto_prefers_candidates):
    """Under a simulated sm100 where the model prefers mxfp8, FP8Precision(recipe="auto") converts the model to mxfp8 and says so (and why) in the
    conversion summary; the checkpoint records the choice and every layer's recipe; resumed on a simulated sm90 (where
    auto would choose per-tensor scaling) the run warns and continues with the checkpoint's recipe in every layer."""
    torch.manual_seed(0)
    model = RegressionModule()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    with simulate_cuda((10, 0)), caplog.at_level(logging.INFO):
        trainer(plugins=[FP8Precision(recipe="auto")], callbacks=[ckpt], max_steps=3, enable_checkpointing=True).fit(
            model, loader())
    assert {layer.recipe.scaling for layer in fp8_layers(model).values()} == {"mxfp8"}
    assert any("recipe='auto' on sm100 (simulated): mxfp8" in r.getMessage() for r in caplog.records)
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)
    plugin_state = next(v for v in state.values() if isinstance(v, dict) and "auto_recipe" in v)
    assert plugin_state["auto_recipe"]["device"] == "sm100 (simulated)"
    assert {r["scaling"] for r in plugin_state["layer_recipes"].values()} == {"mxfp8"}

    torch.manual_seed(0)
    resumed = RegressionModule()
    with simulate_cuda((9, 0)), pytest.warns(UserWarning, match="resumes with the checkpoint's recipe"):
        plugin = FP8Precision(recipe="auto")
        assert plugin.recipe_choice.device.startswith("sm90")
        trainer(plugins=[plugin], max_steps=4).fit(resumed, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert {layer.recipe.scaling for layer in fp8_layers(resumed).values()} == {"mxfp8"}
    # the next checkpoint records the choice the layers run (sm100's), not the one sm90 would have made
    again = plugin.state_dict()["auto_recipe"]
    assert again["device"] == "sm100 (simulated)" and again["recipe"]["scaling"] == "mxfp8"


def test_auto_recipe_through_fabric_and_accelerate(tmp_path, caplog, auto_prefers_candidates):
    """Both adapters convert to the choice, say it in the conversion summary and record it in their checkpoint state
    (Fabric: the plugin's state_dict; Accelerate: save_state's FP8 state file)."""
    from lightning.fabric import Fabric

    from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    note = "recipe='auto' on sm100 (simulated): mxfp8"
    with simulate_cuda((10, 0)), caplog.at_level(logging.INFO, logger="lightning_fp8"):
        plugin = FabricFP8Precision(recipe="auto")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = fabric.setup_module(RegressionModule().net)
        model(torch.randn(4, 32))  # without an example input, first / last (and the summary) wait for this forward
        assert {layer.recipe.scaling for layer in fp8_layers(model).values()} == {"mxfp8"}
        assert sum(note in r.getMessage() for r in caplog.records) == 1
        assert plugin.state_dict()["auto_recipe"]["recipe"]["scaling"] == "mxfp8"
        caplog.clear()
        accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[FP8Kwargs(recipe="auto")])
        prepared = accelerator.prepare(RegressionModule().net)
        prepared(torch.randn(4, 32))
        assert {layer.recipe.scaling for layer in fp8_layers(prepared).values()} == {"mxfp8"}
        assert sum(note in r.getMessage() for r in caplog.records) == 1
        accelerator.save_state(tmp_path)
    saved = [torch.load(f, weights_only=False) for f in tmp_path.glob("custom_checkpoint_*")]
    assert [s["auto_recipe"]["device"] for s in saved if isinstance(s, dict) and "auto_recipe" in s] == [
        "sm100 (simulated)"]


def test_escalation_ladder_per_device():
    def target(capability, scaling, escalate_to="auto"):
        profile = profile_of("cpu") if capability is None else simulate_profile(capability)
        return escalation_target(FP8Recipe(scaling=scaling), "underflow", escalate_to, profile)

    def simulate_profile(capability):
        with simulate_cuda(capability):
            return profile_of("cpu")

    assert [target((10, 0), s) for s in ("nvfp4", "delayed", "blockwise", "mxfp8")] == ["mxfp8"] * 3 + [None]
    assert [target((12, 0), s) for s in ("nvfp4", "current", "mxfp8")] == ["mxfp8", "mxfp8", None]
    assert [target((9, 0), s) for s in ("nvfp4", "delayed", "rowwise", "blockwise", "mxfp8")] == [
        "blockwise", "blockwise", "blockwise", None, None]
    assert [target((8, 9), s) for s in ("delayed", "rowwise", "blockwise")] == ["rowwise", None, None]
    assert [target(None, s) for s in ("delayed", "blockwise")] == ["blockwise", None]  # no FP8 cores: as before
    assert target((10, 0), "delayed", "blockwise") == "blockwise" and target((10, 0), "delayed", None) is None
    assert ladder_for(simulate_profile((10, 0))) == ("nvfp4", "mxfp8")
    with pytest.raises(ValueError, match="'auto'"):
        FP8LayerFallback(escalate_to="nvfp4")


def test_fallback_climbs_the_sm100_ladder_from_nvfp4_to_mxfp8():
    """A planted outlier channel (1e6 x, tests/test_escalation.py) under NVFP4 on a simulated sm100: the layer moves
    to mxfp8 (the next rung there, not blockwise), and stays there: mxfp8 cures the flush."""
    from test_escalation import PlantedRegression

    torch.manual_seed(0)
    model = PlantedRegression()
    fallback = FP8LayerFallback(check_every_n_steps=1)
    with simulate_cuda((10, 0)):
        trainer(plugins=[FP8Precision(FP8Recipe(scaling="nvfp4"))], callbacks=[fallback], max_steps=8).fit(
            model, loader())
    info = fallback.escalations["net.2"]
    assert (info["from"], info["to"]) == ("nvfp4", "mxfp8")
    layer = fp8_layers(model)["net.2"]
    assert layer.recipe.scaling == "mxfp8" and layer.recipe.format == "e4m3" and layer.recipe.rounding == "nearest"
    assert [e["kind"] for e in fallback.events if "net.2" in e["layers"]][0] == "escalate"
    # mxfp8's 1x32 blocks give the outlier channel's block its own scale, so the flush stops: the layer stays there
    # for the remaining checks (the step from mxfp8, the top of sm100's ladder, is BF16:
    # test_escalation_ladder_per_device)
    assert [e["kind"] for e in fallback.events if "net.2" in e["layers"]] == ["escalate"]
    row = {r.fqn: r for r in precision_map(model)}["net.2"]
    assert row.precision == "fp8" and row.recipe == "mxfp8" and layer.fp8_enabled and not fallback.fallbacks


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_checkpoint_resume_with_fp8_optimizer_state_is_bit_identical(scaling, tmp_path):
    """FP8AdamW state and checkpoints with the new recipes: two epochs straight == one epoch + resume, NVFP4 with its
    default stochastic rounding: each layer's Philox stream (seed and offset) is part of the FP8 state the plugin
    checkpoints, so the resumed run draws the numbers the uninterrupted one drew (torch's global RNG is not involved)."""
    def run(max_epochs, ckpt_path=None):
        torch.manual_seed(0)
        model = RegressionModule()
        recipe = FP8Recipe(scaling=scaling)
        t = trainer(plugins=[FP8Precision(recipe, optimizer_state="fp8")], max_epochs=max_epochs,
                    enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=tmp_path / str(max_epochs), save_last=True)])
        t.fit(model, loader(n=96), ckpt_path=ckpt_path)
        assert all(layer.recipe == recipe for layer in fp8_layers(model).values())
        return model.losses

    straight = run(2)
    first = run(1)
    assert first + run(2, ckpt_path=tmp_path / "1" / "last.ckpt") == straight


def test_fsdp2_all_gather_stays_high_precision_for_block_scaled_weights():
    """FP8 all-gather needs one weight scale all ranks agree on before the gather; MX / NVFP4 weights have a scale per
    block (NVFP4's tensor scale needs every rank's amax, MX's backward re-blocks the weight along the other axis), so
    those layers gather in high precision, each with the reason (docs/distributed.md)."""
    from lightning_fp8.distributed import enable_fp8_all_gather

    for scaling in ("mxfp8", "nvfp4"):
        model = convert_to_fp8(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), FP8Recipe(scaling=scaling),
                               verbose=False)
        decisions = enable_fp8_all_gather(model)
        assert decisions and all(reason and scaling in reason for reason in decisions.values())


def test_resume_loads_each_layer_recipe_before_its_history():
    """A checkpoint whose layers keep a longer amax history than this run's recipe (here 32 vs 16 steps): each layer
    adopts its saved recipe first, then its saved history, whole (before: the history was cut to 16 steps on load,
    then padded back to 32 with zeros by the recipe)."""
    torch.manual_seed(0)
    saving = FP8Precision(FP8Recipe(amax_history_len=32))
    model = saving.convert_module(RegressionModule().net)
    for layer in fp8_layers(model).values():
        layer.fp8_meta.amax_history.copy_(torch.rand_like(layer.fp8_meta.amax_history) + 0.5)
    state = saving.state_dict()
    loading = FP8Precision()
    resumed = loading.convert_module(RegressionModule().net)
    loading.load_state_dict(state)
    for fqn, layer in fp8_layers(resumed).items():
        assert layer.recipe.amax_history_len == 32
        assert torch.equal(layer.fp8_meta.amax_history, fp8_layers(model)[fqn].fp8_meta.amax_history)


class _TiedHeadGPT(nn.Module):
    """7 blocks and a head tied to the embedding (F.linear on its weight: no linear module), as GPT-2 and Llama
    variants tie it: the last linear layer is then inside the last block."""

    def __init__(self, d=32, n_blocks=7):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(n_blocks))

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.linear(x, self.emb.weight)


def test_nvfp4_tail_rule_with_a_tied_head_keeps_only_the_tail_and_the_first_layer():
    """The first / last rule looks at every candidate, the tail rule after it: the last linear layer is in the BF16
    tail already, so no layer outside the tail stays in BF16 as "the last" (before: blocks.5.2 did)."""
    model = convert_to_fp8(_TiedHeadGPT(), FP8Recipe(scaling="nvfp4"), verbose=False)
    bf16 = {r.fqn for r in precision_map(model) if r.precision == "bf16"}
    assert bf16 == {"blocks.0.0", "blocks.6.0", "blocks.6.2"}


def test_nvfp4_tail_rule_applies_to_layers_given_nvfp4_by_layer_recipes():
    """layer_recipes={"*": nvfp4} under the default recipe: each layer's own recipe decides the tail (before: only the
    global recipe's, so every layer of the last block ran in NVFP4)."""
    model = convert_to_fp8(_TiedHeadGPT(), layer_recipes={"*": FP8Recipe(scaling="nvfp4")}, verbose=False)
    rows = {r.fqn: r for r in precision_map(model)}
    assert {fqn for fqn, r in rows.items() if r.precision == "bf16"} == {"blocks.0.0", "blocks.6.0", "blocks.6.2"}
    assert "last 1 of 7 blocks" in rows["blocks.6.0"].reason and rows["blocks.5.2"].recipe == "nvfp4"
    mixed = convert_to_fp8(_TiedHeadGPT(), FP8Recipe(scaling="nvfp4"),
                           layer_recipes={"blocks.6.*": FP8Recipe(scaling="mxfp8")}, verbose=False)
    rows = {r.fqn: r for r in precision_map(mixed)}  # the last block runs mxfp8, which has no tail rule
    assert rows["blocks.6.0"].recipe == "mxfp8" and rows["blocks.6.2"].precision == "bf16"  # the last layer
