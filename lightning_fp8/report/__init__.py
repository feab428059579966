"""The precision dashboard: one self-contained HTML file from a run's `fp8_history.jsonl`.

    from lightning_fp8.report import write_report
    path = write_report("lightning_logs/version_0")          # -> lightning_logs/version_0/fp8_report.html

    $ lightning-fp8 report lightning_logs/version_0 [-o report.html]

The page shows the precision map (every linear: FP8 or BF16, and why), the events (fallbacks, retries, skipped
steps, rollbacks, calibration) on a timeline, overflow and underflow heat maps (layers x steps), and per layer the
scale, amax and quantization SQNR over time with that layer's events marked. Charts are inline SVG generated in
Python: no JavaScript, no CDN, nothing fetched over the network, so the file can be opened anywhere, attached to an
issue or archived with the run. The history format is documented in `lightning_fp8.report.history`.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from html import escape
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_fp8.report.history import ROLES, RunHistory, find_history, load_history, to_float
from lightning_fp8.report.svg import EVENT_STYLE, heatmap, line_chart, timeline

REPORT_FILENAME = "fp8_report.html"
ROLE_COLOURS = {"input": "#2563eb", "weight": "#059669", "grad_output": "#9333ea"}

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:24px 32px;color:#111827;background:#f9fafb}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e5e7eb;padding-bottom:4px}
h3{font-size:14px;margin:18px 0 6px;font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
.meta{color:#6b7280;font-size:12px;margin-bottom:14px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:10px 0}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:10px 16px;min-width:120px}
.card .n{font-size:22px;font-weight:700} .card .l{font-size:11px;color:#6b7280;text-transform:uppercase;letter-spacing:.04em}
table{border-collapse:collapse;background:#fff;font-size:12.5px;width:100%}
th,td{border:1px solid #e5e7eb;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6;font-weight:600}
td.fqn{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;white-space:nowrap}
td.layers{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;max-width:420px}
table.events td:first-child{white-space:nowrap;width:4em} table.events td:nth-child(2){white-space:nowrap;width:6em}
.badge{display:inline-block;border-radius:4px;padding:1px 7px;font-size:11px;font-weight:700}
.fp8{background:#dcfce7;color:#166534} .bf16{background:#fef3c7;color:#92400e} .moved{background:#fee2e2;color:#991b1b}
.layer{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:6px 12px 10px;margin:10px 0}
.charts{display:flex;gap:10px;flex-wrap:wrap}
.note{font-size:12px;color:#4b5563;margin:4px 0 8px}
.legend span{display:inline-block;margin-right:14px;font-size:12px}
.legend i{display:inline-block;width:12px;height:3px;margin-right:4px;vertical-align:middle}
"""


def _role_series(history: RunHistory, fqn: str, stat: str) -> List[Tuple[str, str, List[Tuple[int, float]]]]:
    out = []
    for role in ROLES:
        pts = history.series(fqn, role, stat)
        if pts:
            out.append((role, ROLE_COLOURS[role], pts))
    return out


def _layer_markers(history: RunHistory, fqn: str) -> List[Tuple[float, str, str]]:
    markers = []
    for e in history.events:
        kind = e.get("kind")
        if kind in ("fallback", "retry") and fqn in e.get("layers", []):
            markers.append((float(e["step"]), EVENT_STYLE[kind][0], f"step {e['step']}: {kind}: {e.get('reason', '')}"))
        elif kind == "rollback":
            markers.append((float(e["step"]), EVENT_STYLE[kind][0], f"step {e['step']}: rollback: {e.get('reason', '')}"))
    return markers


def _global_markers(history: RunHistory) -> List[Tuple[float, str, str]]:
    out = []
    for e in history.events:
        kind = e.get("kind")
        if kind in ("fallback", "rollback", "retry"):
            layers = ", ".join(e.get("layers", []))
            out.append((float(e["step"]), EVENT_STYLE[kind][0], f"step {e['step']}: {kind} {layers}: {e.get('reason', '')}"))
    return out


def _heat_values(history: RunHistory, layers: Sequence[str], stat: str) -> List[List[Optional[float]]]:
    """Worst role (max) of `stat` per layer per sampled step; None where the layer had no FP8 statistics."""
    grid = []
    for fqn in layers:
        row = []
        for _step, entry in history.stats:
            roles = entry.get(fqn, {})
            vals = [to_float(roles[r][stat]) for r in ROLES if isinstance(roles.get(r), dict) and stat in roles[r]]
            vals = [v for v in vals if not math.isnan(v)]
            row.append(max(vals) if vals else None)
        grid.append(row)
    return grid


