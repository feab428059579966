"""FP8Kwargs: the FP8 options of `FP8Accelerator(kwargs_handlers=[FP8Kwargs(...)])`.

It *is* an `FP8Options` (lightning_fp8/integrations/_options.py), so its fields, defaults and validation are those of
the Lightning and Fabric plugins, and an `accelerate.utils.KwargsHandler`, as Accelerate's own handlers are.
"""
from __future__ import annotations

from dataclasses import dataclass

from accelerate.utils import KwargsHandler

from lightning_fp8.integrations._core import FP8PrecisionCore
from lightning_fp8.integrations._options import FP8Options


@dataclass(kw_only=True)
class FP8Kwargs(FP8Options, KwargsHandler):
    """FP8 options for `FP8Accelerator(kwargs_handlers=[FP8Kwargs(...)])`: the same options as
    `lightning_fp8.FP8Precision`, with the same names and defaults (see `FP8Options` for each).

    Invalid values raise ValueError here, naming the valid choices. The options only take effect when mixed precision
    resolves to "fp8"; otherwise they are ignored with a warning. With the Accelerate adapter, `fp8_eval` applies to
    forward passes of the model in eval mode (`model.eval()`).
    """

    def build_core(self) -> FP8PrecisionCore:
        """The engine and option handling the Lightning / Fabric plugins share, built from these options."""
        return FP8PrecisionCore.from_options(self)


__all__ = ["FP8Kwargs"]
