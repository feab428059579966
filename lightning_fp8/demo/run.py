"""`lightning-fp8 demo`: train the same char-GPT twice, FP8 and a high-precision baseline, same seed and data, and
compare.

The baseline is what the machine runs best, so the time column says something true: BF16 mixed precision on a GPU or
on a CPU that multiplies BF16 in hardware (AVX512-BF16, AMX), float32 on a CPU without it (an AVX2-only CPU runs
torch's BF16 GEMMs in a software fallback far slower than float32, which would make any FP8 run look fast). Where
FP8 GEMMs are emulated (no FP8 tensor cores), the FP8 run is labelled "emulated": its time measures the emulation,
not FP8.
"""
from __future__ import annotations

import argparse
import logging
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_fp8.conversion.convert import precision_map
from lightning_fp8.demo.data import CharCorpus, batches, fixed_val_batches, load_corpus
from lightning_fp8.demo.gpt import GPTConfig
from lightning_fp8.demo.module import CharGPTModule
from lightning_fp8.modules.gemm import FP8EmulationWarning


class _Batches(IterableDataset):
    def __init__(self, ids, batch_size, context, steps, seed):
        self.args = (ids, batch_size, context, steps, seed)

    def __iter__(self):
        return batches(*self.args)


@dataclass
class RunResult:
    name: str
    final_train_loss: float  # mean of the last 20 training losses
    final_val_loss: float
    seconds: float
    module: CharGPTModule
    plugin: Optional[object] = None


#: Lightning precision of each baseline, and its label in the table
BASELINES = {"bf16": "bf16-mixed", "fp32": "32-true"}


def bf16_in_hardware(device: str) -> bool:
    """Whether `device` computes BF16 GEMMs in hardware: a CUDA GPU, or a CPU with AVX512-BF16 / AMX."""
    from lightning_fp8.modules.gemm import cpu_has_native_bf16

    return device == "cuda" or cpu_has_native_bf16()


def choose_baseline(requested: str, device: str) -> Tuple[str, str]:
    """(baseline name, why): "bf16" where BF16 runs in hardware, else "fp32" (what the machine runs fastest)."""
    if requested != "auto":
        return requested, "--baseline " + requested
    if bf16_in_hardware(device):
        return "bf16", f"{device} computes BF16 in hardware"
    return "fp32", (f"this {device} has no BF16 hardware (no AVX512-BF16 or AMX): torch runs BF16 GEMMs in software "
                    "there, far slower than float32, so the baseline runs in float32")


def train_once(name: str, corpus: CharCorpus, args: argparse.Namespace, fp8: bool, baseline: str = "bf16") -> RunResult:
    from lightning_fp8 import FP8Precision

    L.seed_everything(args.seed, verbose=False)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    module = CharGPTModule(cfg, lr=args.lr, max_steps=args.steps)
    plugin = FP8Precision(demo_recipe(args)) if fp8 else None
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.steps,
        precision=None if fp8 else BASELINES[baseline],
        plugins=[plugin] if fp8 else None,
        val_check_interval=args.steps,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=args.progress,
        num_sanity_val_steps=0,
    )
    train = DataLoader(_Batches(corpus.train, args.batch_size, args.context, args.steps, args.seed), batch_size=None)
    val = fixed_val_batches(corpus.val, args.batch_size, args.context, args.val_batches)
    start = time.perf_counter()
    trainer.fit(module, train, DataLoader(val, batch_size=None))
    seconds = time.perf_counter() - start
    tail = module.train_losses[-20:]
    return RunResult(name, sum(tail) / len(tail), module.val_losses[-1], seconds, module, plugin)


def demo_recipe(args: argparse.Namespace):
    """The FP8 recipe of the run: the preset's, with --recipe's scaling (a fine-grained scaling takes its own default
    formats, E4M3 everywhere, unless the preset names others; mxfp8 / nvfp4 take their own formats, rounding and
    transforms, numerics/microscaling.py)."""
    import dataclasses

    from lightning_fp8.presets import get_preset
    from lightning_fp8.recipe import MICROSCALING_SCALINGS, scale_gradients_with

    recipe = get_preset(args.preset)
    scaling = getattr(args, "recipe", None)
    if scaling is None or scaling == recipe.scaling:
        return recipe
    if scaling in MICROSCALING_SCALINGS:
        return dataclasses.replace(recipe, scaling=scaling, format=None, rounding=None, random_hadamard=None,
                                   keep_last_blocks_in_bf16=None, scale_gradients=scale_gradients_with(recipe, scaling))
    keep_format = args.preset != "default"
    return dataclasses.replace(recipe, scaling=scaling, format=recipe.format if keep_format else None,
                               scale_gradients=scale_gradients_with(recipe, scaling))


