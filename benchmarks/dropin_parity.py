"""Unchanged scripts under the launcher: FP8 vs BF16 final evaluation loss, same seed and data, 1 and 2 CPU processes.

    python benchmarks/dropin_parity.py [--steps 150] [--schedule constant] [--out benchmarks/results/dropin_parity.json]

Runs examples/accelerate_unchanged.py (a plain `accelerate.Accelerator()` loop) and examples/hf_trainer.py (a plain
transformers `Trainer`) through `python -m lightning_fp8.accelerate launch --mixed_precision {fp8,bf16}`, with
learning rates that decay linearly to zero, and records each run's final evaluation loss (the scripts' own: eval mode,
no gradients, on the held-out last 10% of the text) and the FP8 conversion summary line; for hf_trainer also its
training loss (the Trainer's logged mean over the last 10% of the steps; accelerate_unchanged prints none). The
machine (bench_io.machine(): CPU, threads, BF16 hardware or not) heads the result. `--schedule constant` runs
hf_trainer with a constant LR after the same warmup (constant_with_warmup) and skips accelerate_unchanged, whose linear
schedule is fixed in the example. One seed: the gap is a check that the FP8 run trains like the BF16 one, not a parity
claim (see docs/measuring.md). On a CPU without BF16 hardware the BF16 runs are slow (software BF16); times are not
compared.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_io import machine  # noqa: E402


def launch(script_args, precision: str, processes: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [sys.executable, "-m", "lightning_fp8.accelerate", "launch", "--num_cpu_threads_per_process", "1",
           "--mixed_precision", precision]
    if processes > 1:
        env["ACCELERATE_USE_CPU"] = "1"
        cmd += ["--multi_gpu", "--num_processes", str(processes), "--main_process_port", str(29500 + os.getpid() % 500)]
    else:
        cmd += ["--cpu", "--num_processes", "1"]
    start = time.perf_counter()
    proc = subprocess.run(cmd + script_args, env=env, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    out = proc.stdout + proc.stderr
    loss = re.search(r"eval_loss=([0-9.]+)", out)
    summary = re.search(r"lightning_fp8: (\d+ of \d+ linear layers run in FP8)", out)
    train_losses = re.findall(r"'loss': '?([0-9.eE+-]+)", out)  # transformers' PrinterCallback (hf_trainer)
    if proc.returncode != 0 or loss is None:
        raise RuntimeError(f"{cmd + script_args} failed ({proc.returncode}):\n{out[-3000:]}")
    return {"eval_loss": float(loss.group(1)), "train_loss": float(train_losses[-1]) if train_losses else None,
            "fp8_layers": summary.group(1) if summary else None, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dropin_parity.json"))
    p.add_argument("--schedule", choices=["linear", "constant"], default="linear",
                   help="linear: warmup then decay to zero (default); constant: hf_trainer only, the same warmup then held")
    args = p.parse_args()
    scripts = {
        "accelerate_unchanged": ["examples/accelerate_unchanged.py", "--steps", str(args.steps), "--max-chars", "200000"],
        "hf_trainer": ["examples/hf_trainer.py", "--output_dir", "/tmp/lightning_fp8_dropin_parity", "--max_steps",
                       str(args.steps), "--per_device_train_batch_size", "8", "--learning_rate", "3e-3",
                       "--warmup_steps", str(args.steps // 10), "--lr_scheduler_type",
                       "constant_with_warmup" if args.schedule == "constant" else "linear", "--save_strategy", "no",
                       "--logging_steps", str(max(1, args.steps // 10)),
                       "--report_to", "none", "--disable_tqdm", "true", "--max_chars", "200000", "--seed", "0"],
    }
    if args.schedule == "constant":
        del scripts["accelerate_unchanged"]  # its linear schedule is fixed in the example
    host = machine()
    lr = "LR constant after warmup" if args.schedule == "constant" else "LR decaying linearly to zero"
    results = {"what": "final eval loss, FP8 vs BF16, unchanged scripts under python -m lightning_fp8.accelerate "
                       f"launch, same seed, {lr}", "steps": args.steps, "schedule": args.schedule, "cpu": host["cpu"],
               "machine": host, "runs": {}}
    for name, script_args in scripts.items():
        for processes in (1, 2):
            row = {precision: launch(script_args, precision, processes) for precision in ("fp8", "bf16")}
            row["gap"] = round((row["fp8"]["eval_loss"] - row["bf16"]["eval_loss"]) / row["bf16"]["eval_loss"], 5)
            results["runs"][f"{name}, {processes} process{'es' if processes > 1 else ''}"] = row
            print(name, processes, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
