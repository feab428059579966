"""Convergence of FP8AdamW against torch.optim.AdamW on a small char-level GPT.

Corpus: the CPython standard library's own .py files (sorted paths, site-packages excluded), as bytes
(vocabulary 256), first 90% train / last 10% validation. Model: 2 layers, d_model 128, 4 heads, context 64.

Every variant of one seed starts from the same initial weights and sees the same batches in the same order;
the LR warms up linearly then decays to zero with a cosine (docs/measuring.md: with a constant LR a 1e-8 change of eps
moves the final loss by 1%, with decay to zero by 0.001%); `--schedule constant` holds the LR after the same
warmup instead. The final loss is measured on a fixed validation set (positions drawn once, independent of the seed)
in eval mode without gradients, reported beside the training loss (an EMA over the last 50 steps) and the machine
(bench_io.machine(): CPU, threads, BF16 hardware or not). The gap of a variant is (loss - adamw) / adamw per seed;
the report gives its mean and spread next to the seed-to-seed spread of the baseline itself.

Variants:
  adamw                     torch.optim.AdamW, fp32 state, fp32 model (the baseline)
  fp8                       FP8AdamW defaults: E4M3 m, per-block FP16 v, fp32 master (the parameters)
  fp8_sqrtv                 FP8AdamW exp_avg_sq_dtype="fp8": sqrt(v) in E4M3, stochastic rounding
  fp8_bf16v                 FP8AdamW exp_avg_sq_dtype="bf16" (stochastic rounding)
  fp8_bf16master            FP8AdamW defaults + master_weights="bf16": the model's parameters are bf16, the
                            whole model computes in bf16, updates are stochastically rounded
  bf16params_nearest        ablation: the same bf16 model updated with round-to-nearest (what
                            torch.optim.AdamW does to bf16 parameters); shows what stochastic rounding buys
  ablation_fp8_sqrtv_nearest  ablation: fp8_sqrtv with sqrt(v) rounded to nearest instead of stochastically
                            (lightning_fp8.optim.moment_storage.FP8_SQRT_V_ROUNDING, not an FP8AdamW option)
  ablation_adamw_lr_x0.9    ablation: torch AdamW with 0.9x the LR, to compare with an optimizer whose update
                            denominator is biased ~10% high (fp8_sqrtv)

Usage: python benchmarks/optim_convergence.py [--steps 800] [--seeds 0 1 2] [--variants ...] [--reuse earlier.json]
                                              [--schedule constant]
Writes benchmarks/results/optim_convergence.json and .md.

(Length: one self-contained benchmark script: corpus, model, variants, report.)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fp8.optim import FP8AdamW, state_bytes_per_param
from lightning_fp8.optim import moment_storage as opt_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import SCHEDULES, hold_after_warmup, machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


# -- data -----------------------------------------------------------------------------------------------------
def load_corpus(max_bytes: int) -> torch.Tensor:
    """The stdlib's .py files, sorted by relative path, concatenated as bytes (uint8 -> int64 tokens)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        paths += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    paths.sort(key=lambda p: str(p.relative_to(root)))
    chunks, total = [], 0
    for p in paths:
        data = p.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.int64)


