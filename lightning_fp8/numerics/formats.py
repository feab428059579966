"""The FP8 formats (and NVFP4's FP4 element format), as facts read off torch's own low-precision dtypes.

Everything else (clamping, scale computation, stochastic rounding) asks these objects for ranges instead of
hard-coding 448 or 57344, so a third format would be one more constant here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch


class TorchFeature(NamedTuple):
    """Something lightning_fp8 uses that torch added after the oldest torch it supports (pyproject's floor)."""

    name: str  # as the user would look for it: "torch.float4_e2m1fn_x2"
    since: Tuple[int, int]  # the torch release that added it
    needed_by: str  # what needs it, for the message of a refusal


#: The torch versions behind the recipes, in one place. The floor (pyproject: torch>=2.6) runs the per-tensor and
#: rowwise / blockwise recipes, the plugins and the engine; beyond it:
#:   float8_e8m0fnu     torch 2.7   MXFP8's E8M0 block scales: FP8Recipe(scaling="mxfp8") refuses on an older torch
#:   float4_e2m1fn_x2   torch 2.8   NVFP4's packed FP4 elements: FP8Recipe(scaling="nvfp4") refuses on an older torch
#:   scaled_mm_v2       torch 2.10  `torch.nn.functional.scaled_mm` (ScalingType, SwizzleType): the GPU GEMMs of
#:                                  blockwise, mxfp8 and nvfp4. Nothing refuses: on an older torch those GEMMs run
#:                                  emulated on a GPU, after the planner's one warning (modules/scaled_mm.py), exactly
#:                                  as they run on a CPU with any torch.
#: `torch_has` looks for the feature itself, never at the version number: a nightly or a backport counts.
TORCH_FEATURES = {
    "float8_e8m0fnu": TorchFeature("torch.float8_e8m0fnu", (2, 7),
                                   "FP8Recipe(scaling='mxfp8') (its E8M0 block scales)"),
    "float4_e2m1fn_x2": TorchFeature("torch.float4_e2m1fn_x2", (2, 8),
                                     "FP8Recipe(scaling='nvfp4') (its packed FP4 E2M1 elements)"),
    "scaled_mm_v2": TorchFeature("torch.nn.functional.scaled_mm", (2, 10),
                                 "the GPU GEMMs of scaling='blockwise', 'mxfp8' and 'nvfp4' (emulated without it)"),
}


def torch_has(feature: str) -> bool:
    """Whether the installed torch has `feature`, a key of TORCH_FEATURES."""
    if feature not in TORCH_FEATURES:
        raise ValueError(f"unknown torch feature {feature!r}; valid features: {sorted(TORCH_FEATURES)}")
    if feature == "scaled_mm_v2":
        functional = torch.nn.functional
        return hasattr(functional, "scaled_mm") and hasattr(functional, "ScalingType")
    return isinstance(getattr(torch, feature, None), torch.dtype)


def missing_torch_feature(feature: str) -> Optional[str]:
    """None where the installed torch has `feature`; otherwise the sentence that says what needs it and which torch
    added it."""
    if torch_has(feature):
        return None
    name, since, needed_by = TORCH_FEATURES[feature]
    return (f"{needed_by} needs {name}, which torch {since[0]}.{since[1]} added; this is torch {torch.__version__}: "
            f"install torch>={since[0]}.{since[1]}, or choose a scaling this torch has")


@dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding: its torch dtype and the numbers that bound it."""

    name: str
    dtype: Optional[torch.dtype]  # None: this torch has no such dtype (E2M1 before torch 2.8: TORCH_FEATURES)
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
#: to it on CPU, so microscaling.py rounds to its codes itself. Before torch 2.8 there is no such dtype: dtype is None
#: and FP8Recipe(scaling="nvfp4") refuses (TORCH_FEATURES).
E2M1 = FP8Format(
    name="e2m1",
    dtype=getattr(torch, "float4_e2m1fn_x2", None),
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
