"""Scale update rules: delayed (history, max / most_recent, margin), current, amax 0 / inf / NaN."""
import math

import pytest
import torch

from lightning_fp8 import FP8Recipe
from lightning_fp8.modules.cast import scaled_cast
from lightning_fp8.numerics import E4M3, E5M2, ScalingState, scale_from_amax


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


def _step(state, amax, fmt=E4M3, algo="max", margin=0):
    state.record(torch.tensor(amax), state.scale.clone(), fmt, "delayed")
    state.update(fmt, "delayed", algo, margin, power_of_2=False)


def test_delayed_scale_is_max_over_history_and_history_rolls():
    state = ScalingState(history_len=4)
    for amax in (1.0, 8.0, 2.0):
        _step(state, amax)
    assert state.amax_history.tolist() == [0.0, 2.0, 8.0, 1.0]
    assert state.scale.item() == 448.0 / 8.0
    _step(state, 0.5)
    _step(state, 0.5)  # the update of this step still sees 8.0 (4 slots: this step and the 3 before)
    assert state.scale.item() == 448.0 / 8.0
    assert state.amax_history.tolist() == [0.0, 0.5, 0.5, 2.0]  # ... and then rolls it out
    _step(state, 0.5)
    assert state.scale.item() == 448.0 / 2.0


def test_delayed_most_recent_and_margin():
    state = ScalingState(history_len=4)
    _step(state, 8.0, algo="most_recent", margin=1)
    _step(state, 2.0, algo="most_recent", margin=1)
    assert state.scale.item() == 448.0 / 2.0 / 2


def test_amax_accumulates_within_a_step():
    state = ScalingState(history_len=2)
    for amax in (1.0, 5.0, 3.0):  # e.g. gradient accumulation: three micro-batches, one step
        state.record(torch.tensor(amax), state.scale, E4M3, "delayed")
    assert state.amax_history[0].item() == 5.0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_amax_is_an_overflow_event_and_keeps_scale(bad):
    state = ScalingState(history_len=3)
    _step(state, 4.0)
    scale_before = state.scale.item()
    _step(state, bad)
    assert state.overflow_count.item() == 1
    assert state.scale.item() == scale_before
    assert torch.isfinite(state.amax_history).all()


def test_zero_amax_keeps_previous_scale():
    state = ScalingState(history_len=1)
    _step(state, 4.0)
    _step(state, 0.0)
    assert state.scale.item() == 448.0 / 4.0


def f32_div(a, b):
    return (torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32)).item()


def test_first_delayed_cast_uses_current_scaling_then_history():
    recipe = FP8Recipe(scaling="delayed")
    state = ScalingState(recipe.amax_history_len)
    x = torch.full((4, 4), 100.0)
    _, scale = scaled_cast(x, state, recipe, "input", record=True)
    assert scale.item() == f32_div(448.0, 100.0)  # not 1.0: an uninitialised state must not clip
    state.update(E4M3, "delayed", "max", 0, False)
    _, scale = scaled_cast(x * 2, state, recipe, "input", record=True)
    assert scale.item() == f32_div(448.0, 100.0)  # delayed: last step's amax, not this tensor's
    assert state.clip_count.item() == 1  # and the growth was clipped, which is counted


def test_current_scaling_uses_this_tensors_amax():
    recipe = FP8Recipe(scaling="current")
    state = ScalingState(recipe.amax_history_len)
    for amax in (10.0, 1000.0):
        _, scale = scaled_cast(torch.full((3,), amax), state, recipe, "grad_output", record=True)
        assert scale.item() == pytest.approx(E5M2.max / amax, rel=1e-7)
    assert state.scale.item() == scale.item()


def test_eval_casts_leave_state_untouched():
    recipe = FP8Recipe()
    state = ScalingState(recipe.amax_history_len)
    before = {k: v.clone() for k, v in state.state_dict().items()}
    scaled_cast(torch.randn(8, 8), state, recipe, "input", record=False)
    assert all(torch.equal(before[k], v) for k, v in state.state_dict().items())


def test_unscaled_gradients_use_scale_one():
    recipe = FP8Recipe(format="e5m2", scale_gradients=False)
    state = ScalingState(recipe.amax_history_len)
    _, scale = scaled_cast(torch.randn(8) * 1e-3, state, recipe, "grad_output", record=True)
    assert scale.item() == 1.0


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
