"""One engine iteration spans every optimizer of a training iteration (issue 12, item 1).

Two optimizers over different layers of one model, through the real Trainer (manual optimization), Fabric and
Accelerate. Every iteration records, per parameter, the weight before the steps, the gradient the backward left
(scaled by the loss scale S of that backward) and S; after the steps the weight must be exactly
`w - lr * grad / S` (SGD, power-of-two S: every operation is exact) when the iteration was applied, and unchanged
when it was skipped. Before the fix each optimizer's step was a whole engine step: with an inf in optimizer B's
gradients A was skipped and B stepped on the poisoned batch; with an FP8 amax overflow the first optimizer backed the
loss scale off before the second unscaled, so the second applied 2x its gradient; the loss scale grew and snapshots
were taken at twice the rate, and the first snapshot held one optimizer of two.
"""
import lightning as L
import pytest
import torch
import torch.nn.functional as F

from support.helpers import loader, mlp, trainer
from lightning_fp8 import FP8Precision
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

LR = 0.05
A_LAYERS, B_LAYERS = (0, 2), (4, 6)  # mlp(): linears at 0, 2, 4, 6; 2 and 4 are FP8 (first / last stay BF16)


def two_optimizers(net, momentum=0.0):
    params = lambda idx: [p for i in idx for p in net[i].parameters()]
    return (torch.optim.SGD(params(A_LAYERS), lr=LR, momentum=momentum),
            torch.optim.SGD(params(B_LAYERS), lr=LR, momentum=momentum))


class Faults:
    """inf_grad_b: an inf in a gradient of optimizer B's layer; amax_a: an inf activation entering FP8 layer net.2
    (optimizer A's): its saturating cast keeps every gradient finite, only the amax shows it."""

    def __init__(self, net, kind, at):
        self.kind, self.at, self.i = kind, at, 0
        net[1].register_forward_hook(lambda m, i, out: out * float("inf") if self.now("amax_a") else out)

    def now(self, kind):
        return self.kind == kind and self.i in self.at

    def after_backward(self, net):
        if self.now("inf_grad_b"):
            net[6].weight.grad[0, 0] = float("inf")


class Ledger:
    """Per iteration: (weights before, gradients after backward, loss scale); checked after the steps. `layers`: the
    layers the steps update (default: all); the others must not move."""

    def __init__(self, net):
        self.net, self.rows = net, []

    def before_steps(self, loss_scale, layers=A_LAYERS + B_LAYERS):
        stepping = {id(p) for i in layers for p in self.net[i].parameters()}
        self.pending = [(p.detach().clone(), p.grad.detach().clone(), loss_scale, id(p) in stepping)
                        for p in self.net.parameters()]

    def after_steps(self, applied):
        self.rows.append(applied)
        for p, (before, grad, scale, stepping) in zip(self.net.parameters(), self.pending):
            expected = before.add(grad / scale, alpha=-LR) if applied and stepping else before
            assert torch.equal(p.detach(), expected), (len(self.rows), applied)


def applied(result):
    """The iteration's update is in the weights (StepResult.applied)."""
    return result.stepped and not result.rolled_back


def check_histories(net, iterations):
    """One scaling step closed per iteration: the input history holds exactly min(iterations, L) amaxes."""
    for i in (2, 4):
        history = net[i].fp8_meta.input.amax_history[1:]
        assert int((history > 0).sum()) == min(iterations, history.numel())


# -- Lightning --------------------------------------------------------------------------------------------------------
class TwoOptimizerModule(L.LightningModule):
    """momentum > 0: optimizer state to roll back (the ledger, which assumes plain SGD, is not checked then)."""

    def __init__(self, kind=None, at=(), momentum=0.0, nan_loss_at=None):
        super().__init__()
        self.automatic_optimization = False
        self.net = mlp()
        self.faults = Faults(self.net, kind, at)
        self.ledger = Ledger(self.net)
        self.momentum, self.nan_loss_at, self.states = momentum, nan_loss_at, {}

    def configure_optimizers(self):
        return list(two_optimizers(self.net, self.momentum))

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        self.states[self.faults.i] = [_momenta(opt) for opt in (opt_a, opt_b)]  # after the previous iteration
        x, y = batch
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = F.mse_loss(self.net(x).float(), y)
        self.manual_backward(loss * float("nan") if self.faults.i == self.nan_loss_at else loss)
        self.faults.after_backward(self.net)
        plugin = self.trainer.precision_plugin
        self.ledger.before_steps(plugin.loss_scale)
        opt_a.step()
        opt_b.step()
        if not self.momentum:
            self.ledger.after_steps(applied(plugin.engine.last_result))
        self.faults.i += 1


