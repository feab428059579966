"""The fused MXFP8 / NVFP4 casts (kernels/triton_microscaled.py) and what the op returns (kernels/microscaled_ops.py):

- under the Triton interpreter (`test_interp_*`, run in a fresh process by `test_interpreter_part`): every output of
  the kernels (data with its zero padding, swizzled scales, the per-tile grid, NVFP4's tensor scales, the amax record,
  the Philox stream's advance) equals the reference path's byte for byte, on the edge cases of
  tests/test_microscaling.py (every code, ties, subnormals, E8M0's range ends, inf / NaN blocks, ragged last blocks,
  NVFP4's block-scale clamp), on input dtypes and strides, on empty tensors; Triton's `tl.rand` equals
  `philox_uniform` bit for bit; a whole FP8Linear step on the kernels equals the step on the reference;
- without the interpreter: the storage layout the scaled GEMM reads without a copy (`gemm_operand_storage`,
  `swizzled_block_scales`), Philox's known-answer vectors, the layer's own stream (no global RNG draw per cast, saved
  with the FP8 state, a resume bit-identical to an uninterrupted run; the same stream under torch.compile), and the
  launches of a layer step on the simulated sm100 path;
- on a CUDA GPU (`pytest -m cuda`; skipped without one): the kernels with the GPU's own FP8 conversion and float32
  arithmetic against the CPU definition, byte for byte.
"""
from __future__ import annotations

import copy
import importlib.util
import io
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from lightning_fp8 import FP8Linear, FP8Recipe, fp8_state_dict, load_fp8_state_dict
from lightning_fp8.kernels import microscaled_ops as ops
from lightning_fp8.kernels.device import simulate_cuda
from lightning_fp8.numerics import microscaling as mx
from lightning_fp8.numerics.formats import E4M3, E5M2
from test_tiled_casts import every_code_tensor

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"
interp = pytest.mark.skipif(not INTERPRETING or not HAS_TRITON or torch.cuda.is_available(),
                            reason="runs inside test_interpreter_part (TRITON_INTERPRET=1 from the process start)")


@pytest.fixture(autouse=True)
def _quiet_emulation():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING or torch.cuda.is_available(),
                    reason="needs triton and no GPU; runs the interp_ tests of this file")
def test_interpreter_part():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k",
                          "interp_"], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1]


