"""Casts: bit-exact against an independent FP8 oracle, saturation, NaN, stochastic rounding unbiasedness."""
import math

import pytest
import torch

from lightning_fp8.numerics import E4M3, E5M2, dequantize, quantize, tensor_amax

FORMATS = [E4M3, E5M2]


def decode(code: int, fmt) -> float:
    """Value of an FP8 code from the format's definition (not from torch)."""
    exp_bits = 7 - fmt.mantissa_bits
    bias = 2 ** (exp_bits - 1) - 1
    sign = -1.0 if code & 0x80 else 1.0
    e = (code >> fmt.mantissa_bits) & ((1 << exp_bits) - 1)
    m = code & ((1 << fmt.mantissa_bits) - 1)
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - fmt.mantissa_bits)
    return sign * (1 + m / 2**fmt.mantissa_bits) * 2.0 ** (e - bias)


def finite_codes(fmt):
    return [c for c in range(0x80) if c <= fmt.max_code]


def oracle_round(x: float, fmt) -> float:
    """Round-to-nearest-even with saturation at +-max, from the format definition alone."""
    if math.isnan(x):
        return math.nan
    mag = min(abs(x), fmt.max)
    best = None
    for c in finite_codes(fmt):
        v = decode(c, fmt)
        d = abs(v - mag)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c, v)
    return math.copysign(best[2], x)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_decode_matches_torch_dtype(fmt):
    codes = torch.tensor(finite_codes(fmt), dtype=torch.uint8)
    values = codes.view(fmt.dtype).float().tolist()
    assert values == [decode(c, fmt) for c in finite_codes(fmt)]
    assert decode(fmt.max_code, fmt) == fmt.max
    assert decode(1, fmt) == fmt.smallest_subnormal


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_cast_bit_exact_against_oracle(fmt):
    grid = [decode(c, fmt) for c in finite_codes(fmt)]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]  # ties: round-to-even decides
    near = [v * (1 + s) for v in grid[1:] for s in (-1e-3, 1e-3)]
    special = [fmt.max, fmt.max * 1.01, fmt.max * 4, 1e30, math.inf, fmt.smallest_subnormal / 2,
               fmt.smallest_subnormal * 0.51, fmt.smallest_subnormal * 0.49, 0.0]
    values = grid + mids + near + special
    values = values + [-v for v in values] + [math.nan]
    x = torch.tensor(values, dtype=torch.float32)
    got = quantize(x, torch.tensor(1.0), fmt).float().tolist()
    want = [oracle_round(v, fmt) for v in x.tolist()]
    for v, g, w in zip(x.tolist(), got, want):
        if math.isnan(w):
            assert math.isnan(g), v
        else:
            assert g == w and math.copysign(1, g) == math.copysign(1, w), (v, g, w)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_infinity_saturates_to_max_and_nan_stays_nan(fmt):
    x = torch.tensor([math.inf, -math.inf, math.nan])
    q = quantize(x, torch.tensor(1.0), fmt).float()
    assert q[0] == fmt.max and q[1] == -fmt.max and torch.isnan(q[2])
    # the amax is what reveals the overflow
    assert not torch.isfinite(tensor_amax(x[:2]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_is_applied_in_float32_and_dequant_inverts_exactly(fmt):
    x = torch.randn(1000) * 3
    scale = torch.tensor(64.0)
    q = quantize(x.bfloat16(), scale, fmt)
    assert torch.equal(q.view(torch.uint8), quantize(x.bfloat16().float(), scale, fmt).view(torch.uint8))
    back = dequantize(q, scale.reciprocal())
    # dequantize is exact for power-of-two scales: quantizing it again is the identity
    assert torch.equal(quantize(back, scale, fmt).view(torch.uint8), q.view(torch.uint8))


def test_amax_of_empty_tensor_is_zero():
    assert tensor_amax(torch.empty(0)).item() == 0.0


def test_unknown_rounding_names_choices():
    with pytest.raises(ValueError, match="nearest"):
        quantize(torch.ones(2), torch.tensor(1.0), E4M3, rounding="up")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(fmt):
    gen = torch.Generator().manual_seed(1)
    # magnitudes spanning subnormals to near max, both signs
    exps = torch.empty(256).uniform_(math.log2(fmt.smallest_subnormal), math.log2(fmt.max / 2), generator=gen)
    x = torch.exp2(exps) * torch.where(torch.rand(256, generator=gen) < 0.5, -1.0, 1.0)
    n = 4000
    draws = quantize(x.expand(n, -1), torch.tensor(1.0), fmt, rounding="stochastic", generator=gen).float()
    down = quantize(x, torch.tensor(1.0), fmt).float()
    # neighbours: every draw is one of the two representable values around x
    lo = torch.minimum(draws.min(0).values, down)
    hi = torch.maximum(draws.max(0).values, down)
    assert torch.all((draws == lo) | (draws == hi))
    # unbiased: the mean of n draws is within 5 standard errors of x. One draw's error is at most the gap between
    # neighbours, so its std is <= gap/2 and the mean's std <= gap / (2 sqrt(n)); 5 sigma keeps 256 checks from
    # ever failing by chance (p < 1.5e-4 overall) while a bias of 1% of a gap would be caught.
    gap = (hi - lo).clamp_min(fmt.smallest_subnormal)
    err = (draws.mean(0) - x).abs()
    assert torch.all(err <= 5 * gap / (2 * math.sqrt(n))), (err / gap).max()
    # nearest rounding is biased on the same inputs (sanity check that the test can fail)
    assert (down - x).abs().mean() > 10 * err.mean()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_stochastic_rounding_keeps_exact_values_nan_and_saturates(fmt):
    x = torch.tensor([0.0, -0.0, 1.0, fmt.max, -fmt.max, math.inf, math.nan, fmt.smallest_subnormal])
    q = quantize(x, torch.tensor(1.0), fmt, rounding="stochastic").float()
    assert q[:5].tolist() == [0.0, -0.0, 1.0, fmt.max, -fmt.max]
    assert q[5] == fmt.max and torch.isnan(q[6]) and q[7] == fmt.smallest_subnormal


def test_stochastic_rounding_with_given_noise_is_deterministic():
    x = torch.randn(512)
    noise = torch.rand(512)
    a = quantize(x, torch.tensor(8.0), E5M2, rounding="stochastic", noise=noise)
    b = quantize(x, torch.tensor(8.0), E5M2, rounding="stochastic", noise=noise)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
