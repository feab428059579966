"""ScalingStepCloser: closes the scaling step of every FP8 layer of a model at once, with a fixed number of tensor ops.

The engine (engine.py) decides *when* a step ends and whether it was taken; this object does what ending it means for
the scales, for all layers together:

    flags = scales.overflow_flags()         before the skip decision: one device flag per (layer, role), set if its
                                            casts overflowed in the step in progress (nothing read; the engine
                                            reads them with the decision's other flags, `scales.keys` names them)
    scales.close_step(taken=...)            after it: the step's amaxes and overflow / clip flags MAX-reduced
                                            across ranks (one collective), the counters (identical on every rank:
                                            an event on any rank counts on all), and the histories advanced (a
                                            taken step) or left as they were (a rejected one: it leaves no trace in
                                            the scales)

`close_step` stacks every layer's [3, L+1] history into one [layers, 3, L+1] tensor, applies
`numerics.scaling.step_flags` / `advance_history` to it (the same functions a single layer uses), and writes the
results back with `torch._foreach_copy_` / `_foreach_add_`: a fixed number of dispatched ops, whatever the number of
layers. The rules are in lightning_fp8/numerics/scaling.py.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from lightning_fp8.engine.distributed import all_reduce_max_
from lightning_fp8.modules.linear import FP8Layer
from lightning_fp8.numerics.scaling import StepConstants, advance_history, reference_amax, step_flags
from lightning_fp8.recipe import ROLES


class ScalingStepCloser:
    """The scaling states of `layers` ({fqn: FP8 layer}), closed together once per step."""

    def __init__(self, layers: Dict[str, FP8Layer]) -> None:
        self.layers = dict(layers)
        self.keys = [f"{fqn}.{role}" for fqn in self.layers for role in ROLES]
        self._constants_key: Tuple = ()
        self._constants: Optional[StepConstants] = None

    # -- per step -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def overflow_flags(self) -> Optional[torch.Tensor]:
        """One device flag per `keys` entry ("fqn.role"), set if that role's casts overflowed in the step in
        progress (inf / NaN amax, or an unscaled role's saturation), from the open history slots; None without FP8
        layers. Nothing is read on the host."""
        if not self.layers:
            return None
        histories = self._histories()
        _, overflow, _ = step_flags(torch.stack(histories), self._recipe_constants(histories[0].device))
        return overflow.reshape(-1)

    @torch.no_grad()
    def sized_flags(self) -> Optional[torch.Tensor]:
        """One device flag per `keys` entry, set if that role's history sizes a delayed scale (a completed step with a
        non-zero amax: `reference_amax` > 0). Once set it stays so while the history is only advanced (a step
        shifts in a non-zero amax or nothing), so the engine reads these with its decision's flags and tells the
        layers (`learn_sizes`): their delayed casts then skip the amax pre-pass."""
        if not self.layers:
            return None
        stacked = torch.stack(self._histories())
        algo_max = self._recipe_constants(stacked.device).algo_max
        return (reference_amax(stacked, algo_max) > 0).reshape(-1)

    def learn_sizes(self, flags: List[float]) -> None:
        """Tell each layer which of its roles' histories size a delayed scale (`sized_flags`, read on the host)."""
        roles = len(ROLES)
        for i, layer in enumerate(self.layers.values()):
            layer.fp8_meta.history_sized = [bool(f) for f in flags[i * roles : (i + 1) * roles]]

    def forget_sizes(self) -> None:
        """The histories were replaced (a rollback, a load): every delayed cast takes its pre-pass until the next
        decision has read them again."""
        for layer in self.layers.values():
            layer.fp8_meta.forget_sizes()

    @torch.no_grad()
    def close_step(self, taken: bool = True) -> None:
        """End the step for every layer (see the module docstring)."""
        if not self.layers:
            return
        metas = [layer.fp8_meta for layer in self.layers.values()]
        histories = [meta.amax_history for meta in metas]
        stacked = torch.stack(histories)
        constants = self._recipe_constants(stacked.device)
        clean, overflow, clip = step_flags(stacked, constants)
        # one collective: every rank advances with the same amaxes (so every rank has the same scales) and counts
        # the same overflows and clips (an event on any rank counts on all, so their FP8 metadata stays identical)
        events = torch.stack([overflow, clip]).to(torch.float32)
        all_reduce_max_([clean, events])
        overflow, clip = events[0] > 0, events[1] > 0
        advanced = advance_history(stacked, clean, taken)
        torch._foreach_copy_(histories, list(advanced.unbind(0)))
        torch._foreach_add_([m.overflow_count for m in metas], list(overflow.to(torch.int64).unbind(0)))
        torch._foreach_add_([m.clip_count for m in metas], list(clip.to(torch.int64).unbind(0)))

    @torch.no_grad()
    def discard_open_step(self) -> None:
        """Clear the open slot of every history (after a rollback: the restored state is between iterations, and the
        amaxes recorded by the rejected one must leave no trace)."""
        if self.layers:
            for history in self._histories():
                history[:, 0].zero_()

    @torch.no_grad()
    def rescale_gradient_history(self, factor: float) -> None:
        """Multiply the gradient amaxes (the open step's and the completed ones) by `factor`: the loss scale changed by
        it, and so will every gradient's amax; delayed gradient scales then stay sized for the gradients to come."""
        if not self.layers or factor == 1.0:
            return
        rows = [layer.fp8_meta.amax_history[ROLES.index("grad_output")] for layer in self.layers.values()]
        torch._foreach_mul_(rows, factor)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _histories(self) -> List[torch.Tensor]:
        return [layer.fp8_meta.amax_history for layer in self.layers.values()]

    def _recipe_constants(self, device: torch.device) -> StepConstants:
        """Per (layer, role) recipe constants, stacked; rebuilt only when a layer's recipe or device changes."""
        key = tuple((id(layer.fp8_meta.recipe), layer.fp8_meta.recipe_fp8_max.device) for layer in self.layers.values())
        if key != self._constants_key:
            metas = [layer.fp8_meta for layer in self.layers.values()]
            per_layer = [meta.constants() for meta in metas]
            self._constants = StepConstants(*(torch.stack(values).to(device) for values in zip(*per_layer)))
            self._constants_key = key
        return self._constants
