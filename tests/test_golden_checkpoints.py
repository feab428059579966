"""Checkpoints written by an OLD version of lightning-fp8 keep loading and resuming.

tests/data/golden/ holds checkpoints that tests/data/golden/make_golden.py wrote ONCE, with the code of commit
ecb0e57 (see its docstring and each case's expected.json): a Lightning checkpoint (FP8Precision with
optimizer_state="fp8", FP8LayerFallback, an LR scheduler), a Fabric checkpoint, an Accelerate save_state folder and a
plain converted model's torch.save. Each test here loads one of them with the library's normal API, resumes 4 steps
and compares the losses with those the writing run recorded after its save (the writer checked that its own resume
from the file was bit-identical to training straight on), and checks that the FP8 state (amax histories, engine
counters, FP8AdamW's compressed moments, the LR scheduler, the callback's state) really came back from the file: a
resume that silently dropped the FP8 state would start its scaling afresh, which on this tiny model gives the very
same losses (see RTOL), so the losses alone would not notice.

Never regenerate the files to make this test pass: `test_the_golden_files_are_the_ones_written_at_ecb0e57` pins their
hashes here, apart from the script. A change that breaks a resume must keep reading these files (or convert them).

The model, data and loops below repeat make_golden.py's on purpose (not imported from it or from support/helpers.py):
the script is a frozen record, these are the current code's way of resuming.
"""
import hashlib
import json
import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fp8 import FP8LayerFallback, FP8Precision, convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.modules.gemm import cpu_has_native_bf16

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden")
SAVE_STEP, RESUME_STEPS = 6, 4
D, HIDDEN, N_SAMPLES, BATCH_SIZE = 32, 64, 192, 32
FP8_LAYERS = ("2", "4")  # net.2 and net.4: the middle linears (first and last stay BF16 under the default filter)

# sha256 of every golden file as make_golden.py wrote it at ecb0e57. Pinned here, not only in the expected.json files
# next to them, so that re-running the script on newer code (which must not be done) cannot go unnoticed.
GOLDEN_SHA256 = {
    "lightning/golden.ckpt": "68cdc94dc5920bbfb6636401a2a98477d1cf867a5265f729e645566228898929",
    "fabric/golden.pt": "cbf4977abd67e321a8b10f82305e532ca556df753aed4e9f1c82ef57ed7b634e",
    "accelerate/checkpoint/custom_checkpoint_0.pkl": "ac144ad1dce9258c852c050da4e2f0b56eeb34f66d6ea9119338d5d808a4e0a9",
    "accelerate/checkpoint/model.safetensors": "9a36c5cd5673054eb51b393f4a6c3edeee4ed2a04ccba2aabe54ba07f288252e",
    "accelerate/checkpoint/optimizer.bin": "322c163524b34c314473a6538b5ebbc438852fb81c7961276d79a26c9e48d140",
    "accelerate/checkpoint/random_states_0.pkl": "6b6ba13426d033fb1e0b74280e4f4378b7d956fd6b2b987185ea220a744cfa7c",
    "accelerate/checkpoint/scheduler.bin": "3c7277e9e0efc04383a02cdf5a9e36d2ce681cc4d3f63620961b67b9c4a298db",
    "plain/golden.pt": "ca24d58c48c4f98e3ee65cc243ac28ad2852b84b507f925cca5d60550459c01c",
}

# Where the resume cannot be bit-identical to the writer's run, the losses are compared with this relative tolerance.
# The CPU emulation of FP8 GEMMs multiplies the (exact) FP8 values in BF16 on a CPU with native BF16 (AVX512-BF16 /
# AMX) and in float32 elsewhere (lightning_fp8.modules.gemm.cpu_has_native_bf16), and the high-precision GEMMs go
# through float32 there too: the same products summed in another order, so the values agree up to rounding, which FP8
# quantization and a few optimizer steps magnify (forcing the float32 path on the writer's CPU moved these losses by
# at most 1.0e-4 relative); another torch major.minor can pick other kernels likewise. A resume that lost the
# optimizer state moves them by ~10%. A lost FP8 metadata (amax histories) or engine state does NOT move them on this
# model: with power-of-two scales a scale restarted from the current amax quantizes to the same FP8 values unless
# something saturates; that is why every test compares the restored state with the file's directly.
RTOL = 2e-2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The writer ran with one thread (expected.json: torch_num_threads): same kernels' summation order, and fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- what the writer used (a copy of make_golden.py's definitions) -------------------------------------------------
def mlp():
    return nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))


def data_loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, D, generator=g)
    w = torch.randn(D, D, generator=g) / D**0.5
    return DataLoader(TensorDataset(x, x @ w), batch_size=BATCH_SIZE, shuffle=False)


BATCHES = list(data_loader())


