"""Training throughput, memory and loss of a GPT in several precisions, same seed, same data order.

    python benchmarks/train.py                          # ~1B-param GPT and a small one, all precisions (GPU)
    python benchmarks/train.py --smoke                  # tiny model, 4 steps: checks the harness (CPU is fine)
    python benchmarks/train.py --models small --precision bf16,fp8 --steps 50

Precisions (several per run, `--precision a,b,...`):
  bf16            torch.autocast(bf16), fp32 master weights, AdamW
  fp8             convert_to_fp8 (default filter: first/last linear in BF16) under the same autocast, AdamW
  fp8+fp8-optim   fp8 plus lightning_fp8.optim.FP8AdamW (compressed moments) when importable
  torchao         torchao.float8.convert_to_float8_training (+ torch.compile) when importable
`--compile` compiles the model for every precision. Data: byte-level text of CPython's standard library
(no download), fixed random windows; validation on a fixed held-out set (eval mode, no gradients, the FP8 forward as
in training). Reports tokens/s (after warmup), peak GPU memory, final train loss (mean of the last 10% of steps) and
validation loss, and the machine (bench_io.machine(): CPU, threads, BF16 hardware or not). Writes
benchmarks/results/train_<device>.json and .md after each run. The LR is constant by default (`--schedule cosine`
decays it to zero over the run, no warmup): loss numbers here are a sanity check that every precision trains, not a
quality comparison (docs/measuring.md).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_fp8 import convert_to_fp8  # noqa: E402
from lightning_fp8.modules.gemm import FP8EmulationWarning  # noqa: E402
from bench_io import machine  # noqa: E402

MODELS = {
    # d_model, n_layer, n_head, seq_len, batch: ~1.0e9 params (12 * L * d^2 = 12 * 20 * 2048^2)
    "1b": dict(d_model=2048, n_layer=20, n_head=16, seq_len=2048, batch=8),
    "small": dict(d_model=768, n_layer=8, n_head=12, seq_len=1024, batch=16),
    "smoke": dict(d_model=64, n_layer=2, n_head=4, seq_len=32, batch=4),
}
PRECISIONS = ("bf16", "fp8", "fp8+fp8-optim", "torchao")


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc_out = nn.Linear(4 * d, d, bias=False)
        self.n_head = n_head

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, d_model, n_layer, n_head, seq_len, vocab=256, **_):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def corpus(max_bytes: int = 8_000_000) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batches(data, seq_len, batch, steps, seed):
    g = torch.Generator().manual_seed(seed)
    n = data.numel() - seq_len - 1
    split = int(n * 0.95)
    for _ in range(steps):
        idx = torch.randint(0, split, (batch,), generator=g)
        yield torch.stack([data[i : i + seq_len + 1] for i in idx.tolist()])
    return


def val_batches(data, seq_len, batch, count):
    n = data.numel() - seq_len - 1
    start = int(n * 0.95)
    g = torch.Generator().manual_seed(12345)
    for _ in range(count):
        idx = torch.randint(start, n, (batch,), generator=g)
        yield torch.stack([data[i : i + seq_len + 1] for i in idx.tolist()])


def build(precision, cfg, device, compile_model, lr):
    torch.manual_seed(0)
    model = GPT(**cfg).to(device)
    note = ""
    if precision in ("fp8", "fp8+fp8-optim"):
        convert_to_fp8(model)
    elif precision == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "head")
        compile_model = True
        note = "compiled (torchao needs torch.compile)"
    if precision == "fp8+fp8-optim":
        from lightning_fp8.optim import FP8AdamW  # ImportError -> row skipped

        opt = FP8AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    else:
        kw = {"fused": True} if device.type == "cuda" else {}
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95), **kw)
    fwd = torch.compile(model) if compile_model else model
    return model, fwd, opt, note


def run(precision, model_name, cfg, args, device, data):
    row = {"model": model_name, "precision": precision}
    try:
        model, fwd, opt, note = build(precision, cfg, device, args.compile, args.lr)
    except ImportError as err:
        row["skipped"] = f"not importable: {err}"
        return row
    row["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    if note:
        row["note"] = note
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    sched = None
    if args.schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    losses, times = [], []
    tokens = cfg["batch"] * cfg["seq_len"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    try:
        for step, xy in enumerate(batches(data, cfg["seq_len"], cfg["batch"], args.steps, seed=1)):
            xy = xy.to(device, non_blocking=True)
            t0 = time.perf_counter()
            with autocast:
                logits = fwd(xy[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if sched is not None:
                sched.step()
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                row["error"] = f"non-finite loss at step {step}"
                break
        model.eval()
        with torch.no_grad(), autocast:
            vals = [F.cross_entropy(fwd(v.to(device)[:, :-1]).float().reshape(-1, 256), v.to(device)[:, 1:].reshape(-1)).item()
                    for v in val_batches(data, cfg["seq_len"], cfg["batch"], args.val_batches)]
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        return row
    steady = times[args.warmup :] or times
    tail = losses[-max(1, len(losses) // 10) :]
    row.update(
        steps=len(losses),
        step_ms=round(statistics.median(steady) * 1e3, 2),
        tokens_per_s=round(tokens / statistics.median(steady), 1),
        peak_mem_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        train_loss=round(statistics.mean(tail), 4),
        val_loss=round(statistics.mean(vals), 4),
    )
    del model, fwd, opt
    return row


def to_markdown(meta, rows):
    lines = [
        f"# GPT training benchmark: {meta['device_name']}",
        "",
        f"torch {meta['torch']}, {meta['steps']} steps ({meta['warmup']} warmup excluded from timing), "
        f"{'cosine-to-zero' if meta.get('schedule') == 'cosine' else 'constant'} LR {meta['lr']}, "
        f"compile={meta['compile']}, {meta['when']}, CPU {meta['machine']['cpu']} (BF16 hardware: "
        f"{meta['machine']['bf16_hardware']})"
        + (" — SMOKE RUN (tiny model; numbers mean nothing)" if meta["smoke"] else ""),
        "",
        "| model | precision | params (M) | step ms | tokens/s | speedup vs bf16 | peak GiB | train loss | val loss | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {r["model"]: r.get("tokens_per_s") for r in rows if r["precision"] == "bf16"}
    for r in rows:
        sp = ""
        if r.get("tokens_per_s") and base.get(r["model"]):
            sp = round(r["tokens_per_s"] / base[r["model"]], 3)
        note = r.get("skipped") or r.get("error") or r.get("note") or ""
        lines.append(
            f"| {r['model']} | {r['precision']} | {r.get('params_m', '')} | {r.get('step_ms', '')} | "
            f"{r.get('tokens_per_s', '')} | {sp} | {r.get('peak_mem_gib') if r.get('peak_mem_gib') is not None else '-'} | "
            f"{r.get('train_loss', '')} | {r.get('val_loss', '')} | {note[:80]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--models", default=None, help="comma list of " + ",".join(MODELS))
    p.add_argument("--precision", default=",".join(PRECISIONS))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--val-batches", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                   help="constant LR (default) or cosine decay to zero over --steps (no warmup)")
    p.add_argument("--batch", type=int, default=None, help="override the model's batch size")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models = args.models.split(",") if args.models else (["smoke"] if args.smoke else ["small", "1b"])
    args.steps = args.steps or (4 if args.smoke else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    args.val_batches = args.val_batches or (2 if args.smoke else 8)
    warnings.simplefilter("ignore", FP8EmulationWarning)
    data = corpus(400_000 if args.smoke else 8_000_000)
    meta = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": args.steps,
        "warmup": args.warmup,
        "lr": args.lr,
        "schedule": args.schedule,
        "compile": args.compile,
        "smoke": args.smoke,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "data": f"CPython stdlib text, {data.numel()} bytes",
        "machine": machine(),
    }
    tag = "".join(c if c.isalnum() else "-" for c in meta["device_name"]).strip("-").lower()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"train_{tag}{'-smoke' if args.smoke else ''}"
    rows = []
    for model_name in models:
        cfg = dict(MODELS[model_name])
        if args.batch:
            cfg["batch"] = args.batch
        for precision in [q for q in args.precision.split(",") if q]:
            row = run(precision, model_name, cfg, args, device, data)
            rows.append(row)
            print(json.dumps(row), flush=True)
            stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            stem.with_suffix(".md").write_text(to_markdown(meta, rows))
    print(f"wrote {stem}.json and {stem}.md")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
