"""The rules FP8LayerFallback decides with: thresholds, patience counters, and where an anomaly starts.

`FallbackRules` turns one step's observations (overflow ratios, bad statistics, non-finite origins; already combined
across ranks) into decisions "move this layer, for this reason"; the callback applies them. It holds no Lightning
code, so the rules can be read and tested on their own.

Values flow forward through the layers (and gradients backward), so one bad layer makes the layers after it overflow
in the same step. `AnomalyOrigins` groups anomalies into episodes per (layer, role); all episodes that start in the
same step are attributed to one origin: the first layer in forward execution order with an input or weight anomaly,
or, when only gradients are anomalous, the last layer in forward order (the first the backward pass reaches). An
episode inherited from an origin stays attributed to it for as long as it lasts, so the layers downstream of a failing
layer are not moved for its failure.

`NonFiniteOriginProbe` finds the layers whose input and weight are finite but whose output is not: forward hooks
installed for one step after the engine saw a non-finite amax.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Set, Tuple

import torch

from lightning_fp8.modules.linear import FP8Linear

Key = Tuple[str, str]  # (layer fqn, role)


class AnomalyOrigins:
    """Episode bookkeeping per kind of anomaly (e.g. "overflow", "stats"); see the module docstring."""

    def __init__(self, kinds: Iterable[str]) -> None:
        self._episodes: Dict[str, Dict[Key, str]] = {kind: {} for kind in kinds}

    def attribute(self, kind: str, anomalies: Set[Key], order: Dict[str, int]) -> Dict[str, Set[str]]:
        """Record this step's anomalies of one kind; return {origin fqn: its own anomalous roles} for the layers
        credited with an anomaly this step. `order`: forward execution position of each layer."""
        previous = self._episodes[kind]
        current: Dict[Key, str] = {key: previous[key] for key in anomalies if key in previous}
        new = [key for key in anomalies if key not in previous]
        if new:
            # the step's origin: the first layer (forward order) with an input / weight anomaly, new or ongoing (a
            # clipping cast delays what the next layer sees by a step, so a downstream episode can start a step
            # after the upstream one); only gradients anomalous: the first layer the backward pass reaches
            forward = [key for key in anomalies if key[1] != "grad_output"]
            if forward:
                first = min(forward, key=lambda k: order.get(k[0], len(order)))
            else:
                first = max(anomalies, key=lambda k: order.get(k[0], -1))
            origin = current.get(first, first[0])  # an ongoing episode passes on its own origin
            for key in new:
                current[key] = origin
        self._episodes[kind] = current
        credited: Dict[str, Set[str]] = {}
        for (fqn, role), origin in current.items():
            if fqn == origin:
                credited.setdefault(fqn, set()).add(role)
        return credited

    def origin(self, kind: str, key: Key) -> Optional[str]:
        """The layer an ongoing anomaly of (layer, role) is attributed to (None: no ongoing anomaly)."""
        return self._episodes[kind].get(key)

    def forget(self, fqn: str) -> None:
        """Drop every episode of, or attributed to, a layer (it starts afresh, e.g. when retried in FP8)."""
        for kind, episodes in self._episodes.items():
            self._episodes[kind] = {k: v for k, v in episodes.items() if k[0] != fqn and v != fqn}


class FallbackRules:
    """Thresholds and per-layer patience counters of the overflow, precision and non-finite rules (documented on
    FP8LayerFallback)."""

    def __init__(
        self,
        overflow_factor: float,
        overflow_patience: int,
        overflow_window: int,
        min_sqnr_db: Optional[float],
        max_underflow: Optional[float],
        stats_patience: int,
        nonfinite_patience: int,
    ) -> None:
        for name, value in (
            ("overflow_patience", overflow_patience),
            ("overflow_window", overflow_window),
            ("stats_patience", stats_patience),
            ("nonfinite_patience", nonfinite_patience),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if overflow_patience > overflow_window:
            raise ValueError(f"overflow_patience ({overflow_patience}) cannot exceed overflow_window ({overflow_window})")
        if not overflow_factor >= 1.0:
            raise ValueError(f"overflow_factor must be >= 1, got {overflow_factor!r}")
        if max_underflow is not None and not 0.0 < max_underflow <= 1.0:
            raise ValueError(f"max_underflow must be in (0, 1] or None, got {max_underflow!r}")
        self.overflow_factor = float(overflow_factor)
        self.overflow_patience = overflow_patience
        self.overflow_window = overflow_window
        self.min_sqnr_db = min_sqnr_db
        self.max_underflow = max_underflow
        self.stats_patience = stats_patience
        self.nonfinite_patience = nonfinite_patience
        self.origins = AnomalyOrigins(("overflow", "stats"))
        self.overflow_hits: Dict[str, Deque[int]] = {}
        self.stats_streak: Dict[str, int] = {}
        self.nonfinite_hits: Dict[str, int] = {}

    def bad_stats(self, role: str, stats: Dict[str, float]) -> Optional[str]:
        """Why one role's sampled statistics are out of bounds (None: they are fine)."""
        sqnr = stats["sqnr_db"]
        if self.min_sqnr_db is not None and sqnr == sqnr and sqnr < self.min_sqnr_db:  # NaN (no signal) is not bad
            return f"quantization SQNR of {role} {sqnr:.1f} dB below {self.min_sqnr_db:g} dB"
        under = stats["underflow"]
        if self.max_underflow is not None and under > self.max_underflow:
            return f"{under:.0%} of the non-zero {role} values flushed to zero (limit {self.max_underflow:.0%})"
        return None

    def overflow_decisions(
        self, step: int, overflow: Dict[Key, float], enabled: Set[str], order: Dict[str, int]
    ) -> List[Tuple[str, List[str], str]]:
        """overflow: {(fqn, role): amax / range ratio} of the keys beyond `overflow_factor` this step. Returns
        (fqn, roles, reason) for each layer to move."""
        credited = self.origins.attribute("overflow", set(overflow), order)
        for hits in self.overflow_hits.values():
            while hits and hits[0] <= step - self.overflow_window:
                hits.popleft()
        decisions = []
        for fqn, roles in credited.items():
            hits = self.overflow_hits.setdefault(fqn, deque())
            hits.append(step)
            if len(hits) >= self.overflow_patience and fqn in enabled:
                worst = max(roles, key=lambda r: overflow[(fqn, r)])
                reason = (
                    f"FP8 overflow originated here in {len(hits)} of the last {self.overflow_window} steps "
                    f"({', '.join(sorted(roles))}: amax up to {overflow[(fqn, worst)]:.3g}x the range of the cast's "
                    f"scale, values clipped; step {step})"
                )
                decisions.append((fqn, sorted(roles), reason))
        return decisions

    def stats_decisions(
        self, step: int, bad: Dict[Key, str], checked: Set[str], order: Dict[str, int]
    ) -> List[Tuple[str, str, List[str], str]]:
        """bad: {(fqn, role): why} of this check's out-of-bounds statistics; checked: the enabled layers the check
        sampled. Returns (fqn, rule, roles, reason) for each layer to move."""
        credited = self.origins.attribute("stats", set(bad), order)
        decisions = []
        for fqn in checked:
            self.stats_streak[fqn] = self.stats_streak.get(fqn, 0) + 1 if fqn in credited else 0
            if self.stats_streak[fqn] >= self.stats_patience:
                roles = sorted(credited[fqn])
                details = "; ".join(bad.get((fqn, r), f"{r} out of bounds") for r in roles)
                reason = f"{details} in {self.stats_streak[fqn]} consecutive checks (step {step})"
                rule = "sqnr" if "SQNR" in details else "underflow"
                decisions.append((fqn, rule, roles, reason))
        return decisions

    def nonfinite_decisions(self, step: int, originated: Set[str]) -> List[Tuple[str, str]]:
        """originated: layers in which a non-finite value started this step. Returns (fqn, reason) to move."""
        decisions = []
        for fqn in originated:
            self.nonfinite_hits[fqn] = self.nonfinite_hits.get(fqn, 0) + 1
            if self.nonfinite_hits[fqn] >= self.nonfinite_patience:
                reason = (
                    f"non-finite output from finite input and weight in {self.nonfinite_hits[fqn]} steps "
                    f"(the non-finite value originates in this layer; step {step})"
                )
                decisions.append((fqn, reason))
        return decisions

    def forget(self, fqn: str, episodes: bool = True) -> None:
        """Reset a layer's counters (it moved), and with `episodes` its anomaly episodes (it is retried in FP8)."""
        self.overflow_hits.pop(fqn, None)
        self.stats_streak.pop(fqn, None)
        self.nonfinite_hits.pop(fqn, None)
        if episodes:
            self.origins.forget(fqn)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "overflow_hits": {fqn: list(hits) for fqn, hits in self.overflow_hits.items()},
            "stats_streak": dict(self.stats_streak),
            "nonfinite_hits": dict(self.nonfinite_hits),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.overflow_hits = {fqn: deque(hits) for fqn, hits in state.get("overflow_hits", {}).items()}
        self.stats_streak = dict(state.get("stats_streak", {}))
        self.nonfinite_hits = dict(state.get("nonfinite_hits", {}))


