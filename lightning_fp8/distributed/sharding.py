"""What the adapters need to know about an FSDP2-sharded model: is it sharded, and may it still be converted.

Conversion must come before `fully_shard`: FSDP2 keeps a reference to each original module and parameter (a layer
replaced afterwards computes with a plain tensor against DTensor shards and fails deep inside an op), and the FP8
all-gather extension is read when FSDP2 shards. `check_convertible` turns the late case into an error that says
what to do instead.
"""
from __future__ import annotations

from typing import Iterable, List

from torch import nn

try:  # FSDP2 (torch >= 2.4 with torch.distributed)
    from torch.distributed.fsdp import FSDPModule
except Exception:  # pragma: no cover - builds without torch.distributed
    FSDPModule = ()  # type: ignore[assignment,misc]

#: what the error message tells each framework's users to call in place of a late conversion
_HOW_TO = (
    "convert before sharding. With Lightning's ModelParallelStrategy the plugin converts the layers the LightningModule "
    "holds before configure_model, and linear layers built inside configure_model through `torch.nn.Linear` are built "
    "as FP8 layers; a layer of another class, or of a class bound before configure_model ran (`from torch.nn import "
    "Linear` at import time), needs `self.trainer.precision_plugin.convert_for_fsdp(module)` in configure_model, "
    "before fully_shard. With Fabric's ModelParallelStrategy the plugin converts before your parallelize_fn. With "
    "plain PyTorch call convert_to_fp8(module) and lightning_fp8.distributed.enable_fp8_all_gather(module) before "
    "fully_shard."
)


def is_fsdp_sharded(model: nn.Module) -> bool:
    """True if `fully_shard` has run on `model` or on any of its submodules."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_modules(model: nn.Module) -> List[nn.Module]:
    """Every module of `model` that `fully_shard` ran on (each owns one group of sharded parameters)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check_convertible(model: nn.Module, would_convert: Iterable[str]) -> None:
    """Raise if `model` is FSDP2-sharded and conversion would still replace layers (`would_convert`: their names)."""
    pending = list(would_convert)
    if pending and is_fsdp_sharded(model):
        raise RuntimeError(
            f"lightning_fp8: this model is already sharded by FSDP2 (fully_shard) and {len(pending)} of its linear "
            f"layers are not converted to FP8 yet ({', '.join(pending[:3])}{' ...' if len(pending) > 3 else ''}). "
            "Layers cannot be replaced after sharding; " + _HOW_TO
        )
