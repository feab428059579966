"""Engine pieces without a framework: loss scaler rules, clipping, snapshots, skip semantics."""
import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Recipe, convert_to_fp8
from lightning_fp8.engine import FP8TrainingEngine, LossScaler, StabilityConfig, resolve_loss_scaling
from lightning_fp8.engine.clipping import clip_grad_norm_, grad_norm_fp32


def test_resolve_auto_loss_scaling():
    assert resolve_loss_scaling("auto", gradients_scaled=True, compute_dtype=torch.bfloat16) == "none"
    assert resolve_loss_scaling("auto", gradients_scaled=False, compute_dtype=torch.bfloat16) == "dynamic"
    assert resolve_loss_scaling("auto", gradients_scaled=True, compute_dtype=torch.float16) == "dynamic"
    assert resolve_loss_scaling(1024, True, torch.bfloat16) == 1024.0
    with pytest.raises(ValueError, match="valid choices"):
        resolve_loss_scaling("always", True, torch.bfloat16)


def test_dynamic_scaler_backoff_and_growth():
    scaler = LossScaler("dynamic", init_scale=256.0, growth_interval=2)
    scaler.update(overflow=True)
    assert scaler.scale == 128.0
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 256.0
    static = LossScaler(64.0)
    static.update(overflow=True)
    assert static.scale == 64.0


def test_unscale_and_check_finds_inf_and_divides():
    scaler = LossScaler("dynamic", init_scale=4.0)
    grads = [torch.full((3,), 8.0), torch.tensor([1.0, float("inf")])]
    assert scaler.unscale_and_check(grads).item() == 1.0
    assert grads[0].tolist() == [2.0, 2.0, 2.0]
    assert scaler.unscale_and_check([torch.ones(2)]).item() == 0.0


def test_clip_norm_in_fp32_for_bf16_grads():
    grads = [torch.full((4096,), 1.0, dtype=torch.bfloat16)]
    # bf16 accumulation of 4096 squares would be inexact; the fp32 norm is exactly 64
    assert grad_norm_fp32(grads).item() == 64.0
    clip_grad_norm_(grads, 1.0)
    assert grads[0].float().norm().item() == pytest.approx(1.0, rel=1e-2)  # bf16 storage rounds the result
    bad = [torch.tensor([float("nan"), 1.0])]
    norm = clip_grad_norm_(bad, 1.0)
    assert not torch.isfinite(norm) and bad[0][1].item() == 1.0  # left alone; the engine skips the step


def _engine_and_model(**config):
    torch.manual_seed(0)
    model = convert_to_fp8(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)))
    engine = FP8TrainingEngine(FP8Recipe(), StabilityConfig(**config))
    engine.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return engine, model, opt


def _step(engine, model, opt, poison=False):
    opt.zero_grad()
    loss = model(torch.randn(8, 16)).pow(2).mean()
    engine.scale_loss(loss).backward()
    if poison:
        model[1].weight.grad[0, 0] = float("nan")
    return engine.step(opt, opt.step)


def test_skipped_step_leaves_params_and_optimizer_state_untouched():
    engine, model, opt = _engine_and_model()
    _step(engine, model, opt)
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model[1].weight].items()}
    result = _step(engine, model, opt, poison=True)
    assert not result.stepped and result.skipped_reason == "non-finite gradients"
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(state[k], v) for k, v in opt.state[model[1].weight].items())
    assert engine.skipped_steps == 1


def test_consecutive_skips_roll_back_and_restore_snapshot():
    engine, model, opt = _engine_and_model(max_consecutive_skips=2, snapshot_every=2)
    for _ in range(2):
        _step(engine, model, opt)
    snap = [p.detach().clone() for p in model.parameters()]
    _step(engine, model, opt)  # a good step after the snapshot: lost on rollback
    _step(engine, model, opt, poison=True)
    result = _step(engine, model, opt, poison=True)
    assert result.rolled_back and "consecutive" in result.rollback_reason
    assert all(torch.equal(a, b) for a, b in zip(snap, model.parameters()))
    assert engine.rollbacks == 1 and engine.events[-1]["restored_to_step"] == 2


def test_engine_state_dict_round_trip():
    engine, model, opt = _engine_and_model(loss_scaling="dynamic")
    _step(engine, model, opt, poison=True)
    other = FP8TrainingEngine(FP8Recipe(), StabilityConfig(loss_scaling="dynamic"))
    other.load_state_dict(engine.state_dict())
    assert other.state_dict() == engine.state_dict()
    assert other.loss_scale == 128.0


def test_rollback_restores_the_precision_switch():
    engine, model, opt = _engine_and_model(max_consecutive_skips=1)
    _step(engine, model, opt)  # snapshot of the first step: layer 1 in FP8
    model[1].fp8_enabled = False  # e.g. a fallback decided after the snapshot
    result = _step(engine, model, opt, poison=True)
    assert result.rolled_back
    assert model[1].fp8_enabled is True and bool(model[1].fp8_meta.enabled)  # flag and buffer agree


def _nan_writing_step(opt, model):
    """An optimizer step that writes a NaN into a weight (as an overflowing update would): gradients and loss
    were finite, so only the weights check can see it."""

    def step():
        opt.step()
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")

    return step


def _poisoning_iteration(engine, model, opt):
    opt.zero_grad()
    engine.scale_loss(model(torch.randn(8, 16)).pow(2).mean()).backward()
    return engine.step(opt, _nan_writing_step(opt, model))


