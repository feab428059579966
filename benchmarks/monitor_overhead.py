"""Overhead of FP8ScaleMonitor at its default interval on the demo char-GPT (CPU).

Two Lightning runs with identical seeds, data and FP8Precision: without and with FP8ScaleMonitor() (default interval:
the Trainer's log_every_n_steps, 50; it also samples the first step). Both log to a CSVLogger, so what differs is
only what the monitor adds. Runs alternate (A B A B ...) to spread machine drift over both.

Two measurements:

direct (the number to quote): the monitor's own work is timed where it happens, in its two per-batch hooks and in
  every observer call during forward/backward, as wall and process-CPU time; overhead = that time per step, averaged
  over the interval, divided by the median step time of the run without monitor:
    (own time on a sampled step + (N - 1) x own time on another step) / (N x base step),   N = the interval.
paired (a check, includes indirect costs such as the logger writing more columns): step time between consecutive
  `on_train_batch_start` calls (forward, backward, optimizer, every hook, logging), run with monitor minus run
  without, step by step (both runs see the same batches), combined the same way. Noisier: on a shared machine other
  processes move single steps by more than the monitor costs.

Times are process CPU time (`time.process_time`, not inflated by other processes on a loaded machine) with
torch.set_num_threads(1) so CPU time is the step's own; wall times are recorded too.

    python benchmarks/monitor_overhead.py [--steps 100] [--repeats 2] [--out benchmarks/results/monitor_overhead.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_fp8 import FP8Precision
from lightning_fp8.callbacks import FP8ScaleMonitor
from lightning_fp8.demo.data import load_corpus
from lightning_fp8.demo.gpt import GPTConfig
from lightning_fp8.demo.module import CharGPTModule


class StepTimer(Callback):
    def __init__(self):
        self.starts = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer, pl_module):
        self.starts.append((time.perf_counter(), time.process_time()))

    @property
    def wall(self):
        return [b[0] - a[0] for a, b in zip(self.starts, self.starts[1:])]

    @property
    def cpu(self):
        return [b[1] - a[1] for a, b in zip(self.starts, self.starts[1:])]


class OwnTime:
    """Accumulates the wall / CPU time of the monitor's own code, per optimizer step (index = global_step at start)."""

    def __init__(self):
        self.wall, self.cpu = {}, {}
        self.step = 0

    def wrap(self, fn, step_of=None):
        def timed(*args, **kwargs):
            if step_of is not None:
                self.step = step_of(*args)
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[self.step] = self.wall.get(self.step, 0.0) + time.perf_counter() - w0
                self.cpu[self.step] = self.cpu.get(self.step, 0.0) + time.process_time() - c0

        return timed


def instrument(monitor, own):
    """Time FP8ScaleMonitor's hooks and the statistics observers (wrapped at the class, for this run only)."""
    from lightning_fp8.callbacks import sampling as records

    monitor.on_train_batch_start = own.wrap(monitor.on_train_batch_start, step_of=lambda trainer, *a: trainer.global_step)
    monitor.on_train_batch_end = own.wrap(monitor.on_train_batch_end)
    original = records.LayerStatsSampler.observe
    records.LayerStatsSampler.observe = own.wrap(original)
    return lambda: setattr(records.LayerStatsSampler, "observe", original)


