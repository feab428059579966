"""The run's FP8 history file (`fp8_history.jsonl`): append-only JSON lines the report reads.

One object per line, "type" in run | precision_map | stats | event (the fields: lightning_fp8/report/history.py).
Non-finite floats are written as the strings "nan" / "inf" / "-inf" so the file stays strict JSON. The run header
carries HISTORY_VERSION; version 2 files hold the thresholds in the run header, range_ratio / loss_scale /
step_time_s in the stats lines, and the per-step "nonfinite" and "overflow" events with their tensors (version 1
files lack them).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict

HISTORY_FILENAME = "fp8_history.jsonl"
HISTORY_VERSION = 2


def json_safe(value: Any) -> Any:
    """Non-finite floats become the strings "nan" / "inf" / "-inf" (strict JSON; `float()` reads them back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class HistoryFile:
    """Append-only JSON-lines file (one object per line, "type" in run | precision_map | stats | event)."""

    def __init__(self, path: str, fresh: bool) -> None:
        self.path = path
        self._fresh = fresh
        self._opened = False

    def append(self, record: Dict[str, Any]) -> None:
        mode = "a"
        if not self._opened:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            mode = "w" if self._fresh else "a"
            self._opened = True
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(json_safe(record), separators=(",", ":"), allow_nan=False) + "\n")
