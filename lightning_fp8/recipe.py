"""FP8Recipe: the one frozen description of how a model computes in FP8.

Every other part of the library (conversion, FP8Linear, the engine, the adapters) reads its choices from a recipe,
so two runs with equal recipes compute the same way.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

from lightning_fp8.numerics.formats import E4M3, E5M2, FP8Format
from lightning_fp8.numerics.quantize import ROUNDING_MODES

#: tensor roles of a linear layer; each has its own scaling state
ROLES = ("input", "weight", "grad_output")

FORMAT_CHOICES = ("hybrid", "e4m3", "e5m2")
SCALING_CHOICES = ("delayed", "current", "rowwise", "blockwise")
#: scalings with one scale per tile of a tensor instead of one per tensor (lightning_fp8/numerics/tiles.py)
FINE_GRAINED_SCALINGS = ("rowwise", "blockwise")
#: scalings from coarse to fine: what FP8LayerFallback escalates along
SCALING_ORDER = {"delayed": 0, "current": 0, "rowwise": 1, "blockwise": 2}
AMAX_ALGO_CHOICES = ("max", "most_recent")
BACKEND_CHOICES = ("auto", "scaled_mm", "emulated")
BOOLEAN_FIELDS = ("scale_gradients", "power_of_2_scales", "keep_first_last_in_bf16", "fast_accum_forward")


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
        stateless scales along the axis each GEMM does not contract (docs/numerics.md, "Fine-grained scaling"):
        "rowwise" (one scale per row of the first GEMM operand and per column of the second) or "blockwise"
        (1 x block_size tiles for inputs and gradients, block_size x block_size blocks for weights: DeepSeek-V3's
        recipe). A fine-grained recipe ignores amax_history_len / amax_compute_algo for its scales (the history
        still records each tensor's amax, for overflow detection and monitoring).
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
        BF16 faithfully (docs/numerics.md), and what blockwise FP8 recipes use (DeepSeek-V3, TE's block scaling).
    keep_first_last_in_bf16: the default filter keeps the first and the last linear of a model in BF16.
    skip_patterns: glob patterns of layer names (fully qualified) the default filter keeps in BF16.
    backend: GEMM backend: "auto" picks torch._scaled_mm on CUDA sm89+ and emulation elsewhere.
    fast_accum_forward: use fast accumulation for the forward GEMM on `_scaled_mm` (never for gradient GEMMs).
    """

    format: Optional[str] = None
    scaling: str = "delayed"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    rounding: str = "nearest"
    scale_gradients: bool = True
    power_of_2_scales: bool = True
    keep_first_last_in_bf16: bool = True
    skip_patterns: Tuple[str, ...] = field(default_factory=tuple)
    backend: str = "auto"
    fast_accum_forward: bool = True
    block_size: int = 128

    def __post_init__(self) -> None:
        _check_choice("scaling", self.scaling, SCALING_CHOICES)
        if self.format is None:
            object.__setattr__(self, "format", "e4m3" if self.scaling in FINE_GRAINED_SCALINGS else "hybrid")
        _check_choice("format", self.format, FORMAT_CHOICES)
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
        if isinstance(self.skip_patterns, str):
            object.__setattr__(self, "skip_patterns", (self.skip_patterns,))
        else:
            object.__setattr__(self, "skip_patterns", tuple(self.skip_patterns))

    @property
    def fine_grained(self) -> bool:
        """True for the scalings with one scale per tile (rowwise, blockwise), False for per-tensor ones."""
        return self.scaling in FINE_GRAINED_SCALINGS

    def format_for(self, role: str) -> FP8Format:
        """The FP8 format of one tensor role ("input", "weight" or "grad_output")."""
        if role not in ROLES:
            raise ValueError(f"unknown tensor role {role!r}; valid roles: {list(ROLES)}")
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
