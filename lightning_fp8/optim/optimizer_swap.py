"""Swapping a user's torch Adam/AdamW for FP8AdamW mid-setup, and re-pointing their LR schedulers.

The Lightning/Fabric/Accelerate adapters call these when the user asks for `optimizer_state="fp8"`:

    new = to_fp8_optimizer(old, **fp8_kwargs)
    if new is None:
        warn(unsupported_optimizer_message(old))       # keep the user's optimizer
    else:
        rebind_lr_schedulers(schedulers, old, new)

Adam's coupled weight decay (L2 added to the gradient) is emulated exactly (group key
decoupled_weight_decay=False), not rejected: the conversion never changes what the user's optimizer computes
beyond the storage precision of its moments.
"""
from __future__ import annotations

import weakref
from functools import wraps
from typing import Any, Iterable, Optional

import torch
from torch.optim import Optimizer

from lightning_fp8.optim.adamw import FP8_GROUP_KEYS, TORCH_IMPL_KEYS, FP8AdamW
from lightning_fp8.optim.moment_storage import adopt_state

SUPPORTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


def _unsupported_reason(optimizer: Optimizer) -> Optional[str]:
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        # exact types: a subclass may change step() in ways a conversion would silently drop
        return f"it is a {type(optimizer).__module__}.{type(optimizer).__qualname__}"
    for i, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            return f"param group {i} uses amsgrad=True"
        if group.get("differentiable"):
            return f"param group {i} uses differentiable=True"
        if any(torch.is_complex(p) for p in group["params"]):
            return f"param group {i} holds complex parameters"
    return None


def unsupported_optimizer_message(optimizer: Optimizer) -> str:
    """The message to show when `to_fp8_optimizer` returned None for `optimizer`."""
    reason = _unsupported_reason(optimizer) or "it was not converted"
    return (
        f"optimizer_state='fp8' keeps optimizer state in FP8 only for torch.optim.Adam and torch.optim.AdamW "
        f"(without amsgrad), but {reason}. The optimizer is left unchanged and its state stays in full precision. "
        f"Use lightning_fp8.optim.FP8AdamW directly, or optimizer_state='fp32' to silence this message."
    )


def to_fp8_optimizer(optimizer: Optimizer, **fp8_kwargs: Any) -> Optional[torch.optim.Optimizer]:
    """An FP8AdamW over the same parameters and param groups as a torch Adam/AdamW, or None if unsupported.

    Every group keeps its hyperparameters (lr, betas, eps, weight_decay, maximize) and any extra keys, such as
    the "initial_lr" of an LR scheduler; torch implementation flags (foreach, fused, capturable, ...) are
    dropped. Existing state (exp_avg, exp_avg_sq, step) is converted into the compressed layout.
    `fp8_kwargs` are FP8AdamW's storage options (exp_avg_sq_dtype, master_weights, block_size, min_numel_fp8,
    seed); anything else raises ValueError. Returns None for any other optimizer (including subclasses of
    Adam/AdamW, and amsgrad=True); show `unsupported_optimizer_message(optimizer)` then.
    """
    unknown = set(fp8_kwargs) - set(FP8_GROUP_KEYS)
    if unknown:
        raise ValueError(f"unknown FP8 optimizer option(s) {sorted(unknown)}; valid options: {list(FP8_GROUP_KEYS)}")
    if _unsupported_reason(optimizer) is not None:
        return None
    is_adamw = type(optimizer) is torch.optim.AdamW
    groups = []
    for group in optimizer.param_groups:
        new_group = {k: v for k, v in group.items() if k not in TORCH_IMPL_KEYS}
        new_group["params"] = list(group["params"])
        new_group["decoupled_weight_decay"] = bool(group.get("decoupled_weight_decay", is_adamw))
        groups.append(new_group)
    d = optimizer.defaults
    new = FP8AdamW(
        groups,
        lr=d["lr"],
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        maximize=d.get("maximize", False),
        decoupled_weight_decay=bool(d.get("decoupled_weight_decay", is_adamw)),
        **fp8_kwargs,
    )
    for group in new.param_groups:
        for p in group["params"]:
            saved = optimizer.state.get(p)
            if saved:
                new.state[p] = adopt_state(p, group, saved, group["block_size"])
    return new


def rebind_lr_schedulers(schedulers: Iterable[Any], old_optimizer: Optimizer, new_optimizer: Optimizer) -> int:
    """Point every scheduler that drives `old_optimizer` at `new_optimizer`; returns how many were re-pointed.

    Accepts torch LR schedulers (SequentialLR / ChainedScheduler children included) and objects with a
    `.scheduler` attribute (Lightning's LRSchedulerConfig). A torch scheduler reads and writes
    `self.optimizer.param_groups` on every step, so re-pointing `optimizer` is all it takes once the new groups
    carry the same keys (to_fp8_optimizer keeps "initial_lr" etc.). Torch also wraps `optimizer.step` of the
    optimizer it was built with, to warn when `scheduler.step()` comes first; the same wrapper is put on the
    new optimizer (and its "already stepped" flag carried over) so that warning keeps its meaning.
    """
    if len(old_optimizer.param_groups) != len(new_optimizer.param_groups):
        raise ValueError("the new optimizer must have as many param groups as the old one")
    count = 0
    for entry in schedulers:
        for sched in _walk(getattr(entry, "scheduler", entry)):
            if getattr(sched, "optimizer", None) is old_optimizer:
                sched.optimizer = new_optimizer
                count += 1
    if count:
        _track_step_called(new_optimizer)
        if getattr(old_optimizer, "_opt_called", False):
            new_optimizer._opt_called = True  # type: ignore[attr-defined]
    return count


def _walk(scheduler: Any) -> Iterable[Any]:
    yield scheduler
    for child in getattr(scheduler, "_schedulers", None) or ():
        yield from _walk(child)


def _track_step_called(optimizer: Optimizer) -> None:
    """torch.optim.lr_scheduler.LRScheduler's step wrapper (it is a closure there, so it is repeated here)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = weakref.ref(optimizer)
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
