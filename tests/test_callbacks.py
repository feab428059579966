"""FP8ScaleMonitor and FP8LayerFallback with a real Lightning Trainer on CPU, and the statistics behind them.

(Length: two callbacks that share the StatsHub, tested through the same real-Trainer fixtures.)
"""
import csv
import json
import logging
import math
import os
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from support.helpers import RegressionModule, loader, sqnr_db, trainer
from lightning_fp8 import FP8Linear, FP8Precision, FP8Recipe, precision_map
from lightning_fp8.callbacks import FP8Calibration, FP8LayerFallback, FP8ScaleMonitor
from lightning_fp8.numerics import E4M3, E5M2, dequantize, quantize, scale_from_amax
from lightning_fp8.numerics.stats import quantization_stats, sample_elements

ROLES = ("input", "weight", "grad_output")
STATS = ("scale", "amax", "range_ratio", "overflow", "underflow", "sqnr_db")


class Deep(RegressionModule):
    """Six linears without normalisation: net.2, net.4, net.6, net.8 run in FP8 (first and last stay BF16), and
    whatever happens in one layer reaches every layer after it."""

    def __init__(self, lr=1e-2):
        super().__init__(lr=lr)
        d, h = 32, 64
        layers = [nn.Linear(d, h), nn.GELU()]
        for _ in range(4):
            layers += [nn.Linear(h, h), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(h, d))


class GrowWeight(Callback):
    """Planted fault: multiply one layer's weight by `factor` before each of `steps` optimizer steps."""

    def __init__(self, fqn, start, steps, factor):
        self.fqn, self.start, self.steps, self.factor = fqn, start, steps, factor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.start <= trainer.global_step < self.start + self.steps:
            with torch.no_grad():
                pl_module.get_submodule(self.fqn).weight.mul_(self.factor)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def history(log_dir):
    with open(log_dir / "fp8_history.jsonl") as f:
        return [json.loads(line) for line in f]


def fp8_names(model):
    return [fqn for fqn, m in model.named_modules() if isinstance(m, FP8Linear)]


# -- numerics/stats.py ---------------------------------------------------------------------------------------------
def test_quantization_stats_by_hand():
    x = torch.tensor([1000.0, 0.5, 1e-9, 0.0, -3.0, float("inf")])
    st = quantization_stats(x, torch.tensor(1.0), E4M3, sample_size=0)  # sample_size 0: every element
    assert st.numel.item() == 6
    assert st.overflow.item() == 2  # 1000 > 448 and inf
    assert st.overflow_fraction().item() == pytest.approx(2 / 6)
    assert st.nonzero.item() == 4  # inf is not finite, 0 is zero
    assert st.underflow.item() == 1  # 1e-9 is flushed to zero
    assert st.underflow_fraction().item() == pytest.approx(0.25)
    finite = torch.tensor([1000.0, 0.5, 1e-9, 0.0, -3.0])
    roundtrip = dequantize(quantize(finite, torch.tensor(1.0), E4M3), torch.tensor(1.0))
    assert st.sqnr_db().item() == pytest.approx(sqnr_db(finite, roundtrip), abs=1e-6)
    assert st.amax.item() == math.inf
    # with a scale that fits the range nothing overflows and the SQNR is the format's
    y = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    scale = torch.tensor(E5M2.max) / y.abs().max()
    st = quantization_stats(y, scale, E5M2)
    assert st.overflow.item() == 0 and st.underflow.item() == 0
    expected = sqnr_db(y, dequantize(quantize(y, scale, E5M2), scale.reciprocal()))
    assert st.sqnr_db().item() == pytest.approx(expected, abs=1e-6)
    assert 20 < expected < 30  # two mantissa bits


def test_sampling_uses_its_own_generator():
    x = torch.randn(100_000)
    state = torch.get_rng_state()
    gen = torch.Generator().manual_seed(0)
    a = sample_elements(x, 1000, gen)
    quantization_stats(x, torch.tensor(10.0), E4M3, sample_size=1000, generator=gen)
    assert torch.equal(torch.get_rng_state(), state)  # training's random stream untouched
    assert a.numel() == 1000 and torch.equal(sample_elements(x, 1000, torch.Generator().manual_seed(0)), a)
    assert sample_elements(x[:10], 1000).numel() == 10  # small tensors: all elements


