"""The FP8 comm hook and reduce-scatter against the code they replaced (the unchunked one of commit eb0bc48: a float32
scale per element, the whole received buffer decoded to float32 at once), on W gloo ranks, bit for bit.

    python tests/workers/comm_parity_worker.py OUT W

Each rank runs both versions on the same per-rank gradients (random, several tensors of sizes that are not multiples
of torch's vector widths, magnitudes over many binades; cases with an inf or a NaN on the last rank) with the
chunk made small (`fp8_reduce.CHUNK`), so that a buffer spans many blocks and a block boundary falls inside tensors,
and writes OUT/rank<r>.pt: {case: (old bits, new bits)}. tests/test_comm_memory.py compares them.
"""
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`
from support.process_group import process_group_ended  # noqa: E402
from support.torchrun_launch import launch_forked  # noqa: E402

from lightning_fp8.distributed import fp8_reduce  # noqa: E402
from lightning_fp8.distributed.comm_hook import FP8CommState, fp8_comm_hook  # noqa: E402
from lightning_fp8.distributed.fp8_reduce import local_amaxes, shared_scales  # noqa: E402
from lightning_fp8.distributed.reduce_scatter import FP8ReduceScatter  # noqa: E402
from lightning_fp8.numerics.formats import get_format  # noqa: E402
from lightning_fp8.numerics.quantize import quantize  # noqa: E402

# ---- the replaced code, verbatim but for names (lightning_fp8/distributed/{fp8_reduce,comm_hook,reduce_scatter}.py
# at eb0bc48)


def _old_elementwise(scales, numels, total):
    parts = [s.expand(n) for s, n in zip(scales.unbind(0), numels)]
    rest = total - sum(numels)
    if rest:
        parts.append(scales.new_ones(rest))
    return torch.cat(parts)


def _old_encode(x, scale, fmt):
    return quantize(x, scale, fmt).view(torch.uint8)


def _old_decode_sum(received, ranks, scale, fmt):
    values = received.view(fmt.dtype).reshape(ranks, -1).to(torch.float32)
    return values.sum(0) / scale


def _old_poison_if(x, nonfinite):
    return x + torch.where(nonfinite, math.nan, 0.0).to(x.dtype)


def _old_hook(state, buffer, gradients):
    group = dist.group.WORLD
    world = dist.get_world_size(group)
    fmt = get_format(state.fmt)
    grads = gradients if state.scaling == "per_tensor" else [buffer]
    numels = [g.numel() for g in grads]
    scales, nonfinite = shared_scales(local_amaxes(grads), fmt, state.margin, group)
    scale = scales[0] if len(numels) == 1 else _old_elementwise(scales, numels, buffer.numel())
    flat = buffer.reshape(-1)
    if state.resolved_algorithm(world) == "all_gather":
        sent = _old_encode(flat, scale, fmt)
        received = torch.empty(world * sent.numel(), dtype=torch.uint8)
        dist.all_gather_into_tensor(received, sent, group=group)
        mean = _old_decode_sum(received, world, scale, fmt) / world
        buffer.copy_(_old_poison_if(mean, nonfinite).reshape(buffer.shape))
        return buffer
    n = flat.numel()
    chunk = math.ceil(n / world)
    padded = flat.new_zeros(world * chunk, dtype=torch.float32)
    padded[:n] = flat
    full_scale = scale
    if scale.dim():
        full_scale = torch.cat([scale, scale.new_ones(world * chunk - n)])
    sent = _old_encode(padded, full_scale, fmt)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    rank = dist.get_rank(group)
    own_scale = full_scale[rank * chunk:(rank + 1) * chunk] if full_scale.dim() else full_scale
    mean = _old_decode_sum(received, world, own_scale, fmt) / world
    means = torch.empty(world * chunk, dtype=torch.uint8)
    dist.all_gather_into_tensor(means, _old_encode(mean, own_scale, fmt), group=group)
    out = means.view(fmt.dtype).to(torch.float32) / full_scale
    buffer.copy_(_old_poison_if(out[:n], nonfinite).reshape(buffer.shape))
    return buffer


def _old_reduce_scatter(state, output_tensor, input_tensor, group, op):
    fmt = get_format(state.fmt)
    world = group.size()
    scales, nonfinite = shared_scales(local_amaxes([input_tensor]), fmt, state.margin, group)
    scale = scales[0]
    sent = _old_encode(input_tensor.reshape(-1), scale, fmt)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    total = _old_decode_sum(received, world, scale, fmt)
    if op == dist.ReduceOp.AVG:
        total = total / world
    output_tensor.copy_(_old_poison_if(total, nonfinite).reshape(output_tensor.shape))


# ---- the cases


class Bucket:
    def __init__(self, buffer, numels):
        self._buffer, self._numels = buffer, numels

    def buffer(self):
        return self._buffer

    def gradients(self):
        return list(self._buffer.split(self._numels))


def gradients(numels, dtype, rank, poison):
    g = torch.Generator().manual_seed(1000 + rank)
    parts = []
    for i, n in enumerate(numels):
        magnitude = 10.0 ** torch.empty(n).uniform_(-6, 2, generator=g)  # many binades: sums that round
        parts.append(torch.randn(n, generator=g) * magnitude * (i + 1))
    flat = torch.cat(parts)
    if poison is not None and rank == dist.get_world_size() - 1:
        flat[numels[0] + 7] = poison
    return flat.to(dtype)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).clone()


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    with process_group_ended():
        rank = dist.get_rank()
        fp8_reduce.CHUNK = 4096  # blocks of 4096 // 2^ceil(log2 W) columns (at least MIN_COLUMNS)
        fp8_reduce.MIN_COLUMNS = 64
        numels = [5003, 77, 1, 12289, 640, 3001]  # 21011: not a multiple of any vector width or of W
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            for fmt in ("e4m3", "e5m2"):
                for poison in (None, float("inf"), float("nan")):
                    for algorithm in ("all_gather", "all_to_all"):
                        for scaling in ("per_tensor", "per_bucket"):
                            state = FP8CommState(fmt=fmt, algorithm=algorithm, scaling=scaling)
                            grads = gradients(numels, dtype, rank, poison)
                            old = _old_hook(state, grads.clone(), Bucket(grads.clone(), numels).gradients())
                            bucket = Bucket(grads.clone(), numels)
                            new = fp8_comm_hook(state, bucket).wait()
                            key = ("hook", str(dtype), fmt, str(poison), algorithm, scaling)
                            results[key] = (bits(old), bits(new))
                    state = FP8CommState(fmt=fmt)
                    world = dist.get_world_size()
                    inp = gradients([n * world for n in (3001, 17)], dtype, rank, poison)
                    for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
                        old = torch.empty(inp.numel() // world, dtype=dtype)
                        new = torch.empty_like(old)
                        _old_reduce_scatter(state, old, inp, dist.group.WORLD, op)
                        FP8ReduceScatter(state)(new, inp, dist.group.WORLD, op)
                        results[("reduce_scatter", str(dtype), fmt, str(poison), str(op))] = (bits(old), bits(new))
        results["module"] = fp8_reduce.__file__
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    launch_forked(main, int(sys.argv[2]))
