"""Fused cast kernels vs their torch twins (quantize / tensor_amax), and scaled_cast's fused path vs its reference.

Three tiers:
- CPU, always: the package imports without triton; the custom ops (reference backend on CPU) match `quantize`;
  scaled_cast's fused orchestration (pre-pass, scale, cast, record), driven through the ops, leaves the same
  outputs and the same ScalingState as the reference path, bit for bit; the ops trace under torch.compile.
- CPU under the Triton interpreter (TRITON_INTERPRET=1), only where triton is importable and no GPU is present:
  the kernel's indexing, masking, transposed store, amax and skip logic, and its exact integer ("soft") FP8
  rounding, bit for bit. The hardware-cvt variant is compared only on values that do not round across a power
  of two: the interpreter's own fp8 conversion mis-rounds those (docs/numerics.md).
- CUDA (`pytest -m cuda`): both cast variants bit-exact against `quantize` on the GPU, many shapes / strides /
  dtypes / edge values; stochastic rounding with given noise; FP8Linear fused vs reference.
Tolerances: none for casts and amaxes (bit-exact; NaN compared as NaN, the hardware cvt may drop NaN's sign).
Statistical tests use 6 standard deviations of the binomial / uniform estimate.

(Length: three tiers of the same kernels share one set of edge-value generators and reference helpers.)
"""
from __future__ import annotations

import importlib.util
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from lightning_fp8 import kernels
from lightning_fp8.modules.cast import PerTensorCaster, cast_to_fp8
from lightning_fp8.modules.layer_state import FP8LayerState
from lightning_fp8.numerics import E4M3, E5M2, cast_scale, close_step, quantize, tensor_amax
from lightning_fp8.recipe import FP8Recipe


def _cast(x, meta, recipe, role, record, transposed=False, generator=None):
    """A layer's per-tensor cast of `x` as `role`: (x_fp8, x_fp8^T or None, scale, scale_inv)."""
    operand = PerTensorCaster(recipe).cast(x, meta.amax_history, role, record, layouts=(True, transposed),
                                           history_sized=meta.history_sized[["input", "weight", "grad_output"].index(role)],
                                           generator=generator)
    data_t = operand.transposed.data if operand.transposed is not None else None
    return operand.matrix.data, data_t, operand.scale, operand.matrix.scale_inv

FORMATS = [E4M3, E5M2]
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_fp8(a: torch.Tensor, b: torch.Tensor, nan_sign: bool = True) -> None:
    """Bit-exact equality of two FP8 tensors; NaNs must coincide (and, if nan_sign, carry the same byte)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(na, nb), "NaN positions differ"
    ba, bb = bits(a), bits(b)
    if not nan_sign:
        ba, bb = ba[~na], bb[~nb]
    mismatch = (ba != bb).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} codes differ, first at {mismatch[:5].tolist()}"


def assert_same_amax(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == torch.float32 and a.shape == ()
    if torch.isnan(b):
        assert torch.isnan(a)
    else:
        assert a.item() == b.item()


def edge_values(fmt, device="cpu") -> torch.Tensor:
    """Every FP8 code's value, the midpoints between neighbours (ties), just above/below them, +-max, beyond max,
    subnormals, zeros, inf, NaN: the values where a cast goes wrong if it does."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    eps = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    below = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    special = torch.tensor(
        [0.0, -0.0, fmt.max, -fmt.max, fmt.max * 1.01, -fmt.max * 3, fmt.smallest_subnormal, fmt.smallest_subnormal / 2,
         fmt.smallest_subnormal * 0.51, fmt.smallest_subnormal * 0.49, 1e-30, -1e-30, 1.4e-45,
         float("inf"), -float("inf"), float("nan"), -float("nan")]
    )
    return torch.cat([finite, mids, eps, below, -mids, special]).to(device)


