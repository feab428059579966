"""What the adapters do for sharded and data-parallel training, shared by all three (each calls these at its own hook).

    convert_for_fsdp(core, module)            before fully_shard: convert, then FP8 all-gather weights
                                              (fp8_all_gather=True)
    prepare_for_sharding(core, module)        the same, called by the plugins themselves right before the user's
                                              sharding code runs (Lightning's configure_model, Fabric's
                                              parallelize_fn), when the model holds layers that would convert;
                                              the user's code may then apply tensor parallelism (torch's styles or
                                              lightning_fp8's) and / or fully_shard
    release_unsharded(core, module)           after the user's sharding code: FP8 all-gather weights back to plain
                                              weights where FSDP2 did not shard (tensor parallelism alone)
    adopt_sharded_module(core, module)        the framework's own conversion call on a model already sharded:
                                              nothing may be replaced any more; refuse an unconverted model,
                                              otherwise attach the engine
    register_gradient_communication(core, model)
                                              gradient_communication="fp8": the DDP comm hook on a DDP wrapper,
                                              the FP8 reduce-scatter on FSDP2 units; idempotent
    adopt_tensor_parallel(core, module)       a model tensor parallelism split (torch's or lightning_fp8's styles):
                                              FP8 metadata back to local tensors, lightning_fp8's styles told the
                                              plugin's gradient_communication

The numerics and the FSDP2 / DDP mechanics live in lightning_fp8/distributed; this module only decides when. It
imports no framework: messages go through the core's rank-zero logging.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, List, Optional

import torch.distributed as dist
from torch import nn

from lightning_fp8.conversion.convert import fp8_layers, plan_conversion
from lightning_fp8.distributed.all_gather import (
    disable_fp8_all_gather,
    enable_fp8_all_gather,
    fp8_all_gather_reason,
    uses_fp8_all_gather,
)
from lightning_fp8.distributed.comm_hook import FP8CommState, fp8_comm_hook
from lightning_fp8.distributed.reduce_scatter import enable_fp8_reduce_scatter
from lightning_fp8.distributed.sharding import check_convertible, is_fsdp_sharded
from lightning_fp8.distributed.tensor_parallel import follow_plugin_communication
from lightning_fp8.integrations.linear_builder import suspended
from lightning_fp8.modules.local_shards import localize_fp8_state

if TYPE_CHECKING:  # pragma: no cover
    from lightning_fp8.integrations.plugin_core import FP8PrecisionCore

#: set on a module whose gradient communication this package configured (DDP allows one comm hook per model)
_REGISTERED_ATTR = "_lightning_fp8_gradient_communication"


def convert_for_fsdp(core: "FP8PrecisionCore", module: nn.Module) -> nn.Module:
    """Convert `module` and (fp8_all_gather=True) make FSDP2 gather its FP8 layers' weights in FP8. Before
    fully_shard: FSDP2 takes the modules and the all-gather extension as they are when it shards. A module the plugin
    prepared already (prepare_for_sharding, before the user's sharding code) is returned as it is."""
    root = getattr(core, "_sharding_root", None)
    if root is not None and any(m is module for m in root.modules()):
        return module
    if core.options.backend != "lightning_fp8":
        raise NotImplementedError(
            f"lightning_fp8: backend={core.options.backend!r} under FSDP2 is not supported by the plugins; use "
            "backend='lightning_fp8' with FSDP2."
        )
    if is_fsdp_sharded(module):
        raise RuntimeError(
            "lightning_fp8: convert_for_fsdp must run before fully_shard (FSDP2 keeps the modules and parameters it "
            "sharded). Call it first in configure_model / your parallelize function, then fully_shard."
        )
    module = core.convert_module(module)
    core.keep_first_last_guess(module)  # sharded next: its first forward is not traced
    if core.options.fp8_all_gather:
        decisions = enable_fp8_all_gather(module)
        if not core._summary_deferred:  # deferred: the strategy's conversion logs it with the summary, if FSDP2 sharded
            _log_all_gather(core, decisions)
    return module


def prepare_for_sharding(core: "FP8PrecisionCore", module: nn.Module) -> bool:
    """What the plugins do right before the user's sharding code runs (Lightning: `configure_model` under
    ModelParallelStrategy; Fabric: the strategy's `parallelize_fn`), whatever the mesh (FSDP2, tensor parallelism,
    both): `convert_for_fsdp(module)`, so the documented patterns (fully_shard and / or a tensor-parallel plan with
    torch's or lightning_fp8's styles in configure_model / parallelize_fn) train in FP8 with FP8 all-gather and no
    extra line. Only for a model not sharded yet that holds linear layers the recipe would convert (a model built
    inside configure_model does not exist yet: its layers are built as FP8 layers, integrations/linear_builder.py).
    Returns whether it converted. `release_unsharded` afterwards undoes the FP8 all-gather weights where FSDP2 did
    not shard."""
    from lightning_fp8.conversion.convert import is_converted, precision_map

    core.keep_first_last_guess(module)  # no trace of a first forward that would run the sharded model's collectives
    if (is_fsdp_sharded(module) or getattr(core, "_sharding_root", None) is not None
            or core.options.backend != "lightning_fp8"):  # the TE backend refuses FSDP2 at the strategy's conversion
        return False
    with suspended():
        if not is_converted(module):
            preview = precision_map(module, core.recipe, core.module_filter)
            if not any(row.precision != "bf16" for row in preview if row.preview):  # a preview row that would convert
                return False
        convert_for_fsdp(core, module)
    core._sharding_root = module
    return True


def release_unsharded(core: "FP8PrecisionCore", module: nn.Module) -> int:
    """After the user's sharding code: where FSDP2 did not shard `module` (tensor parallelism alone, or nothing), the
    FP8 all-gather weights `prepare_for_sharding` (or layers built for it) installed are plain weights again: no op
    goes through the all-gather subclass for nothing. Returns how many layers changed."""
    if is_fsdp_sharded(module):
        return 0
    return disable_fp8_all_gather(module)


def adopt_sharded_module(core: "FP8PrecisionCore", module: nn.Module) -> nn.Module:
    """The framework converts a model that fully_shard already sharded (Lightning's ModelParallelStrategy converts
    after configure_model): refuse if layers would still convert, else take the model over as it is."""
    if not fp8_layers(module):
        # which layers would convert, without the first/last rule (it would trace a forward of the sharded model)
        recipe = dataclasses.replace(core.recipe, keep_first_last_in_bf16=False)
        pending = [fqn for fqn, reason in plan_conversion(module, recipe, core.module_filter).items() if reason is None]
        check_convertible(module, pending)
    warn_if_gathered_in_high_precision(core, module)
    adopt_tensor_parallel(core, module)
    if core.log_summary(module) and core.options.fp8_all_gather:  # once per run, and after a deferred conversion
        _log_all_gather(core, {fqn: None if uses_fp8_all_gather(layer) else fp8_all_gather_reason(layer) or
                               "converted without FP8 all-gather" for fqn, layer in fp8_layers(module).items()})
    core._module = module
    core.engine.attach(module)
    return module


def adopt_tensor_parallel(core: "FP8PrecisionCore", module: nn.Module) -> int:
    """A model tensor parallelism split: torch's styles made the FP8 metadata replicated DTensors (back to the local
    tensors they hold), and lightning_fp8's styles follow the plugin's gradient_communication unless given their own.
    Returns how many lightning_fp8 styles the model has."""
    localize_fp8_state(module)
    return follow_plugin_communication(module, core.options.gradient_communication)


def warn_if_gathered_in_high_precision(core: "FP8PrecisionCore", module: nn.Module) -> None:
    """fp8_all_gather=True on a sharded model whose FP8 layers were converted without it (convert_module instead of
    convert_for_fsdp before fully_shard): say so once, naming the call that would enable it."""
    if not core.options.fp8_all_gather:
        return
    unexplained = [fqn for fqn, layer in fp8_layers(module).items()
                   if not uses_fp8_all_gather(layer) and fp8_all_gather_reason(layer) is None]
    if unexplained:
        core._rank_zero_warn(
            f"lightning_fp8: {len(unexplained)} FP8 layers gather their weights in high precision under FSDP2 "
            f"({', '.join(unexplained[:3])}{' ...' if len(unexplained) > 3 else ''}): they were converted without "
            "FP8 all-gather. Convert with `precision.convert_for_fsdp(module)` before fully_shard to all-gather them "
            "in FP8 (or pass fp8_all_gather=False to silence this)."
        )


def register_gradient_communication(core: "FP8PrecisionCore", model: nn.Module, state: Optional[FP8CommState] = None,
                                    warn_unsupported: bool = True) -> bool:
    """With the core's gradient_communication="fp8": FP8 gradient reduction on `model` (a DDP wrapper: the comm hook;
    a model with FSDP2 units: their reduce-scatter). True if `model` reduces gradients in FP8 afterwards; with several
    processes and neither kind of model, a warning (warn_unsupported) says the option has no effect."""
    if core.options.gradient_communication != "fp8":
        return False
    if getattr(model, _REGISTERED_ATTR, False):
        return True
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        try:
            model.register_comm_hook(state if state is not None else FP8CommState(), fp8_comm_hook)
        except RuntimeError as error:
            raise RuntimeError(
                "lightning_fp8: gradient_communication='fp8' registers a DDP comm hook, but this model has one "
                "already (DDP allows one). Remove your hook, or use gradient_communication='bf16' and keep yours."
            ) from error
    elif is_fsdp_sharded(model):
        enable_fp8_reduce_scatter(model, state)
    elif follow_plugin_communication(model, core.options.gradient_communication):
        pass  # tensor parallelism alone: lightning_fp8's styles reduce-scatter in FP8 (tensor_parallel.py)
    else:
        if warn_unsupported and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            core._rank_zero_warn(
                f"lightning_fp8: gradient_communication='fp8' applies to DDP and FSDP2 (fully_shard); this "
                f"{type(model).__name__} is neither, so its gradients are reduced as the strategy does."
            )
        return False
    object.__setattr__(model, _REGISTERED_ATTR, True)
    return True


def _log_all_gather(core: "FP8PrecisionCore", decisions: Dict[str, Optional[str]]) -> None:
    off: List[str] = [f"{fqn} ({reason})" for fqn, reason in decisions.items() if reason is not None]
    on = len(decisions) - len(off)
    message = f"lightning_fp8: FSDP2 all-gathers {on} FP8 layer weights in FP8"
    if off:
        message += f"; in high precision: {'; '.join(off[:5])}{' ...' if len(off) > 5 else ''}"
    core._rank_zero_info(message)
