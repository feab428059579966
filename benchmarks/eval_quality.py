"""Eval-mode quality after FP8 training (issue 43): ResNet-18 (BatchNorm) and a small ViT (LayerNorm) on the digits,
bf16-mixed vs FP8 recipes, many seeds, constant or decaying learning rate.

    python benchmarks/eval_quality.py --model resnet --schedule constant --variants bf16 fp8-default \
        --seeds 1 2 3 --out benchmarks/results/eval_quality_resnet_constant.jsonl
    python benchmarks/eval_quality.py --report benchmarks/results/eval_quality_resnet_constant.jsonl ...

Each run is one real `lightning.Trainer` fit: `precision="bf16-mixed"` or `plugins=[FP8Precision(recipe)]`, nothing
else (no FP8 callbacks), on the model and data of examples/resnet_digits.py (transformers' ResNetForImageClassification,
basic blocks 2-2-2-2, widths 64-512; scikit-learn's digits upscaled to 32x32, a fixed 1,437 / 360 split), AdamW
(lr 2e-3, weight decay 5e-4), batch 64 (drop_last: 22 steps per epoch), 5 epochs. A seed fixes the initialisation
(`torch.manual_seed(seed)` right before the model is built) and the data order (the loader's generator), the same for
every variant.

After the fit, on the 360 test images, it records:
- eval mode: `model.eval()` (BatchNorm running statistics), inside the plugin's forward context (FP8 evaluates in FP8,
  as FP8Precision does by default), and again with FP8 switched off (`fp8_autocast(enabled=False)`);
- batch statistics: only the BatchNorm layers in train mode (test batches of 72), the FP8 layers left in eval mode so
  their scaling state is not touched, BatchNorm's running buffers restored afterwards;
- re-estimated statistics: BatchNorm running statistics reset and recomputed as a cumulative average over one pass of
  the training data (momentum=None, what torch.optim.swa_utils.update_bn does) by lightning_fp8.refresh_batchnorm,
  then eval mode;
and after every epoch the eval-mode test accuracy (the FP8 layers evaluate without touching their state).

Variants (`VARIANTS`): bf16; bf16-eps (bf16 with AdamW eps 1.1e-8 instead of 1e-8: a perturbation that changes
nothing in expectation, the control for how far any small change moves a run); fp8-default (FP8Recipe()); fp8-current (scaling="current"); fp8-hp-wgrad
(FP8Recipe(weight_grad="high_precision"): the library's FP8 convolutions have no high-precision weight-gradient path,
so this recipe converts no convolution, which the run records); fp8-wgrad-bf16-emulated (the default recipe, with the
weight gradient of every FP8 convolution taken from a BF16 convolution of the same input instead of the FP8 GEMM: the
benchmark's own emulation of what a high-precision weight gradient would do, see `emulate_bf16_weight_grad`);
fp8-stochastic (rounding="stochastic": gradient casts stochastically rounded); fp8-e4m3 (format="e4m3": E4M3
gradients); fp8-fwd-only (the FP8 forward, every gradient from BF16 convolutions: isolates the forward's share).

Runs go to a JSON-lines file, one line per finished run (machine and config included), so a crash loses nothing and
`--resume` (the default) skips runs the file has. `--report` reads such files and writes the Markdown summary: per
variant mean, sd and 95% confidence interval (t distribution) over seeds, and per seed paired differences vs bf16.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_io

warnings.simplefilter("ignore")

VARIANTS = ("bf16", "bf16-eps", "fp8-default", "fp8-current", "fp8-hp-wgrad", "fp8-wgrad-bf16-emulated",
            "fp8-stochastic", "fp8-e4m3", "fp8-fwd-only")
#: AdamW's eps of every variant but bf16-eps, and bf16-eps's: a perturbation of the bf16 run that changes nothing
#: about its numerics in expectation, the control for how far any small change moves a run (docs/measuring.md)
ADAMW_EPS, PERTURBED_EPS = 1e-8, 1.1e-8
MODELS = ("resnet", "vit")
SCHEDULES = ("constant", "cosine")


def _example():
    path = os.path.join(ROOT, "examples", "resnet_digits.py")
    spec = importlib.util.spec_from_file_location("resnet_digits_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def recipe_of(variant: str):
    from lightning_fp8 import FP8Recipe

    return {
        "fp8-default": FP8Recipe(),
        "fp8-current": FP8Recipe(scaling="current"),
        "fp8-hp-wgrad": FP8Recipe(weight_grad="high_precision"),
        "fp8-wgrad-bf16-emulated": FP8Recipe(),
        "fp8-stochastic": FP8Recipe(rounding="stochastic"),
        "fp8-e4m3": FP8Recipe(format="e4m3"),
        "fp8-fwd-only": FP8Recipe(),
    }.get(variant)


def vit(num_labels: int = 10, image_size: int = 32, patch_size: int = 4):
    """transformers' ViT, a small configuration: width 128, 4 layers, 4 heads, MLP 512 (every linear 16-aligned; a
    quarter of ViT-Tiny's compute per token), patches of `patch_size` pixels plus a CLS token."""
    import transformers

    config = transformers.ViTConfig(image_size=image_size, patch_size=patch_size, num_channels=3, hidden_size=128,
                                    num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                                    num_labels=num_labels)
    return transformers.ViTForImageClassification(config)


