"""How far the CPU emulation is from an H100's bits, per GEMM role and contraction length K (mmaemu's model of an H100
PCIe's `torch._scaled_mm`, lightning_fp8/modules/gpu_model.py).

For each role and K, an FP8Linear training step (BF16 autocast, per-tensor scaling, the library's own casts) is recorded
(`record_gemms`) on a layer laid out so that the role contracts K:

  forward  y  = x W^T   tokens x K  @  K x 512     (x: 64 tokens, in = K)     e4m3 x e4m3, fast accumulation
  dgrad    dx = dY W    tokens x K  @  K x 512     (64 tokens, out = K)        e5m2 x e4m3
  wgrad    dW = dY^T x  out x K     @  K x 512     (out 64, K tokens)          e5m2 x e4m3

Every GEMM gives a 64 x 512 output. The H100's result is mmaemu's model of the call the planner issues for sm90, with
the split-K decision the H100 makes for a training-sized GEMM of that role and K (4096 tokens, 4096 features; each
output element depends on its row, its column and the split only, so the decision of the large GEMM applies to these
rows): from mmaemu's records or envelope where it decides, else S = 1 as on an H100 with CUBLASLT_WORKSPACE_SIZE=0
(said in the table). Columns:

  differ        share of the BF16 outputs whose bits differ between the emulation and the H100
  rel(emu, H100)  ||emulation - H100|| / ||H100|| of the BF16 outputs
  err H100 / err emu   ||result - exact|| / ||exact|| of the float32 accumulator scaled (the GEMM with a float32
                output), exact = the float64 product of the FP8 values: what each costs in accuracy before the BF16
                rounding
  err H100 slow  the forward GEMM on the H100 with use_fast_accum=False (the other roles use it already)

    nice -n 19 python benchmarks/h100_vs_emulation.py [--ks 256 1024 4096 16384] [--scaling current]

Writes benchmarks/results/h100_vs_emulation.json and .md. Slow (mmaemu computes in float64: minutes per K = 16384).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_fp8 import FP8Linear, FP8Recipe  # noqa: E402
from lightning_fp8.modules.emulation import emulate  # noqa: E402
from lightning_fp8.modules.gemm import record_gemms  # noqa: E402
from lightning_fp8.modules.gpu_model import modelled_call  # noqa: E402

ROWS, COLS, LARGE = 64, 512, 4096


def recorded_gemm(role: str, k: int, scaling: str, seed: int):
    """The GEMM request of `role` from one FP8Linear training step whose `role` GEMM contracts k."""
    tokens, d_in, d_out = {"forward": (ROWS, k, COLS), "dgrad": (ROWS, COLS, k), "wgrad": (k, COLS, ROWS)}[role]
    torch.manual_seed(seed)
    layer = FP8Linear(d_in, d_out, bias=False, recipe=FP8Recipe(scaling=scaling))
    x = torch.randn(tokens, d_in, requires_grad=True)
    with record_gemms() as records:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(torch.randn_like(y) / (tokens * d_out) ** 0.5)  # a loss gradient's magnitude
    return records[("forward", "dgrad", "wgrad").index(role)]


def h100_split(role: str, k: int, fast: bool):
    """(splitk argument, where it came from) of the H100 for a training-sized GEMM of this role and K."""
    import mmaemu

    e5, e4 = torch.float8_e5m2, torch.float8_e4m3fn
    m, n = (LARGE, LARGE)
    a_dtype = e4 if role == "forward" else e5
    mat_a = torch.empty(m, k, dtype=a_dtype, device="meta")
    mat_b = torch.empty(n, k, dtype=e4, device="meta").t()
    one = torch.ones((), device="meta")
    plan = mmaemu.explain(mat_a, mat_b, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)
    if plan.validation != "ok":
        return 1, "S = 1 assumed (no H100 record for this shape: as with CUBLASLT_WORKSPACE_SIZE=0)"
    split = 1 if plan.split.S == 1 else (plan.split.S, plan.split.scheme)
    return split, f"S = {plan.split.S} ({plan.split.source})"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def measure(role: str, k: int, scaling: str, seed: int) -> dict:
    import mmaemu

    ops = recorded_gemm(role, k, scaling, seed)
    call = modelled_call(ops._replace(out_dtype=torch.float32), "h100")  # the accumulator, scaled
    fast = call.use_fast_accum
    split, source = h100_split(role, k, fast)
    args = (call.mat_a, call.mat_b, call.scale_a, call.scale_b)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h100_32 = call._finished(mmaemu.scaled_mm(*args, out_dtype=torch.float32, use_fast_accum=fast, splitk=split))
        slow_32 = None
        if fast:
            slow_split, _ = h100_split(role, k, False)
            slow_32 = call._finished(mmaemu.scaled_mm(*args, out_dtype=torch.float32, use_fast_accum=False,
                                                      splitk=slow_split))
        seconds = time.perf_counter() - start
        h100 = h100_32.to(torch.bfloat16)  # mmaemu's BF16 output is its float32 output rounded once more
        if k <= 1024:  # which this checks where it is cheap
            bf16_call = modelled_call(ops, "h100")
            direct = bf16_call._finished(mmaemu.scaled_mm(*args, out_dtype=torch.bfloat16, use_fast_accum=fast,
                                                          splitk=split))
            assert torch.equal(direct.view(torch.int16), h100.view(torch.int16))
    emu = emulate(ops._replace(out_dtype=torch.bfloat16))
    emu_32 = emulate(ops._replace(out_dtype=torch.float32), bf16=False)
    exact = (ops.a.data.double() * ops.a.scale_inv.double()) @ (ops.b.data.double() * ops.b.scale_inv.double())
    differ = (emu.view(torch.int16) != h100.view(torch.int16)).double().mean().item()
    row = dict(role=role, k=k, scaling=scaling, seed=seed, shape=list(ops.shape), fast_accum=fast, split=source,
               differ=differ, rel_emu_h100=rel(emu, h100), err_h100=rel(h100_32, exact), err_emu=rel(emu_32, exact),
               err_h100_bf16=rel(h100, exact), err_emu_bf16=rel(emu, exact), mmaemu_seconds=round(seconds, 1))
    if slow_32 is not None:
        row["err_h100_slow"] = rel(slow_32, exact)
        row["differ_fast_slow_bf16"] = (slow_32.to(torch.bfloat16).view(torch.int16)
                                        != h100.view(torch.int16)).double().mean().item()
    return row


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(cpu=cpu, threads=torch.get_num_threads(), torch=torch.__version__, load_1min=os.getloadavg()[0])


def markdown(rows: list, meta: dict) -> str:
    lines = [
        "# Emulation vs the H100's bits, per GEMM role and K",
        "",
        f"Written by `python benchmarks/h100_vs_emulation.py` on {meta['date']}: {meta['machine']['cpu']}, torch "
        f"{meta['machine']['torch']}, mmaemu {meta['mmaemu']} (profile hopper: H100 PCIe, cuBLASLt 12.8.3.14). "
        f"One FP8Linear training step per row (BF16 autocast, scaling={meta['scaling']}, seed {meta['seed']}); each "
        f"GEMM's output is {ROWS} x {COLS}. Not a timing benchmark.",
        "",
        "| role | K | accumulation | H100 split | BF16 outputs that differ | rel(emu, H100) | err H100 (fp32) | "
        "err emu (fp32) | err H100, slow accum. (fp32) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        slow = f"{r['err_h100_slow']:.2e}" if "err_h100_slow" in r else ""
        lines.append(f"| {r['role']} | {r['k']} | {'fast' if r['fast_accum'] else 'slow'} | {r['split']} | "
                     f"{100 * r['differ']:.1f} % | {r['rel_emu_h100']:.2e} | {r['err_h100']:.2e} | "
                     f"{r['err_emu']:.2e} | {slow} |")
    lines += [
        "",
        "rel(emu, H100): ||emulation - H100|| / ||H100|| of the BF16 outputs. err: ||result - exact|| / ||exact|| with "
        "a float32 output (the accumulator, scaled), exact = the float64 product of the FP8 values; the BF16 output "
        "rounding alone is about 2^-9 / sqrt(3) = 1.1e-3 relative.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--roles", nargs="+", default=["forward", "dgrad", "wgrad"])
    parser.add_argument("--scaling", default="current", choices=["delayed", "current"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/h100_vs_emulation")
    args = parser.parse_args()
    import mmaemu

    warnings.filterwarnings("ignore", module="lightning_fp8")
    meta = dict(date=datetime.date.today().isoformat(), machine=machine(), mmaemu=mmaemu.__version__,
                scaling=args.scaling, seed=args.seed)
    rows = []
    for k in args.ks:
        for role in args.roles:
            rows.append(measure(role, k, args.scaling, args.seed))
            print(json.dumps(rows[-1]), flush=True)
            Path(args.out + ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
            Path(args.out + ".md").write_text(markdown(rows, meta))


if __name__ == "__main__":
    main()
