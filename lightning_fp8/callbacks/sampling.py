"""Sampled quantization statistics of every FP8 layer for one optimizer step: the observer, the running metric,
and the record the callbacks read.

`LayerStatsSampler` installs `layer.fp8_observer` on every FP8 layer for one step (all micro-batches of it). The
observer computes `lightning_fp8.numerics.stats.quantization_stats` of each operand with the scale its cast uses (the
cast's own rule, `lightning_fp8.modules.cast`); a torchmetrics Metric per (layer, role) (`QuantStatsMetric`: sums
reduced by sum, amax by max) combines the casts of the step, and `finish` turns them into one `StatsRecord` with one
device-to-host copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torchmetrics import Metric

from lightning_fp8.modules.autocast import current_state
from lightning_fp8.modules.cast import observed_cast_scale  # the cast's own scale rule (delayed / current / none)
from lightning_fp8.modules.linear import FP8Linear
from lightning_fp8.numerics.quantize import tensor_amax
from lightning_fp8.numerics.stats import DEFAULT_SAMPLE_SIZE, STAT_FIELDS, QuantStats, overflow_fraction, quantization_stats
from lightning_fp8.numerics.stats import sqnr_db as _sqnr_db
from lightning_fp8.numerics.stats import underflow_fraction

#: statistics of one role in a StatsRecord (the metric names are fp8/<fqn>/<role>/<stat>). range_ratio is
#: amax x scale / the format's max: 1 fills the FP8 range exactly, above 1 values were clipped (FP8LayerFallback's
#: overflow rule compares the same quantity with its overflow_factor).
STATS = ("scale", "amax", "range_ratio", "overflow", "underflow", "sqnr_db")
_SUMS = STAT_FIELDS[1:]  # ("numel", "overflow", "sampled", "nonzero", "underflow", "signal", "noise")


@dataclass
class StatsRecord:
    """Statistics of one optimizer step, sampled on every FP8 layer that ran in FP8.

    step: optimizer steps completed when the record was taken (`trainer.global_step` after the step: the same
        count the engine's events use). logger_step: the step value Lightning's own `self.log` uses for that
        batch (so the fp8/* metrics land in the same rows as the user's).
    layers: {fqn: {role: {"scale", "amax", "range_ratio", "overflow", "underflow", "sqnr_db", "calls"}}}; overflow
        and underflow are fractions (see lightning_fp8.numerics.stats), scale is the quantization scale the step's
        last cast of that role used, range_ratio = amax * scale / the max of the role's FP8 format.
    """

    step: int
    logger_step: int
    layers: Dict[str, Dict[str, Dict[str, float]]] = field(default_factory=dict)


class QuantStatsMetric(Metric):
    """Running statistics of one (layer, role) over the casts of one step, as a torchmetrics Metric: the sums of
    `QuantStats` (reduced by sum), the amax (reduced by max, NaN propagates) and the last cast's scale. One metric
    object per role keeps the per-cast cost to one update (eight scalar metrics per role cost 8x the bookkeeping)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__(sync_on_compute=False)
        f64 = torch.float64
        self.add_state("sums", default=torch.zeros(len(_SUMS), dtype=f64), dist_reduce_fx="sum")
        self.add_state("amax", default=torch.tensor(-math.inf, dtype=f64), dist_reduce_fx="max")
        self.add_state("scale", default=torch.tensor(math.nan, dtype=f64), dist_reduce_fx="max")
        self.add_state("calls", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, stats: QuantStats, scale: torch.Tensor) -> None:  # type: ignore[override]
        packed = stats.as_tensor()  # amax, then the sums in _SUMS order
        self.sums += packed[1:]
        self.amax = torch.maximum(self.amax, packed[0])  # NaN wins: a NaN amax is an overflow
        self.scale = scale.detach().reshape(()).to(torch.float64)
        self.calls += 1

    def compute(self) -> torch.Tensor:
        """[amax, *sums, scale] as one float64 vector."""
        return torch.cat([self.amax.reshape(1), self.sums, self.scale.reshape(1)])


class LayerStatsSampler:
    """Installs observers on FP8 layers for one step and turns what they saw into a StatsRecord."""

    def __init__(self, sample_size: int = DEFAULT_SAMPLE_SIZE, seed: int = 0) -> None:
        self.sample_size = int(sample_size)
        # a private generator: sampling never moves the training run's random stream
        self.generator = torch.Generator().manual_seed(seed)
        self._aggregates: Dict[Tuple[str, str], QuantStatsMetric] = {}
        self._calls: Dict[Tuple[str, str], int] = {}
        self._format_max: Dict[Tuple[str, str], float] = {}
        self._installed: Dict[str, Tuple[FP8Linear, Optional[Callable]]] = {}

    def start(self, layers: Dict[str, FP8Linear]) -> None:
        self.stop_observing()
        for fqn, layer in layers.items():
            previous = layer.fp8_observer
            layer.fp8_observer = self._observer(fqn, layer, previous)
            self._installed[fqn] = (layer, previous)

    def stop_observing(self) -> None:
        for layer, previous in self._installed.values():
            layer.fp8_observer = previous
        self._installed.clear()

    def _observer(self, fqn: str, layer: FP8Linear, previous: Optional[Callable]) -> Callable:
        def observe(role: str, x: torch.Tensor) -> None:
            if previous is not None:
                previous(role, x)
            self.observe(fqn, layer, role, x)

        return observe

    @torch.no_grad()
    def observe(self, fqn: str, layer: FP8Linear, role: str, x: torch.Tensor) -> None:
        recipe = current_state().recipe or layer.recipe
        fmt = recipe.format_for(role)
        state = getattr(layer.fp8_meta, role)
        x = x.detach()
        amax = tensor_amax(x)
        scale = observed_cast_scale(x, amax, state, recipe, role, True, fmt)
        stats = quantization_stats(
            x, scale, fmt, self.sample_size, self.generator, rounding=recipe.rounding_for(role), amax=amax
        )
        key = (fqn, role)
        metric = self._aggregates.get(key)
        if metric is None:
            metric = self._aggregates[key] = QuantStatsMetric().to(x.device)
        # a fine-grained cast has a scale per tile: report the smallest (the tile holding the amax), so range_ratio
        # = amax * scale / max keeps its meaning (1: the largest tile fills the FP8 range)
        metric.update(stats, scale if scale.numel() == 1 else scale.amin())
        self._calls[key] = self._calls.get(key, 0) + 1
        self._format_max[key] = fmt.max

    def finish(self, step: int, logger_step: int) -> StatsRecord:
        """Stop observing and return the step's record (one host copy per device); the aggregators are reset."""
        self.stop_observing()
        record = StatsRecord(step=step, logger_step=logger_step)
        seen = [(key, self._aggregates[key]) for key, calls in self._calls.items() if calls > 0]
        if seen:
            packed = host_rows([metric.compute() for _, metric in seen])
            for (fqn, role), values in zip((key for key, _ in seen), packed):
                amax, numel, overflow, _sampled, nonzero, underflow, signal, noise, scale = values
                record.layers.setdefault(fqn, {})[role] = {
                    "scale": scale,
                    "amax": amax,
                    "range_ratio": amax * scale / self._format_max[(fqn, role)],
                    "overflow": overflow_fraction(overflow, numel),
                    "underflow": underflow_fraction(underflow, nonzero),
                    "sqnr_db": _sqnr_db(signal, noise),
                    "calls": self._calls[(fqn, role)],
                }
        for key, _ in seen:
            self._aggregates[key].reset()
        self._calls.clear()
        return record


def host_rows(rows: List[torch.Tensor]) -> List[List[float]]:
    """Equal-length 1-D tensors as lists of floats, in their order, with one device-to-host copy per device: the rows
    of each device are stacked there and copied together."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, row in enumerate(rows):
        by_device.setdefault(row.device, []).append(i)
    values: List[Optional[List[float]]] = [None] * len(rows)
    for indices in by_device.values():
        for i, row in zip(indices, torch.stack([rows[i] for i in indices]).cpu().tolist()):
            values[i] = row
    return values  # type: ignore[return-value]