def digits(image_size: int = 32, n_test: int = 360):
    """(train, test): examples/resnet_digits.py's preprocessing (3-channel, standardized, upscaled), its fixed
    permutation (split seed 0), with the issue's sizes: 360 test images, the other 1,437 for training."""
    full_train, full_test = EXAMPLE.digits(image_size, test_fraction=0.0)
    x, y = full_train.tensors
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return TensorDataset(x[order[n_test:]], y[order[n_test:]]), TensorDataset(x[order[:n_test]], y[order[:n_test]])


def build_model(name: str, patch_size: int = 4):
    return EXAMPLE.resnet18() if name == "resnet" else vit(patch_size=patch_size)


# -- the benchmark's own gradient emulations (library code unchanged) --------------------------------------------------
def _high_precision_conv(layer, x):
    return F.conv2d(x, layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation, layer.groups)


def emulate_bf16_weight_grad(model, forward_too: bool = False) -> int:
    """Give every FP8 convolution of `model` a weight gradient computed in the compute dtype (BF16 under autocast)
    instead of by its FP8 weight-gradient GEMM; return how many layers were changed.

    The FP8 layer is made to see a detached weight (so its backward runs the FP8 input-gradient GEMM only), and a
    forward hook adds `conv(x.detach(), W) - conv(x.detach(), W).detach()`: zero in value, so the forward output is
    the FP8 one, but its backward is the high-precision weight gradient of the same input and output gradient.
    forward_too: also take the input gradient from the high-precision convolution (then only the forward is FP8:
    the output is `y_fp8.detach() + conv(x, W) - conv(x, W).detach()`)."""
    from lightning_fp8.modules.conv import FP8ConvNd

    changed = 0
    for module in model.modules():
        if not isinstance(module, FP8ConvNd) or not module.fp8_enabled:
            continue
        module.fp8_weight = (lambda m=module: m.weight.detach())  # instance attribute: FP8 GEMMs without dW

        def hook(layer, args, output):
            if not layer.training or not torch.is_grad_enabled():
                return output
            x = args[0]
            if forward_too:
                hp = _high_precision_conv(layer, x)
                return output.detach() + (hp - hp.detach())
            hp = _high_precision_conv(layer, x.detach())
            return output + (hp - hp.detach())

        module.register_forward_hook(hook)
        changed += 1
    return changed


# -- Lightning module -----------------------------------------------------------------------------------------------
def lr_lambda(schedule: str, total: int, warmup: int):
    if schedule == "constant":
        return lambda step: 1.0
    return lambda step: EXAMPLE.warmup_cosine(step, total, warmup)


