"""The FP8 formats (and NVFP4's FP4 element format), as facts read off torch's own low-precision dtypes.

Everything else (clamping, scale computation, stochastic rounding) asks these objects for ranges instead of
hard-coding 448 or 57344, so a third format would be one more constant here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding: its torch dtype and the numbers that bound it."""

    name: str
    dtype: torch.dtype
    max: float  # largest finite magnitude
    smallest_normal: float
    smallest_subnormal: float
    mantissa_bits: int
    has_inf: bool
    # uint8 bit pattern (sign bit cleared) of the largest finite magnitude; stochastic rounding walks these codes
    max_code: int
    #: bits per element (FP4's torch dtype packs two elements per byte: `float4_e2m1fn_x2`)
    bits: int = 8

    def __repr__(self) -> str:  # keeps recipe reprs readable
        return f"FP8Format({self.name})"


E4M3 = FP8Format(
    name="e4m3",
    dtype=torch.float8_e4m3fn,
    max=float(torch.finfo(torch.float8_e4m3fn).max),  # 448
    smallest_normal=2.0**-6,
    smallest_subnormal=2.0**-9,
    mantissa_bits=3,
    has_inf=False,
    max_code=0x7E,
)

E5M2 = FP8Format(
    name="e5m2",
    dtype=torch.float8_e5m2,
    max=float(torch.finfo(torch.float8_e5m2).max),  # 57344
    smallest_normal=2.0**-14,
    smallest_subnormal=2.0**-16,
    mantissa_bits=2,
    has_inf=True,
    max_code=0x7B,
)

#: FP4 E2M1, the element format of NVFP4 (numerics/microscaling.py): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf,
#: no NaN. torch stores it two per byte (`torch.float4_e2m1fn_x2`, first element in the low nibble) and cannot cast
#: to it on CPU, so microscaling.py rounds to its codes itself.
E2M1 = FP8Format(
    name="e2m1",
    dtype=torch.float4_e2m1fn_x2,
    max=6.0,
    smallest_normal=1.0,
    smallest_subnormal=0.5,
    mantissa_bits=1,
    has_inf=False,
    max_code=0x7,
    bits=4,
)

FORMATS = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}


def get_format(name: str) -> FP8Format:
    """Look a format up by name; unknown names raise a ValueError that lists the valid ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown low-precision format {name!r}; valid formats: {sorted(FORMATS)}") from None
