"""MXFP8 and NVFP4 casts bit-exact against an independent oracle (Python floats, numpy float32 arithmetic, rounding from
the formats' definitions: every code, ties, subnormals, E8M0 range ends, FP4's 8 magnitudes, ragged last blocks,
inf / NaN per block), cross-checked with torch's own reference code (torch.testing._internal.common_quantized: FP4
rounding and packing, the swizzled scale layout, torchao's MX reference); the emulated GEMMs equal their per-block
definition."""
import math

import numpy as np
import pytest
import torch

from lightning_fp8.numerics import microscaling as mx
from lightning_fp8.numerics.formats import E2M1, E4M3, E5M2
from lightning_fp8.numerics.tiles import grid_shape
from test_quantize import decode, finite_codes
from test_tiled_casts import Oracle, every_code_tensor

FP4_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def torch_reference():
    """torch's own MX / FP4 reference functions (torch/testing/_internal/common_quantized.py: torchao's `to_mxfp`, the
    FP4 rounding `_f32_to_floatx_unpacked`, `pack_uint4`, the swizzle `to_blocked`), loaded from that file's source:
    importing the module pulls torch's whole test harness (expecttest, ~8 s)."""
    import ast
    import os

    path = os.path.join(os.path.dirname(torch.__file__), "testing", "_internal", "common_quantized.py")
    if not os.path.exists(path):
        pytest.skip("torch's test utilities are not installed")
    tree = ast.parse(open(path).read())
    wanted = {"_n_ones", "_f32_to_floatx_unpacked", "down_size", "pack_uint4", "ceil_div", "to_blocked", "to_mxfp",
              "_bfloat16_to_float4_e2m1fn_x2"}
    # the wanted functions and the module's constants (EBITS_F32, ..., FP4_MBITS), in file order
    body = [node for node in tree.body if (isinstance(node, ast.FunctionDef) and node.name in wanted)
            or (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]).replace("_", "").replace(", ", "").isupper())]
    module = ast.Module(body=body, type_ignores=[])
    namespace = {"torch": torch, "Tensor": torch.Tensor}
    exec(compile(module, path, "exec"), namespace)
    missing = wanted - namespace.keys()
    assert not missing, f"torch's test utilities changed: {missing}"
    return type("TorchReference", (), {name: staticmethod(namespace[name]) for name in wanted})


# -- the oracle ------------------------------------------------------------------------------------------------------
def oracle_mx_exponent(amax: float, fmt) -> int:
    """The smallest e in [-127, 127] with amax <= fmt.max * 2^e, by search (None: a non-finite block)."""
    if not math.isfinite(amax):
        return None
    e = -127
    while e < 127 and amax > math.ldexp(fmt.max, e):
        e += 1
    return e


def blocks_of(rows, tile):
    m, n = len(rows), len(rows[0])
    tr, tc = tile
    for r0 in range(0, m, tr):
        for c0 in range(0, n, tc):
            yield r0 // tr, c0 // tc, [(i, j) for i in range(r0, min(r0 + tr, m)) for j in range(c0, min(c0 + tc, n))]


def oracle_mx(x: torch.Tensor, tile, fmt):
    """(values, E8M0 codes) of the MX cast from the definitions (module docstring of numerics/microscaling.py)."""
    rows = x.tolist()
    rnd = Oracle(fmt)
    out = [[0.0] * len(rows[0]) for _ in rows]
    codes = [[0] * grid_shape(tile, x.shape)[1] for _ in range(grid_shape(tile, x.shape)[0])]
    for bi, bj, cells in blocks_of(rows, tile):
        mags = [abs(rows[i][j]) for i, j in cells]
        amax = math.nan if any(math.isnan(v) for v in mags) else max(mags)
        e = oracle_mx_exponent(amax, fmt)
        codes[bi][bj] = 255 if e is None else e + 127
        for i, j in cells:
            out[i][j] = math.nan if e is None else rnd.round(math.ldexp(rows[i][j], -e))
    return out, codes


