"""The run's training context from its logger output: loss, loss scale, step time, throughput.

The report reads what the user's loggers wrote into the directory of the history file:

- `metrics.csv` (CSVLogger), read with the standard library;
- TensorBoard event files (`events.out.tfevents.*`, TensorBoardLogger), read with the `tensorboard` package's
  `EventAccumulator` when that package is installed; when it is not, the files are skipped and the page says so
  (the report does not depend on TensorBoard).

Which columns mean what: every non-`fp8/` metric whose name contains "loss" is a loss (names with "val" are
validation losses); `fp8/loss_scale` is the loss scale (logged by the precision plugin); Lightning's
`ThroughputMonitor` gives step time (`train/time`, seconds since the start, differenced) and throughput
(`train/lengths` / `train/samples` differenced over `train/time`: tokens (items) and samples per second, the rank's
own; the first row: since the start of the fit; or its rolling `train/items_per_sec`, `train/samples_per_sec`). All
series are keyed by the logger's step.
"""
from __future__ import annotations

import csv
import glob
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

Series = List[Tuple[float, float]]  # (logger step, value)

CSV_FILENAME = "metrics.csv"
_THROUGHPUT = re.compile(r"^train[/|](time|samples|lengths|items_per_sec|samples_per_sec)$")


@dataclass
class TrainingLog:
    """Scalar series from the logger output, by metric name, plus what was read and what could not be."""

    series: Dict[str, Series] = field(default_factory=dict)
    sources: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def losses(self) -> Dict[str, Series]:
        """Every loss series: train first, then validation, at most 6."""
        names = [n for n in self.series if "loss" in n.lower() and not n.startswith("fp8/")]
        names.sort(key=lambda n: ("val" in n.lower(), n))
        return {n: self.series[n] for n in names[:6]}

    def loss_scale(self) -> Series:
        return self.series.get("fp8/loss_scale", [])

    def _throughput(self, what: str) -> Series:
        for name, values in self.series.items():
            match = _THROUGHPUT.match(name)
            if match and match.group(1) == what:
                return values
        return []

    def step_time(self) -> Series:
        """Seconds per logger step from ThroughputMonitor's cumulative `train/time` (between consecutive rows)."""
        return _rate(self._throughput("time"))

    def tokens_per_s(self) -> Series:
        counts = self._throughput("lengths")
        return _ratio(counts, self._throughput("time")) if counts else self._throughput("items_per_sec")

    def samples_per_s(self) -> Series:
        counts = self._throughput("samples")
        return _ratio(counts, self._throughput("time")) if counts else self._throughput("samples_per_sec")


def _rate(cumulative: Series) -> Series:
    """Differences of a cumulative series per logger step, at the later row."""
    out = []
    for (s0, v0), (s1, v1) in zip(cumulative, cumulative[1:]):
        if s1 > s0 and v1 >= v0:
            out.append((s1, (v1 - v0) / (s1 - s0)))
    return out


def _ratio(counts: Series, times: Series) -> Series:
    """Δcount / Δtime between consecutive rows present in both series; the first row: count / time since the start
    of the fit (ThroughputMonitor counts from there)."""
    time_at = dict(times)
    rows = [(s, c, time_at[s]) for s, c in counts if s in time_at]
    out = []
    for (s0, c0, t0), (s1, c1, t1) in zip([(None, 0.0, 0.0)] + rows, rows):
        if t1 > t0 and c1 >= c0:
            out.append((s1, (c1 - c0) / (t1 - t0)))
    return out


def _read_csv(path: str, log: TrainingLog) -> None:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        for row in reader:
            try:
                step = float(row.get("step") or "nan")
            except ValueError:
                continue
            if math.isnan(step):
                continue
            for name, text in row.items():
                if name in ("step", "epoch") or not text or (name.startswith("fp8/") and name != "fp8/loss_scale"):
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                log.series.setdefault(name, []).append((step, value))
    log.sources.append(path)


def _read_tensorboard(directory: str, files: List[str], log: TrainingLog) -> None:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        log.notes.append(
            f"{len(files)} TensorBoard event file(s) in {directory} were not read: the `tensorboard` package is not "
            "installed (pip install tensorboard)"
        )
        return
    accumulator = EventAccumulator(directory, size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    for tag in accumulator.Tags().get("scalars", []):
        if tag in log.series or (tag.startswith("fp8/") and tag != "fp8/loss_scale"):
            continue  # the CSV has it already; per-layer FP8 statistics come from the history file
        log.series[tag] = [(float(e.step), float(e.value)) for e in accumulator.Scalars(tag)]
    log.sources.append(directory)


def read_training_log(directory: str) -> TrainingLog:
    """Everything the loggers wrote into `directory` (see the module docstring); missing files are not an error."""
    log = TrainingLog()
    path = os.path.join(directory, CSV_FILENAME)
    if os.path.isfile(path):
        _read_csv(path, log)
    files = sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*")))
    if files:
        _read_tensorboard(directory, files, log)
    for values in log.series.values():
        values.sort(key=lambda point: point[0])
    if not log.sources and not log.notes:
        log.notes.append(f"no logger output ({CSV_FILENAME} or TensorBoard event files) in {directory}")
    return log