def get_batch(data: torch.Tensor, starts: torch.Tensor, ctx: int):
    idx = starts[:, None] + torch.arange(ctx + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


# -- model ----------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 2, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# -- optimizers -----------------------------------------------------------------------------------------------
def make_optimizer(variant: str, model: nn.Module, lr: float, wd: float, betas) -> torch.optim.Optimizer:
    common = dict(lr=lr, weight_decay=wd, betas=betas)
    if variant == "adamw":
        return torch.optim.AdamW(model.parameters(), foreach=False, **common)
    if variant == "fp8":
        return FP8AdamW(model.parameters(), **common)
    if variant == "fp8_sqrtv":
        return FP8AdamW(model.parameters(), exp_avg_sq_dtype="fp8", **common)
    if variant == "ablation_adamw_lr_x0.9":
        return torch.optim.AdamW(model.parameters(), foreach=False, **dict(common, lr=lr * 0.9))
    if variant == "ablation_fp8_sqrtv_nearest":
        opt_state.FP8_SQRT_V_ROUNDING = "nearest"  # reset by run()
        return FP8AdamW(model.parameters(), exp_avg_sq_dtype="fp8", **common)
    if variant == "fp8_bf16v":
        return FP8AdamW(model.parameters(), exp_avg_sq_dtype="bf16", **common)
    if variant == "fp8_bf16master":
        return FP8AdamW(model.parameters(), master_weights="bf16", **common)
    if variant == "bf16params_nearest":
        model.to(torch.bfloat16)  # master_weights="fp32" on bf16 parameters = round-to-nearest updates
        return FP8AdamW(model.parameters(), **common)
    raise ValueError(f"unknown variant {variant!r}; valid: {VARIANTS}")


VARIANTS = ["adamw", "fp8", "fp8_sqrtv", "fp8_bf16v", "fp8_bf16master", "bf16params_nearest", "ablation_fp8_sqrtv_nearest",
            "ablation_adamw_lr_x0.9"]


def lr_lambda(total: int, warmup: int, schedule: str = "cosine") -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return hold_after_warmup(f, warmup) if schedule == "constant" else f


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, starts: torch.Tensor, ctx: int, batch: int) -> float:
    model.eval()
    losses = []
    for i in range(0, len(starts), batch):
        x, y = get_batch(data, starts[i : i + batch], ctx)
        logits = model(x)
        losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def run(variant: str, seed: int, args, train: torch.Tensor, val: torch.Tensor, val_starts: torch.Tensor) -> Dict:
    torch.manual_seed(seed)
    model = CharGPT(ctx=args.ctx)
    opt = make_optimizer(variant, model, args.lr, args.wd, (args.beta1, args.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps, args.warmup, args.schedule))
    order = torch.Generator().manual_seed(10_000 + seed)  # same batches for every variant of this seed
    t0 = time.perf_counter()
    train_loss = float("nan")
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.ctx - 1, (args.batch,), generator=order)
        x, y = get_batch(train, starts, args.ctx)
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step >= args.steps - 50:
            first = step == max(0, args.steps - 50)  # runs shorter than 50 steps: the EMA starts at step 0
            train_loss = loss.item() if first else 0.98 * train_loss + 0.02 * loss.item()
    seconds = time.perf_counter() - t0
    opt_state.FP8_SQRT_V_ROUNDING = "stochastic"
    val_loss = evaluate(model, val, val_starts, args.ctx, args.batch)
    out = dict(variant=variant, seed=seed, val_loss=val_loss, train_loss_ema=train_loss, seconds=seconds,
               state_bytes_per_param=state_bytes_per_param(opt))
    print(json.dumps(out), flush=True)
    return out


def summarize(results: List[Dict], variants: List[str], seeds: List[int]) -> Dict:
    by = {(r["variant"], r["seed"]): r for r in results}
    base = [by[("adamw", s)]["val_loss"] for s in seeds]
    summary = {
        "adamw": dict(
            val_loss_mean=statistics.mean(base),
            val_loss_seed_sd=statistics.stdev(base) if len(base) > 1 else 0.0,
            seed_spread_rel=(statistics.stdev(base) / statistics.mean(base)) if len(base) > 1 else 0.0,
            train_loss_ema_mean=statistics.mean(by[("adamw", s)]["train_loss_ema"] for s in seeds),
        )
    }
    for v in variants:
        if v == "adamw":
            continue
        gaps = [(by[(v, s)]["val_loss"] - by[("adamw", s)]["val_loss"]) / by[("adamw", s)]["val_loss"] for s in seeds]
        losses = [by[(v, s)]["val_loss"] for s in seeds]
        summary[v] = dict(
            val_loss_mean=statistics.mean(losses),
            train_loss_ema_mean=statistics.mean(by[(v, s)]["train_loss_ema"] for s in seeds),
            rel_gap_per_seed=gaps,
            rel_gap_mean=statistics.mean(gaps),
            rel_gap_sd=statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
            state_bytes_per_param=by[(v, seeds[0])]["state_bytes_per_param"],
            within_0_5_percent=abs(statistics.mean(gaps)) <= 0.005,
        )
    return summary


