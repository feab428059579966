"""FP8Recipe: the one frozen description of how a model computes in FP8.

Every other part of the library (conversion, FP8Linear, the engine, the adapters) reads its choices from a recipe,
so two runs with equal recipes compute the same way.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

from lightning_fp8.numerics.formats import E2M1, E4M3, E5M2, FP8Format, missing_torch_feature
from lightning_fp8.numerics.quantize import ROUNDING_MODES

#: tensor roles of a linear layer; each has its own scaling state
ROLES = ("input", "weight", "grad_output")

FORMAT_CHOICES = ("hybrid", "e4m3", "e5m2", "e2m1")
SCALING_CHOICES = ("delayed", "current", "rowwise", "blockwise", "mxfp8", "nvfp4")
#: scalings with one scale per tensor (what FP8 all-gather and FP8 tensor-parallel communication can carry)
PER_TENSOR_SCALINGS = ("delayed", "current")
#: the block-scaled formats of Blackwell tensor cores (lightning_fp8/numerics/microscaling.py)
MICROSCALING_SCALINGS = ("mxfp8", "nvfp4")
#: scalings with one scale per tile of a tensor instead of one per tensor (lightning_fp8/numerics/tiles.py)
FINE_GRAINED_SCALINGS = ("rowwise", "blockwise") + MICROSCALING_SCALINGS
#: from the least to the most precise: what FP8LayerFallback escalates along (callbacks/fallback_escalation.py).
#: nvfp4 (4-bit elements) is below every FP8 scaling; mxfp8 has the finest scales of the FP8 ones (32 elements along
#: the contraction dimension of every operand, where blockwise has 128 and 128 x 128).
SCALING_ORDER = {"nvfp4": -1, "delayed": 0, "current": 0, "rowwise": 1, "blockwise": 2, "mxfp8": 3}
#: the weight-gradient GEMM: on the recipe's quantized operands, or in the compute dtype (BF16) from the saved input
WEIGHT_GRAD_CHOICES = ("quantized", "high_precision")
#: formats each microscaling recipe takes (the first is its default). mxfp8 takes E4M3 only: torch's MX GEMM
#: (`F.scaled_mm` with BlockWise1x32) takes E4M3 operands, so "hybrid" (E5M2 gradients) ran every gradient GEMM
#: emulated; TE's MXFP8 recipe with E5M2 gradients has no torch GEMM to run on.
_MICROSCALING_FORMATS = {"mxfp8": ("e4m3",), "nvfp4": ("e2m1",)}
#: why a microscaling recipe refuses some formats, added to the refusal
_MICROSCALING_FORMAT_WHY = {
    "mxfp8": "torch's MX GEMM takes E4M3 operands only, so E5M2 gradients would run every gradient GEMM emulated",
}
#: the torch feature (numerics/formats.py TORCH_FEATURES: the torch release that added it) a scaling cannot run
#: without, on any device; the rest of the GPU paths' needs (`F.scaled_mm`, torch 2.10) emulate when missing
SCALING_NEEDS_TORCH = {"mxfp8": "float8_e8m0fnu", "nvfp4": "float4_e2m1fn_x2"}
#: recipe.keep_last_blocks_in_bf16 when not given: torchtitan's NVFP4 recipe keeps the last ~15% of the blocks in BF16
NVFP4_BF16_TAIL = 0.15
AMAX_ALGO_CHOICES = ("max", "most_recent")
#: "h100" / "rtx4060": that GPU's bits on any device (lightning_fp8/modules/gpu_model.py; needs mmaemu)
BACKEND_CHOICES = ("auto", "scaled_mm", "emulated", "h100", "rtx4060")
BOOLEAN_FIELDS = ("scale_gradients", "power_of_2_scales", "keep_first_last_in_bf16", "fast_accum_forward",
                  "allow_emulation")


class TorchTooOldError(RuntimeError):
    """A recipe that the installed torch cannot run: the message names the torch release it needs
    (numerics/formats.py TORCH_FEATURES)."""


def _check_choice(field_name: str, value: Any, choices: Tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"FP8Recipe.{field_name}={value!r} is not valid; valid choices: {list(choices)}")


@dataclass(frozen=True)
class FP8Recipe:
    """How to compute in FP8.

    format: "hybrid" (E4M3 for inputs and weights, E5M2 for gradients: the standard per-tensor recipe), "e4m3"
        everywhere, or "e5m2" everywhere (Mellempudi et al., 2019). Default (None): "hybrid" for the per-tensor
        scalings, "e4m3" for the fine-grained ones (per-tile scales cover the range E5M2 gradients are for; what
        DeepSeek-V3, Transformer Engine's block scaling and torchao's rowwise recipe use).
    scaling: per-tensor "delayed" (scale from an amax history, updated after each step; one pass over the tensor on
        GPU) or "current" (scale from the amax of the tensor being cast; one more pass, no lag); or fine-grained,
        stateless scales along the axis each GEMM does not contract (lightning_fp8/numerics/tiles.py): "rowwise" (one
        scale per row of the first GEMM operand and per column of the second) or "blockwise" (1 x block_size tiles
        for inputs and gradients, block_size x block_size blocks for weights: DeepSeek-V3's recipe). A fine-grained
        recipe ignores amax_history_len / amax_compute_algo for its scales (the history still records each tensor's
        amax, for overflow detection and monitoring).
    block_size: the tile length of scaling="blockwise": 128 is what the GPU's blockwise GEMMs take; other powers of
        two from 16 run emulated (a warning says so on a GPU); anything else raises ValueError here.
    amax_history_len: steps of amax kept for delayed scaling.
    amax_compute_algo: "max" over the history, or "most_recent".
    margin: scale = fp8_max / amax / 2**margin; a margin of m leaves 2**m headroom for growth.
    rounding: "nearest" or "stochastic". Stochastic rounding applies to the gradient casts only: forward
        activations and weights stay deterministic so evaluation is reproducible.
    scale_gradients: False casts gradients with scale 1 and relies on loss scaling (the E5M2-everywhere recipe of
        Mellempudi et al.); the plugin's loss_scaling="auto" then turns dynamic loss scaling on.
    power_of_2_scales: round scales down to a power of two (default), so scaling and unscaling are exact: a scaled
        value is the FP8 value with its exponent moved, nothing rounds twice. It costs at most one bit of the top
        binade (the amax lands in [max/2, max] instead of at max); it is what lets the CPU emulation run its GEMMs in
        BF16 faithfully, and what blockwise FP8 recipes use (DeepSeek-V3, TE's block scaling).
    keep_first_last_in_bf16: the default filter keeps the first and the last linear of a model in BF16.
    skip_patterns: glob patterns of layer names (fully qualified) the default filter keeps in BF16.
    backend: GEMM backend: "auto" picks torch's scaled GEMM on CUDA sm89+ and emulation elsewhere (and for the GEMMs
        the GPU is known not to take, with a warning); "scaled_mm" insists on the GPU; "emulated" never uses it.
        "h100" / "rtx4060" compute, on any device, the bits an H100 PCIe / RTX 4060 returns for the scaled-GEMM call
        planned for it (mmaemu's model of its cuBLASLt: `pip install lightning-fp8[h100]`; exact and slow):
        per-tensor scalings only, no bias inside a BF16 / FP16 GEMM; anything else raises naming what is modelled,
        and a split-K decision the model cannot make raises unless passed with
        `lightning_fp8.modules.gpu_model.known_splits` (lightning_fp8/modules/gpu_model.py).
    allow_emulation: what happens when torch refuses, at run time, a scaled-GEMM call planned for this GPU (a rule of
        lightning_fp8's planner that does not hold for this torch / cuBLASLt): False (default) raises
        FP8GemmRefusedError naming the call; True emulates such GEMMs (exact FP8 values, float32 products, many times
        slower) after a warning. Emulation where no FP8 GEMM can run at all (a CPU, an older GPU) is not affected.
    fast_accum_forward: use fast accumulation for the forward GEMM on `_scaled_mm` (never for gradient GEMMs).
    weight_grad: "quantized" (the weight-gradient GEMM on the recipe's FP8 / FP4 operands) or "high_precision" (that
        GEMM in the compute dtype, BF16, from the layer's input kept in BF16 for backward: torchao's `*_with_gw_hp`
        recipes; more activation memory, the weight gradient exact to BF16). Valid with every scaling.
    keep_last_blocks_in_bf16: the fraction of a model's repeated blocks (the longest nn.ModuleList of layers, e.g. a
        transformer's `layers`), counted from the end, whose linear layers the default filter keeps in BF16 (rounded
        to the nearest number of blocks). Default (None): 0.15 for scaling="nvfp4" (torchtitan's NVFP4 recipe: the
        last ~15% of the blocks and the head in BF16), 0 otherwise.
    random_hadamard: transform the weight-gradient GEMM's inputs with a 16 x 16 random Hadamard transform before
        quantizing them (numerics/microscaling.py). Default (None): True for scaling="nvfp4", which is the only scaling
        it applies to.

    The microscaling scalings (lightning_fp8/numerics/microscaling.py): "mxfp8" (1 x 32 blocks along the contraction
    dimension of every operand, E8M0 power-of-two scales rounded up so no block saturates, E4M3 data; format "e4m3":
    torch's MX GEMM takes no E5M2, so "hybrid" is refused) and "nvfp4" (FP4 E2M1 data, 16-element blocks with E4M3
    scales and a float32 tensor scale, 16 x 16 weight blocks, stochastic rounding of the gradients
    (rounding="stochastic" by default), random Hadamard transform on the weight-gradient GEMM; format "e2m1"). They
    ignore block_size, margin and power_of_2_scales: their scale rules are fixed by the hardware formats. They need a
    newer torch than the rest (numerics/formats.py TORCH_FEATURES): "mxfp8" torch >= 2.7 (float8_e8m0fnu), "nvfp4"
    torch >= 2.8 (float4_e2m1fn_x2); on an older torch they raise TorchTooOldError naming the release. Their GPU GEMMs
    (and blockwise's) need torch >= 2.10 (`torch.nn.functional.scaled_mm`); on an older torch they run emulated on the
    GPU after one warning, as on a CPU.
    """

    format: Optional[str] = None
    scaling: str = "delayed"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    rounding: Optional[str] = None
    scale_gradients: bool = True
    power_of_2_scales: bool = True
    keep_first_last_in_bf16: bool = True
    skip_patterns: Tuple[str, ...] = field(default_factory=tuple)
    backend: str = "auto"
    fast_accum_forward: bool = True
    block_size: int = 128
    weight_grad: str = "quantized"
    keep_last_blocks_in_bf16: Optional[float] = None
    random_hadamard: Optional[bool] = None
    allow_emulation: bool = False

    def __post_init__(self) -> None:
        _check_choice("scaling", self.scaling, SCALING_CHOICES)
        if self.format is None:
            default = _MICROSCALING_FORMATS.get(self.scaling, ("e4m3" if self.fine_grained else "hybrid",))[0]
            object.__setattr__(self, "format", default)
        _check_choice("format", self.format, FORMAT_CHOICES)
        self._check_microscaling()
        self._check_torch()
        if self.rounding is None:
            object.__setattr__(self, "rounding", "stochastic" if self.scaling == "nvfp4" else "nearest")
        _check_choice("weight_grad", self.weight_grad, WEIGHT_GRAD_CHOICES)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGO_CHOICES)
        _check_choice("rounding", self.rounding, ROUNDING_MODES)
        _check_choice("backend", self.backend, BACKEND_CHOICES)
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"FP8Recipe.amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"FP8Recipe.margin must be an int >= 0, got {self.margin!r}")
        if (isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 16
                or self.block_size & (self.block_size - 1)):
            raise ValueError(
                f"FP8Recipe.block_size={self.block_size!r} is not valid: the GPU's blockwise FP8 GEMMs take 128 "
                "(cuBLASLt, sm90); other tile lengths run emulated, and must tile 16-aligned dimensions evenly; "
                "valid choices: 128, or another power of two >= 16 (16, 32, 64, 256, ...)"
            )
        for name in BOOLEAN_FIELDS:  # bool("no") is True: a string here would silently mean the opposite
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FP8Recipe.{name} must be True or False, got {getattr(self, name)!r}")
        if self.fine_grained and not self.scale_gradients:
            raise ValueError(
                f"FP8Recipe(scaling={self.scaling!r}) scales every tile, gradients included: scale_gradients=False "
                f"applies to the per-tensor scalings only; valid choices: scaling in ['delayed', 'current'] with "
                f"scale_gradients=False, or scale_gradients=True"
            )
        if self.keep_last_blocks_in_bf16 is None:
            object.__setattr__(self, "keep_last_blocks_in_bf16", NVFP4_BF16_TAIL if self.scaling == "nvfp4" else 0.0)
        tail = self.keep_last_blocks_in_bf16
        if isinstance(tail, bool) or not isinstance(tail, (int, float)) or not 0.0 <= tail <= 1.0:
            raise ValueError(f"FP8Recipe.keep_last_blocks_in_bf16 must be a fraction in [0, 1] (or None for the "
                             f"scaling's default), got {tail!r}")
        object.__setattr__(self, "keep_last_blocks_in_bf16", float(tail))
        if isinstance(self.skip_patterns, str):
            object.__setattr__(self, "skip_patterns", (self.skip_patterns,))
        else:
            object.__setattr__(self, "skip_patterns", tuple(self.skip_patterns))

    def _check_microscaling(self) -> None:
        formats = _MICROSCALING_FORMATS.get(self.scaling)
        if formats is not None and self.format not in formats:
            why = _MICROSCALING_FORMAT_WHY.get(self.scaling)
            raise ValueError(f"FP8Recipe(scaling={self.scaling!r}) takes format in {list(formats)}, got "
                             f"format={self.format!r}" + (f" ({why})" if why else "") + f"; valid choices: format in "
                             f"{list(formats)} (or None, the scaling's default {formats[0]!r})")
        if self.format == "e2m1" and self.scaling != "nvfp4":
            raise ValueError("FP8Recipe(format='e2m1') is FP4: it goes with scaling='nvfp4' only; valid formats for "
                             f"scaling={self.scaling!r}: ['hybrid', 'e4m3', 'e5m2']")
        if self.random_hadamard is None:
            object.__setattr__(self, "random_hadamard", self.scaling == "nvfp4")
        if not isinstance(self.random_hadamard, bool):
            raise ValueError(f"FP8Recipe.random_hadamard must be True, False or None, got {self.random_hadamard!r}")
        if self.random_hadamard and self.scaling != "nvfp4":
            raise ValueError(f"FP8Recipe(random_hadamard=True) applies to scaling='nvfp4' only, not "
                             f"scaling={self.scaling!r}; valid choices: random_hadamard in [None, False]")

    def _check_torch(self) -> None:
        """Refuse a scaling the installed torch cannot represent (SCALING_NEEDS_TORCH), naming the torch it needs."""
        feature = SCALING_NEEDS_TORCH.get(self.scaling)
        missing = missing_torch_feature(feature) if feature else None
        if missing:
            raise TorchTooOldError(missing)

    @property
    def fine_grained(self) -> bool:
        """True for the scalings with one scale per tile (rowwise, blockwise, mxfp8, nvfp4), False for per-tensor
        ones."""
        return self.scaling in FINE_GRAINED_SCALINGS

    @property
    def microscaled(self) -> bool:
        """True for the block-scaled formats of Blackwell tensor cores (mxfp8, nvfp4)."""
        return self.scaling in MICROSCALING_SCALINGS

    @property
    def high_precision_wgrad(self) -> bool:
        return self.weight_grad == "high_precision"

    @property
    def label(self) -> str:
        """A short name of how the layer computes, for the precision map and the report: the scaling (with its block
        length for blockwise), the format where it is not the scaling's default, and a high-precision weight
        gradient."""
        label = f"blockwise({self.block_size})" if self.scaling == "blockwise" else self.scaling
        default = _MICROSCALING_FORMATS.get(self.scaling, ("e4m3" if self.fine_grained else "hybrid",))[0]
        if self.format != default:
            label += f" {self.format}"
        if self.high_precision_wgrad:
            label += ", wgrad bf16"
        return label

    def format_for(self, role: str) -> FP8Format:
        """The FP8 format of one tensor role ("input", "weight" or "grad_output")."""
        if role not in ROLES:
            raise ValueError(f"unknown tensor role {role!r}; valid roles: {list(ROLES)}")
        if self.format == "e2m1":
            return E2M1
        if self.format == "e4m3":
            return E4M3
        if self.format == "e5m2":
            return E5M2
        return E5M2 if role == "grad_output" else E4M3

    def rounding_for(self, role: str) -> str:
        return self.rounding if role == "grad_output" else "nearest"

    def uses_scaling_for(self, role: str) -> bool:
        """False where the cast uses scale 1 (gradients without per-tensor scaling)."""
        return self.scale_gradients or role != "grad_output"

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["skip_patterns"] = list(self.skip_patterns)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "FP8Recipe":
        d = dict(d)
        d["skip_patterns"] = tuple(d.get("skip_patterns", ()))
        return cls(**d)


def scale_gradients_with(recipe: FP8Recipe, scaling: str) -> bool:
    """`recipe.scale_gradients` for the same recipe moved to `scaling` (escalation, the demo's --recipe): the
    fine-grained scalings scale every tile, gradients included, so a recipe that casts gradients with scale 1 (the
    mellempudi preset) scales them there; FP8Recipe refuses the combination otherwise."""
    return recipe.scale_gradients or scaling in FINE_GRAINED_SCALINGS
