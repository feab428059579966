"""FP8 gradient communication for DistributedDataParallel: a comm hook that averages gradient buckets in FP8.

    from lightning_fp8.distributed import FP8CommState, fp8_comm_hook
    ddp_model.register_comm_hook(FP8CommState(), fp8_comm_hook)

The plugins register it themselves with `gradient_communication="fp8"`. Per bucket of N
gradient elements on W ranks (the numerics: fp8_reduce.py):

1. the amax of each parameter's gradient in the bucket (`scaling="per_tensor"`, FP8-LM's choice: a layer with small
   gradients is not flushed by a neighbour's large ones) or of the whole bucket ("per_bucket"), one MAX all-reduce
   of those few floats, and the shared scales;
2. the bucket cast to FP8 with them, and moved as uint8:
   - "all_gather": every rank gathers every rank's FP8 bucket and sums in float32: N (W-1) bytes sent per rank,
     one rounding. Cheapest for W = 2 (a BF16 all-reduce sends 2 x 2N (W-1)/W = 2N at W = 2: ratio 0.5);
   - "all_to_all": a reduce-scatter made of an all-to-all of FP8 chunks, a float32 sum of the chunk each rank owns,
     the mean re-cast with the same scale (|mean| <= amax, so it cannot overflow) and an FP8 all-gather of the means:
     2N (W-1)/W bytes, half of BF16's 4N (W-1)/W at any W, two roundings;
   - "auto": "all_gather" for W <= 2, else "all_to_all";
3. the average written back into the bucket; NaN everywhere if any rank's bucket held inf / NaN (the engine then
   skips the step on every rank).

Memory: the uint8 buffers the collectives need ("all_gather": N sent + W N received; "all_to_all": sent and
received, W ceil(N/W) bytes each, then N + ceil(N/W) for the means) plus float32 temporaries of O(fp8_reduce.CHUNK)
elements (the encode and the decode-and-sum work a chunk at a time), whatever N.

The amax all-reduce is per bucket, not per iteration: the scale must be known before the cast, and a bucket's amax
exists only once backward produced it (fp8_reduce.py's docstring).

No host synchronisation: the amax all-reduce is issued in stream order and the rest is chained on the collective's
future. Why this module has no `from __future__ import annotations`: DDP checks the hook's annotations by value
(`torch.futures.Future[torch.Tensor]`), and strings would fail that check.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lightning_fp8.distributed.fp8_reduce import (SegmentScales, cast_into, decode_sum_into, decoded_blocks, encode_into,
                                                  local_amaxes, shared_scales)
from lightning_fp8.numerics.formats import get_format

COMM_FORMATS = ("e4m3", "e5m2")
COMM_SCALINGS = ("per_tensor", "per_bucket")
COMM_ALGORITHMS = ("auto", "all_gather", "all_to_all")


@dataclass
class FP8CommState:
    """Settings of `fp8_comm_hook` (also used by the FSDP2 reduce-scatter, reduce_scatter.py).

    process_group: the group to average over (None: the default group, what DDP uses by default).
    fmt: "e4m3" (default: with a scale shared per tensor, range is not what limits a gradient's precision, and E4M3
        has one more mantissa bit) or "e5m2".
    scaling: "per_tensor" (default) or "per_bucket" (one scale for the whole bucket; FSDP2 always uses one per
        reduce-scatter call, see reduce_scatter.py).
    algorithm: "auto", "all_gather" or "all_to_all" (see the module docstring for what each sends).
    margin: scale = fp8_max / amax / 2**margin.
    """

    process_group: Optional[dist.ProcessGroup] = None
    fmt: str = "e4m3"
    scaling: str = "per_tensor"
    algorithm: str = "auto"
    margin: int = 0

    def __post_init__(self) -> None:
        for name, choices in (("fmt", COMM_FORMATS), ("scaling", COMM_SCALINGS), ("algorithm", COMM_ALGORITHMS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"FP8CommState({name}={getattr(self, name)!r}) is not valid; valid choices: {list(choices)}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"FP8CommState(margin={self.margin!r}) must be an int >= 0")

    def resolved_algorithm(self, world_size: int) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        return "all_gather" if world_size <= 2 else "all_to_all"


def fp8_comm_hook(state: FP8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket averaged over the ranks in FP8 with shared scales (see the module docstring)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    fmt = get_format(state.fmt)
    buffer = bucket.buffer()
    grads = bucket.gradients() if state.scaling == "per_tensor" else [buffer]
    numels = [g.numel() for g in grads]
    if sum(numels) != buffer.numel():  # a bucket laid out with gaps: one scale for the whole buffer
        grads, numels = [buffer], [buffer.numel()]
    scales, nonfinite = shared_scales(local_amaxes(grads), fmt, state.margin, group)
    flat = buffer.reshape(-1)
    segments = SegmentScales(scales, numels, flat.numel())  # per tensor scale, never one float per element
    if state.resolved_algorithm(world) == "all_gather":
        return _average_by_all_gather(flat, buffer, segments, nonfinite, fmt, world, group)
    return _average_by_all_to_all(flat, buffer, segments, nonfinite, fmt, world, group)


def _average_by_all_gather(flat, buffer, segments, nonfinite, fmt, world, group) -> torch.futures.Future[torch.Tensor]:
    sent = encode_into(torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device), flat, segments, fmt)
    received = torch.empty(world * sent.numel(), dtype=torch.uint8, device=sent.device)
    work = dist.all_gather_into_tensor(received, sent, group=group, async_op=True)

    def average(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises a failed collective
        decode_sum_into(buffer, received, world, segments, fmt, divisor=world, nonfinite=nonfinite)
        return buffer

    return work.get_future().then(average)


def _average_by_all_to_all(flat, buffer, segments, nonfinite, fmt, world, group) -> torch.futures.Future[torch.Tensor]:
    n = flat.numel()
    chunk = math.ceil(n / world)
    padded = SegmentScales(segments.scales, [b - a for a, b in zip(segments.starts, segments.starts[1:])], world * chunk)
    sent = torch.empty(world * chunk, dtype=torch.uint8, device=flat.device)
    sent[n:].zero_()  # the padding: zeros (code 0 in both formats), as the cast of 0 gives
    encode_into(sent, flat, segments, fmt)
    received = torch.empty_like(sent)
    # issued from the hook itself, not from a future's callback: collectives stay in this thread's order (and in
    # the caller's stream on NCCL, where the call returns once enqueued)
    dist.all_to_all_single(received, sent, group=group)
    del sent
    rank = dist.get_rank(group)
    own = _Shifted(padded, rank * chunk)  # the scales of this rank's chunk
    mine = torch.empty(chunk, dtype=torch.uint8, device=received.device)
    target = mine.view(fmt.dtype)
    for start, stop, mean in decoded_blocks(received, world, own, fmt, chunk, divisor=world):
        # this rank's chunk averaged in float32, re-cast with the same scales (|mean| <= amax: no overflow)
        cast_into(target[start:stop], mean, own.scale(start, stop), fmt)
    del received
    means = torch.empty(world * chunk, dtype=torch.uint8, device=mine.device)
    work = dist.all_gather_into_tensor(means, mine, group=group, async_op=True)

    def average(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raises a failed collective
        decode_sum_into(buffer, means, 1, padded, fmt, nonfinite=nonfinite)
        return buffer

    return work.get_future().then(average)


class _Shifted:
    """The scales of `segments` from element `offset` on (a rank's chunk of the padded buffer)."""

    def __init__(self, segments: SegmentScales, offset: int) -> None:
        self.segments, self.offset = segments, offset

    def scale(self, start: int, stop: int) -> torch.Tensor:
        return self.segments.scale(self.offset + start, self.offset + stop)


def bf16_comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The BF16 baseline: the bucket averaged by a BF16 all-reduce (`ddp_model.register_comm_hook(None,
    bf16_comm_hook)`). What torch's `bf16_compress_hook` does, which refuses to run on CPU (gloo): this one runs on
    CPU ranks too, so the FP8 hook can be compared with a BF16 baseline there."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    work = dist.all_reduce(compressed, async_op=True)

    def back(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(back)