def _momenta(optimizer):
    return [optimizer.state[p]["momentum_buffer"].clone() for p in optimizer.state if "momentum_buffer" in optimizer.state[p]]


def lightning_run(plugin, kind=None, at=(), steps=8):
    torch.manual_seed(0)
    model = TwoOptimizerModule(kind, at)
    trainer(plugins=[plugin], max_steps=2 * steps, max_epochs=-1).fit(model, loader())  # Lightning counts each .step()
    return model


def test_lightning_inf_in_optimizer_b_skips_both_optimizers():
    """Defaults (no loss scaling): the poisoned batch updates neither optimizer, the clean ones each exactly once."""
    plugin = FP8Precision()
    model = lightning_run(plugin, "inf_grad_b", at={3})
    assert model.ledger.rows == [True] * 3 + [False] + [True] * 4
    assert plugin.skipped_steps == 1 and plugin.engine.step_count == 8
    assert plugin.engine.events[0]["step"] == 4 and plugin.engine.events[0]["reason"] == "non-finite gradients"
    check_histories(model.net, 7)  # the skipped iteration leaves no trace


@pytest.mark.parametrize("kind", ["inf_grad_b", "amax_a"])
def test_lightning_overflow_with_dynamic_loss_scaling_applies_each_gradient_once(kind):
    """After the overflow the scale halves once, for the iteration, and no optimizer divides by the halved scale a
    gradient scaled by the old one (measured before the fix: optimizer B applied 2x its gradient)."""
    plugin = FP8Precision(loss_scaling="dynamic", growth_interval=3)
    model = lightning_run(plugin, kind, at={2}, steps=9)
    assert model.ledger.rows == [True] * 2 + [False] + [True] * 6
    # growth_interval counts iterations: 256 -> 128 at the overflow, doubled after 3 and 6 clean iterations
    assert plugin.loss_scale == 128.0 * 4 and plugin.engine.step_count == 9
    check_histories(model.net, 8)


def test_lightning_snapshots_count_iterations_and_hold_both_optimizers():
    """snapshot_every (default 50) counts iterations (before the fix: optimizer steps, so the snapshot of "step 50"
    was iteration 25's); a rollback at iteration 57 restores both optimizers' state to iteration 50's."""
    plugin = FP8Precision()
    torch.manual_seed(0)
    model = TwoOptimizerModule(momentum=0.9, nan_loss_at=56)
    trainer(plugins=[plugin], max_steps=2 * 58, max_epochs=-1).fit(model, loader())
    assert plugin.engine.step_count == 58 and plugin.engine.snapshot_step == 50
    assert plugin.rollbacks == 1 and plugin.engine.events[-1]["restored_to_step"] == 50
    after_rollback, at_50 = model.states[57], model.states[50]
    assert [len(m) for m in after_rollback] == [4, 4]
    assert all(torch.equal(a, b) for opt_a, opt_b in zip(after_rollback, at_50) for a, b in zip(opt_a, opt_b))


# -- Fabric -----------------------------------------------------------------------------------------------------------
def fabric_run(plugin, kind=None, at=(), steps=8, scheduler=False, nan_loss_at=None):
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = mlp()
    faults, ledger = Faults(net, kind, at), Ledger(net)
    opt_a, opt_b = two_optimizers(net)
    model, opt_a, opt_b = fabric.setup(net, opt_a, opt_b)
    batches = list(loader()) * 4
    for i in range(steps):
        x, y = batches[i]
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        if i == nan_loss_at:
            loss = loss * float("nan")
        fabric.backward(loss)
        faults.after_backward(net)
        ledger.before_steps(plugin.loss_scale)
        opt_a.step()
        opt_b.step()
        if i != nan_loss_at:
            ledger.after_steps(applied(plugin.engine.last_result))
        faults.i += 1
    return net, ledger, (opt_a, opt_b)


