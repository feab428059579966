"""A roofline model of one linear layer's training step (forward + backward), FP8 against BF16, built from what the
CUDA path launches.

Nothing here is measured. The kernels come from recording the layer's CUDA path on meta tensors
(`kernels.trace.record_launches` under `device.simulate_cuda`: every kernel with the bytes it reads and writes and
its FLOPs); each kernel's time is then

    max(FLOPs / (peak of its operand dtype x GEMM efficiency), bytes / (HBM bandwidth x memory efficiency), min_kernel_s)

summed over the step's kernels (kernels run one after another on one stream). `min_kernel_s` is the shortest a
kernel takes on the GPU (launch and tail), so a flood of tiny kernels costs what it costs even when its bytes are
nothing. Host-side operators are not kernels and are not priced (the recorder leaves them out); a copy of a host
tensor to the device is, at the HBM rate (optimistic: it crosses PCIe or C2C; the Triton paths of every recipe have
none in steady state). The casts are the Triton kernels or their torch reference, whichever the modelled machine runs
(`default_triton`). The peaks are the vendors' dense (no sparsity) tensor-core rates and HBM bandwidths of
`shape_filter.GPU_SPECS` (each with its source there); the efficiencies are assumptions stated on `GPUSpec`. What the
model cannot see: the GEMM efficiency differing between recipes on the same dtype (blockwise scaling's cuBLASLt
kernels reach less of the FP8 peak than tensorwise ones), L2 reuse, overlap of communication, and CPU-bound launch
gaps.

The same model is applied to Transformer Engine's documented structure (`te_launches`): one fused cast + transpose
(+ amax) kernel per operand, three GEMMs, so the comparison is of kernel structures, not of kernel qualities.

The shape filter (shape_filter.py) uses `predict` to keep a layer in BF16 where FP8 is predicted slower.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_fp8.kernels.trace import Launch
from lightning_fp8.recipe import FP8Recipe

#: shortest GPU time of one kernel, launch to end, however little it does: an assumption (the figure torchao's float8
#: roofline also uses)
MIN_KERNEL_S = 2e-6

_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_FP4_DTYPES = ("float4_e2m1fn_x2",)


@dataclass(frozen=True)
class LayerShape:
    """A linear's GEMM: M tokens, K input features, N output features."""

    tokens: int
    in_features: int
    out_features: int


@dataclass(frozen=True)
class Prediction:
    """One layer step on one GPU: predicted seconds, FP8 and BF16, and the FP8 kernels with their GPU seconds (the
    step's time is their sum, or the CPU's time to launch them where that is longer: `predict`)."""

    fp8_s: float
    bf16_s: float
    kernels: Tuple[Tuple[str, float], ...]

    @property
    def speedup(self) -> float:
        """BF16 time over FP8 time (> 1: FP8 faster)."""
        return self.bf16_s / self.fp8_s


def kernel_seconds(launch: Launch, spec) -> float:
    """The modelled time of one kernel on `spec` (a shape_filter.GPUSpec)."""
    memory = launch.bytes / (spec.hbm_tbps * 1e12 * spec.bw_efficiency)
    compute = 0.0
    if launch.flops:
        if launch.operand_dtype in _FP4_DTYPES:
            peak, efficiency = spec.fp4_tflops, spec.fp8_efficiency
        elif launch.operand_dtype in _FP8_DTYPES:
            peak, efficiency = spec.fp8_tflops, spec.fp8_efficiency
        else:
            peak, efficiency = spec.bf16_tflops, spec.bf16_efficiency
        if peak <= 0:
            raise ValueError(f"{spec.name} has no {launch.operand_dtype} tensor-core rate in the model")
        compute = launch.flops / (peak * 1e12 * efficiency)
    return max(compute, memory, MIN_KERNEL_S)


def step_seconds(launches: Sequence[Launch], spec) -> float:
    return sum(kernel_seconds(launch, spec) for launch in launches)