def wide_random(shape, seed=0, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(shape, generator=g)
    expo = torch.randint(-24, 18, shape, generator=g).float()
    return (mant * torch.exp2(expo)).to(device)


def special_values(dtype=torch.float32) -> torch.Tensor:
    """NaN (both signs), +-inf, +-0, the input dtype's smallest subnormal, a subnormal of it and its smallest normal,
    its largest finite value (beyond every FP8 max), and values that land on FP8 subnormals or round to zero after
    a scale of about 1."""
    info = torch.finfo(dtype)
    return torch.tensor(
        [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, info.tiny * info.eps, -info.tiny / 2,
         info.tiny, info.max, -info.max, 2.0**-10, -(2.0**-17), 2.0**-20], dtype=torch.float32).to(dtype)


def with_specials(x: torch.Tensor, specials: torch.Tensor) -> torch.Tensor:
    """x with `specials` written over elements spread across it (any strides; x is modified and returned)."""
    m, n = x.shape
    for k, value in enumerate(specials):
        x[(7 * k) % m, (13 * k + k // n) % n] = value
    return x


# ------------------------------------------------------------------------------------------------------------------
# CPU: package, ops on the reference backend, fused orchestration
# ------------------------------------------------------------------------------------------------------------------
def test_kernels_package_imports_without_triton():
    # (torch / lightning may import triton themselves where it is installed; ours must not import the kernels)
    code = (
        "import sys, lightning_fp8, lightning_fp8.kernels as k\n"
        "assert 'lightning_fp8.kernels.triton_cast' not in sys.modules\n"
        "print(k.triton_available())\n"
    )
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("True", "False")


def test_triton_available_false_when_missing(monkeypatch):
    kernels.triton_available.cache_clear()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    try:
        assert kernels.triton_available() is False
        assert not kernels.triton_enabled_for(torch.zeros(2, 2))
    finally:
        kernels.triton_available.cache_clear()


def test_dispatch_switches(monkeypatch):
    x = torch.zeros(4, 4)
    if not INTERPRETING:
        assert not kernels.triton_enabled_for(x) and not kernels.materializes_transpose(x)  # CPU: the reference
    monkeypatch.setenv("LIGHTNING_FP8_DISABLE_TRITON", "1")
    assert kernels.triton_disabled() and not kernels.triton_enabled_for(x)
    monkeypatch.setenv("LIGHTNING_FP8_DISABLE_TRITON", "0")
    assert not kernels.triton_disabled()
    assert not kernels.triton_enabled_for(x.double())  # dtype the kernel does not read


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_ops_reference_backend_matches_quantize(fmt):
    x = wide_random((33, 70))
    scale = torch.tensor(3.5)
    out, out_t, amax = kernels.fp8_cast(x, scale, fmt, write_t=True)
    ref = quantize(x, scale, fmt)
    assert_same_fp8(out, ref)
    assert_same_fp8(out_t, ref.t().contiguous())
    assert_same_amax(amax, tensor_amax(x))
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
    sr, _, _ = kernels.fp8_cast(x, scale, fmt, noise=noise, compute_amax=False)
    assert_same_fp8(sr, quantize(x, scale, fmt, rounding="stochastic", noise=noise))
    assert kernels.fp8_amax(x, skip_if=torch.tensor(True)).item() == 0.0
    assert_same_amax(kernels.fp8_amax(x, skip_if=torch.tensor(False)), tensor_amax(x))
    with pytest.raises(ValueError):
        kernels.fp8_cast(x, scale, fmt, skip_if=torch.tensor(True))


def test_ops_opcheck():
    x = torch.randn(16, 32)
    args = (x, torch.tensor(2.0), "e4m3", None, None, None, True, True, True)
    torch.library.opcheck(torch.ops.lightning_fp8.fp8_cast.default, args)


RECIPES = {
    "delayed": FP8Recipe(power_of_2_scales=False),
    "delayed_p2": FP8Recipe(),
    "current": FP8Recipe(scaling="current", power_of_2_scales=False),
    "delayed_margin_most_recent": FP8Recipe(margin=2, amax_compute_algo="most_recent", power_of_2_scales=False),
    "unscaled_grads": FP8Recipe(scale_gradients=False, format="e5m2"),
    "stochastic": FP8Recipe(rounding="stochastic"),
}


def _run_casts(recipe, use_triton, monkeypatch, device="cpu", seed=0, steps=3):
    """A few training steps' worth of state-driven casts of each role (with an overflow, and a rejected step), an
    evaluation cast and explicit-scale casts per step; returns the outputs and the final FP8 state. use_triton
    selects the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1) or the torch reference."""
    monkeypatch.setenv("LIGHTNING_FP8_DISABLE_TRITON", "0" if use_triton else "1")
    meta = FP8LayerState(recipe, device=device)
    g = torch.Generator(device=device).manual_seed(1234)
    outs = []
    for step in range(steps):
        for role in ("input", "weight", "grad_output"):
            x = wide_random((24, 48), seed=seed + step, device=device) if role != "weight" else torch.randn(
                48, 24, generator=torch.Generator().manual_seed(step)).to(device)
            if step == 1 and role == "input":
                x[3, 5] = float("inf")  # an overflow event: counted when the step closes, never recorded
            q, q_t, s, s_inv = _cast(x, meta, recipe, role, True, transposed=(role != "weight"), generator=g)
            outs += [q, q_t if q_t is not None else q.t().contiguous(), s, s_inv]
        torch.ops.lightning_fp8.close_scaling_step(
            meta.amax_history, meta.overflow_count, meta.clip_count, *meta.constants(), step != 1
        )
        q, _, s, s_inv = _cast(wide_random((8, 24), seed=100 + step, device=device), meta, recipe, "input",
                                     record=False)
        outs += [q, s, s_inv]
        y = wide_random((16, 32), seed=200 + step, device=device)
        outs.append(cast_to_fp8(y, torch.tensor(2.0, device=device), E4M3, layout="t"))
        outs.extend(cast_to_fp8(y, torch.tensor(0.5, device=device), E5M2, layout="both"))
    return outs, {k: v.clone() for k, v in meta.state_dict().items()}


def _assert_runs_equal(a, b):
    outs_a, state_a = a
    outs_b, state_b = b
    assert len(outs_a) == len(outs_b)
    for i, (x, y) in enumerate(zip(outs_a, outs_b)):
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert_same_fp8(x, y)
        else:
            assert torch.equal(x, y), f"output {i}: {x} vs {y}"
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), k


@pytest.mark.parametrize("name", list(RECIPES))
def test_scaled_cast_op_is_the_numerics_composition(name, monkeypatch):
    """On CPU the op runs its torch reference: the scale is numerics.cast_scale of the role's history under the
    cast's recipe, the bytes are numerics.quantize, and the open slot receives max|x|."""
    monkeypatch.setenv("LIGHTNING_FP8_DISABLE_TRITON", "1")
    recipe = RECIPES[name]
    meta = FP8LayerState(recipe)
    meta.amax_history[0, 1:4] = torch.tensor([3.0, 7.0, 1.0])  # input has history; weight / grad_output do not
    for role, index in (("input", 0), ("weight", 1), ("grad_output", 2)):
        x = wide_random((20, 36), seed=index)
        if recipe.rounding_for(role) == "stochastic":
            continue  # its noise is drawn inside scaled_cast: bit-exactness with given noise is tested below
        before = meta.amax_history[index].clone()
        q, _, scale, scale_inv = _cast(x, meta, recipe, role, True)
        fmt = recipe.format_for(role)
        mode = "none" if not recipe.uses_scaling_for(role) else recipe.scaling
        expected = cast_scale(before, tensor_amax(x), fmt.max, mode, recipe.amax_compute_algo == "max",
                              recipe.margin, recipe.power_of_2_scales)
        assert torch.equal(scale, expected) and torch.equal(scale_inv, expected.reciprocal())
        assert_same_fp8(q, quantize(x, expected, fmt))
        assert meta.amax_history[index, 0].item() == tensor_amax(x).item()
        assert torch.equal(meta.amax_history[index, 1:], before[1:])


@pytest.mark.parametrize("name", list(RECIPES))
def test_cpu_kernels_match_the_reference_bit_for_bit(name, monkeypatch):
    """kernels/cpu_kernels.py (host-side scales, the clamp skipped where nothing saturates) against the torch reference, over
    training steps with an overflow and a rejected step, evaluation casts and explicit-scale casts."""
    recipe = RECIPES[name]
    monkeypatch.setenv("LIGHTNING_FP8_CPU_REFERENCE", "1")
    ref = _run_casts(recipe, False, monkeypatch)
    monkeypatch.setenv("LIGHTNING_FP8_CPU_REFERENCE", "0")
    _assert_runs_equal(ref, _run_casts(recipe, False, monkeypatch))


@pytest.mark.parametrize("scaling", ["delayed", "current", "none"])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_cpu_scaled_cast_on_edge_values_and_histories(scaling, power_of_2):
    from lightning_fp8.kernels.cpu_kernels import scaled_cast_cpu
    from lightning_fp8.kernels.kernel_reference import scaled_cast_reference

    for fmt, margin in ((E4M3, 0), (E5M2, 3)):
        v = edge_values(fmt)
        x = torch.cat([v, torch.zeros((-v.numel()) % 32)]).reshape(-1, 32)
        for history_values in ([], [3.0, 11.0, 0.5], [1e-40, 2.0], [3.0e38]):
            for algo_max in (True, False):
                for data in (x, x.nan_to_num(0.0, 1.0e3, -1.0e3), torch.randn(16, 32) * 1e-3):
                    for record in (True, False):
                        h_ref = torch.zeros(3, 6)
                        h_ref[1, 1:1 + len(history_values)] = torch.tensor(history_values)
                        h_cpu = h_ref.clone()
                        q_ref, s_ref = scaled_cast_reference(data, h_ref, 1, fmt, scaling, algo_max, margin,
                                                             power_of_2, record=record)
                        q_cpu, s_cpu, inv_cpu = scaled_cast_cpu(data, h_cpu, 1, fmt, scaling, algo_max, margin,
                                                                power_of_2, record=record)
                        assert torch.equal(s_cpu, s_ref), (s_cpu, s_ref, history_values)
                        assert torch.equal(inv_cpu, s_ref.reciprocal())
                        assert_same_fp8(q_cpu, q_ref)
                        assert torch.equal(h_cpu.nan_to_num(-1.0), h_ref.nan_to_num(-1.0))


def test_cpu_explicit_scale_cast_on_edge_values():
    """kernels/cpu_kernels.py's `cast_cpu` (the backward re-cast with a given scale: amax first, no clamp where nothing can
    saturate) against the reference, over every code's neighbourhood, saturating, inf / NaN and tiny data, scales
    that are and are not powers of two, both layouts; where it declines (saturation, non-finite) it says so."""
    from lightning_fp8.kernels.cpu_kernels import cast_cpu
    from lightning_fp8.kernels.kernel_reference import cast_reference

    taken = 0
    for fmt in (E4M3, E5M2):
        v = edge_values(fmt)
        x = torch.cat([v, torch.zeros((-v.numel()) % 32)]).reshape(-1, 32)
        for data in (x, x.nan_to_num(0.0, 1.0e3, -1.0e3), torch.randn(16, 32) * 1e-3, torch.randn(16, 32) * 100,
                     torch.randn(16, 32).to(torch.bfloat16)):
            for scale in (1.0, 0.5, 2.0 ** 7, 0.3, 3.7, 1e-30):
                s = torch.tensor(scale, dtype=torch.float32)
                for write_row, write_t in ((True, False), (False, True), (True, True)):
                    got = cast_cpu(data, s, fmt, write_row=write_row, write_t=write_t, compute_amax=True)
                    ref = cast_reference(data, s, fmt, write_row=write_row, write_t=write_t, compute_amax=True)
                    saturates = not (tensor_amax(data).float() * s).item() <= fmt.max  # float32 product
                    assert (got is None) == saturates, (fmt, scale)
                    if got is None:
                        continue
                    taken += 1
                    for a, b in zip(got[:2], ref[:2]):
                        assert (a is None) == (b is None)
                        if a is not None:
                            assert_same_fp8(a, b)
                    assert torch.equal(got[2], ref[2])
    assert taken > 0


def test_close_step_op_is_the_numerics_rule():
    recipe = FP8Recipe(scale_gradients=False, format="e5m2")
    meta = FP8LayerState(recipe)
    meta.amax_history[:, 0] = torch.tensor([float("nan"), 2.0, 7.0e4])  # overflow, normal, unscaled saturation
    meta.amax_history[1, 1] = 1.0
    expected, overflow, clip = close_step(meta.amax_history.clone(), meta.constants(), taken=True)
    torch.ops.lightning_fp8.close_scaling_step(
        meta.amax_history, meta.overflow_count, meta.clip_count, *meta.constants(), True
    )
    assert torch.equal(meta.amax_history, expected)
    assert meta.overflow_count.tolist() == [1, 0, 1] == overflow.long().tolist()
    assert meta.clip_count.tolist() == clip.long().tolist()
    assert meta.amax_history[:, 1].tolist() == [0.0, 2.0, 7.0e4]  # NaN never enters; saturation is recorded


def test_cast_ops_trace_under_compile_without_graph_breaks():
    def f(x, scale):
        amax = kernels.fp8_amax(x)
        out, out_t, _ = kernels.fp8_cast(x, scale / amax, "e4m3", write_t=True, compute_amax=False)
        return out.float().sum() + out_t.float().sum()

    x, s = torch.randn(32, 48), torch.tensor(448.0)
    explained = torch._dynamo.explain(f)(x, s)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, s), f(x, s))