def make_data(steps, batch_size, context, seed=0):
    corpus = load_corpus(max_chars=400_000)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(corpus.train) - context - 1, (steps * batch_size,), generator=g).tolist()
    x = torch.stack([corpus.train[s : s + context] for s in starts])
    y = torch.stack([corpus.train[s + 1 : s + context + 1] for s in starts])
    return corpus.vocab_size, DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def one_run(monitor: bool, args, vocab, data, log_root):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, context=args.context, d_model=args.d_model, n_layers=args.n_layers)
    module = CharGPTModule(cfg, max_steps=args.steps)
    timer = StepTimer()
    own = OwnTime()
    restore = None
    callbacks = [timer]
    if monitor:
        mon = FP8ScaleMonitor()
        restore = instrument(mon, own)
        callbacks.append(mon)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, max_epochs=-1, plugins=[FP8Precision()],
        logger=CSVLogger(log_root, name="monitor" if monitor else "base"), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    try:
        trainer.fit(module, data)
    finally:
        if restore is not None:
            restore()
    total = time.perf_counter() - t0
    return timer, own, total, trainer.log_every_n_steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "monitor_overhead.json"))
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    vocab, data = make_data(args.steps, args.batch_size, args.context)
    load_before = os.getloadavg()
    base_runs, mon_runs = [], []
    with tempfile.TemporaryDirectory() as log_root:
        for r in range(args.repeats):
            for monitor in (False, True):
                timer, own, total, interval = one_run(monitor, args, vocab, data, log_root)
                (mon_runs if monitor else base_runs).append({"timer": timer, "own": own, "total_s": total})
                print(f"repeat {r} monitor={monitor}: {total:.1f} s, median step CPU "
                      f"{statistics.median(timer.cpu) * 1e3:.1f} ms", file=sys.stderr)
    n = interval
    sampled = {i for i in range(args.steps) if i == 0 or (i + 1) % n == 0}
    med = statistics.median
    # direct: the monitor's own time (skip step 0: it also samples, but pays one-off set-up)
    own_sampled = {k: [] for k in ("wall", "cpu")}
    own_other = {k: [] for k in ("wall", "cpu")}
    for run in mon_runs:
        for kind in ("wall", "cpu"):
            per_step = getattr(run["own"], kind)
            for i in range(1, args.steps):
                (own_sampled if i in sampled else own_other)[kind].append(per_step.get(i, 0.0))
    base = {kind: med([s for run in base_runs for s in getattr(run["timer"], kind)[1:]]) for kind in ("wall", "cpu")}
    with_mon = {kind: med([s for run in mon_runs for s in getattr(run["timer"], kind)[1:]]) for kind in ("wall", "cpu")}
    direct = {
        kind: (med(own_sampled[kind]) + (n - 1) * med(own_other[kind])) / (n * base[kind]) for kind in ("wall", "cpu")
    }
    # paired check
    paired = {"sampled": [], "other": []}
    for b_run, m_run in zip(base_runs, mon_runs):
        for i, (b, m) in enumerate(zip(b_run["timer"].cpu, m_run["timer"].cpu)):
            if i:
                paired["sampled" if i in sampled else "other"].append(m - b)
    result = {
        "what": "FP8ScaleMonitor() at its default interval vs no monitor, demo char-GPT, FP8Precision, CPU",
        "model": {"d_model": args.d_model, "n_layers": args.n_layers, "context": args.context, "batch_size": args.batch_size,
                  "fp8_layers": 7, "tensors_sampled_per_step": 21},
        "steps": args.steps, "repeats": args.repeats, "interval": n, "sampled_steps": sorted(sampled),
        "torch_threads": args.threads,
        "median_step_ms_without": {k: round(v * 1e3, 1) for k, v in base.items()},
        "median_step_ms_with": {k: round(v * 1e3, 1) for k, v in with_mon.items()},
        "monitor_own_ms_sampled_step": {k: round(med(v) * 1e3, 2) for k, v in own_sampled.items()},
        "monitor_own_ms_other_step": {k: round(med(v) * 1e3, 3) for k, v in own_other.items()},
        "overhead_at_default_interval": {k: round(v, 5) for k, v in direct.items()},
        "overhead_if_every_step": {
            k: round(med(own_sampled[k]) / base[k], 4) for k in ("wall", "cpu")
        },
        "paired_cpu_ms": {"sampled_steps_median": round(med(paired["sampled"]) * 1e3, 1),
                          "other_steps_median": round(med(paired["other"]) * 1e3, 2)},
        "overhead_paired_estimate": round(
            (med(paired["sampled"]) + (n - 1) * med(paired["other"])) / (n * base["cpu"]), 4
        ),
        "total_s_without": [round(r["total_s"], 1) for r in base_runs],
        "total_s_with": [round(r["total_s"], 1) for r in mon_runs],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "note": "shared machine (other jobs running); CPU times are this process's own"},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
