"""The report page: one self-contained HTML string from a RunHistory and the run's logger output.

Top to bottom: summary cards; what needs attention (`health.attention`); the training context (loss, loss scale,
step time, throughput); the three health maps; the events (timeline and table); the precision map; each layer's
scale, amax, range ratio and SQNR. Every chart uses the same step axis and draws the run's events
(`figures.overlay`). Inline CSS and SVG only: no script, no external resource.
"""
from __future__ import annotations

import datetime
from html import escape
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_fp8.report.figures import ROLE_COLOURS, health_maps, is_coarse, layer_charts, overlay, training_charts
from lightning_fp8.report.health import ROLE_NAMES, AttentionItem, Thresholds, attention
from lightning_fp8.report.history import RunHistory
from lightning_fp8.report.names import short_names
from lightning_fp8.report.svg import EVENT_STYLE, timeline
from lightning_fp8.report.training_log import TrainingLog

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:20px 28px;color:#111827;background:#f9fafb}
h1{font-size:21px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #e5e7eb;padding-bottom:3px}
h3{font-size:13.5px;margin:4px 0 4px;font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
.meta{color:#6b7280;font-size:12px;margin-bottom:10px}
.cards{display:flex;gap:10px;flex-wrap:wrap;margin:8px 0}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:7px 14px;min-width:110px}
.card .n{font-size:20px;font-weight:700} .card .l{font-size:10.5px;color:#6b7280;text-transform:uppercase;letter-spacing:.04em}
.card.alert{border-color:#fca5a5;background:#fef2f2}
table{border-collapse:collapse;background:#fff;font-size:12px;width:100%}
th,td{border:1px solid #e5e7eb;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6;font-weight:600}
.fqn,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;white-space:nowrap}
td.layers{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;max-width:460px}
.badge{display:inline-block;border-radius:4px;padding:1px 7px;font-size:11px;font-weight:700}
.fp8{background:#dcfce7;color:#166534} .bf16{background:#fef3c7;color:#92400e} .moved{background:#fee2e2;color:#991b1b}
.problem{background:#fee2e2;color:#991b1b} .near{background:#ffedd5;color:#9a3412} .event{background:#ede9fe;color:#5b21b6}
.role{display:inline-block;border-radius:3px;padding:0 5px;font-size:11px;color:#fff}
ol.attention{margin:6px 0;padding-left:22px;background:#fff;border:1px solid #fecaca;border-radius:8px;font-size:12.5px}
ol.attention li{margin:4px 0}
p.healthy{background:#f0fdf4;border:1px solid #bbf7d0;border-radius:8px;padding:8px 12px;font-size:12.5px;margin:6px 0}
.layer{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:6px 10px 8px;margin:8px 0}
.charts{display:flex;gap:8px;flex-wrap:wrap}
.note{font-size:12px;color:#4b5563;margin:3px 0 6px}
.legend span{display:inline-block;margin-right:12px;font-size:11.5px}
.legend i{display:inline-block;width:12px;height:3px;margin-right:4px;vertical-align:middle}
"""


def _name(fqn: str, names: Dict[str, str]) -> str:
    return f"<span class='fqn' title='{escape(fqn)}'>{escape(names.get(fqn, fqn))}</span>"


def _role(role: Optional[str]) -> str:
    if not role:
        return ""
    colour = ROLE_COLOURS.get(role, "#6b7280")
    return f"<span class='role' style='background:{colour}'>{escape(ROLE_NAMES.get(role, role))}</span>"


def _attention(items: Sequence[AttentionItem], names: Dict[str, str], t: Thresholds) -> List[str]:
    if not items:
        return [
            "<p class='healthy' id='attention-empty'>Nothing needs attention: no tensor went beyond or is within a factor 2 "
            f"of FP8LayerFallback's thresholds ({escape(t.describe('overflow'))}, {escape(t.describe('precision'))}, "
            f"{escape(t.describe('underflow'))}), no non-finite amax, no skipped step, no rollback, no fallback.</p>"
        ]
    out = ["<ol class='attention' id='attention'>"]
    for i in items:
        steps = " ".join(str(s) for s in i.steps)
        who = f"{_name(i.layer, names)} {_role(i.role)} " if i.layer else ""
        out.append(
            f"<li class='attention-item {i.severity}' data-layer='{escape(i.layer or '')}' data-role='{escape(i.role or '')}' "
            f"data-rule='{escape(i.rule or '')}' data-steps='{steps}'><span class='badge {i.severity}'>{i.severity}</span> "
            f"{who}{escape(i.text)}</li>"
        )
    out.append("</ol>")
    return out


def _marker_legend() -> str:
    entries = [("overflow", "\u25bc tensor beyond the overflow threshold"), ("nonfinite", "\u25bc non-finite amax"),
               ("skip", "| skipped step (bottom)"), ("rollback", "band: steps undone by a rollback"),
               ("fallback", "- - fallback"), ("retry", "- - retry"), ("escalate", "- - escalation")]
    return "<div class='legend'>" + "".join(
        f"<span><i style='background:{EVENT_STYLE[k][0]}'></i>{escape(text)}</span>" for k, text in entries) + "</div>"


def _events(history: RunHistory, names: Dict[str, str], x_range) -> List[str]:
    out = [timeline(history.events, x_range, label=lambda n: names.get(n, n))]
    rows: List[Tuple[float, str]] = []
    skips = [e for e in history.events if e.get("kind") == "skip"]
    per_tensor = [e for e in history.events if e.get("kind") in ("overflow", "nonfinite")]
    for e in history.events:
        if e.get("kind") in ("skip", "overflow", "nonfinite"):
            continue
        layers = [str(n) for n in e.get("layers", [])]
        shown = ", ".join(_name(n, names) for n in layers[:3]) + (f", ... ({len(layers)} layers)" if len(layers) > 3 else "")
        rows.append((int(e.get("step", 0)), f"<tr><td>{e.get('step')}</td><td>{escape(str(e.get('kind')))}</td>"
                     f"<td class='layers'>{shown}</td><td>{escape(str(e.get('reason') or ''))}</td></tr>"))
    for e in per_tensor[:40]:
        tensors = ", ".join(
            f"{_name(t['layer'], names)} {_role(t.get('role'))}" + (f" {float(t['ratio']):.3g}x" if "ratio" in t else "")
            for t in e.get("tensors", []) if isinstance(t, dict) and "layer" in t)
        what = "beyond the overflow threshold" if e.get("kind") == "overflow" else "non-finite amax"
        rows.append((int(e.get("step", 0)) + 0.1, f"<tr><td>{e.get('step')}</td><td>{escape(str(e.get('kind')))}</td>"
                     f"<td class='layers'>{tensors}</td><td>{what}</td></tr>"))
    if len(per_tensor) > 40:
        rows.append((1e18, f"<tr><td></td><td>...</td><td></td><td>{len(per_tensor) - 40} more per-tensor events "
                     "(the maps show all of them)</td></tr>"))
    if skips:
        shown = ", ".join(str(e.get("step")) for e in skips[:30]) + (" ..." if len(skips) > 30 else "")
        rows.append((int(skips[0].get("step", 0)) - 0.5, f"<tr><td>{escape(shown)}</td><td>skip &times;{len(skips)}</td>"
                     f"<td></td><td>{escape(str(skips[-1].get('reason') or ''))} (latest)</td></tr>"))
    if rows:
        out.append("<table class='events'><tr><th>step</th><th>event</th><th>layers</th><th>what</th></tr>")
        out.extend(row for _, row in sorted(rows, key=lambda r: r[0]))
        out.append("</table>")
    return out


def _precision_map(history: RunHistory, names: Dict[str, str], moved) -> List[str]:
    if not history.precision_map:
        return ["<p class='note'>No precision map recorded.</p>"]
    out = ["<table class='precision-map'><tr><th>layer</th><th>precision</th><th>recipe</th><th>why</th></tr>"]
    for row in history.precision_map:
        fqn, prec = row.get("fqn", ""), row.get("precision", "")
        cls = "fp8" if prec == "fp8" else ("moved" if fqn in moved else "bf16")
        label = prec.upper() + (" (fallback)" if fqn in moved and prec != "fp8" else "")
        since = history.fallback_step(fqn) if prec != "fp8" and fqn in moved else None
        reason = row.get("reason", "") + (f" (since step {since})" if since is not None else "")
        scaling = (row.get("recipe") or row.get("scaling", "")) if prec == "fp8" else ""  # the recipe, in short
        out.append(f"<tr><td>{_name(fqn, names)}</td><td><span class='badge {cls}'>{escape(label)}</span></td>"
                   f"<td class='scaling'>{escape(str(scaling))}</td><td>{escape(reason)}</td></tr>")
    out.append("</table>")
    return out


def render_page(history: RunHistory, log: TrainingLog, title: Optional[str] = None) -> str:
    title = title or "FP8 precision report"
    t = Thresholds.of(history)
    names = short_names(list(dict.fromkeys(history.layers + history.fp8_layers)))
    marks = history.tensor_marks()
    items = attention(history, t, lambda n: names.get(n, n))
    to_step = history.step_of_logger_step
    logged = [to_step(s) for pts in log.series.values() for s, _ in pts]
    steps = history.steps + [int(e.get("step", 0)) for e in history.events] + logged
    first, last = (min(steps), max(steps)) if steps else (0, 1)
    x_range = (float(min(first, 0)), float(max(last, first + 1)))
    label = lambda n: names.get(n, n)  # noqa: E731
    ov = overlay(history, marks, label)
    moved = {fqn for e in history.events if e.get("kind") == "fallback" for fqn in e.get("layers", [])}
    run = history.runs[-1] if history.runs else {}
    recipe = run.get("recipe") or {}
    count = lambda kind: sum(1 for e in history.events if e.get("kind") == kind)  # noqa: E731
    n_fp8 = sum(1 for r in history.precision_map if r.get("precision") == "fp8")
    problems = sum(1 for i in items if i.severity == "problem")
    meta = (f"{escape(history.path)} &middot; {len(history.steps)} statistics samples"
            + (f" every {run.get('log_every_n_steps')} steps" if run.get("log_every_n_steps") else "")
            + f", steps {x_range[0]:g}&ndash;{x_range[1]:g}"
            + (f" &middot; recipe: format={escape(str(recipe.get('format')))}, scaling={escape(str(recipe.get('scaling')))}, "
               f"amax_history_len={escape(str(recipe.get('amax_history_len')))}, margin={escape(str(recipe.get('margin')))}" if recipe else "")
            + f" &middot; generated {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")
    cards = [(n_fp8, "layers in FP8", False), (len(history.precision_map) - n_fp8, "linears in BF16", False),
             (len(moved), "moved to BF16 in training", bool(moved)), (count("skip"), "skipped steps", bool(count("skip"))),
             (count("rollback"), "rollbacks", bool(count("rollback"))), (problems, "problems", bool(problems))]
    html = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1><div class='meta'>{meta}</div><div class='cards'>",
        *(f"<div class='card{' alert' if alert else ''}'><div class='n'>{n}</div><div class='l'>{escape(text)}</div></div>"
          for n, text, alert in cards),
        "</div><h2>What needs attention</h2>",
        *_attention(items, names, t),
        "<h2>Training</h2>",
        f"<p class='note'>From the run's logger output ({escape(', '.join(log.sources) or 'none')}) and the history file; "
        "x axis: optimizer steps, shared by every chart below." + "".join(f" {escape(n)}." for n in log.notes) + "</p>",
        _marker_legend(),
        "<div class='charts' id='training'>", *training_charts(history, log, x_range, ov), "</div>",
        "<h2>FP8 health</h2>",
        "<p class='note'>One row per FP8 layer, one stripe per tensor role (<b>in</b>put, <b>w</b>eigh<b>t</b>, <b>gr</b>adient, "
        "top to bottom); each sample colours the steps since the previous one. Colours are anchored to FP8LayerFallback's "
        f"thresholds as this run recorded them ({escape(t.source)}): {escape(t.describe('overflow'))}, "
        f"{escape(t.describe('precision'))}, {escape(t.describe('underflow'))}. \"Near\" is within a factor 2 of a threshold "
        "(3 dB for the SQNR). Bars mark per-step events at their exact step, between samples too."
        + (" Large run: consecutive healthy samples are drawn as one span coloured by its worst healthy level."
           if is_coarse(history, history.fp8_layers) else "") + "</p>",
    ]
    layers = history.fp8_layers
    if layers and (history.stats or marks):
        html.extend(health_maps(history, layers, marks, t, names, x_range, ov))
    else:
        html.append("<p class='note'>No statistics recorded.</p>")
    html.append("<h2>Events</h2>")
    html.extend(_events(history, names, x_range))
    html.append("<h2>Precision map</h2>")
    html.extend(_precision_map(history, names, moved))
    html.append("<h2>Scales, amax, range ratio and SQNR per layer</h2>")
    flagged = [i.layer for i in items if i.layer in layers]
    ordered = list(dict.fromkeys(flagged + [f for f in layers if f in moved] + layers))
    html.append("<p class='note'>Layers that need attention first, then the others in model order. " + _role_legend() + "</p>")
    precision_of = {row["fqn"]: row for row in history.precision_map}
    for i, fqn in enumerate(ordered):
        if i == len(dict.fromkeys(flagged)) and len(ordered) > 12 and i > 0:
            html.append(f"<details><summary>{len(ordered) - i} more layers</summary>")
        row = precision_of.get(fqn, {})
        prec = row.get("precision", "fp8")
        badge = ("<span class='badge fp8'>FP8</span>" if prec == "fp8" else
                 f"<span class='badge {'moved' if fqn in moved else 'bf16'}'>BF16</span> <span class='note'>{escape(row.get('reason', ''))}</span>")
        html.append(f"<div class='layer' id='layer-{escape(fqn)}'><h3 title='{escape(fqn)}'>{escape(names.get(fqn, fqn))} {badge}</h3>"
                    f"<div class='charts'>")
        html.extend(layer_charts(history, fqn, x_range, overlay(history, marks, label, layer=fqn), t, marks))
        html.append("</div></div>")
    if len(ordered) > 12 and len(dict.fromkeys(flagged)) < len(ordered):
        html.append("</details>")
    if not layers:
        html.append("<p class='note'>No FP8 layers.</p>")
    if history.skipped_lines:
        html.append(f"<p class='note'>{history.skipped_lines} malformed history lines were skipped.</p>")
    html.append("</body></html>")
    return "\n".join(html)


def _role_legend() -> str:
    return "".join(f"<span class='legend'><span><i style='background:{c}'></i>{escape(ROLE_NAMES[r])}</span></span>"
                   for r, c in ROLE_COLOURS.items())
