"""CPU kernels: what the custom ops run on CPU tensors, as fast as eager torch allows, bit-exact with `kernel_reference.py`.

`kernel_reference.py` composes `lightning_fp8.numerics` and is the definition; on CPU (the emulation every test, CI run and
demo uses) its cost is dominated by dispatch: a cast of a small tensor is dozens of tiny tensor operations on 0-d
scales. These twins compute the same bits with less:

- the scale of a cast is derived on the host, in IEEE float32 arithmetic (numpy float32 scalars: correctly rounded
  divisions, as torch's), from one `tolist()` of the role's amax history: one operation instead of a chain of 0-d ones;
- the clamp of `quantize` is skipped when the tensor's amax shows that nothing can saturate (it is then the
  identity; one reduction costs less than the clamp, so nearest rounding always takes the amax), and a cast that
  needs no amax (the backward's weight re-cast) skips the reduction too where torch's own cast to the format
  saturates exactly as the clamp does (E4M3 from torch 2.12: `_cast_saturates_like_the_clamp`);
- a BF16 tensor with a power-of-two scale is scaled in BF16 (every product exact, as in float32) and cast from there:
  no float32 copy;
- everything else is the reference's own tensor operations.

The passes of these twins (and the emulation's conversions to BF16) are memory-bound: where other processes share the
CPUs, each parallel pass can wait a whole scheduler time slice for a descheduled worker thread, so they run on one
thread or on all of torch's, whichever has been faster lately (`memory_bound_threads`). Results never depend on it.

Every output and state write of these equals the reference's, bit for bit, for every recipe, history, edge value and
NaN / inf. Set LIGHTNING_FP8_CPU_REFERENCE=1 to run the reference instead.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightning_fp8.kernels.kernel_reference import fast_amax
from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize
from lightning_fp8.numerics.tiles import amax_of_tiles, tile_extent, tile_scales, times_tiles, transposed

_F32_MAX = np.float32(np.finfo(np.float32).max)


class _ThreadChoice:
    """One thread or all of torch's for a kind of memory-bound pass: the one whose recent passes took less time per
    element (an exponential average per choice), the other tried again every `PROBE_EVERY` passes so a change of
    load is seen. On a quiet machine all threads win (the passes run from cache at several bytes per cycle per
    core); on a shared one a single thread does (a parallel pass waits for its slowest, descheduled, thread)."""

    PROBE_EVERY = 32

    def __init__(self) -> None:
        self.cost: Dict[bool, Optional[float]] = {False: None, True: None}  # single thread? -> seconds per element
        self.passes = 0

    def single(self) -> bool:
        self.passes += 1
        many, one = self.cost[False], self.cost[True]
        if many is None or one is None:
            return many is not None  # try each once: all threads first
        best = one < many
        return (not best) if self.passes % self.PROBE_EVERY == 0 else best

    def record(self, single: bool, seconds: float, numel: int) -> None:
        cost, old = seconds / numel, self.cost[single]
        self.cost[single] = cost if old is None else 0.75 * old + 0.25 * cost


_thread_choices: Dict[str, _ThreadChoice] = {}
#: passes over fewer elements run on one thread anyway (torch's grain size is 32768)
_PARALLEL_FROM = 1 << 17


@contextlib.contextmanager
def memory_bound_threads(kind: str, numel: int) -> Iterator[None]:
    """Run the block's memory-bound CPU passes (over about `numel` elements; `kind` groups passes of one cost) on one
    thread or on all of torch's (`_ThreadChoice`); the GEMMs are left to torch. Results are the same either way:
    every pass is elementwise or an exact reduction."""
    threads = torch.get_num_threads()
    if threads == 1 or numel < _PARALLEL_FROM:
        yield
        return
    choice = _thread_choices.setdefault(kind, _ThreadChoice())
    single = choice.single()
    if single:
        torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        yield
    finally:
        if single:
            torch.set_num_threads(threads)
    choice.record(single, time.perf_counter() - start, numel)


def _memory_bound(kind: str):
    """Decorator: the function's passes over its first argument run under `memory_bound_threads(kind, ...)`."""
    def wrap(function):
        @functools.wraps(function)
        def run(x, *args, **kwargs):
            with memory_bound_threads(kind, x.numel()):
                return function(x, *args, **kwargs)
        return run
    return wrap


def _usable(amax: float) -> bool:
    return math.isfinite(amax) and amax > 0.0


def host_scale(amax: float, fp8_max: float, margin: int, power_of_2: bool, fallback: float) -> float:
    """`numerics.scaling.scale_from_amax` for one value, on the host: float32 divisions, clamp, power of two by the
    exact binary exponent; `fallback` where amax is 0, inf or NaN. Returns a float32 value (as a Python float)."""
    if not _usable(amax):
        return fallback
    scale = np.float32(np.float32(fp8_max) / np.float32(amax)) / np.float32(2.0**margin)
    scale = min(np.float32(scale), _F32_MAX)
    if power_of_2:
        _, exponent = math.frexp(float(scale))
        scale = np.float32(math.ldexp(1.0, exponent - 1))
    return float(scale)


