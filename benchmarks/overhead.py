"""Eager overhead of FP8Linear, in one run: dispatched operators and CPU time, next to nn.Linear.

    python benchmarks/overhead.py [--out benchmarks/results/overhead] [--repeats 20] [--skip-large]

1. Operators dispatched per FP8Linear forward+backward (steady state, BF16 autocast, 256x512x1024), per scaling mode:
   eager (a TorchDispatchMode counts every operator; a lightning_fp8 custom op counts once and is one or two kernel
   launches on CUDA, see lightning_fp8/kernels/ops.py), and compiled with inductor (its generated kernels plus the
   custom-op calls left in the graph).
2. Operators of one per-step scale close of every layer (the engine's), for models of 10 and 200 FP8 layers.
3. CPU time of a forward+backward, FP8Linear (emulated) vs nn.Linear under BF16 autocast, at 512x1024x2816 and
   2048x4096x4096: medians of interleaved repeats in this one process (so both see the same machine state).

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
from lightning_fp8.engine.scales import ModelScales  # noqa: E402

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
            layer.autoupdate_scales = not engine
            c = count_eager(layer, x)
            rows.append({
                "layer": f"FP8Linear {scaling}", "mode": "eager, " + ("engine" if engine else "no engine (lazy close)"),
                "non_view_ops": c.non_view, "custom_ops": c.custom(),
            })
        layer = FP8Linear(512, 1024, recipe=FP8Recipe(scaling=scaling))
        layer.autoupdate_scales = False
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
        scales = ModelScales({str(i): m for i, m in enumerate(model)})
        scales.close_step()
        fwd_bwd(model, torch.randn(8, 32, requires_grad=True))
        with Count() as c:
            scales.close_step()
        rows.append({"fp8_layers": n, "ops_per_step_close": c.non_view})
    return rows


def time_pair(m, k, n, recipe, repeats):
    torch.manual_seed(0)
    ref = nn.Linear(k, n)
    fp8 = FP8Linear(k, n, recipe=recipe)
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(m, k, requires_grad=True)
    times = {"bf16": [], "fp8": []}
    for layer in (ref, fp8):
        for _ in range(3):
            fwd_bwd(layer, x)
    for _ in range(repeats):  # interleaved: both see the same machine state
        for name, layer in (("bf16", ref), ("fp8", fp8)):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            t0 = time.perf_counter()
            fwd_bwd(layer, x)
            times[name].append(time.perf_counter() - t0)
    bf16, fp8_t = statistics.median(times["bf16"]), statistics.median(times["fp8"])
    return {"shape": f"{m}x{k}x{n}", "recipe": recipe.scaling + (" pow2" if recipe.power_of_2_scales else ""),
            "bf16_ms": round(bf16 * 1e3, 2), "fp8_ms": round(fp8_t * 1e3, 2), "ratio": round(fp8_t / bf16, 2)}


def time_table(repeats, skip_large):
    shapes = [(512, 1024, 2816)] + ([] if skip_large else [(2048, 4096, 4096)])
    rows = []
    for shape in shapes:
        for recipe in (FP8Recipe(), FP8Recipe(scaling="current"), FP8Recipe(power_of_2_scales=False)):
            rows.append(time_pair(*shape, recipe, repeats if shape[0] < 2048 else max(5, repeats // 4)))
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
                    "torch_threads": torch.get_num_threads()},
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
    lines += ["", "## CPU forward+backward time, emulated FP8Linear vs nn.Linear under BF16 autocast (medians)", "",
              "| shape (MxKxN) | recipe | BF16 ms | FP8 ms | FP8 / BF16 |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['recipe']} | {r['bf16_ms']} | {r['fp8_ms']} | {r['ratio']} |" for r in result["time"]]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
