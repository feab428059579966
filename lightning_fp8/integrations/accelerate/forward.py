"""Run a prepared model's forward inside the FP8 + autocast context, removable as Accelerate's own wrapper is."""
from __future__ import annotations

import functools
from types import MethodType
from typing import Any, Callable

from accelerate.utils.operations import convert_outputs_to_fp32
from torch import nn


def wrap_forward(model: nn.Module, context: Callable[[bool], Any]) -> None:
    """Run model.forward inside `context(model.training)`, outputs converted to fp32 as Accelerate's own
    mixed-precision wrapper does. Built like Accelerate's (MethodType over the function, a `__wrapped__` chain,
    `_original_forward`) so `accelerator.unwrap_model(model, keep_fp32_wrapper=False)` removes it."""
    if _is_wrapped(model.forward):
        return
    model._original_forward = model.forward
    func = getattr(model.forward, "__func__", None)
    if func is not None:
        @functools.wraps(func)
        def forward(self, *args, **kwargs):
            with context(self.training):
                return func(self, *args, **kwargs)

        forward._lightning_fp8_forward = True  # type: ignore[attr-defined]
        model.forward = MethodType(convert_outputs_to_fp32(forward), model)
    else:  # forward already replaced by a plain callable (Accelerate handles this case the same way)
        original = model.forward

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with context(model.training):
                return original(*args, **kwargs)

        forward._lightning_fp8_forward = True  # type: ignore[attr-defined]
        model.forward = convert_outputs_to_fp32(forward)


def _is_wrapped(forward: Any) -> bool:
    while forward is not None:
        if getattr(forward, "_lightning_fp8_forward", False):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False
