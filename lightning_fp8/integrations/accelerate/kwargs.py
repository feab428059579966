"""FP8Kwargs: the FP8 options of `FP8Accelerator(kwargs_handlers=[FP8Kwargs(...)])`.

Its fields are generated from the one definition of the options, the parameters of `FP8PrecisionCore.__init__`
(lightning_fp8/integrations/plugin_core.py): the names, types and defaults of the Lightning and Fabric plugins' arguments,
validated by the same function (`_options.validate_options`). It is an `accelerate.utils.KwargsHandler`, as
Accelerate's own handlers are.
"""
from __future__ import annotations

from accelerate.utils import KwargsHandler

from lightning_fp8.integrations.plugin_core import FP8PrecisionCore, option_values, options_dataclass
from lightning_fp8.integrations._options import validate_options


@options_dataclass
class FP8Kwargs(KwargsHandler):
    """FP8 options for `FP8Accelerator(kwargs_handlers=[FP8Kwargs(...)])`: the same options as
    `lightning_fp8.FP8Precision`, with the same names and defaults, keyword-only (`help(FP8PrecisionCore.__init__)`
    says what each does).

    Invalid values raise ValueError here, naming the valid choices. The options only take effect when mixed precision
    resolves to "fp8"; otherwise they are ignored with a warning. With the Accelerate adapter, `fp8_eval` applies to
    forward passes of the model in eval mode (`model.eval()`).
    """

    def __post_init__(self) -> None:
        validate_options(self)

    def build_core(self) -> FP8PrecisionCore:
        """The engine and option handling the Lightning / Fabric plugins share, built from these options."""
        return FP8PrecisionCore(**option_values(self))