def test_casts_reject_what_they_cannot_cast():
    with pytest.raises(Exception, match="2-D"):
        _cast(torch.zeros(2, 3, 4), FP8LayerState(FP8Recipe()), FP8Recipe(), "input", False)
    with pytest.raises(ValueError):
        cast_to_fp8(torch.zeros(4), torch.tensor(1.0), E4M3, layout="t")
    with pytest.raises(ValueError, match="delayed"):
        kernels.scaled_cast(torch.zeros(2, 2), torch.zeros(3, 5), 0, "e4m3", "lazy", True, 0, False)


def test_device_guard_makes_the_tensors_cuda_device_current(monkeypatch):
    """The launch guard asks torch.cuda.device for the tensor's own device (a fake cuda:1 tensor here), and for
    nothing with a CPU tensor (the interpreter)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_fp8.kernels.device_launch import device_guard

    asked, entered = [], []

    class RecordingDevice:
        def __init__(self, device):
            asked.append(device)

        def __enter__(self):
            entered.append(asked[-1])

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", RecordingDevice)
    with FakeTensorMode():
        on_second_gpu = torch.empty(4, 4, device="cuda:1")
    with device_guard(on_second_gpu):
        pass
    assert asked == entered == [torch.device("cuda", 1)]
    with device_guard(torch.zeros(2)):
        pass
    assert asked == [torch.device("cuda", 1)]


def _triton_launches():
    """Every `kernel[grid](...)` call of a @triton.jit function in the package's sources, with the `with` items that
    enclose it: (file, line, kernel name, launch call, enclosing with-item calls)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    files = sorted((root / "kernels").rglob("*.py")) + sorted((root / "lightning_fp8").rglob("*.py"))
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}

    def is_jit(decorator):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return (isinstance(target, ast.Attribute) and target.attr == "jit") or (
            isinstance(target, ast.Name) and target.id == "jit")

    jit_names = {node.name for tree in trees.values() for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef) and any(is_jit(d) for d in node.decorator_list)}
    launches = []
    for f, tree in trees.items():
        def visit(node, withs):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                kernel = node.func.value
                name = kernel.id if isinstance(kernel, ast.Name) else getattr(kernel, "attr", None)
                if name in jit_names:
                    launches.append((f.relative_to(root), node.lineno, name, node, list(withs)))
            if isinstance(node, (ast.With, ast.AsyncWith)):
                withs = withs + [item.context_expr for item in node.items]
            for child in ast.iter_child_nodes(node):
                visit(child, withs)

        visit(tree, [])
    return launches


