"""BatchNorm running statistics that match the weights they normalise: how far they lag, and re-estimating them.

In train mode a BatchNorm layer normalises with the statistics of the batch in hand; in eval mode with its running
averages (momentum 0.1 by default: mostly the last 10-20 steps). While the weights keep moving, at a constant or
slowly decaying learning rate, the running averages trail the statistics the current weights produce, and eval-mode
accuracy falls below what the same weights score with batch statistics. Measured here (docs/numerics.md, "Eval-mode
quality", 40 seeds each): ResNet-18 on the digits at a constant learning rate scores 95.4 % (bf16-mixed) and 95.2 %
(FP8) in eval mode, 97.6 % for both once the statistics are re-estimated; the lag is a property of BatchNorm at that
learning rate, not of FP8. Re-estimating them from training batches with the current weights, as
`torch.optim.swa_utils.update_bn` does after SWA (a cumulative average, momentum None), removes it.

This module is framework-free: `refresh_batchnorm` takes any iterable of batches; the Lightning callback
`lightning_fp8.callbacks.BatchNormRefresh` runs it before validation, before checkpoints and at the end of fit, and
logs the lag `watch_batchnorm_lag` measures while training.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

#: forward(model, batch): runs the model on one batch (its result is ignored)
BatchForward = Callable[[nn.Module, Any], Any]


def batchnorm_layers(model: nn.Module) -> Dict[str, _BatchNorm]:
    """The BatchNorm layers (1d/2d/3d, SyncBatchNorm, lazy ones once materialised) that keep running statistics,
    by qualified name. Layers built with `track_running_stats=False` always use batch statistics and are left out."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
            and not is_lazy(m.running_mean)}


def mean_shift(running_mean: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> float:
    """How far `running_mean` is from `mean`, in units of the standard deviation `var` ** 0.5: the mean over
    channels of (running_mean - mean)^2 / (var + eps). 0.01 moves a normalised channel by 0.1 standard deviations on
    average; on the ResNet-18 of docs/numerics.md eval-mode accuracy dips where it reaches a few hundredths."""
    diff = running_mean.float() - mean.float()
    return float((diff * diff / (var.float() + eps)).mean())


def _batch_moments(layer: _BatchNorm, x: torch.Tensor):
    dims = [0] + list(range(2, x.dim()))
    x = x.detach().float()
    return x.mean(dim=dims), x.var(dim=dims, unbiased=False)


@contextlib.contextmanager
def watch_batchnorm_lag(model: nn.Module) -> Iterator[Dict[str, float]]:
    """Within the block, each train-mode forward of a BatchNorm layer records its lag into the yielded dict: the
    `mean_shift` of its running mean (as it was before this batch updated it) from this batch's mean, in this
    batch's standard deviations. Eval-mode forwards record nothing. The cost is one mean and variance per layer and
    forward, only inside the block."""
    lag: Dict[str, float] = {}
    handles = []

    def hook_for(name: str):
        def hook(layer: _BatchNorm, args) -> None:
            if layer.training and args and isinstance(args[0], torch.Tensor):
                mean, var = _batch_moments(layer, args[0])
                lag[name] = mean_shift(layer.running_mean, mean, var, layer.eps)

        return hook

    for name, layer in batchnorm_layers(model).items():
        handles.append(layer.register_forward_pre_hook(hook_for(name)))
    try:
        yield lag
    finally:
        for handle in handles:
            handle.remove()


def default_forward(model: nn.Module, batch: Any) -> Any:
    """`model(batch)` for a tensor, `model(batch[0])` for a tuple or list (inputs first, as
    torch.optim.swa_utils.update_bn assumes), `model(**batch)` for a mapping (a transformers batch)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


@dataclass(frozen=True)
class BatchNormRefreshResult:
    """What `refresh_batchnorm` did: the batches it averaged over and, per layer, the `mean_shift` of the old running
    mean from the re-estimated one (in the re-estimated standard deviations): how far eval mode was off."""

    batches: int
    shift: Dict[str, float] = field(default_factory=dict)

    @property
    def worst(self) -> Optional[str]:
        """The layer whose running statistics were furthest off, or None without BatchNorm layers."""
        return max(self.shift, key=self.shift.get) if self.shift else None


def refresh_batchnorm(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Optional[BatchForward] = None,
    context: Callable[[], ContextManager] = contextlib.nullcontext,
    layers: Optional[Iterable[str]] = None,
) -> BatchNormRefreshResult:
    """Re-estimate every BatchNorm layer's running mean and variance from `batches` with the current weights.

    Each layer's statistics are reset and recomputed as the cumulative average over the batches (momentum None:
    each batch weighs the same), as torch.optim.swa_utils.update_bn does, the BatchNorm layers normalising with
    batch statistics meanwhile; unlike update_bn, every other module runs in eval mode (dropout off, FP8 layers
    casting with their scales without recording amaxes), so the inputs are those eval mode feeds the layers. Train /
    eval modes and momenta are restored afterwards; runs under torch.no_grad.

    Args:
        model: the model (its BatchNorm layers are found by `batchnorm_layers`).
        batches: an iterable of batches already on the model's device (e.g. `itertools.islice(loader, 200)`).
        forward: runs the model on a batch; default `default_forward`.
        context: a factory of the context each forward runs in, e.g. the precision's autocast
            (`accelerator.autocast`, a Lightning precision plugin's `forward_context`), so the statistics are those
            of the precision eval runs in.
        layers: names of the BatchNorm layers to refresh (default: all); the others keep their statistics and
            normalise with them during the pass (eval mode), as a frozen layer does in training.

    Returns the BatchNormRefreshResult. Raises ValueError when `batches` is empty (the old statistics are kept).
    """
    found = batchnorm_layers(model)
    chosen = found if layers is None else {name: found[name] for name in layers if name in found}
    if not chosen:
        return BatchNormRefreshResult(0)
    forward = forward or default_forward
    old = {name: (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
           for name, m in chosen.items()}
    modes = {m: m.training for m in model.modules()}
    momenta = {m: m.momentum for m in chosen.values()}
    n = 0
    done = False
    try:
        model.eval()
        for m in chosen.values():
            m.reset_running_stats()
            m.momentum = None
            m.train()
        with torch.no_grad():
            for batch in batches:
                with context():
                    forward(model, batch)
                n += 1
        if n == 0:
            raise ValueError("refresh_batchnorm: no batches to estimate the BatchNorm statistics from; the old ones "
                             "are kept")
        done = True
    finally:
        for m, training in modes.items():
            m.training = training
        for m, momentum in momenta.items():
            m.momentum = momentum
        if not done:
            for name, m in chosen.items():
                for buffer, saved in zip((m.running_mean, m.running_var, m.num_batches_tracked), old[name]):
                    buffer.copy_(saved)
    shift = {name: mean_shift(old[name][0], m.running_mean, m.running_var, m.eps) for name, m in chosen.items()}
    return BatchNormRefreshResult(n, shift)
