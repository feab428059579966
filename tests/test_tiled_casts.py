"""Fine-grained (rowwise / blockwise) casts, bit-exact against an independent oracle: per-tile amax and scale computed
with Python floats and numpy float32 arithmetic, rounding from the formats' definitions (tests/test_quantize.py's
decoder), over every code, ties, subnormals, +-max, inf / NaN in a tile, ragged last tiles."""
import bisect
import math

import numpy as np
import pytest
import torch

from lightning_fp8 import kernels
from lightning_fp8.numerics import E4M3, E5M2
from lightning_fp8.numerics.tiles import dequantize_tiles, grid_shape, operand_tiles, quantize_tiles
from test_quantize import decode, finite_codes

FORMATS = [E4M3, E5M2]


class Oracle:
    """Round-to-nearest-even with saturation, from the format's decoded grid (bisect instead of a scan)."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.codes = finite_codes(fmt)
        self.values = [decode(c, fmt) for c in self.codes]  # increasing magnitudes, code order

    def round(self, x: float) -> float:
        if math.isnan(x):
            return math.nan
        mag = min(abs(x), self.fmt.max)
        i = bisect.bisect_left(self.values, mag)
        if i < len(self.values) and self.values[i] == mag:
            return math.copysign(mag, x)
        lo, hi = self.values[i - 1], self.values[i]
        if mag - lo < hi - mag or (mag - lo == hi - mag and self.codes[i - 1] % 2 == 0):
            return math.copysign(lo, x)
        return math.copysign(hi, x)


def oracle_scale(amax: float, fmt, margin: int, power_of_2: bool) -> float:
    if not (math.isfinite(amax) and amax > 0):
        return 1.0
    s = np.float32(np.float32(fmt.max) / np.float32(amax)) / np.float32(2.0**margin)
    s = float(min(np.float32(s), np.finfo(np.float32).max))
    if power_of_2:
        s = math.ldexp(1.0, math.frexp(s)[1] - 1)
    return s


def oracle_cast(x: torch.Tensor, tile, fmt, margin=0, power_of_2=True):
    """(values as floats, per-tile scale_inv) of the tiled cast, from the definitions alone."""
    rows = x.tolist()
    m, n = len(rows), len(rows[0])
    tr = m if tile[0] == 0 else tile[0]
    tc = n if tile[1] == 0 else tile[1]
    rnd = Oracle(fmt)
    out = [[0.0] * n for _ in range(m)]
    scale_inv = []
    for r0 in range(0, m, tr):
        srow = []
        for c0 in range(0, n, tc):
            cells = [(i, j) for i in range(r0, min(r0 + tr, m)) for j in range(c0, min(c0 + tc, n))]
            mags = [abs(rows[i][j]) for i, j in cells]
            amax = math.nan if any(math.isnan(v) for v in mags) else max(mags)
            s = oracle_scale(amax, fmt, margin, power_of_2)
            for i, j in cells:
                out[i][j] = rnd.round(float(np.float32(np.float32(rows[i][j]) * np.float32(s))))
            srow.append(float(np.float32(1.0) / np.float32(s)))
        scale_inv.append(srow)
    return out, scale_inv


def assert_same(got: torch.Tensor, want):
    g = got.float().tolist()
    for i, (grow, wrow) in enumerate(zip(g, want)):
        for j, (a, b) in enumerate(zip(grow, wrow)):
            if math.isnan(b):
                assert math.isnan(a), (i, j)
            else:
                assert a == b and math.copysign(1, a) == math.copysign(1, b), (i, j, a, b)


def every_code_tensor(fmt, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows made of the format's grid values, midpoints (ties), near-ties, subnormal halves and max, each row scaled by
    its own factor (some powers of two, some not), shuffled; ragged shapes by construction."""
    grid = [decode(c, fmt) for c in finite_codes(fmt)]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    near = [v * (1 + s) for v in grid[1:] for s in (-1e-3, 1e-3)]
    special = [fmt.max, fmt.smallest_subnormal / 2, fmt.smallest_subnormal * 0.51, fmt.smallest_subnormal * 0.49, 0.0]
    base = torch.tensor(grid + mids + near + special, dtype=torch.float32)
    base = torch.cat([base, -base])
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, cols)
    for r in range(rows):
        idx = torch.randint(len(base), (cols,), generator=g)
        factor = 2.0 ** (r % 7 - 3) * (1.0 if r % 2 else 1.37)
        out[r] = base[idx] * factor
    return out


