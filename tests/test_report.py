"""The HTML report from a synthetic history: parsing, thresholds read from the run, the escalate design, short names,
the logger output (CSV, TensorBoard), self-containment and the CLI. Real runs: tests/test_report_runs.py."""
import json
import math
import re
import sys

import pytest

from lightning_fp8.report import main, render_report, write_report
from lightning_fp8.report.health import Thresholds, attention, level
from lightning_fp8.report.history import load_history
from lightning_fp8.report.names import short_names
from lightning_fp8.report.training_log import read_training_log

LAYERS = ["model.blocks.0.attn.qkv", "model.blocks.0.mlp.fc1", "model.blocks.0.mlp.fc2"]
FC2 = LAYERS[2]


def synthetic_history(path, steps=40, overflow_factor=8.0, extra_events=()):
    """A history as the callbacks write it: samples every 4 steps; fc2's weight overflows at steps 21-23, between the
    samples at 20 and 24 (per-step overflow events), and it falls back at 23; a NaN at step 30 (skip, rollback,
    non-finite amaxes in fc1's input and qkv's gradient)."""
    lines = [
        {"type": "run", "version": 2, "step": 0, "log_every_n_steps": 4, "sample_size": 4096,
         "recipe": {"format": "hybrid", "scaling": "delayed", "amax_history_len": 16, "margin": 0},
         "thresholds": {"source": "FP8LayerFallback", "overflow_factor": overflow_factor, "min_sqnr_db": 10.0,
                        "max_underflow": None}},
        {"type": "precision_map", "step": 0, "layers": [
            {"fqn": "model.embed_proj", "precision": "bf16", "reason": "first linear layer kept in BF16"},
            *({"fqn": f, "precision": "fp8", "reason": "converted"} for f in LAYERS),
            {"fqn": "model.head", "precision": "bf16", "reason": "last linear layer kept in BF16"},
        ]},
    ]
    for step in [1] + list(range(4, steps + 1, 4)):
        layers = {}
        for i, fqn in enumerate(LAYERS):
            if fqn == FC2 and step > 23:
                layers[fqn] = {"enabled": False}
                continue
            layers[fqn] = {"enabled": True, **{
                role: {"scale": 100.0, "amax": 4.0, "range_ratio": 0.9 if role != "weight" else 1.02, "overflow": 0.0,
                       "underflow": 0.001 * i, "sqnr_db": 31.0 if role != "grad_output" else "inf",
                       "clipped_casts": 0, "nonfinite_casts": 0}
                for role in ("input", "weight", "grad_output")}}
        lines.append({"type": "stats", "step": step, "logger_step": step - 1, "layers": layers, "loss_scale": 1.0,
                      "step_time_s": 0.1, "timed_steps": 4})
    lines += [
        *({"type": "event", "source": "fallback", "kind": "overflow", "step": s, "layers": [FC2],
           "tensors": [{"layer": FC2, "role": "weight", "ratio": r, "origin": FC2}], "threshold": overflow_factor}
          for s, r in ((21, 10.0), (22, 100.0), (23, 1000.0))),
        {"type": "event", "source": "fallback", "step": 23, "kind": "fallback", "layers": [FC2], "rule": "overflow",
         "roles": ["weight"], "reason": "FP8 overflow originated here in 3 of the last 20 steps (weight)"},
        {"type": "precision_map", "step": 23, "layers": [
            {"fqn": "model.embed_proj", "precision": "bf16", "reason": "first linear layer kept in BF16"},
            {"fqn": LAYERS[0], "precision": "fp8", "reason": "converted"},
            {"fqn": LAYERS[1], "precision": "fp8", "reason": "converted"},
            {"fqn": FC2, "precision": "bf16", "reason": "FP8 overflow originated here in 3 of the last 20 steps (weight)"},
            {"fqn": "model.head", "precision": "bf16", "reason": "last linear layer kept in BF16"},
        ]},
        {"type": "event", "source": "engine", "step": 30, "kind": "skip", "reason": "non-finite loss", "layers": [],
         "loss_scale": 1.0},
        {"type": "event", "source": "engine", "kind": "nonfinite", "step": 30, "layers": [LAYERS[0], LAYERS[1]],
         "tensors": [{"layer": LAYERS[0], "role": "grad_output"}, {"layer": LAYERS[1], "role": "input"}],
         "skipped": True, "loss_scale": 1.0},
        {"type": "event", "source": "engine", "step": 30, "kind": "rollback", "reason": "non-finite loss", "layers": [],
         "restored_to_step": 28},
        *extra_events,
    ]
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write("{not json\n")  # a torn last line (a run killed mid-write) is skipped


