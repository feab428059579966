"""Accelerate scripts as users have them: a plain `accelerate.Accelerator()` launched with fp8 through our launcher
gets pointed to FP8Accelerator, and clipping every micro-batch inside `accumulate()` works as under BF16 when no loss
scaling is active."""
import os
import subprocess
import sys
import warnings

import accelerate
import accelerate.utils.imports as accelerate_imports
import pytest
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState

from helpers import loader, mlp
from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs
from lightning_fp8.integrations.accelerate import launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py


@pytest.fixture
def guarded(monkeypatch):
    """What each process launched with fp8 by `python -m lightning_fp8.accelerate launch` runs under."""
    monkeypatch.setattr(accelerate.Accelerator, "__init__", accelerate.Accelerator.__init__)  # restored afterwards
    launch.install_accelerator_check()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")


def test_plain_accelerator_with_fp8_points_to_fp8accelerator(guarded):
    with pytest.raises(RuntimeError, match="FP8Accelerator") as error:
        accelerate.Accelerator(cpu=True)
    assert "none of its FP8 backends" in str(error.value)


def test_plain_accelerator_with_an_accelerate_backend_warns_whose_fp8_it_is(guarded, monkeypatch):
    monkeypatch.setattr(accelerate_imports, "is_torchao_available", lambda: True)
    with pytest.warns(UserWarning, match="Accelerate will run FP8 with torchao") as caught:
        with pytest.raises(ImportError):  # torchao is not really installed here, so Accelerate itself then fails
            accelerate.Accelerator(cpu=True)
    assert "FP8Accelerator" in str(caught[0].message)


def test_the_guard_leaves_fp8accelerator_and_other_precisions_alone(guarded, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FP8Accelerator(cpu=True).mixed_precision == "fp8"
        AcceleratorState._reset_state(True)
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
        assert accelerate.Accelerator(cpu=True).mixed_precision == "bf16"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launcher_points_an_unchanged_script_to_fp8accelerator():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--cpu", "--num_processes", "1",
           "--num_cpu_threads_per_process", "1", "--mixed_precision", "fp8", os.path.join(HERE, "accelerate_plain_script.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode != 0 and "BUILT" not in proc.stdout
    assert "Build lightning_fp8.accelerate.FP8Accelerator instead" in proc.stderr
    assert "requires transformer_engine" not in proc.stderr  # our message comes first, not Accelerate's


def _accumulate(accelerator, model, optimizer, clip, poison_second_micro_batch=False):
    """clip: "every" micro-batch, or only the "unsynced" ones (before the gradients sync)."""
    norms, steps = [], []
    for i, (x, y) in enumerate(loader()):
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x).float(), y))
            if poison_second_micro_batch and i == 1:
                model[0].weight.grad[0, 0] = float("inf")
            if clip == "every" or not accelerator.sync_gradients:
                grads = [p.grad.detach().clone() for p in model.parameters()]
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                norms.append((float(norm), float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))),
                              float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))))
            optimizer.step()
            optimizer.zero_grad()
            steps.append(accelerator.fp8_engine.last_result.stepped if accelerator.sync_gradients else None)
    return norms, steps


def test_clipping_every_micro_batch_without_loss_scaling_works_as_under_bf16():
    torch.manual_seed(0)
    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", gradient_accumulation_steps=2)
    assert accelerator.fp8_engine.scaler.mode == "none"  # the default: no loss scaling with scaled FP8 gradients
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    norms, steps = _accumulate(accelerator, model, optimizer, clip="every")
    assert len(norms) == 8 and accelerator.fp8_engine.step_count == 4 and accelerator.skipped_steps == 0
    for returned, before, after in norms:  # each call returns the norm it clipped, and clips it to 0.5
        assert returned == pytest.approx(before, rel=1e-6) and after <= 0.5 * (1 + 1e-5)


def test_a_non_finite_gradient_after_a_micro_batch_clip_still_skips_the_step():
    """Clipping the first micro-batch must not stand in for the engine's check of the summed gradients: the inf
    added by the second micro-batch (not clipped) is found at the step, which is skipped."""
    torch.manual_seed(0)
    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8", gradient_accumulation_steps=2,
                                 kwargs_handlers=[FP8Kwargs(snapshot_every=1)])
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _, steps = _accumulate(accelerator, model, optimizer, clip="unsynced", poison_second_micro_batch=True)
    assert steps == [None, False, None, True, None, True, None, True]
    assert accelerator.skipped_steps == 1 and accelerator.rollbacks == 0