def cpu_name() -> str:
    """The CPU's model name (benchmarks/optim_memory.py records it too)."""
    return machine()["cpu"]


def write_report(meta: Dict, summary: Dict, results: List[Dict], stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(dict(meta=meta, summary=summary, runs=results), indent=2) + "\n")
    a = meta["args"]
    lines = [
        "# FP8AdamW convergence vs torch.optim.AdamW",
        "",
        f"{meta['date']}, torch {meta['torch']}, {meta['cpu']} ({meta['threads']} threads, BF16 hardware: "
        f"{meta['machine']['bf16_hardware']}).",
        f"Char-GPT (2 layers, d_model 128, 4 heads, context {a['ctx']}), bytes of the CPython stdlib "
        f"({meta['corpus_bytes']/1e6:.1f} MB, 90/10 split), {a['steps']} steps of batch {a['batch']}, "
        f"lr {a['lr']} with {a['warmup']} warmup steps then "
        f"{'constant' if a.get('schedule') == 'constant' else 'cosine to zero'}, weight decay {a['wd']}, "
        f"betas ({a['beta1']}, {a['beta2']}), seeds {meta['seeds']}. Final loss on a fixed validation set of "
        f"{a['val_batches']}x{a['batch']} sequences (eval mode, no gradients).",
        "",
        "| variant | state bytes/param | val loss (mean) | rel. gap vs AdamW (mean) | gap sd over seeds | per-seed gaps "
        "| train loss EMA (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = summary["adamw"]
    lines.append(f"| adamw (fp32 state) | 8.00 | {base['val_loss_mean']:.4f} | - | - | - | "
                 f"{base['train_loss_ema_mean']:.4f} |")
    for v, s in summary.items():
        if v == "adamw":
            continue
        per = ", ".join(f"{g*100:+.2f}%" for g in s["rel_gap_per_seed"])
        lines.append(f"| {v} | {s['state_bytes_per_param']:.2f} | {s['val_loss_mean']:.4f} | "
                     f"{s['rel_gap_mean']*100:+.2f}% | {s['rel_gap_sd']*100:.2f}% | {per} | "
                     f"{s['train_loss_ema_mean']:.4f} |")
    lines += [
        "",
        f"Seed-to-seed spread of the AdamW baseline itself: sd {base['val_loss_seed_sd']:.4f} "
        f"({base['seed_spread_rel']*100:.2f}% relative).",
        "",
        "Run time per variant and seed (s): " + ", ".join(f"{r['variant']}/{r['seed']}: {r['seconds']:.0f}" for r in results),
        "",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))


