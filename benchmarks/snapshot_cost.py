"""Cost of rollback snapshots vs model size (issue 12, item 8; issue 22, defect 9): host bytes and allocations, ms per
snapshot, % of step time at the default interval (snapshot_every=50).

Per model size (the demo GPT, lightning_fp8.demo.gpt, converted to FP8, AdamW with its state created):

- bytes: bytes of state one snapshot holds (parameters, persistent buffers with the FP8 metadata, optimizer state),
  and the host bytes its buffers take (one flat buffer per dtype: alignment padding, whole pages);
- allocations: host allocations of one snapshot, this implementation (one per dtype) and the previous one (one per
  tensor, reproduced below as `PerTensorSnapshot`);
- pinned on CUDA: what the state would page-lock on a GPU: the flat buffers' bytes (registered in place), and the
  previous per-tensor buffers through torch's pinned allocator, which rounds each request up to a power of two
  (computed from the tensors' sizes with that rule; no GPU needed);
- step ms: median time of one training iteration (forward, backward, engine decision, AdamW step);
- snapshot ms, interleaved with the previous implementation so machine drift hits both:
    first: the first capture of a fresh snapshot, which allocates the host buffers (median over the repeats);
    capture: time of `Snapshot.capture` itself. On CPU the copies are synchronous: this is the whole cost.
    loop (CUDA): the extra time one snapshot adds to the training loop: two iterations with a capture at the first
             one's close and the fence before the second one's optimizer step, minus two iterations without (median
             of the pairs). On CUDA `capture` only issues the copies; `loop` is the number that matters, since the
             copies overlap the next forward and backward;
- % of step at the default interval: snapshot ms (loop on CUDA, capture on CPU) / (50 x step ms).

Clocks: on CPU, process CPU time with one torch thread (`time.process_time`: other processes on a shared machine do
not inflate it; the FP8 GEMMs are emulated, so a CPU step is slow and few steps are timed); on CUDA, wall time with
`torch.cuda.synchronize` around what is timed.

    python benchmarks/snapshot_cost.py                       # CPU, sizes up to ~85M parameters
    python benchmarks/snapshot_cost.py --device cuda         # GPU sizes up to ~1.2B (writes snapshot_cost_<gpu>.*)
    python benchmarks/snapshot_cost.py --sizes tiny,small --repeats 3

Writes benchmarks/results/snapshot_cost[_<gpu>].json (rows + machine) and .md (the table).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from lightning_fp8 import FP8Recipe, convert_to_fp8
from lightning_fp8.demo.gpt import GPT, GPTConfig
from lightning_fp8.engine import FP8TrainingEngine, StabilityConfig
from lightning_fp8.engine.snapshot import Snapshot, pinned_for, plan_host_buffers

# name -> (d_model, n_layers, n_heads); vocab 256, context 128
SIZES = {
    "tiny": (128, 2, 4),
    "small": (256, 4, 4),
    "medium": (512, 8, 8),
    "large": (768, 12, 12),
    "xl": (1536, 24, 16),
    "1b": (2048, 24, 16),
}
DEFAULT_SIZES = {"cpu": "tiny,small,medium,large", "cuda": "medium,large,xl,1b"}
INTERVAL = 50
GPU_NOTE = (
    "- What decides the GPU number (not measured here): the copies must be done before the next optimizer step, so "
    "a snapshot costs about max(0, copy time - the next iteration's forward and backward) plus the host time to "
    "issue them, once per 50 iterations; copy time is the bytes column over the device-to-host bandwidth into pinned "
    "memory. The `loop` column of a `--device cuda` run measures exactly that."
)


class PerTensorSnapshot(Snapshot):
    """The snapshot before issue 22 (lightning_fp8/engine/snapshot.py at 9b26792) for the comparison: one host
    allocation per tensor (`torch.empty(..., pin_memory=True)` on CUDA), reused while its shape and dtype stay; the
    copies, fences and restores are the same code."""

    def _prepare_buffers(self, part, sources):
        if part == "capture":
            wanted = {key for key, _ in sources}
            self._host = {key: t for key, t in self._host.items() if key in wanted}
            self._specs = {key: spec for key, spec in self._specs.items() if key in wanted}
        for key, src in sources:
            host = self._host.get(key)
            if host is None or host.shape != src.shape or host.dtype != src.dtype:
                self._host[key] = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pinned_for(src.device))


def power_of_two_bytes(nbytes):
    """What torch's pinned allocator (the caching host allocator behind pin_memory=True, torch 2.13 defaults) takes
    for a request of `nbytes`: the next power of two."""
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


def llama_7b_accounting():
    """Host bytes of a LLaMA-7B AdamW snapshot on one rank, from the shapes alone (meta tensors)."""
    d, ffn, vocab, layers = 4096, 11008, 32000, 32
    shapes = [(vocab, d), (vocab, d), (d,)] + [(d, d)] * 4 * layers + [(ffn, d), (d, ffn), (ffn, d)] * layers
    shapes += [(d,)] * 2 * layers
    state = [(("p", i, name), torch.empty(s, device="meta")) for i, s in enumerate(shapes) for name in "pmv"]
    state_bytes = sum(t.numel() * t.element_size() for _, t in state)
    return {
        "tensors": len(state), "state_bytes": state_bytes,
        "flat_registered_bytes": sum(plan.host_bytes for plan in plan_host_buffers(state)),
        "per_tensor_pinned_bytes": sum(power_of_two_bytes(t.numel() * t.element_size()) for _, t in state),
        "flat_through_pinned_allocator_bytes": power_of_two_bytes(state_bytes),
    }


def allocations(snapshot):
    return len({t.untyped_storage().data_ptr() for t in snapshot._host.values()})


def cpu_model():
    """The CPU's model name (lscpu's "Model name"), for the table's title."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(size, device, batch, context=128):
    d, layers, heads = SIZES[size]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, context=context, d_model=d, n_layers=layers, n_heads=heads)).to(device)
    convert_to_fp8(model, FP8Recipe())
    engine = FP8TrainingEngine(FP8Recipe(), StabilityConfig(snapshot_every=10**9))  # snapshots taken by hand below
    engine.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, 256, (batch, context + 1), device=device)

    def forward_backward():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        engine.scale_loss(loss).backward()

    def step():
        engine.step(optimizer, optimizer.step)

    forward_backward()
    step()  # AdamW state exists from here on
    return model, optimizer, forward_backward, step


