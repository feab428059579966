"""Unchanged scripts under the launcher: FP8 vs BF16 final evaluation loss, same seed and data, 1 and 2 CPU processes.

    python benchmarks/dropin_parity.py [--steps 150] [--out benchmarks/results/dropin_parity.json]

Runs examples/accelerate_unchanged.py (a plain `accelerate.Accelerator()` loop) and examples/hf_trainer.py (a plain
transformers `Trainer`) through `python -m lightning_fp8.accelerate launch --mixed_precision {fp8,bf16}`, with
learning rates that decay linearly to zero, and records each run's final evaluation loss and the FP8 conversion
summary line. One seed: the gap is a check that the FP8 run trains like the BF16 one, not a parity claim (see
docs/measuring.md). On a CPU without BF16 hardware the BF16 runs are slow (software BF16); times are not compared.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    if proc.returncode != 0 or loss is None:
        raise RuntimeError(f"{cmd + script_args} failed ({proc.returncode}):\n{out[-3000:]}")
    return {"eval_loss": float(loss.group(1)), "fp8_layers": summary.group(1) if summary else None,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dropin_parity.json"))
    args = p.parse_args()
    scripts = {
        "accelerate_unchanged": ["examples/accelerate_unchanged.py", "--steps", str(args.steps), "--max-chars", "200000"],
        "hf_trainer": ["examples/hf_trainer.py", "--output_dir", "/tmp/lightning_fp8_dropin_parity", "--max_steps",
                       str(args.steps), "--per_device_train_batch_size", "8", "--learning_rate", "3e-3",
                       "--warmup_steps", str(args.steps // 10), "--lr_scheduler_type", "linear", "--save_strategy", "no",
                       "--report_to", "none", "--disable_tqdm", "true", "--max_chars", "200000", "--seed", "0"],
    }
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    results = {"what": "final eval loss, FP8 vs BF16, unchanged scripts under python -m lightning_fp8.accelerate "
                       "launch, same seed, LR decaying linearly to zero", "steps": args.steps, "cpu": cpu, "runs": {}}
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