def oracle_fp4(v: float) -> float:
    """Round to nearest even on E2M1, saturating at 6 (the code parity is the tie's evenness)."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(FP4_GRID[c] - mag), c % 2))
    return math.copysign(FP4_GRID[best], v)


def f32(v) -> float:
    return float(np.float32(v))


def oracle_nvfp4(x: torch.Tensor, tile):
    """(values, E4M3 block scales, tensor scale) of the NVFP4 cast, in numpy float32 arithmetic."""
    rows = x.tolist()
    flat = [abs(v) for r in rows for v in r]
    amax = math.nan if any(math.isnan(v) for v in flat) else max(flat)
    if not math.isfinite(amax):
        g = math.nan
    else:
        g = f32(np.float32(amax) / np.float32(2688.0)) if amax > 0 else 1.0
    e4m3 = Oracle(E4M3)
    out = [[0.0] * len(rows[0]) for _ in rows]
    scales = [[0.0] * grid_shape(tile, x.shape)[1] for _ in range(grid_shape(tile, x.shape)[0])]
    for bi, bj, cells in blocks_of(rows, tile):
        b = max(abs(rows[i][j]) for i, j in cells)
        s = f32(np.float32(f32(np.float32(b) / np.float32(6.0))) / np.float32(g))
        s = math.nan if math.isnan(s) else e4m3.round(min(max(s, 2.0**-9), 448.0))
        scales[bi][bj] = s
        total = f32(np.float32(s) * np.float32(g))
        for i, j in cells:
            v = f32(np.float32(rows[i][j]) / np.float32(total))
            out[i][j] = math.nan if math.isnan(total) else oracle_fp4(max(-6.0, min(6.0, v)))
    return out, scales, g


def assert_values(got, want):
    for i, (grow, wrow) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(grow, wrow)):
            if math.isnan(b):
                assert math.isnan(a), (i, j, a)
            else:
                assert a == b and math.copysign(1, a) == math.copysign(1, b), (i, j, a, b)


# -- MXFP8 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("tile", [(1, 32), (32, 1)], ids=str)
def test_mx_cast_bit_exact_against_oracle(fmt, tile):
    # every code, midpoints (ties), near-ties, subnormal halves and max, scaled by factors; 70 columns / rows: a ragged
    # last block of 6 along the blocked dimension
    x = every_code_tensor(fmt, 70, 70, seed=3)
    q, scales, amax = mx.quantize_mx(x, tile, fmt)
    want, want_codes = oracle_mx(x, tile, fmt)
    assert q.dtype == fmt.dtype and scales.dtype == torch.float8_e8m0fnu
    assert tuple(scales.shape) == grid_shape(tile, x.shape)
    assert_values(q.float().tolist(), want)
    assert scales.view(torch.uint8).tolist() == want_codes
    assert amax.item() == x.abs().max().item()
    # RCEIL: no element saturates, so the dequantized block max never sits at fmt.max unless the input was exactly there
    back = mx.dequantize_mx(q, scales, tile)
    assert (back.abs() <= x.abs().amax() * (1 + 2.0 ** -fmt.mantissa_bits)).all()


def test_mx_scale_range_ends_and_binade_boundaries():
    """E8M0's ends (2^-127 for zero and tiny blocks, large amaxes near the float32 max), blocks exactly at 448 * 2^k and
    one float32 ulp above it (the next scale: no saturation), subnormal float32 amaxes."""
    amaxes = [0.0, 2.0**-149, 1e-40, 448 * 2.0**-127, 448 * 2.0**-126, 448.0, float(np.nextafter(np.float32(448), 1e9)),
              448 * 2.0**20, float(np.nextafter(np.float32(448 * 2.0**20), 1e30)), 3.0e38, 1.0, 0.875, 1.75]
    x = torch.zeros(len(amaxes), 32)
    for r, a in enumerate(amaxes):
        x[r, r % 32] = a
        x[r, (r + 7) % 32] = -a / 3
    q, scales, _ = mx.quantize_mx(x, (1, 32), E4M3)
    codes = scales.view(torch.uint8).flatten().tolist()
    want = [oracle_mx_exponent(f32(a), E4M3) + 127 for a in amaxes]
    assert codes == want
    assert codes[0] == codes[1] == codes[2] == 0 and codes[3] == 0 and codes[4] == 1  # clamped at 2^-127
    assert codes[5] == 127 and codes[6] == 128 and codes[7] == 147 and codes[8] == 148
    assert (q.float().abs() <= 448).all() and q.float().abs().amax(1)[6] < 448  # one ulp above: the next scale
    assert_values(q.float().tolist(), oracle_mx(x, (1, 32), E4M3)[0])
    # the scales read back as powers of two, exactly (float32: 2^-127 is subnormal there)
    assert scales.float().flatten().tolist() == [math.ldexp(1.0, c - 127) for c in codes]


def test_mx_block_with_inf_or_nan_decodes_to_nan_and_no_other_block_changes():
    x = every_code_tensor(E4M3, 3, 96, seed=5)
    x[0, 3] = math.inf
    x[1, 40] = -math.inf
    x[2, 95] = math.nan
    q, scales, amax = mx.quantize_mx(x, (1, 32), E4M3)
    want, want_codes = oracle_mx(x, (1, 32), E4M3)
    assert scales.view(torch.uint8).tolist() == want_codes
    assert want_codes[0][0] == want_codes[1][1] == want_codes[2][2] == 255
    assert_values(q.float().tolist(), want)
    back = mx.dequantize_mx(q, scales, (1, 32))
    assert torch.isnan(back[0, :32]).all() and torch.isnan(back[1, 32:64]).all() and torch.isnan(back[2, 64:]).all()
    assert torch.isfinite(back[0, 32:]).all() and torch.isfinite(back[2, :64]).all()
    assert math.isnan(amax.item())


def test_torch_reference_mx_cast_agrees_except_where_its_float32_log2_clips():
    """torch's test utilities carry torchao's MX reference (`to_mxfp`, RCEIL through a float32 division and log2): the
    same scales and bytes on ordinary data; just above 448 * 2^k for larger k its log2 rounds down and the block
    saturates, which the exact exponent rule here never does."""
    to_mxfp = torch_reference().to_mxfp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    scales_ref, q_ref = to_mxfp(x, 32, "mxfp8")
    q, scales, _ = mx.quantize_mx(x, (1, 32), E4M3)
    assert torch.equal(scales.view(torch.uint8), scales_ref.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    edge = torch.zeros(1, 32)
    edge[0, 0] = float(np.nextafter(np.float32(448 * 2.0**20), 1e30))
    scales_ref, q_ref = to_mxfp(edge, 32, "mxfp8")
    q, scales, _ = mx.quantize_mx(edge, (1, 32), E4M3)
    assert q_ref.float()[0, 0] == 448 and scales_ref.view(torch.uint8).item() == 147  # clipped
    assert scales.view(torch.uint8).item() == 148 and q.float()[0, 0] < 448  # not clipped


# -- FP4 and NVFP4 ---------------------------------------------------------------------------------------------------
def fp4_test_values():
    grid = FP4_GRID
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]  # every tie
    near = [v + d for v in mids for d in (-1e-3, 1e-3)]
    beyond = [6.5, 7.0, 1e9, 0.1, 0.2499, 0.2501]
    base = grid + mids + near + beyond
    return base + [-v for v in base]


def test_fp4_rounding_every_magnitude_and_tie():
    values = torch.tensor(fp4_test_values(), dtype=torch.float32).clamp(-6, 6)
    codes = mx.fp4_codes(values)
    got = mx.fp4_values(codes).tolist()
    assert got == [oracle_fp4(v) for v in values.tolist()]
    # the codes themselves: sign bit 3, the 8 magnitudes in order
    assert mx.fp4_codes(torch.tensor(FP4_GRID)).tolist() == list(range(8))
    assert mx.fp4_codes(-torch.tensor(FP4_GRID)).tolist() == [8 + c for c in range(8)]  # -0.0 keeps its sign
    # torch's own FP4 reference rounding (test utilities) agrees, code for code
    common = torch_reference()
    assert torch.equal(common._f32_to_floatx_unpacked(values, 2, 1), codes)


def test_fp4_nan_rounds_to_code_zero_on_both_paths():
    """FP4 has no NaN (the block scale carries it) and a NaN's sign differs between devices: the code is 0."""
    v = torch.tensor([math.nan, -math.nan, 1.0, -0.0])
    for noise in (None, torch.full((4,), 0.5)):
        assert mx.fp4_codes(v, noise).tolist() == [0, 0, 2, 8]


