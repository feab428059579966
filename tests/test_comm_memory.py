"""Bounded temporaries of the FP8 gradient communication (lightning_fp8/distributed/fp8_reduce.py): the chunked
encode and decode-and-sum give the unchunked code's values to the bit, and the memory a comm hook or a reduce-scatter
call allocates is its collectives' uint8 buffers plus O(CHUNK), whatever the buffer's size
(benchmarks/results/comm_memory.md has the before / after numbers).

The bit-for-bit comparison with the replaced code on real ranks: tests/workers/comm_parity_worker.py (3 gloo ranks,
every algorithm, format, gradient dtype, an inf or a NaN on one rank). Here, in one process: the building blocks against
the unchunked expressions on simulated received buffers of up to 33 ranks (random bytes: NaN and inf codes included),
and the peak allocation under torch's fake process group.
"""
import math
import os

import pytest
import torch
import torch.distributed as dist

from lightning_fp8.distributed import fp8_reduce
from lightning_fp8.distributed.comm_bytes import peak_allocated_bytes
from lightning_fp8.distributed.comm_hook import FP8CommState, fp8_comm_hook
from lightning_fp8.distributed.fp8_reduce import SegmentScales, decode_sum, decode_sum_into, encode_into, poison_if
from lightning_fp8.distributed.reduce_scatter import FP8ReduceScatter
from lightning_fp8.numerics.formats import get_format
from lightning_fp8.numerics.quantize import quantize

WORKER = os.path.join(os.path.dirname(__file__), "workers", "comm_parity_worker.py")

#: what a call may allocate beyond its collectives' uint8 buffers, in units of CHUNK bytes (measured: at most 10.5
#: with the default CHUNK, benchmarks/results/comm_memory.md)
TEMPORARY_CHUNKS = 16


