"""The CUDA contract suite: the GPU code path, proven on CPU (docs/status.md lists what it covers and what only a GPU
can show).

Every user trains on a GPU; the machines this runs on have none. `kernels.device.simulate_cuda(capability)` makes
CPU and meta tensors take the paths CUDA takes (the torch reference casts, or the Triton kernels under the Triton
interpreter; the scaled-GEMM planning for that architecture), and this file checks those paths with what a CPU can run:

- ops: `torch.library.opcheck` of every custom op on every implementation path (CPU twin, torch reference, Triton
  under the interpreter): the fake implementations (what torch.compile plans with) describe the real outputs;
- GEMM contract: every scaled-GEMM call a full FP8Linear (and FP8Conv2d / FP8Conv1d) forward + backward makes, for
  every recipe, output dtype, shape (convolution geometry) that matters and architecture, replayed on meta tensors
  against torch's own checks and against the rules of lightning_fp8/modules/scaled_mm.py for what meta cannot see;
- GEMM numerics: the same argument preparation run through torch 2.13's CPU `_scaled_mm` equals the emulation;
- compile: inductor with the implementations CUDA uses;
- host syncs: none inside FP8Linear's or FP8Conv2d's forward / backward on the CUDA path.

Tests whose names contain "interp_" need the Triton interpreter from the start of the process;
`test_interpreter_part` runs them in a fresh process with TRITON_INTERPRET=1.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lightning_fp8.kernels import triton_version
from lightning_fp8.kernels.device import simulate_cuda
from lightning_fp8.numerics.formats import TORCH_FEATURES, torch_has
from lightning_fp8.recipe import SCALING_NEEDS_TORCH

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"
interp = pytest.mark.skipif(not INTERPRETING or not HAS_TRITON or torch.cuda.is_available(),
                            reason="runs inside test_interpreter_part (TRITON_INTERPRET=1 from the process start)")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _needs(feature):
    """Skip where the running torch lacks `feature` (numerics/formats.py TORCH_FEATURES), naming the release."""
    since = TORCH_FEATURES[feature].since
    return pytest.mark.skipif(not torch_has(feature), reason=f"needs torch >= {since[0]}.{since[1]} ({feature})")


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING or torch.cuda.is_available(),
                    reason="needs triton and no GPU; runs the interp_ tests of this file")
@pytest.mark.skipif(HAS_TRITON and triton_version() < (3, 6),
                    reason=f"needs triton >= 3.6 (pyproject's dev extra); this is triton "
                           f"{'.'.join(map(str, triton_version()))} (torch {torch.__version__}'s pin), whose interpreter "
                           "cannot run the kernels' loops over a computed bound ('only 0-dimensional arrays can be "
                           "converted to Python scalars')")
def test_interpreter_part():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k", "interp_"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1]


# -- ops: opcheck on every implementation path --------------------------------------------------------------------
#: the paths an op can take on CPU: the CPU twins, the torch reference CUDA runs without triton, and (interpreter
#: only) the Triton kernels CUDA runs
PATHS = {"cpu_twin": None, "cuda_reference": dict(capability=(9, 0), triton=False)}


def _path(name):
    simulation = PATHS[name] if name in PATHS else dict(capability=(9, 0), triton=True)
    return simulate_cuda(**simulation) if simulation is not None else _nothing()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _inputs(shape, layout, seed=0):
    """A float32 tensor of `shape` in a row-major or a transposed (column-major) layout, with values across FP8's
    range (a few elements saturate E4M3 at scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape if layout == "row" else shape[::-1], generator=g) * torch.exp2(
        torch.randint(-8, 10, shape if layout == "row" else shape[::-1], generator=g).float())
    return x if layout == "row" else x.t()


def _cast_cases():
    history = lambda: torch.zeros(3, 5)  # noqa: E731
    warm = lambda: torch.tensor([[0.0, 3.0, 1.0, 0, 0]] * 3)  # noqa: E731  (a history that sizes delayed scales)
    for layout in ("row", "t"):
        x = _inputs((48, 80), layout)
        yield f"fp8_cast-{layout}", torch.ops.lightning_fp8.fp8_cast.default, (
            x, torch.tensor(2.0), "e4m3", None, None, None, True, True, True)
        yield f"fp8_cast-amax-{layout}", torch.ops.lightning_fp8.fp8_cast.default, (
            x, torch.tensor(0.5), "e5m2", None, None, None, False, False, True)
        for scaling, hist in (("delayed", warm), ("delayed", history), ("current", history), ("none", history)):
            for write_t in (False, True):
                yield (f"scaled_cast-{scaling}-{'warm' if hist is warm else 'cold'}-t{int(write_t)}-{layout}",
                       torch.ops.lightning_fp8.scaled_cast.default,
                       (x, hist(), 1, "e4m3", scaling, True, 0, True, None, None, write_t, True))
        # x^T's token columns padded to 16 (45 tokens: 3 zero columns), as the layers ask on the CUDA path
        yield (f"scaled_cast-current-pad16-{layout}", torch.ops.lightning_fp8.scaled_cast.default,
               (_inputs((45, 80), layout), history(), 1, "e4m3", "current", True, 0, True, None, None, True, True, 16))
        for tiles in (((1, 0), (1, 0)), ((1, 128), (1, 128)), ((128, 128), (128, 128)), ((1, 32), ())):
            yield (f"tiled_cast-{tiles}-{layout}", torch.ops.lightning_fp8.tiled_cast.default,
                   (x, history(), 0, "e4m3", list(tiles[0]), list(tiles[1]), 0, True, None, True))
        for tiles, pad_to in ((((1, 128), (1, 128)), 128), (((1, 0), (1, 0)), 16)):  # x^T's tokens padded
            yield (f"tiled_cast-{tiles}-pad{pad_to}-{layout}", torch.ops.lightning_fp8.tiled_cast.default,
                   (x, history(), 0, "e4m3", list(tiles[0]), list(tiles[1]), 0, True, None, True, pad_to))
        # microscaling: MX both layouts; NVFP4 with stochastic rounding and the Hadamard transform of x^T (40 tokens
        # padded to 48 by the transform: x^T's shape differs from x's), and 16 x 16 weight blocks
        # (rng_state: the op's last argument, required: kernels/microscaled_ops.py)
        yield (f"microscaled_cast-mxfp8-{layout}", torch.ops.lightning_fp8.microscaled_cast.default,
               (x, history(), 0, "mxfp8", "e4m3", [1, 32], [1, 32], False, None, None, True, None))
        yield (f"microscaled_cast-nvfp4-rht-{layout}", torch.ops.lightning_fp8.microscaled_cast.default,
               (_inputs((40, 80), layout), history(), 2, "nvfp4", "e2m1", [1, 16], [1, 16], True, torch.rand(40, 80),
                torch.rand(80, 48), True, None))
    # no tokens (an MoE expert that receives none) / no features: empty scales, as the fake impl says
    for empty in ((0, 256), (64, 0)):
        yield (f"tiled_cast-rowwise-empty{empty[0]}x{empty[1]}", torch.ops.lightning_fp8.tiled_cast.default,
               (torch.empty(empty), history(), 0, "e4m3", [1, 0], [1, 0], 0, True, None, True))
    yield ("microscaled_cast-nvfp4-weight", torch.ops.lightning_fp8.microscaled_cast.default,
           (_inputs((48, 80), "row"), history(), 1, "nvfp4", "e2m1", [16, 16], [16, 16], False, None, None, False,
            None))
    yield "close_scaling_step", torch.ops.lightning_fp8.close_scaling_step.default, (
        torch.tensor([[5.0, 3.0, 1.0, 0, 0]] * 3), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
        torch.tensor([448.0, 448.0, 57344.0]), torch.tensor([True] * 3), torch.tensor([True] * 3),
        torch.tensor([True] * 3), torch.zeros(3), torch.tensor([True] * 3), True)


CAST_CASES = {name: (op, args) for name, op, args in _cast_cases()}
#: the cases as parameters: the microscaled casts write E8M0 / FP4, skipped on a torch without that dtype
CAST_CASE_PARAMS = [pytest.param(name, marks=[_needs(SCALING_NEEDS_TORCH[scaling]) for scaling in ("mxfp8", "nvfp4")
                                              if name.startswith(f"microscaled_cast-{scaling}")])
                    for name in CAST_CASES]
#: opcheck's tests that apply to ops that take and return float8 tensors ("test_schema" runs arithmetic on the
#: inputs, which CPU float8 tensors do not implement); the cast ops take no float8 input, so they get all four
CAST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, args, utils):
    clone = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731  (ops mutate the histories)
    torch.library.opcheck(op, tuple(clone(a) for a in args), test_utils=utils)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", CAST_CASE_PARAMS)
def test_cast_ops_match_their_fake_impls(case, path):
    """The fake implementation of each cast op (shapes, dtypes, strides: what torch.compile plans with) equals what
    the op returns on this path. The CUDA reference path returned a column-major x^T from tiled_cast while the fake
    promised a contiguous one: inductor failed a stride assertion on every rowwise / blockwise layer."""
    op, args = CAST_CASES[case]
    with _path(path):
        _opcheck(op, args, CAST_UTILS)


#: the fused fine-grained casts on the Triton path: each kernel family once (opcheck calls an op many times, and the
#: interpreter is slow), a transposed input and both paddings among them
TRITON_TILED_CASES = ["tiled_cast-((1, 128), (1, 128))-pad128-row", "tiled_cast-((1, 0), (1, 0))-pad16-t",
                      "tiled_cast-((128, 128), (128, 128))-row", "tiled_cast-((1, 32), ())-row",
                      "tiled_cast-rowwise-empty0x256", "tiled_cast-rowwise-empty64x0"]


