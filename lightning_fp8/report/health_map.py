"""The FP8 health map: layers x optimizer steps, one stripe per tensor role, coloured by `health.level`.

Each row is a layer, split into three stripes (input, weight, gradient, top to bottom). A sampled statistic colours
its stripe from the previous sample to its own step, on the same step axis as every other chart. Exact-step events
of a tensor (an overflow beyond the threshold, a non-finite amax) are bars at their step in their stripe, so a fault
between two samples shows at its step, layer and role. A layer's state changes are drawn over its row: grey hatching
while it runs in BF16, a violet outline after an escalation to a finer scaling (labelled with it), a diamond at each
change. Consecutive cells of the same healthy level (ok, tolerated, information only) are one rectangle (its tooltip
gives the steps and the worst value). For a large run (more than `COARSE_CELLS` cells in a map) consecutive healthy
cells of any healthy level merge, the span coloured by its worst level, so the page of a model with hundreds of
layers stays small; every cell at or beyond "near" always keeps its own rectangle and tooltip.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lightning_fp8.report.health import ROLE_NAMES
from lightning_fp8.report.history import ROLES, LayerState
from lightning_fp8.report.svg import AXIS, EVENT_STYLE, FONT, GRID, Overlay, draw_overlay, fmt, step_ticks

LEVEL_COLOURS = {
    "ok": "#dcfce7",
    "tolerated": "#fef3c7",
    "near": "#fb923c",
    "beyond": "#dc2626",
    "far": "#7f1d1d",
    "nonfinite": "#111827",
    "info": "#bfdbfe",
}
#: healthy levels: consecutive cells of these merge into one rectangle coloured by the run's worst level
MERGED = ("ok", "info", "tolerated")
#: cells per map (layers x samples x 3 roles) above which healthy runs of different levels merge
COARSE_CELLS = 20_000
STRIPE, ROW_GAP = 6, 4
ROLE_SHORT = {"input": "in", "weight": "wt", "grad_output": "gr"}


@dataclass
class Cell:
    start: float  # the previous sample's step (the cell covers the steps after it)
    end: float  # the sampled step
    level: str
    detail: Callable[[], str]  # the sampled values, for the tooltip (computed only for the cells drawn)
    score: float = 0.0  # higher is worse: the merged tooltip names the worst cell


@dataclass
class Mark:
    step: int
    role: Optional[str]
    level: str
    kind: str
    tip: str


@dataclass
class MapRow:
    fqn: str
    short: str
    cells: Dict[str, List[Cell]] = field(default_factory=dict)  # role -> cells
    marks: List[Mark] = field(default_factory=list)
    states: List[LayerState] = field(default_factory=list)


def _merge(cells: List[Cell], coarse: bool) -> List[Tuple[Cell, int, Cell]]:
    """Runs of consecutive healthy cells as (span, count, worst cell): of the same level, or with `coarse` of any
    healthy level (ok / info / tolerated), the span taking the run's worst; every other cell stays alone."""
    out: List[Tuple[Cell, int, Cell]] = []
    for cell in cells:
        previous = out[-1][0].level if out else None
        if previous in MERGED and cell.level in MERGED and (coarse or cell.level == previous):
            first, n, worst = out[-1]
            level = max(first.level, cell.level, key=MERGED.index)
            out[-1] = (Cell(first.start, cell.end, level, first.detail, first.score), n + 1, cell if cell.score > worst.score else worst)
            continue
        out.append((cell, 1, cell))
    return out