def test_fp4_packing_matches_torch_layout():
    common = torch_reference()
    codes = torch.randint(0, 16, (6, 34), dtype=torch.uint8)
    packed = mx.pack_fp4(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (6, 17)
    assert torch.equal(packed.view(torch.uint8), common.pack_uint4(codes))
    assert torch.equal(mx.unpack_fp4(packed), codes)
    assert torch.equal(mx.unpack_fp4(packed.t(), dim=0), codes.t())  # a transposed view unpacks along its rows
    odd = mx.pack_fp4(codes[:, :33])  # an odd length is padded with a zero code
    assert odd.shape == (6, 17) and torch.equal(mx.unpack_fp4(odd)[:, :33], codes[:, :33])
    assert (mx.unpack_fp4(odd)[:, 33] == 0).all()


def test_fp4_stochastic_rounding_picks_the_neighbours_with_the_right_odds():
    # 0.3 lies between 0 and 0.5 (p_up 0.6), 2.25 between 2 and 3 (p_up 0.25), 5.5 between 4 and 6 (p_up 0.75);
    # grid values never move; noise on a fine grid gives the exact fractions
    noise = (torch.arange(1000, dtype=torch.float32) + 0.5) / 1000
    for v, lo, hi, p in ((0.3, 0.0, 0.5, 0.6), (-2.25, -2.0, -3.0, 0.25), (5.5, 4.0, 6.0, 0.75), (3.0, 3.0, 3.0, 0.0)):
        got = mx.fp4_values(mx.fp4_codes(torch.full((1000,), v), noise))
        assert set(got.tolist()) <= {lo, hi}
        assert (got == hi).float().mean().item() == pytest.approx(p if hi != lo else 1.0, abs=1e-3)


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)], ids=str)
def test_nvfp4_cast_bit_exact_against_oracle(tile):
    """Two levels: the float32 tensor scale, E4M3 block scales (rounded, clamped at 2^-9 for blocks far below the
    tensor's amax), FP4 elements; rows of very different magnitude (some blocks hit the lower clamp), ragged last
    blocks (40 x 40 in 16s)."""
    x = every_code_tensor(E4M3, 40, 40, seed=7)
    x[16:32] *= 2.0**-20  # blocks far below the tensor's amax: their scale clamps at the smallest E4M3 subnormal
    packed, scales, g, amax = mx.quantize_nvfp4(x, tile)
    want, want_scales, want_g = oracle_nvfp4(x, tile)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (40, 20)
    assert scales.dtype == torch.float8_e4m3fn and tuple(scales.shape) == grid_shape(tile, x.shape)
    assert g.item() == want_g and amax.item() == x.abs().max().item()
    assert scales.float().tolist() == want_scales
    assert_values(mx.fp4_values(mx.unpack_fp4(packed)).tolist(), want)
    assert (scales.float() == 2.0**-9).any()  # the clamp was exercised