def test_weights_a_step_made_non_finite_roll_back_at_the_next_decision_before_any_other_step():
    """The weights the step wrote are checked on the device at the close and read with the next decision's flags
    (the iteration's one read): that decision rolls back, so no optimizer ever steps from the non-finite weights."""
    from lightning_fp8.engine.host_reads import count_host_reads

    engine, model, opt = _engine_and_model(snapshot_every=4)
    for _ in range(4):  # the snapshot of iteration 4
        _step(engine, model, opt)
    snap = [p.detach().clone() for p in model.parameters()]
    _step(engine, model, opt)
    with count_host_reads() as reads:
        poisoned = _poisoning_iteration(engine, model, opt)  # iteration 6: applied, its weights not read yet
    assert poisoned.applied and reads == ["iteration flags"]
    assert not torch.isfinite(model[2].weight).all()
    stepped = []
    opt.zero_grad()
    engine.scale_loss(model(torch.randn(8, 16)).pow(2).mean()).backward()
    with count_host_reads() as reads:
        result = engine.step(opt, lambda: stepped.append(1))
    assert reads == ["iteration flags"]
    assert stepped == [] and not result.stepped and result.skipped_reason == "non-finite weights"
    assert result.rolled_back and "non-finite weights" in result.rollback_reason
    assert engine.events[-1]["restored_to_step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(snap, model.parameters()))


def test_a_snapshot_never_holds_weights_a_step_made_non_finite():
    """At a snapshot's close the weights are read before the snapshot replaces the last good state (that close's
    one extra read, every snapshot_every iterations)."""
    from lightning_fp8.engine.host_reads import count_host_reads

    engine, model, opt = _engine_and_model(snapshot_every=3)
    for _ in range(3):  # the snapshot of iteration 3
        _step(engine, model, opt)
    snap = [p.detach().clone() for p in model.parameters()]
    _step(engine, model, opt)
    _step(engine, model, opt)
    with count_host_reads() as reads:
        result = _poisoning_iteration(engine, model, opt)  # iteration 6: its close is a snapshot's
    assert reads == ["iteration flags", "weights finite"]
    assert result.rolled_back and result.rollback_reason == "non-finite weights"
    assert engine.snapshot_step == 3 and engine.events[-1]["restored_to_step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(snap, model.parameters()))


def test_settle_rolls_back_weights_the_last_step_made_non_finite_before_a_checkpoint():
    engine, model, opt = _engine_and_model(snapshot_every=4)
    for _ in range(4):
        _step(engine, model, opt)
    snap = [p.detach().clone() for p in model.parameters()]
    result = _poisoning_iteration(engine, model, opt)  # the run's last step
    engine.settle()  # what the adapters call before a checkpoint
    assert result.rolled_back and engine.rollbacks == 1
    assert all(torch.equal(a, b) for a, b in zip(snap, model.parameters()))
    engine.settle()  # nothing left to check: no second rollback
    assert engine.rollbacks == 1


def test_check_weights_every_spaces_the_weight_checks():
    engine, model, opt = _engine_and_model(snapshot_every=100, check_weights_every=3)
    for _ in range(4):
        _step(engine, model, opt)
    _poisoning_iteration(engine, model, opt)  # iteration 5: no check due at its close
    result = _step(engine, model, opt)  # NaN weights -> NaN loss: caught as such
    assert result.skipped_reason == "non-finite loss" and result.rolled_back


def test_the_decision_tells_the_layers_which_histories_size_a_delayed_scale():
    """The decision's one read carries, per layer role, whether its history sizes a delayed scale; the layers' delayed
    casts then skip their amax pre-pass (tests/test_launch_budget.py counts that launch). The knowledge is dropped
    wherever the histories are replaced: a rollback, a load of FP8 state."""
    from lightning_fp8 import fp8_state_dict, load_fp8_state_dict

    engine, model, opt = _engine_and_model(max_consecutive_skips=1)
    metas = [layer.fp8_meta for layer in engine.layers.values()]
    assert metas
    assert all(meta.history_sized == [False] * 3 for meta in metas)
    _step(engine, model, opt)  # the first decision: nothing completed yet
    assert all(meta.history_sized == [False] * 3 for meta in metas)
    _step(engine, model, opt)  # the first step's amaxes are in the histories now
    assert all(meta.history_sized == [True] * 3 for meta in metas)
    state = fp8_state_dict(model)
    result = _step(engine, model, opt, poison=True)  # one skip is the limit here: rolled back
    assert result.rolled_back
    assert all(meta.history_sized == [False] * 3 for meta in metas)
    _step(engine, model, opt)  # the restored histories are those of the first snapshot, before any step
    assert all(meta.history_sized == [False] * 3 for meta in metas)
    _step(engine, model, opt)
    assert all(meta.history_sized == [True] * 3 for meta in metas)
    load_fp8_state_dict(model, state)
    assert all(meta.history_sized == [False] * 3 for meta in metas)



def test_attach_keeps_the_weight_transpose_only_for_unsharded_models(monkeypatch):
    import lightning_fp8.engine.engine as engine_module

    engine, model, _ = _engine_and_model()
    assert all(layer.keep_weight_transpose for layer in engine.layers.values())
    monkeypatch.setattr(engine_module, "is_fsdp_sharded", lambda m: True)
    engine.attach(model)
    assert not any(layer.keep_weight_transpose for layer in engine.layers.values())
