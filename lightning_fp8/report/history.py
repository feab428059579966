"""Reading `fp8_history.jsonl`, the per-layer history FP8ScaleMonitor / FP8LayerFallback / FP8Calibration write.

Format (JSON lines, one object per line, appended in time order; a resumed run appends to the same file when it
logs to the same directory). Every object has a "type":

    {"type": "run", "version": 1, "started": ISO time, "step": N, "resumed": bool, "log_every_n_steps": n,
     "sample_size": n, "recipe": {...FP8Recipe.to_dict()...} | null}
    {"type": "precision_map", "step": N, "layers": [{"fqn": ..., "precision": "fp8" | "bf16", "reason": ...}]}
    {"type": "stats", "step": N, "logger_step": n, "layers": {fqn: {"enabled": bool,
         "input" | "weight" | "grad_output": {"scale", "amax", "overflow", "underflow", "sqnr_db",
                                               "clipped_casts", "nonfinite_casts"}}}}
    {"type": "event", "source": "engine" | "fallback" | "calibration", "step": N,
     "kind": "skip" | "rollback" | "fallback" | "retry" | "keep_bf16" | "calibration", "reason": str,
     "layers": [...], ...}

"step" is the number of optimizer steps completed (the engine's step count). Non-finite numbers are written as the
strings "nan", "inf", "-inf". Unknown types and fields are ignored, so the format can grow.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from lightning_fp8.callbacks.history_file import HISTORY_FILENAME

ROLES = ("input", "weight", "grad_output")


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
class RunHistory:
    path: str
    runs: List[Dict[str, Any]] = field(default_factory=list)
    #: the latest precision map (list of {"fqn", "precision", "reason"}) and the first one
    precision_map: List[Dict[str, str]] = field(default_factory=list)
    initial_precision_map: List[Dict[str, str]] = field(default_factory=list)
    #: step -> fqn -> role -> stat -> float ; plus fqn -> "enabled"
    stats: List[Tuple[int, Dict[str, Dict[str, Any]]]] = field(default_factory=list)
    events: List[Dict[str, Any]] = field(default_factory=list)
    skipped_lines: int = 0

    @property
    def steps(self) -> List[int]:
        return [step for step, _ in self.stats]

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
            elif kind == "event":
                history.events.append(record)
    history.stats.sort(key=lambda item: item[0])
    history.events.sort(key=lambda e: int(e.get("step", 0)))
    return history


__all__ = ["RunHistory", "load_history", "find_history", "to_float"]