def test_nvfp4_nonfinite_tensor_decodes_to_nan_everywhere():
    for bad in (math.nan, math.inf):
        x = torch.randn(4, 32)
        x[1, 3] = bad
        packed, scales, g, amax = mx.quantize_nvfp4(x, (1, 16))
        assert math.isnan(g.item()) and torch.isnan(scales.float()).all()
        assert torch.isnan(mx.dequantize_nvfp4(packed, scales, g, (1, 16), 32)).all()
        assert not math.isfinite(amax.item())
    packed, scales, g, _ = mx.quantize_nvfp4(torch.zeros(2, 16), (1, 16))  # all zero: g = 1, zeros
    assert g.item() == 1.0 and (mx.dequantize_nvfp4(packed, scales, g, (1, 16), 16) == 0).all()


def test_random_hadamard_transform_is_orthogonal_seeded_and_leaves_the_weight_gradient_alone():
    h = mx.hadamard_matrix()
    assert torch.equal(h, mx.hadamard_matrix())  # the fixed seed: the same transform in every process
    draws = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(mx.HADAMARD_SEED))
    assert mx.HADAMARD_SIGNS == tuple(int(v) * 2 - 1 for v in draws.tolist())  # the constant is the seed's draw
    assert mx.hadamard_sign_mask() == sum(1 << t for t, v in enumerate(mx.HADAMARD_SIGNS) if v < 0)
    assert torch.allclose(h.double() @ h.double().t(), torch.eye(16, dtype=torch.float64), atol=1e-6)
    assert set(h.abs().flatten().tolist()) == {0.25} and (h < 0).any()
    assert not torch.equal(h, mx.hadamard_matrix(seed=1))
    g = torch.Generator().manual_seed(0)
    dy_t, x_t = torch.randn(24, 37, generator=g), torch.randn(40, 37, generator=g)  # 37 tokens: padded to 48
    hy, hx = mx.hadamard_transform(dy_t), mx.hadamard_transform(x_t)
    assert hy.shape == (24, 48)
    assert torch.allclose(hy.double() @ hx.double().t(), dy_t.double() @ x_t.double().t(), atol=1e-4)
    # an outlier token is spread over its 16-token block
    spike = torch.zeros(1, 16)
    spike[0, 5] = 16.0
    assert torch.allclose(mx.hadamard_transform(spike).abs(), torch.full((1, 16), 4.0))