def make_module(args, seed: int, variant: str):
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.model = build_model(args.model, args.patch_size)
            self.example_input_array = torch.zeros(1, 3, args.image_size, args.image_size)
            self.emulated_layers = 0

        def forward(self, x):
            return self.model(pixel_values=x).logits

        def on_fit_start(self):  # after FP8Precision converted the model
            if variant in ("fp8-wgrad-bf16-emulated", "fp8-fwd-only"):
                self.emulated_layers = emulate_bf16_weight_grad(self.model, forward_too=variant == "fp8-fwd-only")

        def validation_step(self, batch, batch_idx):  # only with --lightning-val
            x, y = batch
            self.log("val_acc", (self(x).float().argmax(-1) == y).float().mean())

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x).float(), y)
            self.train_losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            eps = PERTURBED_EPS if variant == "bf16-eps" else ADAMW_EPS
            opt = torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=args.weight_decay, eps=eps)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.schedule, self.total_steps, args.warmup))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Classifier()


def bn_layers(model) -> List[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


@torch.no_grad()
def evaluate(module, loader, context) -> Dict[str, float]:
    correct, loss_sum, n = 0, 0.0, 0
    for x, y in loader:
        with context():
            logits = module(x).float()
        correct += int((logits.argmax(-1) == y).sum())
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        n += len(y)
    return {"acc": correct / n, "loss": loss_sum / n}


def _set_mode(module, bn_train: bool) -> None:
    module.eval()
    if bn_train:
        for bn in bn_layers(module):
            bn.train()


def _bn_buffers(module):
    return [(bn, bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone(), bn.momentum)
            for bn in bn_layers(module)]


def _restore_bn(saved) -> None:
    for bn, mean, var, count, momentum in saved:
        bn.running_mean.copy_(mean)
        bn.running_var.copy_(var)
        bn.num_batches_tracked.copy_(count)
        bn.momentum = momentum


def final_measurements(module, trainer, train, test, args) -> Dict[str, float]:
    from lightning_fp8 import fp8_autocast, refresh_batchnorm

    plugin = trainer.precision_plugin
    context = plugin.forward_context
    test_loader = DataLoader(test, batch_size=72)
    out: Dict[str, float] = {}

    def no_fp8():
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(context())
        stack.enter_context(fp8_autocast(enabled=False))
        return stack

    _set_mode(module, bn_train=False)
    r = evaluate(module, test_loader, context)
    out.update(eval_acc=r["acc"], eval_loss=r["loss"])
    r = evaluate(module, test_loader, no_fp8)
    out.update(eval_acc_fp8_off=r["acc"], eval_loss_fp8_off=r["loss"])
    if bn_layers(module):
        saved = _bn_buffers(module)
        _set_mode(module, bn_train=True)
        for bn in bn_layers(module):
            bn.momentum = 0.0  # batch statistics used, running buffers unchanged
        r = evaluate(module, test_loader, context)
        out.update(batchstat_acc=r["acc"], batchstat_loss=r["loss"])
        _restore_bn(saved)
        # re-estimate over one pass of the training data: the library's refresh_batchnorm (BatchNormRefresh's rule)
        refresh_batchnorm(module, (x for x, _ in DataLoader(train, batch_size=args.batch_size)), context=context)
        _set_mode(module, bn_train=False)
        r = evaluate(module, test_loader, context)
        out.update(reestimated_acc=r["acc"], reestimated_loss=r["loss"])
        _restore_bn(saved)
    return out


def train_once(args, variant: str, seed: int, train, test) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_fp8 import FP8Precision, precision_map

    L.seed_everything(seed, verbose=False)
    module = make_module(args, seed, variant)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    module.total_steps = args.epochs * len(loader)
    module.train_losses = []
    epoch_evals: List[Dict[str, float]] = []
    test_loader = DataLoader(test, batch_size=72)

    class EpochEval(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            _set_mode(pl_module, bn_train=False)
            r = evaluate(pl_module, test_loader, trainer.precision_plugin.forward_context)
            losses = pl_module.train_losses[-len(loader):]
            epoch_evals.append({"eval_acc": r["acc"], "eval_loss": r["loss"],
                                "train_loss": float(torch.stack(losses).mean()) if losses else float("nan")})
            pl_module.train()

    recipe = recipe_of(variant)
    precision = {"precision": "bf16-mixed"} if recipe is None else {"plugins": [FP8Precision(recipe=recipe)]}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[EpochEval()], deterministic=False,
                        limit_val_batches=1.0 if args.lightning_val else 0, **precision)
    start = time.perf_counter()
    trainer.fit(module, loader, DataLoader(test, batch_size=72) if args.lightning_val else None)
    train_s = time.perf_counter() - start
    rows = precision_map(module) if recipe is not None else []
    fp8_layers = sum(r.precision == "fp8" for r in rows)
    result = {
        "model": args.model, "schedule": args.schedule, "variant": variant, "seed": seed,
        "train_s": train_s, "steps": module.total_steps, "fp8_layers": fp8_layers,
        "emulated_layers": module.emulated_layers,
        "skipped_steps": getattr(trainer.precision_plugin, "skipped_steps", 0),
        "rollbacks": getattr(trainer.precision_plugin, "rollbacks", 0),
        "final_train_loss": float(module.train_losses[-1]),
        "losses_finite": bool(torch.isfinite(torch.stack(module.train_losses)).all()),
        "first_batch_labels_sum": int(next(iter(DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                                           generator=torch.Generator().manual_seed(seed))))[1].sum()),
        "epochs": epoch_evals,
    }
    result.update(final_measurements(module, trainer, train, test, args))
    return result


