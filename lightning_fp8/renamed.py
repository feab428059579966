"""Old public names kept for one release after a rename (issue 45), each warning once where it is used.

    warn_renamed("FP8Layer.update_scales", "FP8Layer.close_scaling_step")
    __getattr__ = renamed_module_names(__name__, {"FP8LinearMeta": ("FP8LayerState", FP8LayerState)})

A `FutureWarning` (shown by default, unlike DeprecationWarning outside __main__): the old name works, and says which
name to use instead. Removed in lightning-fp8 0.3.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Tuple

REMOVED_IN = "0.3"


def warn_renamed(old: str, new: str) -> None:
    """Say that `old` is the pre-0.2 name of `new`, and that it goes away in REMOVED_IN."""
    warnings.warn(f"lightning_fp8: {old} is renamed {new}; the old name is removed in lightning-fp8 {REMOVED_IN}",
                  FutureWarning, stacklevel=3)


def renamed_module_names(module: str, names: Dict[str, Tuple[str, Any]]) -> Callable[[str], Any]:
    """A module-level `__getattr__` (PEP 562) serving old names: `names` maps an old name to (new name, object)."""

    def __getattr__(name: str) -> Any:
        if name in names:
            new, value = names[name]
            warnings.warn(f"lightning_fp8: {module}.{name} is renamed {new}; the old name is removed in "
                          f"lightning-fp8 {REMOVED_IN}", FutureWarning, stacklevel=2)
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