def v_tracking(steps: int = 3000, block: int = 128) -> Dict:
    """How well each second-moment storage follows Adam's v, isolated from training.

    4096 elements with gradient scales spread over 3 decades (mixed inside every block), Gaussian gradients, the
    scale dropping 3x at mid-run; the stored v is read back, updated in float32, and stored again each step,
    exactly as FP8AdamW does, next to a float32 EMA. Reports quantiles of sqrt(v_stored / v_float32), the
    factor by which the update's denominator is off. Two storages FP8AdamW does *not* offer are included to
    show why: bf16 and sqrt(v) in E4M3, both with round-to-nearest."""
    from lightning_fp8.optim.blockwise import dequantize_blockwise, quantize_blockwise
    from lightning_fp8.optim.rounding import seeded_generator
    from lightning_fp8.optim.moment_storage import read_moments, write_moments

    shape = (32, block)

    def offered(dtype):
        def codec(state, v, gen):
            if v is None:
                return read_moments(state, shape, block)[1]
            write_moments(state, torch.zeros(shape), v, block, dtype, gen)
        return codec

    def bf16_nearest(state, v, gen):
        if v is None:
            return state["v"].float()
        state["v"] = v.to(torch.bfloat16)

    def fp8_sqrt_nearest(state, v, gen):
        if v is None:
            return dequantize_blockwise(state["d"], state["s"], block, shape) ** 2
        state["d"], state["s"] = quantize_blockwise(v.sqrt(), block, rounding="nearest")

    codecs = {"fp16": offered("fp16"), "bf16": offered("bf16"), "fp8": offered("fp8"),
              "bf16 nearest (not offered)": bf16_nearest, "fp8 sqrt nearest (not offered)": fp8_sqrt_nearest}
    out = {}
    for name, codec in codecs.items():
        torch.manual_seed(0)
        sigma = torch.logspace(-5, -2, shape[0] * shape[1]).reshape(shape)[torch.randperm(shape[0])]
        state = {}
        codec(state, torch.zeros(shape), None)
        v_ref = torch.zeros(shape)
        rows = []
        for t in range(1, steps + 1):
            g = torch.randn(shape) * sigma * (0.3 if t > steps // 2 else 1.0)
            v = codec(state, None, None) * 0.999 + 0.001 * g * g
            v_ref = v_ref * 0.999 + 0.001 * g * g
            codec(state, v, seeded_generator(torch.device("cpu"), t))
            if t in (100, steps // 2, steps):
                r = (codec(state, None, None) / v_ref).sqrt()
                rows.append(dict(step=t, median=float(r.median()), p05=float(r.quantile(0.05)),
                                 p95=float(r.quantile(0.95)), zero_fraction=float((r == 0).float().mean())))
        out[name] = rows
    return out


def write_v_tracking(result: Dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "optim_v_tracking.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Second-moment storage: sqrt(v_stored / v_fp32), the error factor of the update's denominator", "",
             "(benchmarks/optim_convergence.py --v-tracking; see v_tracking() for the setup)", "",
             "| storage | step | median | 5th pct | 95th pct |", "|---|---|---|---|---|"]
    for dtype, rows in result.items():
        for r in rows:
            lines.append(f"| {dtype} | {r['step']} | {r['median']:.3f} | {r['p05']:.3f} | {r['p95']:.3f} |")
    (RESULTS / "optim_v_tracking.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--val-batches", type=int, default=32)
    ap.add_argument("--corpus-bytes", type=int, default=8_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                    help="cosine: warmup then decay to zero (default); constant: the same warmup, then held")
    ap.add_argument("--out", default="optim_convergence", help="file stem under benchmarks/results/")
    ap.add_argument("--reuse", default=None, help="a results JSON of an earlier run with the same settings: its "
                    "(variant, seed) runs are taken from there instead of being run again (runs are deterministic)")
    ap.add_argument("--v-tracking", action="store_true", help="only run the second-moment tracking diagnostic")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.v_tracking:
        result = v_tracking()
        write_v_tracking(result)
        print(json.dumps(result, indent=2))
        return
    variants = ["adamw"] + [v for v in args.variants if v != "adamw"]

    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    val_starts = torch.randint(0, len(val) - args.ctx - 1, (args.val_batches * args.batch,),
                               generator=torch.Generator().manual_seed(1234))
    reused = {}
    if args.reuse:
        text = Path(args.reuse).read_text()
        if args.reuse.endswith(".jsonl") or args.reuse.endswith(".log"):
            # the per-run lines this script prints (no settings recorded: the caller vouches they match)
            runs = [json.loads(line) for line in text.splitlines() if line.startswith('{"variant"')]
            earlier = {"meta": {"args": vars(args)}, "runs": runs}
        else:
            earlier = json.loads(text)
        same = ("steps", "warmup", "batch", "ctx", "lr", "wd", "beta1", "beta2", "val_batches", "corpus_bytes", "schedule")
        if any(dict({"schedule": "cosine"}, **earlier["meta"]["args"])[k] != vars(args)[k] for k in same):
            raise SystemExit(f"--reuse {args.reuse}: settings differ from this run's")
        reused = {(r["variant"], r["seed"]): r for r in earlier["runs"]}
    host = machine()  # before the runs: its load average is the one they started under
    results = [reused.get((v, s)) or run(v, s, args, train, val, val_starts) for s in args.seeds for v in variants]
    summary = summarize(results, variants, args.seeds)
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__, python=sys.version.split()[0], cpu=host["cpu"], threads=args.threads,
        corpus_bytes=len(data), seeds=args.seeds, args=vars(args), machine=host,
    )
    write_report(meta, summary, results, args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
