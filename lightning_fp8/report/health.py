"""What is healthy, near a threshold or beyond it: the report's colours and its "what needs attention" list, anchored
to FP8LayerFallback's own thresholds as the run recorded them (the history's run header).

Three rules, one per health map:

overflow   range ratio r = amax x scale / format max (1: the tensor fills the FP8 range; above 1 values were
           clipped). Beyond: r > overflow_factor, the point where FP8LayerFallback counts an overflow.
precision  quantization SQNR (dB). Beyond: below min_sqnr_db.
underflow  fraction of non-zero values flushed to zero. Beyond: above max_underflow (FP8LayerFallback's flush-to-zero
           rule; off by default, then underflow is shown for information and never as a problem).

Levels, the same for each rule: "ok" (r <= 1 / SQNR 10 dB or more above the floor / nothing flushed), "tolerated"
(inside the threshold by more than a factor 2), "near" (within a factor 2 of the threshold: r > factor / 2, SQNR
less than 3 dB above the floor, underflow above half the limit), "beyond", "far" (beyond by more than a factor 4:
r > 4 x factor, SQNR 6 dB below the floor, underflow above 4 x the limit), "nonfinite" (inf / NaN amax), "info"
(the rule is off in this run) and "nodata". A factor 2 is 3 dB for the SQNR, a power ratio.

Attention list: every tensor that went beyond a threshold (its sampled statistics, and the per-step overflow events
between samples), every fallback and escalation, one item per step the engine skipped or rolled back or saw a
non-finite amax in (naming the tensors in the order the anomaly spreads: inputs and weights in model order, then
gradients in reverse), and every tensor whose latest sample is near a threshold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from lightning_fp8.report.history import ROLES, RunHistory, TensorMark, to_float

LEVELS = ("ok", "tolerated", "near", "beyond", "far", "nonfinite", "info", "nodata")
PROBLEM_LEVELS = ("beyond", "far", "nonfinite")
RULES = {"overflow": "range_ratio", "precision": "sqnr_db", "underflow": "underflow"}
ROLE_NAMES = {"input": "input", "weight": "weight", "grad_output": "gradient"}


@dataclass
class Thresholds:
    """FP8LayerFallback's thresholds (None: that rule is off or was not recorded)."""

    overflow_factor: Optional[float]
    min_sqnr_db: Optional[float]
    max_underflow: Optional[float]
    source: str

    @classmethod
    def of(cls, history: RunHistory) -> "Thresholds":
        recorded = history.thresholds
        if recorded is None:
            return cls(None, None, None, "not recorded (history written by an older version): colours are not anchored")

        def number(name: str) -> Optional[float]:
            value = recorded.get(name)
            return None if value is None else float(value)

        return cls(number("overflow_factor"), number("min_sqnr_db"), number("max_underflow"), str(recorded.get("source", "")))

    def describe(self, rule: str) -> str:
        if rule == "overflow":
            return f"overflow_factor {self.overflow_factor:g}x" if self.overflow_factor else "overflow rule not recorded"
        if rule == "precision":
            return f"min_sqnr_db {self.min_sqnr_db:g} dB" if self.min_sqnr_db is not None else "SQNR rule off"
        return f"max_underflow {self.max_underflow:.3g}" if self.max_underflow is not None else "flush-to-zero rule off"


def level(rule: str, value: Optional[float], t: Thresholds) -> str:
    """The level of one value under one rule (see the module docstring)."""
    if value is None or (isinstance(value, float) and math.isnan(value) and rule != "overflow"):
        return "nodata"
    if rule == "overflow":
        if not math.isfinite(value):
            return "nonfinite"
        if t.overflow_factor is None:
            return "info"
        f = t.overflow_factor
        return "ok" if value <= 1 else "tolerated" if value <= f / 2 else "near" if value <= f else "beyond" if value <= 4 * f else "far"
    if rule == "precision":
        if t.min_sqnr_db is None:
            return "info"
        margin = value - t.min_sqnr_db  # +inf: exact
        return "ok" if margin >= 10 else "tolerated" if margin >= 3 else "near" if margin >= 0 else "beyond" if margin >= -6 else "far"
    if t.max_underflow is None:
        return "ok" if value == 0 else "info"
    u = t.max_underflow
    return "ok" if value == 0 else "tolerated" if value <= u / 2 else "near" if value <= u else "beyond" if value <= 4 * u else "far"


def describe_value(rule: str, value: float) -> str:
    if rule == "overflow":
        return f"amax {value:.3g}x the cast's range" if math.isfinite(value) else "non-finite amax"
    if rule == "precision":
        return f"SQNR {value:.1f} dB"
    return f"{value:.3g} of the non-zero values flushed to zero"


def describe_worst(rule: str, value: float) -> str:
    if rule == "overflow":
        return f"amax up to {value:.3g}x the cast's range"
    if rule == "precision":
        return f"SQNR down to {value:.1f} dB"
    return f"up to {value:.3g} of the non-zero values flushed to zero"


@dataclass
class AttentionItem:
    """One line of the attention list."""

    severity: str  # "problem" | "near" | "event"
    text: str
    layer: Optional[str] = None
    role: Optional[str] = None
    rule: Optional[str] = None
    steps: List[int] = field(default_factory=list)


