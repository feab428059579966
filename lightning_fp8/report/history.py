"""Reading `fp8_history.jsonl`, the per-layer history FP8ScaleMonitor / FP8LayerFallback / FP8Calibration write.

Format (JSON lines, one object per line, appended in time order; a resumed run appends to the same file when it
logs to the same directory). Every object has a "type":

    {"type": "run", "version": 2, "started": ISO time, "step": N, "resumed": bool, "log_every_n_steps": n,
     "sample_size": n, "recipe": {...FP8Recipe.to_dict()...} | null, "world_size": n,
     "thresholds": {"source": str, "overflow_factor": x, "min_sqnr_db": x | null, "max_underflow": x | null}}
    {"type": "precision_map", "step": N, "layers": [{"fqn": ..., "precision": "fp8" | "bf16", "reason": ...}]}
    {"type": "stats", "step": N, "logger_step": n, "loss_scale": x, "step_time_s": x | null, "timed_steps": n,
     "layers": {fqn: {"enabled": bool,
         "input" | "weight" | "grad_output": {"scale", "amax", "range_ratio", "overflow", "underflow", "sqnr_db",
                                               "clipped_casts", "nonfinite_casts"}}}}
    {"type": "event", "source": "engine" | "fallback" | "calibration", "step": N, "kind": ..., "reason": str,
     "layers": [...], ...}

Event kinds: "skip" and "rollback" (engine; a rollback has "restored_to_step"), "nonfinite" (engine: the tensors whose
amax was inf/NaN after a step), "saturation" (engine: roles cast without a scale, FP8Recipe(scale_gradients=False),
whose finite amax went beyond the format's max, with "amax" and "ratio": the loss scaler's overflow; listed, not marked
as a layer problem), "overflow" (FP8LayerFallback: tensors beyond its overflow_factor in a step, with
"ratio" and "origin"), "fallback", "retry", "keep_bf16", "escalate" (layer state changes), "calibration".

Per-tensor events carry "tensors": [{"layer": fqn, "role": "input" | "weight" | "grad_output", ...}]; the report marks
each at its exact step in that layer's row. Events that change a layer's state carry "layers" and may carry the new
state: "precision" ("fp8" | "bf16") and "scaling" (e.g. the finer scaling an "escalate" moves a layer to); without
them the kind decides (fallback, keep_bf16: BF16; retry, escalate: FP8). The report shows the state from that step on.

"step" is the number of optimizer steps completed (the engine's step count); "logger_step" is the step Lightning's
loggers use for the same batch, which maps the rows of the logger's output (metrics.csv) onto that axis. Non-finite
numbers are written as the strings "nan", "inf", "-inf". Unknown types and fields are ignored, so the format can grow;
version 1 files (no thresholds, no range_ratio) still load.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from lightning_fp8.callbacks.history_file import HISTORY_FILENAME

ROLES = ("input", "weight", "grad_output")
#: event kinds that change a layer's state, and the precision each implies when the event does not say
STATE_KINDS = {"fallback": "bf16", "keep_bf16": "bf16", "retry": "fp8", "escalate": "fp8"}


def to_float(value: Any) -> float:
    """Numbers and the "nan" / "inf" strings of the history as floats; anything else is NaN."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


@dataclass
class TensorMark:
    """One per-tensor event at its exact step (an overflow beyond the threshold, a non-finite amax)."""

    step: int
    layer: str
    role: Optional[str]
    kind: str  # "overflow" | "nonfinite"
    ratio: Optional[float] = None
    origin: Optional[str] = None
    skipped: Optional[bool] = None


@dataclass
class LayerState:
    """A layer's state from `step` on: precision "fp8" / "bf16", the scaling when it changed, and why."""

    step: int
    precision: str
    kind: str
    scaling: Optional[str] = None
    reason: str = ""


