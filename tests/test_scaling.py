"""Scale rules (numerics/scaling.py) through the state a layer keeps: delayed (history, max / most_recent, margin),
current, amax 0 / inf / NaN, rejected steps, unscaled saturation, recipe overrides, the old state layout."""
import math

import pytest
import torch

from lightning_fp8 import FP8Recipe
from lightning_fp8.modules.cast import PerTensorCaster
from lightning_fp8.modules.layer_state import FP8LayerState
from lightning_fp8.numerics import E4M3, E5M2, scale_from_amax


def test_scale_from_amax_rules():
    prev = torch.tensor(3.0)
    assert scale_from_amax(torch.tensor(2.0), 448.0, 0, prev).item() == 224.0
    assert scale_from_amax(torch.tensor(2.0), 448.0, 2, prev).item() == 56.0
    for bad in (0.0, math.inf, math.nan):
        assert scale_from_amax(torch.tensor(bad), 448.0, 0, prev).item() == 3.0
    assert scale_from_amax(torch.tensor(3.0), 448.0, 0, prev, power_of_2=True).item() == 128.0  # 149.3 -> 2^7
    assert math.isfinite(scale_from_amax(torch.tensor(1e-45), 448.0, 0, prev).item())
    # just below a power of two: log2 would round up to 2^8 and the amax itself would then clip (448/1.75000006)
    near = scale_from_amax(torch.tensor(1.7500001), 448.0, 0, prev, power_of_2=True)
    assert near.item() == 128.0 and 1.7500001 * near.item() <= 448.0


class Role:
    """One role of a fresh layer's FP8 metadata, driven the way training drives it: casts record into the open
    slot, then the step is closed (taken or rejected)."""

    def __init__(self, recipe=None, role="input"):
        self.recipe = recipe or FP8Recipe()
        self.meta = FP8LayerState(self.recipe)
        self.role = role
        self.state = self.meta.role(role)

    def cast(self, x, record=True, recipe=None):
        operand = PerTensorCaster(recipe or self.recipe).cast(x.reshape(1, -1) if x.dim() < 2 else x,
                                                              self.meta.amax_history, self.role, record)
        q, scale = operand.matrix.data, operand.scale
        return q, scale

    def record(self, amax):
        self.state.observe_amax(torch.tensor(float(amax)))

    def close(self, taken=True):
        meta = self.meta
        torch.ops.lightning_fp8.close_scaling_step(
            meta.amax_history, meta.overflow_count, meta.clip_count, *meta.constants(), taken
        )

    def step(self, amax, taken=True):
        self.record(amax)
        self.close(taken)


def test_delayed_scale_is_max_over_history_and_history_rolls():
    role = Role(FP8Recipe(amax_history_len=3, power_of_2_scales=False))
    for amax in (1.0, 8.0, 2.0):
        role.step(amax)
    assert role.state.amax_history.tolist() == [0.0, 2.0, 8.0, 1.0]
    assert role.state.scale.item() == 448.0 / 8.0
    role.step(0.5)  # the window (3 completed steps) still holds 8.0 ...
    assert role.state.scale.item() == 448.0 / 8.0
    role.step(0.5)  # ... and then rolls it out
    assert role.state.amax_history.tolist() == [0.0, 0.5, 0.5, 2.0]
    assert role.state.scale.item() == 448.0 / 2.0


def test_delayed_most_recent_and_margin():
    role = Role(FP8Recipe(amax_history_len=4, amax_compute_algo="most_recent", margin=1, power_of_2_scales=False))
    role.step(8.0)
    role.step(2.0)
    assert role.state.scale.item() == 448.0 / 2.0 / 2


def test_amax_accumulates_within_a_step():
    role = Role(FP8Recipe(amax_history_len=2))
    for amax in (1.0, 5.0, 3.0):  # e.g. gradient accumulation: three micro-batches, one step
        role.record(amax)
    assert role.state.amax_history[0].item() == 5.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_amax_is_an_overflow_event_and_keeps_scale(bad):
    role = Role(FP8Recipe(amax_history_len=3))
    role.step(4.0)
    scale_before = role.state.scale.item()
    role.record(1.0)
    role.record(bad)  # one of the step's casts overflowed
    role.close()
    assert role.meta.overflow_count[0].item() == 1
    assert role.state.scale.item() == scale_before
    assert torch.isfinite(role.state.amax_history).all()


def test_zero_amax_keeps_previous_scale():
    role = Role(FP8Recipe(amax_history_len=1, power_of_2_scales=False))
    role.step(4.0)
    role.step(0.0)  # all zeros, or the layer did not run: the history is not advanced
    assert role.state.scale.item() == 448.0 / 4.0


def test_a_rejected_step_leaves_no_trace_in_the_scales():
    """A skipped step's amaxes (e.g. a corrupted batch x1e4 that also gave an inf gradient elsewhere) must not enter
    the history: the scale stays what the clean steps gave."""
    role = Role(FP8Recipe(amax_history_len=16))
    for _ in range(3):
        role.step(2.0)
    before_history, before_scale = role.state.amax_history.clone(), role.state.scale.clone()
    role.step(2.0e4, taken=False)
    assert torch.equal(role.state.amax_history, before_history) and torch.equal(role.state.scale, before_scale)
    role.step(2.0)
    assert role.state.scale.item() == before_scale.item()


def f32_div(a, b):
    return (torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32)).item()


