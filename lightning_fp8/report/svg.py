"""Inline SVG charts, generated in Python: the report needs no JavaScript library, no CDN and no network.

Three chart kinds: `line_chart` (linear or log y axis, vertical event markers), `heatmap` (rows x steps) and
`timeline` (event markers along the step axis). Non-finite values are left out of lines (and drawn as the
"missing" colour in heat maps).
"""
from __future__ import annotations

import math
from html import escape
from typing import List, Optional, Sequence, Tuple

Point = Tuple[float, float]

FONT = "font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif"
AXIS = "#6b7280"
GRID = "#e5e7eb"


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    a = abs(value)
    if a >= 1e4 or a < 1e-2:
        mantissa, exp = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exp)}"
    if a >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _nice_ticks(lo: float, hi: float, n: int = 5) -> List[float]:
    if hi <= lo:
        hi = lo + 1.0
    span = hi - lo
    raw = span / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    ticks = []
    v = start
    while v <= hi + 1e-9 * span:
        ticks.append(round(v, 12))
        v += step
    return ticks


def _step_ticks(x0: float, x1: float, n: int = 6) -> List[float]:
    ticks = _nice_ticks(x0, x1, n)
    return [t for t in ticks if float(t).is_integer()] or ticks


def line_chart(
    series: Sequence[Tuple[str, str, Sequence[Point]]],
    title: str,
    x_range: Tuple[float, float],
    width: int = 420,
    height: int = 190,
    log_y: bool = False,
    y_label: str = "",
    markers: Sequence[Tuple[float, str, str]] = (),
    legend: bool = True,
) -> str:
    """series: (label, colour, [(step, value)]); markers: (step, colour, tooltip) drawn as dashed vertical lines."""
    left, right, top, bottom = 58, 12, 24, 34
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1
    values = []
    for _, _, pts in series:
        for _, y in pts:
            if y is not None and math.isfinite(y) and (not log_y or y > 0):
                values.append(y)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{left}" y="15" style="{FONT};font-size:12px;font-weight:600" fill="#111827">{escape(title)}</text>',
    ]
    if not values:
        parts.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" style="{FONT};font-size:11px" '
            f'fill="{AXIS}">no data</text></svg>'
        )
        return "".join(parts)
    if log_y:
        lo, hi = math.log10(min(values)), math.log10(max(values))
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        lo, hi = math.floor(lo * 2) / 2, math.ceil(hi * 2) / 2
        ticks = [float(t) for t in range(math.ceil(lo), math.floor(hi) + 1)] or [lo, hi]
        fy = lambda v: top + ph * (1 - (math.log10(v) - lo) / (hi - lo))  # noqa: E731
        tick_label = lambda t: _fmt(10 ** t)  # noqa: E731
        tick_pos = lambda t: top + ph * (1 - (t - lo) / (hi - lo))  # noqa: E731
    else:
        lo, hi = min(values), max(values)
        if hi - lo < 1e-12:
            lo, hi = lo - 1, hi + 1
        pad = 0.06 * (hi - lo)
        lo, hi = lo - pad, hi + pad
        ticks = _nice_ticks(lo, hi, 4)
        fy = lambda v: top + ph * (1 - (v - lo) / (hi - lo))  # noqa: E731
        tick_label = _fmt
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
    for s in _step_ticks(x0, x1):
        x = fx(s)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="{AXIS}"/>')
        parts.append(
            f'<text x="{x:.1f}" y="{top + ph + 15}" text-anchor="middle" style="{FONT};font-size:10px" '
            f'fill="{AXIS}">{_fmt(s)}</text>'
        )
    parts.append(
        f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle" style="{FONT};font-size:10px" '
        f'fill="{AXIS}">step</text>'
    )
    if y_label:
        parts.append(
            f'<text transform="translate(11,{top + ph / 2}) rotate(-90)" text-anchor="middle" '
            f'style="{FONT};font-size:10px" fill="{AXIS}">{escape(y_label)}</text>'
        )
    for step, colour, tip in markers:
        if x0 <= step <= x1:
            x = fx(step)
            parts.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="{colour}" stroke-width="1.5" '
                f'stroke-dasharray="4 3"><title>{escape(tip)}</title></line>'
            )
    for label, colour, pts in series:
        segments: List[List[str]] = [[]]
        for s, v in pts:
            if v is None or not math.isfinite(v) or (log_y and v <= 0):
                if segments[-1]:
                    segments.append([])
                continue
            segments[-1].append(f"{fx(s):.1f},{fy(v):.1f}")
        for seg in segments:
            if len(seg) > 1:
                parts.append(
                    f'<polyline class="series" data-label="{escape(label)}" fill="none" stroke="{colour}" '
                    f'stroke-width="1.6" points="{" ".join(seg)}"><title>{escape(label)}</title></polyline>'
                )
            elif len(seg) == 1:
                x, y = seg[0].split(",")
                parts.append(f'<circle cx="{x}" cy="{y}" r="2.2" fill="{colour}"><title>{escape(label)}</title></circle>')
    if legend:
        lx = left + pw
        for label, colour, _ in reversed(list(series)):
            w = 7 * len(label) + 16
            lx -= w
            parts.append(f'<rect x="{lx}" y="7" width="10" height="3" fill="{colour}"/>')
            parts.append(
                f'<text x="{lx + 13}" y="12" style="{FONT};font-size:10px" fill="#374151">{escape(label)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _heat_colour(value: Optional[float], vmin_log: float, vmax_log: float) -> str:
    """0 -> near white; growing fractions -> yellow -> orange -> dark red (log scale); missing -> light grey."""
    if value is None or not math.isfinite(value):
        return "#f3f4f6"
    if value <= 0:
        return "#fbfdf9"
    if math.log10(value) < vmin_log:
        return "#fffbe8"
    t = (math.log10(value) - vmin_log) / (vmax_log - vmin_log)
    t = min(1.0, max(0.0, t))
    stops = [(255, 245, 200), (253, 174, 97), (215, 48, 39), (103, 0, 13)]
    pos = t * (len(stops) - 1)
    i = min(int(pos), len(stops) - 2)
    f = pos - i
    r, g, b = (round(stops[i][k] + (stops[i + 1][k] - stops[i][k]) * f) for k in range(3))
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(
    rows: Sequence[str],
    steps: Sequence[int],
    values: Sequence[Sequence[Optional[float]]],
    title: str,
    width: int = 1240,
    vmin: float = 1e-6,
    vmax: float = 1.0,
    markers: Sequence[Tuple[float, str, str]] = (),
    value_label: str = "fraction",
) -> str:
    """rows x steps grid of fractions, log colour scale from vmin to vmax; markers as on a line chart."""
    label_w = max([7 * len(r) for r in rows] + [60]) + 12
    right, top, bottom = 12, 26, 54
    cell_h = 18
    pw = max(100, width - label_w - right)
    height = top + cell_h * len(rows) + bottom
    n = max(1, len(steps))
    cw = pw / n
    lo, hi = math.log10(vmin), math.log10(vmax)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart heatmap" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{label_w}" y="15" style="{FONT};font-size:12px;font-weight:600" fill="#111827">{escape(title)}</text>',
    ]
    for r, name in enumerate(rows):
        y = top + r * cell_h
        parts.append(
            f'<text x="{label_w - 6}" y="{y + cell_h / 2 + 3.5}" text-anchor="end" style="{FONT};font-size:10.5px" '
            f'fill="#374151">{escape(name)}</text>'
        )
        for c, step in enumerate(steps):
            v = values[r][c] if c < len(values[r]) else None
            tip = f"{name} @ step {step}: " + ("no data" if v is None or not math.isfinite(v) else f"{value_label} {v:.3g}")
            parts.append(
                f'<rect x="{label_w + c * cw:.2f}" y="{y}" width="{cw + 0.3:.2f}" height="{cell_h - 2}" '
                f'fill="{_heat_colour(v, lo, hi)}"><title>{escape(tip)}</title></rect>'
            )
    base = top + cell_h * len(rows)
    if steps:
        shown = _step_ticks(steps[0], steps[-1])
        for s in shown:
            c = min(range(len(steps)), key=lambda i: abs(steps[i] - s))
            x = label_w + (c + 0.5) * cw
            parts.append(
                f'<text x="{x:.1f}" y="{base + 12}" text-anchor="middle" style="{FONT};font-size:10px" '
                f'fill="{AXIS}">{_fmt(steps[c])}</text>'
            )
        for step, colour, tip in markers:
            if steps[0] <= step <= steps[-1]:
                c = min(range(len(steps)), key=lambda i: abs(steps[i] - step))
                x = label_w + (c + 0.5) * cw
                parts.append(
                    f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 3}" y2="{base}" stroke="{colour}" stroke-width="1.5" '
                    f'stroke-dasharray="4 3"><title>{escape(tip)}</title></line>'
                )
    # colour legend
    lx, ly = label_w, base + 24
    for i in range(40):
        t = i / 39
        v = 10 ** (lo + t * (hi - lo))
        parts.append(f'<rect x="{lx + i * 5}" y="{ly}" width="5" height="9" fill="{_heat_colour(v, lo, hi)}"/>')
    parts.append(f'<text x="{lx}" y="{ly + 21}" style="{FONT};font-size:10px" fill="{AXIS}">{_fmt(vmin)}</text>')
    parts.append(
        f'<text x="{lx + 200}" y="{ly + 21}" text-anchor="end" style="{FONT};font-size:10px" fill="{AXIS}">{_fmt(vmax)}</text>'
    )
    parts.append(
        f'<text x="{lx + 210}" y="{ly + 8}" style="{FONT};font-size:10px" fill="{AXIS}">{escape(value_label)} '
        f'(log scale; white: 0, grey: not in FP8 / no sample)</text>'
    )
    parts.append("</svg>")
    return "".join(parts)


