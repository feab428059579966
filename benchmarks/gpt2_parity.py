"""GPT-2 loss parity: transformers' GPT2LMHeadModel (Conv1D projections) under FP8Precision vs precision="bf16-mixed".

The demo's setup (lightning_fp8/demo: the CPython standard-library corpus, character level, context 64, batch 16,
d_model 128, 2 layers, 4 heads, AdamW 3e-3 with warmup and cosine decay to zero, a fixed validation set), with the
model replaced by a GPT-2 built from a config (no download). Same seed, data order and validation set for both
precisions; several seeds, so the FP8 - BF16 gap is read against the seed-to-seed spread of BF16 itself. The LR decays
to zero because constant-LR comparisons of short runs are noise (docs/measuring.md); `--schedule constant` holds it
after the same warmup instead. Reported per run: the final validation loss (Lightning's validation loop: eval mode, no
gradients, FP8 forward as FP8Precision runs it, on held-out text) beside the final training loss (mean of the last 20
steps); the machine (bench_io.machine(): CPU, threads, BF16 hardware or not). Not a timing benchmark.

    python benchmarks/gpt2_parity.py --seeds 0 1 2 --steps 300 [--schedule constant]
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_fp8 import FP8Precision, precision_map
from lightning_fp8.demo.data import load_corpus, fixed_val_batches
from lightning_fp8.demo.gpt import GPTConfig
from lightning_fp8.demo.module import CharGPTModule
from lightning_fp8.demo.run import _Batches, build_parser
from bench_io import SCHEDULES, constant_lr, machine


class GPT2Loss(nn.Module):
    """GPT2LMHeadModel with the demo model's `loss(x, y)` interface (next-character cross-entropy)."""

    def __init__(self, vocab_size: int, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=d_model, n_layer=layers,
                                         n_head=heads, bos_token_id=0, eos_token_id=0)
        self.gpt2 = transformers.GPT2LMHeadModel(config)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.gpt2(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_once(corpus, args, fp8: bool):
    L.seed_everything(args.seed, verbose=False)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads)
    module = CharGPTModule(cfg, lr=args.lr, max_steps=args.steps)  # its optimizer, schedule and loss bookkeeping
    module.model = GPT2Loss(corpus.vocab_size, args.context, args.d_model, args.layers, args.heads)
    if args.schedule == "constant":
        constant_lr(module)
    plugin = FP8Precision(preset=args.preset) if fp8 else None
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, precision=None if fp8 else "bf16-mixed",
        plugins=[plugin] if fp8 else None, val_check_interval=args.steps, check_val_every_n_epoch=None, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0,
    )
    train = DataLoader(_Batches(corpus.train, args.batch_size, args.context, args.steps, args.seed), batch_size=None)
    val = fixed_val_batches(corpus.val, args.batch_size, args.context, args.val_batches)
    start = time.perf_counter()
    trainer.fit(module, train, DataLoader(val, batch_size=None))
    rows = precision_map(module) if fp8 else []
    return {
        "val_loss": module.val_losses[-1],
        "train_loss": sum(module.train_losses[-20:]) / len(module.train_losses[-20:]),
        "seconds": time.perf_counter() - start,
        "skipped_steps": plugin.skipped_steps if fp8 else None,
        "rollbacks": plugin.rollbacks if fp8 else None,
        "fp8_layers": [r.fqn for r in rows if r.precision == "fp8"],
        "bf16_layers": {r.fqn: r.reason for r in rows if r.precision != "fp8"},
    }


def main() -> None:
    parser = build_parser(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="benchmarks/results/gpt2_parity")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                        help="cosine: warmup then decay to zero (default); constant: the same warmup, then held")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    corpus = load_corpus(args.data)
    host = machine(gemms="CPU (FP8 GEMMs emulated: real FP8 casts, float32 products)")
    runs = []
    for seed in args.seeds:
        args.seed = seed
        bf16 = train_once(corpus, args, fp8=False)
        fp8 = train_once(corpus, args, fp8=True)
        runs.append({"seed": seed, "bf16": bf16, "fp8": fp8,
                     "relative_gap": (fp8["val_loss"] - bf16["val_loss"]) / bf16["val_loss"]})
        print(json.dumps({"seed": seed, "bf16_val_loss": bf16["val_loss"], "fp8_val_loss": fp8["val_loss"]}), flush=True)
    gaps = [r["relative_gap"] for r in runs]
    bf16_losses = [r["bf16"]["val_loss"] for r in runs]
    fp8_losses = [r["fp8"]["val_loss"] for r in runs]
    result = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": host,
        "config": {k: getattr(args, k) for k in ("steps", "batch_size", "context", "d_model", "layers", "heads", "lr",
                                                   "preset", "val_batches", "schedule")},
        "runs": runs,
        "mean_relative_gap": statistics.mean(gaps),
        "sd_relative_gap": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
        "bf16_relative_sd": statistics.stdev(bf16_losses) / statistics.mean(bf16_losses) if len(runs) > 1 else 0.0,
        "fp8_relative_sd": statistics.stdev(fp8_losses) / statistics.mean(fp8_losses) if len(runs) > 1 else 0.0,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


def markdown(result) -> str:
    fp8, m = result["runs"][0]["fp8"], result["machine"]
    lines = [
        f"# GPT-2 (transformers GPT2LMHeadModel) loss parity: FP8Precision vs bf16-mixed ({result['date']}, "
        f"torch {result['torch']}, transformers {result['transformers']}, {m['cpu']}, {m['threads']} threads, "
        f"BF16 hardware: {m['bf16_hardware']}, {m['gemms']})",
        "",
        f"Written by `python benchmarks/gpt2_parity.py`. config: {result['config']}",
        "",
        f"FP8 layers ({len(fp8['fp8_layers'])}): {', '.join(fp8['fp8_layers'])}",
        "",
        "Kept in BF16: " + "; ".join(f"{k}: {v}" for k, v in fp8["bf16_layers"].items()),
        "",
        "| seed | bf16 val loss | fp8 val loss | relative gap | bf16 train loss | fp8 train loss | fp8 skips | fp8 rollbacks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(f"| {r['seed']} | {r['bf16']['val_loss']:.4f} | {r['fp8']['val_loss']:.4f} | "
                     f"{r['relative_gap']:+.2%} | {r['bf16']['train_loss']:.4f} | {r['fp8']['train_loss']:.4f} | "
                     f"{r['fp8']['skipped_steps']} | {r['fp8']['rollbacks']} |")
    lines += [
        "",
        f"mean gap {result['mean_relative_gap']:+.2%} (sd {result['sd_relative_gap']:.2%} over seeds); seed-to-seed "
        f"spread (relative sd of the val loss): bf16 {result['bf16_relative_sd']:.2%}, fp8 {result['fp8_relative_sd']:.2%}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
