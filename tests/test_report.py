"""The HTML precision report: content, self-containment, the CLI entry point, and a render in headless Chromium."""
import json
import math
import os
import re
import shutil
import subprocess

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from helpers import RegressionModule, loader, trainer
from lightning_fp8 import FP8Precision
from lightning_fp8.callbacks import FP8LayerFallback, FP8ScaleMonitor
from lightning_fp8.report import main, write_report
from lightning_fp8.report.history import load_history

LAYERS = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"]


def synthetic_history(path, steps=40):
    """A history as the callbacks write it: fc2 overflows from step 20 and falls back at 24; a skip and a rollback."""
    lines = [
        {"type": "run", "version": 1, "step": 0, "log_every_n_steps": 2, "sample_size": 4096,
         "recipe": {"format": "hybrid", "scaling": "delayed", "amax_history_len": 16, "margin": 0}},
        {"type": "precision_map", "step": 0, "layers": [
            {"fqn": "embed_proj", "precision": "bf16", "reason": "first linear layer kept in BF16"},
            *({"fqn": f, "precision": "fp8", "reason": "converted"} for f in LAYERS),
            {"fqn": "head", "precision": "bf16", "reason": "last linear layer kept in BF16"},
        ]},
    ]
    for step in range(2, steps + 1, 2):
        layers = {}
        for i, fqn in enumerate(LAYERS):
            if fqn.endswith("fc2") and step > 24:
                layers[fqn] = {"enabled": False}
                continue
            bad = fqn.endswith("fc2") and step >= 20
            amax = (1.0 + 0.1 * i) * (10 ** (step - 18) if bad else 1.0)
            layers[fqn] = {"enabled": True, **{
                role: {"scale": 448.0 / amax, "amax": amax, "overflow": 0.2 if bad else (1e-5 if role == "weight" else 0.0),
                       "underflow": 0.01 * i, "sqnr_db": 5.0 if bad else (31.0 if role != "grad_output" else "inf"),
                       "clipped_casts": 2 if bad else 0, "nonfinite_casts": 0}
                for role in ("input", "weight", "grad_output")}}
        lines.append({"type": "stats", "step": step, "logger_step": step - 1, "layers": layers})
    lines += [
        {"type": "event", "source": "engine", "step": 21, "kind": "skip", "reason": "FP8 amax overflow in blocks.0.mlp.fc2.input",
         "layers": ["blocks.0.mlp.fc2.input"]},
        {"type": "event", "source": "engine", "step": 22, "kind": "rollback", "reason": "non-finite loss", "layers": [],
         "restored_to_step": 20},
        {"type": "event", "source": "fallback", "step": 24, "kind": "fallback", "layers": ["blocks.0.mlp.fc2"],
         "rule": "overflow", "reason": "FP8 overflow originated here in 3 of the last 20 steps (weight)"},
        {"type": "precision_map", "step": 24, "layers": [
            {"fqn": "embed_proj", "precision": "bf16", "reason": "first linear layer kept in BF16"},
            {"fqn": LAYERS[0], "precision": "fp8", "reason": "converted"},
            {"fqn": LAYERS[1], "precision": "fp8", "reason": "converted"},
            {"fqn": LAYERS[2], "precision": "bf16", "reason": "FP8 overflow originated here in 3 of the last 20 steps (weight)"},
            {"fqn": "head", "precision": "bf16", "reason": "last linear layer kept in BF16"},
        ]},
    ]
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write("{not json\n")  # a torn last line (a run killed mid-write) is skipped


def test_history_is_parsed(tmp_path):
    synthetic_history(tmp_path / "fp8_history.jsonl")
    h = load_history(str(tmp_path))
    assert h.fp8_layers == LAYERS and h.layers[0] == "embed_proj"
    assert h.steps == list(range(2, 41, 2)) and h.skipped_lines == 1
    assert h.series(LAYERS[0], "grad_output", "sqnr_db")[0] == (2, math.inf)  # "inf" strings read back
    assert [e["kind"] for e in h.events] == ["skip", "rollback", "fallback"]
    assert h.fallback_step(LAYERS[2]) == 24 and {r["fqn"]: r["precision"] for r in h.precision_map}[LAYERS[2]] == "bf16"


def test_report_content_is_self_contained(tmp_path):
    synthetic_history(tmp_path / "fp8_history.jsonl")
    out = write_report(str(tmp_path))
    assert out == str(tmp_path / "fp8_report.html")
    page = open(out).read()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for fqn in LAYERS + ["embed_proj", "head"]:
        assert fqn in page
    assert "FP8 overflow originated here in 3 of the last 20 steps (weight) (since step 24)" in page
    assert "BF16 (fallback)" in page and "first linear layer kept in BF16" in page
    assert page.count("<svg") == 3 * len(LAYERS) + 2 + 1  # 3 charts per layer, 2 heat maps, 1 timeline
    assert 'class="event fallback"' in page and 'class="event rollback"' in page and 'class="event skip"' in page
    assert page.count('data-label="input"') >= len(LAYERS) * 2
    # offline-safe: no scripts, no external resources (the only URL is the SVG namespace)
    assert "<script" not in page.lower()
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", page)


def test_cli_entry_point(tmp_path, capsys):
    synthetic_history(tmp_path / "fp8_history.jsonl")
    out = tmp_path / "sub" / "r.html"
    assert main([str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.exists()
    assert main([str(tmp_path / "nowhere")]) == 1
    assert "no fp8_history.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])


def test_report_of_a_real_run(tmp_path):
    """Monitor + fallback on the regression model, CSV logger: the log dir's history renders; a parent folder of
    several versions resolves to the newest."""
    torch.manual_seed(0)
    t = trainer(plugins=[FP8Precision()], max_steps=4, logger=CSVLogger(tmp_path, name="run"),
                callbacks=[FP8ScaleMonitor(log_every_n_steps=1), FP8LayerFallback(keep_in_bf16=["net.4"])])
    t.fit(RegressionModule(), loader())
    out = write_report(str(tmp_path / "run"))
    assert out == str(tmp_path / "run" / "version_0" / "fp8_report.html")
    page = open(out).read()
    assert "net.2" in page and "kept in BF16 by FP8LayerFallback" in page and page.count("<polyline") >= 9
    h = load_history(out.replace("fp8_report.html", ""))
    assert h.steps == [1, 2, 3, 4] and [e["kind"] for e in h.events] == ["keep_bf16"]


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (Debian: apt-get install chromium)")
def test_report_renders_in_headless_chromium(tmp_path):
    synthetic_history(tmp_path / "fp8_history.jsonl")
    page = write_report(str(tmp_path))
    url = "file://" + os.path.abspath(page)
    base = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    for fqn in LAYERS:
        assert fqn in html
    assert html.count("<svg") == 3 * len(LAYERS) + 3 and html.count("<polyline") >= 2 * len(LAYERS)
    shot = tmp_path / "report.png"
    run = subprocess.run(base + [f"--screenshot={shot}", "--window-size=1400,2000", url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 2000)
    assert len(png) > 50_000  # a blank page compresses to a few kB; charts and tables do not
