"""`python -m lightning_fp8.accelerate launch ...`: Accelerate's launcher with the fp8 check answered by our engine."""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`accelerate` CLI with `launch --mixed_precision fp8` allowed without TE / torchao / MS-AMP.

    Accelerate's launcher refuses fp8 unless one of its backends is importable (accelerate.utils.launch checks
    `is_fp8_available()` before starting the script). Scripts built on FP8Accelerator do not need one, so this entry
    point answers that check with True and hands everything else to Accelerate unchanged: same flags, same config
    files, same environment the script sees.
    """
    import accelerate.utils.launch as launch_utils
    from accelerate.commands.accelerate_cli import main as accelerate_main

    launch_utils.is_fp8_available = lambda: True
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["accelerate", *argv]
    accelerate_main()


__all__ = ["main"]
