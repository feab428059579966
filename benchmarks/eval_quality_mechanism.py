"""Why eval-mode accuracy differs after FP8 training (issue 43): per-step measurements inside the ResNet runs of
benchmarks/eval_quality.py (same model, data, optimizer, seeds, constant learning rate, real Trainer).

    python benchmarks/eval_quality_mechanism.py --variants bf16 fp8-default --seeds 1 2 \
        --out benchmarks/results/eval_quality_mechanism_runs.jsonl
    python benchmarks/eval_quality_mechanism.py --report benchmarks/results/eval_quality_mechanism_runs.jsonl

A callback records, in each run:
- every step: the loss, and per convolution (and the classifier) the relative weight update ||W_after - W_before|| /
  ||W_before|| of the optimizer step and ||W||;
- every `--probe-every` steps: the BatchNorm running-statistics lag on a fixed probe batch of training images: every
  BatchNorm layer's input statistics of that batch (the network in training mode for its BatchNorm layers, the FP8
  layers in eval mode so their scaling state is untouched, running buffers unchanged) against its running buffers,
  as the mean over channels of (running_mean - batch_mean)^2 / batch_var and of |log(running_var / batch_var)|;
  and the eval-mode test accuracy (360 images);
- every `--grad-every` steps, on a copy of the model at that step (same weights, FP8 scaling state and batch):
  the weight gradient of each FP8 convolution computed four ways: as FP8 training computes it (FP8 forward, E5M2
  gradients in both gradient GEMMs: `g8`), with the weight-gradient GEMM in BF16 (FP8 forward and input gradients:
  `gw`, see eval_quality.emulate_bf16_weight_grad), with the FP8 forward only (both gradient GEMMs in BF16: `gf`),
  and entirely in BF16 (`g16`): g8 - gw is the weight-gradient GEMM's share of the FP8 error, gw - gf the input-gradient
  GEMMs' (their quantized gradients reaching this layer), gf - g16 the forward's (other activations); plus `g16` on four other random
  training batches, whose spread estimates the minibatch noise of one gradient. Reported per layer: relative errors
  ||g8 - g16|| / ||g16|| and ||g8 - gw|| / ||g16|| (the weight-gradient GEMM's own share), the minibatch noise
  ||g16_b - mean_b|| / ||g16|| (root mean over batches), the sign agreement of g8 and g16 (all elements, and the elements
  whose |g16| is below 10% of AdamW's sqrt(v_hat)), and the errors in AdamW's units: RMS of (g8 - g16) / sqrt(v_hat)
  next to RMS of (g16_b - mean_b) / sqrt(v_hat) (v_hat: the optimizer's bias-corrected second moment at that step).
  In an FP8 run g8 is checked against the gradient the step really used.
- FP8 runs only: FP8ScaleMonitor (per_layer="full", every `--monitor-every` steps) writes the library's own
  quantization statistics (numerics/stats.py) of every cast to a history file, summarised per role: overflow
  (saturated) fraction, underflow (flushed to zero) fraction, SQNR.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
import eval_quality as EQ  # noqa: E402
from lightning_fp8.engine.batchnorm_stats import mean_shift  # noqa: E402

warnings.simplefilter("ignore")


#: the convolutions FP8Precision's default filter keeps in BF16 in this ResNet (3-channel stem; first and last
#: convertible ones): left out of a BF16 run's gradient comparison so both compare the same 17 layers
KEPT_IN_BF16 = ("resnet.embedder.embedder.convolution", "resnet.encoder.stages.0.layers.0.layer.0.convolution",
                "resnet.encoder.stages.3.layers.1.layer.1.convolution")


def _conv_params(model) -> Dict[str, torch.nn.Parameter]:
    """name -> weight of every convolution and the classifier's linear."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            out[name] = m.weight
    return out


def _bn_stats_hook(store: dict, name: str):
    def hook(module, args):
        x = args[0].float()
        store[name] = (x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False))
    return hook


def _loss_grads(model, x, y, fp8: bool, names: List[str]) -> Dict[str, torch.Tensor]:
    from lightning_fp8 import fp8_autocast

    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast(enabled=fp8):
        loss = F.cross_entropy(model(pixel_values=x).logits.float(), y)
    loss.backward()
    params = dict(model.named_parameters())
    return {n: params[n].grad.detach().float().clone() for n in names}


