"""The planted-outlier run over seeds: BF16, FP8 without FP8LayerFallback, FP8 with the default FP8LayerFallback().

The char-GPT of lightning_fp8/demo/planted.py (one x1e6 input channel in blocks.0.fc2, its weight column held at
zero): what the default callbacks do with that layer (escalation to blockwise scaling) and what it costs in val
loss, next to BF16's seed-to-seed spread. tests/test_escalation.py runs seed 0 of the same configuration. Reported per
run: the final validation loss (Lightning's validation loop: eval mode, no gradients, FP8 forward as FP8Precision runs
it; one fixed batch of windows of the generated walk the training batches are drawn from, so held out as a batch but
not as text) beside the final training loss (mean of the last 20 steps); the machine (bench_io.machine(): CPU,
threads, BF16 hardware or not). The LR warms up then decays to zero (planted.py); `--schedule constant` holds it after
the same warmup instead.

    python benchmarks/escalation.py --seeds 0 1 2 [--schedule constant]
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import warnings

import torch

from lightning_fp8 import FP8Precision, fp8_layers
from lightning_fp8.callbacks import FP8LayerFallback
from lightning_fp8.demo import planted
from lightning_fp8.demo.planted import PLANTED_LAYER, STEPS, fit_planted
from bench_io import SCHEDULES, constant_lr, machine


def train_loss(module) -> float:
    """The mean training loss of the last 20 steps."""
    tail = module.train_losses[-20:]
    return sum(tail) / len(tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", default="benchmarks/results/escalation")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                        help="cosine: warmup then decay to zero (default); constant: the same warmup, then held")
    args = parser.parse_args()
    if args.schedule == "constant":
        module_class = planted.PlantedGPT
        planted.PlantedGPT = lambda *a, **k: constant_lr(module_class(*a, **k))  # what fit_planted builds
    host = machine(gemms="CPU (FP8 GEMMs emulated)")
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "lightning_fp8"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = []
    for seed in args.seeds:
        bf16_module, bf16 = fit_planted(seed, args.steps, precision="bf16-mixed")
        plain_module, plain = fit_planted(seed, args.steps, plugins=[FP8Precision()])
        fallback = FP8LayerFallback()
        module, guarded = fit_planted(seed, args.steps, plugins=[FP8Precision()], callbacks=[fallback])
        rows.append({
            "seed": seed, "bf16": bf16, "fp8_no_fallback": plain, "fp8_default_callbacks": guarded,
            "gap_no_fallback": (plain - bf16) / bf16, "gap_default_callbacks": (guarded - bf16) / bf16,
            "train_loss": {"bf16": train_loss(bf16_module), "fp8_no_fallback": train_loss(plain_module),
                           "fp8_default_callbacks": train_loss(module)},
            "escalations": {fqn: {k: info[k] for k in ("from", "to", "rule", "step")} for fqn, info in fallback.escalations.items()},
            "fallbacks": sorted(fallback.fallbacks),
            "planted_layer_scaling": fp8_layers(module)[PLANTED_LAYER].recipe.scaling,
        })
        print(json.dumps(rows[-1]), flush=True)
    bf16s = [r["bf16"] for r in rows]
    spread = statistics.stdev(bf16s) / statistics.mean(bf16s) if len(rows) > 1 else 0.0
    summary = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "machine": host, "steps": args.steps, "schedule": args.schedule, "runs": rows, "bf16_seed_spread_relative_sd": spread,
    }
    for key in ("gap_no_fallback", "gap_default_callbacks"):
        gaps = [r[key] for r in rows]
        summary[key] = {"mean": statistics.mean(gaps), "sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0}
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    with open(args.out + ".md", "w") as f:
        m = host
        f.write(f"# Planted x1e6 channel: BF16 vs FP8 with and without FP8LayerFallback ({summary['date']}, torch "
                f"{summary['torch']}, {m['cpu']}, {m['threads']} threads, BF16 hardware: {m['bf16_hardware']}, "
                f"{m['gemms']})\n\n{args.steps} steps, {args.schedule} LR, lightning_fp8/demo/planted.py\n\n")
        f.write("| seed | bf16 val loss | fp8, no fallback | gap | fp8, default callbacks | gap | train loss (bf16 / no "
                "fallback / default) | what moved |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            moved = "; ".join(f"{fqn}: {i['from']} -> {i['to']} at step {i['step']} ({i['rule']})" for fqn, i in r["escalations"].items())
            moved += "".join(f"; {fqn} -> BF16" for fqn in r["fallbacks"])
            f.write(f"| {r['seed']} | {r['bf16']:.4f} | {r['fp8_no_fallback']:.4f} | {r['gap_no_fallback']:+.2%} | "
                    f"{r['fp8_default_callbacks']:.4f} | {r['gap_default_callbacks']:+.2%} | "
                    + " / ".join(f"{v:.4f}" for v in r["train_loss"].values()) + f" | {moved or 'nothing'} |\n")
        a, b = summary["gap_no_fallback"], summary["gap_default_callbacks"]
        f.write(f"\n- FP8 without fallback: mean gap {a['mean']:+.2%} (sd {a['sd']:.2%})\n"
                f"- FP8 with the default callbacks: mean gap {b['mean']:+.2%} (sd {b['sd']:.2%})\n"
                f"- BF16 seed-to-seed spread (relative sd of val loss): {spread:.2%}\n")
    print(open(args.out + ".md").read())


if __name__ == "__main__":
    sys.exit(main())
