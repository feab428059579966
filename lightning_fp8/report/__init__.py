"""The precision dashboard: one self-contained HTML file (inline SVG, no JavaScript, nothing fetched over the network)
from a run's `fp8_history.jsonl` and its logger output.

    path = write_report("lightning_logs/version_0")          # -> lightning_logs/version_0/fp8_report.html
    $ lightning-fp8 report lightning_logs/version_0 [-o report.html]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from lightning_fp8.report.history import RunHistory, find_history, load_history
from lightning_fp8.report.page import render_page
from lightning_fp8.report.training_log import TrainingLog, read_training_log

REPORT_FILENAME = "fp8_report.html"


def render_report(history: RunHistory, title: Optional[str] = None, log: Optional[TrainingLog] = None) -> str:
    """The report page for a loaded history, as an HTML string. `log`: the run's logger output (default: read from
    the history file's directory)."""
    if log is None:
        log = read_training_log(os.path.dirname(os.path.abspath(history.path)))
    return render_page(history, log, title)


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
        description="Write a self-contained HTML report of an FP8 run (what needs attention, loss and loss scale, FP8 "
        "health maps, events, precision map) from the fp8_history.jsonl FP8ScaleMonitor writes and the logger output.",
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


__all__ = ["write_report", "main"]