@pytest.mark.parametrize("kind", ["inf_grad_b", "amax_a"])
def test_fabric_two_optimizers_decide_once_per_iteration(kind):
    plugin = FabricFP8Precision(loss_scaling="dynamic", growth_interval=3)
    net, ledger, _ = fabric_run(plugin, kind, at={0, 4}, steps=9)  # the first iteration too: B is not known yet
    assert ledger.rows == [False] + [True] * 3 + [False] + [True] * 4
    # 256 -> 128 at iteration 0, 256 after iterations 1-3, 128 at iteration 4, 256 after 5-7
    assert plugin.engine.step_count == 9 and plugin.loss_scale == 256.0
    check_histories(net, 7)


def test_fabric_rollback_restores_every_optimizer_met_so_far():
    """Fabric never shows the plugin its optimizers: B is met after A has stepped, in the first iteration. The first
    snapshot must still hold B's state, so a rollback to it restores both (before the fix: only A)."""
    plugin = FabricFP8Precision()
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in mlp().state_dict().items()}
    net, _, (opt_a, opt_b) = fabric_run(plugin, steps=4, nan_loss_at=3)
    assert plugin.rollbacks == 1 and plugin.engine.events[-1]["restored_to_step"] == 0
    assert all(torch.equal(v, initial[k]) for k, v in net.state_dict().items())
    # SGD without momentum keeps no state; the hyperparameters and the LR are what a rollback must restore
    assert [g["lr"] for g in opt_a.param_groups + opt_b.param_groups] == [LR, LR]


# -- Accelerate -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["inf_grad_b", "amax_a"])
def test_accelerate_two_prepared_optimizers_decide_once_per_iteration(kind, fresh_accelerate_state):
    from lightning_fp8.accelerate import FP8Accelerator, FP8Kwargs

    torch.manual_seed(0)
    accelerator = FP8Accelerator(cpu=True, mixed_precision="fp8",
                                 kwargs_handlers=[FP8Kwargs(loss_scaling="dynamic", growth_interval=3)])
    net = mlp()
    faults, ledger = Faults(net, kind, {2}), Ledger(net)
    model, opt_a, opt_b = accelerator.prepare(net, *two_optimizers(net))
    skipped = []
    for i, (x, y) in enumerate(list(loader())[:8]):
        opt_a.zero_grad()
        opt_b.zero_grad()
        accelerator.backward(F.mse_loss(model(x).float(), y))
        faults.after_backward(net)
        ledger.before_steps(accelerator.loss_scale)
        opt_a.step()
        opt_b.step()
        ledger.after_steps(applied(accelerator.fp8_engine.last_result))
        skipped.append((opt_a.step_was_skipped, opt_b.step_was_skipped))
        faults.i += 1
    assert ledger.rows == [True] * 2 + [False] + [True] * 5
    assert skipped == [(False, False)] * 2 + [(True, True)] + [(False, False)] * 5
    assert accelerator.fp8_engine.step_count == 8 and accelerator.loss_scale == 128.0 * 2
    check_histories(net, 7)