def mse(out, y):
    return F.mse_loss(out.float(), y)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def expected(case):
    with open(os.path.join(GOLDEN, case, "expected.json")) as f:
        return json.load(f)


def bit_identical_here(record) -> bool:
    """The writer's losses are reproduced bit for bit where the GEMM emulation takes the same path (BF16 or float32,
    see RTOL) and torch is of the same major.minor."""
    writer = record["writer"]
    same_minor = torch.__version__.split(".")[:2] == writer["torch"].split(".")[:2]
    return same_minor and cpu_has_native_bf16() == writer["cpu_has_native_bf16"]


def assert_resumed_losses(losses, record):
    want = record["expected_losses"]
    assert [float.fromhex(h) for h in record["expected_losses_hex"]] == want  # the JSON's two spellings agree
    assert len(losses) == len(want) == RESUME_STEPS
    if bit_identical_here(record):
        assert losses == want, ([float.hex(v) for v in losses], record["expected_losses_hex"])
    else:
        assert losses == pytest.approx(want, rel=RTOL)


def assert_fp8_meta_restored(model_meta, saved_meta):
    """The model's FP8 metadata equals the file's, entry by entry, and the file's is a real run's (amax histories
    with several closed steps in them). Should the metadata's layout change, compare what the file's entries became
    (as the new loading code upgrades them), never regenerate the file."""
    assert sorted(model_meta) == sorted(saved_meta)
    for key, value in saved_meta.items():
        assert torch.equal(model_meta[key], value), key
    for layer in FP8_LAYERS:
        history = next(v for k, v in saved_meta.items() if k.endswith(f"{layer}.fp8_meta.amax_history"))
        assert history.shape[0] == 3  # input, weight, gradient
        assert (history > 0).sum(dim=1).min() >= SAVE_STEP - 1  # every role holds the steps before the save
        assert bool(next(v for k, v in saved_meta.items() if k.endswith(f"{layer}.fp8_meta.enabled")))


def _without_verbose(scheduler_state: dict) -> dict:
    """An LR scheduler's state without `verbose`, which older torch releases keep in it (torch 2.6 does; the golden
    files were written with torch 2.13, whose schedulers have no such attribute)."""
    return {k: v for k, v in scheduler_state.items() if k != "verbose"}


def clone_state(state):
    return {k: v.detach().clone() for k, v in state.items()}


def assert_engine_restored(state, saved_engine):
    """The engine's state (`engine.state_dict()` right after the load) is the file's: counters, loss scaler, the
    spike rule's loss window (a fresh engine has step_count 0 and an empty window)."""
    assert state["step_count"] == saved_engine["step_count"] == SAVE_STEP
    assert state["skipped_steps"] == saved_engine["skipped_steps"] == 0
    assert state["rollbacks"] == saved_engine["rollbacks"] == 0
    assert state["scaler"] == saved_engine["scaler"]
    assert state["loss_window"] == saved_engine["loss_window"] and len(state["loss_window"]) == SAVE_STEP
    assert state["events"] == saved_engine["events"]


def assert_adamw_state_restored(optimizer, saved, lr):
    """torch.optim.AdamW (Fabric, Accelerate, plain): every parameter's step and moments, and the lr, as saved."""
    assert len(optimizer.state) == len(saved["state"]) == 8
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved_state in saved["state"].items():
        state = optimizer.state[params[index]]
        assert float(state["step"]) == SAVE_STEP
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved_state[key]), (index, key)
    assert optimizer.param_groups[0]["lr"] == saved["param_groups"][0]["lr"] == lr


# -- the files themselves ------------------------------------------------------------------------------------------
def test_the_golden_files_are_the_ones_written_at_ecb0e57():
    on_disk = {}
    for case in ("lightning", "fabric", "accelerate", "plain"):
        record = expected(case)
        writer = record["writer"]
        assert writer["git_commit"].startswith("ecb0e57") and writer["library_code_clean"]
        # what a reader needs to judge a mismatch: the writer's torch, its GEMM emulation path, its thread count
        assert writer["torch"] == "2.13.0+cpu" and writer["torch_num_threads"] == 1
        assert isinstance(writer["cpu_has_native_bf16"], bool)
        assert record["resumed_equals_uninterrupted"] is True
        for rel, info in record["files"].items():
            path = os.path.join(GOLDEN, case, rel)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            assert digest == info["sha256"] and os.path.getsize(path) == info["bytes"], rel
            on_disk[f"{case}/{rel}"] = digest
    assert on_disk == GOLDEN_SHA256