def machine() -> dict:
    """bench_io.machine() plus the CPU's BF16 flags, the core count, Lightning's and transformers' versions and the
    commit the runs ran on."""
    from bench_io import machine as base_machine

    try:
        flags = open("/proc/cpuinfo").read()
        bf16_flags = sorted({f for f in ("avx512_bf16", "amx_bf16") if f in flags})
    except OSError:
        bf16_flags = []
    import lightning
    import transformers

    info = base_machine(cpu_bf16_flags=bf16_flags, cores=os.cpu_count(), lightning=lightning.__version__,
                        transformers=transformers.__version__,
                        commit=subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                              text=True).stdout.strip())
    info["load_average_1min"] = info.pop("load_average_1min_at_start")  # the key earlier runs recorded
    return info


def config_of(args) -> dict:
    return {k: getattr(args, k) for k in ("model", "schedule", "epochs", "batch_size", "lr", "weight_decay",
                                          "warmup", "image_size")} | (
        {"patch_size": args.patch_size} if args.model == "vit" else {}) | (
        {"lightning_val": True} if args.lightning_val else {})


def load_runs(paths: List[str]) -> List[dict]:
    runs = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            runs += [json.loads(line) for line in f if line.strip()]
    return runs


# -- statistics ---------------------------------------------------------------------------------------------------
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000}


def t975(df: int) -> float:
    if df in _T975:
        return _T975[df]
    keys = sorted(_T975)
    return next((_T975[k] for k in keys if k >= df), 1.96)


def mean_ci(values: List[float]) -> Dict[str, float]:
    n = len(values)
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if n > 1 else float("nan")
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half, "median": statistics.median(values),
            "min": min(values), "max": max(values)}


def pearson(a: List[float], b: List[float]) -> float:
    """Correlation over seeds of two variants' results: how much a shared seed (initialisation, data order) still
    ties the two runs together at the end."""
    if len(a) < 3:
        return float("nan")
    ma, mb = statistics.mean(a), statistics.mean(b)
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def sign_test_p(diffs: List[float]) -> float:
    """Two-sided exact sign test of the paired differences (zeros dropped)."""
    pos = sum(d > 0 for d in diffs)
    neg = sum(d < 0 for d in diffs)
    n = pos + neg
    if n == 0:
        return 1.0
    k = min(pos, neg)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)


