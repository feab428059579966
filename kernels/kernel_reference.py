"""The torch twins of the kernels in `triton_cast.py`: what each kernel variant must reproduce.

They are thin compositions of `lightning_fp8.numerics` (the single definition of quantize / amax / scale rules); the
CPU path of the library runs them, the CUDA path runs the Triton kernels, and the tests compare the two.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from lightning_fp8.kernels.device import profile_of
from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize, tensor_amax
from lightning_fp8.numerics.scaling import StepConstants, advance_history, cast_scale, reference_amax, scale_from_amax, step_flags
from lightning_fp8.numerics.groups import quantize_groups
from lightning_fp8.numerics.tiles import quantize_tiles


def cast_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    *,
    write_row: bool = True,
    write_t: bool = False,
    compute_amax: bool = True,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    stochastic: bool = False,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(x_fp8 row-major, x_fp8^T row-major, amax) of a 2-D `x`; entries not asked for are None."""
    amax = fast_amax(x) if compute_amax else None
    out = out_t = None
    if write_row or write_t:
        rounding = "stochastic" if (stochastic or noise is not None) else "nearest"
        q = quantize(x, scale, fmt, rounding=rounding, noise=noise, generator=generator)
        out = q.contiguous() if write_row else None
        out_t = q.t().contiguous() if write_t else None
    return out, out_t, amax