# torch.load(weights_only=True) (torch's default since 2.6) on every file in torch's format that lightning-fp8's state
# is in: the Lightning and Fabric checkpoints, the plain torch.save, and Accelerate's custom_checkpoint_0.pkl (the
# FP8Accelerator engine state), plus Accelerate's optimizer / scheduler files. Left out: Accelerate's own
# random_states_0.pkl, which pickles numpy's RNG state (not loadable with weights_only=True, and read by Accelerate's
# load_state itself), and model.safetensors, which is not a pickle.
NOT_OURS = ("accelerate/checkpoint/random_states_0.pkl",)


@pytest.mark.parametrize("rel", [r for r in GOLDEN_SHA256 if not r.endswith(".safetensors") and r not in NOT_OURS])
def test_golden_files_load_with_weights_only(rel):
    torch.load(os.path.join(GOLDEN, rel), weights_only=True)


# -- Lightning -----------------------------------------------------------------------------------------------------
class GoldenModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = mse(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = adamw(self.parameters())
        return [opt], [{"scheduler": step_lr(opt), "interval": "step"}]


class RestoredState(Callback):
    """What the Trainer restored, seen before the first resumed step."""

    def on_train_start(self, trainer, pl_module):
        self.fp8_meta = clone_state(fp8_state_dict(pl_module))
        self.engine_state = trainer.precision_plugin.engine.state_dict()
        self.optimizer = trainer.optimizers[0]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.optimizer_state = {i: clone_state(self.optimizer.state[p]) for i, p in enumerate(params)
                                if p in self.optimizer.state}
        self.scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.global_step = trainer.global_step


def test_a_lightning_checkpoint_resumes(tmp_path):
    from lightning_fp8.optim import FP8AdamW

    record = expected("lightning")
    path = os.path.join(GOLDEN, "lightning", "golden.ckpt")
    saved = torch.load(path, weights_only=False)

    fallback = FP8LayerFallback()
    loaded_fallback_states = []
    load_fallback = fallback.load_state_dict
    fallback.load_state_dict = lambda state: (loaded_fallback_states.append(state), load_fallback(state))[1]
    restored = RestoredState()
    torch.manual_seed(1)  # other initial weights than the writer's: only the checkpoint can make the losses agree
    module = GoldenModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=FP8Precision(optimizer_state="fp8"),
                        callbacks=[fallback, restored], max_steps=SAVE_STEP + RESUME_STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(module, data_loader(), ckpt_path=path)

    assert trainer.global_step == SAVE_STEP + RESUME_STEPS and restored.global_step == SAVE_STEP
    # the plugin's state: every FP8 layer's metadata and the engine's counters, as the file holds them. Lightning
    # finds it under the plugin class's __qualname__ ("FP8Precision"): a plugin class of another name would skip it
    # without a word, and only these comparisons would notice
    plugin_state = saved["FP8Precision"]
    assert sorted(plugin_state["layer_recipes"]) == ["net.2", "net.4"]
    assert_fp8_meta_restored(restored.fp8_meta, plugin_state["fp8_meta"])
    assert_engine_restored(restored.engine_state, plugin_state["engine"])
    # FP8AdamW's state: the two 64x64 weights with E4M3 first and scaled FP16 second moments, the rest float32 (should
    # the layout change, compare what the loading code made of the file's entries)
    assert isinstance(restored.optimizer, FP8AdamW)
    saved_optimizer = saved["optimizer_states"][0]["state"]
    assert restored.optimizer_state.keys() == saved_optimizer.keys()
    compressed = [i for i, s in saved_optimizer.items() if "exp_avg_scale_inv" in s]
    assert compressed == [2, 4]
    for index, saved_state in saved_optimizer.items():
        state = restored.optimizer_state[index]
        assert state.keys() == saved_state.keys()
        for key, value in saved_state.items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), (index, key)
        assert float(state["step"]) == SAVE_STEP
    assert restored.optimizer_state[2]["exp_avg"].dtype == torch.float8_e4m3fn
    assert restored.optimizer_state[2]["exp_avg_sq"].dtype == torch.float16
    # the LR scheduler (StepLR, step_size 3: halved at steps 3 and 6)
    assert restored.scheduler["last_epoch"] == SAVE_STEP and restored.lr == 1e-2 * 0.5**2
    # FP8LayerFallback: the Trainer handed it the file's state (nothing had fallen back by step 6: its rules' state
    # is empty, but versioned), which it took
    assert loaded_fallback_states == [saved["callbacks"]["FP8LayerFallback"]]
    assert loaded_fallback_states[0] == record["saved_state"]["FP8LayerFallback"]
    assert loaded_fallback_states[0]["version"] == 1 and fallback.fallbacks == {}
    # the losses last: every restored state above is checked on any Lightning
    if _lightning_older_than_the_writers(record):
        pytest.skip(f"the resumed losses need Lightning >= {record['writer']['lightning']} (the writer's): Lightning "
                    f"{L.__version__} resumes this checkpoint, saved at the end of epoch 0 by a newer Lightning, one "
                    "batch off (its own loop state: it trains batch 0 at steps 6 and 7); the FP8 state was checked")
    assert_resumed_losses(module.losses, record)