def levene_p_approx(a: List[float], b: List[float]) -> Dict[str, float]:
    """Brown-Forsythe test of equal spread: Welch t on |x - median| of each group (a normal approximation of the p
    value; enough to say whether the spreads differ clearly)."""
    da = [abs(x - statistics.median(a)) for x in a]
    db = [abs(x - statistics.median(b)) for x in b]
    ma, mb = statistics.mean(da), statistics.mean(db)
    va, vb = statistics.variance(da), statistics.variance(db)
    se = math.sqrt(va / len(da) + vb / len(db))
    t = (mb - ma) / se if se > 0 else 0.0
    p = math.erfc(abs(t) / math.sqrt(2))
    return {"mean_abs_dev_a": ma, "mean_abs_dev_b": mb, "t": t, "p_normal_approx": p}


METRICS = (("eval_acc", "eval-mode acc %", 100.0), ("batchstat_acc", "batch-stat acc %", 100.0),
           ("reestimated_acc", "re-estimated BN acc %", 100.0),
           ("bn_penalty", "BN-statistics penalty (re-estimated minus eval-mode acc), points", 100.0),
           ("eval_acc_fp8_off", "eval acc, FP8 off %", 100.0), ("eval_loss", "eval-mode test loss", 1.0),
           ("final_train_loss", "last train loss", 1.0))
#: the metrics the Markdown tables show (all of METRICS but the last)
SHOWN = METRICS[:6]


def group_of(run: dict) -> str:
    """The table a run belongs to: model/schedule, and /lightning-val for runs with Lightning's validation loop."""
    return f"{run['model']}/{run['schedule']}" + ("/lightning-val" if run["config"].get("lightning_val") else "")