def test_hadamard_transform_is_the_documented_float32_order_bit_for_bit():
    """The transform's float32 arithmetic is fixed (module docstring: signs, butterflies on pairs 1, 2, 4, 8 apart,
    times 1/4), so the fused kernel and this definition give the same bits: checked against numpy float32, element by
    element, on data with a wide exponent range (where another summation order rounds differently), ragged tokens."""
    import numpy as np

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 37, generator=g) * torch.exp2(torch.randint(-12, 12, (5, 37), generator=g).float())
    got = mx.hadamard_transform(x)
    signs = np.array(mx.hadamard_signs(), dtype=np.float32)
    want = np.zeros((5, 48), dtype=np.float32)
    want[:, :37] = x.numpy()
    for r in range(5):
        for b in range(3):
            y = want[r, 16 * b:16 * b + 16] * signs
            h = 1
            while h < 16:
                out = y.copy()
                for i in range(16):
                    if not i & h:
                        out[i], out[i + h] = y[i] + y[i + h], y[i] - y[i + h]
                y, h = out, 2 * h
            want[r, 16 * b:16 * b + 16] = y * np.float32(0.25)
    assert torch.equal(got, torch.from_numpy(want))
    exact = torch.nn.functional.pad(x, (0, 11)).double().view(-1, 16) @ mx.hadamard_matrix().double()
    assert not torch.equal(got.double(), exact.view(5, 48).float().double())  # the order matters at this spread
    assert torch.allclose(got.double(), exact.view(5, 48), rtol=1e-6, atol=1e-6 * float(x.abs().max()))


# -- the scale layout of the native GEMMs ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(128, 4), (200, 9), (3, 1), (256, 130)], ids=str)
def test_swizzle_32_4_4_is_torch_to_blocked(shape):
    from lightning_fp8.modules.scaled_mm import swizzle_32_4_4

    common = torch_reference()
    codes = torch.randint(0, 255, shape, dtype=torch.uint8)
    got = swizzle_32_4_4(codes.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float8_e8m0fnu and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), common.to_blocked(codes))


