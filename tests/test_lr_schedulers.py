"""LR schedulers around skipped and rolled-back iterations, through Accelerate and Fabric (issue 12, items 2 and 6).

Each framework keeps its own rule for a skipped iteration: Accelerate's prepared scheduler does not step after it
(`AcceleratedScheduler.step` returns when an optimizer's `step_was_skipped`), a plain Fabric loop steps whatever
its code says, Lightning steps after every batch (tests/test_faults.py checks Lightning, with a warmup + cosine
schedule and the default snapshot interval). A rollback restores every scheduler the engine knows to the snapshot's
iteration; the rejected iteration is then one more skipped one. The defaults throughout: snapshot_every=50.
"""
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from support.helpers import loader, mlp
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

STEPS, WARMUP, LR = 60, 10, 1e-2
NAN_AT, INF_AT = 56, 53  # a rollback to the snapshot of iteration 50; a skip before it


def warmup_cosine(optimizer):
    lr_sched = torch.optim.lr_scheduler
    return lr_sched.SequentialLR(
        optimizer,
        [lr_sched.LinearLR(optimizer, 0.1, 1.0, WARMUP), lr_sched.CosineAnnealingLR(optimizer, STEPS - WARMUP)],
        [WARMUP],
    )


def schedule_lr(steps):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = warmup_cosine(opt)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


def batches():
    return (list(loader()) * 8)[:STEPS]


def poison(i, loss, model):
    if i == NAN_AT:
        return loss * float("nan")
    return loss


def inject_inf(i, net):
    if i == INF_AT:
        net[4].weight.grad[0, 0] = float("inf")



def test_accelerate_prepared_scheduler_skips_with_the_optimizer_and_rolls_back(fresh_accelerate_state):
    from lightning_fp8.accelerate import FP8Accelerator

    torch.manual_seed(0)
    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8")
    net = mlp()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    model, optimizer, scheduler = accelerator.prepare(net, optimizer, warmup_cosine(optimizer))
    lrs = []
    for i, (x, y) in enumerate(batches()):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad()
        accelerator.backward(poison(i, F.mse_loss(model(x).float(), y), model))
        inject_inf(i, net)
        optimizer.step()
        scheduler.step()
    assert (accelerator.skipped_steps, accelerator.rollbacks) == (2, 1)
    assert accelerator.fp8_engine.events[-1]["restored_to_step"] == 50
    # up to the skip: the schedule; the skipped iteration does not step it; the rollback restores it to iteration 50
    # and the rejected iteration does not step it either
    expected = [schedule_lr(i) for i in range(INF_AT + 1)] + [schedule_lr(i - 1) for i in range(INF_AT + 1, NAN_AT + 1)]
    expected += [schedule_lr(50 + i - NAN_AT - 1) for i in range(NAN_AT + 1, STEPS)]
    assert lrs == expected
    assert scheduler.scheduler.last_epoch == 50 + STEPS - NAN_AT - 1


def fabric_run(register, scheduler_steps_always=True):
    torch.manual_seed(0)
    plugin = FabricFP8Precision()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = mlp()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    model, optimizer = fabric.setup(net, optimizer)
    scheduler = warmup_cosine(optimizer)
    if register:
        plugin.register_lr_scheduler(scheduler)
    lrs = []
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        fabric.backward(poison(i, F.mse_loss(model(x).float(), y), model))
        inject_inf(i, net)
        lrs.append(optimizer.param_groups[0]["lr"])  # the LR this iteration's step uses
        optimizer.step()
        scheduler.step()  # a plain loop steps the scheduler after every iteration, skipped or not
    return plugin, lrs


def test_fabric_registered_scheduler_rolls_back():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no LR scheduler" warning once one is registered
        plugin, lrs = fabric_run(register=True)
    assert (plugin.skipped_steps, plugin.rollbacks) == (2, 1)
    # the loop steps the scheduler after the skip too; after the rollback it continues from iteration 50, exactly
    expected = [schedule_lr(i) for i in range(NAN_AT + 1)] + [schedule_lr(50 + i - NAN_AT - 1) for i in range(NAN_AT + 1, STEPS)]
    assert lrs == expected


def test_fabric_warns_once_when_a_rollback_has_no_scheduler_to_restore():
    with pytest.warns(UserWarning, match="no LR scheduler is registered") as caught:
        plugin, lrs = fabric_run(register=False)
    assert plugin.rollbacks == 1
    assert sum("no LR scheduler" in str(w.message) for w in caught) == 1
    # the schedule did not roll back (what the warning says): after the rollback the LRs leave the restored schedule
    restored = [schedule_lr(50 + i - NAN_AT - 1) for i in range(NAN_AT + 1, STEPS)]
    assert lrs[NAN_AT + 1 :] != restored
