"""The report's figures on the shared step axis: the event overlay, the training charts (loss, loss scale, step
time, throughput), the three health maps and each layer's charts. `lightning_fp8/report/page.py` lays them out.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lightning_fp8.report.health import ROLE_NAMES, Thresholds, level, mark_level
from lightning_fp8.report import health_map as health_map_module
from lightning_fp8.report.health_map import Cell, MapRow, Mark, health_map
from lightning_fp8.report.history import ROLES, RunHistory, TensorMark, to_float
from lightning_fp8.report.svg import EVENT_STYLE, Overlay, line_chart
from lightning_fp8.report.training_log import TrainingLog

ROLE_COLOURS = {"input": "#2563eb", "weight": "#059669", "grad_output": "#9333ea"}
LOSS_COLOURS = ["#2563eb", "#0891b2", "#7c3aed", "#db2777", "#65a30d", "#ea580c"]
THRESHOLD_COLOUR = "#dc2626"


def overlay(history: RunHistory, marks: Sequence[TensorMark], label, layer: Optional[str] = None) -> Overlay:
    """The run's events as an Overlay: rollbacks (band over the undone steps + line), skips (ticks), layer state
    changes (lines; only `layer`'s when given), per-tensor events (top marks; only `layer`'s when given)."""
    out = Overlay()
    for e in history.events:
        kind, step = e.get("kind"), int(e.get("step", 0))
        if kind == "rollback":
            restored = e.get("restored_to_step")
            tip = f"step {step}: rollback to the snapshot of step {restored} ({e.get('reason', '')})"
            if restored is not None:
                out.bands.append((float(restored), float(step), EVENT_STYLE["rollback"][0], tip + f"; steps {restored}-{step} undone"))
            out.lines.append((float(step), EVENT_STYLE["rollback"][0], tip, "rollback"))
        elif kind == "skip":
            out.ticks.append((float(step), EVENT_STYLE["skip"][0], f"step {step}: skipped ({e.get('reason', '')})"))
        elif kind in ("fallback", "retry", "escalate") and (layer is None or layer in e.get("layers", [])):
            names = ", ".join(label(n) for n in e.get("layers", []))
            out.lines.append((float(step), EVENT_STYLE[kind][0], f"step {step}: {kind} {names}: {e.get('reason', '')}", kind))
    by_step: Dict[Tuple[int, str], List[str]] = {}
    for m in marks:
        if layer is None or m.layer == layer:
            by_step.setdefault((m.step, m.kind), []).append(mark_text(m, label))
    for (step, kind), texts in sorted(by_step.items()):
        out.marks.append((float(step), EVENT_STYLE[kind][0], f"step {step}: " + "; ".join(texts), kind))
    return out


def mark_text(m: TensorMark, label) -> str:
    role = ROLE_NAMES.get(m.role or "", m.role or "?")
    if m.kind == "nonfinite":
        return f"{label(m.layer)} {role}: non-finite amax" + (" (step skipped)" if m.skipped else "")
    origin = f", attributed to {label(m.origin)}" if m.origin and m.origin != m.layer else ""
    return f"{label(m.layer)} {role}: amax {m.ratio:.3g}x the cast's range{origin}"


# -- training context --------------------------------------------------------------------------------------------
def training_charts(history: RunHistory, log: TrainingLog, x_range, ov: Overlay) -> List[str]:
    """Loss, loss scale, step time and throughput, on the history's step axis."""
    to_step = history.step_of_logger_step

    def mapped(points):
        return [(to_step(s), v) for s, v in points]

    losses = [(name, LOSS_COLOURS[i % len(LOSS_COLOURS)], mapped(pts), "dashed" if "val" in name.lower() else None)
              for i, (name, pts) in enumerate(log.losses().items())]
    charts = [line_chart(losses, "Loss", x_range, overlay=ov, chart_id="loss",
                         empty_note="no loss in the logger output (self.log('train_loss', loss))")]

    scale = {to_step(s): v for s, v in log.loss_scale()}
    source = "logger"
    if not scale:
        scale = {int(s["step"]): to_float(s["loss_scale"]) for s in history.samples if s.get("loss_scale") is not None}
        source = "history"
    for e in history.events:  # the exact scale after each skip / rollback
        if e.get("source") == "engine" and e.get("loss_scale") is not None:
            scale[float(e["step"])] = to_float(e["loss_scale"])
    charts.append(line_chart([(f"loss scale ({source})", "#0f766e", sorted(scale.items()))], "Loss scale", x_range,
                             log_y=True, overlay=ov, chart_id="loss_scale", empty_note="no loss scale recorded"))

    monitor = [(float(s["step"]), to_float(s["step_time_s"])) for s in history.samples if s.get("step_time_s") is not None]
    times = [("FP8ScaleMonitor", "#b45309", monitor)]
    if log.step_time():
        times.append(("ThroughputMonitor", "#4b5563", mapped(log.step_time()), "dashed"))
    charts.append(line_chart(times, "Step time (s)", x_range, overlay=ov, chart_id="step_time",
                             empty_note="no step time recorded"))

    rates = []  # tokens/s when the run counts them, else samples/s (one y axis: they differ by the sequence length)
    if log.tokens_per_s():
        rates.append(("tokens/s", "#1d4ed8", mapped(log.tokens_per_s())))
    elif log.samples_per_s():
        rates.append(("samples/s", "#1d4ed8", mapped(log.samples_per_s())))
    charts.append(line_chart(rates, "Throughput (rank 0)", x_range, overlay=ov, chart_id="throughput",
                             empty_note="not logged: add Lightning's ThroughputMonitor"))
    return charts