def _lightning_older_than_the_writers(record) -> bool:
    from packaging.version import Version

    return Version(L.__version__) < Version(record["writer"]["lightning"])


# -- Fabric --------------------------------------------------------------------------------------------------------
def test_a_fabric_checkpoint_resumes():
    from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

    record = expected("fabric")
    path = os.path.join(GOLDEN, "fabric", "golden.pt")
    saved = torch.load(path, weights_only=False)

    torch.manual_seed(1)
    plugin = FabricFP8Precision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model = mlp()
    optimizer = adamw(model.parameters())
    scheduler = step_lr(optimizer)
    model, optimizer = fabric.setup(model, optimizer)
    plugin.register_lr_scheduler(scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "fp8": plugin, "step": 0}
    fabric.load(path, state)

    assert state["step"] == SAVE_STEP and state["fp8"] is plugin
    assert_fp8_meta_restored(clone_state(fp8_state_dict(model.module)), saved["fp8"]["fp8_meta"])
    assert_engine_restored(plugin.engine.state_dict(), saved["fp8"]["engine"])
    assert_adamw_state_restored(optimizer.optimizer, saved["optimizer"], lr=1e-2 * 0.5**2)  # StepLR: halved twice
    assert _without_verbose(scheduler.state_dict()) == _without_verbose(saved["scheduler"])
    assert scheduler.last_epoch == SAVE_STEP

    losses = []
    for step in range(state["step"], state["step"] + RESUME_STEPS):
        x, y = BATCHES[step % len(BATCHES)]
        optimizer.zero_grad()
        loss = mse(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert_resumed_losses(losses, record)
    assert plugin.engine.step_count == SAVE_STEP + RESUME_STEPS


# -- Accelerate ----------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py: Accelerate's singletons, reset around
def test_an_accelerate_save_state_folder_resumes():
    from lightning_fp8.accelerate import FP8Accelerator

    record = expected("accelerate")
    folder = os.path.join(GOLDEN, "accelerate", "checkpoint")
    saved_fp8 = torch.load(os.path.join(folder, "custom_checkpoint_0.pkl"), weights_only=False)
    saved_optimizer = torch.load(os.path.join(folder, "optimizer.bin"), weights_only=False)

    torch.manual_seed(1)
    accelerator = FP8Accelerator(mixed_precision="fp8", cpu=True)
    model = mlp()
    optimizer = adamw(model.parameters())
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, step_lr(optimizer))
    accelerator.load_state(folder)

    assert saved_fp8["format"] == "lightning_fp8.accelerate/1"
    assert_fp8_meta_restored(clone_state(fp8_state_dict(model)), saved_fp8["fp8_meta"])
    assert_engine_restored(accelerator.fp8_engine.state_dict(), saved_fp8["engine"])
    assert_adamw_state_restored(optimizer.optimizer, saved_optimizer, lr=1e-2 * 0.5**2)
    assert scheduler.scheduler.last_epoch == SAVE_STEP

    losses = []
    for step in range(SAVE_STEP, SAVE_STEP + RESUME_STEPS):
        x, y = BATCHES[step % len(BATCHES)]
        optimizer.zero_grad()
        loss = mse(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert_resumed_losses(losses, record)
    assert accelerator.fp8_engine.step_count == SAVE_STEP + RESUME_STEPS


# -- plain PyTorch -------------------------------------------------------------------------------------------------
def test_a_plain_converted_models_checkpoint_resumes():
    record = expected("plain")
    saved = torch.load(os.path.join(GOLDEN, "plain", "golden.pt"), weights_only=True)

    torch.manual_seed(1)
    model = convert_to_fp8(mlp())
    optimizer = adamw(model.parameters())
    model.load_state_dict(saved["model"])  # strict: the converted model's state_dict has the plain model's keys
    load_fp8_state_dict(model, saved["fp8"])
    optimizer.load_state_dict(saved["optimizer"])

    # no engine: each layer closes its step lazily at its next forward, so the file holds step 6's amaxes still
    # open (column 0 of each history) and the closed steps before it; they all came back
    assert_fp8_meta_restored(clone_state(fp8_state_dict(model)), saved["fp8"])
    for layer in FP8_LAYERS:
        assert (saved["fp8"][f"{layer}.fp8_meta.amax_history"][:, 0] > 0).all()
    assert_adamw_state_restored(optimizer, saved["optimizer"], lr=1e-2)  # no scheduler

    losses = []
    for step in range(saved["step"], saved["step"] + RESUME_STEPS):
        x, y = BATCHES[step % len(BATCHES)]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = mse(out, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert_resumed_losses(losses, record)

