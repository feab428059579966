"""Inline SVG charts, generated in Python: the report needs no JavaScript library, no CDN and no network.

`line_chart` (linear or log y axis, horizontal threshold lines) and `timeline` (event markers along the step axis).
Every chart takes an `Overlay`, the run's events on the shared step axis, drawn the same way everywhere: rolled-back
steps as a red band, layer state changes (fallback, retry, escalate) and rollbacks as dashed vertical lines, skipped
steps as ticks at the bottom, per-tensor events (overflow beyond the threshold, non-finite amax) as triangles at the
top. Non-finite values are left out of lines. Each chart carries `data-chart`, `data-x0` and `data-x1` so a test can
check that charts share one axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from typing import List, Optional, Sequence, Tuple

Point = Tuple[float, float]

FONT = "font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif"
AXIS = "#6b7280"
GRID = "#e5e7eb"
THRESHOLD_RED = "#dc2626"

#: colour and marker shape of each event kind, everywhere in the report
EVENT_STYLE = {
    "fallback": ("#ea580c", "diamond"),
    "keep_bf16": ("#a16207", "diamond"),
    "retry": ("#2563eb", "circle"),
    "escalate": ("#7c3aed", "diamond"),
    "rollback": ("#dc2626", "triangle"),
    "skip": ("#6b7280", "tick"),
    "overflow": ("#dc2626", "mark"),
    "nonfinite": ("#111827", "mark"),
    "calibration": ("#059669", "circle"),
}


@dataclass
class Overlay:
    """Events drawn on a chart (steps on the shared axis); see the module docstring."""

    bands: List[Tuple[float, float, str, str]] = field(default_factory=list)  # (from, to, colour, tooltip)
    lines: List[Tuple[float, str, str, str]] = field(default_factory=list)  # (step, colour, tooltip, event kind)
    ticks: List[Tuple[float, str, str]] = field(default_factory=list)  # (step, colour, tooltip)
    marks: List[Tuple[float, str, str, str]] = field(default_factory=list)  # (step, colour, tooltip, css class)


def fmt(value: float) -> str:
    if value == 0:
        return "0"
    a = abs(value)
    if a >= 1e4 or a < 1e-2:
        mantissa, exp = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exp)}"
    if a >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> List[float]:
    if hi <= lo:
        hi = lo + 1.0
    span = hi - lo
    raw = span / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    ticks = []
    v = math.ceil(lo / step) * step
    while v <= hi + 1e-9 * span:
        ticks.append(round(v, 12))
        v += step
    return ticks


def step_ticks(x0: float, x1: float, n: int = 6) -> List[float]:
    ticks = nice_ticks(x0, x1, n)
    return [t for t in ticks if float(t).is_integer()] or ticks


def draw_overlay(overlay: Optional[Overlay], fx, x0: float, x1: float, top: float, bottom: float) -> List[str]:
    """The overlay's SVG elements for a plot area spanning [top, bottom] vertically."""
    if overlay is None:
        return []
    parts = []
    for a, b, colour, tip in overlay.bands:
        a, b = max(a, x0), min(b, x1)
        if b >= a:
            parts.append(
                f'<rect class="band" x="{fx(a):.1f}" y="{top}" width="{max(fx(b) - fx(a), 2):.1f}" height="{bottom - top}" '
                f'fill="{colour}" fill-opacity="0.13"><title>{escape(tip)}</title></rect>'
            )
    for step, colour, tip, kind in overlay.lines:
        if x0 <= step <= x1:
            parts.append(
                f'<line class="event-line {kind}" data-step="{step:g}" x1="{fx(step):.1f}" x2="{fx(step):.1f}" y1="{top}" y2="{bottom}" stroke="{colour}" '
                f'stroke-width="1.5" stroke-dasharray="4 3"><title>{escape(tip)}</title></line>'
            )
    for step, colour, tip in overlay.ticks:
        if x0 <= step <= x1:
            parts.append(
                f'<line class="event-tick skip" data-step="{step:g}" x1="{fx(step):.1f}" x2="{fx(step):.1f}" y1="{bottom - 7}" y2="{bottom}" '
                f'stroke="{colour}" stroke-width="2"><title>{escape(tip)}</title></line>'
            )
    for step, colour, tip, cls in overlay.marks:
        if x0 <= step <= x1:
            x = fx(step)
            parts.append(
                f'<path class="event-mark {cls}" data-step="{step:g}" d="M{x - 4:.1f},{top} l8,0 l-4,7 z" fill="{colour}" stroke="#fff" '
                f'stroke-width="0.6"><title>{escape(tip)}</title></path>'
            )
    return parts