# -- health maps -------------------------------------------------------------------------------------------------
def _detail(rule: str, stats: Dict, limit: str) -> Tuple[Callable[[], str], float]:
    """Tooltip text (lazy: most cells merge) and badness score of one sampled role under one rule."""
    if rule == "overflow":
        r = to_float(stats.get("range_ratio"))

        def text() -> str:
            out = (f"amax {to_float(stats.get('amax')):.3g} x scale {to_float(stats.get('scale')):.3g} = {r:.3g}x the FP8 "
                   f"range ({limit}); overflow fraction {to_float(stats.get('overflow')):.2g}")
            if "clipped_casts" in stats:
                out += f"; casts that clipped since the previous sample: {stats['clipped_casts']}"
            return out

        return text, r if not math.isnan(r) else math.inf
    if rule == "precision":
        v = to_float(stats.get("sqnr_db"))
        return (lambda: f"SQNR {v:.1f} dB ({limit})"), -v if not math.isnan(v) else -math.inf
    v = to_float(stats.get("underflow"))
    return (lambda: f"{v:.3g} of the non-zero values flushed to zero ({limit})"), v


def legend(rule: str, t: Thresholds) -> List[Tuple[str, str]]:
    end = [("bf16", "in BF16"), ("nonfinite", "inf/NaN amax")] if rule == "overflow" else [("bf16", "in BF16")]
    if rule == "overflow" and t.overflow_factor:
        f = t.overflow_factor
        return [("ok", "ratio <= 1: nothing clipped"), ("tolerated", f"1-{f / 2:g}x: clipped a little"),
                ("near", f"{f / 2:g}-{f:g}x: near the threshold"), ("beyond", f"> {f:g}x: beyond (overflow_factor)"),
                ("far", f"> {4 * f:g}x")] + end
    if rule == "precision" and t.min_sqnr_db is not None:
        m = t.min_sqnr_db
        return [("ok", f">= {m + 10:g} dB"), ("tolerated", f"{m + 3:g}-{m + 10:g} dB"), ("near", f"{m:g}-{m + 3:g} dB: near the floor"),
                ("beyond", f"< {m:g} dB: below the floor (min_sqnr_db)"), ("far", f"< {m - 6:g} dB")] + end
    if rule == "underflow" and t.max_underflow is not None:
        u = t.max_underflow
        return [("ok", "nothing flushed"), ("tolerated", f"<= {u / 2:.3g}"), ("near", f"{u / 2:.3g}-{u:.3g}: near the limit"),
                ("beyond", f"> {u:.3g}: beyond (max_underflow)"), ("far", f"> {4 * u:.3g}")] + end
    if rule == "underflow":
        return [("ok", "nothing flushed"), ("info", "some values flushed (rule off: information only)")] + end
    return [("info", "sampled (threshold not recorded or rule off: not judged)")] + end