@dataclass
class RunHistory:
    path: str
    runs: List[Dict[str, Any]] = field(default_factory=list)
    #: the latest precision map (list of {"fqn", "precision", "reason"}) and the first one
    precision_map: List[Dict[str, str]] = field(default_factory=list)
    initial_precision_map: List[Dict[str, str]] = field(default_factory=list)
    #: step -> fqn -> role -> stat -> float ; plus fqn -> "enabled"
    stats: List[Tuple[int, Dict[str, Dict[str, Any]]]] = field(default_factory=list)
    #: the stats records' other fields: step, logger_step, loss_scale, step_time_s, timed_steps
    samples: List[Dict[str, Any]] = field(default_factory=list)
    events: List[Dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0

    @property
    def steps(self) -> List[int]:
        return [step for step, _ in self.stats]

    @property
    def thresholds(self) -> Optional[Dict[str, Any]]:
        """FP8LayerFallback's thresholds as the newest run header recorded them (None: not recorded)."""
        for run in reversed(self.runs):
            if isinstance(run.get("thresholds"), dict):
                return run["thresholds"]
        return None

    @property
    def layers(self) -> List[str]:
        """Every layer seen: precision map order first, then any other layer with statistics."""
        names = [row["fqn"] for row in self.precision_map]
        for _, layers in self.stats:
            for fqn in layers:
                if fqn not in names:
                    names.append(fqn)
        return names

    @property
    def fp8_layers(self) -> List[str]:
        """Layers that ever had FP8 statistics or are FP8 in the precision map."""
        names = []
        for _, layers in self.stats:
            for fqn in layers:
                if fqn not in names:
                    names.append(fqn)
        for row in self.precision_map:
            if row["precision"] == "fp8" and row["fqn"] not in names:
                names.append(row["fqn"])
        order = {fqn: i for i, fqn in enumerate(self.layers)}
        return sorted(names, key=lambda f: order.get(f, len(order)))

    def series(self, fqn: str, role: str, stat: str) -> List[Tuple[int, float]]:
        out = []
        for step, layers in self.stats:
            value = layers.get(fqn, {}).get(role, {}).get(stat)
            if value is not None:
                out.append((step, to_float(value)))
        return out

    @property
    def last_step(self) -> int:
        steps = [s for s, _ in self.stats] + [int(e.get("step", 0)) for e in self.events]
        return max(steps) if steps else 0

    def fallback_step(self, fqn: str) -> Optional[int]:
        """Step of the latest fallback / keep_bf16 event of a layer (None if none)."""
        steps = [int(e["step"]) for e in self.events if e.get("kind") in ("fallback", "keep_bf16") and fqn in e.get("layers", [])]
        return steps[-1] if steps else None

    # -- per-tensor events and layer states ------------------------------------------------------------------
    def tensor_marks(self) -> List[TensorMark]:
        """Every per-tensor event at its step: the "tensors" of nonfinite / overflow events, and the "fqn.role"
        names of engine skips written before the monitor recorded tensors (deduplicated)."""
        marks: List[TensorMark] = []
        seen = set()
        for e in self.events:
            kind = e.get("kind")
            step = int(e.get("step", 0))
            if kind == "saturation":  # an unscaled role beyond the format's max: the loss scaler's overflow, not a
                for t in e.get("tensors", []):  # non-finite amax (the skip's names below must not say it is)
                    if isinstance(t, dict) and "layer" in t:
                        seen.add((step, t["layer"], t.get("role"), "nonfinite"))
                continue
            if kind in ("nonfinite", "overflow"):
                for t in e.get("tensors", []):
                    if not isinstance(t, dict) or "layer" not in t:
                        continue
                    key = (step, t["layer"], t.get("role"), kind)
                    if key not in seen:
                        seen.add(key)
                        ratio = to_float(t["ratio"]) if "ratio" in t else None
                        marks.append(TensorMark(step, t["layer"], t.get("role"), kind, ratio, t.get("origin"), e.get("skipped")))
        known = set(self.layers)
        for e in self.events:
            if e.get("kind") != "skip" or not str(e.get("reason", "")).startswith("FP8 amax overflow"):
                continue
            step = int(e.get("step", 0))
            for name in e.get("layers", []):
                fqn, _, role = str(name).rpartition(".")
                if role in ROLES and fqn in known and (step, fqn, role, "nonfinite") not in seen:
                    seen.add((step, fqn, role, "nonfinite"))
                    marks.append(TensorMark(step, fqn, role, "nonfinite", skipped=True))
        return sorted(marks, key=lambda m: (m.step, m.layer, m.role or ""))

    def layer_states(self, fqn: str) -> List[LayerState]:
        """The layer's states in step order: the first precision map's, then one per state-changing event."""
        states: List[LayerState] = []
        for row in self.initial_precision_map:
            if row.get("fqn") == fqn:
                states.append(LayerState(0, str(row.get("precision", "fp8")), "start", None, str(row.get("reason", ""))))
        for e in self.events:
            kind = e.get("kind")
            if fqn not in e.get("layers", []) or (kind not in STATE_KINDS and "precision" not in e and "scaling" not in e):
                continue
            precision = str(e.get("precision") or STATE_KINDS.get(kind, "fp8"))
            scaling = e.get("scaling")
            states.append(LayerState(int(e.get("step", 0)), precision, str(kind), str(scaling) if scaling else None,
                                     str(e.get("reason") or "")))
        return states

    # -- the logger's step axis --------------------------------------------------------------------------------
    def step_of_logger_step(self, logger_step: float) -> float:
        """Map a logger step (a row of metrics.csv) onto the optimizer-step axis of the history, from the
        (logger_step, step) pairs of the stats records: linear between them, their nearest offset outside.
        Without pairs: logger step + 1 (Lightning logs a batch before counting its optimizer step)."""
        pairs = sorted({(int(s["logger_step"]), int(s["step"])) for s in self.samples if "logger_step" in s})
        if not pairs:
            return logger_step + 1
        xs = [p[0] for p in pairs]
        i = bisect.bisect_left(xs, logger_step)
        if i < len(pairs) and xs[i] == logger_step:
            return float(pairs[i][1])
        if i == 0 or i == len(pairs):
            x, s = pairs[0] if i == 0 else pairs[-1]
            return s + (logger_step - x)
        (x0, s0), (x1, s1) = pairs[i - 1], pairs[i]
        return s0 + (s1 - s0) * (logger_step - x0) / (x1 - x0)


def find_history(log_dir: str) -> str:
    """The history file for `log_dir`: the file itself, `<log_dir>/fp8_history.jsonl`, or the most recently written
    one below `log_dir` (e.g. `lightning_logs/` holding several `version_N/`)."""
    if os.path.isfile(log_dir):
        return log_dir
    direct = os.path.join(log_dir, HISTORY_FILENAME)
    if os.path.isfile(direct):
        return direct
    found = []
    for root, _dirs, files in os.walk(log_dir):
        if HISTORY_FILENAME in files:
            found.append(os.path.join(root, HISTORY_FILENAME))
    if not found:
        raise FileNotFoundError(
            f"no {HISTORY_FILENAME} in {log_dir!r}: train with lightning_fp8.callbacks.FP8ScaleMonitor() to write one"
        )
    return max(found, key=os.path.getmtime)


def load_history(path: str) -> RunHistory:
    """Parse a history file (or the one `find_history` finds for a directory). Malformed lines are skipped."""
    path = find_history(path)
    history = RunHistory(path=path)
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                history.skipped_lines += 1
                continue
            if not isinstance(record, dict):
                history.skipped_lines += 1
                continue
            kind = record.get("type")
            if kind == "run":
                history.runs.append(record)
            elif kind == "precision_map":
                rows = [r for r in record.get("layers", []) if isinstance(r, dict) and "fqn" in r]
                if not history.initial_precision_map:
                    history.initial_precision_map = rows
                history.precision_map = rows
            elif kind == "stats":
                history.stats.append((int(record.get("step", 0)), record.get("layers", {})))
                history.samples.append({k: v for k, v in record.items() if k not in ("type", "layers")})
            elif kind == "event":
                history.events.append(record)
    history.stats.sort(key=lambda item: item[0])
    history.samples.sort(key=lambda s: int(s.get("step", 0)))
    history.events.sort(key=lambda e: int(e.get("step", 0)))
    return history