def render_report(history: RunHistory, title: Optional[str] = None) -> str:
    """The report page for a loaded history, as an HTML string."""
    title = title or "FP8 precision report"
    steps = history.steps
    last = history.last_step
    first = min(steps + [int(e.get("step", 0)) for e in history.events]) if (steps or history.events) else 0
    x_range = (float(first), float(max(last, first + 1)))
    pmap = history.precision_map
    n_fp8 = sum(1 for r in pmap if r.get("precision") == "fp8")
    moved = {fqn for e in history.events if e.get("kind") == "fallback" for fqn in e.get("layers", [])}
    n_bf16 = sum(1 for r in pmap if r.get("precision") != "fp8")
    skips = sum(1 for e in history.events if e.get("kind") == "skip")
    rollbacks = sum(1 for e in history.events if e.get("kind") == "rollback")
    run = history.runs[-1] if history.runs else {}
    recipe = run.get("recipe") or {}
    generated = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")

    html: List[str] = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<div class='meta'>{escape(history.path)} &middot; {len(steps)} statistics samples, steps {first}&ndash;{last}"
        + (f" &middot; every {run.get('log_every_n_steps')} steps" if run.get("log_every_n_steps") else "")
        + (
            f" &middot; recipe: format={escape(str(recipe.get('format')))}, scaling={escape(str(recipe.get('scaling')))}, "
            f"amax_history_len={escape(str(recipe.get('amax_history_len')))}, margin={escape(str(recipe.get('margin')))}"
            if recipe
            else ""
        )
        + f" &middot; generated {generated}</div>",
        "<div class='cards'>",
        f"<div class='card'><div class='n'>{n_fp8}</div><div class='l'>layers in FP8</div></div>",
        f"<div class='card'><div class='n'>{n_bf16}</div><div class='l'>linears in BF16</div></div>",
        f"<div class='card'><div class='n'>{len(moved)}</div><div class='l'>moved to BF16 in training</div></div>",
        f"<div class='card'><div class='n'>{skips}</div><div class='l'>skipped steps</div></div>",
        f"<div class='card'><div class='n'>{rollbacks}</div><div class='l'>rollbacks</div></div>",
        "</div>",
    ]

    # precision map
    html.append("<h2>Precision map</h2>")
    if pmap:
        html.append("<table class='precision-map'><tr><th>layer</th><th>precision</th><th>why</th></tr>")
        for row in pmap:
            fqn = row.get("fqn", "")
            prec = row.get("precision", "")
            cls = "fp8" if prec == "fp8" else ("moved" if fqn in moved else "bf16")
            label = prec.upper() + (" (fallback)" if fqn in moved and prec != "fp8" else "")
            since = history.fallback_step(fqn) if prec != "fp8" else None
            reason = row.get("reason", "") + (f" (since step {since})" if since is not None and fqn in moved else "")
            html.append(
                f"<tr><td class='fqn'>{escape(fqn)}</td><td><span class='badge {cls}'>{escape(label)}</span></td>"
                f"<td>{escape(reason)}</td></tr>"
            )
        html.append("</table>")
    else:
        html.append("<p class='note'>No precision map recorded.</p>")

    # events
    html.append("<h2>Events</h2>")
    html.append(timeline(history.events, x_range))
    skip_events = [e for e in history.events if e.get("kind") == "skip"]
    rows: List[Tuple[float, str]] = []
    for e in history.events:
        if e.get("kind") == "skip":
            continue
        names = [str(n) for n in e.get("layers", [])]
        shown_layers = ", ".join(names) if len(names) <= 3 else f"{', '.join(names[:2])}, ... ({len(names)} layers)"
        rows.append((int(e.get("step", 0)),
            f"<tr><td>{escape(str(e.get('step')))}</td><td>{escape(str(e.get('kind')))}</td>"
            f"<td class='layers'>{escape(shown_layers)}</td>"
            f"<td>{escape(str(e.get('reason') or ''))}</td></tr>"))
    if skip_events:  # skips can be many: one summary row, at the first one (before a rollback of the same step)
        shown = ", ".join(str(e.get("step")) for e in skip_events[:30]) + (" ..." if len(skip_events) > 30 else "")
        rows.append((int(skip_events[0].get("step", 0)) - 0.5,
            f"<tr><td>{escape(shown)}</td><td>skip &times;{len(skip_events)}</td><td></td>"
            f"<td>{escape(str(skip_events[-1].get('reason') or ''))} (latest)</td></tr>"))
    if rows:
        html.append("<table class='events'><tr><th>step</th><th>event</th><th>layers</th><th>reason</th></tr>")
        html.extend(row for _, row in sorted(rows, key=lambda r: r[0]))
        html.append("</table>")

    # heat maps
    layers = history.fp8_layers
    html.append("<h2>Overflow and underflow</h2>")
    html.append(
        "<p class='note'>Each cell: the worst tensor role of a layer at a sampled step. Overflow: fraction of values "
        "beyond the FP8 range after scaling (clipped by the cast). Underflow: fraction of non-zero values flushed to "
        "zero. Dashed lines: fallbacks, retries and rollbacks.</p>"
    )
    if layers and steps:
        markers = _global_markers(history)
        html.append(heatmap(layers, steps, _heat_values(history, layers, "overflow"), "Overflow fraction", vmin=1e-4, markers=markers))
        html.append(heatmap(layers, steps, _heat_values(history, layers, "underflow"), "Underflow fraction", vmin=1e-4, markers=markers))
    else:
        html.append("<p class='note'>No statistics recorded.</p>")

    # per layer
    html.append("<h2>Scales, amax and SQNR per layer</h2>")
    html.append("<p class='note'>Layers moved to BF16 during training first, then the others in model order.</p>")
    html.append(
        "<div class='legend'>"
        + "".join(f"<span><i style='background:{c}'></i>{r}</span>" for r, c in ROLE_COLOURS.items())
        + f"<span><i style='background:{EVENT_STYLE['fallback'][0]}'></i>fallback</span>"
        + f"<span><i style='background:{EVENT_STYLE['rollback'][0]}'></i>rollback</span>"
        + f"<span><i style='background:{EVENT_STYLE['retry'][0]}'></i>retry</span></div>"
    )
    precision_of: Dict[str, Dict[str, str]] = {row["fqn"]: row for row in pmap}
    for fqn in sorted(layers, key=lambda f: f not in moved):  # stable: model order within each group
        row = precision_of.get(fqn, {})
        prec = row.get("precision", "fp8")
        badge = (
            "<span class='badge fp8'>FP8</span>"
            if prec == "fp8"
            else f"<span class='badge {'moved' if fqn in moved else 'bf16'}'>BF16</span> "
            f"<span class='note'>{escape(row.get('reason', ''))}</span>"
        )
        markers = _layer_markers(history, fqn)
        html.append(f"<div class='layer' id='layer-{escape(fqn)}'><h3>{escape(fqn)} {badge}</h3><div class='charts'>")
        html.append(line_chart(_role_series(history, fqn, "scale"), "scale", x_range, log_y=True, markers=markers))
        html.append(line_chart(_role_series(history, fqn, "amax"), "amax", x_range, log_y=True, markers=markers))
        html.append(
            line_chart(_role_series(history, fqn, "sqnr_db"), "SQNR (dB)", x_range, markers=markers)
        )
        html.append("</div></div>")
    if not layers:
        html.append("<p class='note'>No FP8 layers.</p>")
    if history.skipped_lines:
        html.append(f"<p class='note'>{history.skipped_lines} malformed history lines were skipped.</p>")
    html.append("</body></html>")
    return "\n".join(html)