EVENT_STYLE = {
    "fallback": ("#ea580c", "diamond"),
    "keep_bf16": ("#a16207", "diamond"),
    "retry": ("#2563eb", "circle"),
    "rollback": ("#dc2626", "triangle"),
    "skip": ("#6b7280", "tick"),
    "calibration": ("#059669", "circle"),
}


def timeline(events: Sequence[dict], x_range: Tuple[float, float], width: int = 1240) -> str:
    """Events along the step axis, one lane per kind."""
    kinds = [k for k in EVENT_STYLE if any(e.get("kind") == k for e in events)]
    left, right, top = 110, 12, 24
    lane = 22
    height = top + lane * max(1, len(kinds)) + 26
    pw = width - left - right
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1
    fx = lambda s: left + pw * (s - x0) / (x1 - x0)  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart timeline" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="events">',
        f'<text x="{left}" y="15" style="{FONT};font-size:12px;font-weight:600" fill="#111827">Events</text>',
    ]
    if not kinds:
        parts.append(
            f'<text x="{left}" y="{top + 14}" style="{FONT};font-size:11px" fill="{AXIS}">no skips, rollbacks or '
            f'fallbacks</text>'
        )
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
                tip += " " + ", ".join(map(str, e["layers"]))
            if e.get("reason"):
                tip += f" ({e['reason']})"
            t = f"<title>{escape(tip)}</title>"
            if shape == "diamond":
                parts.append(
                    f'<path class="event {kind}" d="M{x:.1f},{y - 6} l6,6 l-6,6 l-6,-6 z" fill="{colour}">{t}</path>'
                )
            elif shape == "triangle":
                parts.append(
                    f'<path class="event {kind}" d="M{x:.1f},{y - 6} l6,11 l-12,0 z" fill="{colour}">{t}</path>'
                )
            elif shape == "circle":
                parts.append(f'<circle class="event {kind}" cx="{x:.1f}" cy="{y}" r="5" fill="{colour}">{t}</circle>')
            else:
                parts.append(
                    f'<line class="event {kind}" x1="{x:.1f}" x2="{x:.1f}" y1="{y - 6}" y2="{y + 6}" stroke="{colour}" '
                    f'stroke-width="2">{t}</line>'
                )
    base = top + lane * max(1, len(kinds))
    for s in _step_ticks(x0, x1):
        x = fx(s)
        parts.append(
            f'<text x="{x:.1f}" y="{base + 14}" text-anchor="middle" style="{FONT};font-size:10px" fill="{AXIS}">'
            f'{_fmt(s)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["line_chart", "heatmap", "timeline", "EVENT_STYLE"]