def host_cast_scale(
    history: List[float], amax: float, fp8_max: float, scaling: str, algo_max: bool, margin: int, power_of_2: bool
) -> float:
    """`numerics.scaling.cast_scale` on the host, from the role's history as floats."""
    if scaling == "none":
        return 1.0
    previous = host_scale(history[1], fp8_max, margin, power_of_2, 1.0)
    current = host_scale(amax, fp8_max, margin, power_of_2, previous)
    if scaling == "current":
        return current
    past = history[1:]
    ref = max(past) if algo_max else past[0]  # the history holds finite values only
    return host_scale(ref, fp8_max, margin, power_of_2, current)


def _fits(amax: float, scale: float, fmt: FP8Format) -> bool:
    """Whether amax * scale (float32 product, as the cast computes it) is within range: then no scaled element can
    saturate (rounding is monotone), so quantize's clamp is the identity. False for inf / NaN."""
    return float(np.float32(amax) * np.float32(scale)) <= fmt.max


def _cast_unclamped(x: torch.Tensor, scale: float, fmt: FP8Format) -> torch.Tensor:
    """`quantize` (nearest) where `_fits` holds: x in float32 times the scale, cast; one float32 buffer, scaled in
    place when x was not float32 already. A BF16 x with a power-of-two scale is scaled in BF16 instead: the product
    of a BF16 value and 2^k is exact in BF16 wherever it is a normal number (BF16 has float32's exponent range), and
    below BF16's normal range (2^-126) every value casts to a signed zero either way, so the cast sees the float32
    product's value."""
    if x.dtype == torch.bfloat16 and _power_of_2(scale):
        return (x * scale).to(fmt.dtype)
    y = x.to(torch.float32)
    y = y.mul_(scale) if y is not x else y * scale
    return y.to(fmt.dtype)


def _power_of_2(value: float) -> bool:
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


@functools.lru_cache(maxsize=None)
def _cast_saturates_like_the_clamp(dtype: torch.dtype) -> bool:
    """Whether this torch's CPU cast of float32 to `dtype` equals `quantize`'s clamp-then-cast on every value: on
    the finite range's boundary and beyond it, on +-inf and NaN, through the vectorised and the scalar loop. True for
    E4M3 from torch 2.12 (it saturates, +inf to 448); False for E5M2 (it overflows to inf) and older torch."""
    fmt_max = torch.finfo(dtype).max
    edges = torch.tensor([fmt_max, fmt_max * 1.03, fmt_max * 1.0625, fmt_max * 1.07, fmt_max * 2, 3.0e38,
                          float("inf"), float("nan")])
    values = torch.cat([edges, -edges, torch.logspace(-40, 38, 4000), -torch.logspace(-40, 38, 4000)])
    direct = values.to(dtype).view(torch.uint8)
    clamped = values.clamp(-fmt_max, fmt_max).to(dtype).view(torch.uint8)
    return bool(torch.equal(direct, clamped))


