"""Eager overhead of FP8Linear, in one run: dispatched operators and CPU time, next to nn.Linear.

    python benchmarks/overhead.py [--out benchmarks/results/overhead] [--repeats 20] [--skip-large]

1. Operators dispatched per FP8Linear forward+backward (steady state, BF16 autocast, 256x512x1024), per scaling mode:
   eager (a TorchDispatchMode counts every operator; a lightning_fp8 custom op counts once and is one or two kernel
   launches on CUDA, see lightning_fp8/kernels/ops.py), and compiled with inductor (its generated kernels plus the
   custom-op calls left in the graph).
2. Operators of one per-step scale close of every layer (the engine's), for models of 10 and 200 FP8 layers.
3. CPU time of a forward+backward, FP8Linear (emulated, every recipe) vs nn.Linear under BF16 autocast and in float32,
   at 512x1024x2816 and 2048x4096x4096: medians of interleaved repeats in this one process (so all see the same
   machine state).

Results go to <out>.json and <out>.md with the machine, versions and date.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_fp8 import FP8Linear, FP8Recipe, convert_to_fp8  # noqa: E402
from lightning_fp8.engine.step_closer import ScalingStepCloser  # noqa: E402
from lightning_fp8.modules.emulation import cpu_has_native_bf16  # noqa: E402

warnings.simplefilter("ignore")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def non_view(self) -> int:
        def view(f):
            s = f._schema
            return bool(s.returns) and s.returns[0].alias_info is not None and not s.is_mutable

        return sum(n for f, n in self.ops.items() if not view(f))

    def custom(self) -> int:
        return sum(n for f, n in self.ops.items() if str(f).startswith("lightning_fp8."))


def fwd_bwd(layer, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()


def count_eager(layer, x):
    for _ in range(3):
        fwd_bwd(layer, x)
    with Count() as c:
        fwd_bwd(layer, x)
    return c


def count_inductor(layer, x):
    """(inductor's generated kernels, lightning_fp8 custom-op calls in the compiled forward and backward graphs)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor import metrics

    custom = []

    def count_graph(gm, example_inputs):
        n = 0
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.args[0] if "auto_functionalized" in str(node.target) and node.args else node.target
            n += str(target).startswith("lightning_fp8.")
        custom.append(n)
        return gm

    torch._dynamo.reset()
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backend = aot_autograd(fw_compiler=count_graph, bw_compiler=count_graph,
                           partition_fn=min_cut_rematerialization_partition,  # as aot_eager / inductor do
                           keep_inference_input_mutations=True)
    counted = torch.compile(layer, fullgraph=True, backend=backend)
    for _ in range(2):
        fwd_bwd(counted, x)
    torch._dynamo.reset()
    metrics.reset()
    compiled = torch.compile(layer, fullgraph=True)
    for _ in range(2):
        fwd_bwd(compiled, x)
    return metrics.generated_kernel_count, sum(custom[:2])


def ops_table():
    rows = []
    x = torch.randn(256, 512, requires_grad=True)
    base = count_eager(nn.Linear(512, 1024), x)
    rows.append({"layer": "nn.Linear", "mode": "eager", "non_view_ops": base.non_view, "custom_ops": 0})
    for scaling in ("delayed", "current"):
        for engine in (False, True):
            layer = FP8Linear(512, 1024, recipe=FP8Recipe(scaling=scaling))
            layer.closes_own_steps = not engine
            c = count_eager(layer, x)
            rows.append({
                "layer": f"FP8Linear {scaling}", "mode": "eager, " + ("engine" if engine else "no engine (lazy close)"),
                "non_view_ops": c.non_view, "custom_ops": c.custom(),
            })
        layer = FP8Linear(512, 1024, recipe=FP8Recipe(scaling=scaling))
        layer.closes_own_steps = False
        kernels, custom = count_inductor(layer, x)
        rows.append({"layer": f"FP8Linear {scaling}", "mode": "inductor, engine", "generated_kernels_compiled": kernels,
                     "custom_ops": custom})
    return rows


def close_table():
    rows = []
    for n in (10, 200):
        model = convert_to_fp8(nn.Sequential(*[nn.Linear(32, 32) for _ in range(n)]),
                               FP8Recipe(keep_first_last_in_bf16=False))
        fwd_bwd(model, torch.randn(8, 32, requires_grad=True))
        scales = ScalingStepCloser({str(i): m for i, m in enumerate(model)})
        scales.close_step()
        fwd_bwd(model, torch.randn(8, 32, requires_grad=True))
        with Count() as c:
            scales.close_step()
        rows.append({"fp8_layers": n, "ops_per_step_close": c.non_view})
    return rows


def fwd_bwd_fp32(layer, x):
    layer(x).sum().backward()


def time_shape(m, k, n, recipes, repeats, bf16_repeats):
    """Medians of interleaved repeats (every layer once per round, so all see the same machine state) of: nn.Linear
    under BF16 autocast (the issue's baseline), nn.Linear in float32, and FP8Linear per recipe (emulated).

    Why the float32 baseline too: an AVX2-only CPU has no BF16 hardware, torch's BF16 GEMMs there are a scalar
    fallback (about 1 GFLOP/s on the development machine against 150 for float32), so "FP8 vs BF16" alone would
    flatter the emulation; the emulation uses float32 GEMMs on such a CPU (lightning_fp8/modules/gemm.py,
    `cpu_has_native_bf16`). BF16 gets its own (smaller) number of rounds where one round takes minutes."""
    torch.manual_seed(0)
    ref = nn.Linear(k, n)
    layers = {"bf16": (ref, fwd_bwd), "fp32": (ref, fwd_bwd_fp32)}
    for recipe in recipes:
        fp8 = FP8Linear(k, n, recipe=recipe)
        fp8.load_state_dict(ref.state_dict())
        layers[recipe_name(recipe)] = (fp8, fwd_bwd)
    x = torch.randn(m, k, requires_grad=True)
    times = {name: [] for name in layers}
    for name, (layer, step) in layers.items():
        for _ in range(1 if name == "bf16" and bf16_repeats < repeats else 3):
            step(layer, x)
    for round_ in range(repeats):
        for name, (layer, step) in layers.items():
            if name == "bf16" and round_ >= bf16_repeats:
                continue
            layer.zero_grad(set_to_none=True)
            x.grad = None
            t0 = time.perf_counter()
            step(layer, x)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    for recipe in recipes:
        name = recipe_name(recipe)
        rows.append({"shape": f"{m}x{k}x{n}", "recipe": name, "bf16_ms": round(med["bf16"] * 1e3, 2),
                     "bf16_rounds": len(times["bf16"]), "fp32_ms": round(med["fp32"] * 1e3, 2),
                     "fp8_ms": round(med[name] * 1e3, 2), "fp8_rounds": len(times[name]),
                     "ratio_vs_bf16": round(med[name] / med["bf16"], 3),
                     "ratio_vs_fp32": round(med[name] / med["fp32"], 2)})
    return rows


def recipe_name(recipe) -> str:
    return recipe.scaling + ("" if recipe.power_of_2_scales else " (scales not pow2)")


def time_table(repeats, skip_large):
    recipes = (FP8Recipe(), FP8Recipe(scaling="current"), FP8Recipe(power_of_2_scales=False),
               FP8Recipe(scaling="rowwise"), FP8Recipe(scaling="blockwise"))
    rows = time_shape(512, 1024, 2816, recipes, repeats, bf16_repeats=max(3, repeats // 4))
    if not skip_large:
        rows += time_shape(2048, 4096, 4096, recipes, max(3, repeats // 4), bf16_repeats=1)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/overhead")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "native_bf16": cpu_has_native_bf16()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.date.today().isoformat(),
        "ops": ops_table() if not args.no_compile else [],
        "step_close": close_table(),
        "time": time_table(args.repeats, args.skip_large),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# FP8Linear eager overhead ({result['date']}, torch {torch.__version__}, {result['machine']['cpus']} CPUs, "
             f"{result['machine']['torch_threads']} threads)", "", "## Dispatched operators per forward+backward", "",
             "| layer | mode | non-view ops | custom ops | inductor kernels |", "|---|---|---:|---:|---:|"]
    for r in result["ops"]:
        lines.append(f"| {r['layer']} | {r['mode']} | {r.get('non_view_ops', '')} | {r['custom_ops']} | "
                     f"{r.get('generated_kernels_compiled', '')} |")
    lines += ["", "## One scale close of every layer (engine, per optimizer step)", "", "| FP8 layers | ops |", "|---:|---:|"]
    lines += [f"| {r['fp8_layers']} | {r['ops_per_step_close']} |" for r in result["step_close"]]
    lines += ["", "## CPU forward+backward time, emulated FP8Linear vs nn.Linear (medians of interleaved rounds)", "",
              f"This CPU multiplies BF16 in hardware: {cpu_has_native_bf16()} (without it torch's BF16 GEMMs are a slow "
              "fallback and the emulation runs float32 GEMMs, so the float32 column is the fair baseline).", "",
              "| shape (MxKxN) | recipe | BF16 autocast ms (rounds) | float32 ms | FP8 ms (rounds) | FP8 / BF16 | FP8 / float32 |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['recipe']} | {r['bf16_ms']} ({r['bf16_rounds']}) | {r['fp32_ms']} | {r['fp8_ms']} "
              f"({r['fp8_rounds']}) | {r['ratio_vs_bf16']} | {r['ratio_vs_fp32']} |" for r in result["time"]]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
