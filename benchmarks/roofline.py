"""Roofline model: predicted FP8 / BF16 time of one linear layer's training step (forward + backward), per recipe and
GPU, for LLaMA-3 8B and 70B linear shapes, ours and Transformer Engine's kernel structure. A model, not a measurement.

    python benchmarks/roofline.py [--out benchmarks/results/roofline]

Runs on CPU in seconds: each FP8 step's kernels are recorded from our CUDA path on meta tensors
(lightning_fp8/conversion/roofline.py explains the model; tests/test_launch_budget.py pins the same launches), then
timed with the GPU's published peaks (lightning_fp8/conversion/shape_filter.py `GPU_SPECS`, sources there) and the
efficiencies assumed on `GPUSpec`. Shapes are M tokens x K in x N out; LLaMA-3 8B: hidden 4096, 32 query and 8
key/value heads of 128 (fused q/k/v: 6144 outputs), MLP 14336; 70B: hidden 8192, 64 / 8 heads (fused q/k/v: 10240),
MLP 28672.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_fp8 import FP8Recipe  # noqa: E402
from lightning_fp8.conversion.roofline import MIN_KERNEL_S, LayerShape, predict, te_launches  # noqa: E402
from lightning_fp8.conversion.shape_filter import GPUSpec, spec_for_name  # noqa: E402
from bench_io import write_results  # noqa: E402

MODELS = {
    "LLaMA-3 8B": {"qkv": (4096, 6144), "o": (4096, 4096), "gate/up": (4096, 14336), "down": (14336, 4096)},
    "LLaMA-3 70B": {"qkv": (8192, 10240), "o": (8192, 8192), "gate/up": (8192, 28672), "down": (28672, 8192)},
}
TOKENS = (4096, 16384)
GPUS = ("H100", "H200", "B200", "RTX 5090")
RECIPES = {
    "delayed": FP8Recipe(),
    "current": FP8Recipe(scaling="current"),
    "rowwise": FP8Recipe(scaling="rowwise"),
    "blockwise": FP8Recipe(scaling="blockwise", format="e4m3"),
    "mxfp8": FP8Recipe(scaling="mxfp8"),
    "nvfp4": FP8Recipe(scaling="nvfp4"),
}
#: Transformer Engine's structure is modelled for the per-tensor recipes it documents as fused cast + transpose
TE_RECIPES = ("delayed", "current")
HEADLINE = (LayerShape(16384, 4096, 14336), "H100")
#: issue 35's shape and GPU for the Blackwell recipes (targets: mxfp8 >= 1.4x BF16, nvfp4 >= 2.0x)
BLACKWELL_HEADLINE = (LayerShape(16384, 4096, 14336), "B200")


def run() -> dict:
    rows = []
    for model, layers in MODELS.items():
        for tokens in TOKENS:
            for layer, (k, n) in layers.items():
                shape = LayerShape(tokens, k, n)
                for gpu in GPUS:
                    spec = spec_for_name(gpu)
                    for name, recipe in RECIPES.items():
                        ours = predict(shape, recipe, spec)
                        te = predict(shape, recipe, spec, te_launches(shape, recipe)) if name in TE_RECIPES else None
                        rows.append({"model": model, "layer": layer, "tokens": tokens, "k": k, "n": n, "gpu": gpu,
                                     "recipe": name, "bf16_us": ours.bf16_s * 1e6, "fp8_us": ours.fp8_s * 1e6,
                                     "speedup": ours.speedup, "kernels": len(ours.kernels),
                                     "te_speedup": te.speedup if te else None})
    shape, gpu = HEADLINE
    spec = spec_for_name(gpu)
    breakdown = {name: [(kernel, seconds * 1e6) for kernel, seconds in predict(shape, recipe, spec).kernels]
                 for name, recipe in RECIPES.items() if name in ("delayed", "current", "rowwise", "blockwise")}
    blackwell_shape, blackwell_gpu = BLACKWELL_HEADLINE
    blackwell = {name: [(kernel, seconds * 1e6) for kernel, seconds in
                        predict(blackwell_shape, RECIPES[name], spec_for_name(blackwell_gpu)).kernels]
                 for name in ("delayed", "mxfp8", "nvfp4")}
    specs = {gpu: _spec_dict(spec_for_name(gpu)) for gpu in GPUS}
    return {"date": datetime.date.today().isoformat(), "rows": rows, "headline": {"shape": vars(shape), "gpu": gpu,
            "breakdown_us": breakdown}, "blackwell_headline": {"shape": vars(blackwell_shape), "gpu": blackwell_gpu,
            "breakdown_us": blackwell}, "auto": _auto_decisions(), "specs": specs, "min_kernel_s": MIN_KERNEL_S}


def _auto_decisions() -> list:
    """What recipe="auto" picks on each simulated architecture, with the Triton casts (a GPU machine) and without
    (the torch reference casts), and why (lightning_fp8/presets.py: the model's figures)."""
    from lightning_fp8.kernels.device import simulate_cuda
    from lightning_fp8.presets import auto_recipe

    decisions = []
    for capability in ((8, 9), (9, 0), (10, 0), (12, 0)):
        for triton in (True, False):
            with simulate_cuda(capability, triton=triton):
                choice = auto_recipe()
            decisions.append({"capability": list(capability), "triton": triton, "recipe": choice.recipe.scaling,
                              "reason": choice.reason})
    return decisions


def _spec_dict(spec: GPUSpec) -> dict:
    return {k: getattr(spec, k) for k in ("name", "bf16_tflops", "fp8_tflops", "fp4_tflops", "hbm_tbps",
                                          "bf16_efficiency", "fp8_efficiency", "bw_efficiency", "capability")}


def markdown(result: dict) -> str:
    lines = [f"# Roofline model: FP8 / BF16 per linear layer training step ({result['date']})", "",
             "**A model, not a measurement** (no GPU has run this project's code): written by "
             "`python benchmarks/roofline.py`; the model is lightning_fp8/conversion/roofline.py. Each FP8 step's "
             "kernels are recorded from our CUDA path on meta tensors (as the engine runs it in steady state: the "
             "per-layer scale close is one pass for all layers per iteration and is left out, and delayed casts "
             "skip their amax pre-pass once the engine's decision read says the history sizes the scale), each "
             "kernel timed as "
             "max(FLOPs / (peak x efficiency), bytes / (HBM x efficiency), "
             f"{result['min_kernel_s'] * 1e6:.0f} us), summed. BF16: nn.Linear's three GEMMs on BF16 operands. "
             "TE: the same model on Transformer Engine's documented structure (a fused cast + transpose per "
             "operand, three GEMMs; current scaling adds an amax pass per operand).", "",
             "GPU figures (dense peaks from the vendors' datasheets, sources in "
             "lightning_fp8/conversion/shape_filter.py; efficiencies are assumptions):", "",
             "| GPU | BF16 TFLOP/s | FP8 TFLOP/s | FP4 TFLOP/s | HBM TB/s | BF16 GEMM eff. | FP8 GEMM eff. | HBM eff. |",
             "|---|---|---|---|---|---|---|---|"]
    for gpu, s in result["specs"].items():
        lines.append(f"| {s['name']} | {s['bf16_tflops']:.0f} | {s['fp8_tflops']:.0f} | {s['fp4_tflops'] or '-'} | "
                     f"{s['hbm_tbps']} | {s['bf16_efficiency']} | {s['fp8_efficiency']} | {s['bw_efficiency']} |")
    lines += ["", "With those efficiencies an FP8 GEMM is at most 2 x 0.65 / 0.80 = 1.63x a BF16 one: the ceiling of "
              "every per-tensor figure below before any cast is paid.", ""]
    for model in MODELS:
        for tokens in TOKENS:
            lines += [f"## {model}, {tokens} tokens: predicted BF16 time / FP8 time (TE structure in brackets)", "",
                      "| layer (K x N) | GPU | " + " | ".join(RECIPES) + " |", "|---" * (2 + len(RECIPES)) + "|"]
            for layer in MODELS[model]:
                for gpu in GPUS:
                    cells = []
                    for name in RECIPES:
                        row = next(r for r in result["rows"] if r["model"] == model and r["tokens"] == tokens
                                   and r["layer"] == layer and r["gpu"] == gpu and r["recipe"] == name)
                        cell = f"{row['speedup']:.2f}"
                        if row["te_speedup"] is not None:
                            cell += f" ({row['te_speedup']:.2f})"
                        cells.append(cell)
                    k, n = MODELS[model][layer]
                    lines.append(f"| {layer} ({k} x {n}) | {gpu} | " + " | ".join(cells) + " |")
            lines.append("")
    head = result["headline"]
    shape = head["shape"]
    lines += [f"## Where the time goes: {shape['tokens']} x {shape['in_features']} x {shape['out_features']} on "
              f"{head['gpu']} (microseconds per kernel, in launch order)", ""]
    for name, kernels in head["breakdown_us"].items():
        total = sum(t for _, t in kernels)
        lines.append(f"- {name} ({total:.0f} us): " + ", ".join(f"{k} {t:.0f}" for k, t in kernels))
    lines += ["", _what_keeps_it_lower(result), ""]
    head = result["blackwell_headline"]
    shape = head["shape"]
    lines += [f"## Blackwell: {shape['tokens']} x {shape['in_features']} x {shape['out_features']} on {head['gpu']} "
              "(microseconds per kernel, in launch order)", ""]
    for name, kernels in head["breakdown_us"].items():
        total = sum(t for _, t in kernels)
        lines.append(f"- {name} ({len(kernels)} kernels, {total:.0f} us): "
                     + ", ".join(f"{k} {t:.0f}" for k, t in kernels))
    lines += ["", _blackwell_targets(result), "", "## recipe=\"auto\" per architecture (lightning_fp8/presets.py)", "",
              "Per-tensor delayed scaling is the reference; an architecture's candidate (sm100: mxfp8; sm120: mxfp8, "
              "then current scaling) is taken only where this model predicts it no slower, at "
              "16384 x 4096 x 14336 on the family's GPU (sm89 L40S, sm90 H100 SXM, sm100 B200, sm120 RTX 5090). "
              "Without triton a CUDA machine runs the casts' torch reference.", "",
              "| GPU | Triton casts | auto picks | why (the model's figures) |", "|---|---|---|---|"]
    for d in result["auto"]:
        cap = d["capability"]
        lines.append(f"| sm{cap[0]}{cap[1]} | {'yes' if d['triton'] else 'no'} | {d['recipe']} | {d['reason']} |")
    lines.append("")
    return "\n".join(lines)


def _blackwell_targets(result: dict) -> str:
    """Issue 35's targets on B200 at 16384 x 4096 x 14336 (mxfp8 >= 1.4x BF16, nvfp4 >= 2.0x), from the table."""
    head = result["blackwell_headline"]
    shape = head["shape"]

    def row(recipe):
        return next(r for r in result["rows"] if r["gpu"] == head["gpu"] and r["recipe"] == recipe
                    and r["tokens"] == shape["tokens"] and r["k"] == shape["in_features"]
                    and r["n"] == shape["out_features"])

    mx, nv, delayed = row("mxfp8"), row("nvfp4"), row("delayed")
    return (f"**Against issue 35's targets** ({shape['tokens']} x {shape['in_features']} x {shape['out_features']}, "
            f"{head['gpu']}): mxfp8 {mx['speedup']:.2f}x BF16 in {mx['kernels']} kernels (target 1.4x, <= 7 "
            f"launches), nvfp4 {nv['speedup']:.2f}x in {nv['kernels']} kernels (target 2.0x, <= 10), per-tensor "
            f"delayed {delayed['speedup']:.2f}x in {delayed['kernels']}. The counts are the honest recorder's "
            "(kernels/trace.py) over the fused Triton casts (kernels/triton_microscaled.py) and GEMMs that read the "
            "casts' padded data and swizzled scales as they are. mxfp8 sits just under per-tensor scaling here: the "
            "same three FP8 GEMMs, and casts that also write the E8M0 scales (1 byte per 32 elements per layout).")


def _what_keeps_it_lower(result: dict) -> str:
    """The headline shape's per-tensor prediction against issue 24's targets (per-tensor >= 1.6x, blockwise >= 1.35x
    on H100), with the kernels that set it, computed from the table."""
    head = result["headline"]
    shape = head["shape"]

    def row(recipe):
        return next(r for r in result["rows"] if r["gpu"] == head["gpu"] and r["recipe"] == recipe
                    and r["tokens"] == shape["tokens"] and r["k"] == shape["in_features"]
                    and r["n"] == shape["out_features"])

    delayed, blockwise = row("delayed"), row("blockwise")
    kernels = head["breakdown_us"]["delayed"]
    gemm_us = sum(t for k, t in kernels if "scaled_mm" in k)
    casts = [(k, t) for k, t in kernels if "scaled_mm" not in k]
    largest = max(casts, key=lambda kt: kt[1])
    spec = result["specs"][head["gpu"]]
    ceiling = 2 * spec["fp8_efficiency"] / spec["bf16_efficiency"]
    return (f"**Against the targets** ({shape['tokens']} x {shape['in_features']} x {shape['out_features']}, "
            f"{head['gpu']}): blockwise {blockwise['speedup']:.2f}x (target 1.35x); per-tensor (delayed) "
            f"{delayed['speedup']:.2f}x, Transformer Engine's structure {delayed['te_speedup']:.2f}x (target 1.6x). "
            f"What keeps per-tensor below 1.6x, in this model: the three FP8 GEMMs alone take {gemm_us:.0f} of "
            f"{delayed['fp8_us']:.0f} us, so with the assumed GEMM efficiencies ({spec['fp8_efficiency']} FP8, "
            f"{spec['bf16_efficiency']} BF16) the ceiling is {ceiling:.2f}x before any cast; the casts take "
            f"{sum(t for _, t in casts):.0f} us, the largest being dY's ({largest[1]:.0f} us: the "
            f"{shape['tokens']} x {shape['out_features']} gradient read once in BF16 and written in both FP8 "
            "layouts), the rest the forward's casts of x and W (each writing its transpose in the same pass, kept for "
            "backward). That is Transformer Engine's structure (one cast per operand, three GEMMs), so no launch is "
            "left to remove; what would shrink the casts: fusing dY's cast into the kernel that produces dY (the next "
            "layer's backward epilogue; torchao's roofline models the same fusion); what would move the ceiling: the FP8 GEMM efficiency measured on a GPU (benchmarks/linear.py) "
            "instead of assumed.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/roofline")
    args = parser.parse_args()
    result = run()
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