def _record(build, shape: LayerShape, capability: Optional[Tuple[int, int]], triton: bool = True) -> List[Launch]:
    """The launches of one forward + backward of `build(nn.Linear)` on meta tensors taking the CUDA path of
    `capability` (with the Triton kernels where `triton`; None: whatever path, for code that has no CUDA branch). The
    upstream gradient is made outside the recording (it is the next layer's)."""
    import contextlib

    from lightning_fp8.kernels.device import simulate_cuda, simulated_profile
    from lightning_fp8.kernels.trace import record_launches

    active = simulated_profile()  # simulations do not nest: inside one (a test, an offline check), record under it
    if active is not None and capability is not None and (tuple(active.capability) != tuple(capability)
                                                           or active.triton != triton):
        raise RuntimeError(f"roofline: cannot record the CUDA path of sm{capability[0]}{capability[1]} "
                           f"({'with' if triton else 'without'} triton) inside a simulation of {active.name} "
                           f"({'with' if active.triton else 'without'} triton)")
    simulation = (contextlib.nullcontext() if active is not None or capability is None
                  else simulate_cuda(capability, triton=triton))
    with simulation:
        layer = build(nn.Linear(shape.in_features, shape.out_features, bias=False, device="meta",
                                dtype=torch.bfloat16))
        x = torch.empty(shape.tokens, shape.in_features, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with record_launches() as forward:
            y = layer(x)
        grad = torch.empty_like(y)
        with record_launches() as backward:
            y.backward(grad)
    return forward + backward


def default_triton() -> bool:
    """Whether the CUDA path being modelled runs the Triton kernels: the active simulation's setting, else whether
    triton is installed (a CUDA machine without it runs the torch reference casts)."""
    from lightning_fp8.kernels.device import simulated_profile

    active = simulated_profile()
    return active.triton if active is not None else importlib.util.find_spec("triton") is not None


def fp8_launches(shape: LayerShape, recipe: FP8Recipe, capability: Tuple[int, int],
                 triton: Optional[bool] = None) -> Tuple[Launch, ...]:
    """What an FP8Linear of `recipe` launches for one training step (bf16 activations and weight), as the engine
    runs it in steady state: no scale close of its own (the engine closes every layer's step in one pass per
    iteration) and, its decisions having read that every history sizes a delayed scale, no amax pre-pass in a
    delayed cast. `triton`: whether the Triton kernels run (default: `default_triton()`); cached per argument."""
    return _fp8_launches(shape, recipe, tuple(capability), default_triton() if triton is None else bool(triton))


@functools.lru_cache(maxsize=256)
def _fp8_launches(shape: LayerShape, recipe: FP8Recipe, capability: Tuple[int, int],
                  triton: bool) -> Tuple[Launch, ...]:
    import warnings

    from lightning_fp8.modules.linear import FP8Linear

    def as_the_engine_runs_it(linear: nn.Linear) -> FP8Linear:
        layer = FP8Linear.from_linear(linear, recipe)
        layer.closes_own_steps = False
        layer.fp8_meta.history_sized = [True] * len(layer.fp8_meta.history_sized)
        return layer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an emulated GEMM warns; it shows in the launches (mm on dequantized data)
        return tuple(_record(as_the_engine_runs_it, shape, capability, triton))


fp8_launches.cache_clear = _fp8_launches.cache_clear  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=256)
def bf16_launches(shape: LayerShape) -> Tuple[Launch, ...]:
    """What a BF16 nn.Linear launches for one training step: the three GEMMs (the same on every GPU)."""
    return tuple(_record(lambda linear: linear, shape, None))


def te_launches(shape: LayerShape, recipe: FP8Recipe) -> Tuple[Launch, ...]:
    """Transformer Engine's documented structure for the same step, as launches: per operand one fused kernel that
    reads the BF16 tensor once and writes FP8 in the layouts its GEMMs read (x and dY: both; W: both, the transpose
    kept for backward), with the amax fused in (delayed scaling) or one amax kernel first (current scaling: one more
    read); three FP8 GEMMs with BF16 outputs. Scale bookkeeping (one fused kernel for all layers per iteration) is
    left out, as the engine's close is for ours."""
    m, k, n = shape.tokens, shape.in_features, shape.out_features
    current = recipe.scaling == "current"
    launches: List[Launch] = []
    for rows, cols in ((m, k), (n, k), (m, n)):  # x, W, dY
        if current:
            launches.append(Launch("te", "amax", 2 * rows * cols, 4))
        launches.append(Launch("te", "cast_transpose", 2 * rows * cols, 2 * rows * cols))
    fp8 = "float8_e4m3fn"
    for a_rows, kk, b_cols in ((m, k, n), (m, n, k), (n, m, k)):  # forward, dgrad, wgrad
        launches.append(Launch("te", "gemm", a_rows * kk + kk * b_cols, 2 * a_rows * b_cols,
                               2 * a_rows * kk * b_cols, fp8))
    return tuple(launches)


def capability_of(spec) -> Tuple[int, int]:
    """The compute capability whose CUDA path runs on `spec`."""
    return tuple(getattr(spec, "capability", (9, 0)))


def predict(shape: LayerShape, recipe: FP8Recipe, spec, launches: Optional[Sequence[Launch]] = None,
            compiled: bool = False) -> Prediction:
    """FP8 against BF16 for one training step of `shape` under `recipe` on `spec` (model, not a measurement).
    `launches`: the FP8 step's kernels (default: our CUDA path, recorded; `te_launches` for Transformer Engine's).

    Eager mode issues every kernel from the CPU: a step takes at least `spec.launch_s` per kernel however little
    the GPU has to do, which is what keeps small layers faster in BF16 (3 launches) than in FP8. `compiled`: under
    torch.compile, inductor fuses the aten elementwise kernels (dtype conversions, the bias add) into neighbours:
    they cost nothing here; the casts are custom ops and stay."""
    if launches is None:
        launches = fp8_launches(shape, recipe, capability_of(spec))
    if compiled:
        launches = [launch for launch in launches if launch.is_gemm or launch.source != "aten"]
    kernels = tuple((launch.name, kernel_seconds(launch, spec)) for launch in launches)
    bf16 = bf16_launches(shape)
    fp8_s = max(sum(t for _, t in kernels), len(kernels) * spec.launch_s)
    bf16_s = max(step_seconds(bf16, spec), len(bf16) * spec.launch_s)
    return Prediction(fp8_s, bf16_s, kernels)