@_memory_bound("cast")
def scaled_cast_cpu(
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU twin of `kernel_reference.scaled_cast_reference`: (x_fp8, scale, scale_inv), the same history write."""
    row = history[role].tolist()
    past = row[1:]
    sized_by_history = scaling == "delayed" and (max(past) if algo_max else past[0]) > 0
    rounding = "stochastic" if (stochastic or noise is not None) else "nearest"
    needs_amax = record or scaling == "current" or (scaling == "delayed" and not sized_by_history)
    # Nearest rounding takes the amax even where the scale does not need it (a delayed re-cast in backward): one
    # reduction, cheaper than the clamp, that proves the clamp an identity.
    amax_t = fast_amax(x) if (needs_amax or rounding == "nearest") else None
    amax = float(amax_t) if amax_t is not None else 0.0
    scale = host_cast_scale(row, amax if needs_amax else 0.0, fmt.max, scaling, algo_max, margin, power_of_2)
    if rounding == "nearest" and _fits(amax, scale, fmt):
        q = _cast_unclamped(x, scale, fmt)
    else:
        q = quantize(x, torch.tensor(scale, dtype=torch.float32), fmt, rounding=rounding, noise=noise, generator=generator)
    if record:
        old = row[0]
        new = math.nan if (math.isnan(amax) or math.isnan(old)) else max(old, amax)  # torch.maximum's NaN rule
        if new != old or math.isnan(new):
            history[role, 0] = new
    scale_t = torch.tensor(scale, dtype=torch.float32)
    return q.contiguous(), scale_t, torch.tensor(float(np.float32(1.0) / np.float32(scale)), dtype=torch.float32)


@_memory_bound("cast")
def cast_cpu(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    *,
    write_row: bool,
    write_t: bool,
    compute_amax: bool,
) -> Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]]:
    """The CPU twin of `kernel_reference.cast_reference` for nearest rounding with a scalar scale (a weight re-cast in
    backward with the forward's scale): the amax first, and when it shows nothing saturates, the scaled values cast
    without `quantize`'s clamp; without an amax to return, a float32 x whose cast saturates like the clamp is cast
    directly. None where it does not apply (the caller runs the reference)."""
    if scale.numel() != 1 or not (write_row or write_t):
        return None
    factor = float(scale.reshape(()).to(torch.float32))
    if not compute_amax and x.dtype == torch.float32 and _cast_saturates_like_the_clamp(fmt.dtype):
        # torch's cast is quantize's clamp-then-cast on every value: no amax needed to skip the clamp
        q = (x * factor).to(fmt.dtype)
        return (q if write_row else None), (q.t().contiguous() if write_t else None), None
    amax_t = fast_amax(x)
    amax = float(amax_t)
    if not _fits(amax, factor, fmt):  # saturation, inf or NaN: the reference
        return None
    q = _cast_unclamped(x, factor, fmt)
    return (q if write_row else None), (q.t().contiguous() if write_t else None), (amax_t if compute_amax else None)


def _whole_tiles(tile: Sequence[int], shape: Sequence[int]) -> Optional[Tuple[int, int]]:
    """The tile's extent when it divides the shape exactly (no ragged tile: a plain view then blocks x), else None."""
    tr, tc = tile_extent(tile, shape)
    return (tr, tc) if shape[0] % tr == 0 and shape[1] % tc == 0 else None


def _cast_whole_tiles(x32: torch.Tensor, magnitude: torch.Tensor, extent: Tuple[int, int], fmt: FP8Format,
                      margin: int, power_of_2: bool):
    """(x_fp8, scale per tile, tile amax) of `quantize_tiles`, or None where a tile saturates or is not finite (the
    reference then clamps). The products are the reference's (x in float32 times its tile's float32 scale); the clamp
    is skipped because every tile's amax times its scale is within range, so it would be the identity."""
    m, n = x32.shape
    (tr, tc), (gr, gc) = extent, (m // extent[0], n // extent[1])
    amax = magnitude.reshape(gr, tr, gc, tc).amax(dim=(1, 3))
    scale = tile_scales(amax, fmt, margin, power_of_2)
    if not bool((amax * scale <= fmt.max).all()):
        return None
    return times_tiles(x32, scale, extent).to(fmt.dtype), scale, amax


@_memory_bound("tiled cast")
def tiled_cast_cpu(
    x: torch.Tensor,
    history: torch.Tensor,
    role: int,
    fmt: FP8Format,
    tile: Sequence[int],
    tile_t: Sequence[int],
    margin: int,
    power_of_2: bool,
    *,
    record: bool = True,
) -> Optional[Tuple[Optional[torch.Tensor], ...]]:
    """The CPU twin of `kernel_reference.tiled_cast_reference` for nearest rounding when the tiles divide the tensor (the
    usual case: 128-aligned layers): x blocked by a view and multiplied by its tiles' scales by broadcasting instead
    of scales expanded to every element; x^T cast on x with the transposed tiling, then transposed as FP8 bytes; |x|
    computed once for both tilings. None where it does not apply (ragged tiles, a saturating or non-finite tile):
    the caller runs the reference, which is the definition."""
    shape = tuple(x.shape)
    extent = _whole_tiles(tile, shape) if len(tile) else None
    extent_t = _whole_tiles(transposed(tile_t), shape) if len(tile_t) else None
    if x.numel() == 0 or (len(tile) and extent is None) or (len(tile_t) and extent_t is None):
        return None
    x32 = x.to(torch.float32)
    magnitude = x32.abs()
    q = s = q_t = s_t = amax = None
    if len(tile):
        done = _cast_whole_tiles(x32, magnitude, extent, fmt, margin, power_of_2)
        if done is None:
            return None
        q, scale, tiles = done
        s, amax = scale.reciprocal(), amax_of_tiles(tiles)
    if len(tile_t):
        done = _cast_whole_tiles(x32, magnitude, extent_t, fmt, margin, power_of_2)
        if done is None:
            return None
        q_x, scale, tiles = done
        q_t, s_t = q_x.t().contiguous(), scale.t().contiguous().reciprocal()
        amax = amax_of_tiles(tiles) if amax is None else amax
    if record:
        slot = history[role, 0]
        slot.copy_(torch.maximum(slot, amax if amax is not None else fast_amax(x)))
    return q, s, q_t, s_t