# -- the GEMMs: emulation = per-block definition ---------------------------------------------------------------------
def _double_block_gemm(a_vals, a_scale, a_tile, b_vals, b_scale, b_tile, ga=1.0, gb=1.0):
    """The per-block definition in float64, element by element (small shapes only)."""
    m, k = a_vals.shape
    n = b_vals.shape[1]
    block = a_tile[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    for k0 in range(0, k, block):
        part = a_vals[:, k0:k0 + block].double() @ b_vals[k0:k0 + block].double()
        sa = a_scale[torch.arange(m) // a_tile[0], k0 // block].double()
        sb = b_scale[k0 // block, torch.arange(n) // b_tile[1]].double()
        out += part * sa[:, None] * sb[None, :]
    return out * ga * gb


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_gemm_reference_is_the_per_block_definition(scaling):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(24, 80, generator=g), torch.randn(40, 80, generator=g) * 3
    if scaling == "mxfp8":
        a, sa, _ = mx.quantize_mx(x, (1, 32))
        bt, sbt, _ = mx.quantize_mx(w, (1, 32))
        a_vals, b_vals, ga, gb, b_tile = a.float(), bt.float().t(), None, None, (32, 1)
    else:
        a, sa, ga, _ = mx.quantize_nvfp4(x, (1, 16))
        bt, sbt, gb, _ = mx.quantize_nvfp4(w, (16, 16))
        a_vals, b_vals, b_tile = mx.fp4_values(mx.unpack_fp4(a)), mx.fp4_values(mx.unpack_fp4(bt)).t(), (16, 16)
    a_tile = (1, 32) if scaling == "mxfp8" else (1, 16)
    out = mx.gemm_reference(a, sa, a_tile, bt.t(), sbt.t(), b_tile, torch.float32, None, ga, gb)
    want = _double_block_gemm(a_vals, sa.float(), a_tile, b_vals, sbt.float().t(), b_tile,
                              ga.item() if ga is not None else 1.0, gb.item() if gb is not None else 1.0)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bf16", [False, True], ids=["f32gemm", "bf16gemm"])
@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_emulated_microscaled_gemm_equals_the_definition(scaling, bf16, out_dtype):
    """Bit for bit where every partial sum is exact (values on a coarse grid), within one output rounding on random
    data; a bias is added before the rounding."""
    from support.helpers import gemm_request

    from lightning_fp8.modules.emulation import emulate

    g = torch.Generator().manual_seed(1)
    for exact in (True, False):
        if exact:
            x = torch.randint(-8, 9, (48, 96), generator=g).float() / 4
            w = torch.randint(-8, 9, (32, 96), generator=g).float() / 2
        else:
            x, w = torch.randn(48, 96, generator=g), torch.randn(32, 96, generator=g)
        bias = torch.randint(-4, 5, (32,), generator=g).float()
        if scaling == "mxfp8":
            a, sa, _ = mx.quantize_mx(x, (1, 32))
            bt, sbt, _ = mx.quantize_mx(w, (1, 32))
            ops = gemm_request(a, sa, (1, 32), bt.t(), sbt.t(), (32, 1), out_dtype, bias)
        else:
            a, sa, ga, _ = mx.quantize_nvfp4(x, (1, 16))
            bt, sbt, gb, _ = mx.quantize_nvfp4(w, (16, 16))
            ops = gemm_request(a, sa, (1, 16), bt.t(), sbt.t(), (16, 16), out_dtype, bias, False, ga, gb)
        got = emulate(ops, bf16=bf16)
        want = mx.gemm_reference(ops.a.data, ops.a.scale_inv, ops.a.tile, ops.b.data, ops.b.scale_inv, ops.b.tile, out_dtype,
                                 bias, ops.a.tensor_scale, ops.b.tensor_scale)
        assert got.dtype == out_dtype
        if exact and scaling == "mxfp8":
            assert torch.equal(got, want)
        else:
            exact32 = mx.gemm_reference(ops.a.data, ops.a.scale_inv, ops.a.tile, ops.b.data, ops.b.scale_inv, ops.b.tile,
                                        torch.float32, bias, ops.a.tensor_scale, ops.b.tensor_scale).double()
            bound = torch.finfo(out_dtype).eps * exact32.abs() + 1e-5 * (exact32.abs().max() + 1)
            assert ((got.double() - exact32).abs() <= bound).all()
