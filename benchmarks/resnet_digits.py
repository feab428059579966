"""ResNet-18 on the digits: high precision vs FP8 (default recipe) vs FP8 (`mellempudi` preset), several seeds.

    python benchmarks/resnet_digits.py --time-bf16-step [--seeds 0 1 2] [--epochs 6] [--schedule constant]
                                       [--out benchmarks/results/resnet_digits]

The model and data of examples/resnet_digits.py: transformers' ResNetForImageClassification (basic blocks, depths
2-2-2-2, widths 64-512, 20 convolutions) on scikit-learn's 1797 handwritten 8x8 digits upscaled to 32x32, a fixed 75 /
25 split; AdamW (lr 2e-3, weight decay 5e-4), batch 64, 6 epochs (126 steps; float32 reaches about 98.7% test
accuracy), linear warmup over 20 steps then cosine decay to zero, so runs are compared at their end
(docs/measuring.md; `--schedule constant` holds the LR after the same warmup instead). 6 epochs, not 3: at 3 epochs
the model is still learning and float32's own accuracy varies by 1.0 point (sd) from seed to seed, as much as the
1-point bar the FP8 runs are held to; at 6 it varies by 0.13 (benchmarks/results/resnet_digits_3epochs.md keeps the
3-epoch run). Each seed fixes the initialisation and the data order, the same for the three precisions; the score is
the test-set accuracy after the last step, in eval mode without gradients (FP8 runs evaluate in FP8, as FP8Precision
does by default), reported beside the last step's training loss and the machine (bench_io.machine(): CPU, threads,
BF16 hardware or not).

The high-precision baseline is float32, not BF16: the CPU of the committed run has no BF16 hardware, where one BF16
training step of this model takes tens of seconds (`--time-bf16-step` measures it), so a BF16 baseline run would take
hours. The FP8 runs are float32 everywhere but their FP8 GEMMs (convert_to_fp8 + FP8TrainingEngine in a plain loop,
which is what FP8Precision drives, without its BF16 autocast): the comparison isolates what FP8 changes. The engine's
loss scaling is its "auto" choice: none for the default recipe (gradients scaled per tensor), dynamic for `mellempudi`
(gradients cast unscaled).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from lightning_fp8 import FP8Recipe, convert_to_fp8, precision_map  # noqa: E402
from lightning_fp8.engine import FP8TrainingEngine, StabilityConfig  # noqa: E402
from lightning_fp8.presets import get_preset  # noqa: E402
from bench_io import SCHEDULES, hold_after_warmup, machine  # noqa: E402

warnings.simplefilter("ignore")

VARIANTS = ("float32", "fp8-default", "fp8-mellempudi")


def _example():
    path = os.path.join(ROOT, "examples", "resnet_digits.py")
    spec = importlib.util.spec_from_file_location("resnet_digits_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def recipe_of(variant: str):
    return {"fp8-default": FP8Recipe(), "fp8-mellempudi": get_preset("mellempudi")}.get(variant)


def train_once(variant: str, seed: int, args, train, test) -> dict:
    torch.manual_seed(seed)
    model = EXAMPLE.resnet18()
    recipe = recipe_of(variant)
    engine = None
    fp8_convs = 0
    if recipe is not None:
        example = {"pixel_values": torch.zeros(1, 3, args.image_size, args.image_size)}
        convert_to_fp8(model, recipe, example_input=example, verbose=False)
        fp8_convs = sum(r.precision == "fp8" for r in precision_map(model) if r.family == "convolution")
        engine = FP8TrainingEngine(recipe, StabilityConfig(), compute_dtype=torch.float32)
        engine.attach(model)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    total = args.epochs * len(loader)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    schedule = lambda s: EXAMPLE.warmup_cosine(s, total, 20)  # noqa: E731
    if args.schedule == "constant":
        schedule = hold_after_warmup(schedule, 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if engine is not None:
        engine.track([opt], [sched])
    losses = []
    start = time.perf_counter()
    model.train()
    for _ in range(args.epochs):
        for x, y in loader:
            if engine is not None:
                engine.begin_iteration()
            loss = F.cross_entropy(model(pixel_values=x).logits.float(), y)
            if engine is not None:
                engine.scale_loss(loss).backward()
                engine.step(opt, opt.step)
            else:
                loss.backward()
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    if engine is not None:
        engine.end_iteration()
    train_s = time.perf_counter() - start
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=256):
            correct += int((model(pixel_values=x).logits.argmax(-1) == y).sum())
    return {
        "variant": variant, "seed": seed, "accuracy": correct / len(test), "final_train_loss": losses[-1],
        "train_s": train_s, "steps": total, "fp8_convolutions": fp8_convs,
        "skipped_steps": engine.skipped_steps if engine is not None else 0,
        "rollbacks": engine.rollbacks if engine is not None else 0,
        "loss_scale": engine.loss_scale if engine is not None else 1.0,
        "losses_finite": all(math.isfinite(v) for v in losses),
    }


def bf16_step_seconds(args, train) -> float:
    """One training step of the float32 model under BF16 autocast (what a BF16 baseline costs on this CPU)."""
    torch.manual_seed(0)
    model = EXAMPLE.resnet18()
    x, y = next(iter(DataLoader(train, batch_size=args.batch_size)))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(pixel_values=x).logits.float(), y)
        loss.backward()
        times.append(time.perf_counter() - start)
    return times[-1]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _bf16_step_text(result: dict, cfg: dict) -> str:
    if "bf16_step_s" not in result:
        return "one BF16-autocast training step was not timed in this run (`--time-bf16-step` times it)"
    return (f"one BF16-autocast training step of this model at batch {cfg['batch_size']} took "
            f"{result['bf16_step_s']:.1f} s here")


def markdown(result: dict) -> str:
    m, cfg, runs = result["machine"], result["config"], result["runs"]
    load = m.get("load_average_1min_at_start", float("nan"))
    by = {(r["variant"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in runs)]
    lines = [f"# ResNet-18 on the digits: float32 vs FP8 ({m['date']}, {m['cpu']}, {m['threads']} threads, "
             f"torch {m['torch']}, transformers {m['transformers']})", "",
             "Written by `python benchmarks/resnet_digits.py` (see its docstring for the setup). config: "
             f"{json.dumps(cfg)}", "",
             "**Baseline precision: float32**, standing in for BF16 (BF16 hardware on this CPU: "
             f"{m['bf16_hardware']}); {_bf16_step_text(result, cfg)}. The FP8 runs compute "
             "everything that is not an FP8 GEMM in float32 too. FP8 GEMMs are emulated (real FP8 casts, float32 "
             "products). Times are wall-clock on a machine shared with other jobs (1-minute load average "
             f"{load:.1f} at the start, on 2 cores): they say what a run cost "
             "here, not how fast FP8 is (benchmarks/results/conv.md has interleaved ratios).", ""]
    fp8_convs = sorted({r["fp8_convolutions"] for r in runs if r["variant"] != "float32"})
    lines += [f"Convolutions in FP8: {', '.join(map(str, fp8_convs))} of 20 (the stem, 3 input channels; the first and "
              "the last convertible convolution, the first/last rule); the classifier (512 -> 10) stays in high "
              "precision (not 16-aligned).", "",
              "| seed | " + " | ".join(f"{v} acc" for v in variants) + " | " +
              " | ".join(f"{v} s" for v in variants) + " |",
              "|---" * (1 + 2 * len(variants)) + "|"]
    for seed in seeds:
        accs = " | ".join(f"{100 * by[(v, seed)]['accuracy']:.2f}%" for v in variants if (v, seed) in by)
        times = " | ".join(f"{by[(v, seed)]['train_s']:.0f}" for v in variants if (v, seed) in by)
        lines.append(f"| {seed} | {accs} | {times} |")
    lines.append("")
    base = [100 * by[("float32", s)]["accuracy"] for s in seeds if ("float32", s) in by]
    base_mean = statistics.mean(base) if base else float("nan")
    base_sd = statistics.stdev(base) if len(base) > 1 else 0.0
    for v in variants:
        accs = [100 * by[(v, s)]["accuracy"] for s in seeds if (v, s) in by]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        worst = min(accs) - base_mean
        extra = ""
        if v != "float32":
            rs = [by[(v, s)] for s in seeds if (v, s) in by]
            extra = (f"; each run vs the float32 mean: worst {worst:+.2f} points; skipped steps "
                     f"{sum(r['skipped_steps'] for r in rs)}, rollbacks {sum(r['rollbacks'] for r in rs)}, "
                     f"final loss scales {sorted({r['loss_scale'] for r in rs})}")
        train_loss = statistics.mean(by[(v, s)]["final_train_loss"] for s in seeds if (v, s) in by)
        lines.append(f"- {v}: mean {statistics.mean(accs):.2f}% (sd {sd:.2f} over seeds), mean final train loss "
                     f"{train_loss:.4f}, mean train time "
                     f"{statistics.mean(by[(v, s)]['train_s'] for s in seeds if (v, s) in by):.0f} s{extra}")
    lines.append(f"- float32 seed-to-seed sd: {base_sd:.2f} points")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                        help="cosine: warmup then decay to zero (default); constant: the same warmup, then held")
    parser.add_argument("--time-bf16-step", action="store_true", help="also time one BF16-autocast training step")
    parser.add_argument("--out", default="benchmarks/results/resnet_digits")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs <out>.json has (same config), run the rest")
    args = parser.parse_args()
    train, test = EXAMPLE.digits(args.image_size)
    config = {k: getattr(args, k) for k in ("seeds", "epochs", "batch_size", "lr", "image_size", "schedule")}
    result = {"machine": machine(transformers=_transformers_version()), "runs": [], "config": config}
    if args.resume and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            saved = json.load(f)
        if dict({"schedule": "cosine"}, **saved["config"]) != config:  # results before --schedule are cosine
            raise SystemExit(f"--resume: {args.out}.json has config {saved['config']}, not {config}")
        result["runs"] = saved["runs"]
        if "bf16_step_s" in saved:
            result["bf16_step_s"] = saved["bf16_step_s"]
    if args.time_bf16_step and "bf16_step_s" not in result:
        result["bf16_step_s"] = bf16_step_seconds(args, train)
    done = {(r["variant"], r["seed"]) for r in result["runs"]}
    for seed in args.seeds:
        for variant in args.variants:  # interleaved: every seed sees the machine in the same state for each precision
            if (variant, seed) in done:
                continue
            run = train_once(variant, seed, args, train, test)
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
            with open(args.out + ".json", "w") as f:
                json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