def write_report(log_dir: str, output: Optional[str] = None) -> str:
    """Write the HTML report for the run logged in `log_dir` (a directory holding `fp8_history.jsonl`, a parent of
    such directories: the newest is used, or the history file itself). `output` defaults to `fp8_report.html` next to
    the history. Returns the path written."""
    path = find_history(log_dir)
    history = load_history(path)
    if output is None:
        output = os.path.join(os.path.dirname(os.path.abspath(path)), REPORT_FILENAME)
    elif os.path.isdir(output):
        output = os.path.join(output, REPORT_FILENAME)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    page = render_report(history)
    with open(output, "w", encoding="utf-8") as f:
        f.write(page)
    return output


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`lightning-fp8 report LOG_DIR [-o FILE]`: argv are the arguments after `report`. Prints the path written and
    returns 0; returns 1 (message on stderr) when there is no history to report on."""
    parser = argparse.ArgumentParser(
        prog="lightning-fp8 report",
        description="Write a self-contained HTML precision report (precision map, scales, overflow/underflow heat "
        "maps, fallbacks and rollbacks) from the fp8_history.jsonl FP8ScaleMonitor writes into a log directory.",
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="log directory of the run (or a parent, or the history file)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None, help=f"output HTML file (default: LOG_DIR/{REPORT_FILENAME})")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        out = write_report(args.log_dir, args.output)
    except FileNotFoundError as err:
        print(f"lightning-fp8 report: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


__all__ = ["write_report", "render_report", "main", "load_history", "REPORT_FILENAME"]