def write_csv(path, rows):
    names = sorted({k for r in rows for k in r})
    with open(path, "w") as f:
        f.write(",".join(names) + "\n")
        for r in rows:
            f.write(",".join(str(r.get(n, "")) for n in names) + "\n")


def test_history_is_parsed(tmp_path):
    synthetic_history(tmp_path / "fp8_history.jsonl")
    h = load_history(str(tmp_path))
    assert h.fp8_layers == LAYERS and h.layers[0] == "model.embed_proj"
    assert h.steps == [1] + list(range(4, 41, 4)) and h.skipped_lines == 1
    assert h.series(LAYERS[0], "grad_output", "sqnr_db")[0] == (1, math.inf)  # "inf" strings read back
    assert h.thresholds["overflow_factor"] == 8.0
    marks = [(m.step, m.layer, m.role, m.kind) for m in h.tensor_marks()]
    assert marks == [(21, FC2, "weight", "overflow"), (22, FC2, "weight", "overflow"), (23, FC2, "weight", "overflow"),
                     (30, LAYERS[0], "grad_output", "nonfinite"), (30, LAYERS[1], "input", "nonfinite")]
    assert [(s.step, s.precision, s.kind) for s in h.layer_states(FC2)] == [(0, "fp8", "start"), (23, "bf16", "fallback")]
    assert h.step_of_logger_step(19) == 20 and h.step_of_logger_step(100) == 101  # logger rows onto optimizer steps


def test_levels_and_attention_are_anchored_to_the_recorded_thresholds(tmp_path):
    """The same history with another recorded overflow_factor colours and lists differently: nothing is hard-coded."""
    synthetic_history(tmp_path / "a.jsonl")
    t = Thresholds.of(load_history(str(tmp_path / "a.jsonl")))
    assert [level("overflow", r, t) for r in (0.9, 3.0, 6.0, 9.0, 40.0, math.inf)] == [
        "ok", "tolerated", "near", "beyond", "far", "nonfinite"]
    assert [level("precision", v, t) for v in (31.0, 15.0, 11.0, 8.0, 1.0, math.inf)] == [
        "ok", "tolerated", "near", "beyond", "far", "ok"]
    assert level("underflow", 0.3, t) == "info" and level("underflow", 0.0, t) == "ok"  # rule off: never a problem
    synthetic_history(tmp_path / "b.jsonl", overflow_factor=2.0)
    t2 = Thresholds.of(load_history(str(tmp_path / "b.jsonl")))
    assert level("overflow", 6.0, t2) == "beyond" and level("overflow", 1.02, t2) == "near"
    items = attention(load_history(str(tmp_path / "a.jsonl")), t)
    fc2 = [i for i in items if i.layer == FC2 and i.rule == "overflow"]
    assert len(fc2) == 1 and fc2[0].role == "weight" and fc2[0].steps == [21, 22, 23]
    assert "amax up to 1e+03x" in fc2[0].text and "overflow_factor 8x" in fc2[0].text
    engine = [i for i in items if i.rule == "engine"]
    assert len(engine) == 1 and engine[0].steps == [30] and (engine[0].layer, engine[0].role) == (LAYERS[1], "input")
    assert "skipped" in engine[0].text and "rolled back to the snapshot of step 28" in engine[0].text
    # with factor 2 every weight sample (ratio 1.02) is "near" at its latest sample
    items2 = attention(load_history(str(tmp_path / "b.jsonl")), t2)
    assert {(i.layer, i.role) for i in items2 if i.severity == "near"} == {(LAYERS[0], "weight"), (LAYERS[1], "weight")}


