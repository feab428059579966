"""The report of real short runs (Lightning Trainer, FP8Precision, the callbacks with their default arguments, CSV
logger): a fault planted between two monitor samples shows at its step, layer and role; a healthy run needs no
attention; loss, loss scale and step time share the step axis; the page renders in headless Chromium."""
import json
import os
import re
import subprocess

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger

from support.helpers import loader, trainer
from test_callbacks import Deep, GrowWeight, _HookAt
from lightning_fp8 import FP8Precision
from lightning_fp8.callbacks import FP8LayerFallback, FP8ScaleMonitor
from lightning_fp8.report import write_report

CHROMIUM = "/usr/bin/chromium"
PROBLEM_CELLS = re.compile(r'class="cell (near|beyond|far|nonfinite)"')


def history(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def fit(tmp_path, name, callbacks, steps, **kwargs):
    torch.manual_seed(0)
    model = Deep()
    t = trainer(plugins=[FP8Precision()], max_steps=steps, max_epochs=-1, logger=CSVLogger(tmp_path, name=name),
                callbacks=callbacks, **kwargs)
    t.fit(model, loader())
    return t


@pytest.fixture(scope="module")
def clipping_fault(tmp_path_factory):
    """net.6's weight x10 before each of steps 12-14 (completed-step count 12, 13, 14); the monitor samples every 10
    steps (10, 20): the fault lies between two samples, and the fallback moves net.6 at step 14."""
    tmp_path = tmp_path_factory.mktemp("fault")
    t = fit(tmp_path, "fault", [GrowWeight("net.6", start=11, steps=3, factor=30.0), FP8ScaleMonitor(), FP8LayerFallback(escalate_to=None)],
            steps=30, log_every_n_steps=10)
    return t.log_dir, write_report(t.log_dir)


def test_a_clipping_fault_between_samples_shows_its_step_layer_and_role(clipping_fault):
    log_dir, page_path = clipping_fault
    records = history(os.path.join(log_dir, "fp8_history.jsonl"))
    samples = [r["step"] for r in records if r["type"] == "stats"]
    assert samples == [1, 10, 20, 30]  # nothing sampled during the fault
    page = open(page_path).read()
    item = re.search(r"class='attention-item problem' data-layer='net.6' data-role='weight' data-rule='overflow' "
                     r"data-steps='([0-9 ]+)'>(.*?)</li>", page)
    assert item is not None and item.group(1) == "12 13 14", page[page.find("id='attention'"):][:3000]
    assert "overflow_factor 8x" in item.group(2)
    for step in (12, 13, 14):
        assert f'class="mark overflow" data-layer="net.6" data-role="weight" data-step="{step}"' in page
    assert "moved to BF16 at step 14" in page and 'class="state bf16" data-layer="net.6"' in page


def test_loss_loss_scale_and_step_time_share_the_step_axis(clipping_fault):
    _, page_path = clipping_fault
    page = open(page_path).read()
    svgs = {m.group(1): m.group(0) for m in re.finditer(r'<svg [^>]*data-chart="([^"]+)"[^>]*>.*?</svg>', page, re.S)}
    axis = {name: re.search(r'data-x0="([^"]+)" data-x1="([^"]+)"', svg).groups() for name, svg in svgs.items()}
    assert axis["loss"] == axis["loss_scale"] == axis["step_time"] == axis["map-overflow"] == ("0", "30")
    assert 'data-label="train_loss"' in svgs["loss"] and "<polyline" in svgs["loss"]  # from metrics.csv
    assert 'data-label="loss scale (logger)"' in svgs["loss_scale"]  # the plugin's fp8/loss_scale
    assert 'data-label="FP8ScaleMonitor"' in svgs["step_time"] and "<polyline" in svgs["step_time"]
    for name in ("loss", "loss_scale", "step_time"):  # the fault is drawn on every chart at its steps
        assert re.search(r'class="event-mark overflow" data-step="13"', svgs[name]), name
        assert re.search(r'class="event-line fallback" data-step="14"', svgs[name]), name


class InfInput(Callback):
    """Planted fault: one inf in net.4's input before step 7 (completed-step count)."""

    def __init__(self):
        self.step = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def hook(self, module, args):
        if self.step == 6:
            x = args[0].clone()
            x[0, 0] = float("inf")
            return (x,)


def test_a_nonfinite_fault_between_samples_shows_its_step_layer_and_role(tmp_path):
    """Monitor only (no fallback): the engine skips and rolls back; the monitor records, after that step, the tensors
    whose amax was non-finite; the page names step 7, net.4 and its input first."""
    fault = InfInput()
    t = fit(tmp_path, "nan", [fault, _HookAt("net.4", fault.hook), FP8ScaleMonitor(log_every_n_steps=5)], steps=12)
    records = history(os.path.join(t.log_dir, "fp8_history.jsonl"))
    assert [r["step"] for r in records if r["type"] == "stats"] == [1, 5, 10]
    nonfinite = [r for r in records if r["type"] == "event" and r["kind"] == "nonfinite"]
    assert [r["step"] for r in nonfinite] == [7] and {"layer": "net.4", "role": "input"} in nonfinite[0]["tensors"]
    page = open(write_report(t.log_dir)).read()
    item = re.search(r"class='attention-item problem' data-layer='net.4' data-role='input' data-rule='engine' "
                     r"data-steps='7'>(.*?)</li>", page)
    assert item is not None and "skipped" in item.group(1) and "first in forward order" in item.group(1)
    assert 'class="mark nonfinite" data-layer="net.4" data-role="input" data-step="7"' in page


def test_a_healthy_run_needs_no_attention(tmp_path):
    """The callbacks' default arguments; the Trainer logs every 5 steps, so the monitor (which follows it) samples 7
    times in 30 steps, the early ones included, where healthy ratios peak: stricter than the default 50. Nothing
    listed, no cell at or beyond "near", no mark; loss, step time and tokens/s (Lightning's ThroughputMonitor) are
    on the page."""
    throughput = ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel())
    t = fit(tmp_path, "healthy", [FP8ScaleMonitor(), FP8LayerFallback(), throughput], steps=30, log_every_n_steps=5)
    records = history(os.path.join(t.log_dir, "fp8_history.jsonl"))
    assert [r["step"] for r in records if r["type"] == "stats"] == [1, 5, 10, 15, 20, 25, 30]
    page = open(write_report(t.log_dir)).read()
    assert "id='attention-empty'" in page and "attention-item" not in page
    assert 'class="cell ok"' in page and not PROBLEM_CELLS.search(page) and 'class="mark' not in page
    assert 'data-label="train_loss"' in page and 'data-label="tokens/s"' in page


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"headless Chromium not installed at {CHROMIUM} "
                    "(Debian: apt-get install chromium); the structural checks above run without it")
def test_report_renders_in_headless_chromium(clipping_fault, tmp_path):
    _, page_path = clipping_fault
    url = "file://" + os.path.abspath(page_path)
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout  # what the browser built: the loss chart, the events, the attention list
    assert re.search(r'<svg [^>]*data-chart="loss"', html) and 'data-label="train_loss"' in html
    assert re.search(r'<svg [^>]*data-chart="events"', html) and 'class="event fallback" data-step="14"' in html
    assert re.search(r'<ol class="attention" id="attention">', html) and 'data-layer="net.6" data-role="weight"' in html
    shot = tmp_path / "report.png"
    run = subprocess.run(base + [f"--screenshot={shot}", "--window-size=1400,2000", url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1400, 2000)
    assert len(png) > 50_000  # a blank page compresses to a few kB; charts and tables do not
