"""The CPU fast paths of the emulation give the reference's bits (kernels/cpu_kernels.py, lightning_fp8/modules/emulation.py):

- a BF16 tensor cast with a power-of-two scale is scaled in BF16, not float32;
- the backward's weight re-cast skips the amax where torch's cast saturates like `quantize`'s clamp;
- a power-of-two GEMM scale is folded into the second operand's BF16 image (no pass over the output);
- an FP8 tensor two GEMMs read is converted to BF16 once, and never served stale.
"""
from __future__ import annotations

import pytest
import torch

from lightning_fp8.kernels.cpu_kernels import _cast_saturates_like_the_clamp, cast_cpu, scaled_cast_cpu
from lightning_fp8.kernels.kernel_reference import cast_reference, scaled_cast_reference
from lightning_fp8.modules import emulation
from lightning_fp8.modules.emulation import emulate, fp8_bf16_image
from lightning_fp8.modules.operand import FP8Matrix, GemmRequest
from lightning_fp8.numerics.formats import E4M3, E5M2

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _edge_bf16(fmt):
    """BF16 values around every FP8 code and tie, BF16 subnormals, and values that round to FP8 subnormals or zero."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    near = torch.cat([finite, mids, torch.nextafter(mids, mids * 2 + 1), torch.nextafter(mids, -mids * 2 - 1)])
    tiny = torch.tensor([1e-39, -1e-39, 2.0**-130, 2.0**-126, fmt.smallest_subnormal * 0.5, 0.0, -0.0])
    values = torch.cat([near, -near, tiny]).to(torch.bfloat16)
    return torch.cat([values, torch.zeros((-values.numel()) % 64, dtype=torch.bfloat16)]).reshape(-1, 64)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_a_bf16_cast_scaled_in_bf16_equals_the_reference(fmt, scaling):
    """Power-of-two scales from 2^-20 to 2^20 (the BF16 path) and one that is not (the float32 path), on values at
    every FP8 code, tie and their neighbours, BF16 subnormals and values that cast to FP8 subnormals or zero."""
    x = _edge_bf16(fmt)
    amax = float(x.float().abs().max())
    for log2_scale in (-20, -3, 0, 5, 20, None):
        history = torch.zeros(3, 5)
        if log2_scale is not None:  # a history that sizes the delayed scale to 2^log2_scale (and the clamp is skipped)
            history[0, 1] = fmt.max / 2.0**log2_scale
        data = x if log2_scale is None or amax * 2.0**log2_scale <= fmt.max else x * 2.0**-24
        expected = scaled_cast_reference(data, history.clone(), 0, fmt, scaling, True, 0, log2_scale is not None)
        got = scaled_cast_cpu(data, history.clone(), 0, fmt, scaling, True, 0, log2_scale is not None)
        assert torch.equal(got[1], expected[1])
        assert torch.equal(_bits(got[0]), _bits(expected[0])), log2_scale


def test_the_weight_recast_without_an_amax_equals_the_reference_also_where_it_saturates():
    """A float32 weight re-cast to E4M3 (compute_amax=False): cast directly, saturating values and +-inf to +-448 and
    NaN to NaN as `quantize`'s clamp does; E5M2 (which overflows to inf) keeps the amax check."""
    assert _cast_saturates_like_the_clamp(E4) and not _cast_saturates_like_the_clamp(E5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-20, 12, (64, 96), generator=g).float())
    x[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3e38])
    for fmt in (E4M3, E5M2):
        for scale in (1.0, 2.0**-7, 0.37):
            s = torch.tensor(scale)
            got = cast_cpu(x, s, fmt, write_row=True, write_t=True, compute_amax=False)
            expected = cast_reference(x, s, fmt, write_row=True, write_t=True, compute_amax=False)
            if fmt is E5M2:  # saturates: the amax check declines, the reference runs
                assert got is None
                continue
            assert got[2] is None
            for a, b in zip(got[:2], expected[:2]):
                assert torch.equal(_bits(a), _bits(b))


def _operands(m, k, n, a_dtype, b_dtype, scale_a, scale_b, bias=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 40).clamp(-400, 400).to(a_dtype)
    b = (torch.randn(n, k, generator=g) * 40).clamp(-400, 400).to(b_dtype).t()
    return GemmRequest(FP8Matrix(a, torch.tensor(scale_a)), FP8Matrix(b, torch.tensor(scale_b)), torch.bfloat16, bias)


