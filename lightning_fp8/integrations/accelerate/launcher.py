"""`python -m lightning_fp8.accelerate launch ...`: Accelerate's launcher, with fp8 run by lightning_fp8's engine.

Three additions to `accelerate launch`, nothing else changes (same flags, config files, environment):

- Accelerate's launcher refuses fp8 unless one of its backends (TransformerEngine, torchao, MS-AMP) is importable;
  this engine needs none, so that check answers True.
- When the launch resolves to fp8, each process runs the script through `_run_fp8`, which installs
  lightning_fp8/integrations/accelerate/plain.py first: every `accelerate.Accelerator(...)` the unchanged script
  builds, transformers' `Trainer`'s included, is an FP8Accelerator (a subclass of it: an `FP8<Subclass>`). Then the
  script runs as `accelerate launch` would run it (`__main__`, same argv and sys.path).
- Of the `--fp8_*` flags / the config file's `fp8_config`, only the fields given are exported to the processes
  (`ACCELERATE_FP8_*`), not the flags' defaults, so what the engine honours from them is what the user asked for
  (fp8_config.py).

Why plain `accelerate launch --mixed_precision fp8` cannot do this: its launcher refuses fp8 in the launching
process, before any of this package's code runs, and `accelerate.Accelerator` dispatches fp8 to a closed set of
backends matched by exact class; neither step offers an entry point to another package.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional, Sequence

from lightning_fp8.integrations.accelerate import fp8_config, plain

#: the internal subcommand each launched process runs the training script through
RUN_COMMAND = "_run_fp8"
#: the module that runs it (`python -m lightning_fp8.accelerate _run_fp8 --script train.py ...`)
RUN_MODULE = "lightning_fp8.accelerate"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`accelerate` CLI with `launch --mixed_precision fp8` run by lightning_fp8's engine (see the module docstring);
    `_run_fp8` is the per-process entry the launcher itself uses."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [RUN_COMMAND]:
        return run_fp8(argv[1:])
    import accelerate.commands.launch as launch_command
    import accelerate.utils.launch as launch_utils
    from accelerate.commands.accelerate_cli import main as accelerate_main

    launch_utils.is_fp8_available = lambda: True
    validate = launch_command._validate_launch_command

    def validate_and_run_fp8(args):
        args, defaults, mp_from_config_flag = validate(args)
        if args.mixed_precision == "fp8":
            # export only the fp8_config fields the config file or the command line gave (fp8_config.py)
            fp8_config.keep_explicit_fp8_args(args, defaults)
        if args.mixed_precision == "fp8" and not args.no_python:
            mode = "--module" if args.module else "--script"
            args.training_script_args = [RUN_COMMAND, mode, args.training_script, *args.training_script_args]
            args.training_script, args.module = RUN_MODULE, True
        return args, defaults, mp_from_config_flag

    launch_command._validate_launch_command = validate_and_run_fp8
    sys.argv = ["accelerate", *argv]
    accelerate_main()


def run_fp8(argv: List[str]) -> None:
    """Run a training script (`--script path args...`) or module (`--module name args...`) as `__main__`, with every
    accelerate.Accelerator it builds running fp8 on lightning_fp8's engine (plain.install)."""
    if len(argv) < 2 or argv[0] not in ("--script", "--module"):
        raise SystemExit(f"usage: python -m {RUN_MODULE} {RUN_COMMAND} --script PATH|--module NAME [args...]")
    mode, target, *rest = argv
    plain.install()
    sys.argv = [target, *rest]
    if mode == "--module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` sets it
        runpy.run_path(target, run_name="__main__")
    _end_process_group()


def _end_process_group() -> None:
    """After the script completed on this rank: a barrier (no rank ends the group while another still uses it),
    then destroy_process_group, which joins gloo's worker threads while Python is fully alive. Unchanged scripts
    (transformers' Trainer's) leave the group alive, and a gloo worker still holding a finished collective when the
    interpreter finalizes aborts the process ("terminate called without an active exception", exit code -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
