"""Rollback snapshots: the last known-good training state, kept in host memory.

A snapshot holds everything a step can change: model parameters and buffers, every layer's FP8 scaling state
(`fp8_state_dict`, which the model's state_dict leaves out), each optimizer's state, and the engine's own state (loss
scaler). Restoring copies values back into the live tensors in place, so optimizer references to Parameters stay
valid.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
from torch import nn

from lightning_fp8.conversion.state import fp8_state_dict


def _to_host(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


class Snapshot:
    def __init__(self, step: int, model: nn.Module, optimizers: List[torch.optim.Optimizer], extra: Dict[str, Any]):
        self.step = step
        self.model_state = _to_host(model.state_dict())
        self.fp8_state = _to_host(fp8_state_dict(model))  # FP8 metadata is not in the model's state_dict
        self.optimizer_states = [_to_host(opt.state_dict()) for opt in optimizers]
        self.extra = copy.deepcopy(extra)

    @torch.no_grad()
    def restore(self, model: nn.Module, optimizers: List[torch.optim.Optimizer]) -> Dict[str, Any]:
        live = model.state_dict()
        for key, value in self.model_state.items():
            live[key].copy_(value)
        live_fp8 = fp8_state_dict(model)
        for key, value in self.fp8_state.items():
            live_fp8[key].copy_(value)
        for module in model.modules():  # buffers written in place: python-side mirrors must follow
            sync = getattr(module, "sync_precision_flag", None)
            if callable(sync):
                sync()
        for opt, state in zip(optimizers, self.optimizer_states):
            opt.load_state_dict(copy.deepcopy(state))
        return copy.deepcopy(self.extra)
