"""What every benchmark's result starts with, the machine it ran on, and how a result is written: JSON (the numbers)
and Markdown (the table docs cite), side by side under benchmarks/results/. Also the quality benchmarks' constant-LR
variant (`--schedule constant`): their own warmup, then the LR held instead of decayed."""
from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Callable, List

import torch

from lightning_fp8.modules.emulation import cpu_has_native_bf16


def machine(**extra) -> dict:
    """The CPU model, threads, torch version, whether the CPU multiplies BF16 natively, the date and the 1-minute load
    average when the run started (a shared machine's numbers are only comparable within one run); `extra` adds
    fields (a library's version)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "bf16_hardware": cpu_has_native_bf16(), "date": datetime.date.today().isoformat(),
            "load_average_1min_at_start": os.getloadavg()[0], **extra}


def write_results(out: str, result: dict, markdown: Callable[[dict], str]) -> None:
    """Write `result` to OUT.json and its Markdown rendering to OUT.md, and print the Markdown."""
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)


#: the learning-rate schedules a quality benchmark offers: "cosine" (or the script's own decay) is each one's default
SCHEDULES: List[str] = ["cosine", "constant"]


def hold_after_warmup(schedule: Callable[[int], float], warmup: int) -> Callable[[int], float]:
    """An LR multiplier that is `schedule`'s during its `warmup` steps and 1 after them (no decay)."""
    return lambda step: schedule(step) if step < warmup else 1.0


def constant_lr(module):
    """Hold a CharGPTModule's (lightning_fp8/demo/module.py) LR constant after its warmup instead of decaying it to
    zero: everything else about the run is unchanged. Returns `module`."""
    configure = module.configure_optimizers

    def configure_constant():
        optimizers, schedulers = configure()
        for config in schedulers:
            scheduler = config["scheduler"]
            scheduler.lr_lambdas = [hold_after_warmup(f, module.warmup_steps) for f in scheduler.lr_lambdas]
        return optimizers, schedulers

    module.configure_optimizers = configure_constant
    return module
