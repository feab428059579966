"""Bytes each collective moves per training step, counted (lightning_fp8.distributed.CommBytes), for a GPT-like model
under DDP and FSDP2 with BF16 and FP8 communication. 2 CPU ranks (gloo); the counts do not depend on the backend.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 benchmarks/distributed_bytes.py \\
        [--d-model 512 --layers 8 --context 64 --vocab 256] [--out benchmarks/results/distributed_bytes]

Variants (same converted model, one forward + backward counted after a warm-up step, so DDP's buckets are final):
  ddp_fp32       DDP's default all-reduce (the gradients' dtype: float32), for reference
  ddp_bf16       DDP with a BF16 all-reduce hook (torch's bf16_compress_hook refuses CPU, so an equivalent one)
  ddp_fp8        DDP with lightning_fp8's fp8_comm_hook (what gradient_communication="fp8" registers)
  fsdp2_bf16     fully_shard per block + root, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
  fsdp2_fp8_ag   the same with FP8 all-gather of the FP8 layers' weights (fp8_all_gather=True)
  fsdp2_fp8_all  FP8 all-gather and the FP8 reduce-scatter (gradient_communication="fp8")
The model is converted with the default filter (first and last linear layers, embeddings, LayerNorms and biases
stay BF16), so the totals include everything a real run moves.

(No `from __future__ import annotations`: DDP checks a comm hook's annotations by value.)
"""
import argparse
import copy
import datetime
import json
import platform
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from lightning_fp8 import convert_to_fp8
from lightning_fp8.conversion.convert import fp8_layers
from lightning_fp8.demo.gpt import GPT, GPTConfig
from lightning_fp8.integrations.plugin_core import exclude_fp8_meta_from_ddp_broadcast
from lightning_fp8.distributed import (CommBytes, FP8CommState, bf16_comm_hook, enable_fp8_all_gather, enable_fp8_reduce_scatter,
                                       fp8_comm_hook)
from lightning_fp8.modules.autocast import fp8_autocast



def step(model, x, y) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    for p in model.parameters():
        p.grad = None


def build(base, variant: str):
    model = copy.deepcopy(base)
    if variant.startswith("ddp"):
        exclude_fp8_meta_from_ddp_broadcast(model)  # as every adapter does: the engine keeps FP8 state in agreement
        ddp = DistributedDataParallel(model)
        if variant == "ddp_bf16":
            ddp.register_comm_hook(None, bf16_comm_hook)
        elif variant == "ddp_fp8":
            ddp.register_comm_hook(FP8CommState(), fp8_comm_hook)
        return ddp
    if variant != "fsdp2_bf16":
        enable_fp8_all_gather(model)
    reduce_dtype = torch.float32 if variant == "fsdp2_fp8_all" else torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if variant == "fsdp2_fp8_all":
        enable_fp8_reduce_scatter(model)
    return model