def measure(size, device, batch, repeats, step_repeats):
    model, optimizer, forward_backward, step = build(size, device, batch)
    params = sum(p.numel() for p in model.parameters())
    kinds = {"flat": Snapshot, "per_tensor": PerTensorSnapshot}
    timer = time.perf_counter if device.type == "cuda" else time.process_time

    first = {name: [] for name in kinds}
    for i in range(repeats):  # a fresh snapshot's first capture allocates its host buffers; alternate who goes first
        for name in sorted(kinds, reverse=bool(i % 2)):
            fresh = kinds[name]()
            sync(device)
            t0 = timer()
            fresh.capture(0, model, [optimizer], [], {})
            sync(device)
            first[name].append((timer() - t0) * 1e3)
            del fresh
            gc.collect()
    snapshots = {name: kind() for name, kind in kinds.items()}
    captures = {name: (lambda snap=snap: snap.capture(0, model, [optimizer], [], {})) for name, snap in snapshots.items()}
    for capture in captures.values():
        capture()

    def iteration():
        forward_backward()
        step()

    def timed(fn):
        sync(device)
        t = timer()
        fn()
        sync(device)
        return (timer() - t) * 1e3

    def pair(capture, snapshot):
        def run():
            iteration()  # its close takes the snapshot (capture), the next iteration's step waits on the copies
            if capture is not None:
                capture()
            forward_backward()
            if snapshot is not None:
                snapshot.fence()
            step()
        return run

    iteration()  # warm-up
    steps = [timed(iteration) for _ in range(step_repeats)]
    issue = {name: [] for name in snapshots}
    loops = {"none": [], **{name: [] for name in snapshots}}
    for _ in range(repeats):
        for name, capture in captures.items():
            sync(device)
            t = timer()
            capture()
            issue[name].append((timer() - t) * 1e3)
            sync(device)
        if device.type == "cuda":
            loops["none"].append(timed(pair(None, None)))
            for name, capture in captures.items():
                loops[name].append(timed(pair(capture, snapshots[name])))
    step_ms = statistics.median(steps + [x / 2 for x in loops["none"]])
    flat, per_tensor = snapshots["flat"], snapshots["per_tensor"]
    row = {
        "size": size, "config": dict(zip(("d_model", "n_layers", "n_heads"), SIZES[size])), "parameters": params,
        "batch_tokens": batch * 128, "snapshot_bytes": flat.nbytes, "host_bytes": flat.host_bytes,
        "allocations": {"flat": allocations(flat), "per_tensor": allocations(per_tensor)},
        "pinned_on_cuda_bytes": {
            "flat": flat.host_bytes,
            "per_tensor": sum(power_of_two_bytes(t.numel() * t.element_size()) for t in per_tensor._host.values()),
        },
        "step_ms": step_ms,
    }
    base = statistics.median(loops["none"]) if loops["none"] else None
    for name in snapshots:
        capture_ms = statistics.median(issue[name])
        loop_ms = max(0.0, statistics.median(loops[name]) - base) if base is not None else None
        row[f"{name}_first_capture_ms"] = statistics.median(first[name])
        row[f"{name}_capture_ms"] = capture_ms
        row[f"{name}_loop_ms"] = loop_ms
        row[f"{name}_pct_of_step_at_50"] = 100.0 * (capture_ms if loop_ms is None else loop_ms) / (INTERVAL * step_ms)
    row["repeats"], row["step_repeats"] = repeats, step_repeats
    row["raw"] = {"step_ms": steps, "first_capture_ms": first, "capture_ms": issue, "pair_ms": loops}
    del model, optimizer, snapshots, flat, per_tensor
    return row


