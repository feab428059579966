"""Mixture-of-experts in FP8: the grouped GEMMs' accuracy, a Qwen3-30B-A3B MoE layer step's kernels and the roofline
model's prediction for it, and a small Mixtral trained in FP8 beside bf16-mixed.

    python benchmarks/moe.py [--seeds 0 1 2] [--steps 200] [--schedule constant] [--out benchmarks/results/moe]

1. SQNR (CPU): the three grouped GEMMs of an experts projection (forward, input gradient, weight gradient) against
   float32, with 16 experts routed unevenly (one empty), and the same data through one dense rowwise FP8 layer per
   expert.
2. Kernels and roofline (no GPU: meta tensors under a simulated sm90 with the Triton casts, kernels/trace.py): one
   training step of each projection of a Qwen3-30B-A3B MoE layer (128 experts, top-8, hidden 2048, expert intermediate
   768, 16384 tokens: 131072 routed rows), FP8 grouped against the BF16 grouped GEMMs (torch._grouped_mm) the same
   layer runs with FP8 off; seconds per step priced by lightning_fp8/conversion/roofline.py on H100 SXM and B200
   (B200 with the sm90 kernel structure: torch runs the grouped FP8 kernel on sm100 from 2.14, modules/scaled_mm.py).
   The routing (sort, gathers, the weighted sum) is the same in both and left out.
3. Training (CPU): a Mixtral of 2 layers, hidden 64, 4 experts, top-2, expert intermediate 64, on the text of
   CPython's standard library (the demo's corpus, characters), batch 8 x 64, AdamW lr 3e-3 with 20 warmup steps and
   cosine decay to zero (`--schedule constant`: the same warmup, then held), under a real Lightning Trainer:
   FP8Precision() vs precision="bf16-mixed", the same initialisation and data order per seed; validation loss in eval
   mode without gradients on a fixed held-out set (docs/measuring.md), beside the training losses (every 10th step and
   the mean of the last 20).
The machine (bench_io.machine(): CPU, threads, BF16 hardware or not) heads the result.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
warnings.simplefilter("ignore")

from lightning_fp8 import FP8Linear, FP8Recipe  # noqa: E402
from bench_io import SCHEDULES, hold_after_warmup, machine, write_results  # noqa: E402


# -- 1. SQNR ------------------------------------------------------------------------------------------------------------
def sqnr() -> dict:
    from lightning_fp8.modules.cast import caster_for
    from lightning_fp8.modules.linear_gemms import GemmConfig, linear_gemms

    recipe = FP8Recipe(format="e4m3", scaling="rowwise")
    g = torch.Generator().manual_seed(0)
    experts, n, k = 16, 512, 256
    counts = torch.randint(32, 400, (experts,), generator=g)
    counts[3] = 0
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), k, generator=g)
    weight = torch.randn(experts, n, k, generator=g) / k**0.5
    upstream = torch.randn(x.shape[0], n, generator=g)

    def grouped():
        xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
        history = torch.zeros(3, 17)
        caster = caster_for(recipe, offsets)
        y = linear_gemms(xg, wg, None, caster.cast(xg, history, "input", True, layouts=(True, True)),
                         caster.cast(wg, history, "weight", True), history, None,
                         GemmConfig(recipe, torch.float32, True), offsets=offsets)
        y.backward(upstream)
        return y.detach(), xg.grad, wg.grad

    def per_expert(fp8: bool):
        ys, dxs, dws, start = [], [], [], 0
        for e, count in enumerate(counts.tolist()):
            rows = x[start:start + count].clone().requires_grad_()
            w = weight[e].clone().requires_grad_()
            if fp8:
                layer = FP8Linear(k, n, bias=False, recipe=recipe)
                layer.weight = torch.nn.Parameter(w)
                y = layer(rows)
                w = layer.weight
            else:
                y = rows @ w.t()
            y.backward(upstream[start:start + count])
            ys.append(y.detach())
            dxs.append(rows.grad)
            dws.append(w.grad)
            start += count
        return torch.cat(ys), torch.cat(dxs), torch.stack(dws)

    def db(ref, approx):
        return float(20 * torch.log10(ref.norm() / (ref - approx).norm()))

    exact, fp8_grouped, fp8_dense = per_expert(False), grouped(), per_expert(True)
    return {"experts": experts, "shape": [int(counts.sum()), k, n], "counts": counts.tolist(),
            "grouped_db": {role: db(e, a) for role, e, a in zip(("forward", "dgrad", "wgrad"), exact, fp8_grouped)},
            "dense_db": {role: db(e, a) for role, e, a in zip(("forward", "dgrad", "wgrad"), exact, fp8_dense)}}


# -- 2. kernels and roofline --------------------------------------------------------------------------------------------
QWEN3_30B_A3B = dict(experts=128, top_k=8, hidden=2048, intermediate=768, tokens=16384)


def layer_kernels() -> dict:
    from torch import nn

    from lightning_fp8.conversion.roofline import step_seconds
    from lightning_fp8.conversion.shape_filter import GPU_SPECS
    from lightning_fp8.kernels.device import simulate_cuda
    from lightning_fp8.kernels.trace import record_launches
    from lightning_fp8.modules.grouped_linear import ExpertsLayout, FP8GroupedLinear, Projection, grouped_recipe

    s = QWEN3_30B_A3B
    e, h, i, rows = s["experts"], s["hidden"], s["intermediate"], s["tokens"] * s["top_k"]

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device="meta", dtype=torch.bfloat16))
            self.down_proj = nn.Parameter(torch.empty(e, h, i, device="meta", dtype=torch.bfloat16))

    module = Experts()
    layout = ExpertsLayout(e, (Projection("gate_up_proj", None, "gate_up"), Projection("down_proj", None, "down")),
                           False, s["top_k"], "Qwen3MoeExperts")
    recipe, _ = grouped_recipe(FP8Recipe())
    specs = {name: spec for name, spec in GPU_SPECS if name in ("H100", "B200")}
    result = {"shape": s, "projections": {}}
    for projection, in_features in zip(layout.projections, (h, i)):
        steps = {}
        for fp8 in (True, False):
            with simulate_cuda((9, 0), triton=True):
                layer = FP8GroupedLinear(module, layout, projection, recipe)
                layer.closes_own_steps = False  # under the engine: no close_step in the forward
                layer.fp8_enabled = fp8
                x = torch.empty(rows, in_features, device="meta", dtype=torch.bfloat16, requires_grad=True)
                offsets = torch.empty(e, device="meta", dtype=torch.int32)
                with torch.autocast("cpu", dtype=torch.bfloat16), record_launches() as forward:
                    y = layer(x, offsets)
                grad = torch.empty_like(y)
                with record_launches() as backward:
                    y.backward(grad)
            launches = list(forward) + list(backward)
            steps["fp8" if fp8 else "bf16"] = {
                "launches": len(launches), "forward": len(forward), "backward": len(backward),
                "gemms": [launch.name for launch in launches if launch.is_gemm],
                "seconds": {name: step_seconds(launches, spec) for name, spec in specs.items()},
                "gemm_seconds": {name: step_seconds([l for l in launches if l.is_gemm], spec)
                                 for name, spec in specs.items()},
            }
        result["projections"][projection.parameter] = steps
    for name in specs:
        fp8 = sum(p["fp8"]["seconds"][name] for p in result["projections"].values())
        bf16 = sum(p["bf16"]["seconds"][name] for p in result["projections"].values())
        fp8_gemms = sum(p["fp8"]["gemm_seconds"][name] for p in result["projections"].values())
        result.setdefault("layer", {})[name] = {"fp8_s": fp8, "bf16_s": bf16, "speedup": bf16 / fp8,
                                                "fp8_gemms_only_speedup": bf16 / fp8_gemms}
    return result


# -- 3. training --------------------------------------------------------------------------------------------------------
def training(seeds, steps: int, schedule_name: str = "cosine") -> dict:
    import lightning as L
    import transformers

    from lightning_fp8 import FP8Precision
    from lightning_fp8.demo.data import batches, fixed_val_batches, load_corpus

    torch.set_num_threads(max(1, torch.get_num_threads()))
    corpus = load_corpus(max_chars=2_000_000)
    vocab = -(-corpus.vocab_size // 16) * 16
    config = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    val = fixed_val_batches(corpus.val, 8, 64, 8)

    class Module(L.LightningModule):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.model = transformers.MixtralForCausalLM(config)
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.model(input_ids=x).logits.float().flatten(0, 1), y.flatten())
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
            warm = 20

            def schedule(step):
                return (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))

            if schedule_name == "constant":
                schedule = hold_after_warmup(schedule, warm)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"}]

    def evaluate(module, fp8):
        module.eval()
        total = 0.0
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for x, y in val:
                logits = module.model(input_ids=x).logits.float()
                total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
        return total / len(val)

    runs = {}
    for seed in seeds:
        data = list(batches(corpus.train, 8, 64, steps, seed))
        for variant in ("bf16-mixed", "fp8"):
            module = Module(seed)
            kwargs = dict(plugins=[FP8Precision()]) if variant == "fp8" else dict(precision="bf16-mixed")
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                **kwargs)
            start = time.perf_counter()
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
            seconds = time.perf_counter() - start
            runs.setdefault(variant, []).append({"seed": seed, "val_loss": evaluate(module, variant == "fp8"),
                                                 "train_losses": module.losses[::10],
                                                 "train_loss_last20": statistics.mean(module.losses[-20:]),
                                                 "seconds": seconds})
            print(variant, seed, runs[variant][-1]["val_loss"], f"{seconds:.0f} s", flush=True)
    summary = {}
    for variant, rs in runs.items():
        values = [r["val_loss"] for r in rs]
        summary[variant] = {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}
    gaps = [f["val_loss"] - b["val_loss"] for f, b in zip(runs["fp8"], runs["bf16-mixed"])]
    summary["paired_gap"] = {"mean": statistics.mean(gaps), "sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
                             "relative": statistics.mean(gaps) / summary["bf16-mixed"]["mean"]}
    return {"config": {"hidden": 64, "layers": 2, "experts": 4, "top_k": 2, "steps": steps, "batch": [8, 64],
                       "lr": 3e-3, "schedule": "20 warmup, " + ("then constant" if schedule_name == "constant" else "cosine to 0")},
            "runs": runs, "summary": summary}


# -- report -------------------------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Mixture-of-experts in FP8 ({m['date']}, {m['cpu']}, BF16 hardware: {m['bf16_hardware']}, torch "
             f"{m['torch']}, load {m['load_average_1min_at_start']:.1f})", "",
             "Written by `python benchmarks/moe.py` (see its docstring for the setup).", ""]
    s = result["sqnr"]
    lines += ["## 1. SQNR of the grouped GEMMs against float32 (dB)", "",
              f"{s['experts']} experts, routed rows per expert {s['counts']} (one empty), K {s['shape'][1]}, N "
              f"{s['shape'][2]}; rowwise e4m3.", "", "| GEMM | grouped FP8 | one dense rowwise FP8 layer per expert |",
              "|---|---|---|"]
    for role in ("forward", "dgrad", "wgrad"):
        lines.append(f"| {role} | {s['grouped_db'][role]:.2f} | {s['dense_db'][role]:.2f} |")
    k = result["kernels"]
    shape = k["shape"]
    lines += ["", "## 2. A Qwen3-30B-A3B MoE layer step: kernels and the roofline model (a model, not a measurement)",
              "", f"{shape['experts']} experts, top-{shape['top_k']}, hidden {shape['hidden']}, expert intermediate "
              f"{shape['intermediate']}, {shape['tokens']} tokens; simulated sm90 with the Triton casts, routing left out.",
              "", "| projection | FP8 kernels (fwd + bwd) | BF16 kernels | FP8 GEMMs | H100 FP8 / BF16 ms | B200 FP8 / BF16 ms |",
              "|---|---|---|---|---|---|"]
    for name, p in k["projections"].items():
        f, b = p["fp8"], p["bf16"]
        lines.append(f"| {name} | {f['launches']} ({f['forward']} + {f['backward']}) | {b['launches']} | "
                     f"{', '.join(f['gemms'])} | {f['seconds']['H100'] * 1e3:.2f} / {b['seconds']['H100'] * 1e3:.2f} | "
                     f"{f['seconds']['B200'] * 1e3:.2f} / {b['seconds']['B200'] * 1e3:.2f} |")
    for gpu, v in k["layer"].items():
        lines.append(f"\n{gpu}: the layer's two projections {v['bf16_s'] * 1e3:.2f} ms in BF16, {v['fp8_s'] * 1e3:.2f} "
                     f"ms in FP8: **{v['speedup']:.2f}x**; the FP8 GEMMs alone against BF16's step "
                     f"{v['fp8_gemms_only_speedup']:.2f}x (what fused grouped casts would approach).")
    t = result.get("training")
    if t:
        c = t["config"]
        lines += ["", "## 3. A small Mixtral trained in FP8 beside bf16-mixed (CPU)", "",
                  f"{c['layers']} layers, hidden {c['hidden']}, {c['experts']} experts top-{c['top_k']}, {c['steps']} "
                  f"steps of {c['batch'][0]} x {c['batch'][1]} characters, AdamW lr {c['lr']} ({c['schedule']}); "
                  "validation loss in eval mode on a fixed held-out set.", "",
                  "| seed | bf16-mixed val loss | FP8 val loss | FP8 - bf16 | bf16 / FP8 train loss (last 20) | bf16 s | "
                  "FP8 s |", "|---|---|---|---|---|---|---|"]
        for b, f in zip(t["runs"]["bf16-mixed"], t["runs"]["fp8"]):
            train = " / ".join(f"{r['train_loss_last20']:.4f}" if "train_loss_last20" in r else "-" for r in (b, f))
            lines.append(f"| {b['seed']} | {b['val_loss']:.4f} | {f['val_loss']:.4f} | {f['val_loss'] - b['val_loss']:+.4f} "
                         f"| {train} | {b['seconds']:.0f} | {f['seconds']:.0f} |")
        su = t["summary"]
        lines += ["", f"- bf16-mixed: mean {su['bf16-mixed']['mean']:.4f} (sd {su['bf16-mixed']['sd']:.4f}); FP8: mean "
                      f"{su['fp8']['mean']:.4f} (sd {su['fp8']['sd']:.4f})",
                  f"- paired gap FP8 - bf16: {su['paired_gap']['mean']:+.4f} (sd {su['paired_gap']['sd']:.4f}; "
                  f"{su['paired_gap']['relative'] * 100:+.2f}% of bf16's loss)",
                  "- times are wall-clock on a shared CPU: the FP8 GEMMs are emulated here (numbers, not speed)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                        help="training: cosine, warmup then decay to zero (default); constant: the same warmup, then held")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "moe"))
    args = parser.parse_args()
    result = {"machine": machine(), "sqnr": sqnr(), "kernels": layer_kernels()}
    if not args.skip_training:
        result["training"] = training(args.seeds, args.steps, args.schedule)
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
