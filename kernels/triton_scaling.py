"""Triton kernel that closes one layer's scaling step: `numerics.scaling.close_step` on a [3, L+1] history.

One program per tensor role: the open slot's amax -> overflow (non-finite, or an unscaled role beyond the format's
range) and clip (a delayed-scaling amax beyond the range of the scale its casts used) counters, then a taken step
with a non-zero finite amax shifts into slot 1. One launch per layer per step; the plugins' engine closes every layer
at once with torch ops instead (lightning_fp8/engine/step_closer.py). Twin: `kernels.kernel_reference.close_step_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_fp8.kernels.device_launch import announce, device_guard
from lightning_fp8.kernels.triton_cast import _next_pow2, _scale_from_amax_rt


@triton.jit
def _close_step_kernel(
    hist_ptr, overflow_ptr, clip_ptr, fp8_max_ptr, scaled_ptr, delayed_ptr, algo_max_ptr, margin_ptr, pow2_ptr,
    HIST_LEN: tl.constexpr, HIST_BLOCK: tl.constexpr, TAKEN: tl.constexpr,
):
    role = tl.program_id(0)
    offs = tl.arange(0, HIST_BLOCK)
    row = hist_ptr + role * HIST_LEN
    h = tl.load(row + offs, mask=offs < HIST_LEN, other=0.0)
    amax = tl.sum(tl.where(offs == 0, h, 0.0), axis=0)
    fp8_max = tl.load(fp8_max_ptr + role)
    scaled = tl.load(scaled_ptr + role) != 0
    delayed = tl.load(delayed_ptr + role) != 0
    algo_max = tl.load(algo_max_ptr + role) != 0
    margin_div = tl.exp2(tl.load(margin_ptr + role))
    pow2 = tl.load(pow2_ptr + role) != 0
    finite = (amax == amax) & (tl.abs(amax) < float("inf"))
    overflow = tl.where(finite, tl.where(scaled, amax != amax, amax > fp8_max), amax == amax)  # bools
    overflow = tl.where(finite, overflow, 1 == 1)
    past_max = tl.max(tl.where((offs >= 1) & (offs < HIST_LEN), h, 0.0), axis=0)
    last = tl.sum(tl.where(offs == 1, h, 0.0), axis=0)
    ref = tl.where(algo_max, past_max, last)
    used = _scale_from_amax_rt(ref, 1.0, fp8_max, margin_div, pow2)
    clip = tl.where(finite & scaled & delayed, (ref > 0) & (amax * used > fp8_max), ref < 0)  # ref >= 0: False
    tl.store(overflow_ptr + role, tl.load(overflow_ptr + role) + overflow.to(tl.int64))
    tl.store(clip_ptr + role, tl.load(clip_ptr + role) + clip.to(tl.int64))
    clean = tl.where(finite, amax, 0.0)
    advance = (clean > 0) if TAKEN else (clean < 0)
    prev = tl.load(row + offs - 1, mask=(offs >= 1) & (offs < HIST_LEN), other=0.0)  # slot i-1 -> slot i
    shifted = tl.where(offs == 1, clean, prev)
    new = tl.where(offs >= 1, tl.where(advance, shifted, h), 0.0)
    tl.debug_barrier()  # every lane has read the row before any lane writes it
    tl.store(row + offs, new, mask=offs < HIST_LEN)


def _bytes(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor as the uint8 bytes it is (a view: no conversion kernel per flag, per layer, per step)."""
    return flags.view(torch.uint8) if flags.dtype == torch.bool else flags.to(torch.uint8)


def launch_close_step(history, overflow_count, clip_count, fp8_max, scaled, delayed, algo_max, margin, power_of_2, taken):
    """Close one layer's step in place: history [3, L+1] float32 (contiguous), counters [3] int64, constants [3]."""
    assert history.dim() == 2 and history.is_contiguous()
    n_roles, length = history.shape
    with device_guard(history):
        if not announce("close_step", [history], [history, overflow_count, clip_count]):
            return
        _close_step_kernel[(n_roles,)](
            history, overflow_count, clip_count, fp8_max, _bytes(scaled), _bytes(delayed), _bytes(algo_max),
            margin.to(torch.float32), _bytes(power_of_2),
            HIST_LEN=length, HIST_BLOCK=_next_pow2(max(length, 2)), TAKEN=bool(taken), num_warps=1,
        )
