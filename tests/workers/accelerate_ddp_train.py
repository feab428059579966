"""Run by tests/test_accelerate.py on 2 CPU processes (gloo) through the Accelerate launcher:

    ACCELERATE_USE_CPU=1 python -m lightning_fp8.accelerate launch --multi_gpu --num_processes 2 \
        --mixed_precision fp8 tests/workers/accelerate_ddp_train.py OUT_DIR OVERFLOW_STEP

An ordinary Accelerate loop: the prepared DataLoader gives each rank its own shard, so activations, gradients and raw
amaxes differ between ranks. At OVERFLOW_STEP an activation entering an FP8 layer overflows on rank 0 only. Each
rank saves its final model state (weights and FP8 metadata), counters and losses; the test checks the ranks agree.
The script ends the way Accelerate asks scripts to end (`end_training`, which ends the process group; see
tests/support/process_group.py for why it matters on gloo).
"""
import os
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
from support.helpers import mlp, regression_data  # noqa: E402

from lightning_fp8 import fp8_state_dict  # noqa: E402
from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs  # noqa: E402


def main(out_dir: str, overflow_step: int) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    accelerator = FP8Accelerator(kwargs_handlers=[FP8Kwargs(loss_scaling="dynamic", snapshot_every=4)])
    try:
        train(accelerator, out_dir, overflow_step)
        accelerator.wait_for_everyone()  # no rank ends the process group while another still uses it
    finally:
        accelerator.end_training()  # destroy_process_group: gloo's worker threads end while Python is fully alive


def train(accelerator: FP8Accelerator, out_dir: str, overflow_step: int) -> None:
    assert accelerator.mixed_precision == "fp8", accelerator.mixed_precision
    assert accelerator.num_processes == 2, accelerator.num_processes
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = DataLoader(regression_data(256), batch_size=16, shuffle=False)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    inner = accelerator.unwrap_model(model)
    step = 0

    def overflow(module, inputs, output):
        if accelerator.process_index == 0 and step == overflow_step:
            return output * float("inf")  # the input of FP8 layer 2 overflows, on rank 0 only
        return output

    inner[1].register_forward_hook(overflow)
    losses, skipped = [], []
    for _ in range(2):
        for x, y in data:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            skipped.append(optimizer.step_was_skipped)
            step += 1
    state = {k: v.detach().clone() for k, v in inner.state_dict().items()}
    state.update({k: v.detach().clone() for k, v in fp8_state_dict(inner).items()})
    state["losses"] = torch.tensor(losses)
    state["skipped_at"] = torch.tensor([i for i, s in enumerate(skipped) if s])
    state["counters"] = torch.tensor([accelerator.skipped_steps, accelerator.rollbacks, accelerator.loss_scale])
    torch.save(state, os.path.join(out_dir, f"rank{accelerator.process_index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