def test_every_triton_launch_is_under_the_tensors_device_guard():
    """Defect: Triton launches on the current device, not the tensors' (a layer on cuda:1 while cuda:0 is current
    ran on the wrong GPU). Every launch must sit inside `with device_guard(t):` where t is a tensor the kernel
    receives as a positional argument."""
    import ast

    launches = _triton_launches()
    found = {name for _, _, name, _, _ in launches}
    assert {"_cast_kernel", "_close_step_kernel", "_fp8_adamw_block_kernel"} <= found, found  # the scan sees them
    unguarded = []
    for path, line, name, call, withs in launches:
        arg_names = {a.id for a in call.args if isinstance(a, ast.Name)}
        guarded = any(
            isinstance(w, ast.Call) and isinstance(w.func, ast.Name) and w.func.id == "device_guard"
            and len(w.args) == 1 and isinstance(w.args[0], ast.Name) and w.args[0].id in arg_names
            for w in withs
        )
        if not guarded:
            unguarded.append(f"{path}:{line} {name}")
    assert not unguarded, f"launches outside `with device_guard(<a tensor argument>)`: {unguarded}"


# ------------------------------------------------------------------------------------------------------------------
# CPU under the Triton interpreter
# ------------------------------------------------------------------------------------------------------------------
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"
interp = pytest.mark.skipif(
    not HAS_TRITON or HAS_CUDA or not INTERPRETING,
    reason="interpreter tests: need triton (a test dependency on Linux), no GPU, and TRITON_INTERPRET=1 from the start "
    "of the process (test_interpreter_suite runs them so)",
)


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA or INTERPRETING, reason="needs triton and no GPU; runs the interp tests")
def test_interpreter_suite():
    """Triton reads TRITON_INTERPRET when it is first imported (its own jit'd helpers such as tl.cdiv are decorated
    then), so the interpreter tests run in a fresh process that has it set from the start: this file's and the fused
    FP8AdamW step's (tests/test_optim.py), in one process (its start, importing lightning, costs ~8 s)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    files = [__file__, os.path.join(os.path.dirname(__file__), "test_optim.py")]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *files, "-k", "interp_"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout and " skipped" not in out.stdout, out.stdout[-2000:]


@pytest.fixture(scope="module")
def triton_interp():
    """The kernel module, compiled for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    from lightning_fp8.kernels import triton_cast

    if not isinstance(triton_cast._cast_kernel, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET was set")
    return triton_cast


def _launch(tc, x, scale, fmt, **kw):
    kw.setdefault("write_row", True)
    kw.setdefault("write_t", False)
    kw.setdefault("compute_amax", True)
    kw.setdefault("hw_cast", False)
    out, out_t, amax = tc.launch_cast(x, scale, fmt, **kw)
    view = lambda t: t.view(fmt.dtype) if t is not None else None  # noqa: E731
    return view(out), view(out_t), amax


@interp
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_interp_soft_cast_bit_exact_on_edge_values(triton_interp, fmt):
    v = edge_values(fmt)
    n = v.numel()
    cols = 64
    x = torch.cat([v, torch.zeros((-n) % cols)]).reshape(-1, cols)
    for scale in (1.0, 0.5, 3.0, 2.0**-8):
        s = torch.tensor(scale)
        out, out_t, amax = _launch(triton_interp, x, s, fmt, write_t=True)
        ref = quantize(x, s, fmt)
        assert_same_fp8(out, ref)
        assert_same_fp8(out_t, ref.t().contiguous())
        assert_same_amax(amax, tensor_amax(x))


@interp
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_interp_random_dtypes(triton_interp, fmt, dtype):
    x = with_specials(wide_random((40, 72), seed=3).clamp(-6e4, 6e4).to(dtype), special_values(dtype))
    s = torch.tensor(7.25)
    out, _, amax = _launch(triton_interp, x, s, fmt)
    assert_same_fp8(out, quantize(x, s, fmt))
    assert_same_amax(amax, tensor_amax(x))


@interp
@pytest.mark.parametrize("shape", [(1, 1), (1, 37), (37, 1), (17, 300), (130, 65)])
def test_interp_shapes_and_strides(triton_interp, shape):
    base = wide_random((shape[1], shape[0]), seed=5)
    for x in (base.t(), wide_random(shape, seed=6), wide_random((shape[0], 2 * shape[1]), seed=7)[:, ::2]):
        with_specials(x, special_values()[-x.numel():])
        s = torch.tensor(0.75)
        out, out_t, amax = _launch(triton_interp, x, s, E4M3, write_t=True)
        ref = quantize(x, s, E4M3)
        assert_same_fp8(out, ref)
        assert_same_fp8(out_t, ref.t().contiguous())
        assert_same_amax(amax, tensor_amax(x))
        only_t = _launch(triton_interp, x, s, E4M3, write_row=False, write_t=True, compute_amax=False)
        assert only_t[0] is None and only_t[2] is None
        assert_same_fp8(only_t[1], ref.t().contiguous())


@interp
def test_interp_amax_nan_inf_and_skip(triton_interp):
    x = torch.randn(50, 40)
    x[7, 3] = -float("inf")
    amax = _launch(triton_interp, x, None, E4M3, write_row=False)[2]
    assert amax.item() == float("inf")
    x[9, 9] = float("nan")
    assert torch.isnan(_launch(triton_interp, x, None, E4M3, write_row=False)[2])
    y = torch.randn(50, 40)
    skipped = _launch(triton_interp, y, None, E4M3, write_row=False, skip_if=torch.tensor(True))[2]
    assert skipped.item() == 0.0
    kept = _launch(triton_interp, y, None, E4M3, write_row=False, skip_if=torch.tensor(False))[2]
    assert_same_amax(kept, tensor_amax(y))
    negative_zeros = torch.full((9, 17), -0.0)
    amax = _launch(triton_interp, negative_zeros, None, E4M3, write_row=False)[2]
    assert amax.view(torch.int32).item() == 0  # +0, as torch.amax(|x|)
    subnormals = torch.full((9, 17), 1e-40)
    subnormals[4, 5] = -3e-39
    assert_same_amax(_launch(triton_interp, subnormals, None, E4M3, write_row=False)[2], tensor_amax(subnormals))


@interp
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_interp_soft_decode_of_every_code(triton_interp, fmt, monkeypatch):
    """`_soft_fp8_value`, the integer-only decode the fused AdamW step reads its FP8 moments with where the hardware
    conversion does not compile (sm80-87): every one of the 256 codes, bit for bit with torch (NaN as NaN)."""
    import triton
    import triton.language as tl

    # the interpreter resolves names in the kernel's module globals (this file imports no triton at module level)
    monkeypatch.setitem(globals(), "_soft_fp8_value", triton_interp._soft_fp8_value)

    @triton.jit
    def decode(code_ptr, out_ptr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
               HAS_INF: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(out_ptr + offs, _soft_fp8_value(tl.load(code_ptr + offs), MANT, BIAS, MAX_CODE, HAS_INF))  # noqa: F821

    codes = torch.arange(256, dtype=torch.int32)
    out = torch.empty(256)
    decode[(1,)](codes, out, MANT=fmt.mantissa_bits, BIAS=7 if fmt is E4M3 else 15, MAX_CODE=fmt.max_code,
                 HAS_INF=fmt.has_inf)
    expected = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()].view(torch.int32), expected[~expected.isnan()].view(torch.int32))