def format_table(fp8: RunResult, baseline: RunResult, steps: int, emulated: bool = False,
                 baseline_why: str = "") -> str:
    """The comparison table. `emulated`: the FP8 GEMMs were emulated, so the FP8 row's time is labelled as such."""
    gap = (fp8.final_val_loss - baseline.final_val_loss) / baseline.final_val_loss
    fp8_label = "fp8 (emulated)" if emulated else "fp8"
    width = max(len(fp8_label), len(baseline.name), 3)
    lines = [
        f"{'run':<{width}} {'steps':>6} {'train loss':>11} {'val loss':>9} {'time':>8}",
        f"{baseline.name:<{width}} {steps:>6} {baseline.final_train_loss:>11.4f} {baseline.final_val_loss:>9.4f} "
        f"{baseline.seconds:>7.1f}s",
        f"{fp8_label:<{width}} {steps:>6} {fp8.final_train_loss:>11.4f} {fp8.final_val_loss:>9.4f} {fp8.seconds:>7.1f}s",
        f"relative val-loss gap (fp8 - {baseline.name}) / {baseline.name}: {gap:+.2%}",
    ]
    if baseline_why:
        lines.append(f"baseline {baseline.name}: {baseline_why}")
    if emulated:
        lines.append("time: no FP8 tensor cores here, the FP8 GEMMs are emulated (real FP8 casts, float32 products) "
                     "and the rest computes under BF16 autocast: the fp8 time measures the emulation, not FP8 speed")
    if fp8.plugin is not None:
        lines.append(f"fp8 stability: {fp8.plugin.skipped_steps} skipped steps, {fp8.plugin.rollbacks} rollbacks")
    lines.append("")
    lines.append("layer precision (FP8 run):")
    width = max(len(row.fqn) for row in precision_map(fp8.module))
    for row in precision_map(fp8.module):
        scaling = row.scaling if row.precision == "fp8" else ""
        lines.append(f"  {row.fqn:<{width}}  {row.precision:<4}  {scaling:<9}  {row.reason}")
    return "\n".join(lines)


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="lightning-fp8 demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128, help="model width (multiple of 16)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="default", help="FP8 preset: default, conservative, mellempudi")
    parser.add_argument("--recipe", default=None,
                        choices=["delayed", "current", "rowwise", "blockwise", "mxfp8", "nvfp4"],
                        help="FP8 scaling (default: the preset's): per-tensor delayed / current, fine-grained "
                             "rowwise / blockwise (1x128 tiles, 128x128 weight blocks), or Blackwell's block-scaled "
                             "formats mxfp8 (1x32 E8M0 blocks) / nvfp4 (FP4 with 16-element E4M3 blocks)")
    parser.add_argument("--baseline", default="auto", choices=["auto", "bf16", "fp32"],
                        help="the high-precision run FP8 is compared with (default auto: BF16 mixed precision where "
                             "BF16 runs in hardware, float32 on a CPU without it)")
    parser.add_argument("--data", default=None, help="a text file to train on (default: the CPython stdlib text)")
    parser.add_argument("--progress", action="store_true", help="show Lightning's progress bar")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    warnings.filterwarnings("ignore", category=FP8EmulationWarning)
    warnings.filterwarnings("ignore", module="lightning")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    corpus = load_corpus(args.data)
    print(f"corpus: {len(corpus.train):,} train / {len(corpus.val):,} val characters, vocab {corpus.vocab_size}"
          f" ({args.data or 'CPython standard library'})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from lightning_fp8.kernels.device import profile_of

    emulated = not profile_of(torch.device(device)).fp8_tensor_cores
    if emulated:
        print(f"note: no FP8 tensor cores on {device}; FP8 GEMMs are emulated (real FP8 casts, float32 products)")
    baseline_name, why = choose_baseline(args.baseline, device)
    baseline = train_once(baseline_name, corpus, args, fp8=False, baseline=baseline_name)
    fp8 = train_once("fp8", corpus, args, fp8=True)
    print()
    print(format_table(fp8, baseline, args.steps, emulated=emulated, baseline_why=why))
    return 0
