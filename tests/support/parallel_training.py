"""What the tensor-parallel workers share (tests/workers/tensor_parallel_worker.py,
tests/workers/parallel_2d_worker.py): the model size, the steps where a fault is injected on one rank, and the faults
themselves, placed where no collective carries them to another rank, so every rank takes the skip and the rollback
only if the engine agrees its flags across ranks."""
from __future__ import annotations

import math
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_fp8.demo.gpt import GPTConfig

CFG = GPTConfig(vocab_size=64, context=16, d_model=32, n_layers=2, n_heads=2)
STEPS = 6  # both faults (steps 1 and 3) and two clean steps after them
SKIP_STEP = 3  # rank 1's gradients are inf at this step: every rank must skip it
ROLLBACK_STEP = 1  # rank 0's loss is NaN at this step: every rank must roll back
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
#: how long rank 0 waits for the others to join the process group: a rank can take minutes to start on a loaded
#: machine (4 ranks on 2 cores beside another test's processes), which is slowness, not a hang; the other workers use
#: gloo's default (30 minutes) here, and the test's own timeout bounds the whole launch anyway
JOIN_TIMEOUT = timedelta(seconds=480)


def rank() -> int:
    return dist.get_rank()


def nan_loss_on_rank_0(loss: torch.Tensor, step: int) -> torch.Tensor:
    """Rank 0's loss NaN at ROLLBACK_STEP, the NaN a constant added after the forward: its gradients stay finite, so
    nothing non-finite reaches another rank through a collective (as a NaN in the forward would, through the
    sequence-parallel gathers); the other ranks roll back only if the engine agrees its flags across ranks."""
    return loss + float("nan") if step == ROLLBACK_STEP and rank() == 0 else loss

def inf_gradient_on_rank_1(model: nn.Module, step: int) -> None:
    """Rank 1's gradient of the head's weight gets an inf at SKIP_STEP, after the backward: the head is replicated
    across the tensor-parallel group (FSDP2 x TP: sharded over the data-parallel dimension, its reduce-scatter
    done), so no collective carries it to another rank; they skip only if the engine agrees its flags across ranks."""
    if step == SKIP_STEP and rank() == 1:
        grad = model.head.weight.grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")

def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / STEPS)))

def full_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).float()
                      for p in model.parameters()])


def run_scenarios(scenarios: Dict[str, Callable[[], dict]], out: str, names: Optional[Sequence[str]] = None) -> None:
    """Each rank's body: the scenarios in `names` (default: those named on the command line after OUT, else all),
    each result saved to OUT/<scenario>.rank<r>.pt, a scenario's traceback to .error for the test to show."""
    names = list(names or sys.argv[2:] or scenarios)
    # a rank that raises leaves the others waiting in a collective: bounded at 2 minutes (gloo's default is 30),
    # for the mesh's subgroups too (new_group takes the default timeout); joining is given longer (JOIN_TIMEOUT)
    distributed_c10d.default_pg_timeout = COLLECTIVE_TIMEOUT
    dist.init_process_group("gloo", timeout=JOIN_TIMEOUT)
    dist.barrier()  # every rank has joined: from here on a wait longer than COLLECTIVE_TIMEOUT is a hang
    distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)
    try:
        for name in names:
            prefix = os.path.join(out, f"{name}.rank{rank()}")
            start = time.perf_counter()
            try:
                torch.save(scenarios[name](), prefix + ".pt")
            except Exception:  # noqa: BLE001 - reported to the test through the error file
                with open(prefix + ".error", "w") as f:
                    f.write(traceback.format_exc())
            if rank() == 0:
                print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()
