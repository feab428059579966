"""Memory the FP8 gradient communication allocates, per gradient element: the DDP comm hook (fp8_comm_hook) and the
FSDP2 reduce-scatter (FP8ReduceScatter), measured on CPU.

One process, a fake process group of W ranks (torch's "fake" backend: collectives return at once and move nothing,
so the buffers the code allocates for them are still allocated, and the futures' callbacks run in this thread);
`lightning_fp8.distributed.comm_bytes.peak_allocated_bytes` records the peak of the CPU allocator's running total
while one call runs to completion (the bucket's or the unit's gradient buffer itself exists before and is not
counted). Reported: peak bytes / N, N the elements of the bucket (DDP) or of the unit's whole gradient buffer (FSDP2,
W shards). That includes the uint8 buffers the collectives need (sent, received), not only float32 temporaries.

Bucket layout (DDP, `scaling="per_tensor"`): transformer blocks of width d, each 12 d^2 + 13 d elements in 12 tensors
(qkv, proj, LayerNorms, MLP and their biases); d = 512 with 2 blocks is 6.3 M elements, about DDP's default 25 MiB
bucket of float32 gradients.

    python benchmarks/comm_memory.py --label before --replaced   # the code the chunking replaced
    python benchmarks/comm_memory.py --label after                # this checkout's

writes <out>_<label>.json (default out: benchmarks/results/comm_memory), and <out>.md from <out>_before.json and
<out>_after.json once both exist. "before": the code of commit eb0bc48 (a float32 scale per element, the received
buffer decoded to float32 at once), run from its verbatim copy in tests/workers/comm_parity_worker.py (`--replaced`; the
same peaks as eb0bc48's own modules gave, measured first). Also counted: the aten operators one call dispatches
(views excluded), each a kernel launch on a GPU or close to one: the price of the chunking.
"""
import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fp8.distributed.comm_bytes import peak_allocated_bytes
from lightning_fp8.distributed.comm_hook import FP8CommState, fp8_comm_hook
from lightning_fp8.distributed import fp8_reduce
from lightning_fp8.distributed.reduce_scatter import FP8ReduceScatter

RESULTS = Path(__file__).resolve().parent / "results"
#: the code the chunking replaced (commit eb0bc48), kept verbatim in tests/workers/comm_parity_worker.py (--replaced)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
import comm_parity_worker as REPLACED  # noqa: E402


class FakeBucket:
    """What fp8_comm_hook reads of a `dist.GradBucket`: the flat buffer and the gradients as views of it."""

    def __init__(self, numels, dtype) -> None:
        self._buffer = torch.randn(sum(numels), dtype=dtype) * 1e-3
        self._grads, start = [], 0
        for n in numels:
            self._grads.append(self._buffer[start:start + n])
            start += n

    def buffer(self):
        return self._buffer

    def gradients(self):
        return list(self._grads)


def block_numels(d: int, blocks: int):
    one = [3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d]
    return one * blocks


