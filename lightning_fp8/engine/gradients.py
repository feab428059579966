"""Which gradients of an iteration are unscaled: each exactly once, whatever the number of optimizers.

With loss scaling, a backward leaves gradients multiplied by the loss scale S. The engine divides them by S once per
iteration, at the iteration's decision (or earlier, for clipping), and must never divide a gradient twice: with two
optimizers, or a clip followed by a step, a second division would shrink that gradient by S. This object
remembers which gradient tensors it has unscaled since the last backward.

A gradient can outlive its iteration unscaled: an optimizer that steps every second iteration accumulates its
gradients over two backwards, and the first iteration's decision unscaled them. Before the next backward adds
S-scaled gradients to it, `before_backward` multiplies such a gradient by the (possibly new) scale, so every gradient
holds one consistent scale again. Loss scales are powers of two in dynamic mode, so this round trip is exact. With
loss scaling off (S = 1, the default for scaled FP8 gradients) nothing is multiplied.

References are weak: a gradient the user frees (`zero_grad()`) is not kept alive until the next backward.
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_fp8.engine.distributed import local_shards
from lightning_fp8.engine.loss_scaler import LossScaler


class GradientUnscaler:
    """Unscales each gradient of an iteration once and re-scales the ones left over for the next backward."""

    def __init__(self, scaler: LossScaler) -> None:
        self.scaler = scaler
        #: id(param) -> (param, the gradient tensor that was unscaled), both weak
        self._unscaled: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}
        #: whether a gradient unscaled since the last backward was inf / NaN: a device flag (1.0 if so), None while
        #: none was unscaled. Nothing here reads it: the engine reads it with the iteration's other flags, once
        self._found_inf: Optional[torch.Tensor] = None

    def unscale(self, params: Iterable[torch.Tensor]) -> Optional[torch.Tensor]:
        """Divide by the loss scale every gradient of `params` not unscaled yet since the last backward (one fused
        pass); returns the device flag of every gradient unscaled since the last backward (1.0 if any is inf /
        NaN), None if none was. Nothing is read on the host."""
        todo = []
        for p in params:
            grad = p.grad
            if grad is None or self._is_unscaled(p, grad):
                continue
            self._unscaled[id(p)] = (weakref.ref(p), weakref.ref(grad))
            todo.append(grad)
        if todo:
            # on each rank's part of sharded gradients (DTensors of FSDP2 and tensor parallelism, on different meshes,
            # next to plain tensors): unscaling is elementwise, and the engine MAX-reduces the flag across ranks
            found = self.scaler.unscale_and_check(local_shards(todo)).reshape(())
            if self._found_inf is not None:
                found = torch.maximum(self._found_inf, found.to(self._found_inf.device))
            self._found_inf = found
        return self._found_inf

    @torch.no_grad()
    def before_backward(self) -> None:
        """A backward is about to add gradients at the current loss scale: bring the unscaled gradients still
        attached to their parameters back to that scale, then forget them (the next decision unscales them again)."""
        scale = self.scaler.scale
        if scale != 1.0:
            leftover = [grad for grad in local_shards(grad for _, grad in self._live()) if grad.numel()]
            by_dtype: Dict[Tuple[torch.device, torch.dtype], list] = {}
            for grad in leftover:
                by_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
            for group in by_dtype.values():
                torch._foreach_mul_(group, scale)
        self.forget()

    def forget(self) -> None:
        """Forget every gradient (a state was loaded: gradients from before it mean nothing)."""
        self._unscaled.clear()
        self._found_inf = None

    def _is_unscaled(self, p: torch.Tensor, grad: torch.Tensor) -> bool:
        entry = self._unscaled.get(id(p))
        return entry is not None and entry[0]() is p and entry[1]() is grad

    def _live(self):
        for param_ref, grad_ref in self._unscaled.values():
            p, grad = param_ref(), grad_ref()
            if p is not None and grad is not None and p.grad is grad:
                yield p, grad


def iteration_params(model: Optional[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> List[torch.Tensor]:
    """The parameters whose gradients an iteration's backward(s) can have produced: the attached model's and every
    registered optimizer's, each once."""
    seen: set = set()
    params = []
    model_params = list(model.parameters()) if model is not None else []
    for p in model_params + [p for opt in optimizers for group in opt.param_groups for p in group["params"]]:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params
