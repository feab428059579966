"""Shape-aware auto filter: keep a linear in BF16 where FP8 is predicted slower.

FP8 halves GEMM time at best, and pays for it with casts that move bytes (and, in eager mode, launch small
kernels). `fp8_wins` asks the roofline model (roofline.py) for one training step of the layer: the kernels the
layer's recipe launches on the CUDA path, recorded on meta tensors (not assumed), each timed with the GPU's
published peaks (`GPU_SPECS`, sources below) and assumed efficiencies, against BF16 nn.Linear's three GEMMs; in eager
mode a step also takes at least one CPU launch time per kernel. A layer predicted slower in FP8 stays BF16 with the
prediction as its reason in the precision map.

It is a model with *assumed* efficiencies (stated on `GPUSpec`), not a measurement: with them it keeps
4096x1024x1024-sized layers (and smaller) in BF16 and converts 16384x4096x14336.

On CPU, or a GPU without FP8 tensor cores, FP8 is emulated: there is no speed to win or lose, so nothing is
filtered ("FP8 emulated: no speed model"). Convolutions are left to the default rules (converted where they can run
in FP8): the model's M is tokens per step, and a convolution's M is its number of output positions, which the filter
does not know.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple, Union

import torch
from torch import nn

from lightning_fp8.conversion import layer_kinds, roofline
from lightning_fp8.conversion.filters import SKIP_REASON_ATTR, structural_skip_reason
from lightning_fp8.recipe import FP8Recipe

EMULATED_REASON = "FP8 emulated: no speed model"
#: what the filter decides for a convolution that can run in FP8: it has no speed model for them
CONVOLUTION_NOTE = ("convolution: no speed model (its GEMMs' M is the number of output positions, not "
                    "tokens_per_batch); converted, as the default filter does")


@dataclass(frozen=True)
class GPUSpec:
    """Throughput facts of one GPU. Peaks are dense (no sparsity) tensor-core rates."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_tbps: float
    #: fraction of peak a large BF16 GEMM reaches: an assumption (typical of large cuBLAS GEMMs on Hopper)
    bf16_efficiency: float = 0.80
    #: FP8 GEMMs (cuBLASLt via _scaled_mm) reach a smaller fraction of their doubled peak (assumed)
    fp8_efficiency: float = 0.65
    #: fraction of HBM bandwidth an elementwise cast kernel reaches (assumed)
    bw_efficiency: float = 0.85
    #: seconds per kernel launch in eager mode (CPU-bound dispatch of small kernels; assumed)
    launch_s: float = 6e-6
    #: dense FP4 rate (Blackwell's NVFP4 / MXFP4 tensor cores); 0: none
    fp4_tflops: float = 0.0
    #: the compute capability (which CUDA path the roofline model records, roofline.py)
    capability: Tuple[int, int] = (9, 0)


