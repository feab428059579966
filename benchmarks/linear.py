"""Forward+backward of one linear layer: BF16 vs lightning-fp8 (eager, eager without the fused kernels, compiled)
vs torchao float8 (when importable). Also the cast alone: fused Triton kernel vs the torch reference, in GB/s.

    python benchmarks/linear.py                 # full shapes (a GPU with FP8 tensor cores)
    python benchmarks/linear.py --smoke         # tiny shapes, few iterations: checks the harness (CPU is fine)

Per shape (M tokens, K in, N out) and variant: median time of y = layer(x); y.backward(dy) (bias-free, bf16
weights, bf16 activations), TFLOP/s counting 3 GEMMs of 2*M*K*N flops, speedup over BF16, and the SQNR of the
output against BF16 as a sanity check. Inputs rotate over several buffers so L2 does not hold them between
iterations. Timing: triton.testing.do_bench (median) on CUDA when triton is there, else CUDA events, else
time.perf_counter (CPU). Writes benchmarks/results/linear_<device>.json and .md after every shape.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
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
from lightning_fp8.modules.gemm import FP8EmulationWarning  # noqa: E402

FULL_SHAPES = [
    (16384, 4096, 14336),
    (8192, 8192, 8192),
    (4096, 1024, 1024),
    (16384, 4096, 4096),
    (4096, 4096, 4096),
    (2048, 2048, 2048),
    (1024, 1024, 1024),
    (512, 4096, 4096),
]
SMOKE_SHAPES = [(64, 64, 64), (128, 256, 128), (48, 96, 32)]
VARIANTS = ("bf16", "fp8", "fp8-nofuse", "fp8-compiled", "torchao")


def device_tag(device: torch.device, smoke: bool) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or "cpu"
        name = "cpu"
    tag = "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
    return f"{tag}-smoke" if smoke else tag


def make_timer(device: torch.device, iters: int, warmup: int):
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            def bench(fn):
                return do_bench(fn, warmup=max(25, warmup), rep=max(100, iters * 5), return_mode="median") * 1e-3

            return bench, "triton.testing.do_bench (median)"
        except Exception:
            pass

        def bench(fn):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1e-3)
            return statistics.median(times)

        return bench, "CUDA events (median)"

    def bench(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return bench, "time.perf_counter (median)"


@contextlib.contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def build_layer(variant: str, base: nn.Linear, device: torch.device, compile_backend: str):
    if variant == "bf16":
        return copy.deepcopy(base)
    if variant in ("fp8", "fp8-nofuse"):
        return FP8Linear.from_linear(copy.deepcopy(base), FP8Recipe())
    if variant == "fp8-compiled":
        return torch.compile(FP8Linear.from_linear(copy.deepcopy(base), FP8Recipe()), backend=compile_backend)
    if variant == "torchao":
        from torchao.float8 import convert_to_float8_training  # noqa: F401  (ImportError -> variant skipped)

        model = nn.Sequential(copy.deepcopy(base))
        convert_to_float8_training(model)
        return torch.compile(model, backend=compile_backend)
    raise ValueError(variant)


def sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    err = (y.float() - ref.float()).square().mean().item()
    sig = ref.float().square().mean().item()
    return None if err == 0 else 10 * math.log10(sig / err)  # None: identical (JSON has no inf)


def bench_shape(m, k, n, variants, device, timer, rotate, compile_backend):
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(rotate)]
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    flops = 6.0 * m * k * n
    rows = []
    ref_out = base(xs[0]).detach()
    for variant in variants:
        row = {"shape": [m, k, n], "variant": variant}
        try:
            guard = env("LIGHTNING_FP8_DISABLE_TRITON", "1") if variant == "fp8-nofuse" else contextlib.nullcontext()
            with guard:
                layer = build_layer(variant, base, device, compile_backend)
                state = {"i": 0}

                def step():
                    x = xs[state["i"] % rotate]
                    state["i"] += 1
                    y = layer(x)
                    y.backward(dy)
                    x.grad = None
                    for p in layer.parameters():
                        p.grad = None

                y0 = layer(xs[0])
                q = sqnr_db(y0.detach(), ref_out)
                row["sqnr_db_vs_bf16"] = round(q, 2) if q is not None else None
                y0.backward(dy)
                xs[0].grad = None
                t = timer(step)
            row.update(ms=round(t * 1e3, 4), tflops=round(flops / t / 1e12, 2))
        except ImportError as err:
            row.update(skipped=f"not importable: {err}")
        except Exception as err:  # keep going: one broken variant must not lose the others' numbers
            row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
        rows.append(row)
    base_ms = next((r["ms"] for r in rows if r["variant"] == "bf16" and "ms" in r), None)
    for r in rows:
        if base_ms and "ms" in r:
            r["speedup_vs_bf16"] = round(base_ms / r["ms"], 3)
    return rows


def bench_cast(m, k, device, timer, rotate):
    """The input cast alone (amax + scale + cast + transpose): fused kernel vs torch reference, effective GB/s
    counting the bytes each must move at least (read bf16 once, write fp8 twice)."""
    from lightning_fp8.modules.cast import PerTensorCaster
    from lightning_fp8.modules.layer_state import FP8LayerState

    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(rotate)]
    recipe = FP8Recipe()
    caster = PerTensorCaster(recipe)
    min_bytes = m * k * (2 + 1 + 1)
    rows = []
    for label, disable in (("cast-fused", "0"), ("cast-reference", "1")):
        row = {"shape": [m, k], "variant": label, "min_bytes": min_bytes}
        try:
            with env("LIGHTNING_FP8_DISABLE_TRITON", disable):
                meta = FP8LayerState(recipe, device=device)
                caster.cast(xs[0], meta.amax_history, "input", True, layouts=(True, True))
                torch.ops.lightning_fp8.close_scaling_step(meta.amax_history, meta.overflow_count, meta.clip_count,
                                                           *meta.constants(), True)
                it = {"i": 0}

                def step():
                    caster.cast(xs[it["i"] % rotate], meta.amax_history, "input", True, layouts=(True, True))
                    it["i"] += 1

                t = timer(step)
            row.update(ms=round(t * 1e3, 4), effective_gbps=round(min_bytes / t / 1e9, 1))
        except Exception as err:
            row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
        rows.append(row)
    return rows


def to_markdown(meta, rows, cast_rows) -> str:
    lines = [
        f"# Linear fwd+bwd benchmark: {meta['device_name']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, timer: {meta['timer']}, {meta['when']}"
        + f", fused cast kernels: {meta['fused_cast_kernels']}"
        + (" — SMOKE RUN (tiny shapes; numbers mean nothing)" if meta["smoke"] else ""),
        "",
        "| M x K x N | variant | ms | TFLOP/s | speedup vs BF16 | SQNR vs BF16 (dB) | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        note = r.get("skipped") or r.get("error") or ""
        lines.append(
            f"| {shape} | {r['variant']} | {r.get('ms', '')} | {r.get('tflops', '')} | "
            f"{r.get('speedup_vs_bf16', '')} | {r.get('sqnr_db_vs_bf16') if r.get('sqnr_db_vs_bf16') is not None else '-'} | "
            f"{note[:80]} |"
        )
    if cast_rows:
        lines += ["", "Input cast alone (amax + scale + cast + transpose, delayed scaling):", "",
                  "| M x K | path | ms | effective GB/s (min bytes / time) | note |", "|---|---|---:|---:|---|"]
        for r in cast_rows:
            lines.append(f"| {'x'.join(map(str, r['shape']))} | {r['variant']} | {r.get('ms', '')} | "
                         f"{r.get('effective_gbps', '')} | {r.get('error', '')[:80]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (runs on CPU)")
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shapes", default=None, help="e.g. 8192x8192x8192,4096x1024x1024")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--rotate", type=int, default=None, help="input buffers cycled through")
    p.add_argument("--compile-backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    p.add_argument("--no-cast", action="store_true", help="skip the cast-alone rows")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else (
        SMOKE_SHAPES if args.smoke else FULL_SHAPES)
    iters = args.iters or (3 if args.smoke else 50)
    rotate = args.rotate or (2 if args.smoke else 4)
    backend = args.compile_backend or ("inductor" if device.type == "cuda" else "aot_eager")
    variants = [v for v in args.variants.split(",") if v]
    timer, timer_name = make_timer(device, iters, warmup=1 if args.smoke else 10)
    warnings.simplefilter("ignore", FP8EmulationWarning)
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    meta = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "timer": timer_name,
        "compile_backend": backend,
        "smoke": args.smoke,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "weights": "bf16, no bias",
        "fused_cast_kernels": bool(device.type == "cuda" and __import__("lightning_fp8.kernels").kernels.triton_available()),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"linear_{device_tag(device, args.smoke)}"
    rows, cast_rows = [], []
    for m, k, n in shapes:
        shape_rows = bench_shape(m, k, n, variants, device, timer, rotate, backend)
        rows += shape_rows
        if not args.no_cast:
            cast_rows += bench_cast(m, k, device, timer, rotate)
        for r in shape_rows:
            print(json.dumps(r), flush=True)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "cast_rows": cast_rows}, indent=1))
        stem.with_suffix(".md").write_text(to_markdown(meta, rows, cast_rows))
    print(f"wrote {stem}.json and {stem}.md")
    failed = [r for r in rows + cast_rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
