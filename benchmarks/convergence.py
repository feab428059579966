"""Convergence benchmark: char-GPT on the embedded corpus, FP8Precision vs precision="bf16-mixed".

Same model, seed, data order and fixed validation set for both; LR warms up then decays to zero (docs/measuring.md:
constant-LR comparisons of short runs are noise); `--schedule constant` holds it after the same warmup instead. Several
seeds, so the gap is reported next to the seed spread. Reported per run: the final validation loss (Lightning's
validation loop: eval mode, no gradients, FP8 forward as FP8Precision runs it, on held-out text) beside the final
training loss (mean of the last 20 steps); the machine (bench_io.machine(): CPU, threads, BF16 hardware or not).

    python benchmarks/convergence.py --seeds 0 1 2 --steps 300 [--preset default] [--schedule constant]
    python benchmarks/convergence.py --recipes rowwise blockwise --out benchmarks/results/convergence_finegrained
    python benchmarks/convergence.py --recipes mxfp8 nvfp4 --out benchmarks/results/convergence_blackwell

With --recipes, each seed runs BF16 once and FP8 once per recipe (the demo's --recipe scalings), all on the same
seed, data order and validation set. --bf16-from RESULT.json takes each seed's BF16 run from an earlier --recipes
result of the same configuration instead of training it again (a BF16 run is the same computation whatever FP8
recipes it is compared with; on a CPU without BF16 hardware it is the slowest run of a seed):

    python benchmarks/convergence.py --recipes mxfp8 nvfp4 --out benchmarks/results/convergence_blackwell \
        --bf16-from benchmarks/results/convergence_finegrained.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import warnings

import torch

from lightning_fp8.demo import run as demo_run
from lightning_fp8.demo.data import load_corpus
from lightning_fp8.demo.run import build_parser, train_once
from bench_io import SCHEDULES, constant_lr, machine


def main() -> None:
    parser = build_parser(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="benchmarks/results/convergence")
    parser.add_argument("--recipes", nargs="+", default=None,
                        choices=["delayed", "current", "rowwise", "blockwise", "mxfp8", "nvfp4"],
                        help="FP8 scalings to compare with BF16 (default: the preset's recipe only)")
    parser.add_argument("--bf16-from", default=None,
                        help="with --recipes: an earlier --recipes result (.json) of the same configuration whose BF16 "
                             "runs are reused, seed by seed")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                        help="cosine: warmup then decay to zero (default); constant: the same warmup, then held")
    args = parser.parse_args()
    args.host = _machine()  # before the runs: its load average is the one they started under
    if args.schedule == "constant":
        module_class = demo_run.CharGPTModule
        demo_run.CharGPTModule = lambda *a, **k: constant_lr(module_class(*a, **k))  # what train_once builds
    if args.recipes:
        return compare_recipes(args)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    corpus = load_corpus(args.data)
    rows = []
    for seed in args.seeds:
        args.seed = seed
        bf16 = train_once("bf16", corpus, args, fp8=False)
        fp8 = train_once("fp8", corpus, args, fp8=True)
        gap = (fp8.final_val_loss - bf16.final_val_loss) / bf16.final_val_loss
        rows.append({
            "seed": seed,
            "bf16_val_loss": bf16.final_val_loss,
            "fp8_val_loss": fp8.final_val_loss,
            "relative_gap": gap,
            "bf16_train_loss": bf16.final_train_loss,
            "fp8_train_loss": fp8.final_train_loss,
            "fp8_skipped_steps": fp8.plugin.skipped_steps,
            "fp8_rollbacks": fp8.plugin.rollbacks,
            "bf16_seconds": bf16.seconds,
            "fp8_seconds": fp8.seconds,
        })
        print(json.dumps(rows[-1]), flush=True)
    gaps = [r["relative_gap"] for r in rows]
    bf16_losses = [r["bf16_val_loss"] for r in rows]
    summary = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": args.host,
        "config": _config(args),
        "runs": rows,
        "mean_relative_gap": statistics.mean(gaps),
        "sd_relative_gap": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
        "bf16_seed_spread_relative_sd": (statistics.stdev(bf16_losses) / statistics.mean(bf16_losses)) if len(rows) > 1 else 0.0,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Convergence: FP8Precision vs bf16-mixed ({summary['date']}, torch {summary['torch']}, "
                f"{_machine_text(summary['machine'])})\n\n")
        f.write(f"config: {summary['config']}\n\n")
        f.write("| seed | bf16 val loss | fp8 val loss | relative gap | bf16 train loss | fp8 train loss | fp8 skips | "
                "fp8 rollbacks |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['seed']} | {r['bf16_val_loss']:.4f} | {r['fp8_val_loss']:.4f} | {r['relative_gap']:+.2%} | "
                    f"{r['bf16_train_loss']:.4f} | {r['fp8_train_loss']:.4f} | {r['fp8_skipped_steps']} | {r['fp8_rollbacks']} |\n")
        f.write(f"\nmean gap {summary['mean_relative_gap']:+.2%} (sd {summary['sd_relative_gap']:.2%} over seeds); "
                f"bf16 seed-to-seed spread (relative sd of val loss) {summary['bf16_seed_spread_relative_sd']:.2%}\n")
    print(open(args.out + ".md").read())


def compare_recipes(args) -> None:
    """BF16 and one FP8 run per recipe for each seed: per-recipe gap (mean, sd over seeds) next to the BF16 spread."""
    import logging

    warnings.simplefilter("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    corpus = load_corpus(args.data)
    reused = _reused_bf16_runs(args)
    rows = []
    for seed in args.seeds:
        args.seed = seed
        args.recipe = None
        if reused is not None:
            row = {"seed": seed, "bf16_val_loss": reused[seed]["bf16_val_loss"], "bf16_seconds": reused[seed]["bf16_seconds"],
                   "bf16_train_loss": reused[seed].get("bf16_train_loss"), "bf16_from": args.bf16_from}
        else:
            bf16 = train_once("bf16", corpus, args, fp8=False)
            row = {"seed": seed, "bf16_val_loss": bf16.final_val_loss, "bf16_seconds": bf16.seconds,
                   "bf16_train_loss": bf16.final_train_loss}
        for scaling in args.recipes:
            args.recipe = scaling
            fp8 = train_once(scaling, corpus, args, fp8=True)
            row[scaling] = {
                "val_loss": fp8.final_val_loss,
                "relative_gap": (fp8.final_val_loss - row["bf16_val_loss"]) / row["bf16_val_loss"],
                "train_loss": fp8.final_train_loss,
                "skipped_steps": fp8.plugin.skipped_steps,
                "rollbacks": fp8.plugin.rollbacks,
                "seconds": fp8.seconds,
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    bf16_losses = [r["bf16_val_loss"] for r in rows]
    summary = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": args.host,
        "config": _config(args),
        "recipes": args.recipes,
        "bf16_from": args.bf16_from,
        "runs": rows,
        "bf16_seed_spread_relative_sd": (statistics.stdev(bf16_losses) / statistics.mean(bf16_losses)) if len(rows) > 1 else 0.0,
        "gaps": {},
    }
    for scaling in args.recipes:
        gaps = [r[scaling]["relative_gap"] for r in rows]
        summary["gaps"][scaling] = {"mean": statistics.mean(gaps), "sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0}
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Convergence: FP8 recipes {', '.join(args.recipes)} vs bf16-mixed ({summary['date']}, torch {summary['torch']}, "
                f"{_machine_text(summary['machine'])})\n\nconfig: {summary['config']}\n\n")
        f.write("| seed | bf16 val loss | bf16 train loss | "
                + " | ".join(f"{s} val loss | {s} gap | {s} train loss" for s in args.recipes) + " |\n")
        f.write("|---|---|---|" + "---|---|---|" * len(args.recipes) + "\n")
        for r in rows:
            cells = " | ".join(f"{r[s]['val_loss']:.4f} | {r[s]['relative_gap']:+.2%} | {r[s]['train_loss']:.4f}"
                               for s in args.recipes)
            f.write(f"| {r['seed']} | {r['bf16_val_loss']:.4f} | {_loss(r['bf16_train_loss'])} | {cells} |\n")
        f.write("\n")
        for scaling in args.recipes:
            g = summary["gaps"][scaling]
            skips = sum(r[scaling]["skipped_steps"] for r in rows)
            f.write(f"- {scaling}: mean gap {g['mean']:+.2%} (sd {g['sd']:.2%} over seeds), {skips} skipped steps\n")
        f.write(f"- bf16 seed-to-seed spread (relative sd of val loss): {summary['bf16_seed_spread_relative_sd']:.2%}\n")
        if args.bf16_from:
            f.write(f"- the BF16 runs are those of `{args.bf16_from}` (same configuration and seeds; --bf16-from)\n")
        f.write(f"- wall time per run (s), seeds {[r['seed'] for r in rows]}: bf16 {[round(r['bf16_seconds']) for r in rows]}"
                + "".join(f", {s} {[round(r[s]['seconds']) for r in rows]}" for s in args.recipes)
                + f" ({summary['machine']['cpu']}; shared with other jobs, so times are indicative)\n")
    print(open(args.out + ".md").read())


def _config(args) -> dict:
    return {k: getattr(args, k) for k in ("steps", "batch_size", "context", "d_model", "layers", "heads", "lr", "preset",
                                          "val_batches", "schedule")}


def _machine() -> dict:
    return machine(gemms="GPU" if torch.cuda.is_available() else "CPU (FP8 GEMMs emulated)")


def _machine_text(m: dict) -> str:
    return f"{m['cpu']}, {m['threads']} threads, BF16 hardware: {m['bf16_hardware']}, {m['gemms']}"


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _reused_bf16_runs(args):
    """--bf16-from: the earlier result's BF16 run of every requested seed, refused unless its configuration is this one."""
    if args.bf16_from is None:
        return None
    with open(args.bf16_from) as f:
        earlier = json.load(f)
    if dict({"schedule": "cosine"}, **earlier.get("config", {})) != _config(args):  # results before --schedule
        raise SystemExit(f"--bf16-from {args.bf16_from}: its configuration {earlier.get('config')} is not this run's "
                         f"{_config(args)}")
    runs = {r["seed"]: r for r in earlier["runs"]}
    missing = [seed for seed in args.seeds if seed not in runs]
    if missing:
        raise SystemExit(f"--bf16-from {args.bf16_from} has no BF16 run for seeds {missing}")
    return runs


if __name__ == "__main__":
    sys.exit(main())