#: Vendor peak numbers, dense (the datasheets' sparsity figures halved); efficiencies are the assumptions noted on
#: GPUSpec. Sources: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM / PCIe / NVL: BF16, FP8, HBM), NVIDIA H200
#: Tensor Core GPU datasheet (H200 SXM: the H100 SXM's compute, 4.8 TB/s HBM3e), NVIDIA Blackwell architecture
#: technical brief (B200 in HGX B200, per GPU: BF16 2.25, FP8 4.5, FP4 9 PFLOP/s dense, 8 TB/s HBM3e), the L40S and
#: RTX 4090 (Ada) datasheets, the NVIDIA RTX Blackwell (GeForce RTX 5090, sm120) architecture figures: 838 FP16 and
#: 1677 FP8 tensor TFLOP/s sparse with FP16 accumulation, halved for dense and halved again for FP32 accumulation
#: (what training runs, as the RTX 4090's row), 1792 GB/s GDDR7; its FP4 rate is left out (NVFP4 does not run
#: natively on sm120 here: modules/scaled_mm.py). Matched against torch.cuda.get_device_name() by substring, first
#: match wins (so "H100 PCIe" before "H100").
GPU_SPECS: Tuple[Tuple[str, GPUSpec], ...] = (
    ("B200", GPUSpec("B200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_tbps=8.0, fp4_tflops=9000.0,
                     capability=(10, 0))),
    ("H200", GPUSpec("H200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tbps=4.8)),
    ("GH200", GPUSpec("GH200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tbps=4.0)),
    ("H100 PCIe", GPUSpec("H100 PCIe", bf16_tflops=756.0, fp8_tflops=1513.0, hbm_tbps=2.0)),
    ("H100 NVL", GPUSpec("H100 NVL", bf16_tflops=835.0, fp8_tflops=1671.0, hbm_tbps=3.9)),
    ("H100", GPUSpec("H100 SXM", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tbps=3.35)),
    ("H800", GPUSpec("H800", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_tbps=3.35)),
    ("L40S", GPUSpec("L40S", bf16_tflops=362.0, fp8_tflops=733.0, hbm_tbps=0.864, capability=(8, 9))),
    ("4090", GPUSpec("RTX 4090", bf16_tflops=165.0, fp8_tflops=330.0, hbm_tbps=1.0, capability=(8, 9))),
    ("5090", GPUSpec("RTX 5090", bf16_tflops=209.5, fp8_tflops=419.0, hbm_tbps=1.792, capability=(12, 0))),
)

#: per compute-capability major version, the GPU whose figures stand for the family where a device's own name has
#: none (a simulated GPU, or one missing from GPU_SPECS): sm89 L40S, sm90 H100 SXM, sm100 / sm103 B200, sm120 /
#: sm121 RTX 5090
FAMILY_SPECS: Dict[int, str] = {8: "L40S", 9: "H100", 10: "B200", 12: "5090"}

DeviceLike = Union[None, str, torch.device, GPUSpec]


def spec_for_name(device_name: str) -> Optional[GPUSpec]:
    for key, spec in GPU_SPECS:
        if key.lower() in device_name.lower():
            return spec
    return None


def spec_for_capability(capability: Tuple[int, int]) -> Optional[GPUSpec]:
    """The speed model standing for GPUs of `capability` (`FAMILY_SPECS`), or None (no FP8 tensor cores, or a family
    without one); the capability it models is `capability` itself."""
    if tuple(capability) < (8, 9) or capability[0] not in FAMILY_SPECS:
        return None
    spec = spec_for_name(FAMILY_SPECS[capability[0]])
    return replace(spec, capability=tuple(capability)) if spec is not None else None


def resolve_spec(device: DeviceLike = None) -> Tuple[Optional[GPUSpec], str]:
    """(spec, note): the speed model for `device`, or None with the reason there is none."""
    if isinstance(device, GPUSpec):
        return device, device.name
    if isinstance(device, str) and not _looks_like_device(device):
        spec = spec_for_name(device)
        return (spec, spec.name) if spec else (None, f"no speed model for GPU {device!r}")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, EMULATED_REASON
    if torch.cuda.get_device_capability(device) < (8, 9):
        return None, EMULATED_REASON
    name = torch.cuda.get_device_name(device)
    spec = spec_for_name(name)
    return (spec, spec.name) if spec else (None, f"no speed model for GPU {name!r}; FP8 kept")


def _looks_like_device(s: str) -> bool:
    return s.split(":")[0] in ("cpu", "cuda", "meta", "mps", "xpu")


def fp8_wins(
    m: int, k: int, n: int, device: DeviceLike = None, min_speedup: float = 1.0, compiled: bool = False,
    recipe: Optional[FP8Recipe] = None,
) -> Tuple[bool, str]:
    """Whether an M x K x N linear (M tokens per step) is faster in FP8 than in BF16 on `device`, and why.

    The prediction is the roofline model of roofline.py: the kernels `recipe`'s CUDA path launches for the layer
    (recorded, not assumed) timed with the GPU's peaks. device: None (the current CUDA device, else CPU), a
    torch.device / "cuda:0" / "cpu", a GPU name ("H100", "H200", "B200"), or a GPUSpec. Where FP8 is emulated the
    answer is (True, "FP8 emulated: no speed model"): nothing to gain or lose, so nothing is filtered. min_speedup:
    FP8 must beat BF16 by this factor to be chosen. compiled: the step runs under torch.compile (inductor fuses the
    elementwise conversions). recipe: the layer's recipe (default FP8Recipe())."""
    spec, note = resolve_spec(device)
    if spec is None:
        return True, note
    recipe = recipe if recipe is not None else FP8Recipe()
    prediction = roofline.predict(roofline.LayerShape(m, k, n), recipe, spec, compiled=compiled)
    bf16_s, fp8_s, speedup = prediction.bf16_s, prediction.fp8_s, prediction.speedup
    detail = (
        f"{m}x{k}x{n} fwd+bwd on {spec.name}, {recipe.scaling} scaling ({len(prediction.kernels)} kernels): "
        f"roofline model FP8 {fp8_s * 1e3:.3f} ms vs BF16 {bf16_s * 1e3:.3f} ms ({speedup:.2f}x)"
    )
    if speedup >= min_speedup:
        return True, f"FP8 faster: {detail}"
    return False, f"kept in BF16 by the shape filter: {detail}"


class AutoShapeFilter:
    """module_filter(module, fqn) -> bool for `convert_to_fp8`: True converts the linear to FP8.

    Keeps a linear in BF16 where `fp8_wins` says FP8 would be slower for `tokens_per_batch` tokens per step, and
    (as the default filter does) where its features are not multiples of 16 or nn.MultiheadAttention uses it
    functionally. Every decision is kept: `decisions[fqn] = (convert, reason)`; `skip_reason(module, fqn)` returns
    the reason a layer stays in BF16 (or None), in the convention of `convert.default_skip_reason`, and the
    filter also stores it on the module as `_fp8_skip_reason` (which `precision_map` reads)."""

    def __init__(
        self, tokens_per_batch: int, device: DeviceLike = None, min_speedup: float = 1.0, compiled: bool = False,
        recipe: Optional[FP8Recipe] = None,
    ) -> None:
        if not isinstance(tokens_per_batch, int) or tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be a positive int, got {tokens_per_batch!r}")
        self.tokens_per_batch = tokens_per_batch
        self.device = device
        self.min_speedup = min_speedup
        self.compiled = compiled
        self.recipe = recipe
        self.decisions: Dict[str, Tuple[bool, str]] = {}

    def skip_reason(self, module: nn.Module, fqn: str) -> Optional[str]:
        if layer_kinds.linear_kind(module) is None:
            return "not a linear layer conversion knows (lightning_fp8/conversion/layer_kinds.py)"
        reason = structural_skip_reason(module)
        if reason is None and layer_kinds.linear_kind(module).family == "convolution":
            # tokens_per_batch is not a convolution's M (output positions per step, which differ from layer to layer)
            self.decisions[fqn] = (True, CONVOLUTION_NOTE)
            return None
        if reason is None:
            device = self.device if self.device is not None else _device(module)
            in_features, out_features = layer_kinds.features(module)
            wins, why = fp8_wins(
                self.tokens_per_batch, in_features, out_features, device, self.min_speedup, self.compiled,
                self.recipe,
            )
            reason = None if wins else why
            self.decisions[fqn] = (wins, why)
            if wins:
                return None
        self.decisions[fqn] = (False, reason)
        return reason

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        reason = self.skip_reason(module, fqn)
        if reason is not None:
            setattr(module, SKIP_REASON_ATTR, reason)
        return reason is None


def auto_filter(
    tokens_per_batch: int, device: DeviceLike = None, min_speedup: float = 1.0, compiled: bool = False,
    recipe: Optional[FP8Recipe] = None,
) -> AutoShapeFilter:
    """A module_filter for `convert_to_fp8(model, module_filter=auto_filter(tokens_per_batch))` (see
    AutoShapeFilter). tokens_per_batch: rows of the activations each linear sees per step (batch x sequence
    length per device, per micro-batch). recipe: the recipe the layers will run (its kernels are what the model
    times; default FP8Recipe())."""
    return AutoShapeFilter(tokens_per_batch, device, min_speedup, compiled, recipe)


def shape_skip_reason(
    module: nn.Module,
    tokens_per_batch: int,
    device: DeviceLike = None,
    min_speedup: float = 1.0,
    compiled: bool = False,
    recipe: Optional[FP8Recipe] = None,
) -> Optional[str]:
    """For `default_skip_reason`: the reason to keep `module` in BF16 on speed grounds, or None to convert it."""
    device = device if device is not None else _device(module)
    in_features, out_features = layer_kinds.features(module)
    wins, why = fp8_wins(tokens_per_batch, in_features, out_features, device, min_speedup, compiled, recipe)
    return None if wins else why


def _device(module: nn.Module) -> torch.device:
    tensor = next(iter(module.parameters()), None)
    return tensor.device if tensor is not None else torch.device("cpu")
