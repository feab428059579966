"""FP8 convolutions on CPU, in one run: accuracy next to an FP8 linear of the same GEMM, emulated speed next to the
float32 convolution, and the k x k strategy (unfold + GEMM, what FP8Conv2d does, vs an implicit GEMM).

    python benchmarks/conv.py [--out benchmarks/results/conv] [--repeats 5]

1. SQNR (dB) of FP8Conv2d's output, input gradient and weight gradient against the float64 convolution, next to an
   FP8Linear of the same GEMM (M = N*Ho*Wo, K = C*kh*kw, N = O) on Gaussian inputs of the same sizes; per-tensor
   recipes (delayed, i.e. current on the first step, and the `mellempudi` preset) and blockwise.
2. Time of one forward+backward: FP8Conv2d (emulated GEMMs: real FP8 casts, float32 products) vs nn.Conv2d in
   float32 (this CPU's fast path), on the convolutions of a ResNet-18 at 32x32 (batch 64) and one ResNet stage-1
   convolution at 56x56 (batch 32); interleaved repeats in this one process, medians. BF16 nn.Conv2d is timed once,
   on the smallest shape, to say what it costs here.
3. The k x k strategy: the GEMM work of one forward+backward on FP8 operands (forward, input gradient, weight
   gradient) as unfold + one GEMM per pass (lightning_fp8/modules/conv_layout.py, the library's choice) vs an
   implicit GEMM written here (kh*kw shifted views of the input, each a GEMM with K = C, accumulated in float32): time
   and the peak of the memory torch allocates for it (profiler memory events), each in a fresh subprocess.

Results go to <out>.json and <out>.md with the machine, versions and date.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_fp8 import FP8Conv2d, FP8Linear, FP8Recipe  # noqa: E402
from lightning_fp8.modules.conv_layout import (  # noqa: E402
    ConvGeometry, col2im_add_, flipped_weight_matrix, im2col, input_gradient_geometry, padded_nhwc, weight_matrix,
)
from lightning_fp8.modules.gemm import fp8_gemm  # noqa: E402
from lightning_fp8.modules.operand import FP8Matrix  # noqa: E402
from lightning_fp8.presets import get_preset  # noqa: E402
from bench_io import machine, write_results  # noqa: E402

warnings.simplefilter("ignore")

#: (name, N, C, H, O, k, stride): ResNet-18's convolutions at 32x32, batch 64 (stage 1 is 8x8 after the stem and the
#: max-pool), the first convolution of each downsampling block, its 1x1 shortcut, and a stage-1 convolution at 224x224
SHAPES = [
    ("s1 3x3 64->64 @8x8", 64, 64, 8, 64, 3, 1),
    ("s2 3x3 64->128 /2", 64, 64, 8, 128, 3, 2),
    ("s2 1x1 64->128 /2 (shortcut)", 64, 64, 8, 128, 1, 2),
    ("s2 3x3 128->128 @4x4", 64, 128, 4, 128, 3, 1),
    ("s3 3x3 256->256 @2x2", 64, 256, 2, 256, 3, 1),
    ("s4 3x3 512->512 @1x1", 64, 512, 1, 512, 3, 1),
    ("224px s1 3x3 64->64 @56x56", 32, 64, 56, 64, 3, 1),
]


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref = ref.double()
    return float(20 * torch.log10(ref.norm() / (ref - x.double()).norm()))


# -- 1. accuracy ---------------------------------------------------------------------------------------------------
def accuracy_rows():
    rows = []
    recipes = {"delayed (hybrid)": FP8Recipe(), "mellempudi (e5m2, stochastic)": get_preset("mellempudi"),
               "blockwise (e4m3)": FP8Recipe(scaling="blockwise")}
    for name, n, c, h, o, k, s in [SHAPES[0], SHAPES[3], SHAPES[4]]:
        torch.manual_seed(0)
        conv = nn.Conv2d(c, o, k, stride=s, padding=k // 2)
        x = torch.randn(n, c, h, h)
        ref = copy.deepcopy(conv).double()
        xr = x.double().requires_grad_(True)
        yr = ref(xr)
        dy = torch.randn(yr.shape) * 1e-2
        yr.backward(dy.double())
        m, kk = yr.numel() // o, c * k * k
        xl = torch.randn(m, kk)
        lin_ref = nn.Linear(kk, o).double()
        xlr = xl.double().requires_grad_(True)
        ylr = lin_ref(xlr)
        dyl = torch.randn(ylr.shape) * 1e-2
        ylr.backward(dyl.double())
        for rname, recipe in recipes.items():
            fp8 = FP8Conv2d.from_conv(copy.deepcopy(conv), recipe)
            xi = x.clone().requires_grad_(True)
            y = fp8(xi)
            y.backward(dy)
            lin = FP8Linear.from_linear(copy.deepcopy(lin_ref).float(), recipe)
            xli = xl.clone().requires_grad_(True)
            yl = lin(xli)
            yl.backward(dyl)
            rows.append({
                "shape": name, "gemm": f"{m}x{kk}x{o}", "recipe": rname,
                "conv": [sqnr(yr, y), sqnr(xr.grad, xi.grad), sqnr(ref.weight.grad, fp8.weight.grad)],
                "linear": [sqnr(ylr, yl), sqnr(xlr.grad, xli.grad), sqnr(lin_ref.weight.grad, lin.weight.grad)],
            })
    return rows


# -- 2. speed ------------------------------------------------------------------------------------------------------
def _fwd_bwd(layer, x, dy):
    xi = x.detach().requires_grad_(True)
    layer(xi).backward(dy)
    layer.weight.grad = None


def speed_rows(repeats: int):
    rows = []
    for name, n, c, h, o, k, s in SHAPES:
        torch.manual_seed(0)
        conv = nn.Conv2d(c, o, k, stride=s, padding=k // 2, bias=False)
        fp8 = FP8Conv2d.from_conv(copy.deepcopy(conv), FP8Recipe())
        x = torch.randn(n, c, h, h)
        dy = torch.randn(conv(x).shape) * 1e-2
        timings = {"fp8": [], "fp32": []}
        for layer in (fp8, conv):  # warm-up
            _fwd_bwd(layer, x, dy)
        for _ in range(repeats):
            for key, layer in (("fp8", fp8), ("fp32", conv)):
                t = time.perf_counter()
                _fwd_bwd(layer, x, dy)
                timings[key].append(time.perf_counter() - t)
        fp8_ms, fp32_ms = (1e3 * statistics.median(timings[key]) for key in ("fp8", "fp32"))
        rows.append({"shape": name, "fp8_ms": fp8_ms, "fp32_ms": fp32_ms, "ratio": fp8_ms / fp32_ms})
    return rows


def bf16_row():
    name, n, c, h, o, k, s = SHAPES[0]
    conv = nn.Conv2d(c, o, k, stride=s, padding=k // 2, bias=False)
    x = torch.randn(n, c, h, h)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dy = torch.randn(conv(x).shape, dtype=torch.bfloat16)
        _fwd_bwd(conv, x, dy)
        t = time.perf_counter()
        _fwd_bwd(conv, x, dy)
    return {"shape": name, "bf16_ms": 1e3 * (time.perf_counter() - t)}


# -- 3. strategy ---------------------------------------------------------------------------------------------------
ONE = torch.ones(())


def _gemm(a, b, out=torch.float32):
    return fp8_gemm(FP8Matrix(a, ONE), FP8Matrix(b, ONE), out, None, False, "emulated")


def unfold_gemms(xf, wf, gf, geo: ConvGeometry, out_hw):
    """The library's GEMM work: forward, input gradient (a convolution of dy at stride 1, col2im when strided) and
    weight gradient, from FP8 x (N, C, H, W), weight and dy (N*Ho*Wo, O)."""
    n, c, h, w = xf.shape
    xp = padded_nhwc(xf, geo)
    _gemm(im2col(xp, geo, 0, out_hw), weight_matrix(wf, 0, 1).t())
    dgeo = input_gradient_geometry(geo)
    if dgeo is not None:
        gp = padded_nhwc(gf.view(n, out_hw[0], out_hw[1], -1).permute(0, 3, 1, 2), dgeo)
        _gemm(im2col(gp, dgeo, 0, (h, w)), flipped_weight_matrix(wf, 0, 1).t())
    else:
        top, bottom, left, right = geo.padding
        dxp = torch.zeros((n, h + top + bottom, w + left + right, c))
        col2im_add_(dxp, _gemm(gf, weight_matrix(wf, 0, 1)), geo, 0, out_hw)
    _gemm(gf.t(), im2col(xp, geo, 0, out_hw))


def implicit_gemms(xf, wf, gf, geo: ConvGeometry, out_hw):
    """The same three GEMMs as kh*kw GEMMs of K = C over shifted views of the padded input, accumulated in float32."""
    n, c, h, w = xf.shape
    (kh, kw), (sh, sw), (dh, dw) = geo.kernel, geo.stride, geo.dilation
    ho, wo = out_hw
    xp = padded_nhwc(xf, geo)
    wk = wf.view(torch.uint8).permute(2, 3, 0, 1).contiguous().view(wf.dtype)  # (kh, kw, O, C)

    def shifted(i, j):
        return xp[:, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw, :].reshape(-1, c)

    acc = None
    for i in range(kh):
        for j in range(kw):
            part = _gemm(shifted(i, j), wk[i, j].t())
            acc = part if acc is None else acc.add_(part)
    dxp = torch.zeros(xp.shape)
    for i in range(kh):
        for j in range(kw):
            dxp[:, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw, :] += (
                _gemm(gf, wk[i, j]).view(n, ho, wo, c))
            _gemm(gf.t(), shifted(i, j))


def peak_bytes(fn) -> int:
    """The peak of the bytes torch allocated and had not freed while `fn` ran: the profiler's memory events in time
    order (an operator's own net allocation counted at its start, its own net free at its end, frees outside
    operators where they happen)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    for e in prof.events():
        nbytes = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if nbytes:
            events.append((e.time_range.start if nbytes > 0 else e.time_range.end, nbytes))
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


