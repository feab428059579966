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
from accelerate.state import AcceleratorState, GradientState

from helpers import loader, mlp, trainer
from lightning_fp8 import FP8Precision
from lightning_fp8.fabric import FP8Precision as FabricFP8Precision

LR = 0.05
A_LAYERS, B_LAYERS = (0, 2), (4, 6)  # mlp(): linears at 0, 2, 4, 6; 2 and 4 are FP8 (first / last stay BF16)


def two_optimizers(net):
    params = lambda idx: [p for i in idx for p in net[i].parameters()]
    return torch.optim.SGD(params(A_LAYERS), lr=LR), torch.optim.SGD(params(B_LAYERS), lr=LR)


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
    """Per iteration: (weights before, gradients after backward, loss scale); checked after the steps."""

    def __init__(self, net):
        self.net, self.rows = net, []

    def before_steps(self, loss_scale):
        self.pending = [(p.detach().clone(), p.grad.detach().clone(), loss_scale) for p in self.net.parameters()]

    def after_steps(self, applied):
        self.rows.append(applied)
        for p, (before, grad, scale) in zip(self.net.parameters(), self.pending):
            expected = before.add(grad / scale, alpha=-LR) if applied else before
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
    def __init__(self, kind=None, at=()):
        super().__init__()
        self.automatic_optimization = False
        self.net = mlp()
        self.faults = Faults(self.net, kind, at)
        self.ledger = Ledger(self.net)

    def configure_optimizers(self):
        return list(two_optimizers(self.net))

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(F.mse_loss(self.net(x).float(), y))
        self.faults.after_backward(self.net)
        plugin = self.trainer.precision_plugin
        self.ledger.before_steps(plugin.loss_scale)
        opt_a.step()
        opt_b.step()
        self.ledger.after_steps(applied(plugin.engine.last_result))
        self.faults.i += 1


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
    """snapshot_every (default 50) counts iterations; a rollback restores both optimizers (and the weights)."""
    plugin = FP8Precision()
    torch.manual_seed(0)
    model = TwoOptimizerModule()
    trainer(plugins=[plugin], max_steps=2 * 60, max_epochs=-1).fit(model, loader())
    assert plugin.engine.step_count == 60 and plugin.engine.snapshot_step == 50


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
@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


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