def health_map(
    rows: Sequence[MapRow],
    x_range: Tuple[float, float],
    title: str,
    rule: str,
    legend: Sequence[Tuple[str, str]],
    overlay: Optional[Overlay] = None,
    width: int = 1320,
    coarse: bool = False,
) -> str:
    """legend: (level, meaning) in display order. coarse: merge runs of any healthy levels (for large runs)."""
    label_w = min(260, max([6.2 * len(r.short) for r in rows] + [60]) + 30)
    right, top = 12, 26
    row_h = 3 * STRIPE + ROW_GAP
    pw = width - label_w - right
    base = top + row_h * len(rows)
    x0, x1 = x_range
    if x1 <= x0:
        x1 = x0 + 1
    fx = lambda s: label_w + pw * (s - x0) / (x1 - x0)  # noqa: E731
    parts = [
        '<defs><pattern id="bf16-' + rule + '" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="#e5e7eb"/><line x1="0" y1="0" x2="0" y2="6" stroke="#9ca3af" stroke-width="2"/></pattern></defs>',
        f'<text x="{label_w}" y="15" style="{FONT};font-size:12px;font-weight:600" fill="#111827">{escape(title)}</text>',
    ]
    for r, row in enumerate(rows):
        y = top + r * row_h
        parts.append(f'<rect x="{label_w}" y="{y}" width="{pw}" height="{3 * STRIPE}" fill="#f3f4f6"/>')
        parts.append(
            f'<text x="{label_w - 22}" y="{y + 1.5 * STRIPE + 3.5}" text-anchor="end" style="{FONT};font-size:10.5px" '
            f'fill="#111827">{escape(row.short)}<title>{escape(row.fqn)}</title></text>'
        )
        for i, role in enumerate(ROLES):
            sy = y + i * STRIPE
            parts.append(
                f'<text x="{label_w - 4}" y="{sy + STRIPE - 0.5}" text-anchor="end" style="{FONT};font-size:6.5px" '
                f'fill="{AXIS}">{ROLE_SHORT[role]}</text>'
            )
            for cell, n, worst in _merge(row.cells.get(role, []), coarse):
                if cell.level == "nodata":
                    continue
                a, b = fx(max(cell.start, x0)), fx(min(cell.end, x1))
                where = f"sample at step {cell.end:g}" if n == 1 else f"{n} samples, steps {cell.start:g}-{cell.end:g}, worst at {worst.end:g}"
                tip = f"{row.fqn} \u00b7 {ROLE_NAMES[role]} \u00b7 {where}: {cell.level}; {worst.detail()}"
                parts.append(
                    f'<rect class="cell {cell.level}" data-layer="{escape(row.fqn)}" data-role="{role}" data-step="{cell.end:g}" '
                    f'x="{a:.2f}" y="{sy}" width="{max(b - a, 1.5):.2f}" height="{STRIPE - 0.6}" '
                    f'fill="{LEVEL_COLOURS[cell.level]}"><title>{escape(tip)}</title></rect>'
                )
        parts.extend(_states(row, rule, fx, x1, y))
        for mark in row.marks:
            if not x0 <= mark.step <= x1:
                continue
            i = ROLES.index(mark.role) if mark.role in ROLES else 0
            h = STRIPE if mark.role in ROLES else 3 * STRIPE
            colour = LEVEL_COLOURS.get(mark.level, LEVEL_COLOURS["beyond"])
            parts.append(
                f'<rect class="mark {mark.kind}" data-layer="{escape(row.fqn)}" data-role="{mark.role or ""}" '
                f'data-step="{mark.step}" x="{fx(mark.step) - 1.75:.2f}" y="{y + i * STRIPE - 1}" width="3.5" height="{h + 1.4}" '
                f'fill="{colour}" stroke="#fff" stroke-width="0.7"><title>{escape(mark.tip)}</title></rect>'
            )
    parts.extend(draw_overlay(overlay, fx, x0, x1, top - 3, base))
    for s in step_ticks(x0, x1):
        parts.append(
            f'<text x="{fx(s):.1f}" y="{base + 11}" text-anchor="middle" style="{FONT};font-size:10px" fill="{AXIS}">{fmt(s)}</text>'
        )
    lx, ly = label_w, base + 22
    for lvl, meaning in legend:
        colour = f"url(#bf16-{rule})" if lvl == "bf16" else LEVEL_COLOURS.get(lvl, "#fff")
        text = f"{meaning}"
        parts.append(f'<rect x="{lx}" y="{ly}" width="11" height="9" fill="{colour}" stroke="{GRID}"/>')
        parts.append(f'<text x="{lx + 14}" y="{ly + 8}" style="{FONT};font-size:9.5px" fill="#374151">{escape(text)}</text>')
        lx += 14 + 5.4 * len(text) + 14
        if lx > width - 220:
            lx, ly = label_w, ly + 13
    height = ly + 16
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart healthmap" data-chart="map-{rule}" data-x0="{x0:g}" '
        f'data-x1="{x1:g}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'
    )
    return head + "".join(parts) + "</svg>"


def _states(row: MapRow, rule: str, fx, x1: float, y: float) -> List[str]:
    """BF16 hatching, escalation outlines and a diamond per change (the first state, at step 0, has none)."""
    parts = []
    for i, state in enumerate(row.states):
        end = row.states[i + 1].step if i + 1 < len(row.states) else x1
        a, b = fx(max(state.step, 0)), fx(min(end, x1))
        if b < a:
            continue
        if state.precision != "fp8":
            parts.append(
                f'<rect class="state bf16" data-layer="{escape(row.fqn)}" x="{a:.2f}" y="{y}" width="{max(b - a, 1):.2f}" '
                f'height="{3 * STRIPE}" fill="url(#bf16-{rule})"><title>{escape(row.fqn)}: {escape(state.precision.upper())} from step '
                f'{state.step} ({escape(state.reason)})</title></rect>'
            )
            if b - a > 34:
                parts.append(f'<text x="{a + 4:.1f}" y="{y + 13}" style="{FONT};font-size:9px;font-weight:600" fill="#374151">'
                             f'{escape(state.precision.upper())}</text>')
        elif state.scaling:
            parts.append(
                f'<rect class="state escalated" data-layer="{escape(row.fqn)}" data-scaling="{escape(state.scaling)}" x="{a:.2f}" '
                f'y="{y - 1}" width="{max(b - a, 1):.2f}" height="{3 * STRIPE + 2}" fill="none" stroke="{EVENT_STYLE["escalate"][0]}" '
                f'stroke-width="1.4"><title>{escape(row.fqn)}: FP8 with {escape(state.scaling)} scaling from step {state.step} '
                f'({escape(state.reason)})</title></rect>'
            )
            parts.append(f'<text x="{a + 4:.1f}" y="{y - 2}" style="{FONT};font-size:8.5px" fill="{EVENT_STYLE["escalate"][0]}">'
                         f'\u2192 {escape(state.scaling)}</text>')
        if state.kind != "start":
            colour = EVENT_STYLE.get(state.kind, EVENT_STYLE["fallback"])[0]
            cy = y + 1.5 * STRIPE
            parts.append(
                f'<path class="state-change {escape(state.kind)}" data-layer="{escape(row.fqn)}" data-step="{state.step}" '
                f'd="M{a:.1f},{cy - 6} l6,6 l-6,6 l-6,-6 z" fill="{colour}" stroke="#fff" stroke-width="0.8">'
                f'<title>step {state.step}: {escape(state.kind)} {escape(row.fqn)}: {escape(state.reason)}</title></path>'
            )
    return parts