def strategy_child(strategy: str, index: int, repeats: int) -> dict:
    name, n, c, h, o, k, s = SHAPES[index]
    torch.manual_seed(0)
    geo = ConvGeometry((k, k), (s, s), (1, 1), (k // 2,) * 4, 1)
    out_hw = geo.output_size(h, h)
    xf = torch.randn(n, c, h, h).to(torch.float8_e4m3fn).contiguous(memory_format=torch.channels_last)
    wf = torch.randn(o, c, k, k).to(torch.float8_e4m3fn)
    gf = torch.randn(n * out_hw[0] * out_hw[1], o).to(torch.float8_e5m2)
    run = unfold_gemms if strategy == "unfold" else implicit_gemms
    run(xf, wf, gf, geo, out_hw)  # warm-up (lookup tables, first-call dispatch)
    peak_mb = peak_bytes(lambda: run(xf, wf, gf, geo, out_hw)) / 2**20
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run(xf, wf, gf, geo, out_hw)
        times.append(time.perf_counter() - t)
    return {"shape": name, "strategy": strategy, "ms": 1e3 * statistics.median(times), "peak_mb": peak_mb,
            "input_mb": xf.numel() / 2**20}


def strategy_rows(repeats: int):
    rows = []
    for index in range(len(SHAPES)):
        if SHAPES[index][5] == 1:
            continue  # a 1x1 convolution is one GEMM either way
        for strategy in ("unfold", "implicit"):
            out = subprocess.run([sys.executable, __file__, "--child", strategy, str(index), str(repeats)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


# -- report --------------------------------------------------------------------------------------------------------
def markdown(result) -> str:
    m = result["machine"]
    load = m.get("load_average_1min_at_start", float("nan"))
    lines = [f"# FP8 convolutions on CPU ({m['date']}, {m['cpu']}, {m['threads']} threads, torch {m['torch']}, "
             f"BF16 hardware: {m['bf16_hardware']})", "",
             "Written by `python benchmarks/conv.py`. FP8 GEMMs are emulated here (real FP8 casts, float32 products). "
             f"The machine is shared with other jobs (1-minute load average {load:.1f} "
             "at the start, on 2 cores): absolute times are inflated by it; the FP8 / float32 ratios come from "
             "interleaved runs in one process.", "",
             "## SQNR (dB) against float64: FP8Conv2d vs an FP8Linear of the same GEMM", "",
             "| convolution | GEMM MxKxN | recipe | conv out / dgrad / wgrad | linear out / dgrad / wgrad |",
             "|---|---|---|---|---|"]
    for r in result["accuracy"]:
        conv = " / ".join(f"{v:.1f}" for v in r["conv"])
        lin = " / ".join(f"{v:.1f}" for v in r["linear"])
        lines.append(f"| {r['shape']} | {r['gemm']} | {r['recipe']} | {conv} | {lin} |")
    lines += ["", "## Forward+backward time: FP8Conv2d (emulated) vs nn.Conv2d in float32 (medians, interleaved)", "",
              "| convolution (batch, channels, size) | FP8 ms | float32 ms | FP8 / float32 |", "|---|---|---|---|"]
    for r in result["speed"]:
        lines.append(f"| {r['shape']} | {r['fp8_ms']:.1f} | {r['fp32_ms']:.1f} | {r['ratio']:.2f}x |")
    b = result["bf16"]
    lines += ["", f"nn.Conv2d under BF16 autocast, {b['shape']}: {b['bf16_ms']:.0f} ms (one run; this CPU has no BF16 "
              "hardware, so float32 is the fair baseline).", "",
              "## k x k strategy: the GEMM work of forward + both gradients on FP8 operands", "",
              "unfold + one GEMM per pass (the library) vs an implicit GEMM (kh*kw shifted GEMMs, float32 "
              "accumulation); peak: the most memory torch held for the pass at once (profiler memory events), each in "
              "a fresh process. Both include the emulation's float32 images of the FP8 operands (4 bytes per "
              "element); on a GPU the GEMMs read FP8 directly.", "",
              "| convolution | input MB (FP8) | unfold ms | implicit ms | unfold peak MB | implicit peak MB |",
              "|---|---|---|---|---|---|"]
    by_shape = {}
    for r in result["strategy"]:
        by_shape.setdefault(r["shape"], {})[r["strategy"]] = r
    for shape, d in by_shape.items():
        u, i = d["unfold"], d["implicit"]
        lines.append(f"| {shape} | {u['input_mb']:.2f} | {u['ms']:.1f} | {i['ms']:.1f} | {u['peak_mb']:.0f} | "
                     f"{i['peak_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/conv")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(strategy_child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return
    result = {"machine": machine(), "accuracy": accuracy_rows(), "speed": speed_rows(args.repeats),
              "bf16": bf16_row(), "strategy": strategy_rows(args.repeats)}
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
