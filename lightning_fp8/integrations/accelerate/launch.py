"""`python -m lightning_fp8.accelerate launch ...`: Accelerate's launcher with the fp8 check answered by our engine.

Two additions to `accelerate launch`, nothing else changes (same flags, config files, environment):

- Accelerate's launcher refuses fp8 unless one of its backends (TransformerEngine, torchao, MS-AMP) is importable;
  scripts built on FP8Accelerator need none, so that check answers True.
- When the launch resolves to fp8, each process runs the script through `_run_guarded`, which makes a plain
  `accelerate.Accelerator(...)` (a script not switched to FP8Accelerator yet) say so: without an Accelerate FP8
  backend it stops with a message pointing to FP8Accelerator (instead of Accelerate's "requires transformer_engine or
  MS-AMP"); with one it warns that Accelerate's backend, not lightning_fp8, runs FP8.
"""
from __future__ import annotations

import functools
import inspect
import os
import runpy
import sys
import warnings
from typing import List, Optional, Sequence

#: the internal subcommand each launched process runs the training script through
GUARD_COMMAND = "_run_guarded"
#: the module that runs it (`python -m lightning_fp8.accelerate _run_guarded --script train.py ...`)
GUARD_MODULE = "lightning_fp8.accelerate"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`accelerate` CLI with `launch --mixed_precision fp8` allowed without TE / torchao / MS-AMP (see the module
    docstring); `_run_guarded` is the per-process entry the launcher itself uses."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [GUARD_COMMAND]:
        return run_guarded(argv[1:])
    import accelerate.commands.launch as launch_command
    import accelerate.utils.launch as launch_utils
    from accelerate.commands.accelerate_cli import main as accelerate_main

    launch_utils.is_fp8_available = lambda: True
    validate = launch_command._validate_launch_command

    def validate_and_guard(args):
        args, defaults, mp_from_config_flag = validate(args)
        if args.mixed_precision == "fp8" and not args.no_python:
            mode = "--module" if args.module else "--script"
            args.training_script_args = [GUARD_COMMAND, mode, args.training_script, *args.training_script_args]
            args.training_script, args.module = GUARD_MODULE, True
        return args, defaults, mp_from_config_flag

    launch_command._validate_launch_command = validate_and_guard
    sys.argv = ["accelerate", *argv]
    accelerate_main()


def run_guarded(argv: List[str]) -> None:
    """Run a training script (`--script path args...`) or module (`--module name args...`) as `__main__`, with
    `accelerate.Accelerator` checked for fp8 (see `check_plain_accelerator`)."""
    if len(argv) < 2 or argv[0] not in ("--script", "--module"):
        raise SystemExit(f"usage: python -m {GUARD_MODULE} {GUARD_COMMAND} --script PATH|--module NAME [args...]")
    mode, target, *rest = argv
    install_accelerator_check()
    sys.argv = [target, *rest]
    if mode == "--module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
        runpy.run_path(target, run_name="__main__")


def install_accelerator_check() -> None:
    """Make `accelerate.Accelerator.__init__` call `check_plain_accelerator` first (once per process)."""
    from accelerate import Accelerator

    if getattr(Accelerator.__init__, "_lightning_fp8_checked", False):
        return
    original = Accelerator.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from lightning_fp8.integrations.accelerate.accelerator import FP8AcceleratorMixin

        if not isinstance(self, FP8AcceleratorMixin):
            check_plain_accelerator(signature.bind(self, *args, **kwargs).arguments.get("mixed_precision"))
        original(self, *args, **kwargs)

    __init__._lightning_fp8_checked = True  # type: ignore[attr-defined]
    Accelerator.__init__ = __init__


def check_plain_accelerator(mixed_precision: Optional[str]) -> None:
    """A plain accelerate.Accelerator asked for fp8 in a script launched by lightning_fp8's launcher: stop with a
    pointer to FP8Accelerator when Accelerate has no FP8 backend to run it with, else warn whose FP8 it is."""
    from accelerate.utils import imports

    from lightning_fp8.integrations.accelerate.accelerator import _resolve_mixed_precision

    if _resolve_mixed_precision(mixed_precision) != "fp8":
        return
    message = (
        "lightning_fp8: this script was launched with mixed precision 'fp8' by `python -m lightning_fp8.accelerate "
        "launch`, but it builds accelerate.Accelerator, which does not use lightning_fp8. Build "
        "lightning_fp8.accelerate.FP8Accelerator instead (same arguments: `from lightning_fp8.accelerate import "
        "FP8Accelerator; accelerator = FP8Accelerator()`, see docs/accelerate.md)."
    )
    backends = [name for name, available in (("torchao", imports.is_torchao_available),
                                               ("Transformer Engine", imports.is_transformer_engine_available),
                                               ("MS-AMP", imports.is_msamp_available)) if available()]
    if not backends:
        raise RuntimeError(message + " accelerate.Accelerator cannot run fp8 here: none of its FP8 backends "
                           "(torchao, Transformer Engine, MS-AMP) is installed.")
    warnings.warn(message + f" Accelerate will run FP8 with {backends[0]} instead (lightning_fp8.precision_map reports "
                  "those layers as converted by it).", UserWarning, stacklevel=3)


__all__ = ["main", "run_guarded", "install_accelerator_check", "check_plain_accelerator", "GUARD_COMMAND"]