# -- FP8ScaleMonitor -----------------------------------------------------------------------------------------------
def test_default_run_log_is_readable_and_quiet(tmp_path):
    """What a user sees by default: 7 metrics.csv columns per FP8 layer (the full set: 25): the three scale factors,
    fp8_enabled and the worst figures, the run's worst values, and no "Precision fp8-mixed is not supported by the
    model summary" warning (the summary is enabled, as by default)."""
    logger = CSVLogger(tmp_path, name="run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded, however often it was seen before
        t = trainer(plugins=[FP8Precision()], max_steps=3, logger=logger, log_every_n_steps=1,
                    enable_model_summary=True, callbacks=[FP8ScaleMonitor()])
        t.fit(RegressionModule(), loader())
    assert not [w for w in caught if "model summary" in str(w.message)]
    columns = set(read_csv(tmp_path / "run" / "version_0" / "metrics.csv")[0])
    per_layer = sorted(c for c in columns if c.startswith("fp8/net."))
    assert per_layer == [f"fp8/{fqn}/{name}" for fqn in ("net.2", "net.4")
                         for name in ("fp8_enabled", "grad_output/scale", "input/scale", "weight/scale",
                                      "worst_overflow", "worst_sqnr_db", "worst_underflow")]
    assert {"fp8/worst_sqnr_db", "fp8/worst_overflow", "fp8/loss_scale"} <= columns
    history_layers = history(tmp_path / "run" / "version_0")[-2]["layers"]  # the history file keeps every statistic
    assert set(history_layers["net.2"]["grad_output"]) >= set(STATS)


def test_monitor_logs_per_layer_metrics_to_csv(tmp_path):
    seen = {}

    class ObserverSpy(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen[trainer.global_step] = [m.fp8_observer is not None for m in pl_module.modules() if isinstance(m, FP8Linear)]

    model = RegressionModule()
    logger = CSVLogger(tmp_path, name="run")
    monitor = FP8ScaleMonitor(log_every_n_steps=2, per_layer="full")
    t = trainer(plugins=[FP8Precision()], max_steps=6, logger=logger, log_every_n_steps=2, callbacks=[monitor, ObserverSpy()])
    t.fit(model, loader())
    layers = fp8_names(model)
    assert layers == ["net.2", "net.4"]
    # observers only on the sampled steps (the first, then every 2nd), removed afterwards
    assert {step: all(flags) for step, flags in seen.items()} == {0: True, 1: True, 2: False, 3: True, 4: False, 5: True}
    assert all(m.fp8_observer is None for m in model.modules() if isinstance(m, FP8Linear))

    rows = read_csv(tmp_path / "run" / "version_0" / "metrics.csv")
    names = [f"fp8/{fqn}/{role}/{stat}" for fqn in layers for role in ROLES for stat in STATS]
    assert set(names) <= set(rows[0])
    sampled = [r for r in rows if r[names[0]] != ""]
    assert [int(r["step"]) for r in sampled] == [0, 1, 3, 5]  # Lightning's own step numbering
    assert {int(r["step"]) for r in rows if r["train_loss"] != ""} == {1, 3, 5}  # train_loss lands on the same steps
    for r in sampled:
        for fqn in layers:
            assert float(r[f"fp8/{fqn}/fp8_enabled"]) == 1.0
            for role in ROLES:
                v = {stat: float(r[f"fp8/{fqn}/{role}/{stat}"]) for stat in STATS}
                assert v["scale"] > 0 and v["amax"] > 0
                assert 0.0 <= v["overflow"] <= 1.0 and 0.0 <= v["underflow"] <= 1.0
                assert 15.0 < v["sqnr_db"] < 40.0  # healthy FP8 casts: ~31 dB E4M3, ~25 dB E5M2
                assert float(r[f"fp8/{fqn}/{role}/clipped_casts"]) >= 0
    # step 0 casts with current scaling (no history yet): scale = fp8 max / amax exactly
    first = sampled[0]
    pow2 = FP8Recipe().power_of_2_scales
    for role, fmt in (("input", E4M3), ("grad_output", E5M2)):
        amax = torch.tensor(float(first[f"fp8/net.2/{role}/amax"]))
        expected = scale_from_amax(amax, fmt.max, 0, 1.0, pow2).item()
        assert float(first[f"fp8/net.2/{role}/scale"]) == pytest.approx(expected, rel=1e-5)
    # the history file: run header, precision map, one stats line per sampled step
    records = history(tmp_path / "run" / "version_0")
    kinds = [r["type"] for r in records]
    assert kinds[:2] == ["run", "precision_map"] and kinds.count("stats") == 4 and kinds[-1] == "precision_map"
    stats = [r for r in records if r["type"] == "stats"]
    assert [r["step"] for r in stats] == [1, 2, 4, 6]  # optimizer steps completed (the engine's count)
    assert set(stats[0]["layers"]) == set(layers) and set(stats[0]["layers"]["net.2"]) == {"enabled", *ROLES}
    # the training context of each sample: loss scale (no loss scaling by default: 1) and host time per step
    assert all(r["loss_scale"] == 1.0 and r["step_time_s"] > 0 for r in stats)
    assert [r["timed_steps"] for r in stats] == [1, 1, 2, 2]
    # the thresholds the report anchors its colours to: FP8LayerFallback's defaults, said so (none in this run)
    header = records[0]
    assert header["version"] == 2 and header["thresholds"] == {
        "source": "FP8LayerFallback defaults (no FP8LayerFallback in this run)",
        "overflow_factor": 8.0, "min_sqnr_db": 10.0, "max_underflow": 0.5}  # the flush-to-zero rule is on by default
    assert [row["precision"] for row in records[1]["layers"]] == ["bf16", "fp8", "fp8", "bf16"]


def test_default_monitor_logs_the_scales_the_casts_used(tmp_path, monkeypatch):
    """A default FP8ScaleMonitor with a real CSVLogger and Trainer: every FP8 layer has an input, weight and gradient
    scale column, and on every sampled step they hold the scale the layer's cast op returned (recorded at the op)."""
    import lightning_fp8.modules.cast as cast_module

    used = {}  # (history storage, role index) -> the scale the last cast of that role returned
    original = cast_module.kernels.scaled_cast

    def spy(x, history, role, *args, **kwargs):
        out = original(x, history, role, *args, **kwargs)
        used[(history.data_ptr(), role)] = float(out[2])
        return out

    monkeypatch.setattr(cast_module.kernels, "scaled_cast", spy)
    per_step = {}

    class Snapshot(Callback):  # after forward and backward (every cast of the step), before the scales move
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            layers = {m.fp8_meta.amax_history.data_ptr(): fqn for fqn, m in pl_module.named_modules()
                      if isinstance(m, FP8Linear)}
            per_step[trainer.global_step] = {(layers[ptr], ROLES[role]): scale for (ptr, role), scale in used.items()
                                             if ptr in layers}

    monitor = FP8ScaleMonitor()
    t = trainer(plugins=[FP8Precision()], max_steps=6, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=2,
                callbacks=[monitor, Snapshot()])
    t.fit(RegressionModule(), loader())
    assert monitor._unscaled is None  # the default recipe scales every role: nothing kept for saturation checks
    rows = read_csv(tmp_path / "run" / "version_0" / "metrics.csv")
    sampled = [r for r in rows if r.get("fp8/net.2/input/scale", "") != ""]
    assert [int(r["step"]) for r in sampled] == [0, 1, 3, 5]
    for row in sampled:
        for fqn in ("net.2", "net.4"):
            for role in ROLES:
                assert float(row[f"fp8/{fqn}/{role}/scale"]) == per_step[int(row["step"])][(fqn, role)], (row["step"],
                                                                                                        fqn, role)
    # the scales moved during the run (delayed scaling from step 1 on), and the columns show it
    assert len({row["fp8/net.2/grad_output/scale"] for row in sampled}) > 1


def test_a_saturating_unscaled_gradient_is_not_reported_as_non_finite(tmp_path):
    """Mellempudi's recipe casts gradients without a scale (dynamic loss scaling instead): a gradient whose finite
    amax goes beyond E5M2's max is the loss scaler's overflow, a "saturation" event; a NaN later is "nonfinite"."""
    model = RegressionModule()

    def fault(module, x, y):
        step = module.trainer.global_step
        if step == 2:
            return x * 1e7, y  # large but finite: the loss-scaled gradients saturate E5M2 (max 57344)
        if step == 5:
            return x * float("nan"), y
        return x, y

    model.fault = fault
    plugin = FP8Precision(preset="mellempudi", max_rollbacks=10)
    t = trainer(plugins=[plugin], max_steps=7, max_epochs=-1, default_root_dir=tmp_path,
                callbacks=[FP8ScaleMonitor(log_every_n_steps=1)])
    t.fit(model, loader())
    events = [r for r in history(tmp_path) if r["type"] == "event"]
    saturation = [e for e in events if e["kind"] == "saturation"]
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert saturation and all(t["role"] == "grad_output" and t["ratio"] > 1 and math.isfinite(t["amax"])
                              for e in saturation for t in e["tensors"])
    assert all(e["skipped"] and "scale_gradients=False" in e["reason"] for e in saturation)
    assert not any(e["step"] == saturation[0]["step"] for e in nonfinite)  # before: every entry said "non-finite"
    assert [e["step"] for e in nonfinite] and all(e["step"] > saturation[0]["step"] for e in nonfinite)
    from lightning_fp8.report.history import load_history

    marks = load_history(str(tmp_path)).tensor_marks()
    assert not [m for m in marks if m.step == saturation[0]["step"]]  # the report marks no inf/NaN there either


def test_stats_reach_the_host_in_one_copy_per_device(monkeypatch):
    """LayerStatsSampler.finish: one device-to-host copy per device, not one per layer and role."""
    from lightning_fp8 import convert_to_fp8
    from lightning_fp8.callbacks.sampling import LayerStatsSampler

    model = convert_to_fp8(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]), FP8Recipe(keep_first_last_in_bf16=False),
                           verbose=False)
    layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, FP8Linear)}
    sampler = LayerStatsSampler(sample_size=64)
    sampler.start(layers)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(8, 32)).float().sum().backward()
    copies = []
    original = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape) or original(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a host read per value"))
    record = sampler.finish(step=1, logger_step=0)
    assert len(record.layers) == 6 and all(set(roles) == set(ROLES) for roles in record.layers.values())
    assert copies == [torch.Size([18, 9])]  # one stacked copy: 6 layers x 3 roles, 9 numbers each


def test_monitor_statistics_are_those_of_the_cast(tmp_path):
    """On the first step (current scaling) the record equals quantization_stats of the exact tensor the layer cast."""
    captured = {}

    def grab(module, args):
        captured.setdefault("x", args[0].detach().clone())

    model = RegressionModule()
    monitor = FP8ScaleMonitor(log_every_n_steps=1, sample_size=1 << 20)  # larger than the tensors: exact
    t = trainer(plugins=[FP8Precision()], max_steps=1, default_root_dir=tmp_path, callbacks=[monitor, _HookAt("net.2", grab)])
    t.fit(model, loader())
    rec = monitor.last_record.layers["net.2"]["input"]
    x = captured["x"]
    scale = scale_from_amax(x.abs().max().float(), E4M3.max, 0, 1.0, FP8Recipe().power_of_2_scales)
    expected = quantization_stats(x, scale, E4M3, sample_size=0)
    assert rec["scale"] == pytest.approx(scale.item(), rel=1e-6)
    assert rec["amax"] == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert rec["overflow"] == 0.0
    assert rec["underflow"] == pytest.approx(expected.underflow_fraction().item())
    assert rec["sqnr_db"] == pytest.approx(expected.sqnr_db().item(), abs=1e-4)
    assert rec["range_ratio"] == pytest.approx(rec["amax"] * rec["scale"] / E4M3.max, rel=1e-12)  # 1: current scaling
    roundtrip = dequantize(quantize(x, scale, E4M3), scale.reciprocal())
    assert rec["sqnr_db"] == pytest.approx(sqnr_db(x.float(), roundtrip), abs=1e-3)


class _HookAt(Callback):
    """Register a forward pre-hook on a layer once the plugin has converted the model."""

    def __init__(self, fqn, hook):
        self.fqn, self.hook = fqn, hook

    def on_fit_start(self, trainer, pl_module):
        pl_module.get_submodule(self.fqn).register_forward_pre_hook(self.hook)


# -- FP8LayerFallback ------------------------------------------------------------------------------------------------
def test_fallback_moves_exactly_the_origin_layer_and_survives_resume(tmp_path, caplog):
    """net.6's weight grows x30 per step for 4 steps (x8e5 in all; x30 so that every step's amax lands beyond
    overflow_factor=8 times the range even under a power-of-two scale, which can sit up to 2x below the exact one):
    its weight cast clips, and so do the input of
    net.8 (its output, a step later), and the gradients of net.2 / net.4 (backward through it). Only net.6, where the
    overflow originates, moves to BF16, with the reason; the loss stays finite; a resumed run has the same map.
    (escalate_to=None: this is the BF16 move itself; with the default, the layer first goes to blockwise scaling,
    tests/test_escalation.py.)"""
    caplog.set_level(logging.WARNING, logger="lightning_fp8")
    torch.manual_seed(0)
    model = Deep()
    fallback = FP8LayerFallback(escalate_to=None)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    logger = CSVLogger(tmp_path, name="run")
    t = trainer(
        plugins=[FP8Precision()], max_steps=12, max_epochs=-1, logger=logger, log_every_n_steps=1, enable_checkpointing=True,
        callbacks=[GrowWeight("net.6", start=4, steps=4, factor=30.0), FP8ScaleMonitor(log_every_n_steps=1), fallback, ckpt],
    )
    t.fit(model, loader())
    pmap = {row.fqn: row for row in precision_map(model)}
    assert [fqn for fqn, row in pmap.items() if row.precision == "fp8"] == ["net.2", "net.4", "net.8"]
    reason = pmap["net.6"].reason
    assert reason.startswith("FP8 overflow originated here in 3 of the last 20 steps") and "weight" in reason
    assert model.net[6].fp8_disabled_reason == reason and not bool(model.net[6].fp8_meta.enabled)
    assert [(e["kind"], e["layers"], e["rule"]) for e in fallback.events] == [("fallback", ["net.6"], "overflow")]
    assert all(math.isfinite(loss) for loss in model.losses)
    assert any("net.6 moved to BF16" in r.getMessage() and reason in r.getMessage() for r in caplog.records)

    log_dir = tmp_path / "run" / "version_0"
    records = history(log_dir)
    # the layers around net.6 did overflow badly in the same steps: it is the attribution that spares them
    worst = {}
    for r in (r for r in records if r["type"] == "stats"):
        for fqn, entry in r["layers"].items():
            for role in ROLES:
                if role in entry:
                    worst[(fqn, role)] = max(worst.get((fqn, role), 0.0), float(entry[role]["overflow"]))
    assert worst[("net.8", "input")] > 0.05 and worst[("net.4", "grad_output")] > 0.05
    events = [r for r in records if r["type"] == "event" and r["kind"] == "fallback"]
    assert [(e["layers"], e["reason"]) for e in events] == [(["net.6"], reason)]
    final_map = [r for r in records if r["type"] == "precision_map"][-1]["layers"]
    assert {r["fqn"]: r["reason"] for r in final_map}["net.6"] == reason
    rows = read_csv(log_dir / "metrics.csv")
    enabled = [float(r["fp8/net.6/fp8_enabled"]) for r in rows if r.get("fp8/net.6/fp8_enabled", "") != ""]
    assert enabled[0] == 1.0 and enabled[-1] == 0.0
    assert [float(r["fp8/fallback_layers"]) for r in rows if r.get("fp8/fallback_layers", "") != ""] == [1.0]

    # resume from the checkpoint into a fresh model: same precision map with the same reasons
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["callbacks"]["FP8LayerFallback"]["fallbacks"]["net.6"]["reason"] == reason
    maps = {}

    class MapSpy(Callback):
        def on_train_start(self, trainer, pl_module):
            maps["start"] = [(r.fqn, r.precision, r.reason) for r in precision_map(pl_module)]

    torch.manual_seed(0)
    resumed = Deep()
    t2 = trainer(plugins=[FP8Precision()], max_steps=14, max_epochs=-1, callbacks=[FP8LayerFallback(escalate_to=None), MapSpy()])
    t2.fit(resumed, loader(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    expected = [(r.fqn, r.precision, r.reason) for r in pmap.values()]
    assert maps["start"] == expected
    assert [(r.fqn, r.precision, r.reason) for r in precision_map(resumed)] == expected
    assert not resumed.net[6].fp8_enabled and not bool(resumed.net[6].fp8_meta.enabled)


def test_fp8_metrics_can_be_watched_by_modelcheckpoint_and_earlystopping(tmp_path):
    """Lightning's own ModelCheckpoint and EarlyStopping watch fp8/* metrics: a per-layer SQNR the monitor samples
    (put into trainer.callback_metrics because a callback monitors it), and the fallback's layer count, which stops
    the run at the end of the epoch in which net.6 falls back."""
    torch.manual_seed(0)
    watched = "fp8/net.4/input/sqnr_db"
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=watched, mode="max", save_top_k=1, every_n_train_steps=4)
    stop = EarlyStopping(monitor="fp8/fallback_layers", mode="min", divergence_threshold=0.5, patience=100,
                         check_on_train_epoch_end=True)
    t = trainer(plugins=[FP8Precision()], max_epochs=10, logger=CSVLogger(tmp_path, name="run"), enable_checkpointing=True,
                callbacks=[GrowWeight("net.6", start=10, steps=4, factor=30.0), FP8ScaleMonitor(log_every_n_steps=4),
                           FP8LayerFallback(escalate_to=None), ckpt, stop])
    t.fit(Deep(), loader())  # 8 batches per epoch
    records = history(tmp_path / "run" / "version_0")
    fell = [r["step"] for r in records if r["type"] == "event" and r["kind"] == "fallback"]
    assert fell and 8 < fell[0] <= 16
    assert t.global_step == 16 and stop.stopped_epoch == 1  # the end of the epoch of the fallback, not max_epochs
    assert float(t.callback_metrics["fp8/fallback_layers"]) == 1.0
    sampled = {r["step"]: r["layers"]["net.4"]["input"]["sqnr_db"] for r in records if r["type"] == "stats"}
    assert sorted(sampled) == [1, 4, 8, 10, 12, 16]  # the monitor's steps and the fallback's checks (every 10)
    assert float(ckpt.best_model_score) == pytest.approx(max(sampled[s] for s in (4, 8, 12, 16)), rel=1e-5)  # 6 digits
    assert os.path.exists(ckpt.best_model_path)
    # the monitor's run-level summaries are there for any watcher; the unwatched per-layer names are not
    assert float(t.callback_metrics["fp8/worst_sqnr_db"]) <= float(t.callback_metrics[watched])
    assert "fp8/net.2/input/sqnr_db" not in t.callback_metrics


def test_a_one_time_jump_is_absorbed_by_the_scales():
    """Per-tensor scaling is scale-invariant: a weight x1e4 once overflows for one step, then the scale follows.
    That is no reason to leave FP8."""
    torch.manual_seed(0)
    model = Deep()
    fallback = FP8LayerFallback()
    t = trainer(plugins=[FP8Precision()], max_steps=10, max_epochs=-1, callbacks=[GrowWeight("net.6", 3, 1, 1e4), fallback])
    t.fit(model, loader())
    assert fallback.events == []
    assert all(row.precision == "fp8" for row in precision_map(model) if row.fqn in ("net.2", "net.4", "net.6", "net.8"))


def test_sqnr_rule_after_an_activation_spike():
    """One batch whose activations entering net.4 are 1e6x larger, in a step that is *taken* (every value stays
    finite: the saturating cast hides nothing from the engine, so nothing is skipped), pins net.4's delayed scale for
    the whole amax history: the following casts flush its inputs (SQNR near 0 dB). net.6 and net.8 inherit the spike
    through net.4; only net.4 moves, by the SQNR rule. (A *skipped* step's amaxes never enter the history:
    tests/test_step_scales.py.)"""

    step = {}

    def spike(module, args):
        if step["now"] == 3:
            return (args[0] * 1e6,)

    class StepCounter(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step["now"] = trainer.global_step

    torch.manual_seed(0)
    model = Deep()
    fallback = FP8LayerFallback(check_every_n_steps=1, stats_patience=3, escalate_to=None)
    plugin = FP8Precision()
    t = trainer(plugins=[plugin], max_steps=10, max_epochs=-1, callbacks=[StepCounter(), _HookAt("net.4", spike), fallback])
    t.fit(model, loader())
    assert plugin.skipped_steps == 0  # the spike's step was taken: its amax belongs in the history
    assert [(e["layers"], e["rule"]) for e in fallback.events] == [(["net.4"], "sqnr")]
    assert "quantization SQNR of input" in model.net[4].fp8_disabled_reason
    assert [row.fqn for row in precision_map(model) if row.precision == "fp8"] == ["net.2", "net.6", "net.8"]


class InfOutput(Callback):
    """Planted fault: `fqn` writes inf into its output while it runs in FP8, on steps [start, stop)."""

    def __init__(self, fqn, start, stop=10**9):
        self.fqn, self.start, self.stop = fqn, start, stop

    def on_fit_start(self, trainer, pl_module):
        layer = pl_module.get_submodule(self.fqn)

        def hook(module, args, output):
            if module.fp8_enabled and self.start <= trainer.global_step < self.stop:
                output = output.clone()
                output[0, :4] = float("inf")
                return output

        layer.register_forward_hook(hook)


def test_nonfinite_origin_and_decisions_survive_a_rollback():
    """net.4 produces inf from finite inputs (GELU turns it into NaN). The engine sees non-finite amaxes at net.6's
    input and in the gradients, never at net.4's input, and skips and rolls back those steps; the fallback's
    diagnosis finds where the non-finite value starts and moves net.4. A later rollback (NaN loss at step 9)
    restores the layers' buffers from an older snapshot; the decision stays."""
    torch.manual_seed(0)
    model = Deep()

    def nan_loss(module, x, y):
        return (x * float("nan"), y) if module.trainer.global_step == 9 else (x, y)

    model.fault = nan_loss
    fallback = FP8LayerFallback(nonfinite_patience=2)
    # the only snapshot is the one before step 1 (net.4 still in FP8)
    plugin = FP8Precision(snapshot_every=50, max_rollbacks=10)
    t = trainer(plugins=[plugin], max_steps=12, max_epochs=-1, callbacks=[InfOutput("net.4", start=3), fallback])
    t.fit(model, loader())
    assert [(e["layers"], e["rule"]) for e in fallback.events] == [(["net.4"], "nonfinite")]
    assert "non-finite output from finite input and weight" in model.net[4].fp8_disabled_reason
    engine = plugin.engine
    skips = [e for e in engine.events if e["kind"] == "skip"]
    assert "net.6.input" in skips[0]["layers"] and not any("net.4.input" in e["layers"] for e in skips)
    fell = fallback.events[0]["step"]
    assert engine.rollbacks >= 1 and any(e["kind"] == "rollback" and e["step"] > fell for e in engine.events)
    assert not model.net[4].fp8_enabled and not bool(model.net[4].fp8_meta.enabled)
    assert [row.fqn for row in precision_map(model) if row.precision == "fp8"] == ["net.2", "net.6", "net.8"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_keep_in_bf16_and_retry(tmp_path):
    torch.manual_seed(0)
    model = Deep()
    fallback = FP8LayerFallback(keep_in_bf16=["net.2"], retry_after_steps=3, max_retries=1, escalate_to=None)
    states = {}

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            layer = pl_module.net[6]
            states[trainer.global_step] = (layer.fp8_enabled, bool(layer.fp8_meta.weight.initialized))

    t = trainer(plugins=[FP8Precision()], max_steps=12, max_epochs=-1, logger=CSVLogger(tmp_path, name="run"),
                callbacks=[GrowWeight("net.6", start=3, steps=4, factor=30.0), fallback, Spy()])
    t.fit(model, loader())
    kinds = [(e["kind"], e["layers"]) for e in fallback.events]
    assert kinds == [("keep_bf16", ["net.2"]), ("fallback", ["net.6"]), ("retry", ["net.6"])]
    fell, retried = fallback.events[1]["step"], fallback.events[2]["step"]
    assert retried == fell + 3 and "FP8 retry at step" in fallback.events[1]["reason"]
    assert states[fell] == (False, True)
    assert states[retried] == (True, False)  # back in FP8 with a fresh scaling state (current scaling first)
    assert model.net[6].fp8_enabled and model.net[6].fp8_disabled_reason is None  # the growth has stopped
    assert model.net[2].fp8_disabled_reason == "kept in BF16 by FP8LayerFallback(keep_in_bf16=['net.2'])"
    assert [r.precision for r in precision_map(model)] == ["bf16", "bf16", "fp8", "fp8", "fp8", "bf16"]
    # the history file holds the events even without a monitor (it goes where the logger writes)
    events = [r for r in history(tmp_path / "run" / "version_0") if r["type"] == "event"]
    assert [r["kind"] for r in events if r["kind"] != "overflow"] == ["keep_bf16", "fallback", "retry"]
    # and every step in which a tensor went beyond overflow_factor, with its layer, role and ratio
    over = [r for r in events if r["kind"] == "overflow"]
    assert [r["step"] for r in over if "net.6" in r["layers"]] == [4, 5, fell]
    [tensor] = over[0]["tensors"]
    assert (tensor["layer"], tensor["role"], tensor["origin"]) == ("net.6", "weight", "net.6")
    assert tensor["ratio"] > fallback.overflow_factor
    inherited = [t for r in over for t in r["tensors"] if t["layer"] == "net.8"]  # net.6's output is net.8's input
    assert inherited and all(t["origin"] == "net.6" for t in inherited if t["role"] == "input")


def test_fallback_arguments_are_validated():
    with pytest.raises(ValueError, match="overflow_patience"):
        FP8LayerFallback(overflow_patience=0)
    with pytest.raises(ValueError, match="cannot exceed"):
        FP8LayerFallback(overflow_patience=5, overflow_window=4)
    with pytest.raises(ValueError, match="retry_after_steps"):
        FP8LayerFallback(retry_after_steps=0)
    with pytest.raises(ValueError, match="log_every_n_steps"):
        FP8ScaleMonitor(log_every_n_steps=0)


DDP_SCRIPT = '''
import json, sys, warnings
import torch
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
from torch.utils.data import DataLoader
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from support.helpers import regression_data, trainer
from support.process_group import process_group_ended
from test_callbacks import Deep, _HookAt
from lightning_fp8 import FP8Precision, precision_map
from lightning_fp8.callbacks import FP8Calibration, FP8LayerFallback, FP8ScaleMonitor

out = sys.argv[1]
torch.manual_seed(0)
model = Deep()
now = {{}}

class Step(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now.update(step=trainer.global_step, rank=trainer.global_rank)

def spike(module, args):  # an activation spike into net.4 on rank 0 only
    if now.get("rank") == 0 and now["step"] == 3:
        return (args[0] * 1e6,)

fallback = FP8LayerFallback(check_every_n_steps=1, escalate_to=None)
t = trainer(plugins=[FP8Precision()], strategy="ddp", devices=2, max_steps=10, max_epochs=-1,
            logger=CSVLogger(out, name="ddp"),
            callbacks=[Step(), _HookAt("net.4", spike), FP8Calibration(num_batches=2), FP8ScaleMonitor(log_every_n_steps=2), fallback])
with process_group_ended():
    t.fit(model, DataLoader(regression_data(512), batch_size=16, shuffle=False))
    result = {{"map": [[r.fqn, r.precision] for r in precision_map(model)], "events": [[e["kind"], e["layers"], e["step"]] for e in fallback.events],
              "scale": model.net[2].fp8_meta.input.scale.item()}}
    json.dump(result, open(f"{{out}}/rank{{t.global_rank}}.json", "w"))
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_ranks_make_the_same_decision(tmp_path):
    """2 CPU processes (gloo): a spike on rank 0 only; both ranks move the same layer at the same step (one flag
    all-reduce per step), calibration syncs its amaxes, and only rank 0 writes the history file."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "ddp_fallback.py"
    script.write_text(DDP_SCRIPT.format(tests=tests))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]  # rank 1 (not the launched process) aborted
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    assert [e[:2] for e in r0["events"]] == [["fallback", ["net.4"]]]
    assert ["net.4", "bf16"] in r0["map"]
    lines = (tmp_path / "ddp" / "version_0" / "fp8_history.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["type"] == "run" for line in lines) == 1


def test_callbacks_without_the_fp8_plugin_say_so_and_the_report_tells_the_truth(tmp_path):
    """The FP8 callbacks on a Trainer with no FP8 plugin: nothing runs in FP8, so fit start warns (once, naming
    them), and the history / report list every linear as BF16, not converted (before: no warning, and the report
    counted the preview's "would be converted" layers as 2 layers in FP8)."""
    from lightning_fp8.report import write_report

    logger = CSVLogger(tmp_path, name="run")
    t = trainer(max_steps=3, logger=logger, log_every_n_steps=1,
                callbacks=[FP8Calibration(num_batches=1), FP8ScaleMonitor(), FP8LayerFallback()])
    with pytest.warns(UserWarning, match="FP8Calibration, FP8LayerFallback, FP8ScaleMonitor are in this Trainer, but "
                                         "nothing in this run computes in FP8") as caught:
        t.fit(RegressionModule(), loader())
    assert sum("nothing in this run computes in FP8" in str(w.message) for w in caught) == 1
    rows = [r for r in history(tmp_path / "run" / "version_0") if r["type"] == "precision_map"][-1]["layers"]
    assert len(rows) == 4 and {r["precision"] for r in rows} == {"bf16"}
    assert sum("FP8Precision would convert it" in r["reason"] for r in rows) == 2  # net.2 and net.4, said as such
    page = open(write_report(str(tmp_path / "run" / "version_0"))).read()
    assert "<div class='n'>0</div><div class='l'>layers in FP8</div>" in page