@interp
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_interp_stochastic_with_given_noise_bit_exact(triton_interp, fmt):
    v = edge_values(fmt)
    x = torch.cat([v, wide_random((4096 - v.numel(),), seed=8)]).reshape(64, 64)
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(9))
    s = torch.tensor(1.0)
    out, out_t, _ = _launch(triton_interp, x, s, fmt, write_t=True, noise=noise)
    ref = quantize(x, s, fmt, rounding="stochastic", noise=noise)
    assert_same_fp8(out, ref)
    assert_same_fp8(out_t, ref.t().contiguous())


@interp
def test_interp_philox_rounding_is_unbiased(triton_interp):
    # 1.1 lies between E4M3 neighbours 1.0 and 1.125: rounds up with p = 0.8
    n = 128 * 128
    x = torch.full((128, 128), 1.1)
    out, _, _ = _launch(triton_interp, x, torch.tensor(1.0), E4M3, noise=None, seed=torch.tensor([7]), compute_amax=False)
    vals = out.float()
    assert set(vals.unique().tolist()) <= {1.0, 1.125}
    p_up = (vals == 1.125).float().mean().item()
    p = (1.1 - 1.0) / 0.125
    assert abs(p_up - p) < 6 * (p * (1 - p) / n) ** 0.5


@interp
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_interp_hw_cast_away_from_binade_crossings(triton_interp, fmt):
    x = wide_random((64, 64), seed=11).clamp(-fmt.max, fmt.max)
    s = torch.tensor(1.0)
    out, _, _ = _launch(triton_interp, x, s, fmt, hw_cast=True)
    ref = quantize(x, s, fmt)
    # keep the values whose rounded result stays in the input's binade (the interpreter mis-rounds the others)
    xr, rr = x.abs(), ref.float().abs()
    same_binade = (torch.floor(torch.log2(xr)) == torch.floor(torch.log2(rr))) & (xr >= fmt.smallest_normal)
    assert same_binade.float().mean() > 0.5
    assert torch.equal(bits(out)[same_binade], bits(ref)[same_binade])