def line_chart(
    series: Sequence[Tuple],
    title: str,
    x_range: Tuple[float, float],
    width: int = 320,
    height: int = 180,
    log_y: bool = False,
    overlay: Optional[Overlay] = None,
    hlines: Sequence[Tuple[float, str, str]] = (),
    chart_id: str = "",
    empty_note: str = "no data",
) -> str:
    """series: (label, colour, [(step, value)]) or (label, colour, points, style), style "dashed" or "points" (no
    line: events at their own steps); hlines: (y, colour, label) horizontal reference lines (thresholds), drawn when
    inside the data's range (which they extend, so a threshold is always in view)."""
    left, right, top, bottom = 50, 10, 34, 30  # the title, then a line of series labels
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1
    values = [y for s in series for _, y in s[2] if y is not None and math.isfinite(y) and (not log_y or y > 0)]
    for y, _, _ in hlines:
        if values and (not log_y or y > 0):
            values.append(y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="{escape(chart_id or title)}" data-x0="{x0:g}" '
        f'data-x1="{x1:g}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{left}" y="13" style="{FONT};font-size:12px;font-weight:600" fill="#111827">{escape(title)}</text>',
    ]
    if not values:
        parts.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" style="{FONT};font-size:11px" '
            f'fill="{AXIS}">{escape(empty_note)}</text></svg>'
        )
        return "".join(parts)
    if log_y:
        lo, hi = math.log10(min(values)), math.log10(max(values))
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        lo, hi = math.floor(lo * 2) / 2, math.ceil(hi * 2) / 2
        every = max(1, math.ceil((math.floor(hi) - math.ceil(lo) + 1) / 6))  # at most ~6 labelled decades
        ticks = [float(t) for t in range(math.ceil(lo), math.floor(hi) + 1) if t % every == 0] or [lo, hi]
        fy = lambda v: top + ph * (1 - (math.log10(v) - lo) / (hi - lo))  # noqa: E731
        tick_label = lambda t: fmt(10 ** t)  # noqa: E731
        tick_pos = lambda t: top + ph * (1 - (t - lo) / (hi - lo))  # noqa: E731
    else:
        lo, hi = min(values), max(values)
        if hi - lo < 1e-12:
            lo, hi = lo - 1, hi + 1
        pad = 0.06 * (hi - lo)
        lo, hi = lo - pad, hi + pad
        ticks = nice_ticks(lo, hi, 4)
        fy = lambda v: top + ph * (1 - (v - lo) / (hi - lo))  # noqa: E731
        tick_label = fmt
        tick_pos = fy
    fx = lambda s: left + pw * (s - x0) / (x1 - x0)  # noqa: E731
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="{GRID}"/>')
    for t in ticks:
        y = tick_pos(t)
        if top - 0.5 <= y <= top + ph + 0.5:
            parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{GRID}"/>')
            parts.append(
                f'<text x="{left - 5}" y="{y + 3.5:.1f}" text-anchor="end" style="{FONT};font-size:10px" '
                f'fill="{AXIS}">{escape(tick_label(t))}</text>'
            )
    for s in step_ticks(x0, x1):
        x = fx(s)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="{AXIS}"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{top + ph + 15}" text-anchor="middle" style="{FONT};font-size:10px" '
            f'fill="{AXIS}">{fmt(s)}</text>'
        )
    parts.extend(draw_overlay(overlay, fx, x0, x1, top, top + ph))
    for y, colour, label in hlines:
        if (not log_y or y > 0) and top <= fy(y) <= top + ph:
            parts.append(
                f'<line class="threshold" x1="{left}" x2="{left + pw}" y1="{fy(y):.1f}" y2="{fy(y):.1f}" stroke="{colour}" '
                f'stroke-width="1" stroke-dasharray="6 3"><title>{escape(label)}</title></line>'
            )
            parts.append(
                f'<text x="{left + 3}" y="{fy(y) - 3:.1f}" style="{FONT};font-size:9px" fill="{colour}">{escape(label)}</text>'
            )
    for s in series:
        label, colour, pts = s[0], s[1], s[2]
        style = s[3] if len(s) > 3 else None
        dash = ' stroke-dasharray="5 3"' if style == "dashed" else ""
        if style == "points":
            for step, v in pts:
                if v is not None and math.isfinite(v) and (not log_y or v > 0) and x0 <= step <= x1:
                    parts.append(
                        f'<circle class="series points" data-label="{escape(label)}" cx="{fx(step):.1f}" cy="{fy(v):.1f}" '
                        f'r="3" fill="{colour}" stroke="{THRESHOLD_RED}" stroke-width="1.2"><title>{escape(label)}: step '
                        f'{step:g}, {fmt(v)}</title></circle>'
                    )
            continue
        segments: List[List[str]] = [[]]
        for step, v in pts:
            if v is None or not math.isfinite(v) or (log_y and v <= 0) or not x0 <= step <= x1:
                if segments[-1]:
                    segments.append([])
                continue
            segments[-1].append(f"{fx(step):.1f},{fy(v):.1f}")
        for seg in segments:
            if len(seg) > 1:
                parts.append(
                    f'<polyline class="series" data-label="{escape(label)}" fill="none" stroke="{colour}" '
                    f'stroke-width="1.6"{dash} points="{" ".join(seg)}"><title>{escape(label)}</title></polyline>'
                )
            elif len(seg) == 1:
                x, y = seg[0].split(",")
                parts.append(
                    f'<circle class="series" data-label="{escape(label)}" cx="{x}" cy="{y}" r="2.4" fill="{colour}">'
                    f'<title>{escape(label)}</title></circle>'
                )
    lx = left
    for s in series:
        label, colour = s[0], s[1]
        parts.append(f'<rect x="{lx}" y="22" width="10" height="3" fill="{colour}"/>')
        parts.append(f'<text x="{lx + 13}" y="27" style="{FONT};font-size:9.5px" fill="#374151">{escape(label)}</text>')
        lx += 5.6 * len(label) + 24
    parts.append("</svg>")
    return "".join(parts)