def map_rows(history: RunHistory, rule: str, layers: Sequence[str], marks: Sequence[TensorMark], t: Thresholds, names) -> List[MapRow]:
    stat = {"overflow": "range_ratio", "precision": "sqnr_db", "underflow": "underflow"}[rule]
    rows = {fqn: MapRow(fqn, names[fqn], {role: [] for role in ROLES}, [], history.layer_states(fqn)) for fqn in layers}
    limit = t.describe(rule)
    previous = 0.0
    for step, entry in history.stats:
        for fqn, row in rows.items():
            roles = entry.get(fqn, {})
            for role in ROLES:
                stats = roles.get(role) if isinstance(roles, dict) else None
                if isinstance(stats, dict) and stat in stats:
                    text, score = _detail(rule, stats, limit)
                    row.cells[role].append(Cell(previous, float(step), level(rule, to_float(stats[stat]), t), text, score))
        previous = float(step)
    for m in marks:
        if m.layer in rows and rule == "overflow":
            rows[m.layer].marks.append(Mark(m.step, m.role, mark_level(m, t), m.kind, f"step {m.step}: {mark_text(m, lambda n: n)}"))
    for e in history.events:  # the statistics rules' own fallbacks, at their step and roles
        if e.get("kind") == "fallback" and e.get("rule") == {"precision": "sqnr", "underflow": "underflow"}.get(rule):
            for fqn in e.get("layers", []):
                for role in [r for r in e.get("roles", []) if r in ROLES] or [None]:
                    if fqn in rows:
                        rows[fqn].marks.append(Mark(int(e["step"]), role, "beyond", "fallback",
                                                    f"step {e['step']}: {fqn} moved to BF16: {e.get('reason', '')}"))
    return list(rows.values())


MAP_TITLES = {
    "overflow": "Overflow: range ratio = amax x scale / FP8 max",
    "precision": "Precision: quantization SQNR",
    "underflow": "Flush to zero: fraction of non-zero values the cast turns into 0",
}


def is_coarse(history: RunHistory, layers) -> bool:
    """Large runs merge healthy cells of different levels (see lightning_fp8/report/health_map.py)."""
    return len(layers) * len(history.stats) * len(ROLES) > health_map_module.COARSE_CELLS


def health_maps(history: RunHistory, layers, marks, t: Thresholds, names, x_range, ov: Overlay) -> List[str]:
    map_overlay = Overlay(bands=ov.bands, lines=[line for line in ov.lines if line[3] == "rollback"], ticks=ov.ticks)
    coarse = is_coarse(history, layers)
    return [health_map(map_rows(history, rule, layers, marks, t, names), x_range, MAP_TITLES[rule], rule, legend(rule, t),
                       map_overlay, coarse=coarse)
            for rule in ("overflow", "precision", "underflow")]


# -- per layer ---------------------------------------------------------------------------------------------------
def layer_charts(history: RunHistory, fqn: str, x_range, ov: Overlay, t: Thresholds, marks: Sequence[TensorMark] = ()) -> List[str]:
    """Scale, amax, range ratio and SQNR of one layer per role; the range ratio also shows the per-step overflow
    events between samples as points (red outline) at their own steps."""
    def series(stat):
        return [(ROLE_NAMES[role], ROLE_COLOURS[role], pts) for role in ROLES if (pts := history.series(fqn, role, stat))]

    between = [(f"{ROLE_NAMES[role]} events", ROLE_COLOURS[role],
                [(float(m.step), m.ratio) for m in marks if m.layer == fqn and m.role == role and m.ratio is not None], "points")
               for role in ROLES]
    between = [b for b in between if b[2]]

    ratio_lines = [(1.0, "#9ca3af", "range")]
    if t.overflow_factor:
        ratio_lines.append((t.overflow_factor, THRESHOLD_COLOUR, f"overflow_factor {t.overflow_factor:g}x"))
    sqnr_lines = [(t.min_sqnr_db, THRESHOLD_COLOUR, f"min_sqnr_db {t.min_sqnr_db:g}")] if t.min_sqnr_db is not None else []
    return [
        line_chart(series("scale"), "scale", x_range, log_y=True, overlay=ov, chart_id="scale"),
        line_chart(series("amax"), "amax", x_range, log_y=True, overlay=ov, chart_id="amax"),
        line_chart(series("range_ratio") + between, "range ratio (amax x scale / max)", x_range, log_y=True, overlay=ov,
                   hlines=ratio_lines, chart_id="range_ratio"),
        line_chart(series("sqnr_db"), "SQNR (dB)", x_range, overlay=ov, hlines=sqnr_lines, chart_id="sqnr"),
    ]
