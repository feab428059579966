"""Rank-zero logging without a framework, for the parts of the adapters that import none (`FP8PrecisionCore`, the
Accelerate adapter). The Lightning and Fabric plugins log through Lightning's rank-zero utilities instead
(`FP8PrecisionCore._rank_zero_info` / `_rank_zero_warn`, overridden in integrations/fabric_plugin.py)."""
from __future__ import annotations

import logging
import os
import sys
import warnings

import torch.distributed as dist

log = logging.getLogger("lightning_fp8")


def global_rank() -> int:
    """This process's rank: torch.distributed's once a process group exists, else the launcher's RANK variable
    (torchrun, accelerate launch), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def rank_zero_info(message: str) -> None:
    """Log `message` at INFO (logger "lightning_fp8") on rank 0 only. Where the application configured no logging,
    the logger gets a stderr handler at INFO first, as Lightning gives its own: what the adapters say at set-up (the
    conversion summary) is seen under Accelerate as under Lightning."""
    if global_rank() == 0:
        if not log.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            if log.level == logging.NOTSET:
                log.setLevel(logging.INFO)
        log.info(message)


def rank_zero_warn(message: str) -> None:
    """Warn (UserWarning) on rank 0 only."""
    if global_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)