def summarize(runs: List[dict]) -> dict:
    groups: Dict[str, Dict[str, Dict[int, dict]]] = {}
    for r in runs:
        if "reestimated_acc" in r:
            r["bn_penalty"] = r["reestimated_acc"] - r["eval_acc"]
        groups.setdefault(group_of(r), {}).setdefault(r["variant"], {})[r["seed"]] = r
    out = {}
    for group, by_variant in sorted(groups.items()):
        base = by_variant.get("bf16", {})
        table = {}
        for variant in [v for v in VARIANTS if v in by_variant]:
            rs = by_variant[variant]
            row = {"seeds": sorted(rs), "fp8_layers": sorted({r["fp8_layers"] for r in rs.values()}),
                   "emulated_layers": sorted({r.get("emulated_layers", 0) for r in rs.values()}),
                   "skipped_steps": sum(r["skipped_steps"] for r in rs.values()),
                   "rollbacks": sum(r["rollbacks"] for r in rs.values()),
                   "mean_train_s": statistics.mean(r["train_s"] for r in rs.values())}
            for key, _, factor in METRICS:
                vals = [factor * r[key] for r in rs.values() if key in r]
                if not vals:
                    continue
                row[key] = mean_ci(vals)
                shared = [s for s in rs if s in base and key in base[s]]
                if variant != "bf16" and len(shared) > 1:
                    diffs = [factor * (rs[s][key] - base[s][key]) for s in shared]
                    row[key + "_paired_vs_bf16"] = {**mean_ci(diffs), "sign_test_p": sign_test_p(diffs),
                                                    "seed_correlation": pearson([base[s][key] for s in shared],
                                                                                [rs[s][key] for s in shared])}
                    row[key + "_spread_vs_bf16"] = levene_p_approx([factor * base[s][key] for s in shared],
                                                                   [factor * rs[s][key] for s in shared])
            epochs = [r["epochs"] for r in rs.values() if r.get("epochs")]
            if epochs:
                n_ep = min(len(e) for e in epochs)
                row["per_epoch_eval_acc"] = [mean_ci([100 * e[i]["eval_acc"] for e in epochs]) for i in range(n_ep)]
                # every epoch-end snapshot of the second half of training: how often eval mode is badly off
                snaps = [100 * e[i]["eval_acc"] for e in epochs for i in range(n_ep // 2, n_ep)]
                row["snapshots_second_half"] = {"n": len(snaps), "below_90": sum(s < 90 for s in snaps),
                                                "below_80": sum(s < 80 for s in snaps), **mean_ci(snaps)}
            table[variant] = row
        out[group] = table
    return out


def _fmt_ci(c: dict, digits: int = 2) -> str:
    return f"{c['mean']:.{digits}f} (sd {c['sd']:.{digits}f}; CI {c['lo']:.{digits}f} to {c['hi']:.{digits}f})"


def markdown(runs: List[dict], summary: dict, machine_info: dict) -> str:
    m = machine_info
    lines = [f"# Eval-mode quality after FP8 training: raw tables ({m['date']})", "",
             f"Written by `python benchmarks/eval_quality.py --report` (setup: its docstring). Machine: {m['cpu']}, "
             f"{m['cores']} cores, BF16 hardware: {m['bf16_hardware']} (cpuinfo flags {m['cpu_bf16_flags']}), torch "
             f"{m['torch']}, lightning {m['lightning']}, transformers {m['transformers']}, commit {m['commit']}; each run "
             "one thread under `nice -n 19`, two runs at a time, on a machine shared with other jobs. Accuracies in "
             "%, on the 360 test images. CI: 95% confidence interval of the mean (t distribution over seeds); paired: "
             "the per-seed difference to bf16 (same initialisation and data order); sign p: exact two-sided sign "
             "test of those differences; spread p: Brown-Forsythe test of equal spread vs bf16 (normal approx.).", ""]
    for group, table in summary.items():
        lines += [f"## {group}", ""]
        lines += ["| variant | seeds | FP8 layers | " + " | ".join(label for _, label, _ in SHOWN) + " |",
                  "|---|---|---|" + "---|" * len(SHOWN)]
        for variant, row in table.items():
            cells = [_fmt_ci(row[k], 4 if k == "eval_loss" else 2) if k in row else "-" for k, _, _ in SHOWN]
            fp8 = ",".join(map(str, row["fp8_layers"]))
            if row["emulated_layers"] != [0]:
                fp8 += f" ({','.join(map(str, row['emulated_layers']))} with BF16 dW)"
            lines.append(f"| {variant} | {len(row['seeds'])} | {fp8} | " + " | ".join(cells) + " |")
        lines += ["", "Paired differences vs bf16 (variant minus bf16, per seed):", "",
                  "| variant | metric | mean diff | sd | 95% CI | sign p | wins/losses | spread (MAD bf16 -> var) | spread p "
                  "| seed correlation with bf16 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        base = {r["seed"]: r for r in runs if group_of(r) == group and r["variant"] == "bf16"}
        for variant, row in table.items():
            for key, label, factor in SHOWN:
                p = row.get(key + "_paired_vs_bf16")
                if not p:
                    continue
                s = row[key + "_spread_vs_bf16"]
                rs = [r for r in runs if group_of(r) == group and r["variant"] == variant and r["seed"] in base]
                wins = sum(factor * (r[key] - base[r["seed"]][key]) > 0 for r in rs)
                losses = sum(factor * (r[key] - base[r["seed"]][key]) < 0 for r in rs)
                d = 4 if key == "eval_loss" else 2
                lines.append(f"| {variant} | {label} | {p['mean']:+.{d}f} | {p['sd']:.{d}f} | {p['lo']:+.{d}f} to "
                             f"{p['hi']:+.{d}f} | {p['sign_test_p']:.3f} | {wins}/{losses} | "
                             f"{s['mean_abs_dev_a']:.{d}f} -> {s['mean_abs_dev_b']:.{d}f} | {s['p_normal_approx']:.3f} | "
                             f"{p['seed_correlation']:+.2f} |")
        n_epochs = min((len(row["per_epoch_eval_acc"]) for row in table.values() if "per_epoch_eval_acc" in row),
                       default=0)
        lines += ["", "Eval-mode accuracy at the end of each epoch (mean over seeds; the epoch-end snapshots of the second half "
                      "of training (epochs after the first n // 2): "
                      "how many fell below 90% / 80%):", "",
                  "| variant | " + " | ".join(f"epoch {i + 1}" for i in range(n_epochs)) + " | snapshots <90 / <80 |",
                  "|---|" + "---|" * (n_epochs + 1)]
        for variant, row in table.items():
            if "per_epoch_eval_acc" in row:
                sn = row["snapshots_second_half"]
                lines.append(f"| {variant} | " + " | ".join(f"{c['mean']:.1f}" for c in row["per_epoch_eval_acc"][:n_epochs])
                             + f" | {sn['below_90']} / {sn['below_80']} of {sn['n']} |")
        lines += ["", "Per seed, eval-mode accuracy (batch-statistics accuracy, re-estimated-BN accuracy):", "",
                  "| seed | " + " | ".join(table) + " |", "|---|" + "---|" * len(table)]
        seeds = sorted({s for row in table.values() for s in row["seeds"]})
        by = {(r["variant"], r["seed"]): r for r in runs if group_of(r) == group}
        for seed in seeds:
            cells = []
            for variant in table:
                r = by.get((variant, seed))
                if r is None:
                    cells.append("-")
                elif "batchstat_acc" in r:
                    cells.append(f"{100 * r['eval_acc']:.1f} ({100 * r['batchstat_acc']:.1f}, "
                                 f"{100 * r['reestimated_acc']:.1f})")
                else:
                    cells.append(f"{100 * r['eval_acc']:.1f}")
            lines.append(f"| {seed} | " + " | ".join(cells) + " |")
        times = ", ".join(f"{v} {row['mean_train_s']:.0f} s" for v, row in table.items())
        lines += ["", f"Mean fit time per run (shared machine): {times}. Skipped steps / rollbacks: "
                  + ", ".join(f"{v} {row['skipped_steps']}/{row['rollbacks']}" for v, row in table.items()), ""]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="resnet")
    p.add_argument("--schedule", choices=SCHEDULES, default="constant")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["bf16", "fp8-default"])
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 21)))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20, help="warmup steps of the cosine schedule")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4, help="ViT patch size")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lightning-val", action="store_true",
                   help="also run Lightning's validation loop on the test images after every epoch (as "
                        "examples/resnet_digits.py does), to check it leaves training unchanged")
    p.add_argument("--out", default="benchmarks/results/eval_quality_runs.jsonl")
    p.add_argument("--report", nargs="+", help="JSON-lines files to summarise (no training)")
    p.add_argument("--report-out", default="benchmarks/results/eval_quality_tables")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report:
        runs = load_runs(args.report)
        summary = summarize(runs)
        info = runs[0]["machine"] if runs else machine()
        with open(args.report_out + ".json", "w") as f:
            json.dump({"machine": info, "summary": summary}, f, indent=1)
        with open(args.report_out + ".md", "w") as f:
            f.write(markdown(runs, summary, info))
        print(markdown(runs, summary, info))
        return
    train, test = digits(args.image_size)
    config = config_of(args)
    done = {(r["variant"], r["seed"]) for r in load_runs([args.out]) if r["config"] == config}
    info = machine()
    for seed in args.seeds:
        for variant in args.variants:  # interleaved: each seed sees the machine in a similar state for each variant
            if (variant, seed) in done:
                continue
            run = train_once(args, variant, seed, train, test)
            run.update(config=config, machine={**info, "load_average_1min": os.getloadavg()[0]})
            with open(args.out, "a") as f:
                f.write(json.dumps(run) + "\n")
            print(json.dumps({k: v for k, v in run.items() if k not in ("epochs", "machine", "config")}), flush=True)


if __name__ == "__main__":
    main()