TILES = [(1, 128), (128, 128), (1, 0), (1, 16), (16, 1), (0, 1)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("power_of_2,margin", [(True, 0), (False, 0), (True, 1)])
def test_tiled_cast_bit_exact_against_oracle(fmt, tile, power_of_2, margin):
    # 130 x 300: the last row block and the last column block are ragged for every tile length above
    x = every_code_tensor(fmt, 130, 300)
    q, scale_inv, amax = quantize_tiles(x, tile, fmt, margin, power_of_2)
    want, want_scale_inv = oracle_cast(x, tile, fmt, margin, power_of_2)
    assert q.dtype == fmt.dtype and tuple(scale_inv.shape) == grid_shape(tile, x.shape)
    assert_same(q, want)
    assert scale_inv.tolist() == want_scale_inv
    assert amax.item() == x.abs().max().item()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_inf_and_nan_stay_in_their_tile(fmt):
    x = every_code_tensor(fmt, 4, 300, seed=1)
    x[1, 5] = math.inf
    x[2, 140] = -math.inf
    x[3, 260] = math.nan
    q, scale_inv, amax = quantize_tiles(x, (1, 128), fmt)
    want, want_scale_inv = oracle_cast(x, (1, 128), fmt)
    assert_same(q, want)
    assert scale_inv.tolist() == want_scale_inv
    # the tiles holding inf / NaN cast with scale 1 (inf saturates, NaN stays), every other tile has its own scale
    assert q[1, 5].float() == fmt.max and q[2, 140].float() == -fmt.max and torch.isnan(q[3, 260].float())
    assert scale_inv[1, 0] == scale_inv[2, 1] == scale_inv[3, 2] == 1.0
    assert scale_inv[1, 1] != 1.0 and scale_inv[0, 0] != 1.0
    assert math.isnan(amax.item())  # the tensor's amax reveals the NaN (and the inf, without a NaN)
    assert math.isinf(quantize_tiles(x[:3], (1, 128), fmt)[2].item())


def test_all_zero_and_tiny_tiles():
    x = torch.zeros(3, 256)
    x[1, 130] = 1e-38  # scale clamps to the float32 max, then to a power of two
    q, scale_inv, _ = quantize_tiles(x, (1, 128), E4M3)
    assert scale_inv[0, 0] == 1.0 and scale_inv[1, 0] == 1.0  # all-zero tiles: scale 1, zeros
    assert q.float().abs().sum() > 0 and scale_inv[1, 1].item() == 2.0**-127
    want, want_scale_inv = oracle_cast(x, (1, 128), E4M3)
    assert_same(q, want)
    assert scale_inv.tolist() == want_scale_inv


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantize_inverts_exactly_for_power_of_two_scales(fmt):
    x = every_code_tensor(fmt, 20, 200)
    q, scale_inv, _ = quantize_tiles(x, (1, 128), fmt)
    back = dequantize_tiles(q, scale_inv, (1, 128))
    # each FP8 value times its tile's power-of-two dequant scale: exact (the product computed in Python floats)
    qf, s = q.float().tolist(), scale_inv.tolist()
    want = [[v * s[i][j // 128] for j, v in enumerate(row)] for i, row in enumerate(qf)]
    assert back.tolist() == want
    # and the scaled FP8 values, multiplied back by the quantization scale, are the FP8 values themselves
    assert torch.equal(dequantize_tiles(q, scale_inv, (1, 128)) / back.new_tensor(s).repeat_interleave(128, 1)[:, :200],
                       q.float())


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_tiled_cast_op_matches_oracle_both_layouts_and_records_amax(scaling, role):
    fmt = E4M3
    x = every_code_tensor(fmt, 150, 260, seed=2)
    x[7, 9] = -5000.0  # the tensor's amax, recorded
    tile, tile_t = operand_tiles(scaling, 128, role)
    history = torch.zeros(3, 5)
    history[1, 0] = 1.0  # another role's open slot: untouched
    (q, s), (q_t, s_t) = kernels.tiled_cast(x, history, 1 if role == "weight" else 0, "e4m3", tile, tile_t, 0, True)
    want, want_s = oracle_cast(x, tile, fmt)
    want_t, want_s_t = oracle_cast(x.t().contiguous(), tile_t, fmt)
    assert_same(q, want)
    assert_same(q_t, want_t)
    assert s.tolist() == want_s and s_t.tolist() == want_s_t
    slot = 1 if role == "weight" else 0
    assert history[slot, 0] == 5000.0 and history[slot, 1:].eq(0).all()
    if role != "weight":
        assert history[1, 0] == 1.0
    # record=False leaves the state alone; NaN is recorded raw
    before = history.clone()
    kernels.tiled_cast(x, history, slot, "e4m3", tile, (), 0, True, record=False)
    assert torch.equal(history, before)
    x[0, 0] = math.nan
    kernels.tiled_cast(x, history, slot, "e4m3", (), tile_t, 0, True)
    assert math.isnan(history[slot, 0].item())


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
def test_tiled_cast_op_on_aligned_shapes_matches_oracle(scaling, role):
    """128-aligned shapes take the CPU twin (kernels/cpu_kernels.py `tiled_cast_cpu`: a blocked view instead of expanded
    scales); the oracle decides, in both layouts."""
    fmt = E4M3
    x = every_code_tensor(fmt, 256, 384, seed=3)
    tile, tile_t = operand_tiles(scaling, 128, role)
    history = torch.zeros(3, 5)
    (q, s), (q_t, s_t) = kernels.tiled_cast(x, history, 0, "e4m3", tile, tile_t, 0, True)
    want, want_s = oracle_cast(x, tile, fmt)
    want_t, want_s_t = oracle_cast(x.t().contiguous(), tile_t, fmt)
    assert_same(q, want)
    assert_same(q_t, want_t)
    assert s.tolist() == want_s and s_t.tolist() == want_s_t
    assert history[0, 0] == x.abs().max()


def test_cpu_tiled_cast_is_the_reference_bit_for_bit():
    """The CPU twin against the reference over formats, margins, scales that are and are not powers of two, bf16 and
    float32 inputs, one or both layouts, record on / off; where it declines (ragged tiles, a saturating, inf or NaN
    tile) it returns None and the op runs the reference."""
    from lightning_fp8.kernels.cpu_kernels import tiled_cast_cpu
    from lightning_fp8.kernels.kernel_reference import tiled_cast_reference

    taken = declined = 0
    for fmt in FORMATS:
        base = every_code_tensor(fmt, 256, 256, seed=5)
        cases = [base, base.to(torch.bfloat16), torch.randn(128, 384) * 1e-3, base[:, :200]]
        poisoned = base.clone()
        poisoned[3, 4] = math.inf
        cases.append(poisoned)
        poisoned = base.clone()
        poisoned[130, 7] = math.nan
        cases.append(poisoned)
        for x in cases:
            for scaling, role in (("rowwise", "input"), ("blockwise", "input"), ("blockwise", "weight")):
                tile, tile_t = operand_tiles(scaling, 128, role)
                for tiles in ((tile, tile_t), (tile, ()), ((), tile_t)):
                    for margin, power_of_2 in ((0, True), (0, False), (2, False)):
                        for record in (True, False):
                            h_ref = torch.zeros(3, 4)
                            h_ref[0, 0] = 0.25
                            h_cpu = h_ref.clone()
                            ref = tiled_cast_reference(x, h_ref, 0, fmt, *tiles, margin, power_of_2, record=record)
                            got = tiled_cast_cpu(x, h_cpu, 0, fmt, *tiles, margin, power_of_2, record=record)
                            if got is None:
                                declined += 1
                                assert torch.equal(h_cpu, h_ref.new_tensor([[0.25, 0, 0, 0], [0] * 4, [0] * 4]))
                                continue
                            taken += 1
                            for a, b in zip(got, ref):
                                assert (a is None) == (b is None)
                                if a is None:
                                    continue
                                if a.dtype == fmt.dtype:
                                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                else:
                                    assert torch.equal(a, b) and a.stride() == b.stride()
                            assert torch.equal(h_cpu, h_ref)
    assert taken > 100 and declined > 10


def test_operand_tiles_follow_the_non_contracted_axis():
    assert operand_tiles("blockwise", 128, "input") == ((1, 128), (1, 128))
    assert operand_tiles("blockwise", 128, "weight") == ((128, 128), (128, 128))
    assert operand_tiles("blockwise", 64, "grad_output") == ((1, 64), (1, 64))
    assert operand_tiles("rowwise", 128, "weight") == ((1, 0), (1, 0))
    with pytest.raises(ValueError, match="rowwise"):
        operand_tiles("delayed", 128, "input")
