"""The Triton kernels compiled ahead of time for the GPUs users have, on CPU: no GPU, nothing here is marked `cuda`.

`triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))` runs Triton's whole
pipeline down to its bundled ptxas for sm80 (A100), sm89 (L4, L40S, RTX 40xx), sm90 (H100), sm100 (B200) and sm120
(RTX 50xx). The variants compiled are the ones the host code launches: each launcher (`launch_cast`,
`launch_scaled_cast`, `launch_close_step`, `adamw_multi_step_triton_`) runs on small CPU tensors with its kernel
replaced by a recorder, and the recorded arguments give the signature (pointer dtypes, scalars) and the constexprs.
So a launcher change that emits a variant which cannot compile somewhere fails here.

What this proves (and what it cannot): that each architecture's *selected* variant compiles, that the hardware FP8
conversion does not compile below sm89 (so the selection is needed, not luck), which conversion instructions the
PTX holds, and that the fused AdamW step has no NaN-dropping float min/max left. Not: that the instructions compute
what the reference computes (the interpreter suite checks the kernels' logic; `pytest -m cuda` the hardware).
Works with Triton 3.6 (what the GPU machines run) and the newest release (what CI installs): the signature is read
from the kernel's own argument names.
"""
from __future__ import annotations

import contextlib
import functools
import re
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lightning_fp8 import kernels  # noqa: E402
from lightning_fp8.kernels import device as device_module  # noqa: E402
from lightning_fp8.kernels import hardware_cast_exact, triton_cast, triton_version  # noqa: E402
from lightning_fp8.numerics import E4M3, E5M2  # noqa: E402

ARCHS = (80, 89, 90, 100, 120)
FORMATS = (E4M3, E5M2)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")
_POINTER_TYPES = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}
#: the instruction that converts float32 to FP8 in one rounding (sm89+)
DIRECT_CVT = {"e4m3": "cvt.rn.satfinite.e4m3x2.f32", "e5m2": "cvt.rn.satfinite.e5m2x2.f32"}
#: any conversion to or from an FP8 format in PTX
ANY_FP8_CVT = re.compile(r"\bcvt\.[a-z0-9.]*(e4m3|e5m2)")
#: a float min / max that returns the other operand for a NaN (PTX spells the propagating form `max.NaN.f32`)
NAN_DROPPING_MIN_MAX = re.compile(r"\b(?:redux\.sync\.)?(?:max|min)(?:\.ftz)?(?:\.abs)?\.(?:f16|bf16|f32|f64)(?:x2)?\b")


def capability(arch: int) -> Tuple[int, int]:
    return arch // 10, arch % 10