GATHER = ("_allgather_base_",)
AMAX = ("allreduce_",)
REDUCE = ("_reduce_scatter_base_", "alltoall_base_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/distributed_bytes")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cfg = GPTConfig(vocab_size=args.vocab, context=args.context, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
        torch.manual_seed(0)
        base = convert_to_fp8(GPT(cfg), verbose=False)
        layers = fp8_layers(base)
        fp8_weight_numel = sum(layer.weight.numel() for layer in layers.values())
        total_numel = sum(p.numel() for p in base.parameters())
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, args.vocab, (args.batch_size, args.context + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]
        tables = {}
        for variant in ("ddp_fp32", "ddp_bf16", "ddp_fp8", "fsdp2_bf16", "fsdp2_fp8_ag", "fsdp2_fp8_all"):
            model = build(base, variant)
            step(model, x, y)  # warm-up: DDP rebuilds its buckets after the first backward
            with CommBytes() as counter:
                step(model, x, y)
            tables[variant] = counter
            dist.barrier()
        if rank == 0:
            write(args, cfg, world, tables, fp8_weight_numel, total_numel, len(layers))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def write(args, cfg, world, tables, fp8_weight_numel, total_numel, n_fp8_layers) -> None:
    t = tables
    bus = {name: c.total("bus_bytes") for name, c in t.items()}
    gather = {name: t[name].total("bus_bytes", ops=GATHER) for name in ("fsdp2_bf16", "fsdp2_fp8_ag", "fsdp2_fp8_all")}
    amax = {name: t[name].total("bus_bytes", ops=AMAX) for name in ("fsdp2_fp8_ag", "fsdp2_fp8_all")}
    reduce = {name: t[name].total("bus_bytes", ops=REDUCE) for name in ("fsdp2_bf16", "fsdp2_fp8_ag", "fsdp2_fp8_all")}
    # the FP8 layers' weights alone: each all-gather call of a block moves its weights once; FP8 all-gather sends
    # 1 byte per element instead of 2 and adds one 4-byte MAX all-reduce per FP8 layer and forward (counted)
    calls = t["fsdp2_bf16"].records[("_allgather_base_", "bfloat16")]["calls"]
    assert calls == 1 + 2 * cfg.n_layers, calls  # the root once, each block in forward and again in backward
    weight_bf16 = 2 * (2 * fp8_weight_numel * (world - 1) / world)  # 2 bytes, 2 gathers of every FP8 layer's weight
    weight_fp8 = weight_bf16 / 2 + amax["fsdp2_fp8_ag"]
    summary = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} CPU, gloo, {world} ranks (byte counts do not depend on the backend)",
        "model": {"d_model": cfg.d_model, "layers": cfg.n_layers, "context": cfg.context, "vocab": cfg.vocab_size,
                  "parameters": total_numel, "fp8_layers": n_fp8_layers, "fp8_weight_elements": fp8_weight_numel,
                  "fp8_weight_share": fp8_weight_numel / total_numel},
        "bus_bytes_per_rank_per_step": bus,
        "ratios": {
            "ddp_fp8_vs_ddp_bf16": bus["ddp_fp8"] / bus["ddp_bf16"],
            "ddp_fp8_vs_ddp_fp32": bus["ddp_fp8"] / bus["ddp_fp32"],
            "fsdp2_all_gather_fp8_vs_bf16": (gather["fsdp2_fp8_ag"] + amax["fsdp2_fp8_ag"]) / gather["fsdp2_bf16"],
            "fsdp2_all_gather_weights_only_fp8_vs_bf16": weight_fp8 / weight_bf16,
            "fsdp2_reduce_scatter_fp8_vs_bf16": (reduce["fsdp2_fp8_all"] + amax["fsdp2_fp8_all"] - amax["fsdp2_fp8_ag"]) / reduce["fsdp2_bf16"],
            "fsdp2_step_fp8_all_vs_bf16": bus["fsdp2_fp8_all"] / bus["fsdp2_bf16"],
        },
        "all_gather_calls_per_step": calls,
        "tables": {name: {f"{op} {dtype}": value for (op, dtype), value in c.table().items()} for name, c in t.items()},
    }
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    r = summary["ratios"]
    with open(args.out + ".md", "w") as f:
        f.write(f"# Bytes per training step by collective ({summary['date']}, torch {summary['torch']}, {summary['machine']})\n\n")
        f.write("Counted by `lightning_fp8.distributed.CommBytes` (a TorchDispatchMode on the c10d ops) on rank 0, one "
                "forward + backward after a warm-up step. Bus bytes: what a rank sends with the bandwidth-optimal "
                "algorithm (all-reduce 2(W-1)/W x buffer, all-gather (W-1) x input, reduce-scatter and all-to-all "
                "(W-1)/W x input). Produced by `benchmarks/distributed_bytes.py`.\n\n")
        m = summary["model"]
        f.write(f"Model: GPT, d_model {m['d_model']}, {m['layers']} layers, context {m['context']}, vocab {m['vocab']}: "
                f"{m['parameters']:,} parameters, {m['fp8_layers']} FP8 layers holding {m['fp8_weight_share']:.1%} of "
                "them (default conversion: the first and last linear layers, embeddings, LayerNorms and biases stay "
                "BF16).\n\n")
        f.write("| variant | collective | dtype | calls | payload bytes | bus bytes |\n|---|---|---|---|---|---|\n")
        for name, c in t.items():
            for (op, dtype), v in c.table().items():
                f.write(f"| {name} | {op} | {dtype} | {v['calls']} | {v['bytes']:,} | {v['bus_bytes']:,.0f} |\n")
        f.write("\n| comparison | ratio |\n|---|---|\n")
        f.write(f"| DDP: FP8 comm hook vs BF16 all-reduce (amax all-reduce included) | {r['ddp_fp8_vs_ddp_bf16']:.3f} |\n")
        f.write(f"| DDP: FP8 comm hook vs the default float32 all-reduce | {r['ddp_fp8_vs_ddp_fp32']:.3f} |\n")
        f.write(f"| FSDP2 all-gather: FP8 vs BF16, whole model (amax all-reduces included) | {r['fsdp2_all_gather_fp8_vs_bf16']:.3f} |\n")
        f.write(f"| FSDP2 all-gather: FP8 layers' weights only (amax all-reduces included) | {r['fsdp2_all_gather_weights_only_fp8_vs_bf16']:.3f} |\n")
        f.write(f"| FSDP2 gradient reduction: FP8 reduce-scatter vs BF16 (amax all-reduces included) | {r['fsdp2_reduce_scatter_fp8_vs_bf16']:.3f} |\n")
        f.write(f"| FSDP2 whole step: FP8 all-gather + FP8 reduce-scatter vs BF16 | {r['fsdp2_step_fp8_all_vs_bf16']:.3f} |\n")
    print(open(args.out + ".md").read())


if __name__ == "__main__":
    main()
