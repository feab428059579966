"""SQNR of each GEMM of a linear layer (output, dgrad, wgrad) under the Blackwell-era recipes, next to torchao's MXFP8.

512 tokens x 1024 in x 2816 out, random normal inputs and gradients (the shapes and data of docs/numerics.md's table
for the other recipes), float32 throughout, against an float32 nn.Linear: FP8Linear with scaling "current",
"blockwise", "mxfp8" (and weight_grad="high_precision"), "nvfp4" (stochastic gradients over 3 seeds, and with nearest
rounding, and without the Hadamard transform); torchao's emulated MXFP8 training recipe (`MXFP8_EMULATED_RCEIL`: its
`_to_mxfp8_then_scaled_mm` autograd function with KernelPreference.EMULATED and ScaleCalculationMode.RCEIL, which is
what its MXFP8 linear runs). Second case: one input channel x1e6 (512 x 1024 x 1024), the SQNR of the weight gradient
of the other channels (the outlier case of docs/numerics.md).

    pip install torchao   # into the benchmark's environment only: it is not a dependency of lightning-fp8
    python benchmarks/blackwell_sqnr.py --out benchmarks/results/blackwell_sqnr
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import warnings

import torch
from torch import nn

from lightning_fp8 import FP8Linear, FP8Recipe


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref = ref.double()
    return float(20 * torch.log10(ref.norm() / (ref - approx.double()).norm()))


def grads(layer, x, dy, bf16=False):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = layer(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad


def torchao_mxfp8(ref: nn.Linear):
    """torchao's emulated MXFP8 training GEMMs as a module (forward, dgrad and wgrad through its autograd function)."""
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    class TorchaoMX(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(ref.weight.detach().clone())

        def forward(self, x):
            return _to_mxfp8_then_scaled_mm(x, self.weight, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)

    return TorchaoMX()


#: name -> (recipe, under BF16 autocast): the high-precision weight gradient is a BF16 GEMM, so it and its quantized
#: twin run under BF16 autocast (every GEMM output BF16); the rest in float32 as docs/numerics.md's table
RECIPES = {
    "per-tensor (current)": (FP8Recipe(scaling="current"), False),
    "blockwise": (FP8Recipe(scaling="blockwise"), False),
    "mxfp8": (FP8Recipe(scaling="mxfp8"), False),
    "mxfp8 (BF16 autocast)": (FP8Recipe(scaling="mxfp8"), True),
    "mxfp8, weight_grad=high_precision (BF16 autocast)": (FP8Recipe(scaling="mxfp8", weight_grad="high_precision"), True),
    "nvfp4": (FP8Recipe(scaling="nvfp4"), False),
    "nvfp4, nearest rounding": (FP8Recipe(scaling="nvfp4", rounding="nearest"), False),
    "nvfp4, no Hadamard transform": (FP8Recipe(scaling="nvfp4", random_hadamard=False), False),
}


def measure(shape, outlier: bool, with_torchao: bool):
    tokens, k, n = shape
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=False)
    x = torch.randn(tokens, k)
    if outlier:
        x[:, 7] *= 1e6
    dy = torch.randn(tokens, n) * 1e-2
    y_ref, dx_ref, dw_ref = grads(ref, x, dy)
    other = torch.ones(k, dtype=torch.bool)
    other[7] = False

    def sqnrs(y, dx, dw):
        if outlier:
            return {"wgrad_other_channels": sqnr_db(dw_ref[:, other], dw[:, other])}
        return {"output": sqnr_db(y_ref, y), "dgrad": sqnr_db(dx_ref, dx), "wgrad": sqnr_db(dw_ref, dw)}

    rows = {}
    for name, (recipe, bf16) in RECIPES.items():
        seeds = (0, 1, 2) if recipe.rounding_for("grad_output") == "stochastic" else (0,)
        runs = []
        for seed in seeds:
            torch.manual_seed(seed)
            layer = FP8Linear.from_linear(copy.deepcopy(ref), recipe)
            layer.weight.grad = None
            runs.append(sqnrs(*grads(layer, x, dy, bf16)))
        rows[name] = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
        if len(runs) > 1:
            rows[name]["seeds"] = len(runs)
            rows[name]["spread"] = {key: max(r[key] for r in runs) - min(r[key] for r in runs) for key in runs[0]}
    if with_torchao:
        rows["torchao MXFP8_EMULATED_RCEIL"] = sqnrs(*grads(torchao_mxfp8(ref), x, dy))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/blackwell_sqnr")
    parser.add_argument("--no-torchao", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with_torchao = not args.no_torchao
    torchao_version = None
    if with_torchao:
        import torchao

        torchao_version = torchao.__version__
    ordinary = measure((512, 1024, 2816), outlier=False, with_torchao=with_torchao)
    outlier = measure((512, 1024, 1024), outlier=True, with_torchao=with_torchao)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    summary = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "torchao": torchao_version,
               "machine": f"{cpu}, {torch.get_num_threads()} threads (CPU emulation)",
               "ordinary_512x1024x2816": ordinary, "outlier_channel_512x1024x1024": outlier}
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    lines = [f"# SQNR per GEMM: Blackwell-era recipes and torchao's MXFP8 ({summary['date']}, torch {summary['torch']}, "
             f"torchao {torchao_version})", "", f"Machine: {summary['machine']}. Run: `python benchmarks/blackwell_sqnr.py`"
             " (torchao installed in the benchmark's environment only).", "",
             "| recipe | output | dgrad | wgrad | outlier case: wgrad of the other channels |", "|---|---|---|---|---|"]
    for name, row in ordinary.items():
        spread = row.get("spread")
        note = f" (mean of {row['seeds']} seeds, spread ≤ {max(spread.values()):.2f} dB)" if spread else ""
        lines.append(f"| {name}{note} | {row['output']:.2f} dB | {row['dgrad']:.2f} dB | {row['wgrad']:.2f} dB | "
                     f"{outlier[name]['wgrad_other_channels']:.2f} dB |")
    lines += ["", "Rows marked with seeds round gradients stochastically: each layer draws from its own Philox stream (seeded "
              "from torch's generator under `torch.manual_seed(seed)`), so they are a mean over seeds, and two runs of "
              "different code that draws other numbers compare within the spread, not digit for digit. The other rows "
              "are deterministic."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