def test_report_content_is_self_contained(tmp_path):
    synthetic_history(tmp_path / "fp8_history.jsonl")
    write_csv(tmp_path / "metrics.csv", [{"step": s, "epoch": 0, "train_loss": 3.0 - s / 20, "fp8/loss_scale": 1.0}
                                         for s in range(3, 40, 4)] + [{"step": 19, "epoch": 0, "val_loss": 2.5}])
    out = write_report(str(tmp_path))
    assert out == str(tmp_path / "fp8_report.html")
    page = open(out).read()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for fqn in LAYERS + ["model.embed_proj", "model.head"]:
        assert f"title='{fqn}'" in page  # the full name on hover
    assert ">blocks.0.mlp.fc2<" in page  # the shared "model." prefix is dropped in the short name
    assert "FP8 overflow originated here in 3 of the last 20 steps (weight) (since step 23)" in page
    # the attention list names the fault between samples: step, layer and role
    assert re.search(rf"class='attention-item problem' data-layer='{re.escape(FC2)}' data-role='weight' "
                     r"data-rule='overflow' data-steps='21 22 23'", page)
    # the overflow map marks it at its exact steps (no sample at 21-23), in fc2's weight stripe
    for step in (21, 22, 23):
        assert f'class="mark overflow" data-layer="{FC2}" data-role="weight" data-step="{step}"' in page
    assert 'class="state bf16" data-layer="' + FC2 + '"' in page
    # the training charts and the maps share the step axis; the loss chart has train and val series
    axes = set(re.findall(r'data-chart="([^"]+)" data-x0="([^"]+)" data-x1="([^"]+)"', page))
    charts = {name for name, _, _ in axes}
    assert {"loss", "loss_scale", "step_time", "throughput", "map-overflow", "map-precision", "map-underflow", "events"} <= charts
    assert len({(x0, x1) for _, x0, x1 in axes}) == 1
    assert 'data-label="train_loss"' in page and 'data-label="val_loss"' in page and 'data-label="FP8ScaleMonitor"' in page
    assert 'class="band"' in page and 'class="event-tick skip" data-step="30"' in page  # rollback band, skip tick
    # offline-safe: no scripts, no external resources (the only URL is the SVG namespace)
    assert "<script" not in page.lower()
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", page)


def test_an_escalation_shows_in_the_map_without_code_for_it(tmp_path):
    """An "escalate" event with the new scaling (the record a recipe escalation writes) changes the layer's row from
    its step on and is listed, with no code specific to it beyond the event's fields."""
    escalate = {"type": "event", "source": "fallback", "step": 12, "kind": "escalate", "layers": [LAYERS[1]],
                "roles": ["input"], "scaling": "rowwise", "reason": "overflow in 3 of the last 20 steps"}
    synthetic_history(tmp_path / "fp8_history.jsonl", extra_events=[escalate])
    h = load_history(str(tmp_path))
    assert [(s.step, s.precision, s.scaling) for s in h.layer_states(LAYERS[1])] == [(0, "fp8", None), (12, "fp8", "rowwise")]
    page = render_report(h)
    assert f'class="state escalated" data-layer="{LAYERS[1]}" data-scaling="rowwise"' in page
    assert f'class="state-change escalate" data-layer="{LAYERS[1]}" data-step="12"' in page
    assert "escalated to rowwise scaling at step 12" in page


def test_a_saturated_unscaled_gradient_is_listed_not_marked_non_finite(tmp_path):
    """A "saturation" event (an unscaled gradient beyond E5M2's max: the loss scaler's overflow) and the engine's skip
    naming the same tensor: the page lists the event; no inf/NaN mark is derived from the skip's names."""
    skip = {"type": "event", "source": "engine", "step": 12, "kind": "skip", "layers": [f"{LAYERS[1]}.grad_output"],
            "reason": f"FP8 amax overflow in {LAYERS[1]}.grad_output", "loss_scale": 128.0}
    saturation = {"type": "event", "source": "engine", "step": 12, "kind": "saturation", "layers": [LAYERS[1]],
                  "tensors": [{"layer": LAYERS[1], "role": "grad_output", "ratio": 1.5, "amax": 86016.0}],
                  "reason": "amax beyond the FP8 format's max in ...grad_output, cast without a scale", "skipped": True}
    synthetic_history(tmp_path / "fp8_history.jsonl", extra_events=[skip, saturation])
    h = load_history(str(tmp_path))
    assert not [m for m in h.tensor_marks() if m.step == 12]
    page = render_report(h)
    assert "<td>saturation</td>" in page and "cast without a scale" in page
    # without the monitor's event, the skip's names still mark the tensor (a history written before it existed)
    synthetic_history(tmp_path / "old.jsonl", extra_events=[skip])
    marks = load_history(str(tmp_path / "old.jsonl")).tensor_marks()
    assert [(m.step, m.layer, m.role, m.kind) for m in marks if m.step == 12] == [
        (12, LAYERS[1], "grad_output", "nonfinite")]