def test_first_delayed_cast_uses_current_scaling_then_history():
    role = Role(FP8Recipe(scaling="delayed", power_of_2_scales=False))
    x = torch.full((4, 4), 100.0)
    _, scale = role.cast(x)
    assert scale.item() == f32_div(448.0, 100.0)  # not 1.0: a role without history must not clip
    role.close()
    _, scale = role.cast(x * 2)
    assert scale.item() == f32_div(448.0, 100.0)  # delayed: last step's amax, not this tensor's
    role.close()
    assert role.state.clip_count.item() == 1  # and the growth was clipped, which is counted


def test_current_scaling_uses_this_tensors_amax():
    role = Role(FP8Recipe(scaling="current", power_of_2_scales=False), role="grad_output")
    for amax in (10.0, 1000.0):
        _, scale = role.cast(torch.full((3,), amax))
        assert scale.item() == pytest.approx(E5M2.max / amax, rel=1e-7)
        role.close()
    assert role.state.scale.item() == scale.item()  # the state shows the scale the last step used


def test_eval_casts_leave_state_untouched():
    role = Role()
    role.step(3.0)
    before = {k: v.clone() for k, v in role.meta.state_dict().items()}
    role.cast(torch.randn(8, 8), record=False)
    assert all(torch.equal(before[k], v) for k, v in role.meta.state_dict().items())


def test_unscaled_gradients_use_scale_one():
    role = Role(FP8Recipe(format="e5m2", scale_gradients=False), role="grad_output")
    _, scale = role.cast(torch.randn(8) * 1e-3)
    assert scale.item() == 1.0


def test_unscaled_gradient_saturation_is_an_overflow():
    """A gradient cast without a per-tensor scale saturates silently above the format's range (57344 for E5M2):
    that is what the loss scaler must hear about, so it counts as an overflow, not a clip."""
    role = Role(FP8Recipe(format="e5m2", scale_gradients=False), role="grad_output")
    role.cast(torch.tensor([1.0e5, 3.0]))  # finite, beyond 57344
    role.close()
    assert role.meta.overflow_count[2].item() == 1 and role.meta.clip_count[2].item() == 0
    role.cast(torch.tensor([5.0e4, 3.0]))  # within range: nothing
    role.close()
    assert role.meta.overflow_count[2].item() == 1


def test_recipe_override_derives_the_scale_under_the_casts_own_format():
    """An E5M2 layer cast under fp8_autocast(recipe=E4M3) must size its scales for 448, not 57344."""
    e5 = FP8Recipe(format="e5m2", power_of_2_scales=False)
    role = Role(e5)
    role.step(10.0)
    assert role.state.scale.item() == f32_div(57344.0, 10.0)
    q, scale = role.cast(torch.full((4,), 10.0), recipe=FP8Recipe(format="e4m3", power_of_2_scales=False))
    assert scale.item() == f32_div(448.0, 10.0) and q.dtype == torch.float8_e4m3fn
    assert torch.isfinite(q.float()).all() and q.float().max().item() == 448.0


def test_power_of_two_scales_are_powers_of_two_and_never_clip_the_amax():
    role = Role(FP8Recipe(power_of_2_scales=True))
    for amax in (3.0, 1.7500001, 448.0, 1e-30):
        role.step(amax)
        scale = role.state.scale.item()
        assert math.frexp(scale)[0] == 0.5 and amax * scale <= 448.0


def test_old_per_role_state_dicts_load_into_the_new_layout():
    """FP8 metadata saved with one module per role (history of L slots, slot 0 open) loads as [3, L+1]."""
    old = {}
    for i, role in enumerate(("input", "weight", "grad_output")):
        old[f"{role}.amax_history"] = torch.tensor([0.0, 4.0 + i, 2.0, 0.0])
        old[f"{role}.scale"] = torch.tensor(448.0 / (4.0 + i))
        old[f"{role}.overflow_count"] = torch.tensor(i)
        old[f"{role}.clip_count"] = torch.tensor(2 * i)
        old[f"{role}.initialized"] = torch.tensor(True)
    meta = FP8LayerState(FP8Recipe(amax_history_len=4))
    meta.load_state_dict(old)
    assert meta.amax_history[:, :4].tolist() == [[0, 4, 2, 0], [0, 5, 2, 0], [0, 6, 2, 0]]
    assert meta.overflow_count.tolist() == [0, 1, 2] and meta.clip_count.tolist() == [0, 2, 4]
    assert meta.input.scale.item() == 448.0 / 4.0 or FP8Recipe().power_of_2_scales


@pytest.mark.parametrize(
    "kwargs, valid",
    [
        ({"format": "fp8"}, "hybrid"),
        ({"scaling": "dynamic"}, "delayed"),
        ({"amax_compute_algo": "mean"}, "most_recent"),
        ({"rounding": "down"}, "stochastic"),
        ({"backend": "cuda"}, "scaled_mm"),
    ],
)
def test_invalid_recipe_values_name_valid_choices(kwargs, valid):
    with pytest.raises(ValueError, match=valid):
        FP8Recipe(**kwargs)


def test_recipe_is_frozen_and_round_trips_through_dict():
    recipe = FP8Recipe(format="e4m3", skip_patterns=["*attn*"])
    with pytest.raises(Exception):
        recipe.margin = 3
    assert FP8Recipe.from_dict(recipe.to_dict()) == recipe
    assert recipe.format_for("grad_output") is E4M3
    assert FP8Recipe().format_for("grad_output") is E5M2
