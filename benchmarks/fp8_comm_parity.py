"""Loss parity of FP8 gradient communication vs BF16 gradient communication: char-GPT on the standard library's text,
DDP on 2 CPU ranks, FP8 compute (FP8Precision) in both, 3 seeds, the learning rate decaying to zero
(docs/measuring.md: short constant-LR runs are noise; `--schedule constant` holds it after the same warmup instead).
Reported per run: the final validation loss (Lightning's validation loop: eval mode, no gradients, on held-out text)
beside the final training loss (rank 0's, mean of the last 20 steps); the machine (bench_io.machine(): CPU, threads,
BF16 hardware or not).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 benchmarks/fp8_comm_parity.py \\
        [--seeds 0 1 2 --steps 300 --d-model 128 --layers 2 --context 32 --batch-size 8] [--schedule constant]

bf16: DDP all-reduces the gradients in BF16 (a comm hook equivalent to torch's bf16_compress_hook, which refuses
CPU). fp8: FP8Precision(gradient_communication="fp8"), i.e. lightning_fp8's fp8_comm_hook with its defaults.
Each rank draws its own batches (seed, rank); both variants of a seed see the same data and the same init.
"""
import argparse
import datetime
import json
import logging
import statistics
import time
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, IterableDataset

from lightning_fp8 import FP8Precision
from lightning_fp8.demo.data import batches, fixed_val_batches, load_corpus
from lightning_fp8.demo.gpt import GPTConfig
from lightning_fp8.demo.module import CharGPTModule
from lightning_fp8.distributed import bf16_comm_hook
from bench_io import SCHEDULES, constant_lr, machine


class BF16Communication(L.Callback):
    def on_train_start(self, trainer, pl_module):
        trainer.strategy.model.register_comm_hook(None, bf16_comm_hook)


class RankBatches(IterableDataset):
    def __init__(self, ids, batch_size, context, steps, seed):
        self.args = (ids, batch_size, context, steps, seed)

    def __iter__(self):
        return batches(*self.args)


def run(variant, seed, corpus, args):
    L.seed_everything(seed, verbose=False)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model, n_layers=args.layers,
                    n_heads=args.heads)
    module = CharGPTModule(cfg, lr=args.lr, max_steps=args.steps)
    if args.schedule == "constant":
        constant_lr(module)
    plugin = FP8Precision(gradient_communication="fp8" if variant == "fp8" else "bf16")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(), plugins=[plugin], max_steps=args.steps,
        val_check_interval=args.steps, check_val_every_n_epoch=None, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=[BF16Communication()] if variant == "bf16" else [],
    )
    rank = dist.get_rank()
    train = DataLoader(RankBatches(corpus.train, args.batch_size, args.context, args.steps, 1000 * seed + rank), batch_size=None)
    val = DataLoader(fixed_val_batches(corpus.val, args.batch_size, args.context, args.val_batches), batch_size=None)
    start = time.perf_counter()
    trainer.fit(module, train, val)
    return {"val_loss": module.val_losses[-1], "train_loss_last20": sum(module.train_losses[-20:]) / len(module.train_losses[-20:]),
            "skipped_steps": plugin.skipped_steps, "rollbacks": plugin.rollbacks, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/fp8_comm_parity")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                        help="cosine: warmup then decay to zero (default); constant: the same warmup, then held")
    args = parser.parse_args()
    host = machine(ranks="2 gloo ranks (FP8 GEMMs emulated); shared with other jobs")
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "lightning_fp8"):
        logging.getLogger(name).setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    try:
        corpus = load_corpus()
        rows = []
        for seed in args.seeds:
            bf16, fp8 = run("bf16", seed, corpus, args), run("fp8", seed, corpus, args)
            rows.append({"seed": seed, "bf16": bf16, "fp8": fp8,
                         "relative_gap": (fp8["val_loss"] - bf16["val_loss"]) / bf16["val_loss"]})
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
        if dist.get_rank() == 0:
            write(args, rows, host)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def write(args, rows, host):
    gaps = [r["relative_gap"] for r in rows]
    bf16 = [r["bf16"]["val_loss"] for r in rows]
    fp8 = [r["fp8"]["val_loss"] for r in rows]
    summary = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "machine": host,
        "config": {k: getattr(args, k) for k in ("steps", "d_model", "layers", "heads", "context", "batch_size", "lr", "val_batches",
                                                 "schedule")},
        "runs": rows, "mean_relative_gap": statistics.mean(gaps),
        "sd_relative_gap": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
        "bf16_seed_spread_relative_sd": statistics.stdev(bf16) / statistics.mean(bf16) if len(bf16) > 1 else 0.0,
        "fp8_seed_spread_relative_sd": statistics.stdev(fp8) / statistics.mean(fp8) if len(fp8) > 1 else 0.0,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    with open(args.out + ".md", "w") as f:
        m = summary["machine"]
        f.write(f"# FP8 vs BF16 gradient communication, DDP, loss parity ({summary['date']}, torch {summary['torch']}, "
                f"{m['cpu']}, {m['threads']} thread(s) per rank, BF16 hardware: {m['bf16_hardware']}, {m['ranks']})\n\n"
                f"Produced by `benchmarks/fp8_comm_parity.py`; config {summary['config']}; FP8 compute (FP8Precision "
                "defaults) in both; LR warm-up then "
                f"{'constant' if args.schedule == 'constant' else 'cosine decay to zero'}.\n\n")
        f.write("| seed | BF16 comm val loss | FP8 comm val loss | relative gap | BF16 / FP8 comm train loss | "
                "FP8 comm skips / rollbacks |\n|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['seed']} | {r['bf16']['val_loss']:.4f} | {r['fp8']['val_loss']:.4f} | {r['relative_gap']:+.3%} | "
                    f"{r['bf16']['train_loss_last20']:.4f} / {r['fp8']['train_loss_last20']:.4f} | "
                    f"{r['fp8']['skipped_steps']} / {r['fp8']['rollbacks']} |\n")
        f.write(f"\nmean gap {summary['mean_relative_gap']:+.3%} (sd {summary['sd_relative_gap']:.3%} over seeds); seed-to-seed "
                f"spread (relative sd of the val loss): BF16 comm {summary['bf16_seed_spread_relative_sd']:.2%}, "
                f"FP8 comm {summary['fp8_seed_spread_relative_sd']:.2%}\n")
    print(open(args.out + ".md").read())


if __name__ == "__main__":
    main()