def test_the_precision_map_table_shows_each_fp8_layers_scaling(tmp_path):
    """The precision-map record's rows carry each FP8 layer's scaling (callbacks/hub.py `precision_rows`); the table
    shows it, and nothing for BF16 layers."""
    escalate = {"type": "event", "source": "fallback", "step": 12, "kind": "escalate", "layers": [LAYERS[1]],
                "roles": ["input"], "scaling": "blockwise", "reason": "90% of the non-zero input values flushed"}
    final_map = {"type": "precision_map", "step": 12, "layers": [
        {"fqn": "model.embed_proj", "precision": "bf16", "reason": "first linear layer kept in BF16"},
        *({"fqn": f, "precision": "fp8", "reason": "converted", "scaling": "blockwise" if f == LAYERS[1] else "delayed"}
          for f in LAYERS)]}
    synthetic_history(tmp_path / "fp8_history.jsonl", extra_events=[escalate, final_map])
    page = render_report(load_history(str(tmp_path)))
    table = page[page.index("<table class='precision-map'>"):]
    table = table[: table.index("</table>")]
    assert "<th>recipe</th>" in table
    assert table.count("<td class='scaling'>blockwise</td>") == 1 and "<td class='scaling'>delayed</td>" in table
    assert "<td class='scaling'></td>" in table  # the BF16 layer


def test_short_names():
    names = short_names(["model.model.layers.0.self_attn.q_proj", "model.model.layers.17.mlp.down_proj", "model.lm_head"])
    assert names == {"model.model.layers.0.self_attn.q_proj": "layers.0.self_attn.q_proj",
                     "model.model.layers.17.mlp.down_proj": "layers.17.mlp.down_proj", "model.lm_head": "lm_head"}
    assert short_names(["net.2", "net.4"]) == {"net.2": "net.2", "net.4": "net.4"}  # never a bare index
    long = short_names(["a.layers.3." + "x" * 60, "a.head"])["a.layers.3." + "x" * 60]
    assert len(long) == 30 and "\u2026" in long
    # names that would collide keep their longer form
    assert len(set(short_names(["a.layers.0." + "y" * 40 + "1", "a.layers.0." + "y" * 40 + "2"]).values())) == 2


def test_tensorboard_files_are_read_or_skipped_with_a_note(tmp_path, monkeypatch):
    (tmp_path / "events.out.tfevents.123.host").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)  # not installed
    log = read_training_log(str(tmp_path))
    assert log.series == {} and "tensorboard` package is not installed" in log.notes[0]