# -- helpers ----------------------------------------------------------------------------------------------------------
def run_op(x, scaling, fmt, tile, tile_t, hadamard=False, rng=None, record=True, triton=True, slot=0.0):
    """The op's six outputs, the history and the stream state after it, on the Triton path (interpreter) or the
    reference path CUDA runs without triton."""
    history = torch.zeros(3, 5)
    history[1, 0] = slot
    state = rng.clone() if rng is not None else None
    with simulate_cuda((10, 0), triton=triton):
        from lightning_fp8 import kernels

        assert kernels.triton_enabled_for(x) == (triton and x.dtype != torch.float64)
        outputs = torch.ops.lightning_fp8.microscaled_cast(x, history, 1, scaling, fmt, list(tile), list(tile_t),
                                                            hadamard, None, None, record, state)
    return outputs, history, state


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes; for float32 tensors equal bits except that any NaN equals any NaN (a NaN's payload and sign are
    the device's: the amax record of an inf / NaN tensor)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_kernel_is_reference(x, scaling, fmt, tile, tile_t, hadamard=False, rng=None, record=True, slot=0.0):
    kernel = run_op(x, scaling, fmt, tile, tile_t, hadamard, rng, record, True, slot)
    ref = run_op(x, scaling, fmt, tile, tile_t, hadamard, rng, record, False, slot)
    names = ["data", "scales", "tensor scale", "data^T", "scales^T", "tensor scale^T"]
    for name, a, b in zip(names, kernel[0], ref[0]):
        assert same_bits(a, b), (name, a.shape, b.shape, (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()[:5]
                                 if a.shape == b.shape and a.dtype != torch.float32 else None)
    assert same_bits(kernel[1], ref[1]), (kernel[1], ref[1])
    if rng is not None:
        assert torch.equal(kernel[2], ref[2]) and kernel[2][1] > rng[1]
    return kernel


def mx_range_ends(cols: int = 64) -> torch.Tensor:
    """Rows whose blocks sit at E8M0's range ends and at binade boundaries (tests/test_microscaling.py's amaxes): zero,
    float32 subnormals, 448 * 2^k and one ulp above it, near float32's max."""
    import numpy as np

    amaxes = [0.0, 2.0**-149, 1e-40, 448 * 2.0**-127, 448 * 2.0**-126, 448.0,
              float(np.nextafter(np.float32(448), 1e9)), 448 * 2.0**20,
              float(np.nextafter(np.float32(448 * 2.0**20), 1e30)), 3.0e38, 1.0, 0.875, 1.75]
    x = torch.zeros(len(amaxes), cols)
    for r, a in enumerate(amaxes):
        for block in range(cols // 32):
            x[r, block * 32 + (r + block) % 32] = a
            x[r, block * 32 + (r + block + 7) % 32] = -a / 3
    return x


def with_specials(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0, 3] = math.inf
    x[min(5, x.shape[0] - 1), x.shape[1] // 2] = -math.inf
    x[-1, -1] = math.nan
    return x


def fp4_grid_block_tensor() -> torch.Tensor:
    """Blocks whose decode scale is exactly 1 (tensor amax 6 * 448: g = 1; block amax 6: s = 1), holding every FP4
    magnitude, every midpoint (tie) and near-ties, both signs: the FP4 rounding itself, at every threshold."""
    from test_microscaling import fp4_test_values

    values = [v for v in fp4_test_values() if abs(v) <= 6]
    rows = []
    for start in range(0, len(values), 15):
        chunk = values[start:start + 15]
        rows.append(chunk + [6.0] + [0.0] * (15 - len(chunk)))
    x = torch.tensor(rows, dtype=torch.float32).reshape(-1, 16)
    x = torch.cat([x, torch.zeros(x.shape[0], 16)], 1)
    x[0, 16] = 6 * 448.0
    return x


# -- under the interpreter: kernel == reference -----------------------------------------------------------------------
MX_INPUTS = {
    "every-code-e4m3-70x70": lambda: every_code_tensor(E4M3, 70, 70, seed=3),
    "every-code-e5m2-70x70": lambda: every_code_tensor(E5M2, 70, 70, seed=4),
    "range-ends": mx_range_ends,
    "inf-nan-blocks": lambda: with_specials(every_code_tensor(E4M3, 33, 96, seed=5)),
    "ragged-200x17": lambda: torch.randn(200, 17, generator=torch.Generator().manual_seed(1)) * 1e3,
}


@interp
@pytest.mark.parametrize("case", list(MX_INPUTS))
def test_interp_mx_cast_is_the_reference_bit_for_bit(case):
    x = MX_INPUTS[case]()
    fmt = "e5m2" if "e5m2" in case else "e4m3"
    assert_kernel_is_reference(x, "mxfp8", fmt, (1, 32), (1, 32))
    if case == "every-code-e4m3-70x70":
        for tile, tile_t in (((1, 32), ()), ((), (1, 32))):  # each layout alone (the weight's dgrad re-cast: x^T)
            assert_kernel_is_reference(x, "mxfp8", fmt, tile, tile_t, record=False)


@interp
def test_interp_mx_cast_on_input_dtypes_strides_and_empty_tensors():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 130, generator=g) * torch.exp2(torch.randint(-30, 30, (96, 1), generator=g).float())
    for dtype in (torch.bfloat16, torch.float16):
        assert_kernel_is_reference(x.to(dtype), "mxfp8", "e4m3", (1, 32), (1, 32), slot=1.5)
    assert_kernel_is_reference(x.t(), "mxfp8", "e4m3", (1, 32), (1, 32))  # a transposed (column-major) input
    assert_kernel_is_reference(torch.randn(1, 1), "mxfp8", "e4m3", (1, 32), (1, 32))
    for empty in ((0, 64), (64, 0)):
        outputs, _, _ = assert_kernel_is_reference(torch.empty(empty), "mxfp8", "e4m3", (1, 32), (1, 32))


NVFP4_INPUTS = {
    "every-code-40x40-clamped": lambda: torch.cat([every_code_tensor(E4M3, 16, 40, seed=7),
                                                   every_code_tensor(E4M3, 16, 40, seed=8) * 2.0**-20,
                                                   every_code_tensor(E4M3, 8, 40, seed=9)]),
    "fp4-ties": fp4_grid_block_tensor,
    "ragged-33x200": lambda: torch.randn(33, 200, generator=torch.Generator().manual_seed(3)),
    "inf-nan": lambda: with_specials(torch.randn(70, 100, generator=torch.Generator().manual_seed(4))),
    "zeros": lambda: torch.zeros(20, 48),
}


@interp
@pytest.mark.parametrize("case", list(NVFP4_INPUTS))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_interp_nvfp4_cast_is_the_reference_bit_for_bit(case, rounding):
    """Activations / gradients: 1 x 16 blocks, x^T Hadamard-transformed along the tokens (zero-padded to 16), and not;
    stochastic rounding from the same Philox numbers, the stream advanced alike. Weights: 16 x 16 blocks."""
    x = NVFP4_INPUTS[case]()
    rng = torch.tensor([0x1234_5678_9ABC, 7]) if rounding == "stochastic" else None
    assert_kernel_is_reference(x, "nvfp4", "e2m1", (1, 16), (1, 16), hadamard=True, rng=rng)
    assert_kernel_is_reference(x, "nvfp4", "e2m1", (1, 16), (1, 16), hadamard=False, rng=rng)
    if rounding == "nearest":
        assert_kernel_is_reference(x, "nvfp4", "e2m1", (16, 16), (16, 16))
        assert_kernel_is_reference(x, "nvfp4", "e2m1", (), (16, 16), record=False)  # the dgrad weight alone
    else:
        assert_kernel_is_reference(x, "nvfp4", "e2m1", (), (1, 16), hadamard=True, rng=rng)  # x^T alone


@interp
def test_interp_nvfp4_cast_on_input_dtypes_strides_and_empty_tensors():
    x = torch.randn(64, 80, generator=torch.Generator().manual_seed(5)) * 37.0
    rng = torch.tensor([99, 123456789012])
    for dtype in (torch.bfloat16, torch.float16):
        assert_kernel_is_reference(x.to(dtype), "nvfp4", "e2m1", (1, 16), (1, 16), hadamard=True, rng=rng)
    assert_kernel_is_reference(x.t(), "nvfp4", "e2m1", (1, 16), (1, 16), hadamard=True, rng=rng)
    assert_kernel_is_reference(x.t(), "nvfp4", "e2m1", (16, 16), (16, 16))
    for empty in ((0, 64), (64, 0)):
        assert_kernel_is_reference(torch.empty(empty), "nvfp4", "e2m1", (1, 16), (1, 16), hadamard=True)


@interp
def test_interp_tl_rand_is_philox_uniform_bit_for_bit():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(seed_ptr, off_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        offsets = tl.load(off_ptr + i, mask=i < n, other=0)
        tl.store(out_ptr + i, tl.rand(tl.load(seed_ptr), offsets), mask=i < n)

    offsets = torch.cat([torch.arange(200), torch.tensor([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**62])])
    for seed in (0, 1, -5, 2**62 + 12345, -(2**63), 2**63 - 1):
        out = torch.empty(offsets.numel())
        draw[(1,)](torch.tensor([seed]), offsets, out, offsets.numel(), BLOCK=256)
        assert torch.equal(out.view(torch.int32), mx.philox_uniform(seed, offsets).view(torch.int32)), seed


@interp
@pytest.mark.parametrize("case", ["mxfp8", "nvfp4-rht-sr", "nvfp4-weight"])
def test_interp_op_matches_its_fake_impl_on_the_triton_path(case):
    x = torch.randn(48, 80, generator=torch.Generator().manual_seed(6))
    args = {"mxfp8": ("mxfp8", "e4m3", [1, 32], [1, 32], False, None),
            "nvfp4-rht-sr": ("nvfp4", "e2m1", [1, 16], [1, 16], True, torch.tensor([5, 0])),
            "nvfp4-weight": ("nvfp4", "e2m1", [16, 16], [16, 16], False, None)}[case]
    scaling, fmt, tile, tile_t, hadamard, rng = args
    with simulate_cuda((10, 0), triton=True):
        torch.library.opcheck(torch.ops.lightning_fp8.microscaled_cast.default,
                              (x, torch.zeros(3, 5), 1, scaling, fmt, tile, tile_t, hadamard, None, None, True, rng),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@interp
@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_interp_a_layer_step_on_the_kernels_is_the_step_on_the_reference(scaling):
    """An FP8Linear trained 2 steps on the simulated sm100 path: with the fused kernels (interpreted) and with the
    reference casts, the same outputs, gradients, amax histories and stochastic-rounding stream, bit for bit (the GEMMs
    are the same emulation of the same operands). 37 tokens, 40 -> 24 features: every block ragged somewhere."""
    results = []
    for triton in (True, False):
        torch.manual_seed(0)
        layer = FP8Linear(40, 24, recipe=FP8Recipe(scaling=scaling))
        x = torch.randn(37, 40)
        dy = torch.randn(37, 24)
        run = []
        with simulate_cuda((10, 0), triton=triton):
            for _ in range(2):
                xi = x.clone().requires_grad_(True)
                y = layer(xi)
                y.backward(dy)
                run += [y.detach(), xi.grad, layer.weight.grad.clone()]
                layer.weight.grad = None
        run.append(layer.fp8_meta.amax_history.clone())
        if scaling == "nvfp4":
            run.append(layer.fp8_meta.rng_state.clone())
        results.append(run)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# -- the storage the scaled GEMM reads ------------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(100, 200), (37, 40), (128, 64), (1, 1)], ids=str)
def test_each_layout_is_stored_padded_with_its_scales_swizzled_in_front_of_the_grid(scaling, shape):
    """What the op returns on the CPU path (the fake implementation says the same on every path): data in a
    (round_up(rows, 16), round_up(cols, 32)) buffer whose padding is zeros, of which the Python face returns the
    (rows, cols) view; scales in one buffer, swizzled (= scaled_mm.swizzle_32_4_4 of the grid, one scale per row), then
    the grid, which the face returns. The GEMM helpers give the padded matrix and the swizzled scales back from those
    views without a copy (same memory), and refuse any other tensor."""
    from lightning_fp8.modules.scaled_mm import swizzle_32_4_4

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 10
    fmt = "e4m3" if scaling == "mxfp8" else "e2m1"
    tiles = ((1, 32), (1, 32)) if scaling == "mxfp8" else ((1, 16), (1, 16))
    hadamard = scaling == "nvfp4"
    raw = torch.ops.lightning_fp8.microscaled_cast(x, torch.zeros(3, 5), 0, scaling, fmt, *map(list, tiles), hadamard,
                                                   None, None, True, None)
    casts = ops.microscaled_cast(x, torch.zeros(3, 5), 0, scaling, fmt, *tiles, hadamard_t=hadamard)
    layouts = ops.layouts_of(scaling, shape, *tiles, hadamard)
    reference = [(mx.quantize_mx(src, (1, 32), E4M3) if scaling == "mxfp8" else mx.quantize_nvfp4(src, (1, 16)))
                 for src in (x, mx.hadamard_transform(x.t()) if hadamard else x.t())]
    for layout, (data, scales, _), (storage, scale_buffer), ref in zip(layouts, casts, (raw[:2], raw[3:5]), reference):
        rows, cols = layout.storage_shape
        assert tuple(storage.shape) == (rows, cols) and storage.is_contiguous()
        assert tuple(data.shape) == (layout.rows, layout.data_cols) and data.stride() == (cols, 1)
        assert data.untyped_storage().nbytes() == storage.numel() * storage.element_size()
        assert torch.equal(data.view(torch.uint8), ref[0].view(torch.uint8))
        padding = storage.view(torch.uint8).clone()
        padding[: layout.rows, : layout.data_cols] = 0
        assert not padding.any()
        assert torch.equal(scales.view(torch.uint8), ref[1].view(torch.uint8))
        assert scales.untyped_storage().nbytes() == scale_buffer.numel() == layout.scale_numel
        swizzled = swizzle_32_4_4(ref[1])
        assert torch.equal(scale_buffer[: layout.swizzled_numel], swizzled.view(torch.uint8))
        k32 = -(-layout.cols // 32) * 32
        gemm_cols = k32 // 2 if layout.packed else k32
        padded = ops.gemm_operand_storage(data, -(-layout.rows // 16) * 16, gemm_cols)
        assert padded is not None and padded.data_ptr() == data.data_ptr()  # the same memory: no copy
        assert torch.equal(padded.view(torch.uint8), storage.view(torch.uint8)[:, :gemm_cols])
        got = ops.swizzled_block_scales(scales, layout.rows, layout.blocks)
        assert got is not None and got.data_ptr() + layout.swizzled_numel == scales.data_ptr()
        assert torch.equal(got.view(torch.uint8), swizzled.view(torch.uint8))
        # anything else: None (the planner then pads and swizzles a copy)
        copy_of_data = data.clone(memory_format=torch.contiguous_format)
        assert ops.gemm_operand_storage(copy_of_data, layout.rows, gemm_cols) is None or (
            layout.rows % 16 == 0 and layout.cols % 32 == 0)  # (a copy of an unpadded layout is its storage)
        assert ops.swizzled_block_scales(scales.clone(), layout.rows, layout.blocks) is None
        assert ops.swizzled_block_scales(scales, layout.rows + 128, layout.blocks) is None


def test_nvfp4_weight_scales_are_swizzled_per_row():
    """A 16 x 16 block's scale is repeated over its 16 rows in the swizzled buffer (the GEMM reads one scale per row and
    K block); the grid holds one per block."""
    from lightning_fp8.modules.scaled_mm import swizzle_32_4_4

    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(1))
    (data, grid, g), (data_t, grid_t, g_t) = ops.microscaled_cast(w, torch.zeros(3, 5), 1, "nvfp4", "e2m1", (16, 16),
                                                                  (16, 16), record=False)
    assert grid.shape == (3, 5) and grid_t.shape == (5, 3) and torch.equal(g, g_t)
    assert torch.equal(grid_t.view(torch.uint8), grid.view(torch.uint8).t())  # W and W^T share their blocks
    for matrix_grid, rows, cols in ((grid, 40, 72), (grid_t, 72, 40)):
        per_row = matrix_grid.view(torch.uint8).repeat_interleave(16, 0)[:rows]
        got = ops.swizzled_block_scales(matrix_grid, rows, -(-cols // 16))
        assert torch.equal(got.view(torch.uint8), swizzle_32_4_4(per_row))


@pytest.mark.parametrize("shape", [(128, 4), (200, 9), (3, 1), (256, 130)], ids=str)
def test_swizzle_is_torch_to_blocked_and_swizzled_offset_finds_each_scale(shape):
    from test_microscaling import torch_reference

    codes = torch.randint(0, 255, shape, dtype=torch.uint8)
    swizzled = ops.swizzle_block_scales(codes)
    assert torch.equal(swizzled, torch_reference().to_blocked(codes))
    for r, c in ((0, 0), (shape[0] - 1, shape[1] - 1), (shape[0] // 2, shape[1] // 3)):
        assert swizzled[ops.swizzled_offset(r, c, shape[1])] == codes[r, c]


@pytest.mark.parametrize("case", ["mxfp8", "nvfp4-rht-sr", "nvfp4-weight", "nvfp4-t-only-sr"])
@pytest.mark.parametrize("path", ["cpu", "cuda_reference"])
def test_op_matches_its_fake_impl_with_the_stream_argument(case, path):
    """opcheck with the Philox stream (a mutated argument), on the CPU path and the CUDA reference path (the Triton
    path: `test_interp_op_matches_its_fake_impl_on_the_triton_path`)."""
    x = torch.randn(45, 80, generator=torch.Generator().manual_seed(6))
    args = {"mxfp8": ("mxfp8", "e4m3", [1, 32], [1, 32], False, None),
            "nvfp4-rht-sr": ("nvfp4", "e2m1", [1, 16], [1, 16], True, torch.tensor([5, 0])),
            "nvfp4-weight": ("nvfp4", "e2m1", [16, 16], [16, 16], False, None),
            "nvfp4-t-only-sr": ("nvfp4", "e2m1", [], [1, 16], True, torch.tensor([5, 10]))}[case]
    scaling, fmt, tile, tile_t, hadamard, rng = args
    context = simulate_cuda((10, 0), triton=False) if path == "cuda_reference" else _nothing()
    with context:
        torch.library.opcheck(torch.ops.lightning_fp8.microscaled_cast.default,
                              (x, torch.zeros(3, 5), 1, scaling, fmt, tile, tile_t, hadamard, None, None, True, rng),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                          "test_aot_dispatch_dynamic"))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- the random stream ----------------------------------------------------------------------------------------------------
def test_philox_known_answers():
    """Random123's known-answer vectors for philox4x32_10 (kat_vectors): counter, key -> the four output words."""
    kats = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
            ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
            ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
             (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in kats:
        words = mx.philox4x32(*(torch.tensor([v]) for v in counter), *(torch.tensor([v]) for v in key))
        assert [int(w) for w in words] == list(want)


def test_philox_uniform_is_in_zero_one_and_uniform():
    u = mx.philox_uniform(42, torch.arange(200_000))
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert not torch.equal(u[:1000], mx.philox_uniform(43, torch.arange(1000)))  # the seed changes the stream
    assert torch.equal(u[500:600], mx.philox_uniform(42, torch.arange(500, 600)))  # a counter stream: offsets index it


def test_the_layer_stream_is_drawn_once_saved_and_never_touches_the_global_generator():
    """Only recipes that draw in-kernel numbers (NVFP4 with stochastic gradients) have the stream; its seed comes from
    torch's generator when the layer adopts the recipe (torch.manual_seed reproduces it); a training step leaves the
    global generator where it was (dropout's stream is not shifted); the state is in fp8_state_dict, and a state without
    it (an older checkpoint) loads, keeping the fresh stream."""
    assert "rng_state" not in dict(FP8Linear(32, 32, recipe=FP8Recipe(scaling="mxfp8")).fp8_meta.named_buffers())
    assert "rng_state" not in dict(FP8Linear(32, 32, recipe=FP8Recipe(scaling="nvfp4", rounding="nearest"))
                                   .fp8_meta.named_buffers())
    torch.manual_seed(3)
    layer = FP8Linear(32, 48, recipe=FP8Recipe(scaling="nvfp4"))
    torch.manual_seed(3)
    again = FP8Linear(32, 48, recipe=FP8Recipe(scaling="nvfp4"))
    assert torch.equal(layer.fp8_meta.rng_state, again.fp8_meta.rng_state) and layer.fp8_meta.rng_state[1] == 0
    before = torch.get_rng_state()
    x = torch.randn(40, 32, requires_grad=True, generator=torch.Generator().manual_seed(0))
    layer(x).square().sum().backward()
    assert torch.equal(torch.get_rng_state(), before)
    assert int(layer.fp8_meta.rng_state[1]) == 40 * 48 + 48 * 48  # dY and dY^T H (40 tokens padded to 48)
    state = fp8_state_dict(layer)
    assert torch.equal(state["fp8_meta.rng_state"], layer.fp8_meta.rng_state)
    old = {k: v for k, v in state.items() if not k.endswith("rng_state")}
    fresh = FP8Linear(32, 48, recipe=FP8Recipe(scaling="nvfp4"))
    kept = fresh.fp8_meta.rng_state.clone()
    load_fp8_state_dict(fresh, old)
    assert torch.equal(fresh.fp8_meta.rng_state, kept)
    load_fp8_state_dict(fresh, state)
    assert torch.equal(fresh.fp8_meta.rng_state, layer.fp8_meta.rng_state)
    # the cast finds the stream through the history it is given, also after the buffers were moved or copied
    from lightning_fp8.modules.layer_state import stochastic_rounding_state

    for module in (fresh.to(torch.device("cpu")), copy.deepcopy(fresh), fresh.double()):
        meta = module.fp8_meta
        assert stochastic_rounding_state(meta.amax_history) is meta.rng_state


def _nvfp4_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(FP8Linear(24, 64, recipe=FP8Recipe(scaling="nvfp4")), nn.GELU(),
                         FP8Linear(64, 16, recipe=FP8Recipe(scaling="nvfp4")))


def _train(model, optimizer, steps, start):
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(40, 24, generator=g), torch.randn(40, 16, generator=g)
        loss = (model(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("with_fp8_state", [True, False])
def test_nvfp4_resume_is_bit_identical_to_an_uninterrupted_run(with_fp8_state):
    """6 steps straight against 3 steps, a checkpoint (model, FP8 state, optimizer) through torch.save, and 3 steps in a
    fresh process's worth of objects (another seed: nothing carried over but the file): the same losses and weights,
    bit for bit, because the stochastic rounding stream resumes at the saved offset. Without the FP8 state (the stream
    restarts at a fresh seed) the resumed run differs: the comparison can see it."""
    uninterrupted = _nvfp4_model(0)
    straight = _train(uninterrupted, torch.optim.AdamW(uninterrupted.parameters(), lr=1e-2), 6, 0)

    model = _nvfp4_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = _train(model, optimizer, 3, 0)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "fp8": fp8_state_dict(model), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _nvfp4_model(1)
    resumed.load_state_dict(saved["model"])
    if with_fp8_state:
        load_fp8_state_dict(resumed, saved["fp8"])
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    second = _train(resumed, resumed_optimizer, 3, 3)
    assert first == straight[:3]
    if with_fp8_state:
        assert second == straight[3:]
        for (name, a), b in zip(uninterrupted.named_parameters(), resumed.parameters()):
            assert torch.equal(a, b), name
        assert torch.equal(fp8_state_dict(uninterrupted)["0.fp8_meta.rng_state"],
                           fp8_state_dict(resumed)["0.fp8_meta.rng_state"])
    else:
        assert second != straight[3:]


# -- what a layer step launches (simulated sm100, meta tensors) ---------------------------------------------------------
def test_a_microscaled_layer_step_launches_one_cast_per_operand_and_three_gemms():
    """Under the engine, at 8192 x 4096 x 4096 (tests/test_launch_budget.py's `layer_launches`): MXFP8 one `mx_cast` per
    operand (x and W in forward, W^T kept for backward; dY in backward) and three GEMMs: 6; NVFP4 an amax pass and a cast
    per operand: 9. Ragged token counts (200, 197) change nothing (the casts pad); under FSDP2 (no W^T kept) the backward
    casts the weight again: one cast (NVFP4: two launches) more."""
    from test_launch_budget import layer_launches

    expected = {
        "mxfp8": (["mx_cast", "mx_cast", "_scaled_mm_v2"], ["mx_cast", "_scaled_mm_v2", "_scaled_mm_v2"]),
        "nvfp4": (["nvfp4_amax", "nvfp4_cast", "nvfp4_amax", "nvfp4_cast", "_scaled_mm_v2"],
                  ["nvfp4_amax", "nvfp4_cast", "_scaled_mm_v2", "_scaled_mm_v2"]),
    }
    for scaling, (forward, backward) in expected.items():
        recipe = FP8Recipe(scaling=scaling)
        for tokens in (8192, 200, 197):
            got = layer_launches(recipe, tokens=tokens, capability=(10, 0), under_engine=True)[:2]
            assert got == (forward, backward), (scaling, tokens, got)
        _, backward_fsdp2, _ = layer_launches(recipe, capability=(10, 0), under_engine=True, keep_weight_transpose=False)
        recast = ["mx_cast"] if scaling == "mxfp8" else ["nvfp4_amax", "nvfp4_cast"]
        assert backward_fsdp2 == backward[: len(recast)] + recast + backward[len(recast):]


def test_compiled_layer_draws_the_same_stream_as_eager():
    """torch.compile(fullgraph=True) of an NVFP4 layer: the cast finds the layer's stream through the history inside
    the compiled backward, mutates it in place, and rounds with the same numbers as eager: the gradients are equal bit
    for bit (the casts and GEMMs are opaque ops over the same operands) and the stream ends at the same offset."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = FP8Linear(64, 48, recipe=FP8Recipe(scaling="nvfp4"))
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(40, 64, generator=g), torch.randn(40, 48, generator=g)
    grads = []
    for module, call in ((eager, eager), (twin, compiled)):
        for _ in range(2):
            xi = x.clone().requires_grad_(True)
            call(xi).backward(dy)
        grads.append((xi.grad, module.weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert torch.equal(eager.fp8_meta.rng_state, twin.fp8_meta.rng_state)
    assert int(twin.fp8_meta.rng_state[1]) == 2 * (40 * 48 + 48 * 48)
    torch._dynamo.reset()


# -- on a CUDA GPU: the kernels' hardware conversions against the CPU definition ----------------------------------------
def _op_on(device, x, scaling, fmt, tile, tile_t, hadamard, rng):
    history = torch.zeros(3, 5, device=device)
    state = rng.clone().to(device) if rng is not None else None
    outputs = torch.ops.lightning_fp8.microscaled_cast(x.to(device), history, 1, scaling, fmt, list(tile), list(tile_t),
                                                        hadamard, None, None, True, state)
    return [t.cpu() for t in outputs] + [history.cpu()] + ([state.cpu()] if state is not None else [])


CUDA_CASES = ([(f"mx-{name}", "mxfp8", build) for name, build in MX_INPUTS.items()]
              + [(f"nvfp4-{name}", "nvfp4", build) for name, build in NVFP4_INPUTS.items()])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [name for name, _, _ in CUDA_CASES])
def test_cuda_fused_casts_are_the_cpu_definition_bit_for_bit(case):
    """What the interpreter cannot show: the fused kernels on a GPU (its FP8 conversion, float32 arithmetic and
    Philox) give the bytes of the torch definition on the CPU, every output, with stochastic rounding too."""
    from lightning_fp8 import kernels

    _, scaling, build = next(c for c in CUDA_CASES if c[0] == case)
    x = build()
    assert kernels.triton_enabled_for(x.cuda())
    if scaling == "mxfp8":
        variants = [("e5m2" if "e5m2" in case else "e4m3", (1, 32), (1, 32), False, None)]
    else:
        variants = [("e2m1", (1, 16), (1, 16), True, None), ("e2m1", (1, 16), (1, 16), True, torch.tensor([3, 11])),
                    ("e2m1", (16, 16), (16, 16), False, None)]
    for dtype in (torch.float32, torch.bfloat16):
        for fmt, tile, tile_t, hadamard, rng in variants:
            gpu = _op_on("cuda", x.to(dtype), scaling, fmt, tile, tile_t, hadamard, rng)
            cpu = _op_on("cpu", x.to(dtype), scaling, fmt, tile, tile_t, hadamard, rng)
            for i, (a, b) in enumerate(zip(gpu, cpu)):
                assert same_bits(a, b) if a.dtype != torch.int64 else torch.equal(a, b), (case, dtype, fmt, tile, i)