# -- optimizers that step at different rates, two backwards, accumulation ---------------------------------------------
class StaggeredModule(TwoOptimizerModule):
    """Optimizer B steps every second iteration and accumulates its gradients over two backwards (zeroed only after
    it stepped), while the loss scale doubles after every clean iteration (growth_interval=1): B's gradient of the
    first backward was unscaled by that iteration's decision and must be brought to the new scale before the next
    backward adds to it. Each backward's contribution to every parameter is recorded by a hook, with its scale."""

    def __init__(self):
        super().__init__()
        self.contributions = {id(p): [] for p in self.net.parameters()}
        for p in self.net.parameters():
            p.register_hook(lambda g, p=p: self.contributions[id(p)].append(g / self.trainer.precision_plugin.loss_scale))
        self.rows = []

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        self.rows.append(self.trainer.precision_plugin.loss_scale)  # the scale of this iteration's backward
        b_steps = batch_idx % 2 == 1
        x, y = batch
        opt_a.zero_grad()
        before = [p.detach().clone() for p in self.net.parameters()]
        self.manual_backward(F.mse_loss(self.net(x).float(), y))
        opt_a.step()
        if b_steps:
            opt_b.step()
        b_params = {id(p) for i in B_LAYERS for p in self.net[i].parameters()}
        for p, w in zip(self.net.parameters(), before):
            updates = self.contributions[id(p)]
            if id(p) in b_params and not b_steps:
                assert torch.equal(p.detach(), w)  # accumulating
                continue
            expected = w.add(sum(updates[1:], updates[0]), alpha=-LR)
            assert torch.equal(p.detach(), expected), (batch_idx, id(p) in b_params)
            updates.clear()
        if b_steps:
            opt_b.zero_grad()


def test_lightning_optimizer_stepping_every_second_iteration_accumulates_exactly():
    plugin = FP8Precision(loss_scaling="dynamic", growth_interval=1)
    torch.manual_seed(0)
    model = StaggeredModule()
    trainer(plugins=[plugin], max_steps=9, max_epochs=-1).fit(model, loader())  # 6 iterations: 6 A steps, 3 B steps
    assert plugin.engine.step_count == 6 and plugin.skipped_steps == 0
    assert model.rows == [256.0 * 2**i for i in range(6)]  # the scale changed between every two backwards


class TwoBackwardsModule(TwoOptimizerModule):
    """The GAN pattern: backward of A's loss, step A, backward of B's loss, step B. Two backwards, each followed by
    its step: two updates, each its own decision. An inf in the second backward's gradients skips B only."""

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        plugin = self.trainer.precision_plugin
        for opt, scale_b, layers in ((opt_a, False, A_LAYERS), (opt_b, True, B_LAYERS)):
            opt_a.zero_grad()
            opt_b.zero_grad()
            out = self.net(x).float()
            self.manual_backward(F.mse_loss(out * 2 if scale_b else out, y))
            if scale_b:
                self.faults.after_backward(self.net)
            self.ledger.before_steps(plugin.loss_scale, layers)
            opt.step()
            self.ledger.after_steps(applied(plugin.engine.last_result))
        self.faults.i += 1


def test_lightning_two_backwards_are_two_decisions():
    plugin = FP8Precision()
    torch.manual_seed(0)
    model = TwoBackwardsModule("inf_grad_b", at={2})
    trainer(plugins=[plugin], max_steps=8, max_epochs=-1).fit(model, loader())
    assert model.ledger.rows == [True] * 5 + [False] + [True] * 2  # A, B per training step; B skipped in the third
    assert plugin.engine.step_count == 8 and plugin.skipped_steps == 1


class AccumulatingModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, self.losses = mlp(), []

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]).float(), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_lightning_gradient_accumulation_with_a_changing_loss_scale_is_exact():
    """accumulate_grad_batches=2 with the loss scale doubling after every iteration: power-of-two scales commute
    with every rounding on the way (FP8 casts included: delayed gradient scales follow the loss scale), so the run
    is bit-identical to one without loss scaling."""
    losses, counts = [], []
    for kwargs in (dict(loss_scaling="none"), dict(loss_scaling="dynamic", growth_interval=1)):
        torch.manual_seed(0)
        model, plugin = AccumulatingModule(), FP8Precision(**kwargs)
        trainer(plugins=[plugin], max_steps=6, max_epochs=-1, accumulate_grad_batches=2).fit(model, loader())
        losses.append(model.losses)
        counts.append((plugin.engine.step_count, plugin.loss_scale))
    assert losses[0] == losses[1] and len(losses[0]) == 12
    assert counts == [(6, 1.0), (6, 256.0 * 2**6)]