def timeline(events: Sequence[dict], x_range: Tuple[float, float], width: int = 1320, label=str) -> str:
    """Events along the step axis, one lane per kind; `label(fqn)` shortens layer names in tooltips."""
    kinds = [k for k in EVENT_STYLE if any(e.get("kind") == k for e in events)]
    left, right, top = 110, 12, 24
    lane = 20
    height = top + lane * max(1, len(kinds)) + 26
    pw = width - left - right
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1
    fx = lambda s: left + pw * (s - x0) / (x1 - x0)  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart timeline" data-chart="events" data-x0="{x0:g}" '
        f'data-x1="{x1:g}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="events">',
    ]
    if not kinds:
        parts.append(f'<text x="{left}" y="{top + 10}" style="{FONT};font-size:11px" fill="{AXIS}">no events</text>')
    for i, kind in enumerate(kinds):
        y = top + i * lane + lane / 2
        colour, shape = EVENT_STYLE[kind]
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y}" y2="{y}" stroke="{GRID}"/>')
        parts.append(
            f'<text x="{left - 8}" y="{y + 3.5}" text-anchor="end" style="{FONT};font-size:11px" fill="#374151">'
            f'{escape(kind)}</text>'
        )
        for e in events:
            if e.get("kind") != kind:
                continue
            x = fx(float(e.get("step", 0)))
            tip = f"step {e.get('step')}: {kind}"
            if e.get("layers"):
                tip += " " + ", ".join(label(str(n)) for n in e["layers"])
            if e.get("reason"):
                tip += f" ({e['reason']})"
            t = f"<title>{escape(tip)}</title>"
            cls = f'class="event {kind}" data-step="{int(e.get("step", 0))}"'
            if shape == "diamond":
                parts.append(f'<path {cls} d="M{x:.1f},{y - 6} l6,6 l-6,6 l-6,-6 z" fill="{colour}">{t}</path>')
            elif shape == "triangle":
                parts.append(f'<path {cls} d="M{x:.1f},{y - 6} l6,11 l-12,0 z" fill="{colour}">{t}</path>')
            elif shape == "circle":
                parts.append(f'<circle {cls} cx="{x:.1f}" cy="{y}" r="5" fill="{colour}">{t}</circle>')
            elif shape == "mark":
                parts.append(f'<path {cls} d="M{x - 5:.1f},{y - 5} l10,0 l-5,9 z" fill="{colour}">{t}</path>')
            else:
                parts.append(
                    f'<line {cls} x1="{x:.1f}" x2="{x:.1f}" y1="{y - 6}" y2="{y + 6}" stroke="{colour}" stroke-width="2">{t}</line>'
                )
    base = top + lane * max(1, len(kinds))
    for s in step_ticks(x0, x1):
        parts.append(
            f'<text x="{fx(s):.1f}" y="{base + 14}" text-anchor="middle" style="{FONT};font-size:10px" fill="{AXIS}">'
            f'{fmt(s)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)
