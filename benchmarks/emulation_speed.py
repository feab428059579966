"""CPU speed of the emulated FP8Linear forward+backward against the BF16 nn.Linear, with torchao's float8 emulation in
the same run.

One layer at M x K x N (tokens x in x out; default 512 x 1024 x 2816, bias, float32 parameters and input as a model
has them) under BF16 autocast: y = layer(x); y.backward(dy). Variants, timed in interleaved rounds in this one process
(every variant once per round, so all see the same machine state; each round's FP8 / BF16 ratio is paired):

  bf16                  nn.Linear under BF16 autocast: the baseline
  ours <scaling>        FP8Linear, FP8Recipe(scaling=...) for delayed, current, rowwise, blockwise (the CPU emulation)
  torchao <recipe>      torchao.float8 Float8Linear with Float8LinearConfig(emulate=True): "tensorwise" (current
                        scaling) and "rowwise", where torchao is importable. torchao has no delayed scaling any more
                        and its blockwise training (torchao.prototype.blockwise_fp8_training) quantizes with Triton
                        kernels only: no CPU path, so neither is in the table.

    python benchmarks/emulation_speed.py [--rounds 15] [--threads 2]
    python benchmarks/emulation_speed.py --profile delayed      # where the time of one variant goes (torch.profiler)

torchao is not a dependency: run it from a Python that has torchao and this repository's requirements (e.g. a venv
with `pip install --no-deps torchao` whose site-packages sees this project's). Writes
benchmarks/results/emulation_speed.json and .md (machine: CPU model, its BF16 / AMX flags, the load average).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_fp8 import FP8Linear, FP8Recipe  # noqa: E402
from lightning_fp8.modules.emulation import cpu_has_native_bf16  # noqa: E402

OURS = ("delayed", "current", "rowwise", "blockwise")
TORCHAO = ("tensorwise", "rowwise")


def step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy)


def torchao_layer(ref: nn.Linear, recipe: str):
    """torchao's Float8Linear for `recipe` with emulation on (or None where torchao cannot be imported)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception:  # not installed, or not importable with this torch
        return None
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    model = nn.Sequential(nn.Linear(ref.in_features, ref.out_features))
    model[0].load_state_dict(ref.state_dict())
    convert_to_float8_training(model, config=config)
    return model


def layers(m: int, k: int, n: int) -> dict:
    torch.manual_seed(0)
    ref = nn.Linear(k, n)
    out = {"bf16": ref}
    for scaling in OURS:
        layer = FP8Linear(k, n, recipe=FP8Recipe(scaling=scaling))
        layer.load_state_dict(ref.state_dict())
        out[f"ours {scaling}"] = layer
    for recipe in TORCHAO:
        layer = torchao_layer(ref, recipe)
        if layer is not None:
            out[f"torchao {recipe}"] = layer
    return out


def cpu_info() -> dict:
    info = dict(model=platform.processor(), flags=[])
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                info["flags"] = sorted(f for f in flags
                                       if "bf16" in f or f.startswith("amx") or f in ("avx512f", "avx2"))
                break
    except OSError:
        pass
    info["cpus"] = os.cpu_count()
    info["native_bf16"] = cpu_has_native_bf16()
    return info


def measure(m: int, k: int, n: int, rounds: int) -> dict:
    variants = layers(m, k, n)
    torch.manual_seed(1)
    x = torch.randn(m, k, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    for layer in variants.values():  # warm up: first calls allocate, the delayed scales settle
        for _ in range(3):
            step(layer, x, dy)
    times = {name: [] for name in variants}
    load_before = os.getloadavg()[0]
    for _ in range(rounds):
        for name, layer in variants.items():
            start = time.perf_counter()
            step(layer, x, dy)
            times[name].append(time.perf_counter() - start)
    load_after = os.getloadavg()[0]
    bf16 = times["bf16"]
    rows = []
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, bf16)]
        rows.append(dict(variant=name, median_ms=round(1e3 * statistics.median(ts), 2),
                         min_ms=round(1e3 * min(ts), 2), ratio_of_medians=round(statistics.median(ts) /
                                                                                  statistics.median(bf16), 3),
                         median_paired_ratio=round(statistics.median(ratios), 3)))
    return dict(shape=[m, k, n], rounds=rounds, load_1min_before=load_before, load_1min_after=load_after, rows=rows,
                missing=[f"torchao {r}" for r in TORCHAO if f"torchao {r}" not in variants])


def profile(variant: str, m: int, k: int, n: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    layer = layers(m, k, n)[variant if variant == "bf16" or " " in variant else f"ours {variant}"]
    x = torch.randn(m, k, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    for _ in range(3):
        step(layer, x, dy)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step(layer, x, dy)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def markdown(result: dict) -> str:
    cpu = result["cpu"]
    lines = [
        f"# Emulated FP8Linear forward+backward vs BF16 nn.Linear on the CPU ({result['date']})",
        "",
        f"CPU: {cpu['model']}, {cpu['cpus']} CPUs, flags {', '.join(cpu['flags'])}; BF16 in hardware: "
        f"{cpu['native_bf16']}. torch {result['torch']}, {result['threads']} threads, torchao "
        f"{result['torchao'] or 'not importable'}. Shape M x K x N = {' x '.join(map(str, result['shape']))} (tokens x "
        f"in x out), bias, BF16 autocast, float32 input and parameters; {result['rounds']} interleaved rounds, one "
        f"process; 1-minute load average {result['load_1min_before']:.2f} before, {result['load_1min_after']:.2f} "
        "after (other processes shared the CPUs).",
        "",
        "| variant | median ms | min ms | / BF16 (medians) | / BF16 (median of paired rounds) |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['variant']} | {r['median_ms']} | {r['min_ms']} | {r['ratio_of_medians']} | "
              f"{r['median_paired_ratio']} |" for r in result["rows"]]
    if result["missing"]:
        lines += ["", f"Not measured: {', '.join(result['missing'])} (torchao not importable here)."]
    lines += ["", "torchao has no delayed scaling, and its blockwise training quantizes with Triton kernels only "
                  "(no CPU path): neither has a torchao row."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=3, default=[512, 1024, 2816], metavar=("M", "K", "N"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", default=None, help="a variant to profile instead (e.g. delayed, bf16)")
    parser.add_argument("--out", default="benchmarks/results/emulation_speed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.profile:
        profile(args.profile, *args.shape)
        return
    try:
        import torchao
        torchao_version = torchao.__version__
    except Exception:
        torchao_version = None
    result = dict(date=datetime.date.today().isoformat(), cpu=cpu_info(), torch=torch.__version__,
                  threads=torch.get_num_threads(), torchao=torchao_version, **measure(*args.shape, args.rounds))
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
