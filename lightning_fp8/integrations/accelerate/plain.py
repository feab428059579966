"""Plain `accelerate.Accelerator` objects (a script's own, transformers' `Trainer`'s) run FP8 on lightning_fp8's engine.

A script built on `accelerate.Accelerator()` and transformers' `Trainer` (which builds `Accelerator(**args)` inside
`transformers/trainer.py`) cannot be told to build `FP8Accelerator` instead without editing them. When FP8 is
requested for a process, `install()` makes every `accelerate.Accelerator` (or subclass) constructed afterwards an
instance of the matching FP8 class (`FP8Accelerator`, or `FP8<YourClass>` = FP8AcceleratorMixin + your subclass):

    Accelerator.__new__(cls, ...)   returns an object of the FP8 class; Python then runs that class's __init__ with
                                    the caller's arguments, so the FP8 class sees exactly what the script passed

Mixed precision then resolves as in Accelerate (the argument, else ACCELERATE_MIXED_PRECISION, else the existing
AcceleratorState; an argument a library chose by default does not count, precision_source.py): "fp8" runs on the
engine; any other value makes the FP8 class behave as its base class, and, since FP8 was requested, warns at the first
`prepare` which setting won and why (FP8AcceleratorMixin). A script that passes one of Accelerate's own FP8 handlers
(TERecipeKwargs, AORecipeKwargs, MSAMPRecipeKwargs, FP8RecipeKwargs) asked for that backend: it keeps
`accelerate.Accelerator`, with a warning that lightning_fp8 is not the one running FP8.

Who installs it:
    python -m lightning_fp8.accelerate launch --mixed_precision fp8 train.py   each launched process (launcher.py)
    lightning_fp8.accelerate.enable_fp8()                                      one line in a script run otherwise
                                                                                (python, torchrun, accelerate launch)

Only `__new__` is set on accelerate.Accelerator (it defines none; Python's default allocates the object): the class,
its __init__ and every isinstance check stay as they are. `uninstall()` removes it.
"""
from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Dict, Optional

#: marks the __new__ this module installs
_MARK = "_lightning_fp8_plain_accelerators"
_FP8_CLASSES: Dict[type, type] = {}
_defaults: Dict[str, Any] = {"kwargs": None}
#: names of Accelerate's own FP8 handlers (asking for its TransformerEngine / torchao / MS-AMP backends)
ACCELERATE_FP8_HANDLERS = ("FP8RecipeKwargs", "TERecipeKwargs", "AORecipeKwargs", "MSAMPRecipeKwargs")


def enable_fp8(kwargs: Optional[Any] = None) -> None:
    """Run FP8 on lightning_fp8's engine for every `accelerate.Accelerator` this process builds from now on,
    transformers' `Trainer` included. The one line for a script run without `python -m lightning_fp8.accelerate
    launch`; call it before the Accelerator is built (for a Trainer: before `TrainingArguments`, which read the
    precision from the environment when built; arguments built earlier hold "no", which FP8 then overrides, and says
    so: precision_source.py).

    kwargs: an `FP8Kwargs` with the options of those Accelerators that pass none themselves.

    It sets ACCELERATE_MIXED_PRECISION=fp8 for this process, unless the environment asks for bf16 or fp16 already
    (`accelerate launch --mixed_precision bf16`, to run a baseline with the same script): that choice is kept, and
    said. An explicit `mixed_precision=` argument the user chose (transformers: `--bf16`) wins over both, as in
    Accelerate, with a warning at the first `prepare`; one a library chose by default (trl's bf16) does not."""
    from lightning_fp8.integrations.accelerate.kwargs import FP8Kwargs

    if kwargs is not None and not isinstance(kwargs, FP8Kwargs):
        raise TypeError(f"enable_fp8(kwargs=...) takes an FP8Kwargs, got {type(kwargs).__name__}")
    current = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if current in ("bf16", "fp16"):
        warnings.warn(
            f"lightning_fp8.accelerate.enable_fp8(): ACCELERATE_MIXED_PRECISION={current} (set by `accelerate launch "
            f"--mixed_precision {current}`, an accelerate config file or the environment) is kept: this run trains in "
            f"{current}, not FP8. Launch with --mixed_precision fp8 (or without the setting) to train in FP8.",
            UserWarning, stacklevel=2,
        )
    else:
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp8"
    _defaults["kwargs"] = kwargs
    install()


def default_kwargs() -> Optional[Any]:
    """The FP8Kwargs `enable_fp8` was given (None: the defaults)."""
    return _defaults["kwargs"]


def fp8_requested() -> bool:
    """Whether FP8 was requested for this process: `--mixed_precision fp8`, an accelerate config file with
    `mixed_precision: fp8`, ACCELERATE_MIXED_PRECISION=fp8 or `enable_fp8()`."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp8"


def install() -> None:
    """Make every accelerate.Accelerator built from now on an FP8 class (see the module docstring); idempotent."""
    from accelerate import Accelerator

    if getattr(Accelerator.__dict__.get("__new__"), _MARK, False):
        return

    def __new__(cls, *args: Any, **kwargs: Any):
        return object.__new__(_class_for(cls, args, kwargs))

    setattr(__new__, _MARK, True)
    Accelerator.__new__ = __new__  # type: ignore[method-assign]


def uninstall() -> None:
    """Make accelerate.Accelerator build its own class again (tests; a process that wants plain Accelerators back).

    The installed __new__ is replaced by one that allocates the class asked for, not deleted: CPython keeps a class's
    allocation slot pointing at a Python-level __new__ once one was set, and with it deleted `object.__new__` refuses
    the constructor's arguments ("takes exactly one argument")."""
    from accelerate import Accelerator

    if getattr(Accelerator.__dict__.get("__new__"), _MARK, False):
        Accelerator.__new__ = _allocate  # type: ignore[method-assign]
    _defaults["kwargs"] = None


def _allocate(cls, *args: Any, **kwargs: Any):
    """Python's default allocation (the arguments are __init__'s)."""
    return object.__new__(cls)


def _class_for(cls: type, args: tuple, kwargs: dict) -> type:
    from lightning_fp8.integrations.accelerate.accelerator import FP8Accelerator, FP8AcceleratorMixin

    if issubclass(cls, FP8AcceleratorMixin):
        return cls
    foreign = _foreign_fp8_handlers(cls, args, kwargs)
    if foreign:
        warnings.warn(
            f"lightning_fp8: this {cls.__name__} is given {foreign[0]}, which configures one of Accelerate's own FP8 "
            "backends (Transformer Engine, torchao, MS-AMP): that backend runs FP8 here, not lightning_fp8. Remove it "
            "to train on lightning_fp8's engine (its options: lightning_fp8.accelerate.FP8Kwargs).",
            UserWarning, stacklevel=3,
        )
        return cls
    from accelerate import Accelerator

    if cls is Accelerator:
        return FP8Accelerator
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"FP8{cls.__name__}", (FP8AcceleratorMixin, cls), {"__module__": cls.__module__})
    return _FP8_CLASSES[cls]


def _foreign_fp8_handlers(cls: type, args: tuple, kwargs: dict) -> list:
    try:
        handlers = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments.get("kwargs_handlers")
    except TypeError:  # arguments __init__ will refuse itself, with its own message
        handlers = kwargs.get("kwargs_handlers")
    return [type(h).__name__ for h in handlers or () if type(h).__name__ in ACCELERATE_FP8_HANDLERS]
