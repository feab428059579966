"""Accelerate scripts as users have them: clipping every micro-batch inside `accumulate()` works as under BF16 when no
loss scaling is active. (Unchanged `accelerate.Accelerator()` scripts under the launcher: tests/test_examples.py and
tests/test_accelerate_dropin.py.)"""

import pytest
import torch
import torch.nn.functional as F

from support.helpers import loader, mlp
from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # tests/conftest.py


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