def gib(n):
    return f"{n / 2**30:.3f}"


def to_markdown(meta, rows):
    lines = [
        f"# Rollback snapshot cost ({meta['device_name']})",
        "",
        f"Written by `python benchmarks/snapshot_cost.py{' --device cuda' if meta['device'] == 'cuda' else ''}`. "
        f"torch {meta['torch']}, {meta['machine']}; demo GPT (vocab 256, context 128, batch {rows[0]['batch_tokens']} "
        f"tokens), FP8 default recipe, AdamW. Snapshot times: medians of {rows[0]['repeats']} interleaved repeats; "
        f"step: median of {rows[0]['step_repeats']} after a warm-up. Clock: {meta['clock']}. **flat**: this "
        "implementation (one host buffer per dtype); **per tensor**: the previous one (one host buffer per tensor), "
        "same process, interleaved.",
        "",
        "| model | parameters | state (GiB) | host allocations: flat / per tensor | pinned on CUDA (GiB): flat / per tensor | step ms | first capture ms: flat / per tensor | capture ms: flat / per tensor | loop ms: flat / per tensor | % of step at snapshot_every=50: flat / per tensor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}"
    for r in rows:
        c = r["config"]
        lines.append(
            f"| {r['size']} (d {c['d_model']}, {c['n_layers']} layers) | {r['parameters'] / 1e6:.1f}M | "
            f"{gib(r['snapshot_bytes'])} | {r['allocations']['flat']} / {r['allocations']['per_tensor']} | "
            f"{gib(r['pinned_on_cuda_bytes']['flat'])} / {gib(r['pinned_on_cuda_bytes']['per_tensor'])} | "
            f"{r['step_ms']:.0f} | {r['flat_first_capture_ms']:.1f} / {r['per_tensor_first_capture_ms']:.1f} | "
            f"{r['flat_capture_ms']:.1f} / {r['per_tensor_capture_ms']:.1f} | "
            f"{fmt(r['flat_loop_ms'])} / {fmt(r['per_tensor_loop_ms'])} | "
            f"{r['flat_pct_of_step_at_50']:.4f} / {r['per_tensor_pct_of_step_at_50']:.4f} |"
        )
    lines += ["", *meta["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default=None, help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--batch", type=int, default=None, help="sequences of 128 tokens per step (cpu 4, cuda 16)")
    parser.add_argument("--repeats", type=int, default=5, help="snapshot timings (and CUDA loop pairs) per size")
    parser.add_argument("--step-repeats", type=int, default=None, help="timed training steps (cpu 2, cuda 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (process CPU time is the clock)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    device = torch.device(args.device)
    sizes = (args.sizes or DEFAULT_SIZES[args.device]).split(",")
    batch = args.batch or (4 if args.device == "cpu" else 16)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_model()}"
    load_before = os.getloadavg()
    rows = []
    for size in sizes:
        row = measure(size, device, batch, args.repeats, args.step_repeats or (2 if device.type == "cpu" else 10))
        print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    load_after = os.getloadavg()
    llama = llama_7b_accounting()
    notes = [
        "- **state**: parameters + persistent buffers (FP8 metadata included) + AdamW state, on this process: about 3x "
        "the fp32 parameter bytes (sharded state: this rank's shards only). The flat buffers take "
        + ", ".join(f"{r['size']} {r['host_bytes'] - r['snapshot_bytes']} bytes" for r in rows)
        + " more (64-byte alignment of each tensor, whole pages).",
        "- **pinned on CUDA**: flat: the buffers' bytes, page-locked in place (cudaHostRegister); per tensor: each "
        "tensor's buffer through torch's pinned allocator, which rounds every request up to a power of two (computed "
        "from the sizes with that rule, not measured on a GPU). LLaMA-7B (shapes only, "
        f"{llama['tensors']} float32 tensors: parameters and AdamW moments; the step counters are a few bytes): state "
        f"{gib(llama['state_bytes'])} GiB per rank; per tensor through the pinned allocator "
        f"{gib(llama['per_tensor_pinned_bytes'])} GiB; one flat buffer through it would take "
        f"{gib(llama['flat_through_pinned_allocator_bytes'])} GiB; flat and registered (this implementation) "
        f"{gib(llama['flat_registered_bytes'])} GiB. The memory check counts that times the ranks on the node: "
        f"{gib(8 * llama['flat_registered_bytes'])} GiB for 8 ranks (LOCAL_WORLD_SIZE=8).",
        "- **first capture**: the first capture of a fresh snapshot, which allocates the host buffers (and on CUDA "
        "pins them); median over the repeats, each of which frees the previous one's buffers. A flat buffer is one "
        "large request, served with fresh pages that fault on first touch every time; the per-tensor buffers are "
        "many smaller requests, which the host allocator partly serves from memory the previous repeat freed ("
        + "; ".join(f"{r['size']} per tensor: " + ", ".join(f"{x:.0f}" for x in r["raw"]["first_capture_ms"]["per_tensor"])
                    + " ms" for r in rows)
        + "). A run's first snapshot gets fresh pages either way; on a GPU pinning them dominates (not measured "
        "here). **capture**: time of a later `Snapshot.capture`, into the reused buffers: the same memcpys, plus, "
        "for flat, planning the buffers in Python (a few microseconds per tensor) to find the tensors unchanged. "
        "**loop** (CUDA): extra wall time one snapshot adds to two training iterations (capture at the first one's "
        "close, the second one's optimizer step fenced on the copies), vs two iterations without.",
    ]
    if device.type == "cpu":
        notes += [
            f"- CPU: copies are synchronous memcpys into the reused buffers. {os.cpu_count()} cores, torch threads "
            f"{torch.get_num_threads()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after: other "
            "processes shared the machine, hence process CPU time as the clock (memory bandwidth is still shared: the "
            "flat/per-tensor ratio, measured interleaved, is the robust number).",
            "- **Unverified on GPU**: the asynchronous path (buffers page-locked in place, side-stream copies "
            "overlapping the next forward and backward, the optimizer step fenced on an event) and the <= 1% target "
            "for a model that fills the GPU need a GPU run: `python benchmarks/snapshot_cost.py --device cuda` (sizes "
            "up to ~1.2B parameters; writes snapshot_cost_<gpu>.json/.md). On CPU the step is slow (FP8 is emulated), "
            "which makes the % here small for a reason that does not carry over to a GPU; the bytes columns do carry "
            "over.",
            GPU_NOTE,
        ]
    else:
        notes += [f"- {torch.cuda.get_device_name(device)}; host buffers page-locked, copies on a side stream."]
    meta = {
        "device": device.type, "device_name": device_name, "torch": torch.__version__,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
        "threads": torch.get_num_threads(), "loadavg_before": load_before, "loadavg_after": load_after,
        "interval": INTERVAL, "notes": notes, "llama_7b": llama,
        "clock": "wall time, synchronised" if device.type == "cuda" else "process CPU time, 1 torch thread",
    }
    suffix = "" if device.type == "cpu" else "_" + re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"snapshot_cost{suffix}.json")
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(out[: -len(".json")] + ".md", "w") as f:
        f.write(to_markdown(meta, rows))
    print(to_markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