def amax_reference(x: torch.Tensor, skip_if: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max|x| in float32; 0 where the device flag `skip_if` is set (delayed scaling's pre-pass)."""
    amax = fast_amax(x)
    if skip_if is None:
        return amax
    return torch.where(skip_if, torch.zeros_like(amax), amax)


def fast_amax(x: torch.Tensor) -> torch.Tensor:
    """`tensor_amax` in one pass over x: max(-min, max) is max|x| exactly, and NaN propagates through both."""
    if x.numel() == 0 or not x.is_floating_point():
        return tensor_amax(x)
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(lo.neg(), hi).to(torch.float32)


def scaled_cast_reference(
    x: torch.Tensor,
    history: torch.Tensor,
    role: int,
    fmt: FP8Format,
    scaling: str,
    algo_max: bool,
    margin: int,
    power_of_2: bool,
    *,
    noise: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    stochastic: bool = False,
    record: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One state-driven cast: the scale from the role's amax history (numerics.scaling.cast_scale) under this cast's
    recipe, the saturating cast, and (record) this tensor's amax accumulated into the step in progress (slot 0,
    NaN / inf kept raw: closing the step counts them). Returns (x_fp8, scale). `history` is [roles, L+1]."""
    row = history[role]
    rounding = "stochastic" if (stochastic or noise is not None) else "nearest"
    if not profile_of(x.device).host_checks_allowed:
        # a GPU runs this without triton (or with LIGHTNING_FP8_DISABLE_TRITON=1, or for float64 input): decide
        # nothing on the host, which would synchronise with the device twice per cast. The amax is always taken
        # (one reduction) and the scale follows cast_scale's rules on the device; quantize clamps.
        amax = fast_amax(x)
        scale = cast_scale(row, amax, fmt.max, scaling, algo_max, margin, power_of_2)
        q = quantize(x, scale, fmt, rounding=rounding, noise=noise, generator=generator)
    else:
        # on a CPU the checks below read values already on the host: no device to synchronise with
        ref = reference_amax(row, algo_max) if scaling == "delayed" else None
        sized_by_history = ref is not None and bool(ref > 0)
        needs_amax = record or scaling == "current" or (scaling == "delayed" and not sized_by_history)
        amax = fast_amax(x) if needs_amax else torch.zeros((), dtype=torch.float32, device=x.device)
        if sized_by_history:
            # cast_scale's answer when the history sizes the scale (its fallbacks unused), in one call
            scale = scale_from_amax(ref, fmt.max, margin, 1.0, power_of_2)
        else:
            scale = cast_scale(row, amax, fmt.max, scaling, algo_max, margin, power_of_2)
        if rounding == "nearest" and needs_amax and bool(amax * scale <= fmt.max):
            # nothing can saturate: quantize without its clamp, the same bytes
            q = (x.to(torch.float32) * scale).to(fmt.dtype)
        else:
            q = quantize(x, scale, fmt, rounding=rounding, noise=noise, generator=generator)
    if record:
        slot = history[role, 0]
        slot.copy_(torch.maximum(slot, amax))  # torch.maximum propagates NaN
    return q, scale


def close_step_reference(
    history: torch.Tensor,
    overflow_count: torch.Tensor,
    clip_count: torch.Tensor,
    constants: Tuple[torch.Tensor, ...],
    taken: bool,
) -> None:
    """Close the step in progress of one layer's roles in place (numerics.scaling.close_step)."""
    clean, overflow, clip = step_flags(history, StepConstants(*constants))
    overflow_count.add_(overflow.to(overflow_count.dtype))
    clip_count.add_(clip.to(clip_count.dtype))
    history.copy_(advance_history(history, clean, taken))


def tiled_cast_reference(
    x: torch.Tensor,
    history: torch.Tensor,
    role: int,
    fmt: FP8Format,
    tile: Sequence[int],
    tile_t: Sequence[int],
    margin: int,
    power_of_2: bool,
    *,
    noise: Optional[torch.Tensor] = None,
    record: bool = True,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The cast of a fine-grained FP8 layer (numerics.tiles.quantize_tiles): x with one scale per `tile`, and x^T
    with one per `tile_t` (an empty tile: that cast is not made). Returns (x_fp8, scale_inv, x^T_fp8, scale_inv^T);
    (record) x's amax is max-accumulated into history[role, 0], NaN / inf kept raw, as the per-tensor casts do."""
    rounding = "stochastic" if noise is not None else "nearest"
    q = s = q_t = s_t = None
    amax = None
    # every output contiguous (row-major), whatever x's layout: what the op's fake implementation promises and what
    # a kernel writes; x^T cast from the transposed view would otherwise come back column-major
    if len(tile):
        q, s, amax = quantize_tiles(x, tile, fmt, margin, power_of_2, rounding=rounding, noise=noise)
        q, s = q.contiguous(), s.contiguous()
    if len(tile_t):
        noise_t = noise.t() if noise is not None else None
        q_t, s_t, amax_t = quantize_tiles(x.t(), tile_t, fmt, margin, power_of_2, rounding=rounding, noise=noise_t)
        q_t, s_t = q_t.contiguous(), s_t.contiguous()
        amax = amax_t if amax is None else amax
    if record:
        if amax is None:
            amax = fast_amax(x)
        slot = history[role, 0]
        slot.copy_(torch.maximum(slot, amax))  # torch.maximum propagates NaN
    return q, s, q_t, s_t


def grouped_cast_reference(
    x: torch.Tensor,
    history: torch.Tensor,
    role: int,
    fmt: FP8Format,
    offsets: torch.Tensor,
    margin: int,
    power_of_2: bool,
    *,
    noise: Optional[torch.Tensor] = None,
    record: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-group cast of an experts layer (numerics.groups.quantize_groups): x^T_fp8 (C, M) contiguous and the
    dequant scales (E, C); (record) x's amax max-accumulated into history[role, 0], NaN / inf kept raw."""
    rounding = "stochastic" if noise is not None else "nearest"
    q, s, amax = quantize_groups(x, offsets, fmt, margin, power_of_2, rounding=rounding, noise=noise)
    if record:
        slot = history[role, 0]
        slot.copy_(torch.maximum(slot, amax))  # torch.maximum propagates NaN
    return q.t().contiguous(), s.contiguous()


def microscaled_cast_reference(
    x: torch.Tensor,
    history: torch.Tensor,
    role: int,
    scaling: str,
    fmt: FP8Format,
    tile: Sequence[int],
    tile_t: Sequence[int],
    hadamard_t: bool,
    *,
    noise: Optional[torch.Tensor] = None,
    noise_t: Optional[torch.Tensor] = None,
    rng_state: Optional[torch.Tensor] = None,
    record: bool = True,
):
    """The twin of the fused microscaled casts (kernels/triton_microscaled.py), composed of `numerics.microscaling`:
    ((x_q, grid scales, tensor scale or None), (x^T_q, ...)) for the layouts asked for (an empty tile: (None, None,
    None)); x^T Hadamard-transformed along the tokens first where `hadamard_t` (NVFP4). NVFP4's stochastic rounding:
    `noise` / `noise_t` (uniform [0, 1) in each layout's unpacked shape), or draws from the Philox stream of
    `rng_state` (int64 [seed, offset]: `philox_uniform(seed, offset + i)` for the i-th element of the cast, row layout
    first, row-major; the offset then advanced in place by the number of draws). MXFP8 rounds to nearest even. (record)
    x's amax is max-accumulated into history[role, 0], NaN / inf kept raw."""
    from lightning_fp8.numerics import microscaling

    sources = []
    if len(tile):
        sources.append((x, tile, noise))
    else:
        sources.append(None)
    if len(tile_t):
        source_t = microscaling.hadamard_transform(x.t()) if (hadamard_t and scaling == "nvfp4") else x.t()
        sources.append((source_t, tile_t, noise_t))
    else:
        sources.append(None)
    if scaling == "nvfp4" and rng_state is not None and noise is None and noise_t is None:
        offset = rng_state[1]
        start = 0
        drawn = []
        for entry in sources:
            if entry is None:
                drawn.append(entry)
                continue
            source, layout_tile, _ = entry
            rows, cols = source.shape
            offsets = offset + start + torch.arange(rows * cols, dtype=torch.int64, device=x.device).view(rows, cols)
            drawn.append((source, layout_tile, microscaling.philox_uniform(rng_state[0], offsets)))
            start += rows * cols
        sources = drawn
        rng_state[1].add_(start)  # the stream's next draws start after this cast's
    casts = []
    amax = None
    for entry in sources:
        if entry is None:
            casts.append((None, None, None))
            continue
        source, layout_tile, layout_noise = entry
        if scaling == "mxfp8":
            q, s, layout_amax = microscaling.quantize_mx(source, layout_tile, fmt)
            g = None
        else:
            q, s, g, layout_amax = microscaling.quantize_nvfp4(source, layout_tile, layout_noise)
        casts.append((q.contiguous(), s.contiguous(), g))
        if amax is None and (source is x or not hadamard_t or scaling != "nvfp4"):
            amax = layout_amax  # x's amax (the transposed layout's equals it unless transformed)
    if record:
        if amax is None:  # only x^T was cast, and transformed: the amax of x itself
            amax = fast_amax(x)
        slot = history[role, 0]
        slot.copy_(torch.maximum(slot, amax))  # torch.maximum propagates NaN
    return casts[0], casts[1]