@interp
@pytest.mark.parametrize("case", [c for c in CAST_CASES if not c.startswith(("tiled_cast", "microscaled_cast"))]
                         + TRITON_TILED_CASES)
def test_interp_cast_ops_match_their_fake_impls_on_the_triton_path(case):
    op, args = CAST_CASES[case]
    from lightning_fp8 import kernels

    with _path("triton"):
        assert kernels.triton_enabled_for(args[0]), "the Triton path must be the one under test"
        _opcheck(op, args, CAST_UTILS)


# -- GEMM contract: every scaled-GEMM call of a layer, per architecture --------------------------------------------
from lightning_fp8 import FP8Linear, FP8Recipe  # noqa: E402
from lightning_fp8.modules.gemm import record_gemms  # noqa: E402
from lightning_fp8.modules.scaled_mm import (  # noqa: E402
    BLOCKWISE,
    MICROSCALED,
    MXFP8,
    NVFP4,
    ROWWISE,
    TENSORWISE,
    V2,
    Refusal,
    TORCH_RULES,
    ScaledMMCall,
    check_call,
    plan_scaled_mm,
    rules_for_torch,
    scaling_kind,
    target_for,
)

#: the torch release that runs the suite: its rules are the ones replayed
INSTALLED_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
#: the CUDA (cuBLASLt) the running torch was built with; a CPU build is taken to have the current wheels' CUDA 13
INSTALLED_CUDA = tuple(int(v) for v in torch.version.cuda.split(".")[:2]) if torch.version.cuda else (13, 0)
ARCHS = {"sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}
RECIPES = {
    "delayed": FP8Recipe(),
    "current": FP8Recipe(scaling="current"),
    "rowwise": FP8Recipe(scaling="rowwise"),
    "blockwise": FP8Recipe(scaling="blockwise"),
}
#: the Blackwell recipes (numerics/microscaling.py): their GEMM kinds run natively on sm100 (both) and sm120 (MX)
#: (on a torch without their dtypes, numerics/formats.py TORCH_FEATURES, they refuse and their contract is skipped)
MICROSCALED_RECIPES = {scaling: FP8Recipe(scaling=scaling) for scaling in ("mxfp8", "nvfp4")
                       if torch_has(SCALING_NEEDS_TORCH[scaling])}
#: the microscaled recipes as parameters: each skipped, by name, on a torch without its dtype
MICROSCALED_PARAMS = [pytest.param(scaling, marks=_needs(SCALING_NEEDS_TORCH[scaling]))
                      for scaling in ("mxfp8", "nvfp4")]
#: torch.nn.functional.scaled_mm (v2): the GPU GEMMs of blockwise, mxfp8 and nvfp4 (without it they are refused)
HAS_V2 = torch_has("scaled_mm_v2")
needs_v2 = _needs("scaled_mm_v2")
OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: (tokens M, in K, out N) run for real on CPU: K/128 = 6 (the padded 128x128 scale layout), token counts that are
#: not multiples of 16 or 128, dimensions not multiples of 16 (padded), one 128-block dimensions
SMALL_SHAPES = [(256, 768, 768), (100, 128, 768), (128, 768, 128), (33, 40, 24)]
#: LLaMA-like shapes, run on meta tensors (the casts' fake implementations, which the opcheck tests above prove equal
#: to the real outputs' shapes and strides on every path): K, N in {4096, 11008, 14336}
LARGE_SHAPES = [(1000, 4096, 11008), (4096, 11008, 4096), (8192, 4096, 14336), (2048, 14336, 4096)]


def layer_gemms(recipe, shape, out_dtype, bias, device="cpu", triton=False):
    """The GEMM requests of one FP8Linear forward + backward (training), on the casts a CUDA machine runs (the
    torch reference, or the Triton kernels where `triton`), every operand as the layer hands it over."""
    m, k, n = shape
    with simulate_cuda((9, 0), triton=triton), record_gemms() as records:
        torch.manual_seed(0)
        layer = FP8Linear(k, n, bias=bias, device=device, dtype=out_dtype, recipe=recipe)
        x = torch.randn(m, k, device=device, dtype=out_dtype, requires_grad=True)
        layer(x).float().square().sum().backward()
    assert len(records) == 3, "forward, dgrad and wgrad"
    return records


def expected_native(arch, ops, torch_version=None):
    """Whether the GEMM must run on the GPU's scaled GEMM (True) or be refused (False), stated independently of the
    planner's code from the rules of lightning_fp8/modules/scaled_mm.py, those of the torch that runs the suite (or
    `torch_version`): the per-release data `TORCH_RULES`, the running torch's v2 API (blockwise, MX, NVFP4 need
    `torch.nn.functional.scaled_mm`: numerics/formats.py TORCH_FEATURES) and the CUDA it was built with (cuBLASLt's
    rowwise scaling from 12.9, its block scale modes from 12.8 (MX, NVFP4) and 12.9 (blockwise)). (A blockwise
    recipe's GEMM whose contraction is one 128-block is rowwise scaling: one scale per row and column.)"""
    m, k, n = ops.shape
    kind = scaling_kind(ops)
    rules = rules_for_torch(torch_version or INSTALLED_TORCH)
    if ops.a.data.dtype == E5 and ops.b.data.dtype == E5:
        return False
    if kind == TENSORWISE:
        return True
    if kind == ROWWISE:  # cuBLASLt (sm90) writes any output; torch's CUTLASS kernel what its release's rules say
        cutlass = rules.arch(ARCHS[arch][0]).rowwise_backend == "cutlass" or INSTALLED_CUDA < (12, 9)
        written = ops.out_dtype if ops.out_dtype in OUT_DTYPES.values() else torch.float32
        return not cutlass or (written in rules.cutlass_rowwise_out_dtypes and ops.b.data.dtype == E4)
    if kind in MICROSCALED + BLOCKWISE and not HAS_V2:  # their GEMMs go through torch.nn.functional.scaled_mm only
        return False
    if INSTALLED_CUDA < ((12, 8) if kind in MICROSCALED else (12, 9)):
        return False
    if kind == MXFP8:  # Blackwell's MX tensor cores; torch's MX GEMM takes e4m3 only
        return arch in ("sm100", "sm120") and ops.a.data.dtype == ops.b.data.dtype == E4
    if kind == NVFP4:  # FP4 tensor cores: sm100 here (sm120's path through torch 2.13 is not established)
        return arch == "sm100"
    assert kind in BLOCKWISE, kind
    # the token count is free: the layer pads the weight-gradient GEMM's contraction (x^T's and dY^T's token columns)
    # to whole 128-blocks in the cast; M must be a multiple of 4 (1x128 scales), N of 16 (torch's check of mat_b)
    shape_ok = k % 128 == 0 and m % 4 == 0 and (n % 128 == 0 if kind == BLOCKWISE[0] else n % 16 == 0)
    return arch == "sm90" and shape_ok and ops.a.data.dtype == ops.b.data.dtype == E4


def check_on_every_arch(records, scaling, torch_version=None):
    """Plan every GEMM for every architecture under the rules of the installed torch (or of `torch_version`, another
    release's rules: planned and checked against the rules, not replayed on this torch's meta checks)."""
    kinds = {"delayed": {TENSORWISE}, "current": {TENSORWISE}, "rowwise": {ROWWISE}, "blockwise": {ROWWISE, *BLOCKWISE},
             "mxfp8": {MXFP8}, "nvfp4": {NVFP4}}
    for arch, capability in ARCHS.items():
        target = target_for(capability, torch_version)
        for ops in records:
            assert scaling_kind(ops) in kinds[scaling], (scaling, scaling_kind(ops))
            plan = plan_scaled_mm(ops, target)
            where = (f"{arch} (torch {target.torch_version}), {scaling}, GEMM {tuple(ops.shape)} {ops.a.data.dtype} x "
                     f"{ops.b.data.dtype} -> {ops.out_dtype}")
            if not expected_native(arch, ops, torch_version):
                assert isinstance(plan, Refusal) and plan.reason, f"{where}: must be refused with a reason, got {plan}"
                continue
            assert isinstance(plan, ScaledMMCall), f"{where}: refused ({plan})"
            assert plan.kind == scaling_kind(ops), where
            assert check_call(plan) == [], f"{where}: {check_call(plan)}"
            if torch_version is None:
                plan.on_meta().launch()  # torch's own checks of the call (meta tensors are checked as CUDA ones)


@pytest.mark.parametrize("release", [rules.since for rules in TORCH_RULES] + [INSTALLED_TORCH],
                         ids=lambda v: f"torch{v[0]}.{v[1]}")
def test_gemm_contract_under_each_torch_releases_rules(release):
    """The planner follows the rules of the torch it plans for, whatever torch runs the suite: every GEMM of a
    rowwise and a per-tensor layer, every output dtype, with and without bias, planned for each release range of
    `TORCH_RULES` (2.13's table among them) and checked against that range's rules; and the rules of the installed
    torch are the ones a plain target (the planner in use) gets."""
    for scaling in ("rowwise", "delayed"):
        for out in OUT_DTYPES.values():
            for bias in (False, True):
                check_on_every_arch(layer_gemms(RECIPES[scaling], SMALL_SHAPES[3], out, bias), scaling, release)
    assert target_for((8, 9)).torch_rules == rules_for_torch(INSTALLED_TORCH)
    sm89 = target_for((8, 9), release)
    fp32_native = torch.float32 in rules_for_torch(release).cutlass_rowwise_out_dtypes
    ops = layer_gemms(RECIPES["rowwise"], SMALL_SHAPES[0], torch.float32, False)[0]
    assert isinstance(plan_scaled_mm(ops, sm89), ScaledMMCall) == fp32_native
    fp16 = plan_scaled_mm(layer_gemms(RECIPES["rowwise"], SMALL_SHAPES[0], torch.float16, False)[0], sm89)
    if torch.float16 in rules_for_torch(release).cutlass_rowwise_out_dtypes:
        # the zero bias that keeps the fp16 kernel writing fp16, only where its kernel without a bias writes bf16
        assert (fp16.bias is not None) == sm89.cutlass_rowwise_fp16_needs_bias


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("out", list(OUT_DTYPES))
@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_contract_cpu(shape, scaling, out, with_bias):
    """Every GEMM of an FP8Linear forward + backward, built from the torch reference casts CUDA runs without triton,
    planned for sm89 / sm90 / sm100 / sm120: valid under torch's checks and the per-architecture rules, or refused
    with a reason (then emulated, warned once) exactly where the rules say."""
    check_on_every_arch(layer_gemms(RECIPES[scaling], shape, OUT_DTYPES[out], with_bias), scaling)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("out", list(OUT_DTYPES))
@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("shape", LARGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_contract_large_shapes_on_meta(shape, scaling, out, with_bias):
    check_on_every_arch(layer_gemms(RECIPES[scaling], shape, OUT_DTYPES[out], with_bias, device="meta"), scaling)
    check_on_every_arch(layer_gemms(RECIPES[scaling], shape, OUT_DTYPES[out], with_bias, device="meta", triton=True),
                        scaling)


@interp
@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("shape", [(100, 128, 768), (33, 40, 24)], ids=lambda s: "x".join(map(str, s)))
def test_interp_gemm_contract_with_triton_casts(shape, scaling):
    """The same with the Triton casts (interpreted): x^T and dY^T written by the cast kernel, no copies."""
    check_on_every_arch(layer_gemms(RECIPES[scaling], shape, torch.bfloat16, True, triton=True), scaling)


@pytest.mark.parametrize("scaling", MICROSCALED_PARAMS)
def test_gemm_contract_microscaled(scaling):
    """Every GEMM of an FP8Linear forward + backward under the mxfp8 / nvfp4 recipe, for every output dtype, with and
    without bias (on a LLaMA shape, on meta; two combinations on the small shapes run for real, with ragged blocks:
    K = 40, 33 tokens: padded K, odd token counts): planned for sm100 as `torch.nn.functional.scaled_mm` calls with swizzled E8M0 / E4M3 (+ float32) scales
    that torch's own v2 checks accept (replayed on meta), MX also on sm120; refused with a reason on sm89 / sm90 (and
    NVFP4 on sm120), then emulated. The weight_grad="high_precision" variant has no weight-gradient FP8 GEMM."""
    recipe = MICROSCALED_RECIPES[scaling]
    cases = [(shape, device, out, bias) for shape, device in ((SMALL_SHAPES[0], "cpu"), (SMALL_SHAPES[3], "cpu"))
             for out, bias in ((torch.bfloat16, False), (torch.float32, True))]
    cases += [(LARGE_SHAPES[0], "meta", out, bias) for out in OUT_DTYPES.values() for bias in (False, True)]
    for shape, device, out, bias in cases:
        records = layer_gemms(recipe, shape, out, bias, device=device)
        check_on_every_arch(records, scaling)
        for ops in records:
            for arch in ("sm89", "sm90"):
                reason = plan_scaled_mm(ops, target_for(ARCHS[arch])).reason
                assert "Blackwell" in reason or "sm100" in reason, reason
    m, k, n = SMALL_SHAPES[0]
    with simulate_cuda((10, 0)), record_gemms() as records:
        layer = FP8Linear(k, n, recipe=dataclasses.replace(recipe, weight_grad="high_precision"))
        layer(torch.randn(m, k, requires_grad=True)).float().square().sum().backward()
    assert len(records) == 2 and layer.weight.grad is not None  # forward and dgrad; wgrad in BF16


@_needs("float8_e8m0fnu")
@_needs("float4_e2m1fn_x2")
@needs_v2
def test_microscaled_scales_are_swizzled_e8m0_and_two_level_e4m3():
    """The scale arguments of the sm100 calls: MX E8M0, NVFP4 [E4M3 blocks, float32 tensor scale], each swizzled into
    128 x 4 tiles and flat: numel round_up(rows, 128) * round_up(ceil(K / block), 4), with rows = M for mat_a and N
    for mat_b; the scales of the unswizzled layout (torch's meta check also counts elements only) put at the swizzled
    positions (numerics tests: `swizzle_32_4_4` equals torch's `to_blocked`)."""
    for scaling, block in (("mxfp8", 32), ("nvfp4", 16)):
        forward = layer_gemms(MICROSCALED_RECIPES[scaling], (100, 768, 256), torch.bfloat16, False)[0]
        call = plan_scaled_mm(forward, target_for((10, 0)))
        assert call.api == V2 and call.kind == scaling_kind(forward)
        blocks = -(-768 // block)
        assert call.scale_a.numel() == 128 * (-(-blocks // 4) * 4) and call.scale_b.numel() == 256 * (-(-blocks // 4) * 4)
        if scaling == "mxfp8":
            assert call.scale_a.dtype == call.scale_b.dtype == torch.float8_e8m0fnu and call.tensor_scale_a is None
        else:
            assert call.mat_a.dtype == torch.float4_e2m1fn_x2 and call.mat_a.shape == (100, 384)
            assert call.scale_a.dtype == torch.float8_e4m3fn and call.tensor_scale_a.dtype == torch.float32
            assert call.tensor_scale_a.numel() == call.tensor_scale_b.numel() == 1
        # row r, block c of mat_a's scales sits at the swizzled offset (cuBLAS "1D block scaling factors layout")
        r, c = 70, 5
        offset = (r // 128 * (-(-blocks // 4)) + c // 4) * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
        assert call.scale_a.view(torch.uint8)[offset] == forward.a.scale_inv.view(torch.uint8)[r, c]


# -- torch's CUDA rule for the v2 calls, which its meta check does not replay ---------------------------------------
#: torch's CUDA acceptance of a `torch.nn.functional.scaled_mm` (v2) call, written as data from its source
#: (pytorch/pytorch aten/src/ATen/native/cuda/ScaledBlas.cpp, `_scaled_mm_cuda_v2_out`): `scale_kernel_dispatch` picks
#: the implementation whose recipe check accepts the recipe lists and scale dtypes (aten/src/ATen/cuda/
#: CUDAScaledBlas.cpp `check_mxfp8_recipe`, `check_nvfp4_recipe`, `check_nvfp4_recipe_single_scale`,
#: `check_deepseek_recipe`); `check_swizzle_lengths` then wants one swizzle per scale for the swizzled implementations
#: ({MXFP8_MXFP8, 1}, {NVFP4_NVFP4, 2}, {NVFP4_NVFP4_SINGLE_SCALE, 1}: "swizzle_a must have 2 values, got 1"), and
#: `_scaled_mxfp8_mxfp8` / `_scaled_nvfp4_nvfp4` want the block scales' swizzle (the first) SWIZZLE_32_4_4. The
#: tensor-wise scale of two-level NVFP4 has no layout: NO_SWIZZLE, as torch's own sample of the call passes it
#: (torch/testing/_internal/common_methods_invocations.py, `sample_inputs_scaled_mm_v2`: `[SWIZZLE_32_4_4,
#: NO_SWIZZLE]`). torch's meta check (`meta_scaled_mm_v2`) reads `swizzle_a[0]` only, so replaying a call on meta
#: tensors cannot see a missing second swizzle: on a GPU such a call is refused (and then emulated).
#: implementation -> per operand (data dtype, [(ScalingType, scale dtype, SwizzleType or None: no swizzle required)])
TORCH_CUDA_V2_RULE = {
    "mxfp8_mxfp8": [(E4, [("BlockWise1x32", getattr(torch, "float8_e8m0fnu", None), "SWIZZLE_32_4_4")])] * 2,
    "nvfp4_nvfp4": [(getattr(torch, "float4_e2m1fn_x2", None), [("BlockWise1x16", E4, "SWIZZLE_32_4_4"),
                                                               ("TensorWise", torch.float32, "NO_SWIZZLE")])] * 2,
    "nvfp4_nvfp4_single_scale": [(getattr(torch, "float4_e2m1fn_x2", None),
                                  [("BlockWise1x16", E4, "SWIZZLE_32_4_4")])] * 2,
    "block_1x128_128x128": [(E4, [("BlockWise1x128", torch.float32, None)]),
                            (E4, [("BlockWise128x128", torch.float32, None)])],
    "block_1x128_1x128": [(E4, [("BlockWise1x128", torch.float32, None)])] * 2,
}
#: the implementations whose swizzle lists torch checks (`check_swizzle_lengths`)
TORCH_CUDA_SWIZZLED = ("mxfp8_mxfp8", "nvfp4_nvfp4", "nvfp4_nvfp4_single_scale")


def _as_list(value):
    """What torch.nn.functional.scaled_mm hands to the op for a scale / recipe / swizzle argument
    (`_expand_single_value`, `_list_or_empty`)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def torch_cuda_v2_violations(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None, swizzle_b=None,
                             **_):
    """What torch's CUDA code (TORCH_CUDA_V2_RULE) refuses in a v2 call, or [] when it takes it."""
    operands = []
    for data, scales, recipes, swizzles in ((mat_a, scale_a, recipe_a, swizzle_a),
                                            (mat_b, scale_b, recipe_b, swizzle_b)):
        operands.append((data.dtype, [(r.name, s.dtype) for r, s in zip(_as_list(recipes), _as_list(scales))],
                         len(_as_list(scales)), [w.name for w in _as_list(swizzles)]))
    for impl, rule in TORCH_CUDA_V2_RULE.items():
        if all(dtype == want_dtype and len(recipes) == len(want) == n_scales
               and all((r, s) == (wr, ws) for (r, s), (wr, ws, _) in zip(recipes, want))
               for (dtype, recipes, n_scales, _), (want_dtype, want) in zip(operands, rule)):
            break
    else:
        return [f"no implementation of torch's v2 scaled GEMM takes {[op[:2] for op in operands]}"]
    problems = []
    if impl in TORCH_CUDA_SWIZZLED:
        for name, (_, _, n_scales, swizzles), (_, want) in zip("ab", operands, rule):
            if len(swizzles) != n_scales:
                problems.append(f"{impl}: swizzle_{name} must have {n_scales} value(s), got {len(swizzles)} "
                                f"({swizzles})")
                continue
            for got, (_, _, wanted) in zip(swizzles, want):
                if wanted is not None and got != wanted:
                    problems.append(f"{impl}: swizzle_{name} {swizzles}, wants {[w for _, _, w in want]}")
    return problems


def _v2_calls_of_every_planned_block_scaled_gemm():
    """(where, call) for every v2 call the planner makes for the GEMMs of an mxfp8 / nvfp4 / blockwise layer, on the
    architectures that run them natively, every output dtype, with and without bias, small shapes for real and a
    LLaMA shape on meta."""
    recipes = {**MICROSCALED_RECIPES, "blockwise": FP8Recipe(scaling="blockwise", format="e4m3")}
    cases = [(shape, "cpu", out, bias) for shape in (SMALL_SHAPES[0], SMALL_SHAPES[3])
             for out, bias in ((torch.bfloat16, False), (torch.float32, True))]
    cases += [(LARGE_SHAPES[0], "meta", out, bias) for out in OUT_DTYPES.values() for bias in (False, True)]
    for name, recipe in recipes.items():
        for shape, device, out, bias in cases:
            for ops in layer_gemms(recipe, shape, out, bias, device=device):
                for arch in ("sm90", "sm100", "sm120"):
                    call = plan_scaled_mm(ops, target_for(ARCHS[arch]))
                    if isinstance(call, ScaledMMCall) and call.api == V2:
                        yield f"{name} {arch} {tuple(ops.shape)} -> {out}{' bias' if bias else ''}", call


@needs_v2
def test_v2_calls_pass_torchs_cuda_rule_for_recipes_and_swizzles(monkeypatch):
    """Every v2 call the planner issues (MXFP8 and NVFP4 on sm100 / sm120, blockwise on sm90), as it reaches
    `torch.nn.functional.scaled_mm`, against torch's CUDA rule written as data above, not only its meta check: one
    recipe and one swizzle per scale. The NVFP4 call passed one swizzle per operand (SWIZZLE_32_4_4, for two scales):
    meta accepted it (it reads swizzle_a[0]), a real sm100 would refuse every NVFP4 GEMM ("swizzle_a must have 2
    values, got 1") and run it emulated."""
    import torch.nn.functional as F

    seen, real = [], F.scaled_mm

    def scaled_mm(*args, **kwargs):
        names = ("mat_a", "mat_b", "scale_a", "recipe_a", "scale_b", "recipe_b")
        seen.append(torch_cuda_v2_violations(**dict(zip(names, args)), **{
            {"scale_recipe_a": "recipe_a", "scale_recipe_b": "recipe_b"}.get(k, k): v for k, v in kwargs.items()}))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", scaled_mm)
    kinds = set()
    cpu_checks_swizzles = _cpu_build_checks_swizzle_lengths()
    for where, call in _v2_calls_of_every_planned_block_scaled_gemm():
        seen.clear()
        call.on_meta().launch()  # torch's meta check too
        assert len(seen) == 1 and seen[0] == [], f"{where}: {call.describe()}: {seen}"
        kinds.add((call.kind, call.target.name))
        if cpu_checks_swizzles and call.kind in MICROSCALED and call.mat_a.device.type == "cpu":
            # torch's own swizzle check (the CUDA one) on the CPU build, which then refuses swizzled scales
            with pytest.raises(ValueError, match="CPU does not support swizzle"):
                call.launch()
    assert kinds >= {(MXFP8, "sm100"), (MXFP8, "sm120"), (NVFP4, "sm100"), (BLOCKWISE[0], "sm90")}, kinds


def _cpu_build_checks_swizzle_lengths() -> bool:
    """Whether this torch's CPU build runs the swizzle-length check its CUDA build runs (`check_swizzle_lengths`,
    shared from torch 2.15: the CPU build of 2.13 refuses every swizzle before counting them)."""
    import torch.nn.functional as F

    fp4 = torch.zeros(128, 32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    scales = [torch.zeros(128 * 4, dtype=E4), torch.ones((), dtype=torch.float32)]
    recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    try:
        F.scaled_mm(fp4, fp4.t(), scales, recipe, scales, recipe, swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
                    swizzle_b=F.SwizzleType.SWIZZLE_32_4_4)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        return "must have 2 values" in str(error)
    return False


@_needs("float8_e8m0fnu")
@_needs("float4_e2m1fn_x2")
@needs_v2
def test_the_cuda_rule_written_as_data_refuses_what_torch_refuses():
    """The rule above against the calls torch's CUDA code refuses: NVFP4 with one swizzle for two scales (what the
    planner passed), MX without a swizzle, NVFP4 with its recipes in the other order."""
    import torch.nn.functional as F

    fp4 = torch.empty(128, 64, dtype=torch.float4_e2m1fn_x2, device="meta")
    blocks = torch.empty(128 * 8, dtype=E4, device="meta")
    scale = torch.empty((), dtype=torch.float32, device="meta")
    nv = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swz, none = F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE
    two = ([blocks, scale], nv)
    assert torch_cuda_v2_violations(fp4, fp4.t(), *two, *two, [swz, none], [swz, none]) == []
    assert "must have 2 value(s), got 1" in torch_cuda_v2_violations(fp4, fp4.t(), *two, *two, swz, swz)[0]
    assert torch_cuda_v2_violations(fp4, fp4.t(), [blocks, scale], nv[::-1], [blocks, scale], nv[::-1], [swz, none],
                                    [swz, none])[0].startswith("no implementation")
    e4 = torch.empty(128, 64, dtype=E4, device="meta")
    mx = torch.empty(128 * 4, dtype=torch.float8_e8m0fnu, device="meta")
    assert "got 0" in torch_cuda_v2_violations(e4, e4.t(), mx, F.ScalingType.BlockWise1x32, mx,
                                               F.ScalingType.BlockWise1x32)[0]


def test_blockwise_128x128_scales_are_padded_to_four_k_blocks():
    """cuBLASLt reads 128x128 scales with the K-block dimension padded to a multiple of 4: (L4, N/128), strides
    (1, L4). K = 768 (6 blocks -> L4 = 8), 11008 (86 -> 88), 128 (1 -> 4). The unpadded layout (what torch._scaled_mm
    v1 accepts) gives silent wrong answers on the GPU; torch's v2 meta check rejects it. On a torch without the v2
    API the GEMM is refused, never handed to v1."""
    for k in (128, 768, 11008):
        records = layer_gemms(RECIPES["blockwise"], (256, k, 256), torch.bfloat16, False, device="meta")
        forward = records[0]
        call = plan_scaled_mm(forward, target_for((9, 0)))
        if not HAS_V2:
            assert isinstance(call, Refusal) and "torch.nn.functional.scaled_mm" in call.reason, call
            continue
        kb = k // 128
        l4 = -(-kb // 4) * 4
        assert call.api == V2 and call.scale_b.shape == (l4, 2) and call.scale_b.stride() == (1, l4)
        call.on_meta().launch()
        unpadded = torch.empty_strided((kb, 2), (1, kb), dtype=torch.float32, device="meta")
        if kb % 4:
            wrong = type(call)(**{**call.on_meta().__dict__, "scale_b": unpadded})
            assert any("cuBLASLt reads (L4, N/128)" in problem for problem in check_call(wrong))
            if META_CHECKS_V2_SCALES:
                with pytest.raises(RuntimeError, match="scale b must have shape"):
                    wrong.launch()


def _meta_checks_v2_scales() -> bool:
    """Whether this torch's meta implementation of the v2 scaled GEMM checks the scales per recipe (torch 2.13; from
    2.15 that check is in the C++ meta function, which meta tensors do not run: they are sized, not checked)."""
    import torch.nn.functional as F

    if not torch_has("scaled_mm_v2"):
        return False  # no v2 scaled GEMM to check anything
    a = torch.empty(256, 256, dtype=E4, device="meta")
    wrong = torch.empty(3, 3, dtype=torch.float32, device="meta")
    try:
        F.scaled_mm(a, a.t(), wrong, F.ScalingType.BlockWise1x128, wrong, F.ScalingType.BlockWise128x128)
    except (RuntimeError, ValueError):
        return True
    return False


META_CHECKS_V2_SCALES = _meta_checks_v2_scales()


# -- GEMM contract of FP8 convolutions ------------------------------------------------------------------------------
from torch import nn  # noqa: E402

from lightning_fp8.modules.conv import FP8Conv1d, FP8Conv2d  # noqa: E402

#: (name, the nn.Conv to convert, input shape, channels-last input): the geometries whose GEMMs differ (the unfolded
#: input, the stride-1 input gradient as a convolution, the strided one as GEMM + col2im, one GEMM triple per group,
#: a 1x1 convolution's input read as it is, a Conv1d as the (1, k) case)
CONV_CASES = [
    ("3x3", lambda: nn.Conv2d(32, 64, 3, padding=1), (2, 32, 6, 5), False),
    ("stride2", lambda: nn.Conv2d(32, 64, 3, stride=2, padding=1), (2, 32, 7, 6), False),
    ("groups2", lambda: nn.Conv2d(32, 64, 3, padding=1, groups=2), (2, 32, 5, 5), False),
    ("dilation2", lambda: nn.Conv2d(32, 64, 3, padding=2, dilation=2), (2, 32, 5, 6), False),
    # M = K = N = 128 in all three GEMMs: the one case whose blockwise GEMMs run natively on sm90
    ("1x1", lambda: nn.Conv2d(128, 128, 1), (2, 128, 8, 8), False),
    ("conv1d", lambda: nn.Conv1d(32, 64, 5, stride=2, padding=2), (3, 32, 21), False),
    ("channels_last", lambda: nn.Conv2d(32, 64, 3, stride=2, padding=1), (2, 32, 7, 6), True),
]


def conv_gemms(scaling, case, device="cpu", triton=False, dtype=torch.bfloat16):
    """The GEMM requests of one FP8 convolution forward + backward (training) on the casts a CUDA machine runs:
    3 per group (forward, input gradient, weight gradient), every operand as the layer hands it over."""
    _, build, shape, channels_last = case
    with simulate_cuda((9, 0), triton=triton), record_gemms() as records:
        torch.manual_seed(0)
        conv = build().to(device=device, dtype=dtype)
        fp8 = (FP8Conv1d if isinstance(conv, nn.Conv1d) else FP8Conv2d).from_conv(conv, RECIPES[scaling])
        x = torch.randn(shape, device=device, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        fp8(x.requires_grad_()).float().square().sum().backward()
    assert len(records) == 3 * conv.groups, "forward, dgrad and wgrad per group"
    return records


def assert_b_column_major(records):
    """The second operand of every GEMM reaches it column-major, the layout the scaled GEMM reads: the planner
    passes it on as it is instead of copying it (`scaled_mm._packed`)."""
    for ops in records:
        k, n = ops.b.data.shape
        assert n == 1 or ops.b.data.stride(0) == 1 and ops.b.data.stride(1) == k, (tuple(ops.shape), ops.b.data.stride())
        if ops.b.data.device.type == "cpu" and k % 16 == 0 and n % 16 == 0:
            plan = plan_scaled_mm(ops, target_for((9, 0)))
            if isinstance(plan, ScaledMMCall):
                assert plan.mat_b.data_ptr() == ops.b.data.data_ptr(), "the planner copied B"


@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_gemm_contract_cpu(case, scaling):
    """Every GEMM of an FP8Conv2d / FP8Conv1d forward + backward (the unfolded input, the stride-1 input gradient as
    a convolution of dy, the strided one as GEMM + col2im, one GEMM triple per group), built from the torch reference
    casts CUDA runs without triton, planned for sm89 / sm90 / sm100 / sm120: valid under torch's checks and the
    per-architecture rules, or refused with a reason exactly where the rules say; B column-major, so not copied."""
    records = conv_gemms(scaling, case)
    check_on_every_arch(records, scaling)
    assert_b_column_major(records)


@pytest.mark.parametrize("scaling", list(RECIPES))
def test_conv_gemm_contract_on_meta(scaling):
    """The same on meta tensors, without triton and with the Triton casts (which write dy^T in the cast)."""
    for triton in (False, True):
        for case in (CONV_CASES[1], CONV_CASES[2]):
            records = conv_gemms(scaling, case, device="meta", triton=triton)
            check_on_every_arch(records, scaling)
            assert_b_column_major(records)


def test_blockwise_weight_gradient_with_in_features_not_a_multiple_of_16_is_refused_at_planning():
    """Defect: the planner accepted a 1x128 x 1x128 GEMM (the weight gradient: N = in_features) whose N is not a
    multiple of 16, which torch's scaled GEMM refuses ("both dimensions of mat2 divisible by 16"): the launch failed
    on the GPU and the GEMM ran emulated after a warning, while the plan claimed it was native. Now refused with the
    reason, and torch's own check agrees with the planner on every GEMM of such a layer."""
    recipe = FP8Recipe(scaling="blockwise", format="e4m3")
    records = layer_gemms(recipe, (256, 100, 256), torch.bfloat16, False)
    wgrad = records[2]
    assert tuple(wgrad.shape) == (256, 256, 100)
    plan = plan_scaled_mm(wgrad, target_for((9, 0)))
    # (a torch without the v2 API refuses every blockwise GEMM, for that reason first)
    assert isinstance(plan, Refusal)
    assert ("multiple of 16" if HAS_V2 else "torch.nn.functional.scaled_mm") in plan.reason, plan.reason
    check_on_every_arch(records, "blockwise")


def test_blockwise_at_token_counts_not_multiples_of_128_runs_the_scaled_gemm_on_sm90():
    """Every GEMM of a blockwise e4m3 layer at 200 tokens is planned for sm90's blockwise scaled GEMM: the casts pad
    the weight-gradient GEMM's contraction (the tokens) to whole 128-blocks with zeros, and the forward and dgrad GEMMs
    take any token count (a multiple of 4). Before, all three were refused ("M, K and N multiples of 128") and ran
    emulated, with only a one-time warning: most real token counts."""
    recipe = FP8Recipe(scaling="blockwise", format="e4m3")
    records = layer_gemms(recipe, (200, 256, 384), torch.bfloat16, True)
    forward, dgrad, wgrad = records
    assert forward.shape == (200, 256, 384) and dgrad.shape == (200, 384, 256)
    assert wgrad.shape == (384, 256, 256)  # the contraction: 200 tokens padded to 256
    assert torch.equal(wgrad.a.data.float()[:, 200:], torch.zeros(384, 56))  # padding: zeros
    if not HAS_V2:  # the running torch's rule: no v2 API, every blockwise GEMM refused (then emulated)
        for ops in records:
            call = plan_scaled_mm(ops, target_for((9, 0)))
            assert isinstance(call, Refusal) and "torch.nn.functional.scaled_mm" in call.reason, call
        return
    for ops in records:
        call = plan_scaled_mm(ops, target_for((9, 0)))
        assert isinstance(call, ScaledMMCall) and call.kind in BLOCKWISE, call
        assert check_call(call) == []
        call.on_meta().launch()
    # and the casts wrote the scales where the GEMM reads them: no copy in the plan
    fwd_call = plan_scaled_mm(forward, target_for((9, 0)))
    assert fwd_call.scale_b.untyped_storage().data_ptr() == forward.b.scale_inv.untyped_storage().data_ptr()
    assert fwd_call.scale_a.untyped_storage().data_ptr() == forward.a.scale_inv.untyped_storage().data_ptr()


# -- GEMM numerics: the planned calls run through torch's CPU scaled GEMM ------------------------------------------
from support.helpers import gemm_request  # noqa: E402

from lightning_fp8.modules.emulation import emulate  # noqa: E402


def _grid_operands(m, k, n, kind, out_dtype, with_bias, exact, seed=0):
    """FP8 operands a (M, K) row-major and b (K, N) column-major (as the layer hands them over), with tensorwise or
    rowwise dequant scales. exact: values on a 1/8 grid and power-of-two scales, so every partial sum is exact in
    float32 whatever the order and a bias exact in the output dtype."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        a = (torch.randint(-64, 65, (m, k), generator=g).float() / 8).to(E4)
        b = (torch.randint(-64, 65, (n, k), generator=g).float() / 8).to(E4).t()
    else:
        a = (torch.randn(m, k, generator=g) * 6).to(E4)
        b = (torch.randn(n, k, generator=g) * 6).to(E4).t()
    if kind == "tensorwise":
        sa, sb, tiles = torch.tensor(2.0**-3), torch.tensor(0.5), (None, None)
    else:
        sa = 2.0 ** torch.randint(-3, 2, (m, 1), generator=g).float()
        sb = 2.0 ** torch.randint(-3, 2, (1, n), generator=g).float()
        if not exact:
            sa, sb = sa * 1.37, sb * 0.61
        tiles = ((1, 0), (0, 1))
    bias = (torch.randint(-32, 33, (n,), generator=g).float() / 4).to(out_dtype) if with_bias else None
    return gemm_request(a, sa, tiles[0], b, sb, tiles[1], out_dtype, bias)


def _emulation(ops):
    return emulate(ops, bf16=False)


NUMERIC_SHAPES = [(48, 256, 40), (33, 40, 24), (16, 64, 128)]


def _cpu_build_runs_scaled_mm(kind):
    """Whether this torch's CPU build runs `torch._scaled_mm` with `kind` scales (before torch 2.8 it has no CPU
    kernel at all; 2.8's takes tensorwise scales only; 2.13's both)."""
    a = _grid_operands(16, 32, 16, kind, torch.bfloat16, False, True)
    try:
        torch._scaled_mm(a.a.data, a.b.data, scale_a=a.a.scale_inv.reshape(() if kind == "tensorwise" else (16, 1)),
                         scale_b=a.b.scale_inv.reshape(() if kind == "tensorwise" else (1, 16)),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


CPU_SCALED_MM = {kind: _cpu_build_runs_scaled_mm(kind) for kind in ("tensorwise", "rowwise")}
CPU_SCALED_MM_KINDS = [pytest.param(kind, marks=pytest.mark.skipif(
    not CPU_SCALED_MM[kind], reason=f"needs a torch whose CPU build runs {kind} torch._scaled_mm (torch 2.13 does; "
                                    f"this is torch {torch.__version__})")) for kind in CPU_SCALED_MM]


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise"])
def test_simulated_gpu_launches_on_cpu_only_what_the_cpu_build_runs(kind):
    """Under a simulated GPU a planned call runs on torch's CPU scaled GEMM where this torch's CPU build has one for
    its kind (`ScaledMMCall.runs_on_cpu`), and is emulated where not: a layer trains either way, with no refusal
    (torch 2.6 and 2.7 have no CPU `_scaled_mm`: every simulated GEMM raised FP8GemmRefusedError)."""
    ops = _grid_operands(32, 64, 48, kind, torch.bfloat16, False, True)
    call = plan_scaled_mm(ops, target_for(ARCHS["sm90"]))
    assert isinstance(call, ScaledMMCall) and call.runs_on_cpu == CPU_SCALED_MM[kind]
    with simulate_cuda((9, 0)), record_gemms() as records:
        torch.manual_seed(0)
        layer = FP8Linear(64, 48, recipe=RECIPES["rowwise" if kind == "rowwise" else "current"])
        layer(torch.randn(32, 64, requires_grad=True)).float().square().sum().backward()
    assert len(records) == 3 and torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("shape", NUMERIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("out", list(OUT_DTYPES))
@pytest.mark.parametrize("kind", CPU_SCALED_MM_KINDS)
@pytest.mark.parametrize("arch", ["sm89", "sm90"])
def test_planned_calls_on_cpu_scaled_mm_equal_the_emulation(arch, kind, out, with_bias, shape):
    """The argument preparation of the CUDA path (padding of K and N, packed layouts, scale shapes, the bias passed
    or added after, the zero fp16 bias of the CUTLASS rowwise kernel) run with real numbers through torch 2.13's CPU
    scaled GEMM: equal to the emulation bit for bit where every partial sum is exact, within one output rounding
    otherwise. (sm89 plans differ from sm90's: CUTLASS rowwise.)"""
    out_dtype = OUT_DTYPES[out]
    target = target_for(ARCHS[arch])
    for exact in (True, False):
        ops = _grid_operands(*shape, kind, out_dtype, with_bias, exact)
        call = plan_scaled_mm(ops, target)
        if isinstance(call, Refusal):  # where the running torch's rules refuse it (2.13: sm89 rowwise float32)
            assert not expected_native(arch, ops), call
            continue
        result, reference = call.launch(), _emulation(ops)
        assert result.dtype == out_dtype and result.shape == reference.shape and result.is_contiguous()
        if exact:
            assert torch.equal(result, reference)
        else:
            # one output rounding, plus float32 accumulation in another order (and, for scales that are not powers
            # of two, the emulation's dequantized operands rounded once more): k * 2^-23 of the sum of |products|
            magnitude = (ops.a.data.double().abs() * ops.a.scale_inv.double()) @ (
                ops.b.data.double().abs() * ops.b.scale_inv.double())
            bound = (torch.finfo(out_dtype).eps * reference.double().abs() + torch.finfo(out_dtype).tiny
                     + shape[1] * 2.0**-23 * magnitude)
            assert ((result.double() - reference.double()).abs() <= bound).all()


# -- failures at launch ----------------------------------------------------------------------------------------------
def _launch_as_a_gpu(monkeypatch):
    """The real `ScaledMMCall.launch`, made to run every planned call under the simulated GPU as a GPU would: torch's
    CPU scaled GEMM where this torch's CPU build has one for the call's kind (CPU_SCALED_MM: unchanged there), else the
    call's own arithmetic in float32 (a torch whose CPU build has none, 2.6 / 2.7: the tests below are about what
    happens around a launch, not its numbers)."""
    from lightning_fp8.modules.scaled_mm import ScaledMMCall as Call

    real_launch = Call.launch

    def launch(self):
        if CPU_SCALED_MM[self.kind]:
            return real_launch(self)
        out = (self.mat_a.float() * self.scale_a) @ (self.mat_b.float() * self.scale_b)
        return self.finished((out if self.bias is None else out + self.bias.float()).to(self.out_dtype))

    monkeypatch.setattr(Call, "runs_on_cpu", property(lambda self: True))
    return launch


def _run(ops, allow_emulation=False):
    from lightning_fp8.modules.gemm import fp8_gemm

    return fp8_gemm(ops.a, ops.b, ops.out_dtype, ops.bias, allow_emulation=allow_emulation)


def test_a_device_failure_propagates_and_never_turns_the_gemm_kind_to_emulation(monkeypatch):
    """An out-of-memory error (or a sticky CUDA error) raised by the scaled GEMM is the device failing, not the call
    being refused: it propagates as it is, also with allow_emulation, and the next call runs the scaled GEMM again."""
    from lightning_fp8.modules import gemm
    from lightning_fp8.modules.scaled_mm import ScaledMMCall as Call

    ops = _grid_operands(32, 64, 48, "rowwise", torch.bfloat16, False, True)
    launches, failures = [], [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")]
    real_launch = _launch_as_a_gpu(monkeypatch)

    def launch(self):
        launches.append(self.kind)
        if failures:
            raise failures.pop()
        return real_launch(self)

    monkeypatch.setattr(Call, "launch", launch)
    gemm._emulated_refusals.clear()
    with simulate_cuda((9, 0)):
        with pytest.raises(torch.OutOfMemoryError):
            _run(ops, allow_emulation=True)
        _run(ops, allow_emulation=True)  # the same signature: the scaled GEMM again, not emulation
        assert launches == [ROWWISE, ROWWISE]
        failures.append(RuntimeError("CUDA error: an illegal memory access was encountered"))
        with pytest.raises(RuntimeError, match="illegal memory access"):
            _run(ops, allow_emulation=True)
    assert not gemm._emulated_refusals


def _refusing_launch(monkeypatch):
    """Make torch refuse every planned call without a bias, as a cuBLASLt without a kernel for it would."""
    from lightning_fp8.modules.scaled_mm import ScaledMMCall as Call

    real_launch, launches = _launch_as_a_gpu(monkeypatch), []

    def launch(self):
        launches.append(self.bias is not None)
        if self.bias is None:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return real_launch(self)

    monkeypatch.setattr(Call, "launch", launch)
    return launches


def test_a_planned_call_torch_refuses_raises_naming_the_call(monkeypatch):
    """A call the planner issued and torch refused at run time is a planning bug, not a reason to slow down 10x in
    silence: FP8GemmRefusedError names the call (kind, API, every tensor's shape, strides and dtype) and torch's
    message, and says how to opt in to emulation."""
    from lightning_fp8.modules import gemm
    from lightning_fp8.modules.gemm import FP8GemmRefusedError

    launches = _refusing_launch(monkeypatch)
    gemm._emulated_refusals.clear()
    ops = _grid_operands(32, 64, 48, "rowwise", torch.bfloat16, False, True)
    with simulate_cuda((9, 0)):
        with pytest.raises(FP8GemmRefusedError) as error:
            _run(ops)
    text = str(error.value)
    for part in ("rowwise scaled GEMM", "torch._scaled_mm", "mat_a=(32, 64) strides (64, 1) float8_e4m3fn",
                 "mat_b=(64, 48) strides (1, 64) float8_e4m3fn", "scale_a=(32, 1)", "scale_b=(1, 48)", "sm90",
                 "CUBLAS_STATUS_NOT_SUPPORTED", "FP8Recipe(allow_emulation=True)"):
        assert part in text, (part, text)
    assert launches == [False] and not gemm._emulated_refusals


def test_a_refused_call_is_emulated_by_opt_in_and_remembered_per_exact_signature(monkeypatch):
    """With allow_emulation the refused signature (shapes, strides, dtypes, bias, fast accumulation) is emulated from
    then on, warned once; a call that differs in any of them still tries the scaled GEMM."""
    from lightning_fp8.modules import gemm
    from lightning_fp8.modules.gemm import FP8EmulationWarning

    launches = _refusing_launch(monkeypatch)
    gemm._emulated_refusals.clear()
    gemm._warned.clear()
    plain = _grid_operands(32, 64, 48, "rowwise", torch.bfloat16, False, True)
    biased = _grid_operands(32, 64, 48, "rowwise", torch.bfloat16, True, True)
    with simulate_cuda((9, 0)):
        with pytest.warns(FP8EmulationWarning, match="NOT_SUPPORTED"):
            assert torch.equal(_run(plain, allow_emulation=True), _emulation(plain))
        _run(plain, allow_emulation=True)  # remembered: not launched again
        _run(biased, allow_emulation=True)  # another signature: launched
    assert launches == [False, True]
    gemm._emulated_refusals.clear()


def test_allow_emulation_reaches_every_gemm_of_a_layer(monkeypatch):
    """FP8Recipe(allow_emulation=...) is what the layer's three GEMMs run under: a refusing torch fails a training
    step of a default recipe, and the opt-in recipe trains through it with the emulation's result."""
    from lightning_fp8.modules import gemm
    from lightning_fp8.modules.gemm import FP8EmulationWarning, FP8GemmRefusedError

    _refusing_launch(monkeypatch)
    gemm._emulated_refusals.clear()
    # float32 GEMM outputs where the running torch's rules plan them for sm90 (cuBLASLt's rowwise scaling), else bf16
    # (torch's CUTLASS rowwise kernel before 2.10, or a CUDA older than 12.9: float32 is refused at planning, never
    # launched)
    fp32_planned = expected_native("sm90", _grid_operands(32, 64, 48, "rowwise", torch.float32, False, True))
    dtype = torch.float32 if fp32_planned else torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=dtype)
    for allow in (False, True):
        with simulate_cuda((9, 0)):
            layer = FP8Linear(64, 48, bias=False, dtype=dtype,
                              recipe=FP8Recipe(scaling="rowwise", allow_emulation=allow))
            if not allow:
                with pytest.raises(FP8GemmRefusedError, match="rowwise"):
                    layer(x.requires_grad_())
                continue
            with pytest.warns(FP8EmulationWarning):
                layer(x.requires_grad_()).float().sum().backward()
        assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    gemm._emulated_refusals.clear()


# -- host synchronisations -------------------------------------------------------------------------------------------
import contextlib  # noqa: E402

from torch import nn  # noqa: E402

#: the Tensor methods that read a device tensor's values on the host: each a device-to-host synchronisation on a GPU
#: (`bool(t)`, `float(t)`, `t.item()`, `t.tolist()`, `t.cpu()`, ...). Patched at the Python level, they are seen
#: wherever they are called from Python, inside the custom ops' implementations too (a dispatch mode would see a
#: custom op as one opaque call).
HOST_READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "cpu", "nonzero")


class HostReads:
    """Counts the HOST_READS calls on tensors while active and not paused; the engine's own `to_host` is counted
    separately (engine/host_reads.py) and excluded here."""

    def __init__(self, monkeypatch):
        self.calls, self.paused, self._monkeypatch = [], False, monkeypatch

    @contextlib.contextmanager
    def active(self):
        from lightning_fp8.engine import host_reads

        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        counter = self

        def wrap(name):
            original = originals[name]

            def method(tensor, *args, **kwargs):
                if not counter.paused:
                    counter.calls.append(name)
                return original(tensor, *args, **kwargs)

            return method

        real_to_host = host_reads.to_host

        def to_host(tensor, why):  # counted by count_host_reads, not here
            paused, counter.paused = counter.paused, True
            try:
                return real_to_host(tensor, why)
            finally:
                counter.paused = paused

        with self._monkeypatch.context() as patch:
            for name in HOST_READS:
                patch.setattr(torch.Tensor, name, wrap(name))
            for module in _modules_using_to_host():
                patch.setattr(module, "to_host", to_host)
            yield self


def _modules_using_to_host():
    import importlib

    names = ["lightning_fp8.engine.engine", "lightning_fp8.engine.iteration_checks", "lightning_fp8.engine.gradients",
             "lightning_fp8.engine.step_closer", "lightning_fp8.engine.distributed"]
    return [module for module in map(importlib.import_module, names) if hasattr(module, "to_host")]


@pytest.mark.parametrize("scaling", list(RECIPES) + MICROSCALED_PARAMS)
def test_no_host_sync_inside_fp8linear_forward_backward(scaling, monkeypatch):
    """A training forward + backward of FP8 layers on the path CUDA takes without triton (the torch reference casts,
    which CUDA runs for float64 input, without triton or with LIGHTNING_FP8_DISABLE_TRITON=1): no op that reads a
    device value on the host. The reference per-tensor cast read two (`bool(ref > 0)`, `bool(amax * scale <= max)`)
    per cast: about 8 device-to-host synchronisations per layer and step."""
    with simulate_cuda((9, 0), triton=False):
        torch.manual_seed(0)
        recipe = {**RECIPES, **MICROSCALED_RECIPES}[scaling]
        model = nn.Sequential(FP8Linear(64, 128, recipe=recipe), nn.GELU(), FP8Linear(128, 64, recipe=recipe))
        x = torch.randn(48, 64)
        for step in range(3):  # steps 2 and 3 run with the delayed scales sized by the history
            with HostReads(monkeypatch).active() as reads:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                out.float().square().mean().backward()
            assert reads.calls == [], f"step {step}: {reads.calls}"


@pytest.mark.parametrize("scaling", list(RECIPES))
def test_no_host_sync_inside_fp8conv_forward_backward(scaling, monkeypatch):
    """The same for FP8 convolutions (a 3x3 one, then a strided grouped one: the unfold, the input gradient as a
    convolution and as GEMM + col2im, one GEMM triple per group): no device value read on the host."""
    with simulate_cuda((9, 0), triton=False):
        torch.manual_seed(0)
        model = nn.Sequential(FP8Conv2d.from_conv(nn.Conv2d(16, 32, 3, padding=1), RECIPES[scaling]), nn.GELU(),
                              FP8Conv2d.from_conv(nn.Conv2d(32, 16, 3, stride=2, padding=1, groups=2),
                                                  RECIPES[scaling]))
        x = torch.randn(1, 16, 6, 6)
        for step in range(2):  # step 2 runs with the delayed scales sized by the history
            with HostReads(monkeypatch).active() as reads:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                out.float().square().mean().backward()
            assert reads.calls == [], f"step {step}: {reads.calls}"

def _train_iteration(engine, model, opt, counter, clip=None):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(32, 64)).float().pow(2).mean()
    engine.scale_loss(loss).backward()
    if clip is not None:
        engine.clip_grad_norm_(opt, clip)

    def optimizer_step():  # torch's optimizer is not the engine's: its own host reads are not counted here
        counter.paused = True
        opt.step()
        counter.paused = False

    engine.step(opt, optimizer_step)
    engine.end_iteration()


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_engine_host_reads_per_iteration(clip, monkeypatch):
    """The engine's device-to-host reads per training iteration on one GPU, counted at engine/host_reads.py's `to_host`,
    the only place they happen (no implicit read anywhere in the iteration outside the optimizer's own step): the
    figures docs/plugin.md ("Host synchronisations") states and justifies."""
    from lightning_fp8.engine import FP8TrainingEngine
    from lightning_fp8.engine.host_reads import count_host_reads

    with simulate_cuda((9, 0), triton=False):
        torch.manual_seed(0)
        model = nn.Sequential(FP8Linear(64, 128), nn.GELU(), FP8Linear(128, 64))
        engine = FP8TrainingEngine(FP8Recipe())
        engine.attach(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        counter = HostReads(monkeypatch)
        for _ in range(2):
            _train_iteration(engine, model, opt, counter, clip)
        with counter.active(), count_host_reads() as reads:
            _train_iteration(engine, model, opt, counter, clip)
    assert counter.calls == [], counter.calls
    assert reads == ["iteration flags"]  # with clipping too: the norm's flag joins the others


# -- compile with the implementations CUDA runs ---------------------------------------------------------------------
def _inductor_vs_eager(recipe):
    import copy

    torch.manual_seed(0)
    base = nn.Sequential(FP8Linear(64, 128, recipe=recipe), nn.GELU(), FP8Linear(128, 128, recipe=recipe))
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    x = torch.randn(128, 64)
    outs = []
    for model, fwd in ((eager, eager), (compiled, torch.compile(compiled, fullgraph=True))):
        for _ in range(2):  # the second step runs on delayed scales
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fwd(x).float().square().mean()
            loss.backward()
        outs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_e, grads_e), (loss_c, grads_c) = outs
    # tolerances of tests/test_compile.py (inductor reorders the BF16 ops around the layers)
    torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=0)
    for ge, gc in zip(grads_e, grads_c):
        assert ((gc - ge).norm() / ge.norm()).item() < 3e-2


@pytest.mark.parametrize("scaling", list(RECIPES))
def test_inductor_with_the_cuda_reference_implementations(scaling):
    """Inductor, fullgraph, on the casts and GEMM plans CUDA runs without triton: with the column-major x^T the CUDA
    reference of tiled_cast returned, inductor failed its stride assertion on every rowwise / blockwise layer."""
    torch._dynamo.reset()
    with simulate_cuda((9, 0), triton=False):
        _inductor_vs_eager(RECIPES[scaling])
    torch._dynamo.reset()


@pytest.mark.skipif(INSTALLED_TORCH == (2, 7), reason=(
    "torch 2.7's inductor fails on a float8_e8m0fnu graph input read by any op (torch/_inductor/lowering.py "
    "`unsupported_input_tensor` calls `is_view` on a placeholder's str target: \"'str' object has no attribute "
    "'_schema'\"; fixed in 2.8): the backward graph reads the saved E8M0 weight scales"))
@pytest.mark.parametrize("scaling", MICROSCALED_PARAMS)
def test_inductor_with_the_microscaled_casts(scaling):
    """Inductor, fullgraph, on the MXFP8 / NVFP4 casts and GEMMs (NVFP4 with nearest rounding here, so eager and
    compiled runs round alike): the cast op returned E8M0 scales and FP4 data in those dtypes, and inductor refused to
    functionalize it ("auto_functionalized_v2 was not removed"): it now returns their bytes, viewed outside."""
    torch._dynamo.reset()
    recipe = dataclasses.replace(MICROSCALED_RECIPES[scaling], rounding="nearest")
    with simulate_cuda((10, 0), triton=False):
        _inductor_vs_eager(recipe)
    torch._dynamo.reset()


@interp
@pytest.mark.parametrize("scaling", ["delayed", "rowwise"])
def test_interp_inductor_with_the_triton_casts(scaling):
    torch._dynamo.reset()
    with simulate_cuda((9, 0), triton=True):
        _inductor_vs_eager(RECIPES[scaling])
    torch._dynamo.reset()


# -- the GEMM ops' fake implementations, on every path ---------------------------------------------------------------
#: ("test_schema" runs arithmetic on the inputs, which CPU float8 tensors do not implement)
GEMM_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("path", ["cpu_emulation", "sm90", "sm89"])
@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "blockwise"])
def test_gemm_ops_match_their_fake_impls(kind, path):
    """fp8_gemm: the CPU emulation, and the simulated GPUs' plans (run through CPU _scaled_mm where
    torch's CPU build has it, emulated where not), return what the fake implementation says (shape, dtype, strides:
    padded and sliced outputs must come back contiguous)."""
    from lightning_fp8.numerics.tiles import quantize_tiles, transposed

    g = torch.Generator().manual_seed(1)
    m, k, n = 128, 256, 136 if kind != "blockwise" else 128
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    for out_dtype, bias in ((torch.bfloat16, torch.randn(n, generator=g)), (torch.float32, None)):
        if kind == "tensorwise":
            a, b = x.to(E4), w.to(E4).t()
            args = (a, torch.tensor(0.5), [], None, b, torch.tensor(2.0), [], None, out_dtype, bias, False, "auto",
                    False)
        else:
            a_tile, b_tile = ((1, 0), (0, 1)) if kind == "rowwise" else ((1, 128), (128, 128))
            fmt = RECIPES["rowwise"].format_for("input")
            qa, sa, _ = quantize_tiles(x, a_tile, fmt)
            qbt, sbt, _ = quantize_tiles(w, transposed(b_tile), fmt)
            args = (qa, sa, list(a_tile), None, qbt.t(), sbt.t(), list(b_tile), None, out_dtype, bias, False, "auto",
                    False)
        op = torch.ops.lightning_fp8.fp8_gemm.default
        with simulate_cuda(ARCHS[path]) if path != "cpu_emulation" else _nothing():
            torch.library.opcheck(op, args, test_utils=GEMM_UTILS)


def test_hardware_fp8_cast_only_where_it_compiles_and_rounds_once():
    """The Triton casts use the hardware conversion where it compiles (sm89+) and rounds float32 once like torch's
    cast: not on sm80/86/87 (Triton refuses fp8e4nv there), not on sm89 before Triton 3.9 (it converts through
    float16 there, two roundings); elsewhere the kernels' exact integer rounding."""
    from lightning_fp8.kernels import hardware_cast_exact

    assert not any(hardware_cast_exact(cap, (3, 9)) for cap in [(8, 0), (8, 6), (8, 7), None])
    assert not hardware_cast_exact((8, 9), (3, 6)) and hardware_cast_exact((8, 9), (3, 9))
    assert all(hardware_cast_exact(cap, (3, 6)) for cap in [(9, 0), (10, 0), (12, 0)])


# -- GEMM contract against the recorded hardware: cuBLASLt's acceptance and the GPU's bits (mmaemu) -------------------
#: mmaemu models `torch._scaled_mm` with per-tensor scales as recorded on an H100 PCIe ("hopper") and an RTX 4060
#: ("ada"), both cuBLASLt 12.8.3.14: which calls the GPU took, how it split K, and the bits it returned
import itertools  # noqa: E402

HAS_MMAEMU = importlib.util.find_spec("mmaemu") is not None
needs_mmaemu = pytest.mark.skipif(not HAS_MMAEMU, reason="needs mmaemu (pip install 'lightning-fp8[h100]')")
MMAEMU_PROFILES = {"sm89": "ada", "sm90": "hopper"}
#: the suite's shapes, and one whose sm90 forward and weight-gradient calls the H100's records decide (K >= 1024 and a
#: large enough output: its envelope), so both GPUs' bits are compared below
MMAEMU_SHAPES = SMALL_SHAPES + [(1024, 1024, 64)]
ROLES = ("forward", "dgrad", "wgrad")


def _per_tensor_calls(shapes, device, cases=None):
    """(where, role, arch, request, planned call) of every GEMM of a per-tensor FP8Linear forward + backward, for
    every per-tensor recipe and every (output dtype, bias) of `cases` (default: all), planned for sm89 and sm90."""
    cases = cases or [(out, bias) for out in OUT_DTYPES for bias in (False, True)]
    for shape in shapes:
        for scaling in ("delayed", "current"):
            for out, bias in cases:
                records = layer_gemms(RECIPES[scaling], shape, OUT_DTYPES[out], bias, device=device)
                for (role, ops), arch in itertools.product(zip(ROLES, records), MMAEMU_PROFILES):
                    call = plan_scaled_mm(ops, target_for(ARCHS[arch]))
                    where = f"{arch} {role} of {shape} {scaling} {out} bias={bias}"
                    assert isinstance(call, ScaledMMCall) and call.kind == TENSORWISE, where
                    yield where, role, arch, ops, call


def _explain(call, arch):
    import mmaemu

    return mmaemu.explain(call.mat_a, call.mat_b, call.scale_a, call.scale_b, bias=call.bias,
                          out_dtype=call.out_dtype, use_fast_accum=call.use_fast_accum,
                          profile=MMAEMU_PROFILES[arch])


@needs_mmaemu
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_every_planned_per_tensor_call_is_one_cublaslt_took(device):
    """Every per-tensor call the planner issues for sm89 / sm90 (the suite's small shapes on CPU, its LLaMA shapes on
    meta; every output dtype, with and without bias) passes the checks mmaemu recorded on the GPU (torch 2.7.1's
    argument checks, cuBLASLt's layout, alignment and leading-dimension rules, the profile's rejections): never
    ReferenceRejectsError. The only refusals are outside mmaemu's scope (a bias inside the call, which cuBLASLt took
    but mmaemu does not model) or a split-K decision it cannot make."""
    from mmaemu import ReferenceRejectsError  # noqa: F401  (the class whose name must never appear)

    decided = {arch: 0 for arch in MMAEMU_PROFILES}
    for where, role, arch, ops, call in _per_tensor_calls(SMALL_SHAPES if device == "cpu" else LARGE_SHAPES, device):
        with torch.no_grad():  # as inside the GEMM op (mmaemu refuses inputs that require grad under grad mode)
            plan = _explain(call, arch)
        if plan.validation == "ok":
            decided[arch] += 1
            continue
        kind, message = plan.validation
        assert kind != "ReferenceRejectsError", f"{where}: {call.describe()} was rejected on the GPU: {message}"
        assert kind in ("UnsupportedFeatureError", "SplitKUnknownError"), (where, kind, message)
        assert kind != "UnsupportedFeatureError" or (call.bias is not None and "bias" in message), (where, message)
    # the H100's records start at K = 1024: the small shapes' sm90 calls are all undecided
    assert decided["sm89"] and (decided["sm90"] or device == "cpu"), decided


@needs_mmaemu
def test_planned_per_tensor_calls_return_the_gpus_bits_through_the_modelled_backend(monkeypatch):
    """Where the GPU's split-K decision is known, a planned call run the way the GPU path runs it (`ScaledMMCall.launch`,
    with `torch._scaled_mm` answered by mmaemu's model of that GPU) and the same GEMM through
    FP8Recipe(backend="h100" / "rtx4060") agree bit for bit: the backend computes the calls the GPU path issues.
    On the first rows of each call (an output element depends on its row and column and on the split, which is the
    full call's)."""
    import mmaemu

    from lightning_fp8.modules.gpu_model import known_splits
    from lightning_fp8.modules.scaled_mm import _cpu_scaled_mm_runs

    assert _cpu_scaled_mm_runs(TENSORWISE)
    backends = {"sm89": "rtx4060", "sm90": "h100"}
    rows, compared, seen = 4, {arch: set() for arch in MMAEMU_PROFILES}, set()
    # the two ways a GEMM's output is finished: rounded by the call (bf16), or a float32 output plus the bias
    for where, role, arch, ops, call in _per_tensor_calls(MMAEMU_SHAPES, "cpu", [("bf16", False), ("fp32", True)]):
        with torch.no_grad():  # as inside the GEMM op
            plan = _explain(call, arch)
        if plan.validation != "ok":
            continue
        key = (arch, role, tuple(call.mat_a.shape), tuple(call.mat_b.shape), call.out_dtype, call.bias is not None,
               ops.bias is not None)
        if key in seen:  # the same call for another scaling: its bits were compared once
            continue
        seen.add(key)
        split = plan.split.S if plan.split.S == 1 else (plan.split.S, plan.split.scheme)
        sliced = ops._replace(a=ops.a._replace(data=ops.a.data[:rows]))

        def gpu_scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
            return mmaemu.scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                                    use_fast_accum=use_fast_accum, profile=MMAEMU_PROFILES[arch], splitk=split)

        with monkeypatch.context() as patch, torch.no_grad():
            patch.setattr(torch, "_scaled_mm", gpu_scaled_mm)
            gpu = dataclasses.replace(call, mat_a=call.mat_a[:rows]).launch()
        with known_splits({(rows, call.mat_a.shape[1], call.mat_b.shape[1]): split}):
            backend = _run_backend(sliced, backends[arch])
        assert gpu.dtype == backend.dtype == ops.out_dtype, where
        assert torch.equal(gpu.view(torch.uint8), backend.view(torch.uint8)), where
        compared[arch].add(role)
    assert compared == {"sm89": set(ROLES), "sm90": {"forward", "wgrad"}}, compared


def _run_backend(ops, backend):
    from lightning_fp8.modules.gemm import fp8_gemm

    return fp8_gemm(ops.a, ops.b, ops.out_dtype, ops.bias, ops.use_fast_accum, backend=backend)
