"""Writes the golden checkpoints under tests/data/golden/ that tests/test_golden_checkpoints.py resumes from.

WRITTEN ONCE, BY THE CODE OF COMMIT ecb0e57 (main, "docs/status.md: the 2-D amax agreement count as it is now ..."),
with torch 2.13.0+cpu, lightning 2.6.6 and accelerate 1.15.0 on a CPU with native BF16 (AVX512-BF16 / AMX); each
case's expected.json records exactly what wrote it. DO NOT RE-RUN THIS SCRIPT ON NEWER CODE to "refresh" the files:
their whole point is that they were written by the OLD code, so that the test proves that checkpoints of that
version keep loading and resuming after the options, the GEMM path or the state formats change. If a change breaks
the test, fix the loading code (or add a converter), not the files. The script refuses to write into a folder that
already holds golden files; it is committed so that anyone can see how the files were made (and, with --out, re-run
it into a scratch folder on the old commit to check that it is deterministic).

Four cases, one folder each, all the same tiny model (Linear 32->64, GELU, 64->64, GELU, 64->64, GELU, 64->32:
the two middle linears are FP8 under the default filter, the first and the last stay BF16), the same regression data
(192 samples, batch 32, no shuffling: 6 batches per epoch, step i trains on batch i % 6), AdamW(lr=1e-2,
weight_decay=0.01), seeds 0, torch.set_num_threads(1), CPU only. Each case trains SAVE_STEP=6 steps, saves, and the
same in-memory objects train RESUME_STEPS=4 more; then the script also resumes a fresh run (other initial weights,
seed 1) from the saved file(s) with the library's normal API and checks the two agree. expected.json holds the
losses of steps 7..10 (float64 from `.item()`, and their float.hex()), the settings, the versions, the commit,
`cpu_has_native_bf16()` (the CPU emulation of FP8 GEMMs runs in BF16 or float32 depending on it), whether the
resumed run was bit-identical to the uninterrupted one, and each file's size and sha256.

    lightning/   Trainer(plugins=FP8Precision(optimizer_state="fp8"), callbacks=[FP8LayerFallback()], max_steps=10):
                 a StepLR(step_size=3, gamma=0.5, interval="step") scheduler, golden.ckpt written by
                 trainer.save_checkpoint in on_train_batch_end at global_step 6 (what ModelCheckpoint(
                 every_n_train_steps=6) does, without ModelCheckpoint's own state, which holds absolute paths of the
                 writing machine). Step 6 ends epoch 0: Lightning cannot resume a non-stateful DataLoader mid-epoch
                 (it restarts the epoch's data while counting on from the saved batch index), so the save point is an
                 epoch end. The resume is a fresh Trainer(max_steps=10).fit(module, ckpt_path=golden.ckpt).
    fabric/      L.Fabric(accelerator="cpu", devices=1, plugins=lightning_fp8.fabric.FP8Precision()), StepLR
                 registered with the plugin, golden.pt = fabric.save(path, {"model", "optimizer", "scheduler",
                 "fp8": plugin, "step"}); the resume is fabric.load(path, same keys).
    accelerate/  FP8Accelerator(mixed_precision="fp8", cpu=True), model / optimizer / StepLR prepared (the data is not
                 prepared: a plain list of batches), checkpoint/ = accelerator.save_state(...); the resume is
                 accelerator.load_state(...).
    plain/       convert_to_fp8(model), torch.optim.AdamW, forward under torch.autocast("cpu", dtype=torch.bfloat16),
                 golden.pt = torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model),
                 "optimizer": opt.state_dict(), "step": 6}); the resume is convert_to_fp8 + load_state_dict +
                 load_fp8_state_dict.

Usage (from the repository root): python tests/data/golden/make_golden.py [--out DIR]
Each case runs in its own subprocess (Accelerate's state is a process-wide singleton; nothing leaks between cases).
Determinism: at ecb0e57 two runs into scratch folders and the run that wrote tests/data/golden/ gave byte-identical
files (every checkpoint and every expected.json); nothing in them depends on the output folder's path.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CASES = ("lightning", "fabric", "accelerate", "plain")

SEED = 0
RESUME_SEED = 1  # the resumed run starts from other weights: only the checkpoint can make it agree
D, HIDDEN = 32, 64
N_SAMPLES, BATCH_SIZE = 192, 32  # 6 batches per epoch
LR, WEIGHT_DECAY = 1e-2, 0.01
STEP_SIZE, GAMMA = 3, 0.5  # StepLR, stepped every optimizer step
SAVE_STEP, RESUME_STEPS = 6, 4
THREADS = 1


# -- model, data, seeds (inlined, not imported from tests/support/helpers.py: this file is a record of what wrote the files) --
def seed_all(seed):
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))


def dataset():
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, D, generator=g)
    w = torch.randn(D, D, generator=g) / D**0.5
    return TensorDataset(x, x @ w)


def data_loader():
    from torch.utils.data import DataLoader

    return DataLoader(dataset(), batch_size=BATCH_SIZE, shuffle=False)


def batches():
    return list(data_loader())


def mse(out, y):
    import torch.nn.functional as F

    return F.mse_loss(out.float(), y)


def adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def step_lr(optimizer):
    import torch

    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE, gamma=GAMMA)


# -- cases: each returns (uninterrupted losses, resumed losses, {file: path}, saved state summary) ------------------
def case_lightning(out):
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_fp8 import FP8LayerFallback, FP8Precision

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

    class SaveAt(Callback):
        """trainer.save_checkpoint in on_train_batch_end, as ModelCheckpoint(every_n_train_steps=...) does."""

        def __init__(self, step, path):
            self.step, self.path = step, path

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == self.step:
                trainer.save_checkpoint(self.path)

    def trainer(max_steps, callbacks):
        return L.Trainer(accelerator="cpu", devices=1, plugins=FP8Precision(optimizer_state="fp8"),
                         callbacks=callbacks, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)

    path = os.path.join(out, "golden.ckpt")
    seed_all(SEED)
    module = GoldenModule()
    trainer(SAVE_STEP + RESUME_STEPS, [FP8LayerFallback(), SaveAt(SAVE_STEP, path)]).fit(module, data_loader())
    uninterrupted = module.losses

    seed_all(RESUME_SEED)
    fresh = GoldenModule()
    trainer(SAVE_STEP + RESUME_STEPS, [FP8LayerFallback()]).fit(fresh, data_loader(), ckpt_path=path)

    saved = torch.load(path, weights_only=False)
    summary = {
        "engine": _engine_summary(saved["FP8Precision"]["engine"]),
        "fp8_meta_keys": sorted(saved["FP8Precision"]["fp8_meta"]),
        "FP8LayerFallback": saved["callbacks"]["FP8LayerFallback"],
        "optimizer_state_dtypes": _optimizer_dtypes(saved["optimizer_states"][0]),
        "lr_scheduler": {k: v for k, v in saved["lr_schedulers"][0].items()},
        "loops_global_step": saved["global_step"],
        "epoch": saved["epoch"],
        "checkpoint_keys": sorted(saved),
    }
    settings = {
        "trainer": "L.Trainer(accelerator='cpu', devices=1, plugins=FP8Precision(optimizer_state='fp8'), "
                   "callbacks=[FP8LayerFallback(), <save at step 6>], max_steps=10, logger=False, "
                   "enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)",
        "plugin": "lightning_fp8.FP8Precision(optimizer_state='fp8'), every other argument at its default",
        "callbacks": "lightning_fp8.FP8LayerFallback() at its defaults",
        "optimizers": "configure_optimizers: AdamW(lr=1e-2, weight_decay=0.01) (the plugin makes it FP8AdamW), "
                      "StepLR(step_size=3, gamma=0.5), interval='step'",
        "save": "trainer.save_checkpoint(golden.ckpt) in on_train_batch_end at global_step 6 (the end of epoch 0)",
        "resume": "a fresh module (seed 1) and Trainer(max_steps=10), "
                  "trainer.fit(module, loader, ckpt_path=golden.ckpt)",
    }
    return uninterrupted, fresh.losses, {"golden.ckpt": path}, summary, settings


def case_fabric(out):
    import lightning as L
    import torch

    from lightning_fp8.fabric import FP8Precision

    path = os.path.join(out, "golden.pt")
    data = batches()

    def setup(seed):
        seed_all(seed)
        plugin = FP8Precision()
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
        model = mlp()
        optimizer = adamw(model.parameters())
        scheduler = step_lr(optimizer)
        model, optimizer = fabric.setup(model, optimizer)
        plugin.register_lr_scheduler(scheduler)
        return fabric, plugin, model, optimizer, scheduler

    def train(fabric, model, optimizer, scheduler, steps, start):
        losses = []
        for step in range(start, start + steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad()
            loss = mse(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        return losses

    fabric, plugin, model, optimizer, scheduler = setup(SEED)
    first = train(fabric, model, optimizer, scheduler, SAVE_STEP, 0)
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "fp8": plugin,
                       "step": SAVE_STEP})
    uninterrupted = first + train(fabric, model, optimizer, scheduler, RESUME_STEPS, SAVE_STEP)

    fabric, plugin, model, optimizer, scheduler = setup(RESUME_SEED)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "fp8": plugin, "step": 0}
    fabric.load(path, state)
    resumed = train(fabric, model, optimizer, scheduler, RESUME_STEPS, state["step"])

    saved = torch.load(path, weights_only=False)
    summary = {
        "engine": _engine_summary(saved["fp8"]["engine"]),
        "fp8_meta_keys": sorted(saved["fp8"]["fp8_meta"]),
        "optimizer_state_dtypes": _optimizer_dtypes(saved["optimizer"]),
        "scheduler": saved["scheduler"],
        "step": saved["step"],
        "checkpoint_keys": sorted(saved),
    }
    settings = {
        "fabric": "L.Fabric(accelerator='cpu', devices=1, plugins=lightning_fp8.fabric.FP8Precision())",
        "plugin": "lightning_fp8.fabric.FP8Precision(), every argument at its default",
        "optimizer": "torch.optim.AdamW(lr=1e-2, weight_decay=0.01), StepLR(step_size=3, gamma=0.5) stepped every "
                     "step and registered with plugin.register_lr_scheduler",
        "loop": "step i: x, y = batches[i % 6]; zero_grad; loss = mse_loss(model(x).float(), y); "
                "fabric.backward(loss); optimizer.step(); scheduler.step()",
        "save": "fabric.save(golden.pt, {'model', 'optimizer', 'scheduler', 'fp8': plugin, 'step': 6}) after step 6",
        "resume": "fresh Fabric, plugin, model (seed 1), optimizer, scheduler set up the same way, "
                  "fabric.load(golden.pt, same dict), steps 6..9",
    }
    return uninterrupted, resumed, {"golden.pt": path}, summary, settings


def case_accelerate(out):
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from lightning_fp8.accelerate import FP8Accelerator

    folder = os.path.join(out, "checkpoint")
    data = batches()

    def setup(seed):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        seed_all(seed)
        accelerator = FP8Accelerator(mixed_precision="fp8", cpu=True)
        model = mlp()
        optimizer = adamw(model.parameters())
        scheduler = step_lr(optimizer)
        return (accelerator, *accelerator.prepare(model, optimizer, scheduler))

    def train(accelerator, model, optimizer, scheduler, steps, start):
        losses = []
        for step in range(start, start + steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad()
            loss = mse(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        return losses

    accelerator, model, optimizer, scheduler = setup(SEED)
    first = train(accelerator, model, optimizer, scheduler, SAVE_STEP, 0)
    accelerator.save_state(folder)
    uninterrupted = first + train(accelerator, model, optimizer, scheduler, RESUME_STEPS, SAVE_STEP)

    accelerator, model, optimizer, scheduler = setup(RESUME_SEED)
    accelerator.load_state(folder)
    resumed = train(accelerator, model, optimizer, scheduler, RESUME_STEPS, SAVE_STEP)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    files = {f"checkpoint/{name}": os.path.join(folder, name) for name in sorted(os.listdir(folder))}
    custom = torch.load(os.path.join(folder, "custom_checkpoint_0.pkl"), weights_only=False)
    summary = {
        "custom_checkpoint_0.format": custom["format"],
        "engine": _engine_summary(custom["engine"]),
        "fp8_meta_keys": sorted(custom["fp8_meta"]),
        "optimizer_state_dtypes": _optimizer_dtypes(torch.load(os.path.join(folder, "optimizer.bin"),
                                                               weights_only=False)),
        "scheduler": torch.load(os.path.join(folder, "scheduler.bin"), weights_only=False),
        "files": sorted(os.listdir(folder)),
    }
    settings = {
        "accelerator": "lightning_fp8.accelerate.FP8Accelerator(mixed_precision='fp8', cpu=True), no FP8Kwargs",
        "prepared": "accelerator.prepare(model, AdamW(lr=1e-2, weight_decay=0.01), StepLR(step_size=3, gamma=0.5)); "
                    "the data is a plain list of batches, not prepared",
        "loop": "step i: x, y = batches[i % 6]; optimizer.zero_grad(); loss = mse_loss(model(x).float(), y); "
                "accelerator.backward(loss); optimizer.step(); scheduler.step()",
        "save": "accelerator.save_state(checkpoint/) after step 6 (Accelerate's defaults: safetensors for the model)",
        "resume": "AcceleratorState._reset_state(True), GradientState._reset_state(), a fresh FP8Accelerator and "
                  "model (seed 1) prepared the same way, accelerator.load_state(checkpoint/), steps 6..9",
    }
    return uninterrupted, resumed, files, summary, settings


def case_plain(out):
    import torch

    from lightning_fp8 import convert_to_fp8, fp8_layers, fp8_state_dict, load_fp8_state_dict

    path = os.path.join(out, "golden.pt")
    data = batches()

    def setup(seed):
        seed_all(seed)
        model = convert_to_fp8(mlp())
        return model, adamw(model.parameters())

    def train(model, optimizer, steps, start):
        losses = []
        for step in range(start, start + steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out_ = model(x)
            loss = mse(out_, y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    model, optimizer = setup(SEED)
    first = train(model, optimizer, SAVE_STEP, 0)
    torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model), "optimizer": optimizer.state_dict(),
                "step": SAVE_STEP}, path)
    uninterrupted = first + train(model, optimizer, RESUME_STEPS, SAVE_STEP)

    model, optimizer = setup(RESUME_SEED)
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    load_fp8_state_dict(model, saved["fp8"])
    optimizer.load_state_dict(saved["optimizer"])
    resumed = train(model, optimizer, RESUME_STEPS, saved["step"])

    summary = {
        "fp8_layers": sorted(fp8_layers(model)),
        "fp8_meta_keys": sorted(saved["fp8"]),
        "optimizer_state_dtypes": _optimizer_dtypes(saved["optimizer"]),
        "step": saved["step"],
        "checkpoint_keys": sorted(saved),
    }
    settings = {
        "model": "lightning_fp8.convert_to_fp8(model) with the default recipe and filter",
        "optimizer": "torch.optim.AdamW(lr=1e-2, weight_decay=0.01), no scheduler",
        "loop": "step i: x, y = batches[i % 6]; zero_grad; with torch.autocast('cpu', dtype=torch.bfloat16): "
                "out = model(x); loss = mse_loss(out.float(), y); loss.backward(); optimizer.step()",
        "save": "torch.save({'model': model.state_dict(), 'fp8': fp8_state_dict(model), "
                "'optimizer': optimizer.state_dict(), 'step': 6}, golden.pt) after step 6",
        "resume": "convert_to_fp8(mlp()) (seed 1), model.load_state_dict, load_fp8_state_dict, "
                  "optimizer.load_state_dict, steps 6..9",
    }
    return uninterrupted, resumed, {"golden.pt": path}, summary, settings


def _engine_summary(engine):
    keep = ("scaler", "skipped_steps", "rollbacks", "step_count", "consecutive_skips", "overflow_events",
            "rollback_steps", "loss_window", "events")
    return {k: engine[k] for k in keep if k in engine}


def _optimizer_dtypes(state_dict):
    return {str(index): {key: str(value.dtype) for key, value in sorted(state.items())}
            for index, state in sorted(state_dict["state"].items())}


# -- driver --------------------------------------------------------------------------------------------------------
def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_case(name, out):
    import torch

    torch.set_num_threads(THREADS)
    warnings.simplefilter("ignore")  # FP8EmulationWarning, Lightning's notes on a CPU run
    import accelerate
    import lightning

    import lightning_fp8
    from lightning_fp8.modules.gemm import cpu_has_native_bf16

    os.makedirs(out, exist_ok=True)
    uninterrupted, resumed, files, summary, settings = globals()[f"case_{name}"](out)
    assert len(uninterrupted) == SAVE_STEP + RESUME_STEPS and len(resumed) == RESUME_STEPS, (uninterrupted, resumed)
    after_save = uninterrupted[SAVE_STEP:]
    equal = after_save == resumed
    # the losses a resume must reproduce: the uninterrupted run's where the resume is bit-identical to it (then both
    # are the same list), else the resumed run's (what loading the file does), and the difference is recorded
    expected = after_save if equal else resumed
    lightning_fp8_dir = os.path.dirname(os.path.abspath(lightning_fp8.__file__))
    record = {
        "case": name,
        "note": "written once by tests/data/golden/make_golden.py at the commit below; never regenerate these files",
        "writer": {
            "git_commit": _git("rev-parse", "HEAD"),
            "library_code_clean": _git("status", "--porcelain", "--", "lightning_fp8", "kernels") == "",
            "lightning_fp8": lightning_fp8.__version__,
            "lightning_fp8_imported_from_this_checkout": lightning_fp8_dir == os.path.join(ROOT, "lightning_fp8"),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "accelerate": accelerate.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_has_native_bf16": cpu_has_native_bf16(),
            "torch_num_threads": torch.get_num_threads(),
        },
        "settings": {
            "seed": SEED, "resume_seed": RESUME_SEED,
            "model": f"Linear({D},{HIDDEN}) GELU Linear({HIDDEN},{HIDDEN}) GELU "
                     f"Linear({HIDDEN},{HIDDEN}) GELU Linear({HIDDEN},{D}); FP8: net.2, net.4",
            "data": f"{N_SAMPLES} samples: x = randn({N_SAMPLES}, {D}), y = x @ (randn({D}, {D}) / sqrt({D})), one "
                    f"torch.Generator seeded 0; batch_size {BATCH_SIZE}, shuffle=False; step i trains on batch i % "
                    f"{N_SAMPLES // BATCH_SIZE}",
            "loss": "mse_loss(output.float(), y)",
            "save_after_step": SAVE_STEP, "resume_steps": RESUME_STEPS,
            **settings,
        },
        "losses_before_save": uninterrupted[:SAVE_STEP],
        "losses_before_save_hex": [float.hex(v) for v in uninterrupted[:SAVE_STEP]],
        "expected_losses": expected,
        "expected_losses_hex": [float.hex(v) for v in expected],
        "expected_losses_from": "the uninterrupted run (the same in-memory objects, trained on after the save)"
                                if equal else "the script's own resumed run (it differs from the uninterrupted one)",
        "resumed_equals_uninterrupted": equal,
        "uninterrupted_after_save_hex": [float.hex(v) for v in after_save],
        "resumed_hex": [float.hex(v) for v in resumed],
        "saved_state": summary,
        "files": {rel: {"bytes": os.path.getsize(p), "sha256": _sha256(p)} for rel, p in sorted(files.items())},
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(record, f, indent=1, sort_keys=False, default=_json_default)
        f.write("\n")
    print(f"{name}: resumed == uninterrupted: {equal}; expected losses {[float.hex(v) for v in expected]}")


def _json_default(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=HERE, help="the folder to write the four case folders into")
    parser.add_argument("--case", choices=CASES, help="run one case in this process (the driver uses it)")
    args = parser.parse_args()
    if args.case:
        run_case(args.case, os.path.join(args.out, args.case))
        return
    existing = [c for c in CASES if os.path.exists(os.path.join(args.out, c))]
    if existing:
        sys.exit(f"{args.out} already holds {existing}: golden files are written once and never regenerated "
                 "(see the docstring); pass --out with an empty folder to check the script")
    for case in CASES:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--case", case, "--out", args.out], check=True)


if __name__ == "__main__":
    main()