def init_fake(world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


class OpCount(TorchDispatchMode):
    """aten operators dispatched (views excluded): each is a kernel launch on a GPU, or close to one."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _hook_call(algorithm: str, bucket: FakeBucket, replaced: bool):
    state = FP8CommState(algorithm=algorithm)
    if replaced:
        return lambda: REPLACED._old_hook(state, bucket.buffer(), bucket.gradients())
    return lambda: fp8_comm_hook(state, bucket).wait()


def _reduce_scatter_call(out, inp, replaced: bool):
    if replaced:
        return lambda: REPLACED._old_reduce_scatter(FP8CommState(), out, inp, dist.group.WORLD, dist.ReduceOp.AVG)
    return lambda: FP8ReduceScatter()(out, inp, dist.group.WORLD, dist.ReduceOp.AVG)


def _measure(call) -> tuple:
    peak, _ = peak_allocated_bytes(call)
    with OpCount() as counter:
        call()
    return peak, counter.ops


def measure_hook(world: int, d: int, blocks: int, algorithm: str, dtype, replaced: bool = False) -> dict:
    numels = block_numels(d, blocks)
    peak, ops = _measure(_hook_call(algorithm, FakeBucket(numels, dtype), replaced))
    n = sum(numels)
    return dict(path=f"ddp_hook/{algorithm}", world=world, dtype=str(dtype).replace("torch.", ""), numel=n,
                tensors=len(numels), peak_bytes=peak, bytes_per_element=peak / n, aten_ops=ops)


def measure_reduce_scatter(world: int, n: int, dtype, replaced: bool = False) -> dict:
    n = n // world * world
    inp = torch.randn(n, dtype=dtype) * 1e-3
    out = torch.empty(n // world, dtype=dtype)
    peak, ops = _measure(_reduce_scatter_call(out, inp, replaced))
    return dict(path="fsdp2_reduce_scatter", world=world, dtype=str(dtype).replace("torch.", ""), numel=n, tensors=1,
                peak_bytes=peak, bytes_per_element=peak / n, aten_ops=ops)


def needed(row: dict) -> int:
    """The uint8 bytes the algorithm's collectives need (see the module docstring of comm_hook.py)."""
    n, w = row["numel"], row["world"]
    if row["path"] == "ddp_hook/all_gather":
        return (1 + w) * n
    if row["path"] == "ddp_hook/all_to_all":
        return 2 * w * math.ceil(n / w)
    return 2 * n


def write_markdown(out: str) -> None:
    before = json.loads(Path(f"{out}_before.json").read_text())
    after = json.loads(Path(f"{out}_after.json").read_text())
    lines = [
        "# Memory of the FP8 gradient communication, per gradient element (CPU, measured)",
        "",
        "`python benchmarks/comm_memory.py --label before|after` (module docstring: method and bucket layout). Peak of",
        "what one call allocates (profiler allocation events on the CPU allocator, torch's fake process group, one",
        "process), divided by N, the elements of the DDP bucket or of the FSDP2 unit's whole gradient buffer. "
        "\"needed\": the",
        "uint8 buffers the collectives need (all_gather: (1 + W) N; all_to_all: 2 W ceil(N/W); reduce-scatter: 2N);",
        "\"beyond\": the rest, in MiB. DDP buckets use `scaling=\"per_tensor\"`, 12 tensors per block.",
        "",
        "before: the code of commit eb0bc48, run from its verbatim copy in tests/workers/comm_parity_worker.py (`--replaced`;",
        "eb0bc48's own modules, measured first, gave the same 36 peaks to the byte); aten ops: operators dispatched per",
        "call, views excluded (a kernel launch each on a GPU, or close to one).",
        "",
        f"before: measured {before['meta']['date']}; after: commit {after['meta']['commit']} "
        f"({after['meta']['date']}); torch {after['meta']['torch']}. Float32 and BF16 gradients gave the same numbers "
        "(BF16 rows in the JSON files).",
        "",
        "| path | W | N | before, B/element | after, B/element | needed, B/element | beyond needed, MiB: before | after | aten ops: before | after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, a in zip(before["rows"], after["rows"]):
        assert all(b[k] == a[k] for k in ("path", "world", "dtype", "numel"))
        if a["dtype"] != "float32":
            continue
        n = a["numel"]
        lines.append(f"| {a['path']} | {a['world']} | {n / 1e6:.1f} M | {b['bytes_per_element']:.2f} | "
                     f"{a['bytes_per_element']:.2f} | {needed(a) / n:.2f} | {(b['peak_bytes'] - needed(b)) / 2**20:.1f} | "
                     f"{(a['peak_bytes'] - needed(a)) / 2**20:.1f} | {b.get('aten_ops', '-')} | {a.get('aten_ops', '-')} |")
    worst = max((a["peak_bytes"] - needed(a)) / 2**20 for a in after["rows"])
    was = [(b["peak_bytes"] - needed(b)) / b["numel"] for b in before["rows"]]
    chunk_log2 = fp8_reduce.CHUNK.bit_length() - 1
    lines += ["", f"After: at most {worst:.1f} MiB beyond the needed buffers, whatever N (CHUNK = 2^{chunk_log2} "
              f"elements); before: {min(was):.0f} to {max(was):.0f} bytes per element beyond them.", ""]
    Path(f"{out}.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default=str(RESULTS / "comm_memory"))
    parser.add_argument("--markdown-only", action="store_true", help="rewrite <out>.md from the JSON files")
    parser.add_argument("--replaced", action="store_true",
                        help="measure the replaced code (tests/workers/comm_parity_worker.py's copy of eb0bc48) instead")
    args = parser.parse_args()
    if args.markdown_only:
        write_markdown(args.out)
        return
    torch.set_num_threads(2)
    rows = []
    for world in (2, 8):
        init_fake(world)
        for dtype in (torch.float32, torch.bfloat16):
            for d, blocks in ((256, 2), (512, 2), (512, 4)):
                for algorithm in ("all_gather", "all_to_all"):
                    rows.append(measure_hook(world, d, blocks, algorithm, dtype, args.replaced))
                    print(json.dumps(rows[-1]), flush=True)
                rows.append(measure_reduce_scatter(world, sum(block_numels(d, blocks)), dtype, args.replaced))
                print(json.dumps(rows[-1]), flush=True)
    dist.destroy_process_group()
    here = Path(__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "lightning_fp8"], cwd=here).returncode:
        commit += "+uncommitted changes"
    meta = dict(label=args.label, commit=commit, code="replaced (eb0bc48, tests/workers/comm_parity_worker.py)" if args.replaced
                else "this checkout", torch=torch.__version__, platform=platform.platform(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                method="peak_allocated_bytes (profiler allocation events, CPU allocator), fake process group")
    Path(f"{args.out}_{args.label}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    if Path(f"{args.out}_before.json").exists() and Path(f"{args.out}_after.json").exists():
        write_markdown(args.out)


if __name__ == "__main__":
    main()