def _per_element(scales, numels, total):
    """The replaced code's per-element scale (one float32 per element)."""
    parts = [s.expand(n) for s, n in zip(scales.unbind(0), numels)]
    if total > sum(numels):
        parts.append(scales.new_ones(total - sum(numels)))
    return torch.cat(parts)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _segments(m, seed):
    g = torch.Generator().manual_seed(seed)
    numels, left = [], m - 5  # 5 elements of padding (scale 1)
    while left > 0:
        n = min(left, int(torch.randint(1, 700, (1,), generator=g)))
        numels.append(n)
        left -= n
    scales = torch.exp2(torch.randint(-10, 20, (len(numels),), generator=g).float()) * 1.37
    return scales, numels


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("ranks", [2, 3, 5, 8, 16, 33])
def test_decode_sum_into_is_the_unchunked_sum_to_the_bit(fmt, ranks):
    f = get_format(fmt)
    m = 9001
    g = torch.Generator().manual_seed(ranks)
    received = torch.randint(0, 256, (ranks * m,), generator=g, dtype=torch.uint8)  # NaN / inf codes included
    scales, numels = _segments(m, ranks)
    for nonfinite in (torch.tensor(False), torch.tensor(True)):
        for dtype in (torch.float32, torch.bfloat16):
            expected = poison_if(decode_sum(received, ranks, _per_element(scales, numels, m), f) / ranks, nonfinite)
            for chunk in (1 << 12, 1 << 20):
                out = torch.empty(m, dtype=dtype)
                decode_sum_into(out, received, ranks, SegmentScales(scales, numels, m), f, divisor=ranks,
                                nonfinite=nonfinite, chunk=chunk)
                assert torch.equal(_bits(out), _bits(expected.to(dtype))), (dtype, chunk, bool(nonfinite))
    # a 0-d scale, no divisor, the first m' < m columns (the all-to-all's padded last chunk)
    out = torch.empty(m - 3)
    decode_sum_into(out, received, ranks, scales[0], f, chunk=1 << 12)
    assert torch.equal(_bits(out), _bits(decode_sum(received, ranks, scales[0], f)[: m - 3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_into_and_segment_scales_are_the_per_element_scale(dtype):
    f = get_format("e4m3")
    m = 20011
    scales, numels = _segments(m, 7)
    x = (torch.randn(m) * 10.0 ** torch.empty(m).uniform_(-8, 3)).to(dtype)
    x[100], x[5000] = float("inf"), float("nan")
    per_element = _per_element(scales, numels, m)
    segments = SegmentScales(scales, numels, m)
    for start, stop in ((0, m), (3, 4), (17, 9000), (m - 5, m), (m - 6, m - 4)):
        assert torch.equal(segments.scale(start, stop).expand(stop - start), per_element[start:stop])
    expected = quantize(x, per_element, f).view(torch.uint8)
    for chunk in (1000, 1 << 20):
        out = torch.full((m + 3,), 7, dtype=torch.uint8)
        encode_into(out, x, segments, f, chunk=chunk)
        assert torch.equal(out[:m], expected) and torch.equal(out[m:], torch.full((3,), 7, dtype=torch.uint8))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_chunked_paths_match_the_replaced_code_bit_for_bit_on_three_ranks(tmp_path):
    from support.torchrun_launch import run_workers

    proc = run_workers(WORKER, tmp_path, 300, "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(3):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert results.pop("module") == fp8_reduce.__file__  # the ranks ran this checkout's code
        assert len(results) == 72
        for key, (old, new) in results.items():
            assert torch.equal(old, new), key
            if key[3] != "None":  # an inf / NaN on the last rank: NaN everywhere on every rank
                assert torch.isnan(new.view(torch.float32 if new.element_size() == 4 else torch.bfloat16)).all(), key


class _Bucket:
    def __init__(self, numels):
        self._buffer = torch.randn(sum(numels)) * 1e-3
        self._numels = numels

    def buffer(self):
        return self._buffer

    def gradients(self):
        return list(self._buffer.split(self._numels))


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    yield lambda world: dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_peak_allocation_is_the_collective_buffers_plus_o_chunk(fake_group, monkeypatch, world):
    """Measured under the fake backend (the collectives move nothing; what the code allocates for them is real).
    Buffers the algorithms need: all_gather: sent N + received W N bytes; all_to_all: sent and received, W ceil(N/W)
    bytes each; the reduce-scatter: sent and received, N bytes each. Beyond those, at most TEMPORARY_CHUNKS x CHUNK
    bytes for two sizes N: the temporaries do not grow with N (the replaced code: 13 + 5W, 25 and 10 bytes per
    element at W = 2)."""
    chunk = 1 << 15
    monkeypatch.setattr(fp8_reduce, "CHUNK", chunk)
    fake_group(world)
    block = [3 * 64 * 64, 3 * 64, 64 * 64, 64, 64, 64, 4 * 64 * 64, 4 * 64, 4 * 64 * 64, 64, 64, 64]
    extra = {}
    for blocks in (8, 32):  # 0.4 M and 1.6 M elements
        numels = block * blocks
        n = sum(numels)
        for algorithm in ("all_gather", "all_to_all"):
            bucket = _Bucket(numels)
            peak, _ = peak_allocated_bytes(lambda: fp8_comm_hook(FP8CommState(algorithm=algorithm), bucket).wait())
            needed = (1 + world) * n if algorithm == "all_gather" else 2 * world * math.ceil(n / world)
            extra[(algorithm, blocks)] = peak - needed
        m = n // world * world
        inp, out = torch.randn(m), torch.empty(m // world)
        peak, _ = peak_allocated_bytes(lambda: FP8ReduceScatter()(out, inp, dist.group.WORLD, dist.ReduceOp.AVG))
        extra[("reduce_scatter", blocks)] = peak - 2 * m
    for key, value in extra.items():
        assert 0 <= value <= TEMPORARY_CHUNKS * chunk, (key, value / chunk)