def test_tensorboard_scalars_are_read(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is optional (pip install tensorboard)")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(5):
        writer.add_scalar("train_loss", 2.0 - 0.1 * step, step)
        writer.add_scalar("fp8/loss_scale", 256.0, step)
    writer.close()
    log = read_training_log(str(tmp_path))
    assert [v for _, v in log.losses()["train_loss"]] == pytest.approx([2.0, 1.9, 1.8, 1.7, 1.6])
    assert log.loss_scale()[-1] == (4.0, 256.0)


def test_cli_entry_point(tmp_path, capsys):
    synthetic_history(tmp_path / "fp8_history.jsonl")
    out = tmp_path / "sub" / "r.html"
    assert main([str(tmp_path), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.exists()
    assert main([str(tmp_path / "nowhere")]) == 1
    assert "no fp8_history.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])


@pytest.mark.parametrize("coarse", [False, True])
def test_healthy_cells_merge_problem_cells_do_not(tmp_path, monkeypatch, coarse):
    """Consecutive samples of the same healthy level are one rectangle; in a large run (here: COARSE_CELLS lowered)
    any consecutive healthy samples are, coloured by the worst; a sample beyond a threshold always keeps its own."""
    from lightning_fp8.report import health_map

    monkeypatch.setattr(health_map, "COARSE_CELLS", 100 if coarse else 10**9)
    layers = [f"model.layers.{i}.mlp.fc{j}" for i in range(12) for j in (1, 2)]
    lines = [{"type": "run", "version": 2, "thresholds": {"source": "FP8LayerFallback", "overflow_factor": 8.0,
                                                          "min_sqnr_db": 10.0, "max_underflow": None}},
             {"type": "precision_map", "step": 0, "layers": [{"fqn": f, "precision": "fp8", "reason": ""} for f in layers]}]
    for k, step in enumerate(range(10, 501, 10)):
        stats = {"scale": 1.0, "amax": 1.0, "overflow": 0.0, "underflow": 0.0, "sqnr_db": 30.0}
        entry = {f: {"enabled": True, **{r: {**stats, "range_ratio": (0.9, 1.05)[k % 2]} for r in ("input", "weight", "grad_output")}}
                 for f in layers}
        if step == 250:
            entry[layers[3]]["weight"]["range_ratio"] = 20.0
        lines.append({"type": "stats", "step": step, "logger_step": step - 1, "layers": entry})
    with open(tmp_path / "fp8_history.jsonl", "w") as f:
        f.write("\n".join(json.dumps(line) for line in lines) + "\n")
    page = open(write_report(str(tmp_path))).read()
    overflow_map = re.search(r'<svg [^>]*data-chart="map-overflow".*?</svg>', page, re.S).group(0)
    cells = len(layers) * 3
    if coarse:  # one span per row and role, two around the fault
        assert overflow_map.count('class="cell tolerated"') == cells - 1 + 2 and 'class="cell ok"' not in overflow_map
        assert "Large run: consecutive healthy samples" in page
    else:  # alternating ok / tolerated samples: one rectangle each (25 + 25 per row and role; the fault replaced an ok)
        assert overflow_map.count('class="cell tolerated"') == 25 * cells and overflow_map.count('class="cell ok"') == 25 * cells - 1
    assert overflow_map.count('class="cell beyond"') == 1
    assert f'class="cell beyond" data-layer="{layers[3]}" data-role="weight" data-step="250"' in overflow_map


def test_a_version_1_history_still_renders(tmp_path):
    """Histories written before thresholds and range ratios were recorded: the page renders, says the colours are not
    anchored, judges nothing against a threshold, and still lists the engine's step and the fallback."""
    synthetic_history(tmp_path / "v2.jsonl")
    with open(tmp_path / "v2.jsonl") as f, open(tmp_path / "fp8_history.jsonl", "w") as out:
        for line in f:
            if not line.startswith("{not"):
                record = json.loads(line)
                record.pop("thresholds", None)
                for entry in record.get("layers", {}).values() if isinstance(record.get("layers"), dict) else ():
                    for role in ("input", "weight", "grad_output"):
                        entry.get(role, {}).pop("range_ratio", None)
                out.write(json.dumps(record) + "\n")
    page = open(write_report(str(tmp_path))).read()
    assert "not recorded (history written by an older version)" in page
    assert not re.search(r'class="cell (near|beyond|far)"', page)
    assert "data-rule='engine' data-steps='30'" in page and "data-rule='fallback'" in page


def test_each_layers_recipe_goes_from_the_model_to_the_history_to_the_table(tmp_path):
    """callbacks/hub.py `precision_rows` records each FP8 layer's recipe label (a per-layer nvfp4 recipe with a BF16
    weight gradient here), and the report's table shows that label, not just the scaling."""
    from support.helpers import RegressionModule

    from lightning_fp8 import FP8Recipe, convert_to_fp8
    from lightning_fp8.callbacks.hub import precision_rows

    special = FP8Recipe(scaling="nvfp4", weight_grad="high_precision")
    model = convert_to_fp8(RegressionModule().net, layer_recipes={"2": special}, verbose=False)
    rows = {r["fqn"]: r for r in precision_rows(model)}
    assert (rows["2"]["recipe"], rows["2"]["scaling"]) == ("nvfp4, wgrad bf16", "nvfp4")
    assert rows["4"]["recipe"] == "delayed" and "recipe" not in rows["0"]  # the first layer: BF16
    final_map = {"type": "precision_map", "step": 12, "layers": list(rows.values())}
    synthetic_history(tmp_path / "fp8_history.jsonl", extra_events=[final_map])
    page = render_report(load_history(str(tmp_path)))
    assert "<td class='scaling'>nvfp4, wgrad bf16</td>" in page and "<td class='scaling'>delayed</td>" in page