class NonFiniteOriginProbe:
    """Forward hooks that record, per FP8 layer, whether input, weight and output were finite (on device; read once
    per step)."""

    def __init__(self) -> None:
        self._hooks: List[Any] = []
        self._flags: Dict[str, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def install(self, layers: Dict[str, FP8Linear]) -> None:
        self.remove()

        def hook_for(fqn: str):
            def hook(module, args, output):
                if not module.fp8_enabled or not args or not isinstance(output, torch.Tensor):
                    return
                with torch.no_grad():
                    flags = (
                        torch.isfinite(args[0]).all().reshape(1),
                        torch.isfinite(module.weight).all().reshape(1),
                        torch.isfinite(output).all().reshape(1),
                    )
                previous = self._flags.get(fqn)
                if previous is not None:  # several calls in a step: any call that originates counts
                    flags = tuple(torch.cat([p, f.to(p.device)]) for p, f in zip(previous, flags))
                self._flags[fqn] = flags

            return hook

        for fqn, layer in layers.items():
            if layer.fp8_enabled:
                self._hooks.append(layer.register_forward_hook(hook_for(fqn)))

    def originated_in(self, fqn: str) -> bool:
        """True when a call of the layer turned finite input and weight into a non-finite output."""
        flags = self._flags.get(fqn)
        if flags is None:
            return False
        inp, weight, out = (f.cpu() for f in flags)
        return bool((inp & weight & ~out).any())

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._flags = {}