def _norm(t: torch.Tensor) -> float:
    return float(t.norm())


class Probe:
    """The measurements of one run (see the module docstring); `callback()` is the Lightning callback."""

    def __init__(self, args, variant: str, train, test, is_fp8: bool):
        self.args, self.variant, self.is_fp8 = args, variant, is_fp8
        g = torch.Generator().manual_seed(1234)
        idx = torch.randperm(len(train), generator=g)
        self.probe_x = train.tensors[0][idx[:args.probe_size]]
        self.train = train
        self.test_loader = DataLoader(test, batch_size=72)
        self.rng = torch.Generator().manual_seed(4321)
        self.steps: List[dict] = []
        self.probes: List[dict] = []
        self.grads: List[dict] = []
        self._before: Dict[str, torch.Tensor] = {}
        self._batch = None

    # -- helpers ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def bn_lag(self, pl_module, context) -> Dict[str, dict]:
        bns = {n: m for n, m in pl_module.model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
        store: dict = {}
        handles = [m.register_forward_pre_hook(_bn_stats_hook(store, n)) for n, m in bns.items()]
        saved = EQ._bn_buffers(pl_module)
        EQ._set_mode(pl_module, bn_train=True)
        for m in bns.values():
            m.momentum = 0.0
        with context():
            pl_module(self.probe_x)
        EQ._restore_bn(saved)
        for h in handles:
            h.remove()
        out = {}
        for n, m in bns.items():
            mean, var = store[n]
            rm, rv = m.running_mean.float(), m.running_var.float()
            out[n] = {"mean_shift": mean_shift(rm, mean, var, m.eps),
                      "log_var_ratio": float(((rv + m.eps) / (var + m.eps)).log().abs().mean())}
        return out

    def grad_comparison(self, trainer, pl_module, optimizer) -> dict:
        args = self.args
        x, y = self._batch
        names = {n + ".weight": n for n, m in pl_module.model.named_modules() if _is_fp8_conv(m) or
                 (not self.is_fp8 and isinstance(m, torch.nn.Conv2d) and n not in KEPT_IN_BF16)}
        real = {n: p.grad.detach().float().clone() for n, p in pl_module.model.named_parameters() if n in names}
        model = copy.deepcopy(pl_module.model)
        model.train()
        pnames = list(names)
        g8 = _loss_grads(model, x, y, True, pnames) if self.is_fp8 else None
        g16 = _loss_grads(model, x, y, False, pnames)
        gw = None
        if self.is_fp8:
            emul = copy.deepcopy(pl_module.model)
            emul.train()
            EQ.emulate_bf16_weight_grad(emul)
            gw = _loss_grads(emul, x, y, True, pnames)
            del emul
            fwd_only = copy.deepcopy(pl_module.model)
            fwd_only.train()
            EQ.emulate_bf16_weight_grad(fwd_only, forward_too=True)
            gf = _loss_grads(fwd_only, x, y, True, pnames)
            del fwd_only
        others = []
        for _ in range(args.noise_batches):
            idx = torch.randperm(len(self.train), generator=self.rng)[:args.batch_size]
            others.append(_loss_grads(model, self.train.tensors[0][idx], self.train.tensors[1][idx], False, pnames))
        del model
        params = dict(pl_module.model.named_parameters())
        beta1, beta2 = optimizer.param_groups[0]["betas"]
        eps = optimizer.param_groups[0]["eps"]
        out = {"step": trainer.global_step, "layers": {}}
        trained = g8 if self.is_fp8 else g16
        for n in pnames:
            state = optimizer.state.get(params[n], {})
            if "exp_avg_sq" not in state:
                continue
            t = float(state["step"]) + 1  # the step about to be taken
            vhat = (beta2 * state["exp_avg_sq"].float() + (1 - beta2) * real[n] ** 2) / (1 - beta2 ** t)
            denom = vhat.sqrt() + eps
            ref = g16[n]
            batch = [o[n] for o in others] + [ref]
            mean_b = torch.stack(batch).mean(0)
            noise_sq = torch.stack([(b - mean_b) ** 2 for b in batch]).sum(0) / (len(batch) - 1)  # per-element var
            small = ref.abs() < 0.1 * denom
            row = {
                "real_vs_recomputed": _norm(real[n] - trained[n]) / max(_norm(real[n]), 1e-30),
                "g16_norm": _norm(ref),
                "minibatch_noise_rel": math.sqrt(float(noise_sq.sum())) / max(_norm(ref), 1e-30),
                "minibatch_noise_adam_rms": float((noise_sq / denom ** 2).mean().sqrt()),
                "g16_adam_rms": float(((ref / denom) ** 2).mean().sqrt()),
                "small_fraction": float(small.float().mean()),
            }
            if self.is_fp8:
                e8 = g8[n] - ref
                row.update({
                    "fp8_err_rel": _norm(e8) / max(_norm(ref), 1e-30),
                    "wgrad_gemm_err_rel": _norm(g8[n] - gw[n]) / max(_norm(ref), 1e-30),
                    "dgrad_gemms_err_rel": _norm(gw[n] - gf[n]) / max(_norm(ref), 1e-30),
                    "forward_err_rel": _norm(gf[n] - ref) / max(_norm(ref), 1e-30),
                    "fp8_err_adam_rms": float(((e8 / denom) ** 2).mean().sqrt()),
                    "wgrad_gemm_err_adam_rms": float((((g8[n] - gw[n]) / denom) ** 2).mean().sqrt()),
                    "sign_agree": float((torch.sign(g8[n]) == torch.sign(ref)).float().mean()),
                    "sign_agree_small": float((torch.sign(g8[n][small]) == torch.sign(ref[small])).float().mean())
                    if bool(small.any()) else float("nan"),
                    "zero_in_fp8": float((g8[n] == 0).float().mean()),
                    "zero_in_bf16": float((ref == 0).float().mean()),
                })
            out["layers"][names[n]] = row
        return out

    # -- the callback --------------------------------------------------------------------------------------------
    def callback(self):
        from lightning.pytorch.callbacks import Callback

        probe = self

        class _Callback(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                probe._batch = batch
                step = trainer.global_step
                if step % probe.args.probe_every == 0:
                    context = trainer.precision_plugin.forward_context
                    lag = probe.bn_lag(pl_module, context)
                    EQ._set_mode(pl_module, bn_train=False)
                    acc = EQ.evaluate(pl_module, probe.test_loader, context)
                    pl_module.train()
                    probe.probes.append({"step": step, "bn": lag, "eval_acc": acc["acc"], "eval_loss": acc["loss"]})

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                step = trainer.global_step
                probe._before = {n: p.detach().clone() for n, p in _conv_params(pl_module.model).items()}
                if step % probe.args.grad_every == probe.args.grad_every - 1:
                    probe.grads.append(probe.grad_comparison(trainer, pl_module, optimizer))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                now = _conv_params(pl_module.model)
                rel = {n: _norm(now[n].detach() - w) / max(_norm(w), 1e-30) for n, w in probe._before.items()}
                probe.steps.append({"step": trainer.global_step, "loss": float(outputs["loss"]),
                                    "rel_update": rel, "w_norm": {n: _norm(w) for n, w in now.items()}})

        return _Callback()


def _is_fp8_conv(m) -> bool:
    from lightning_fp8.modules.conv import FP8ConvNd

    return isinstance(m, FP8ConvNd) and m.fp8_enabled


def monitor_summary(path: str) -> dict:
    """Per role: mean and max over logged steps and layers of the overflow and underflow fractions, mean SQNR."""
    per_role: Dict[str, Dict[str, List[float]]] = {}
    per_layer: Dict[str, Dict[str, List[float]]] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") != "stats":
                continue
            for layer, roles in rec["layers"].items():
                for role, st in roles.items():
                    if not isinstance(st, dict):
                        continue
                    d = per_role.setdefault(role, {"overflow": [], "underflow": [], "sqnr_db": []})
                    for k in d:
                        v = st.get(k)
                        if isinstance(v, (int, float)) and math.isfinite(v):
                            d[k].append(float(v))
                    if role == "grad_output":
                        dl = per_layer.setdefault(layer, {"underflow": [], "overflow": [], "sqnr_db": []})
                        for k in dl:
                            v = st.get(k)
                            if isinstance(v, (int, float)) and math.isfinite(v):
                                dl[k].append(float(v))
    summ = {role: {k + "_mean": (statistics.mean(v) if v else float("nan")) for k, v in d.items()}
            for role, d in per_role.items()}
    for role, d in per_role.items():
        summ[role].update({k + "_max": (max(v) if v else float("nan")) for k, v in d.items()})
    summ["grad_output_per_layer"] = {layer: {k: statistics.mean(v) if v else float("nan") for k, v in d.items()}
                                     for layer, d in per_layer.items()}
    return summ


def run_once(args, variant: str, seed: int, train, test) -> dict:
    import lightning as L

    from lightning_fp8 import FP8Precision
    from lightning_fp8.callbacks import FP8ScaleMonitor

    L.seed_everything(seed, verbose=False)
    module = EQ.make_module(args, seed, variant)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    module.total_steps = args.epochs * len(loader)
    module.train_losses = []
    recipe = EQ.recipe_of(variant)
    probe = Probe(args, variant, train, test, recipe is not None)
    callbacks = [probe.callback()]
    history = None
    if recipe is not None:
        history = tempfile.mktemp(suffix=".jsonl", prefix=f"eqm_{variant}_{seed}_")
        callbacks.append(FP8ScaleMonitor(log_every_n_steps=args.monitor_every, per_layer="none",
                                         history_file=history))
    precision = {"precision": "bf16-mixed"} if recipe is None else {"plugins": [FP8Precision(recipe=recipe)]}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=callbacks, **precision)
    start = time.perf_counter()
    trainer.fit(module, loader)
    result = {"variant": variant, "seed": seed, "train_s": time.perf_counter() - start,
              "steps": probe.steps, "probes": probe.probes, "grads": probe.grads}
    EQ._set_mode(module, bn_train=False)
    result["final_eval"] = EQ.evaluate(module, probe.test_loader, trainer.precision_plugin.forward_context)
    if history is not None and os.path.exists(history):
        result["monitor"] = monitor_summary(history)
        os.remove(history)
    return result


# -- report -------------------------------------------------------------------------------------------------------
def _opt(value: float) -> str:
    """A mean that runs recorded before its field existed leave NaN: shown as "-" (not recorded)."""
    return "-" if math.isnan(value) else f"{value:.4f}"


def _mean(v: List[float]) -> float:
    v = [x for x in v if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.mean(v) if v else float("nan")


def _pearson(a: List[float], b: List[float]) -> float:
    if len(a) < 3:
        return float("nan")
    ma, mb = statistics.mean(a), statistics.mean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def _ci(v: List[float]) -> str:
    v = [x for x in v if math.isfinite(x)]
    if len(v) < 2:
        return f"{_mean(v):.4g}"
    c = EQ.mean_ci(v)
    return f"{c['mean']:.4g} ({c['lo']:.4g} to {c['hi']:.4g})"


def report(runs: List[dict], out: str, machine: dict) -> str:
    variants = [v for v in EQ.VARIANTS if any(r["variant"] == v for r in runs)]
    by = {v: [r for r in runs if r["variant"] == v] for v in variants}
    seeds = {v: sorted(r["seed"] for r in by[v]) for v in variants}
    lines = ["# Eval-mode quality after FP8 training: mechanism measurements", "",
             f"Written by `python benchmarks/eval_quality_mechanism.py --report` (setup: its docstring). Machine: "
             f"{machine.get('cpu')}, BF16 hardware: {machine.get('bf16_hardware')}; ResNet-18, digits, AdamW lr 2e-3 "
             "constant, batch 64, 5 epochs (110 steps). Seeds: " +
             "; ".join(f"{v} {seeds[v]}" for v in variants) + ". CI: 95% over seeds.", ""]
    summary: Dict[str, dict] = {}
    # 1. relative updates and weight norms
    lines += ["## Relative weight update per step, ||dW|| / ||W|| (mean over the run's steps, per seed; then over seeds)",
              "", "| variant | all convs, steps 1-22 | all convs, steps 23-110 | classifier, steps 23-110 | ||W|| growth "
              "(last/first, convs) | eval acc at step-probes, steps >= 66: mean, sd within run, min |",
              "|---|---|---|---|---|---|"]
    for v in variants:
        early, late, head, growth, acc_mean, acc_sd, acc_min = [], [], [], [], [], [], []
        for r in by[v]:
            convs = [n for n in r["steps"][0]["rel_update"] if n != "classifier.1"]
            early.append(_mean([s["rel_update"][n] for s in r["steps"][:22] for n in convs]))
            late.append(_mean([s["rel_update"][n] for s in r["steps"][22:] for n in convs]))
            head.append(_mean([s["rel_update"].get("classifier.1", float("nan")) for s in r["steps"][22:]]))
            growth.append(_mean([r["steps"][-1]["w_norm"][n] / r["steps"][0]["w_norm"][n] for n in convs]))
            late_acc = [100 * p["eval_acc"] for p in r["probes"] if p["step"] >= 66]
            acc_mean.append(_mean(late_acc))
            acc_sd.append(statistics.stdev(late_acc) if len(late_acc) > 1 else float("nan"))
            acc_min.append(min(late_acc) if late_acc else float("nan"))
        summary.setdefault(v, {}).update(rel_update_early=early, rel_update_late=late, head_late=head,
                                         w_growth=growth, late_probe_acc_mean=acc_mean, late_probe_acc_sd=acc_sd,
                                         late_probe_acc_min=acc_min)
        lines.append(f"| {v} | {_ci(early)} | {_ci(late)} | {_ci(head)} | {_ci(growth)} | {_mean(acc_mean):.1f}, "
                     f"{_mean(acc_sd):.1f}, {_mean(acc_min):.1f} |")
    # per layer relative update ratio FP8 / BF16 (late)
    if "bf16" in by:
        lines += ["", "Per layer, steps 23-110: mean relative update, variant / bf16 (same seeds):", "",
                  "| layer | " + " | ".join(v for v in variants if v != "bf16") + " |",
                  "|---|" + "---|" * (len(variants) - 1)]
        layers = list(by["bf16"][0]["steps"][0]["rel_update"])
        for n in layers:
            base = _mean([s["rel_update"][n] for r in by["bf16"] for s in r["steps"][22:]])
            cells = [f"{_mean([s['rel_update'][n] for r in by[v] for s in r['steps'][22:]]) / base:.3f}"
                     for v in variants if v != "bf16"]
            lines.append(f"| {n.replace('resnet.encoder.', '')} | " + " | ".join(cells) + " |")
    # 2. BN lag
    lines += ["", "## BatchNorm running-statistics lag on a fixed probe batch",
              "", "Mean over BN layers of mean over channels of (running_mean - batch_mean)^2 / batch_var "
              "(|log(running_var / batch_var)| in brackets), averaged over probes in the step range and over seeds:",
              "", "| variant | steps 0-21 | steps 22-65 | steps 66-109 | worst probe (steps >= 22), mean over seeds |",
              "|---|---|---|---|---|"]
    for v in variants:
        cells = []
        for lo, hi in ((0, 22), (22, 66), (66, 110)):
            ms = [_mean([_mean([b["mean_shift"] for b in p["bn"].values()]) for p in r["probes"]
                         if lo <= p["step"] < hi]) for r in by[v]]
            lv = [_mean([_mean([b["log_var_ratio"] for b in p["bn"].values()]) for p in r["probes"]
                         if lo <= p["step"] < hi]) for r in by[v]]
            cells.append(f"{_mean(ms):.3f} [{_mean(lv):.3f}]")
            summary[v][f"bn_mean_shift_{lo}_{hi}"] = ms
            summary[v][f"bn_log_var_{lo}_{hi}"] = lv
        worst = [max((_mean([b["mean_shift"] for b in p["bn"].values()]) for p in r["probes"] if p["step"] >= 22),
                     default=float("nan")) for r in by[v]]
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {_mean(worst):.3f} |")
    lines += ["", "Does the lag explain the eval-mode dips? Over the probes from step 44 on (epochs 3-5, accuracy on its "
              "plateau), per run: Pearson correlation "
              "of the eval-mode test accuracy with log(mean shift); and at the run's worst eval-mode probe, its mean "
              "shift relative to the run's median (mean over seeds):", "",
              "| variant | correlation (mean over seeds) | per seed | worst probe's shift / median shift |",
              "|---|---|---|---|"]
    for v in variants:
        rs, ratios = [], []
        for r in by[v]:
            ps = [p for p in r["probes"] if p["step"] >= 44]
            acc = [p["eval_acc"] for p in ps]
            shift = [math.log(_mean([b["mean_shift"] for b in p["bn"].values()])) for p in ps]
            rs.append(_pearson(acc, shift))
            worst = min(range(len(ps)), key=lambda i: acc[i])
            ratios.append(math.exp(shift[worst]) / statistics.median(math.exp(x) for x in shift))
        summary[v]["acc_vs_log_shift_r"] = rs
        summary[v]["worst_probe_shift_ratio"] = ratios
        lines.append(f"| {v} | {_mean(rs):+.2f} | {', '.join(f'{x:+.2f}' for x in rs)} | {_mean(ratios):.1f} |")
    if "bf16" in by:
        lines += ["", "Per BN layer, steps 22-109, mean shift (variant / bf16):", "",
                  "| BN layer | bf16 | " + " | ".join(v for v in variants if v != "bf16") + " |",
                  "|---|---|" + "---|" * (len(variants) - 1)]
        for n in by["bf16"][0]["probes"][0]["bn"]:
            base = _mean([p["bn"][n]["mean_shift"] for r in by["bf16"] for p in r["probes"] if p["step"] >= 22])
            cells = [f"{_mean([p['bn'][n]['mean_shift'] for r in by[v] for p in r['probes'] if p['step'] >= 22]) / base:.2f}"
                     for v in variants if v != "bf16"]
            lines.append(f"| {n.replace('resnet.encoder.', '')} | {base:.3f} | " + " | ".join(cells) + " |")
    # 3. gradient comparison
    lines += ["", "## FP8 vs BF16 weight gradients on the same weights and batch",
              "", "Averaged over FP8 convolutions, comparison steps and seeds. Relative errors are norms relative to "
              "||g16||; 'Adam units' divides element-wise by AdamW's sqrt(v_hat) and takes the RMS (1.0 = a full-size "
              "AdamW step for a lone gradient).", "",
              "| variant | ||g8-g16|| | wgrad GEMM's share ||g8-gw|| | dgrad GEMMs' ||gw-gf|| | forward's ||gf-g16|| | "
              "minibatch noise | in Adam units: FP8 error | wgrad GEMM error | minibatch noise | g16 | sign agreement "
              "(all / small |g|) | zeros in g8 / g16 | recomputed = real |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        rows = [row for r in by[v] for g in r["grads"] for row in g["layers"].values()]
        if not rows:
            continue
        f = lambda k: _mean([row.get(k, float("nan")) for row in rows])  # noqa: E731
        summary[v]["grads"] = {k: f(k) for k in set().union(*rows)}
        if "fp8_err_rel" in rows[0]:
            lines.append(f"| {v} | {f('fp8_err_rel'):.4f} | {f('wgrad_gemm_err_rel'):.4f} | "
                         f"{_opt(f('dgrad_gemms_err_rel'))} | {_opt(f('forward_err_rel'))} | {f('minibatch_noise_rel'):.3f} | "
                         f"{f('fp8_err_adam_rms'):.4f} | "
                         f"{f('wgrad_gemm_err_adam_rms'):.4f} | {f('minibatch_noise_adam_rms'):.3f} | "
                         f"{f('g16_adam_rms'):.3f} | {f('sign_agree'):.4f} / {f('sign_agree_small'):.4f} | "
                         f"{f('zero_in_fp8'):.2e} / {f('zero_in_bf16'):.2e} | "
                         f"max {max(row['real_vs_recomputed'] for row in rows):.1e} |")
        else:
            lines.append(f"| {v} | - | - | - | - | {f('minibatch_noise_rel'):.3f} | - | - | {f('minibatch_noise_adam_rms'):.3f} | "
                         f"{f('g16_adam_rms'):.3f} | - | - / {f('zero_in_bf16'):.2e} | "
                         f"max {max(row['real_vs_recomputed'] for row in rows):.1e} |")
    fp8v = [v for v in variants if v != "bf16" and any(r["grads"] and "fp8_err_rel" in
                                                       next(iter(r["grads"][0]["layers"].values())) for r in by[v])]
    if fp8v:
        v = fp8v[0]
        lines += ["", f"Per layer ({v}): FP8 error / wgrad-GEMM error / minibatch noise, relative to ||g16||; the "
                      "FP8 error in Adam units; sign agreement on small-gradient elements:", "",
                  "| layer | FP8 err | wgrad GEMM err | minibatch noise | FP8 err, Adam units | sign agree small |",
                  "|---|---|---|---|---|---|"]
        for n in by[v][0]["grads"][0]["layers"]:
            rows = [g["layers"][n] for r in by[v] for g in r["grads"] if n in g["layers"]]
            f = lambda k: _mean([row[k] for row in rows])  # noqa: E731
            lines.append(f"| {n.replace('resnet.encoder.', '')} | {f('fp8_err_rel'):.4f} | "
                         f"{f('wgrad_gemm_err_rel'):.4f} | {f('minibatch_noise_rel'):.3f} | "
                         f"{f('fp8_err_adam_rms'):.4f} | {f('sign_agree_small'):.3f} |")
    # 4. cast statistics
    lines += ["", "## Quantization statistics of the casts (FP8ScaleMonitor, lightning_fp8/numerics/stats.py)", "",
              "Mean (max) over logged steps and FP8 layers: overflow = fraction saturated, underflow = fraction of the "
              "non-zero elements flushed to zero; SQNR in dB.", "",
              "| variant | role | overflow mean (max) | underflow mean (max) | SQNR mean (min over the run: see max "
              "column of the worst) |", "|---|---|---|---|---|"]
    for v in variants:
        mons = [r["monitor"] for r in by[v] if r.get("monitor")]
        if not mons:
            continue
        for role in ("input", "weight", "grad_output"):
            ms = [m[role] for m in mons if role in m]
            if not ms:
                continue
            lines.append(f"| {v} | {role} | {_mean([m['overflow_mean'] for m in ms]):.2e} "
                         f"({max(m['overflow_max'] for m in ms):.2e}) | {_mean([m['underflow_mean'] for m in ms]):.2e} "
                         f"({max(m['underflow_max'] for m in ms):.2e}) | {_mean([m['sqnr_db_mean'] for m in ms]):.1f} |")
        summary[v]["monitor"] = {role: {k: _mean([m[role][k] for m in mons if role in m])
                                        for k in mons[0].get(role, {})} for role in ("input", "weight", "grad_output")}
    text = "\n".join(lines) + "\n"
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump({"machine": machine, "summary": summary}, f, indent=1)
    return text


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=EQ.VARIANTS, default=["bf16", "fp8-default"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--probe-size", type=int, default=128)
    p.add_argument("--probe-every", type=int, default=4)
    p.add_argument("--grad-every", type=int, default=10)
    p.add_argument("--noise-batches", type=int, default=4)
    p.add_argument("--monitor-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/eval_quality_mechanism_runs.jsonl")
    p.add_argument("--report", nargs="+")
    p.add_argument("--report-out", default="benchmarks/results/eval_quality_mechanism")
    args = p.parse_args(argv)
    args.model, args.schedule = "resnet", "constant"
    torch.set_num_threads(args.threads)
    if args.report:
        runs = EQ.load_runs(args.report)
        print(report(runs, args.report_out, runs[0].get("machine", {}) if runs else {}))
        return
    train, test = EQ.digits(args.image_size)
    done = {(r["variant"], r["seed"]) for r in EQ.load_runs([args.out])}
    info = EQ.machine()
    for seed in args.seeds:
        for variant in args.variants:
            if (variant, seed) in done:
                continue
            run = run_once(args, variant, seed, train, test)
            run["machine"] = info
            with open(args.out, "a") as f:
                f.write(json.dumps(run) + "\n")
            print(json.dumps({"variant": variant, "seed": seed, "train_s": run["train_s"],
                              "final_eval": run["final_eval"]}), flush=True)


if __name__ == "__main__":
    main()
