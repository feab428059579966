"""CPU kernels: what the custom ops run on CPU tensors, as fast as eager torch allows, bit-exact with `reference.py`.

`reference.py` composes `lightning_fp8.numerics` and is the definition; on CPU (the emulation every test, CI run and
demo uses) its cost is dominated by dispatch: a cast of a small tensor is thirty tiny tensor operations on 0-d scales.
These twins compute the same bits with less:

- the scale of a cast is derived on the host, in IEEE float32 arithmetic (numpy float32 scalars: correctly rounded
  divisions, as torch's), from one `tolist()` of the role's amax history: one operation instead of about twenty;
- the clamp of `quantize` is skipped when the tensor's amax shows that nothing can saturate (it is then the
  identity; one reduction costs less than the clamp, so nearest rounding always takes the amax);
- everything else is the reference's own tensor operations.

tests/test_kernels.py compares every output and state write of these with the reference over recipes, histories,
edge values and NaN / inf. Set LIGHTNING_FP8_CPU_REFERENCE=1 to run the reference instead.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np
import torch

from lightning_fp8.kernels.reference import fast_amax
from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.quantize import quantize

_F32_MAX = np.float32(np.finfo(np.float32).max)


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
    """The CPU twin of `reference.scaled_cast_reference`: (x_fp8, scale, scale_inv), the same history write."""
    row = history[role].tolist()
    past = row[1:]
    sized_by_history = scaling == "delayed" and (max(past) if algo_max else past[0]) > 0
    rounding = "stochastic" if (stochastic or noise is not None) else "nearest"
    needs_amax = record or scaling == "current" or (scaling == "delayed" and not sized_by_history)
    # Nearest rounding takes the amax even where the scale does not need it (a delayed re-cast in backward): one
    # reduction (about 0.5 ms for 2816x1024 here) that proves the clamp an identity, instead of the clamp (3.6 ms).
    amax_t = fast_amax(x) if (needs_amax or rounding == "nearest") else None
    amax = float(amax_t) if amax_t is not None else 0.0
    scale = host_cast_scale(row, amax if needs_amax else 0.0, fmt.max, scaling, algo_max, margin, power_of_2)
    if rounding == "nearest" and float(np.float32(amax) * np.float32(scale)) <= fmt.max:
        # nothing saturates: quantize's clamp is the identity; one float32 buffer, scaled in place
        y = x.to(torch.float32)
        y = y.mul_(scale) if y is not x else y * scale
        q = y.to(fmt.dtype)
    else:
        q = quantize(x, torch.tensor(scale, dtype=torch.float32), fmt, rounding=rounding, noise=noise, generator=generator)
    if record:
        old = row[0]
        new = math.nan if (math.isnan(amax) or math.isnan(old)) else max(old, amax)  # torch.maximum's NaN rule
        if new != old or math.isnan(new):
            history[role, 0] = new
    scale_t = torch.tensor(scale, dtype=torch.float32)
    return q.contiguous(), scale_t, torch.tensor(float(np.float32(1.0) / np.float32(scale)), dtype=torch.float32)


def cast_cpu(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: FP8Format,
    *,
    write_row: bool,
    write_t: bool,
    compute_amax: bool,
) -> Optional[Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]]:
    """The CPU twin of `reference.cast_reference` for nearest rounding with a scalar scale (a weight re-cast in
    backward with the forward's scale): the amax first, and when it shows nothing saturates, the scaled values cast
    without `quantize`'s clamp. None where it does not apply (the caller runs the reference)."""
    if scale.numel() != 1 or not (write_row or write_t):
        return None
    amax_t = fast_amax(x)
    amax, factor = float(amax_t), float(scale.reshape(()).to(torch.float32))
    if not float(np.float32(amax) * np.float32(factor)) <= fmt.max:  # saturation, inf or NaN: the reference
        return None
    y = x.to(torch.float32)
    y = y.mul_(factor) if y is not x else y * factor
    q = y.to(fmt.dtype)
    return (q if write_row else None), (q.t().contiguous() if write_t else None), (amax_t if compute_amax else None)


__all__ = ["scaled_cast_cpu", "cast_cpu", "host_scale", "host_cast_scale"]