@interp
@pytest.mark.parametrize("name", list(RECIPES))
def test_interp_scaled_cast_fused_matches_reference(triton_interp, name, monkeypatch):
    """The whole fused scaled_cast path with the real kernel (interpreted, soft cast) vs the reference path."""
    recipe = RECIPES[name]
    assert kernels.triton_enabled_for(torch.zeros(2, 2))  # the ops now run the interpreted kernel on CPU
    _assert_runs_equal(_run_casts(recipe, False, monkeypatch, steps=2), _run_casts(recipe, True, monkeypatch, steps=2))


#: (x's tile, x^T's tile, rows): blockwise activations / gradients and weights, rowwise both layouts and x^T alone (the
#: dgrad weight), a 1x32 block (other block sizes); rowwise on fewer rows (its kernels loop over whole rows and columns)
#: (both formats on the first case; one is enough for the layouts)
_TILED_CASES = {
    "1x128-e4m3": ((1, 128), (1, 128), 130, E4M3), "1x128-e5m2": ((1, 128), (1, 128), 130, E5M2),
    "128x128": ((128, 128), (128, 128), 130, E4M3), "rowwise": ((1, 0), (1, 0), 37, E4M3),
    "rowwise_t_only": ((), (1, 0), 37, E4M3), "1x32_row_only": ((1, 32), (), 33, E4M3),
}


@interp
@pytest.mark.parametrize("case", list(_TILED_CASES))
def test_interp_fused_tiled_cast_is_the_reference_bit_for_bit(case):
    """The fused fine-grained casts (kernels/triton_tiled.py, interpreted, exact integer rounding) against the torch
    reference CUDA runs without triton: every FP8 code, ties, near-ties, subnormal halves and +-max in each tile
    (tests/test_tiled_casts.py's edge-value rows), an inf, a -inf and a NaN each in its own tile, ragged last tiles in
    both dimensions, float32 and bf16 input, margins and non-power-of-two scales, the token padding of x^T: the same
    bytes, the same scales in the same layout, the same open history slot."""
    from test_tiled_casts import every_code_tensor

    from lightning_fp8.kernels.device import simulate_cuda
    from lightning_fp8.kernels.trace import record_launches

    tile, tile_t, rows, fmt = _TILED_CASES[case]
    x = every_code_tensor(fmt, rows, 300)
    x[1, 5], x[2, 140], x[rows - 3, 260] = math.inf, -math.inf, math.nan
    for margin, power_of_2, dtype, pad_to in ((0, True, torch.float32, 128), (1, False, torch.bfloat16, 1)):
        xx = x.to(dtype)
        outs = []
        for triton in (True, False):
            history = torch.zeros(3, 4)
            history[0, 0] = 0.25
            with simulate_cuda((9, 0), triton=triton), record_launches() as launches:
                got = kernels.tiled_cast(xx, history, 0, fmt, tile, tile_t, margin, power_of_2, pad_to=pad_to)
            # the fused path is one Triton launch per cast (rowwise with both layouts: two), and nothing else
            assert [launch.source for launch in launches] == (["triton"] * (1 + (case == "rowwise")) if triton
                                                              else [launch.source for launch in launches])
            outs.append((got, history))
        (fused, h_fused), (ref, h_ref) = outs
        for (q, s), (q_ref, s_ref) in zip(fused, ref):
            assert (q is None) == (q_ref is None)
            if q is None:
                continue
            assert_same_fp8(q, q_ref)
            assert torch.equal(s, s_ref) and s.stride() == s_ref.stride()
        assert math.isnan(h_fused[0, 0]) and torch.equal(h_fused.nan_to_num(), h_ref.nan_to_num())


# unscaled casts ignore the history: one case of them is enough
_SCALE_DERIVATION_CASES = [(scaling, history, power_of_2) for scaling in ("delayed", "current")
                           for history in ("empty", "filled", "most_recent") for power_of_2 in (False, True)]
_SCALE_DERIVATION_CASES.append(("none", "filled", False))


@interp
@pytest.mark.parametrize("scaling, history, power_of_2", _SCALE_DERIVATION_CASES)
def test_interp_scale_derived_in_kernel_matches_reference(triton_interp, scaling, history, power_of_2):
    """launch_scaled_cast derives the scale inside the kernel from the history (and a pre-pass amax): bit-exact
    with numerics.scaling.cast_scale, the same bytes, the same open-slot amax (NaN kept), for both formats; inputs
    with -0 and subnormals, then with a NaN or an inf (the amax is unusable: the scale falls back). A delayed cast
    whose history sizes the scale runs also as the engine has it (`history_sized`: no pre-pass): the same result."""
    from lightning_fp8.kernels.kernel_reference import scaled_cast_reference

    sized_options = (False, True) if scaling == "delayed" and history != "empty" else (False,)

    for fmt, margin in ((E4M3, 0), (E5M2, 2)):
        hist = torch.zeros(3, 9)
        if history != "empty":
            hist[1, 1:5] = torch.tensor([3.0, 11.0, 0.5, 2.0])
        algo_max = history != "most_recent"
        inputs = ((with_specials(wide_random((33, 70), seed=2).clamp(-3e4, 3e4), special_values()[4:8]),
                   float("nan")), (torch.randn(16, 32) * 5, -float("inf")))
        for (x, special), with_special, sized in itertools.product(inputs, (False, True), sized_options):
            x = x.clone()
            if with_special:
                x[1, 1] = special
            h_kernel, h_ref = hist.clone(), hist.clone()
            out, out_t, scale, scale_inv = triton_interp.launch_scaled_cast(
                x, h_kernel[1], fmt, scaling, algo_max, margin, power_of_2, write_t=True, record=True,
                hw_cast=False, history_sized=sized,
            )
            ref, ref_scale = scaled_cast_reference(x, h_ref, 1, fmt, scaling, algo_max, margin, power_of_2)
            assert torch.equal(scale, ref_scale), (scale, ref_scale)
            assert torch.equal(scale_inv, ref_scale.reciprocal())
            assert_same_fp8(out.view(fmt.dtype), ref)
            assert_same_fp8(out_t.view(fmt.dtype), ref.t().contiguous())
            assert torch.equal(h_kernel.nan_to_num(-1.0), h_ref.nan_to_num(-1.0))