def on_gpu(monkeypatch, arch: int) -> None:
    """CUDA tensors from here on are on a GPU of this architecture (for the code that asks: kernels.device), and the
    launch guard does not need a CUDA runtime; the tensors themselves are fake (`fake_cuda`)."""
    monkeypatch.delenv("LIGHTNING_FP8_SOFT_CAST", raising=False)
    monkeypatch.setattr(device_module, "_cuda_profile", lambda index: device_module.DeviceProfile("cuda", capability(arch)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def fake_cuda(*tensors: torch.Tensor) -> List[torch.Tensor]:
    """Fake cuda:0 tensors with the shapes and dtypes of `tensors` (no data: the launches are only recorded)."""
    with FakeTensorMode():
        return [torch.empty(t.shape, dtype=t.dtype, device="cuda:0") for t in tensors]


def selected_hw(monkeypatch, arch: int) -> bool:
    """The conversion the casts choose on this GPU (`use_soft_cast`, what ops.py passes to the kernels)."""
    with monkeypatch.context() as m:
        on_gpu(m, arch)
        return not kernels.use_soft_cast(fake_cuda(torch.zeros(2, 2))[0])


# -- recording the launches the host code makes ---------------------------------------------------------------------
class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` is recorded, nothing runs."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: List[Tuple[tuple, dict]] = []

    def __getitem__(self, grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def record(monkeypatch, module, kernel_name: str, run: Callable[[], Any]) -> List["Variant"]:
    """The kernel variants `run()` launches through `module.<kernel_name>`."""
    recorder = _Recorder(getattr(module, kernel_name))
    with monkeypatch.context() as m:
        m.setattr(module, kernel_name, recorder)
        run()
    return [Variant.of(recorder.kernel, args, kwargs) for args, kwargs in recorder.launches]


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton signature type for {type(value).__name__}")


class Variant:
    """One compilable specialisation of a kernel: the signature of its run-time arguments, its constexprs and launch
    options, hashable so that a variant is compiled once per architecture in a session."""

    def __init__(self, kernel, signature: Dict[str, str], constexprs: Dict[str, Any], options: Dict[str, Any]):
        self.kernel, self.signature, self.constexprs, self.options = kernel, signature, constexprs, options

    @classmethod
    def of(cls, kernel, args: tuple, kwargs: dict) -> "Variant":
        names = kernel.arg_names
        constexprs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
        options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        values = dict(zip(names, args))
        signature = {n: "constexpr" if n in constexprs else _arg_type(values[n]) for n in names}
        return cls(kernel, signature, constexprs, options)

    def with_(self, **constexprs) -> "Variant":
        return Variant(self.kernel, self.signature, {**self.constexprs, **constexprs}, self.options)

    def key(self):
        return (self.kernel.__name__, tuple(self.signature.items()), tuple(sorted(
            (k, repr(v)) for k, v in self.constexprs.items())), tuple(sorted(self.options.items())))

    def __repr__(self) -> str:
        return f"{self.kernel.__name__}({self.constexprs})"


_compiled: Dict[tuple, Any] = {}


def compile_for(variant: Variant, arch: int):
    """The compiled kernel (PTX in `.asm["ptx"]`), or the exception Triton raised; once per variant and arch."""
    key = (variant.key(), arch)
    if key not in _compiled:
        source = ASTSource(variant.kernel, signature=dict(variant.signature), constexprs=dict(variant.constexprs))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Triton 3.9's notice about its fp-fusion default
                _compiled[key] = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                                options=dict(variant.options))
        except Exception as exc:  # noqa: BLE001 - the failure is the result under test
            _compiled[key] = exc
    return _compiled[key]


def ptx_of(variant: Variant, arch: int) -> str:
    compiled = compile_for(variant, arch)
    if isinstance(compiled, Exception):
        raise AssertionError(f"{variant} does not compile for sm{arch}: {_message(compiled)}") from compiled
    return compiled.asm["ptx"]


def _message(exc: BaseException) -> str:
    """The whole chain of a compile error (Triton wraps the cause in CompilationErrors)."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


# -- the variants ---------------------------------------------------------------------------------------------------
def cast_variant(monkeypatch, fmt, hw_cast: bool) -> Variant:
    """The widest `launch_cast` variant: both layouts, amax, stochastic rounding with a noise tensor (which decodes
    FP8 codes as well as encoding them)."""
    x = torch.randn(16, 32)
    return record(monkeypatch, triton_cast, "_cast_kernel", lambda: triton_cast.launch_cast(
        x, torch.tensor(1.0), fmt, write_row=True, write_t=True, compute_amax=True, noise=torch.rand(16, 32),
        hw_cast=hw_cast))[0]


def adamw_variant(monkeypatch, arch: int, exp_avg_sq_dtype: str = "fp8", aligned: bool = True, **group) -> Variant:
    """The variant `adamw_multi_step_triton_` launches for two CUDA parameters on a GPU of this architecture (its own
    choice of conversion, through kernels.use_soft_cast). Fake tensors have no addresses, so the per-tensor table is
    a fake one of the real table's shape and dtype, and `aligned` stands for what the addresses and sizes would say
    (the interpreter tests in tests/test_optim.py run the real table)."""
    from lightning_fp8.optim import FP8AdamW, moment_storage as opt_state, triton_adamw

    ws = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(48, 96))]
    with monkeypatch.context() as m:
        m.setattr(opt_state, "FP8_SQRT_V_ROUNDING", "nearest")  # the kernel's fp8 second moment
        group = FP8AdamW(ws, exp_avg_sq_dtype=exp_avg_sq_dtype, **group).param_groups[0]
        states = [opt_state.init_state(w, group) for w in ws]
        on_gpu(m, arch)
        params, grads, fake_states = [], [], []
        for w, state in zip(ws, states):
            keys = [k for k in state if k != "step"]  # step stays a CPU tensor, as FP8AdamW keeps it
            param, grad, *moments = fake_cuda(w.detach(), w.detach(), *(state[k] for k in keys))
            params.append(param)
            grads.append(grad)
            fake_states.append({"step": state["step"], **dict(zip(keys, moments))})
        table, coef = fake_cuda(torch.zeros(len(triton_adamw._TABLE_ROWS), len(ws), dtype=torch.int64),
                                torch.zeros(2, len(ws), dtype=torch.float64))
        m.setattr(triton_adamw, "_launch_table", lambda *args: (table, coef, 68, aligned))
        return record(m, triton_adamw, "_fp8_adamw_block_kernel",
                      lambda: triton_adamw.adamw_multi_step_triton_(params, grads, fake_states, group))[0]


#: constexprs that carry a number (block sizes, history length, format constants) rather than choose code
NUMERIC_CONSTEXPRS = {"BLOCK_M", "BLOCK_N", "BLOCK", "HIST_LEN", "HIST_BLOCK", "MARGIN_DIV", "FP8_MAX", "MANT", "BIAS",
                      "MAX_CODE", "M_MAX", "V_MAX", "FLT_MAX", "B", "BLOCK_R", "BLOCK_C"}


def _features(variant: Variant) -> set:
    """What a variant exercises: each code-choosing constexpr's value and each argument's type."""
    return ({(variant.kernel.__name__, "arg", k, t) for k, t in variant.signature.items() if t != "constexpr"}
            | {(variant.kernel.__name__, "constexpr", k, repr(v)) for k, v in variant.constexprs.items()
               if k not in NUMERIC_CONSTEXPRS and k != "HW_CAST"})


def covering(variants: List[Variant]) -> List[Variant]:
    """A few of `variants` in which every constexpr value and argument type of all of them occurs (greedy cover)."""
    unique = list({v.key(): v for v in variants}.values())
    needed = set().union(*(_features(v) for v in unique))
    chosen = []
    while needed:
        best = max(unique, key=lambda v: len(_features(v) & needed))
        chosen.append(best)
        needed -= _features(best)
    return chosen


def record_kernels(monkeypatch, module, kernel_names, run: Callable[[], Any]) -> List["Variant"]:
    """The variants of several kernels of `module` that `run()` launches (each replaced by a recorder)."""
    recorders = {name: _Recorder(getattr(module, name)) for name in kernel_names}
    with monkeypatch.context() as m:
        for name, recorder in recorders.items():
            m.setattr(module, name, recorder)
        run()
    return [Variant.of(r.kernel, args, kwargs) for r in recorders.values() for args, kwargs in r.launches]


def tiled_variants(monkeypatch) -> List["Variant"]:
    """Every variant `launch_tiled_cast` emits: the block kernel (1xB / BxB tiles, each layout alone and both, token
    padding) and the two rowwise kernels, both formats, the three input dtypes, power-of-two scales or not, recording
    the amax or not."""
    import itertools

    from lightning_fp8.kernels import triton_tiled

    def calls():
        for dtype, fmt in itertools.product((torch.float32, torch.bfloat16, torch.float16), FORMATS):
            x = torch.randn(200, 300).to(dtype)  # (nothing runs: the block size compiled is the one layers use)
            for kind, (row, t), pow2, rec in itertools.product(
                    (("1xB", 128), ("BxB", 128), ("rowwise", 0)), ((True, False), (False, True), (True, True)),
                    (False, True), (False, True)):
                hist = torch.zeros(1) if rec else None
                triton_tiled.launch_tiled_cast(x, hist, fmt, kind, row, t, 1, pow2, 256 if t else 200, hw_cast=True)

    return record_kernels(monkeypatch, triton_tiled, ("_block_cast_kernel", "_colwise_kernel", "_rowwise_cast_kernel"),
                          calls)


def _every_launch(monkeypatch) -> Tuple[List[Variant], List[Variant], List[Variant], List[Variant]]:
    """Every variant the launchers emit over their options: the cast kernel and the scaled cast's amax pre-pass (launch_cast: layouts, amax, rounding,
    skip flag; launch_scaled_cast: scaling mode, history reduction, power-of-two, layouts, recording, rounding; both
    formats, the three input dtypes), the close-step kernel (step taken or not) and the fused AdamW step (second
    moment dtype, vectorised addresses or not, decoupled, maximize, weight decay)."""
    import itertools

    from lightning_fp8.kernels import triton_scaling
    from lightning_fp8.modules.layer_state import FP8LayerState
    from lightning_fp8.recipe import FP8Recipe

    def cast_calls():
        for dtype, fmt in itertools.product((torch.float32, torch.bfloat16, torch.float16), FORMATS):
            x = torch.randn(16, 32).to(dtype)
            roundings = (dict(), dict(noise=torch.rand(16, 32)), dict(seed=torch.tensor([3])))
            for (row, t), amax, rounding in itertools.product(((True, False), (False, True), (True, True)),
                                                              (True, False), roundings):
                triton_cast.launch_cast(x, torch.tensor(2.0), fmt, write_row=row, write_t=t, compute_amax=amax,
                                        **rounding)
            for skip_if in (None, torch.tensor(False)):
                triton_cast.launch_cast(x, None, fmt, write_row=False, write_t=False, compute_amax=True,
                                        skip_if=skip_if)
            for scaling, algo_max, pow2, t, rec, rounding in itertools.product(
                    ("delayed", "current", "none"), (True, False), (False, True), (False, True), (False, True),
                    roundings):
                triton_cast.launch_scaled_cast(x, torch.zeros(17), fmt, scaling, algo_max, 1, pow2, write_t=t,
                                               record=rec, **rounding)

    prepass = _Recorder(triton_cast._amax_partials_kernel)

    def cast_and_prepass_calls():
        with monkeypatch.context() as m:
            m.setattr(triton_cast, "_amax_partials_kernel", prepass)
            cast_calls()

    casts = record(monkeypatch, triton_cast, "_cast_kernel", cast_and_prepass_calls)
    prepasses = [Variant.of(prepass.kernel, args, kwargs) for args, kwargs in prepass.launches]
    meta = FP8LayerState(FP8Recipe())
    closes = []
    for taken in (True, False):
        closes += record(monkeypatch, triton_scaling, "_close_step_kernel", lambda: triton_scaling.launch_close_step(
            meta.amax_history.clone(), meta.overflow_count.clone(), meta.clip_count.clone(),
            *meta.constants(), taken))
    steps = [adamw_variant(monkeypatch, 90, vdt, aligned, decoupled_weight_decay=decoupled, maximize=maximize,
                           weight_decay=wd)
             for vdt, aligned, decoupled, maximize, wd in itertools.product(
                 ("fp16", "fp8"), (True, False), (True, False), (False, True), (0.0, 0.01))]
    return casts, prepasses, closes, steps


@functools.lru_cache(maxsize=None)
def launcher_variants() -> Tuple[Tuple[Variant, int], ...]:
    """The covering variants of each kernel, each with the architecture it is compiled for (round robin, so every
    architecture gets a share and each variant compiles once) and that architecture's choice of conversion."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        casts, prepasses, closes, steps = _every_launch(monkeypatch)
        tiled = tiled_variants(monkeypatch)
    chosen = covering(casts) + covering(prepasses) + covering(closes) + covering(steps)
    for name in ("_block_cast_kernel", "_colwise_kernel", "_rowwise_cast_kernel"):
        chosen += covering([v for v in tiled if v.kernel.__name__ == name])
    assigned = []
    for i, variant in enumerate(chosen):
        arch = ARCHS[i % len(ARCHS)]
        if "HW_CAST" in variant.constexprs:
            variant = variant.with_(HW_CAST=hardware_cast_exact(capability(arch), triton_version()))
        assigned.append((variant, arch))
    return tuple(assigned)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_launcher_variant_compiles(arch):
    """Each code-choosing constexpr value and argument type the launchers emit, compiled at least once (a covering
    subset of every launch, not the cross product: the architecture-dependent part, the conversion, is checked per
    architecture above)."""
    share = [variant for variant, on in launcher_variants() if on == arch]
    assert share
    for variant in share:
        ptx_of(variant, arch)


def test_launcher_variants_cover_every_choice():
    with pytest.MonkeyPatch.context() as monkeypatch:
        everything = [v for group in _every_launch(monkeypatch) for v in group] + tiled_variants(monkeypatch)
    compiled = launcher_variants()
    assert set().union(*(_features(v) for v in everything)) == set().union(*(_features(v) for v, _ in compiled))
    assert {arch for _, arch in compiled} == set(ARCHS)
    assert {v.kernel.__name__ for v, _ in compiled} >= {"_block_cast_kernel", "_colwise_kernel", "_rowwise_cast_kernel"}
    assert len(compiled) <= 30, len(compiled)  # keeps the suite fast (29: the amax pre-pass joined)


# -- selection: what each architecture runs compiles, with the conversion we rely on -----------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_selected_cast_variant_compiles_with_the_conversion_we_rely_on(monkeypatch, arch):
    """The conversion `use_soft_cast` picks for a CUDA tensor on this GPU compiles there, and is the single-rounding
    hardware cvt or the integer rounding (no FP8 instruction at all)."""
    hw = selected_hw(monkeypatch, arch)
    assert hw == hardware_cast_exact(capability(arch), triton_version())
    assert hw == (arch >= 90 or (arch == 89 and triton_version() >= (3, 9)))
    for fmt in FORMATS:
        ptx = ptx_of(cast_variant(monkeypatch, fmt, hw), arch)
        if hw:
            assert DIRECT_CVT[fmt.name] in ptx, (arch, fmt.name)
            assert "cvt.rz.f16.f32" not in ptx  # no float16 intermediate (two roundings)
        else:
            assert not ANY_FP8_CVT.search(ptx), (arch, fmt.name)  # the integer rounding: no FP8 instruction at all


@pytest.mark.parametrize("arch", ARCHS)
def test_selected_adamw_variant_compiles(monkeypatch, arch):
    """Defect: the fused FP8AdamW step stored its moments with the e4m3 hardware conversion everywhere, which does not
    compile below sm89 (A100, A10, RTX 30xx)."""
    variant = adamw_variant(monkeypatch, arch)
    ptx = ptx_of(variant, arch)
    hw = selected_hw(monkeypatch, arch)
    assert variant.constexprs.get("HW_CAST", True) == hw
    if hw:
        assert DIRECT_CVT["e4m3"] in ptx
    else:
        assert not ANY_FP8_CVT.search(ptx)


def test_hardware_conversion_does_not_compile_below_sm89(monkeypatch):
    """The selection is needed, not luck: the hardware variants of both kernels fail on sm80 with Triton's message."""
    for variant in (cast_variant(monkeypatch, E4M3, True), adamw_variant(monkeypatch, 90).with_(HW_CAST=True)):
        failure = compile_for(variant, 80)
        assert isinstance(failure, Exception), variant
        assert "fp8e4nv not supported in this architecture" in _message(failure)
    assert not any(selected_hw(monkeypatch, arch) for arch in (80, 86, 87))


def test_sm89_hardware_conversion_is_selected_only_where_triton_rounds_once(monkeypatch):
    """Triton <= 3.8 lowers sm89's float32 -> FP8 conversion through float16 truncated toward zero, then rounds to FP8:
    two roundings (1.0625001 -> 1.0, the reference gives 1.125). The selection must follow the installed Triton's
    lowering, read from its PTX."""
    for fmt in FORMATS:
        ptx = ptx_of(cast_variant(monkeypatch, fmt, True), 89)
        single_rounding = DIRECT_CVT[fmt.name] in ptx and "cvt.rz.f16.f32" not in ptx
        assert selected_hw(monkeypatch, 89) == single_rounding, (triton.__version__, fmt.name)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_adamw_step_has_no_nan_dropping_min_max(monkeypatch, arch):
    """Defect: the fused step's block amax (tl.max) and saturation (tl.maximum / tl.minimum) compiled to PTX max.f32 /
    min.f32, which return the other operand for a NaN: a NaN moment was stored as -448 * s, a NaN second moment as
    -65504 * s, and the block scale ignored it (the reference keeps NaN, scale 1). Now the amax is an integer max
    over the bit patterns and every float min / max is the NaN-propagating form; the interpreter check in
    tests/test_optim.py runs the same source against the reference with NaN gradients."""
    variants = [adamw_variant(monkeypatch, arch)]
    if arch in (80, 90):  # the float16 second moment, with each conversion
        variants.append(adamw_variant(monkeypatch, arch, "fp16", weight_decay=0.0, maximize=True))
    for variant in variants:
        ptx = ptx_of(variant, arch)
        assert not NAN_DROPPING_MIN_MAX.findall(ptx), (variant, NAN_DROPPING_MIN_MAX.findall(ptx))
        assert "max.NaN.f32" in ptx and "min.NaN.f32" in ptx and "max.s32" in ptx  # the scan reads real code


def test_aligned_adamw_step_keeps_vectorised_loads():
    """The multi-tensor step reads its addresses from a table, where Triton's argument specialisation (16-byte
    aligned pointers, sizes divisible by 16) cannot see them, so its loads and stores would be one element each.
    ALIGNED (the host found every address aligned and every numel a multiple of 16) restores the 128-bit accesses the
    per-parameter kernel got from the specialisation; without it they stay scalar, which is right for unaligned
    tensors. A block of 1024 gives each thread 8 elements (128 elements per block is one per thread: nothing to
    vectorise)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        aligned = ptx_of(adamw_variant(monkeypatch, 90, "fp16", aligned=True, block_size=1024), 90)
        unaligned = ptx_of(adamw_variant(monkeypatch, 90, "fp16", aligned=False, block_size=1024), 90)
    assert "ld.global.v4.b32" in aligned and "st.global.v4.b32" in aligned
    assert "ld.global.v4" not in unaligned and "st.global.v4" not in unaligned


# -- the microscaled casts (kernels/triton_microscaled.py) ------------------------------------------------------------
MICROSCALED_KERNELS = ("_mx_cast_kernel", "_nvfp4_amax_kernel", "_nvfp4_cast_kernel")


@functools.lru_cache(maxsize=None)
def microscaled_variants() -> Tuple[Variant, ...]:
    """Every variant the microscaled launchers emit: MXFP8 (both formats, each layout alone and both, recording or
    not), NVFP4 (1 x 16 with and without the Hadamard transform of x^T, with and without stochastic rounding; 16 x 16
    weights; each layout alone and both; recording or not), the three input dtypes."""
    import itertools

    from lightning_fp8.kernels import triton_microscaled
    from lightning_fp8.kernels.microscaled_ops import layouts_of

    def calls():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(200, 300).to(dtype)  # (nothing runs: the recorder takes the launches)
            for fmt, (row, t), rec in itertools.product(FORMATS, ((True, False), (False, True), (True, True)),
                                                       (False, True)):
                layouts = layouts_of("mxfp8", x.shape, [1, 32] if row else [], [1, 32] if t else [], False)
                triton_microscaled.launch_mx_cast(x, torch.zeros(1) if rec else None, fmt, *layouts, hw_cast=True)
            for tile, (row, t), hadamard, stochastic, rec in itertools.product(
                    ((1, 16), (16, 16)), ((True, False), (False, True), (True, True)), (False, True), (False, True),
                    (False, True)):
                if tile == (16, 16) and (hadamard or stochastic):
                    continue  # weights: neither
                layouts = layouts_of("nvfp4", x.shape, tile if row else [], tile if t else [], hadamard)
                triton_microscaled.launch_nvfp4_cast(x, torch.zeros(1) if rec else None,
                                                     torch.tensor([1, 0]) if stochastic else None, *layouts, hadamard,
                                                     hw_cast=True)

    with pytest.MonkeyPatch.context() as monkeypatch:
        return tuple(record_kernels(monkeypatch, triton_microscaled, MICROSCALED_KERNELS, calls))


def _for_arch(variant: Variant, arch: int) -> Variant:
    if "HW_CAST" in variant.constexprs:
        return variant.with_(HW_CAST=hardware_cast_exact(capability(arch), triton_version()))
    return variant


@pytest.mark.parametrize("arch", (100, 120))
@pytest.mark.parametrize("kernel", MICROSCALED_KERNELS)
def test_microscaled_variants_compile_for_blackwell(kernel, arch):
    """Each code-choosing constexpr value and argument type of the MXFP8 / NVFP4 casts, compiled through ptxas for
    sm100 (B200) and sm120 (RTX 50xx) with that GPU's FP8 conversion (the hardware cvt): a covering subset of every
    launch. The E8M0 / E4M3 scale codes and the MX data use the single-rounding cvt; the Philox stream and the Hadamard
    butterflies are integer and float32 arithmetic."""
    variants = covering([v for v in microscaled_variants() if v.kernel.__name__ == kernel])
    assert variants
    for variant in variants:
        ptx = ptx_of(_for_arch(variant, arch), arch)
        if kernel == "_mx_cast_kernel":
            assert DIRECT_CVT["e4m3" if variant.constexprs["BIAS"] == 7 else "e5m2"] in ptx
        if kernel == "_nvfp4_cast_kernel":
            assert DIRECT_CVT["e4m3"] in ptx  # the E4M3 block scales
            if variant.constexprs["STOCHASTIC"]:
                assert "mul.hi.u32" in ptx  # Philox's multiply-high: the in-kernel stream


@pytest.mark.parametrize("arch", (80, 89, 90))
def test_microscaled_casts_compile_before_blackwell(arch):
    """The casts also run where the GEMMs are emulated (a CUDA GPU without block-scaled tensor cores): the widest
    variant of each kernel compiles there with that GPU's conversion (sm80: the integer rounding, no FP8 instruction)."""
    for kernel in MICROSCALED_KERNELS:
        variants = [v for v in microscaled_variants() if v.kernel.__name__ == kernel]
        widest = max(variants, key=lambda v: len(_features(v)) + sum(bool(x) for x in v.constexprs.values()
                                                                     if isinstance(x, bool)))
        ptx = ptx_of(_for_arch(widest, arch), arch)
        if not hardware_cast_exact(capability(arch), triton_version()):
            assert not ANY_FP8_CVT.search(ptx)