def _steps_text(steps: List[int], limit: int = 8) -> str:
    """Steps as ranges: "4-6, 9"."""
    steps = sorted(set(steps))
    parts: List[str] = []
    start = prev = steps[0]
    for s in steps[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    shown = ", ".join(parts[:limit]) + (f", ... ({len(steps)} steps)" if len(parts) > limit else "")
    return ("step " if len(steps) == 1 else "steps ") + shown


def _forward_first(tensors, order: Dict[str, int]) -> List[Tuple[str, str]]:
    """Tensors in the order an anomaly spreads: inputs and weights in model order, then gradients in reverse."""
    forward = sorted((t for t in tensors if t[1] != "grad_output"), key=lambda t: (order.get(t[0], len(order)), t[1]))
    backward = sorted((t for t in tensors if t[1] == "grad_output"), key=lambda t: -order.get(t[0], -1))
    return forward + backward


def attention(history: RunHistory, t: Thresholds, label: Callable[[str], str] = str) -> List[AttentionItem]:
    """The "what needs attention" list (see the module docstring), problems first. `label` shortens layer names."""
    order = {fqn: i for i, fqn in enumerate(history.layers)}
    beyond: Dict[Tuple[str, str, str], Dict[str, Any]] = {}
    nonfinite: Dict[int, Set[Tuple[str, str]]] = {}  # step -> tensors with a non-finite amax

    def note(layer: str, role: str, rule: str, step: int, value: float, origin: Optional[str] = None) -> None:
        if rule == "overflow" and not math.isfinite(value):
            nonfinite.setdefault(step, set()).add((layer, role))
            return
        entry = beyond.setdefault((layer, role, rule), {"steps": [], "worst": value, "origins": set()})
        entry["steps"].append(step)
        if (value < entry["worst"]) if rule == "precision" else (value > entry["worst"]):
            entry["worst"] = value
        if origin and origin != layer:
            entry["origins"].add(origin)

    for step, layers in history.stats:
        for fqn, roles in layers.items():
            for role in ROLES:
                stats = roles.get(role) if isinstance(roles, dict) else None
                for rule, stat in RULES.items():
                    if isinstance(stats, dict) and stat in stats and level(rule, to_float(stats[stat]), t) in PROBLEM_LEVELS:
                        note(fqn, role, rule, step, to_float(stats[stat]))
    for mark in history.tensor_marks():
        value = mark.ratio if mark.kind == "overflow" and mark.ratio is not None else math.inf
        note(mark.layer, mark.role or "?", "overflow", mark.step, value, mark.origin)

    items: List[AttentionItem] = []
    for (layer, role, rule), entry in beyond.items():
        text = f"{describe_worst(rule, entry['worst'])} at {_steps_text(entry['steps'])} (threshold: {t.describe(rule)})"
        if entry["origins"]:
            text += f"; FP8LayerFallback attributes it to {', '.join(label(o) for o in sorted(entry['origins']))}"
        items.append(AttentionItem("problem", text, layer, role, rule, sorted(set(entry["steps"]))))

    # the engine's view of a step (skip, rollback, non-finite amaxes) is one item per step
    engine_steps: Dict[int, List[str]] = {}
    for e in history.events:
        kind, step = e.get("kind"), int(e.get("step", 0))
        if kind == "skip":
            engine_steps.setdefault(step, []).append(f"skipped ({str(e.get('reason', '')).split(' in ')[0]})")
        elif kind == "rollback":
            engine_steps.setdefault(step, []).append(
                f"rolled back to the snapshot of step {e.get('restored_to_step')} ({e.get('reason', '')})")
        elif kind == "fallback":
            for layer in e.get("layers", []):
                roles = [r for r in e.get("roles", []) if r in ROLES] or [None]
                items.append(AttentionItem("problem", f"moved to BF16 at step {step}: {e.get('reason', '')}", layer,
                                           roles[0], "fallback", [step]))
        elif kind == "escalate":
            for layer in e.get("layers", []):
                items.append(AttentionItem("event", f"escalated to {e.get('scaling', 'a finer scaling')} scaling at step "
                                           f"{step}: {e.get('reason', '')}", layer, None, "escalate", [step]))
    for step in sorted(set(engine_steps) | set(nonfinite)):
        parts = list(engine_steps.get(step, []))
        tensors = _forward_first(nonfinite.get(step, ()), order)
        layer = role = None
        if tensors:
            layer, role = tensors[0]
            names = ", ".join(f"{label(f)} {ROLE_NAMES.get(r, r)}" for f, r in tensors[:4])
            more = f" and {len(tensors) - 4} more" if len(tensors) > 4 else ""
            parts.append(f"non-finite amax in {len(tensors)} tensor(s), first in forward order: {names}{more}")
        items.append(AttentionItem("problem", f"step {step}: " + "; ".join(parts), layer, role, "engine", [step]))

    flagged = {(i.layer, i.role) for i in items if i.layer}
    latest: Dict[Tuple[str, str], Tuple[int, Dict[str, Any]]] = {}
    for step, layers in history.stats:
        for fqn, roles in layers.items():
            for role in ROLES:
                if isinstance(roles, dict) and isinstance(roles.get(role), dict):
                    latest[(fqn, role)] = (step, roles[role])
    for (fqn, role), (step, stats) in latest.items():
        for rule, stat in RULES.items():
            if (fqn, role) not in flagged and stat in stats and level(rule, to_float(stats[stat]), t) == "near":
                items.append(AttentionItem(
                    "near", f"{describe_value(rule, to_float(stats[stat]))} at the latest sample (step {step}), within a "
                    f"factor 2 of the threshold ({t.describe(rule)})", fqn, role, rule, [step]))
    rank = {"problem": 0, "event": 1, "near": 2}
    items.sort(key=lambda i: (rank[i.severity], i.steps[0] if i.steps else 0, order.get(i.layer or "", -1), i.role or ""))
    return items


def mark_level(mark: TensorMark, t: Thresholds) -> str:
    if mark.kind == "nonfinite" or mark.ratio is None:
        return "nonfinite"
    return level("overflow", mark.ratio, t)