def _unfolded(ops):
    """The BF16 GEMM with the scale applied to the output afterwards (the path for scales outside the fold range)."""
    scale = ops.a.scale_inv * ops.b.scale_inv
    a, b = fp8_bf16_image(ops.a.data), fp8_bf16_image(ops.b.data)
    if ops.bias is None:
        return torch.mm(a, b).mul_(scale)
    return torch.addmm(ops.bias.to(torch.bfloat16) / scale, a, b).mul_(scale)


@pytest.mark.skipif(not emulation.cpu_has_native_bf16(), reason="the BF16 GEMM path needs BF16 hardware")
@pytest.mark.parametrize("pair", [(E4, E4), (E5, E4), (E5, E5)], ids=["e4m3xe4m3", "e5m2xe4m3", "e5m2xe5m2"])
def test_a_scale_folded_into_the_image_gives_the_same_bits_as_scaling_the_output(pair):
    """Power-of-two scales across the fold range and its edges, with and without bias: the image times the scale
    equals the output times the scale, bit for bit; beyond the range the output is scaled."""
    for scale_a, scale_b in ((1.0, 1.0), (2.0**-7, 2.0**3), (2.0**-60, 2.0**-34), (2.0**30, 2.0**30),
                             (2.0**-60, 2.0**-40), (2.0**40, 2.0**30)):
        for bias in (None, torch.randn(48) * 3):
            ops = _operands(40, 160, 48, *pair, scale_a, scale_b, bias)
            got, expected = emulate(ops), _unfolded(ops)
            assert torch.equal(_bits(got), _bits(expected)), (scale_a, scale_b, bias is not None)


def test_an_image_is_converted_once_for_two_readers_and_never_served_stale():
    q = (torch.randn(64, 32) * 8).to(E4)
    first = fp8_bf16_image(q)
    assert fp8_bf16_image(q.t()).t().data_ptr() == first.data_ptr(), "the transposed reader gets the same image"
    q.view(torch.uint8)[0, 0] = 0  # a write: the remembered image is stale
    fresh = fp8_bf16_image(q)
    assert fresh.data_ptr() != first.data_ptr() and fresh[0, 0] == 0
    assert torch.equal(fresh, q.float().to(torch.bfloat16))
    other = q.clone()  # equal values, another tensor: its own image
    assert fp8_bf16_image(other).data_ptr() != fresh.data_ptr()
    del q, other
    assert all(ref() is None for ref, _, _ in emulation._recent_images), "images go with their tensors"


def test_memory_bound_passes_take_the_thread_count_that_ran_faster_and_restore_torchs():
    """`_ThreadChoice` tries all threads and one thread, then keeps the one with the lower time per element and
    re-tries the other every PROBE_EVERY passes; `memory_bound_threads` gives torch its thread count back, also when
    the block raises, and leaves small passes and one-thread setups alone."""
    from lightning_fp8.kernels.cpu_kernels import _ThreadChoice, memory_bound_threads

    choice = _ThreadChoice()
    assert choice.single() is False  # each tried once, all threads first
    choice.record(False, 1.0, 1000)
    assert choice.single() is True
    choice.record(True, 0.1, 1000)  # one thread ran ten times faster (a shared CPU)
    picks = [choice.single() for _ in range(2 * choice.PROBE_EVERY)]
    assert picks.count(False) == 2 and picks.count(True) == 2 * choice.PROBE_EVERY - 2
    for _ in range(16):  # the load went away: all threads are faster again
        choice.record(False, 0.01, 1000)
    assert [choice.single() for _ in range(3)] == [False] * 3

    threads = torch.get_num_threads()
    if threads > 1:
        with pytest.raises(RuntimeError):
            with memory_bound_threads("test", 1 << 20):
                raise RuntimeError("inside")
        assert torch.get_num_threads() == threads
        with memory_bound_threads("small", 10):
            assert torch.get_num_threads() == threads


def test_inference_tensors_are_converted_without_being_remembered():
    """Tensors made under torch.inference_mode (Lightning's evaluation loops) track no version: never cached."""
    with torch.inference_mode():
        q = (torch.randn(16, 32) * 8).to(E4)
        image = fp8_bf16_image(q)
    assert torch.equal(image, q.float().to(torch.bfloat16))
    assert all(ref() is not q for ref, _, _ in emulation._recent_images)