@interp
@pytest.mark.parametrize("tokens", [33, 45, 64, 1])
def test_interp_scaled_cast_pads_the_transpose_with_zeros(triton_interp, tokens):
    """pad_to=16: x^T's token columns are M rounded up to 16, the first M the reference's bytes, the rest +0 (code 0),
    with stochastic rounding too (the padded columns have no noise to draw); x itself and the recorded amax are
    those of the unpadded cast."""
    from lightning_fp8.kernels.kernel_reference import scaled_cast_reference

    x = wide_random((tokens, 70), seed=4).clamp(-3e4, 3e4)
    padded = -(-tokens // 16) * 16
    for noise in (None, torch.rand(tokens, 70)):
        h_kernel, h_ref = torch.zeros(3, 9), torch.zeros(3, 9)
        out, out_t, scale, _ = triton_interp.launch_scaled_cast(
            x, h_kernel[1], E4M3, "current", True, 0, False, write_t=True, record=True, noise=noise, hw_cast=False,
            pad_to=16)
        ref, ref_scale = scaled_cast_reference(x, h_ref, 1, E4M3, "current", True, 0, False, noise=noise)
        assert tuple(out_t.shape) == (70, padded)
        assert_same_fp8(out.view(E4M3.dtype), ref)
        assert_same_fp8(out_t[:, :tokens].view(E4M3.dtype), ref.t().contiguous())
        assert torch.equal(out_t[:, tokens:], torch.zeros(70, padded - tokens, dtype=torch.uint8))
        assert torch.equal(scale, ref_scale) and torch.equal(h_kernel, h_ref)


@interp
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("taken", [True, False])
def test_interp_close_step_kernel_matches_reference(triton_interp, name, taken):
    from lightning_fp8.kernels.kernel_reference import close_step_reference
    from lightning_fp8.kernels.triton_scaling import launch_close_step

    recipe = RECIPES[name]
    meta = FP8LayerState(recipe)
    g = torch.Generator().manual_seed(3)
    for case in range(4):
        hist = torch.rand(meta.amax_history.shape, generator=g) * 10
        hist[:, 0] = torch.tensor([[float("nan"), 3.0, 7.0e4], [0.0, 50.0, 1.0], [float("inf"), 0.0, 2.0],
                                   [1.0, 2.0, 3.0]][case])
        counters = [torch.randint(0, 5, (3,), generator=g) for _ in range(2)]
        ref_h, ref_o, ref_c = hist.clone(), counters[0].clone(), counters[1].clone()
        k_h, k_o, k_c = hist.clone(), counters[0].clone(), counters[1].clone()
        close_step_reference(ref_h, ref_o, ref_c, meta.constants(), taken)
        launch_close_step(k_h, k_o, k_c, *meta.constants(), taken)
        assert torch.equal(k_h, ref_h) and torch.equal(k_o, ref_o) and torch.equal(k_c, ref_c), case


# ------------------------------------------------------------------------------------------------------------------
# CUDA: the real kernels (unverified until a GPU session runs `pytest -m cuda`)
# ------------------------------------------------------------------------------------------------------------------
def _cuda_cast(x, scale, fmt, hw, **kw):
    from lightning_fp8.kernels import triton_cast

    kw.setdefault("write_row", True)
    kw.setdefault("write_t", False)
    kw.setdefault("compute_amax", True)
    out, out_t, amax = triton_cast.launch_cast(x, scale, fmt, hw_cast=hw, **kw)
    view = lambda t: t.view(fmt.dtype) if t is not None else None  # noqa: E731
    return view(out), view(out_t), amax


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("hw", [True, False], ids=["hw_cvt", "soft"])
def test_cuda_edge_values_bit_exact(fmt, hw):
    v = edge_values(fmt, "cuda")
    x = torch.cat([v, torch.zeros((-v.numel()) % 64, device="cuda")]).reshape(-1, 64)
    for scale in (1.0, 0.5, 3.0, 2.0**-8, 2.0**10):
        s = torch.tensor(scale, device="cuda")
        out, out_t, amax = _cuda_cast(x, s, fmt, hw, write_t=True)
        ref = quantize(x, s, fmt)
        assert_same_fp8(out, ref, nan_sign=not hw)
        assert_same_fp8(out_t, ref.t().contiguous(), nan_sign=not hw)
        assert_same_amax(amax, tensor_amax(x))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("hw", [True, False], ids=["hw_cvt", "soft"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (1, 4099), (4099, 1), (17, 300), (1000, 1024), (4096, 1536), (2, 3, 80)])
def test_cuda_shapes_dtypes_strides_bit_exact(fmt, hw, dtype, shape):
    x = wide_random(shape, seed=sum(shape)).clamp(-6e4, 6e4).to(dtype).cuda()
    x2 = x.reshape(-1, shape[-1])
    views = [x2, x2.t(), x2[:, ::2] if x2.shape[1] > 1 else x2]
    for v in views:
        s = torch.tensor(5.5, device="cuda")
        out, out_t, amax = _cuda_cast(v, s, fmt, hw, write_t=True)
        ref = quantize(v, s, fmt)
        assert_same_fp8(out, ref, nan_sign=not hw)
        assert_same_fp8(out_t, ref.t().contiguous(), nan_sign=not hw)
        assert_same_amax(amax, tensor_amax(v))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("hw", [True, False], ids=["hw_cvt", "soft"])
def test_cuda_stochastic_with_noise_bit_exact(fmt, hw):
    v = edge_values(fmt, "cuda")
    x = torch.cat([v, wide_random((65536 - v.numel(),), seed=3, device="cuda")]).reshape(256, 256)
    noise = torch.rand(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    s = torch.tensor(1.0, device="cuda")
    out, out_t, _ = _cuda_cast(x, s, fmt, hw, write_t=True, noise=noise)
    ref = quantize(x, s, fmt, rounding="stochastic", noise=noise)
    assert_same_fp8(out, ref, nan_sign=not hw)
    assert_same_fp8(out_t, ref.t().contiguous(), nan_sign=not hw)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_philox_unbiased_and_amax_specials():
    x = torch.full((1024, 1024), 1.1, device="cuda")
    out, _, _ = _cuda_cast(x, torch.tensor(1.0, device="cuda"), E4M3, True, seed=torch.tensor([3], device="cuda"))
    p_up = (out.float() == 1.125).float().mean().item()
    p, n = 0.8, x.numel()
    assert abs(p_up - p) < 6 * (p * (1 - p) / n) ** 0.5
    y = torch.randn(3000, 700, device="cuda")
    y[100, 7] = -float("inf")
    assert _cuda_cast(y, None, E4M3, True, write_row=False)[2].item() == float("inf")
    y[5, 5] = float("nan")
    assert torch.isnan(_cuda_cast(y, None, E4M3, True, write_row=False)[2])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(RECIPES))
def test_cuda_scaled_cast_fused_matches_reference(name, monkeypatch):
    recipe = RECIPES[name]
    assert kernels.triton_available(), "triton should ship with CUDA torch"
    ref = _run_casts(recipe, False, monkeypatch, device="cuda")
    fused = _run_casts(recipe, True, monkeypatch, device="cuda")
    _assert_runs_equal(ref, fused)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_fp8linear_fused_vs_reference(monkeypatch):
    import copy

    from lightning_fp8 import FP8Linear, fp8_state_dict

    torch.manual_seed(0)
    layer = FP8Linear(1024, 2048).cuda()
    twin = copy.deepcopy(layer)
    x = torch.randn(4, 256, 1024, device="cuda")
    grads = []
    for disable, mod in (("1", layer), ("0", twin)):
        monkeypatch.setenv("LIGHTNING_FP8_DISABLE_TRITON", disable)
        xi = x.clone().requires_grad_()
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = mod(xi)
            y.float().square().mean().backward()
        grads.append((y.detach(), xi.grad, mod.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    for k, v in {**layer.state_dict(), **fp8_state_dict(layer)}.items():
        assert torch.equal(v, {**twin.state_dict(), **fp8_state_dict(twin)}[k]), k


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_kernels_launch_on_the_tensors_device_not_the_current_one():
    """Defect: Triton launches on the current device. With cuda:0 current and every tensor on cuda:1, whose stream
    is kept busy until the input is written, a kernel launched on cuda:0 would fault or read the input before it
    exists; under the device guard each kernel runs on cuda:1, after the input, and cuda:0 stays current."""
    from lightning_fp8.kernels import triton_cast
    from lightning_fp8.kernels.kernel_reference import close_step_reference, scaled_cast_reference
    from lightning_fp8.kernels.triton_scaling import launch_close_step

    second = torch.device("cuda", 1)
    source = wide_random((512, 384), seed=4, device=second).clamp(-3e4, 3e4)
    hw = not kernels.use_soft_cast(source)

    def fresh_input():
        with torch.cuda.device(second):
            torch.cuda._sleep(100_000_000)  # ~0.1 s of work queued on cuda:1's stream
        return source * 1.0  # runs on cuda:1's stream after the sleep

    with torch.cuda.device(0):
        for fmt in FORMATS:
            x = fresh_input()
            s = torch.tensor(3.0, device=second)
            out, out_t, amax = triton_cast.launch_cast(x, s, fmt, write_row=True, write_t=True, compute_amax=True,
                                                       hw_cast=hw)
            ref = quantize(x, s, fmt)
            assert out.device == second
            assert_same_fp8(out.view(fmt.dtype), ref, nan_sign=not hw)
            assert_same_fp8(out_t.view(fmt.dtype), ref.t().contiguous(), nan_sign=not hw)
            assert_same_amax(amax, tensor_amax(x))

            x = fresh_input()
            hist = torch.zeros(3, 9, device=second)
            h_ref = hist.clone()
            q, q_t, scale, _ = triton_cast.launch_scaled_cast(x, hist[1], fmt, "current", True, 0, False, write_t=True,
                                                              record=True, hw_cast=hw)
            q_ref, scale_ref = scaled_cast_reference(x, h_ref, 1, fmt, "current", True, 0, False)
            assert torch.equal(scale, scale_ref)
            assert_same_fp8(q.view(fmt.dtype), q_ref, nan_sign=not hw)
            assert torch.equal(hist, h_ref)

        meta = FP8LayerState(FP8Recipe(), device=second)
        history = torch.rand(meta.amax_history.shape, device=second) * 10
        counts = [torch.zeros(3, dtype=torch.int64, device=second) for _ in range(4)]
        h_kernel, h_ref = history.clone(), history.clone()
        launch_close_step(h_kernel, counts[0], counts[1], *meta.constants(), True)
        close_step_reference(h_ref, counts[2], counts[3], meta.constants(), True)
        assert torch.equal(h_kernel, h_ref) and torch.equal(counts[0], counts[2]) and torch.equal(counts[1], counts[3])
        assert torch.cuda.current_device() == 0  # the guard restores the caller's device
    torch.cuda.synchronize(second)
