"""Bytes of optimizer state per parameter: FP8AdamW vs torch.optim.AdamW on GPT-like models.

Counts the storage of every tensor in the optimizer state after one step (moments, block scales, step counters)
divided by the number of parameters (`lightning_fp8.optim.state_bytes_per_param`). With fp32 master weights
the parameter is the master copy and is not optimizer state; the "weights + state" column adds the parameter
bytes (4 for fp32, 2 for bf16 master weights) to show what low-precision master weights save on top.
A second, independent count: the size of `torch.save(optimizer.state_dict())`, which includes pickling
overhead and so can only be slightly larger.

Targets: <= 3.1 bytes/param with the FP16 second moment, <= 2.1 with the FP8 (sqrt) second moment.

Usage: python benchmarks/optim_memory.py   -> prints a table, writes benchmarks/results/optim_memory.json / .md
"""
from __future__ import annotations

import datetime
import io
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optim_convergence import CharGPT, cpu_name  # noqa: E402

from lightning_fp8.optim import FP8AdamW, state_bytes_per_param  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

MODELS = {
    # name: (vocab, d_model, layers, heads, context)
    "gpt-d256-L4-vocab8192": (8192, 256, 4, 4, 256),
    "gpt-d512-L4-vocab8192": (8192, 512, 4, 8, 256),
    "gpt-d384-L6-bytes": (256, 384, 6, 6, 256),
}

VARIANTS = {
    "torch AdamW (fp32 state)": lambda p: torch.optim.AdamW(p),
    "FP8AdamW fp16 v (default)": lambda p: FP8AdamW(p),
    "FP8AdamW bf16 v": lambda p: FP8AdamW(p, exp_avg_sq_dtype="bf16"),
    "FP8AdamW fp8 sqrt(v)": lambda p: FP8AdamW(p, exp_avg_sq_dtype="fp8"),
    "FP8AdamW fp16 v, block 256": lambda p: FP8AdamW(p, block_size=256),
    "FP8AdamW fp8 sqrt(v), block 256": lambda p: FP8AdamW(p, exp_avg_sq_dtype="fp8", block_size=256),
    "FP8AdamW fp16 v + bf16 master": lambda p: FP8AdamW(p, master_weights="bf16"),
    "FP8AdamW fp8 sqrt(v) + bf16 master": lambda p: FP8AdamW(p, exp_avg_sq_dtype="fp8", master_weights="bf16"),
}


def measure(model_name: str, variant: str) -> dict:
    vocab, d, layers, heads, ctx = MODELS[model_name]
    torch.manual_seed(0)
    model = CharGPT(vocab=vocab, d=d, layers=layers, heads=heads, ctx=ctx)
    n_params = sum(p.numel() for p in model.parameters())
    opt = VARIANTS[variant](model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) / n_params
    fp32_state = sum(p.numel() for p in model.parameters() if p.dim() < 2 or p.numel() < 4096)
    state = state_bytes_per_param(opt)
    return dict(
        model=model_name, variant=variant, params=n_params,
        fp32_state_fraction=fp32_state / n_params if isinstance(opt, FP8AdamW) else 1.0,
        state_bytes_per_param=state,
        serialized_bytes_per_param=buf.getbuffer().nbytes / n_params,
        weights_plus_state_bytes_per_param=param_bytes + state,
    )


def main() -> None:
    torch.set_num_threads(2)
    rows = []
    for model_name in MODELS:
        for variant in VARIANTS:
            row = measure(model_name, variant)
            rows.append(row)
            print(f"{model_name:24s} {variant:36s} state {row['state_bytes_per_param']:.3f} B/param "
                  f"(serialized {row['serialized_bytes_per_param']:.3f}), weights+state "
                  f"{row['weights_plus_state_bytes_per_param']:.3f}", flush=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, cpu=cpu_name(), block_size_default=128, min_numel_fp8_default=4096)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "optim_memory.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = [
        "# Optimizer state bytes per parameter",
        "",
        f"{meta['date']}, torch {meta['torch']}. State counted after one step: every state tensor (moments, block "
        "scales, step counters) / number of parameters. fp32 master weights are the parameters themselves and "
        "are not state. Parameters with fewer than 4096 elements or 1 dim keep fp32 state (fraction shown).",
        "",
        "| model | params | fp32-state fraction | variant | state B/param | torch.save B/param | weights + state B/param |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params']/1e6:.2f} M | {r['fp32_state_fraction']*100:.2f}% | {r['variant']} | "
                     f"{r['state_bytes_per_param']:.3f} | {r['serialized_bytes_per_param']:.3f} | "
                     f"{r['weights_plus_state_bytes_per_param']:.3f} |")
    lines.append("")
    (RESULTS / "optim_memory.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
