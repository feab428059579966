"""How an FP8 GEMM is handed to torch's scaled GEMM on a CUDA GPU: the plan of one call, per architecture.

`plan_scaled_mm(operands, target)` turns a GEMM request (`GemmRequest`: FP8 operands in any layout, dequant scales
per tensor, per row / column or per 128-block, output dtype, bias) into either a `ScaledMMCall`, every argument in the
shape, layout and dtype that the target's torch and GPU libraries accept, or a `Refusal` that says why the target
cannot take it (the caller then emulates, and says so once). The plan is plain torch code (pads, copies, views), so
it runs on CUDA, CPU and meta tensors alike: a planned call can be replayed on meta tensors against torch's own
checks without a GPU, and `check_call` checks what meta tensors cannot show.

The rules, per kind of scaling (torch 2.10 - 2.15, cuBLASLt >= 12.9, as their scaled-GEMM sources read). They are
data, per torch release range (`TORCH_RULES`: the rules per architecture and what torch's CUTLASS rowwise kernel
writes), and a target carries its torch version (`ScaledMMTarget.torch_rules`), so the planner follows the installed
torch and the contract suite replays the rules of the torch that runs it:

  every kind   FP8 tensor cores: sm89 and newer. mat_a (M, K) row-major, mat_b (K, N) column-major, K and N multiples
               of 16 (zero-padded here: padded products are zero), M free; never e5m2 x e5m2. Operands exactly
               packed and 16-byte aligned (torch checks neither; sm89's rowwise kernel reads every operand as
               packed whatever its strides). A bias only with a bf16 / fp16 output and of that dtype; a float32
               output gets its bias added here, in float32, before the one rounding.
  tensorwise   `torch._scaled_mm`, float32 0-d dequant scales; fast accumulation where asked, below K = 4096
               (`FAST_ACCUM_MAX_K`: measured against an H100's bits, its error grows with K).
  rowwise      `torch._scaled_mm`, scale_a (M, 1) and scale_b (1, N), float32, contiguous. sm90 runs cuBLASLt (any
               output dtype). sm89, sm100 and sm120 run CUTLASS kernels which take e5m2 only as mat_a and write, per
               torch release (`TORCH_RULES`): bf16 only before 2.10; bf16 and fp16 in 2.10 - 2.13 (float32 output:
               refused), with bf16 bits written into an fp16 output that has no bias (so an fp16 output always gets
               a bias, zeros if need be); bf16, fp16 and float32 from 2.14 (pytorch#187569: the kernel without a bias
               writes the output's dtype).
  blockwise    DeepSeek-style 1x128 x 128x128 and 1x128 x 1x128 through `torch.nn.functional.scaled_mm` (v2): sm90
               only, both operands e4m3, no fast accumulation. cuBLASLt reads a 128x128 scale tensor with its K-block
               dimension padded to a multiple of 4 (L4 = round_up(K/128, 4): shape (L4, N/128), strides (1, L4)); the
               v1 `torch._scaled_mm` accepts only the unpadded layout, which gives silent wrong answers where
               (K/128) % 4 != 0, so blockwise never goes through v1. 1x128 scales: mat_a's (M, K/128) with strides
               (1, M), mat_b's (N, K/128) with strides (1, N). K a multiple of 128 (the layers pad the tokens where a
               GEMM contracts them: kernels/tiled_ops.py `pad_to`), N a multiple of 128 for a 128x128 mat_b and of 16
               for a 1x128 one (torch checks both dimensions of mat_b against 16); M a multiple of 4: cuBLASLt reads
               1x128 scales with a leading dimension rounded up to 4 (Transformer Engine and vLLM pad it so), while
               torch requires it to equal the dimension (other shapes are refused). Scales already in these layouts (the
               fused casts write them so) are used as they are; others are copied into them.
  mxfp8        1x32 blocks along K of both operands with E8M0 scales (`torch.float8_e8m0fnu`), BlockWise1x32 through
               `torch.nn.functional.scaled_mm` (v2): Blackwell only (sm100 / sm103, sm120 / sm121: cuBLASLt's
               VEC32_UE8M0 scale mode, CUDA >= 12.8; sm89 / sm90 have no block-scaled tensor cores), both operands
               e4m3 (torch's MX check), no fast accumulation. Each operand's scales, (rows, ceil(K/32)) with rows = M
               for mat_a and N for mat_b, zero-padded to (round_up(rows, 128), round_up(ceil(K/32), 4)) and swizzled
               into cuBLASLt's 128 x 4 tiles (SWIZZLE_32_4_4: `swizzle_32_4_4`), flat and contiguous. K is zero-padded
               to a multiple of 32 and N to 16 (padded elements are zero; a ragged last block keeps its scale).
  nvfp4        FP4 E2M1 operands (`torch.float4_e2m1fn_x2`, two per byte along K) with two-level scales per operand:
               BlockWise1x16 E4M3 block scales (swizzled as for MX, over ceil(K/16) blocks) and a TensorWise float32
               scale (cuBLASLt multiplies the accumulator by their product); one recipe and one swizzle per scale,
               [SWIZZLE_32_4_4, NO_SWIZZLE] (torch's CUDA check, ScaledBlas.cpp `check_swizzle_lengths`, wants two;
               its meta check reads the first only). sm100 / sm103 only here (cuBLASLt's
               VEC16_UE4M3 mode; sm120's FP4 path is not established: Transformer Engine's NVFP4 recipe fails there,
               TransformerEngine#2255), no fast accumulation (torch refuses it for FP4). 16 x 16 weight blocks are
               handed over as the 1 x 16 scales of their rows (the same scale repeated). K is zero-padded to 32
               elements, N to 16.
  A bias of an mxfp8 / nvfp4 GEMM is added after it in float32, before the one rounding (as for blockwise).
  grouped      a mixture-of-experts layer's GEMMs (`GemmRequest.offsets`, numerics/groups.py), rowwise:
               `torch._scaled_grouped_mm` (torch's CUTLASS grouped kernel, built for sm90; sm100 from the release
               that carries pytorch#188063, taken here as torch 2.14; sm89 and sm120 have none: `TorchRules.grouped`),
               both operands e4m3, bf16 output only, no bias (experts add theirs after), offsets int32 end rows.
               Rows grouped (forward, dgrad): mat_a (M, K) row-major with scale_a (M,), mat_b (E, K, N) column-major
               with scale_b (E, N); rows past the last offset come back unwritten and are zeroed here. The
               contraction grouped (wgrad): mat_a (M, T) row-major with scale_a (E * M,), mat_b (T, N) column-major
               with scale_b (E * N,), group-major; each group's tokens start 16-aligned, so the token dimension is
               re-laid with every group zero-padded to a multiple of 16 (a gather on the device, the offsets
               recomputed there: no host read), and the output of an empty group is zeroed. K and N (and M of the
               contraction) multiples of 16, as the kernel checks.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from lightning_fp8.kernels.device import DeviceProfile
from lightning_fp8.kernels.microscaled_ops import gemm_operand_storage, swizzled_block_scales
from lightning_fp8.modules.operand import FP8Matrix, GemmRequest
from lightning_fp8.numerics.groups import group_counts, group_of_rows
from lightning_fp8.numerics.tiles import tile_extent

Tensor = torch.Tensor
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

TENSORWISE = "tensorwise"
ROWWISE = "rowwise"
BLOCK_1x128_128x128 = "blockwise 1x128 x 128x128"
BLOCK_1x128_1x128 = "blockwise 1x128 x 1x128"
BLOCKWISE = (BLOCK_1x128_128x128, BLOCK_1x128_1x128)
MXFP8 = "mxfp8 1x32"
NVFP4 = "nvfp4 1x16"
MICROSCALED = (MXFP8, NVFP4)
E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7
FP4 = getattr(torch, "float4_e2m1fn_x2", None)  # torch >= 2.8

V1 = "torch._scaled_mm"
V2 = "torch.nn.functional.scaled_mm"
GROUPED_V1 = "torch._scaled_grouped_mm"
#: the kinds of grouped call: A's rows grouped over a 3-D B (forward, dgrad), or the contraction grouped (wgrad)
GROUPED_ROWS = "grouped rowwise (rows)"
GROUPED_CONTRACTION = "grouped rowwise (contraction)"
GROUPED = (GROUPED_ROWS, GROUPED_CONTRACTION)
#: the multiple each group's tokens start at in a grouped contraction (16-byte aligned FP8)
GROUP_ALIGNMENT = 16

#: out_dtypes a scaled GEMM writes directly
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: the contraction length from which a GEMM that may use fast accumulation (a forward GEMM,
#: FP8Recipe.fast_accum_forward) accumulates slowly instead: measured against an H100's bits, fast accumulation's error
#: is that of the output's BF16 rounding at K = 256 (1.01x) and measurably above it from K = 4096 (1.26x; 2.07x at
#: 16384), while slow accumulation stays at 1.00x at every K (benchmarks/results/h100_vs_emulation.md)
FAST_ACCUM_MAX_K = 4096


# -- what the target accepts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArchRules:
    """What torch's scaled GEMM takes on one GPU architecture (module docstring)."""

    kinds: Tuple[str, ...]
    #: "cublaslt" (sm90 with cuBLASLt >= 12.9: any output dtype) or "cutlass" (torch's CUTLASS rowwise kernel: the
    #: output dtypes of `TorchRules.cutlass_rowwise_out_dtypes`, e5m2 only as mat_a)
    rowwise_backend: str
    #: the rowwise kernel reads operands as packed whatever their strides (sm89's CUTLASS kernel)
    rowwise_ignores_strides: bool = False


#: per compute-capability major version (sm89 is the only FP8 architecture of major 8): torch 2.10 - 2.15 alike
_ARCHS: Tuple[Tuple[int, ArchRules], ...] = (
    (8, ArchRules(kinds=(TENSORWISE, ROWWISE), rowwise_backend="cutlass", rowwise_ignores_strides=True)),
    (9, ArchRules(kinds=(TENSORWISE, ROWWISE) + BLOCKWISE, rowwise_backend="cublaslt")),
    (10, ArchRules(kinds=(TENSORWISE, ROWWISE, MXFP8, NVFP4), rowwise_backend="cutlass")),
    (12, ArchRules(kinds=(TENSORWISE, ROWWISE, MXFP8), rowwise_backend="cutlass")),
)


#: before torch 2.10: sm90's rowwise GEMM taken as torch's CUTLASS kernel too (conservative: cuBLASLt's rowwise path
#: came with cuBLASLt 12.9 support in torch's rowwise dispatch, whose first release is not established here)
_ARCHS_BEFORE_2_10 = tuple((major, replace(rules, rowwise_backend="cutlass") if major == 9 else rules)
                           for major, rules in _ARCHS)


@dataclass(frozen=True)
class TorchRules:
    """What the scaled GEMM of a range of torch releases takes, as their CUDA sources read (module docstring): the
    rules per architecture, and what torch's CUTLASS rowwise kernel (sm89, sm100, sm120, and sm90 below cuBLASLt
    12.9) writes."""

    #: the first torch release (major, minor) these rules hold for; they hold up to the next entry's
    since: Tuple[int, int]
    archs: Tuple[Tuple[int, ArchRules], ...]
    #: the output dtypes the CUTLASS rowwise kernel writes (others: refused, "Only bf16 ... output types are
    #: supported for row-wise scaling")
    cutlass_rowwise_out_dtypes: Tuple[torch.dtype, ...]
    #: whether its kernel without a bias writes an fp16 output as fp16 (False: it writes bf16 bits into it, so an fp16
    #: output always gets a bias, zeros if need be)
    cutlass_rowwise_fp16_without_bias: bool
    #: where the rules were read
    source: str
    #: the compute-capability majors torch's grouped scaled GEMM (`torch._scaled_grouped_mm`, rowwise) runs on
    grouped: Tuple[int, ...] = ()

    def arch(self, major: int) -> Optional[ArchRules]:
        return dict(self.archs).get(major)


#: the rules of each torch release range, oldest first (`rules_for_torch`); the contract suite replays the rules of the
#: torch that runs it (tests/test_cuda_contract.py `expected_native`)
TORCH_RULES: Tuple[TorchRules, ...] = (
    TorchRules(
        since=(2, 0), archs=_ARCHS_BEFORE_2_10, cutlass_rowwise_out_dtypes=(torch.bfloat16,),
        cutlass_rowwise_fp16_without_bias=False, grouped=(9,),
        source="before 2.10 torch's CUTLASS rowwise kernel writes bf16 only (its fp16 output came with "
               "pytorch#166744), and sm90's rowwise GEMM is taken to be that kernel; the v2 API (blockwise, MX, NVFP4) "
               "is absent, which `ScaledMMTarget.has_v2` reads off the running torch. Conservative: not checked "
               "against each older release's sources"),
    TorchRules(
        since=(2, 10), archs=_ARCHS, cutlass_rowwise_out_dtypes=(torch.bfloat16, torch.float16),
        cutlass_rowwise_fp16_without_bias=False, grouped=(9,),
        source="torch 2.13's table (aten/src/ATen/native/cuda/ScaledBlas.cpp `_scaled_rowwise_rowwise`, "
               "RowwiseScaledMM.cu `check_inputs` / `dispatch_fp8_rowwise_kernel_on_bias_dtype`: bf16 and fp16 "
               "outputs, the kernel without a bias bound to bf16 output; 2.13.0+cu130's libtorch_cuda.so holds 'Only "
               "bf16 and fp16 high precision output types are supported for row-wise scaling.'; fp16 since 2.10, "
               "pytorch#166744)"),
    TorchRules(
        since=(2, 14), archs=_ARCHS, cutlass_rowwise_out_dtypes=(torch.bfloat16, torch.float16, torch.float32),
        cutlass_rowwise_fp16_without_bias=True, grouped=(9, 10),
        source="grouped: sm100 taken from 2.14 on, the first release after pytorch#188063 (June 2026: 'Enable "
               "Blackwell FP8 grouped GEMM'; before it the CUTLASS grouped kernel was built for sm90 only, pytorch#161780 "
               "reported sm100 unsupported); not checked in a binary. pytorch#187569 (opened after the 2.13 branch cut): the CUTLASS rowwise kernel without a bias writes "
               "the output's dtype, float32 included (RowwiseScaledMM.cu `check_inputs`: bf16, fp16 or fp32; "
               "ScaledBlas.cpp `_scaled_rowwise_rowwise`); a bias with a float32 output stays refused. Checked in "
               "the binaries: 2.14.1+cu130's and 2.15.0+cu132's libtorch_cuda.so hold 'Only bf16, fp16, and fp32 high "
               "precision output types are supported for row-wise scaling.' and 'Output dtype must be bfloat16, "
               "float16, or float32'"),
)


def rules_for_torch(version: Tuple[int, int]) -> TorchRules:
    """The scaled-GEMM rules of torch `version` (major, minor): the last `TORCH_RULES` entry it has reached."""
    chosen = TORCH_RULES[0]
    for rules in TORCH_RULES:
        if tuple(version) >= rules.since:
            chosen = rules
    return chosen


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float32"}
    return " / ".join(names.get(d, str(d).replace("torch.", "")) for d in dtypes)


#: why an architecture refuses a kind it does not list (the caller emulates and warns once with this)
_KIND_REFUSALS = {
    BLOCK_1x128_128x128: "runs on sm90 only (cuBLASLt's block scale modes)",
    BLOCK_1x128_1x128: "runs on sm90 only (cuBLASLt's block scale modes)",
    MXFP8: ("needs Blackwell tensor cores (sm100 / sm120): cuBLASLt has no MX (VEC32_UE8M0) kernels before "
            "Blackwell"),
    NVFP4: ("runs natively on sm100 / sm103 only: FP4 tensor cores are Blackwell's, and sm120's FP4 path through "
            "torch 2.13 is not established (Transformer Engine's NVFP4 recipe fails there)"),
}


def _version(text: Optional[str]) -> Optional[Tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


#: the architectures' rules of the installed torch (per compute-capability major version)
ARCH_RULES: Dict[int, ArchRules] = dict(rules_for_torch(_version(torch.__version__) or (0, 0)).archs)


@dataclass(frozen=True)
class ScaledMMTarget:
    """One GPU architecture with one torch build: what a scaled-GEMM call may be there."""

    capability: Tuple[int, int]
    torch_version: Tuple[int, int]
    cuda_version: Tuple[int, int]  # the CUDA (and cuBLASLt) torch was built with
    has_v2: bool  # torch.nn.functional.scaled_mm with ScalingType (torch >= 2.10)
    has_grouped: bool = True  # torch._scaled_grouped_mm (read off the running torch)

    @staticmethod
    def of(profile: DeviceProfile) -> "ScaledMMTarget":
        """The target of a CUDA device profile with the running torch (cached: one per device). A simulated GPU (or
        a CPU build of torch) is taken to have the CUDA 13 libraries of the current CUDA wheels."""
        return _target_of(profile)


    @property
    def name(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def torch_rules(self) -> TorchRules:
        """The scaled-GEMM rules of this target's torch release."""
        return rules_for_torch(self.torch_version)

    @property
    def rules(self) -> Optional[ArchRules]:
        """The architecture's rules under this target's torch; None below sm89 (no FP8 tensor cores)."""
        if self.capability < (8, 9):
            return None
        torch_rules = self.torch_rules
        return torch_rules.arch(self.capability[0]) or (torch_rules.arch(12) if self.capability[0] > 12 else None)

    @property
    def rowwise_backend(self) -> str:
        rules = self.rules
        if rules is None:
            return "none"
        if rules.rowwise_backend == "cublaslt" and self.cuda_version < (12, 9):
            return "cutlass"  # cuBLASLt has rowwise scaling from 12.9; torch runs its CUTLASS kernel before that
        return rules.rowwise_backend

    @property
    def cutlass_rowwise_out_dtypes(self) -> Tuple[torch.dtype, ...]:
        """The output dtypes torch's CUTLASS rowwise kernel writes under this target's torch."""
        return self.torch_rules.cutlass_rowwise_out_dtypes

    @property
    def cutlass_rowwise_fp16_needs_bias(self) -> bool:
        """Whether an fp16 output of the CUTLASS rowwise kernel needs a bias (its kernel without one writes bf16
        bits) under this target's torch."""
        return not self.torch_rules.cutlass_rowwise_fp16_without_bias

    @property
    def torch_name(self) -> str:
        return f"torch {self.torch_version[0]}.{self.torch_version[1]}"


@functools.lru_cache(maxsize=None)
def _target_of(profile: DeviceProfile) -> ScaledMMTarget:
    assert profile.capability is not None, "a scaled-GEMM target needs a CUDA compute capability"
    return ScaledMMTarget(
        capability=profile.capability,
        torch_version=_version(torch.__version__) or (0, 0),
        cuda_version=_version(torch.version.cuda) or (13, 0),
        has_v2=hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"),
        has_grouped=hasattr(torch, "_scaled_grouped_mm"),
    )


# -- the request --------------------------------------------------------------------------------------------------
def scaling_kind(operands: GemmRequest) -> Optional[str]:
    """The scaling kind of a GEMM request: tensorwise, rowwise, one of the blockwise kinds, mxfp8, nvfp4, or None (a
    tiling no scaled GEMM takes). The microscaled kinds are told by their dtypes (E8M0 scales, FP4 data)."""
    a, b = operands.a, operands.b
    if a.tile is None and b.tile is None:
        return TENSORWISE
    if a.tile is None or b.tile is None:
        return None
    m, k, n = operands.shape
    if a.data.dtype == FP4 or b.data.dtype == FP4 or E8M0 in (a.scale_inv.dtype, b.scale_inv.dtype):
        return _microscaled_kind(a, b)
    ar, ak = tile_extent(a.tile, (m, k))
    bk, bc = tile_extent(b.tile, (k, n))
    if ar == 1 and ak == k and bk == k and bc == 1:
        return ROWWISE
    if ar == 1 and ak == 128 and bk == 128:
        return {128: BLOCK_1x128_128x128, 1: BLOCK_1x128_1x128}.get(bc)
    return None


def _microscaled_kind(a: FP8Matrix, b: FP8Matrix) -> Optional[str]:
    a_k, b_k = a.tile[1], b.tile[0]
    if a.scale_inv.dtype == E8M0 and b.scale_inv.dtype == E8M0 and a.data.dtype != FP4:
        return MXFP8 if (tuple(a.tile) == (1, 32) and tuple(b.tile) == (32, 1)) else None
    if a.data.dtype == FP4 and b.data.dtype == FP4 and a.scale_inv.dtype == E4M3 == b.scale_inv.dtype:
        rows_ok = a.tile[0] in (1, 16) and b.tile[1] in (1, 16)
        return NVFP4 if (a_k == b_k == 16 and rows_ok) else None
    return None


class Refusal(NamedTuple):
    """Why a target cannot run a request (the caller emulates it; `quiet`: nothing worth a warning, e.g. no work)."""

    reason: str
    quiet: bool = False


class _Finish(NamedTuple):
    """What happens to the scaled GEMM's output: the padded columns dropped, a float32 output's bias added, the
    output dtype."""

    n: int
    bias_after: Optional[Tensor]
    out_dtype: torch.dtype


@dataclass
class ScaledMMCall:
    """One call of torch's scaled GEMM with every argument prepared, and what is done to its output."""

    api: str  # V1 | V2
    kind: str
    mat_a: Tensor
    mat_b: Tensor
    scale_a: Tensor
    scale_b: Tensor
    bias: Optional[Tensor]
    out_dtype: torch.dtype
    use_fast_accum: bool
    finish: _Finish
    target: ScaledMMTarget

    #: NVFP4's tensor scales (the second TensorWise scale of each operand)
    tensor_scale_a: Optional[Tensor] = None
    tensor_scale_b: Optional[Tensor] = None

    def launch(self) -> Tensor:
        """Run the call (on the tensors' device) and finish its output."""
        if self.api == V1:
            out = torch._scaled_mm(self.mat_a, self.mat_b, scale_a=self.scale_a, scale_b=self.scale_b, bias=self.bias,
                                   out_dtype=self.out_dtype, use_fast_accum=self.use_fast_accum)
        elif self.kind in MICROSCALED:
            # one recipe and one swizzle per scale (torch's CUDA check, `check_swizzle_lengths`; its meta check reads
            # the first swizzle only): the block scales swizzled, NVFP4's tensor scale not
            scaling, swizzle = F.ScalingType, F.SwizzleType
            if self.kind == MXFP8:
                scale_a, scale_b = [self.scale_a], [self.scale_b]
                recipe = [scaling.BlockWise1x32]
                swizzles = [swizzle.SWIZZLE_32_4_4]
            else:
                scale_a, scale_b = [self.scale_a, self.tensor_scale_a], [self.scale_b, self.tensor_scale_b]
                recipe = [scaling.BlockWise1x16, scaling.TensorWise]
                swizzles = [swizzle.SWIZZLE_32_4_4, swizzle.NO_SWIZZLE]
            out = F.scaled_mm(self.mat_a, self.mat_b, scale_a, recipe, scale_b, list(recipe), swizzle_a=swizzles,
                              swizzle_b=list(swizzles), bias=self.bias, output_dtype=self.out_dtype,
                              use_fast_accum=self.use_fast_accum)
        else:
            recipe_a, recipe_b = _V2_RECIPES[self.kind]
            out = F.scaled_mm(self.mat_a, self.mat_b, self.scale_a, getattr(F.ScalingType, recipe_a), self.scale_b,
                              getattr(F.ScalingType, recipe_b), bias=self.bias, output_dtype=self.out_dtype,
                              use_fast_accum=self.use_fast_accum)
        return self.finished(out)

    def finished(self, out: Tensor) -> Tensor:
        n, bias_after, out_dtype = self.finish
        sliced = out.shape[1] != n
        if sliced:
            out = out[:, :n]
        if bias_after is not None:
            # one kernel: the float32 output plus the bias (read in its own dtype, widened exactly), rounded once
            # into the output dtype
            if bias_after.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                bias_after = bias_after.to(torch.float32)
            result = torch.empty((out.shape[0], n), dtype=out_dtype, device=out.device)
            return torch.add(out.to(torch.float32), bias_after, out=result)
        if out.dtype != out_dtype or sliced:
            out = out.to(out_dtype).contiguous()
        return out

    def signature(self) -> Tuple:
        """What torch's acceptance of the call depends on: the target, the API, the kind, and the shape, strides and
        dtype of every tensor argument, the output dtype and fast accumulation."""
        return (self.target, self.api, self.kind) + tuple(_spec(t) for t in self._tensors().values()) + (
            self.out_dtype, self.use_fast_accum)

    def describe(self) -> str:
        """The call in words: kind, API and every tensor argument's shape, strides and dtype."""
        args = ", ".join(f"{name}={_spec_text(t)}" for name, t in self._tensors().items() if t is not None)
        return (f"{self.kind} scaled GEMM {self.api}({args}, out_dtype={self.out_dtype}, "
                f"use_fast_accum={self.use_fast_accum})")

    def _tensors(self) -> Dict[str, Optional[Tensor]]:
        return {"mat_a": self.mat_a, "mat_b": self.mat_b, "scale_a": self.scale_a, "scale_b": self.scale_b,
                "bias": self.bias, "tensor_scale_a": self.tensor_scale_a, "tensor_scale_b": self.tensor_scale_b}

    def on_meta(self) -> "ScaledMMCall":
        """The same call on meta tensors of the same shapes, strides and dtypes: launching it runs torch's own
        device-independent checks of the call (as for CUDA), nothing else."""
        def meta(t: Optional[Tensor]) -> Optional[Tensor]:
            if t is None:
                return None
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        return replace(self, mat_a=meta(self.mat_a), mat_b=meta(self.mat_b), scale_a=meta(self.scale_a),
                       scale_b=meta(self.scale_b), bias=meta(self.bias),
                       tensor_scale_a=meta(self.tensor_scale_a), tensor_scale_b=meta(self.tensor_scale_b),
                       finish=self.finish._replace(bias_after=meta(self.finish.bias_after)))

    @property
    def runs_on_cpu(self) -> bool:
        """Whether torch's CPU build runs this call (torch 2.13: tensorwise and rowwise, v1; v2 from 2.13). Read off
        the running torch (`_cpu_scaled_mm_runs`): before torch 2.8 its CPU build has no `torch._scaled_mm`, and 2.8's
        runs tensorwise scales only."""
        return (self.kind in (TENSORWISE, ROWWISE) and (self.api == V1 or self.target.torch_version >= (2, 13))
                and _cpu_scaled_mm_runs(self.kind))


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_runs(kind: str) -> bool:
    """Whether the running torch's CPU build runs a v1 scaled GEMM of `kind` (tensorwise or rowwise): one tiny call,
    once per kind."""
    cpu = torch.device("cpu")  # whatever default device is in effect
    a = torch.zeros(16, 16, dtype=E4M3, device=cpu)
    shapes = ((), ()) if kind == TENSORWISE else ((16, 1), (1, 16))
    scales = [torch.ones(shape, device=cpu) for shape in shapes]
    try:
        torch._scaled_mm(a, a.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _spec(t: Optional[Tensor]):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)


def _spec_text(t: Tensor) -> str:
    return f"{tuple(t.shape)} strides {tuple(t.stride())} {str(t.dtype).replace('torch.', '')}"


_V2_RECIPES = {
    BLOCK_1x128_128x128: ("BlockWise1x128", "BlockWise128x128"),
    BLOCK_1x128_1x128: ("BlockWise1x128", "BlockWise1x128"),
}


# -- planning -----------------------------------------------------------------------------------------------------
def plan_scaled_mm(operands: GemmRequest, target: ScaledMMTarget) -> Union[ScaledMMCall, Refusal]:
    """The call that computes `operands` on `target`, or why there is none (module docstring)."""
    a, b = operands.a.data, operands.b.data
    m, k, n = operands.shape
    if a.numel() == 0 or b.numel() == 0:
        return Refusal("an empty operand", quiet=True)
    rules = target.rules
    if rules is None:
        return Refusal(f"{target.name} has no FP8 tensor cores (compute capability 8.9 or newer)")
    if operands.offsets is not None:
        return _plan_grouped(operands, target)
    if a.dtype == E5M2 and b.dtype == E5M2:
        return Refusal("torch's scaled GEMM does not multiply two e5m2 operands (format='e5m2' recipes)")
    kind = scaling_kind(operands)
    if kind is None:
        return Refusal(f"no scaled GEMM takes the tiling {operands.a.tile} x {operands.b.tile}")
    if kind not in rules.kinds:
        why = _KIND_REFUSALS.get(kind, "is not taken by torch's scaled GEMM there")
        return Refusal(f"{kind} scaling {why}; this GPU is {target.name}")
    if kind in BLOCKWISE:
        return _plan_blockwise(operands, kind, target)
    if kind in MICROSCALED:
        return _plan_microscaled(operands, kind, target)
    return _plan_tensorwise_or_rowwise(operands, kind, target)


def _plan_tensorwise_or_rowwise(operands: GemmRequest, kind: str, target: ScaledMMTarget) -> Union[ScaledMMCall, Refusal]:
    a, b, out_dtype, bias = operands.a.data, operands.b.data, operands.out_dtype, operands.bias
    m, k, n = operands.shape
    cutlass = kind == ROWWISE and target.rowwise_backend == "cutlass"
    mm_dtype = out_dtype if out_dtype in _OUT_DTYPES else torch.float32
    if cutlass:
        if b.dtype == E5M2:
            return Refusal(f"rowwise scaling on {target.name} (CUTLASS) takes e5m2 only as the first operand")
        if mm_dtype not in target.cutlass_rowwise_out_dtypes:
            return Refusal(f"rowwise scaling on {target.name} (CUTLASS) writes "
                           f"{_dtype_names(target.cutlass_rowwise_out_dtypes)} only in {target.torch_name}; this "
                           f"GEMM's output is {_dtype_names([mm_dtype])} (train under BF16 autocast, or use per-tensor "
                           "scaling)")
    k16, n16 = _round_up(k, 16), _round_up(n, 16)
    mat_a = _packed(_padded(a, m, k16))
    mat_b = _packed(_padded(b.t(), n16, k16)).t()
    if kind == TENSORWISE:
        scale_a = operands.a.scale_inv.to(torch.float32).reshape(())
        scale_b = operands.b.scale_inv.to(torch.float32).reshape(())
    else:
        # (M, 1) with strides (1, 1): torch checks scale_a.stride(1) == 1, which `.contiguous()` does not make of an
        # (M, 1) view with another stride along its size-1 dimension (what compiled graphs hand over)
        scale_a = operands.a.scale_inv.to(torch.float32).reshape(-1).contiguous().view(m, 1)
        scale_b = operands.b.scale_inv.to(torch.float32).reshape(1, n)
        if n16 != n:
            scale_b = F.pad(scale_b, (0, n16 - n), value=1.0)
        scale_b = scale_b.contiguous()
    bias_arg, bias_after = None, None
    if bias is not None:
        if mm_dtype == torch.float32:
            bias_after = bias
        else:
            bias_arg = _padded_vector(bias.to(mm_dtype), n16)
    elif cutlass and mm_dtype == torch.float16 and target.cutlass_rowwise_fp16_needs_bias:
        bias_arg = torch.zeros(n16, dtype=torch.float16, device=a.device)  # the fp16 kernel is the one with a bias
    # fast accumulation (forward GEMMs that ask for it) only below FAST_ACCUM_MAX_K: its error grows with K
    fast_accum = operands.use_fast_accum and k < FAST_ACCUM_MAX_K
    return ScaledMMCall(V1, kind, mat_a, mat_b, scale_a, scale_b, bias_arg, mm_dtype, fast_accum,
                        _Finish(n, bias_after, out_dtype), target)


def _plan_blockwise(operands: GemmRequest, kind: str, target: ScaledMMTarget) -> Union[ScaledMMCall, Refusal]:
    a, b = operands.a.data, operands.b.data
    m, k, n = operands.shape
    if not target.has_v2:
        return Refusal(f"torch {target.torch_version[0]}.{target.torch_version[1]} has no "
                       "torch.nn.functional.scaled_mm; its torch._scaled_mm mis-reads 128x128 scales where "
                       "(K/128) % 4 != 0, so blockwise GEMMs need torch >= 2.10")
    if target.cuda_version < (12, 9):
        return Refusal("blockwise scaling needs cuBLASLt 12.9 or newer (a torch built with CUDA >= 12.9)")
    if a.dtype != E4M3 or b.dtype != E4M3:
        return Refusal("blockwise scaling takes e4m3 operands only; this recipe casts gradients to e5m2 "
                       "(use format='e4m3' with blockwise scaling)")
    problem = _blockwise_shape_problem(kind, m, k, n)
    if problem:
        return Refusal(f"blockwise scaling on this GEMM ({m} x {k} x {n}): {problem}")
    mat_a = _packed(a)
    mat_b = _packed(b.t()).t()
    kb = k // 128
    scale_a = operands.a.scale_inv.to(torch.float32).t().contiguous().t()  # (M, K/128), strides (1, M)
    if kind == BLOCK_1x128_128x128:
        # (K/128, N/128) scales in a (L4, N/128) buffer with strides (1, L4): the K-block dimension padded to 4
        scale_b = _l4_padded_view(operands.b.scale_inv, kb, n // 128)
        if scale_b is None:
            l4 = _round_up(kb, 4)
            buffer = torch.ones((n // 128, l4), dtype=torch.float32, device=a.device)
            buffer[:, :kb].copy_(operands.b.scale_inv.to(torch.float32).t())
            scale_b = buffer.t()
    else:
        scale_b = operands.b.scale_inv.to(torch.float32).contiguous().t()  # (N, K/128), strides (1, N)
    bias = operands.bias
    # a bias goes in after the GEMM, in float32 before the one rounding (cuBLASLt refuses a bias with a float32
    # output, and whether it takes one with block scales at all is not documented)
    mm_dtype = torch.float32 if bias is not None or operands.out_dtype not in _OUT_DTYPES else operands.out_dtype
    return ScaledMMCall(V2, kind, mat_a, mat_b, scale_a, scale_b, None, mm_dtype, False,
                        _Finish(n, bias, operands.out_dtype), target)


def _plan_microscaled(operands: GemmRequest, kind: str, target: ScaledMMTarget) -> Union[ScaledMMCall, Refusal]:
    a, b = operands.a.data, operands.b.data
    m, k, n = operands.shape
    if not target.has_v2:
        return Refusal(f"torch {target.torch_version[0]}.{target.torch_version[1]} has no "
                       f"torch.nn.functional.scaled_mm: {kind} scaling needs torch >= 2.10")
    if target.cuda_version < (12, 8):
        return Refusal(f"{kind} scaling needs CUDA 12.8 or newer (cuBLASLt's block scale modes)")
    if kind == MXFP8 and (a.dtype != E4M3 or b.dtype != E4M3):
        return Refusal("torch's MX GEMM takes e4m3 operands only; this recipe casts gradients to e5m2 (format='hybrid'): "
                       "use format='e4m3' (the default of scaling='mxfp8')")
    k32, n16 = _round_up(k, 32), _round_up(n, 16)
    block = 32 if kind == MXFP8 else 16
    cols = k32 if kind == MXFP8 else k32 // 2  # packed FP4: two elements per byte along K
    mat_a = _microscaled_operand(a, m, cols, kind)
    mat_b = _microscaled_operand(b.t(), n16, cols, kind).t()
    scale_a = _swizzled_scales(operands.a.scale_inv, operands.a.tile, m, k, block, m)
    scale_b = _swizzled_scales(operands.b.scale_inv.t(), _transposed(operands.b.tile), n, k, block, n16)
    bias = operands.bias
    mm_dtype = torch.float32 if bias is not None or operands.out_dtype not in _OUT_DTYPES else operands.out_dtype
    call = ScaledMMCall(V2, kind, mat_a, mat_b, scale_a, scale_b, None, mm_dtype, False,
                        _Finish(n, bias, operands.out_dtype), target)
    if kind == NVFP4:
        call.tensor_scale_a = operands.a.tensor_scale.to(torch.float32).reshape(())
        call.tensor_scale_b = operands.b.tensor_scale.to(torch.float32).reshape(())
    return call


@dataclass
class ScaledGroupedMMCall(ScaledMMCall):
    """One call of torch's grouped scaled GEMM (module docstring, "grouped"): the dense call's fields (scale_a and
    scale_b rowwise, bias None, out_dtype bf16) with the offsets, and what is done to the output: the rows past the
    last offset zeroed (rows grouped), the empty groups' outputs zeroed (contraction grouped)."""

    offs: Optional[Tensor] = None
    #: rows grouped: the original offsets (rows past offsets[-1] are zeroed); contraction: the groups' token counts
    #: (an empty group's output is zeroed)
    groups: Optional[Tensor] = None

    def launch(self) -> Tensor:
        out = torch._scaled_grouped_mm(self.mat_a, self.mat_b, self.scale_a, self.scale_b, offs=self.offs,
                                       out_dtype=self.out_dtype, use_fast_accum=self.use_fast_accum)
        return self.finished(out)

    def finished(self, out: Tensor) -> Tensor:
        if self.kind == GROUPED_ROWS:
            in_group = group_of_rows(self.groups, out.shape[0]) < self.groups.shape[0]
            out = torch.where(in_group.unsqueeze(1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        else:
            out = torch.where((self.groups > 0).view(-1, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out.to(self.finish.out_dtype)

    def _tensors(self) -> Dict[str, Optional[Tensor]]:
        return {"mat_a": self.mat_a, "mat_b": self.mat_b, "scale_a": self.scale_a, "scale_b": self.scale_b,
                "offs": self.offs}

    def on_meta(self) -> "ScaledGroupedMMCall":
        def meta(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        return replace(self, mat_a=meta(self.mat_a), mat_b=meta(self.mat_b), scale_a=meta(self.scale_a),
                       scale_b=meta(self.scale_b), offs=meta(self.offs), groups=meta(self.groups))

    @property
    def runs_on_cpu(self) -> bool:
        """torch's grouped scaled GEMM has no CPU kernel (torch 2.13)."""
        return False


def _plan_grouped(operands: GemmRequest, target: ScaledMMTarget) -> Union[ScaledMMCall, Refusal]:
    """The grouped call (module docstring, "grouped"), or why the target has none."""
    a, b = operands.a, operands.b
    m, k, n = operands.shape
    grouped = operands.grouped
    if not target.has_grouped:
        return Refusal(f"{target.torch_name} has no torch._scaled_grouped_mm: grouped FP8 GEMMs (experts) need a "
                       "newer torch")
    if target.capability[0] not in target.torch_rules.grouped:
        return Refusal(f"torch's grouped scaled GEMM does not run on {target.name} in {target.torch_name} (its "
                       "CUTLASS grouped kernel is built for sm90, and for sm100 from torch 2.14)")
    if a.data.dtype != E4M3 or b.data.dtype != E4M3:
        return Refusal("torch's grouped scaled GEMM takes e4m3 operands only (the experts' recipe casts every role "
                       "to e4m3: lightning_fp8/modules/grouped_linear.py)")
    if operands.out_dtype != torch.bfloat16:
        return Refusal(f"torch's grouped scaled GEMM writes bf16 only; this GEMM's output is "
                       f"{_dtype_names([operands.out_dtype])} (train under BF16 autocast)")
    if operands.bias is not None:
        return Refusal("torch's grouped scaled GEMM takes no bias (experts add theirs after the GEMM)")
    if a.tile != (1, 0) or (b.tile not in ((0, 1),)):
        return Refusal(f"torch's grouped scaled GEMM takes rowwise scales only, not the tiling {a.tile} x {b.tile}")
    offsets = operands.offsets.to(torch.int32).contiguous()
    fast_accum = operands.use_fast_accum and k < FAST_ACCUM_MAX_K
    if grouped == "rows":
        if k % 16 or n % 16:
            return Refusal(f"torch's grouped scaled GEMM needs K and N in multiples of 16 ({m} x {k} x {n})")
        experts = b.data.shape[0]
        mat_a = _packed(a.data)
        mat_b = b.data if _column_major(b.data) else b.data.transpose(-2, -1).contiguous().transpose(-2, -1)
        scale_a = a.scale_inv.to(torch.float32).reshape(-1).contiguous()
        scale_b = b.scale_inv.to(torch.float32).reshape(experts, n).contiguous()
        return ScaledGroupedMMCall(GROUPED_V1, GROUPED_ROWS, mat_a, mat_b, scale_a, scale_b, None, torch.bfloat16,
                                   fast_accum, _Finish(n, None, operands.out_dtype), target, offs=offsets,
                                   groups=offsets)
    # the contraction grouped: a (M, T), b (T, N); every group's tokens re-laid 16-aligned
    if m % 16 or n % 16:
        return Refusal(f"torch's grouped scaled GEMM needs the output's dimensions in multiples of 16 ({m} x {n})")
    experts = offsets.shape[0]
    counts = group_counts(offsets)
    index, padded_offsets = _aligned_token_layout(offsets, counts, k, GROUP_ALIGNMENT)
    mat_a = _gather_columns(a.data, index)  # (M, T') row-major
    mat_b = _gather_columns(b.data.t(), index).t()  # (T', N) column-major
    scale_a = a.scale_inv.to(torch.float32).reshape(experts * m).contiguous()
    scale_b = b.scale_inv.to(torch.float32).reshape(experts * n).contiguous()
    return ScaledGroupedMMCall(GROUPED_V1, GROUPED_CONTRACTION, mat_a, mat_b, scale_a, scale_b, None, torch.bfloat16,
                               False, _Finish(n, None, operands.out_dtype), target, offs=padded_offsets,
                               groups=counts)


def _column_major(t: Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) == t.shape[-2] and _aligned(t)


def _aligned_token_layout(offsets: Tensor, counts: Tensor, tokens: int, multiple: int) -> Tuple[Tensor, Tensor]:
    """Where each column of a token dimension re-laid with every group starting at a multiple of `multiple` reads
    from: (index (T',) int64, -1 for a padding column; the new int32 end offsets). T' is the bound tokens + groups *
    (multiple - 1), rounded up to `multiple`, known on the host without reading the offsets."""
    groups = offsets.shape[0]
    length = _round_up(tokens + groups * (multiple - 1), multiple)
    padded = (counts + multiple - 1) // multiple * multiple
    ends = torch.cumsum(padded, 0)
    new_starts, old_starts = ends - padded, offsets.to(torch.int64) - counts
    position = torch.arange(length, device=offsets.device)
    group = torch.searchsorted(ends, position, right=True).clamp(max=groups - 1)
    within = position - new_starts[group]
    valid = (within < counts[group]) & (position < ends[-1])
    index = torch.where(valid, old_starts[group] + within, torch.full_like(position, -1))
    return index, ends.to(torch.int32)


def _gather_columns(t: Tensor, index: Tensor) -> Tensor:
    """A row-major copy of 2-D FP8 `t` with column j taken from t[:, index[j]] (zero where index is -1)."""
    raw = F.pad(t.contiguous().view(torch.uint8), (0, 1))  # a zero column at the end for the padding
    return raw[:, torch.where(index < 0, torch.full_like(index, t.shape[1]), index)].contiguous().view(t.dtype)


def _microscaled_operand(t: Tensor, rows: int, cols: int, kind: str) -> Tensor:
    """The (rows, cols) row-major operand (K padded to 32, N to 16; `cols` in bytes for packed FP4): the padded storage
    a microscaled cast wrote it in, read as it is (kernels/microscaled_ops.py `gemm_operand_storage`), else a padded,
    packed copy."""
    stored = gemm_operand_storage(t, rows, cols)
    if stored is not None and _aligned(stored):
        return stored
    return _packed(_padded(t, rows, cols) if kind == MXFP8 else _padded_bytes(t, rows, cols))


def _swizzled_scales(scales: Tensor, tile: Sequence[int], rows: int, k: int, block: int, padded_rows: int) -> Tensor:
    """An operand's block scales in cuBLASLt's swizzled layout: the swizzled buffer a microscaled cast wrote in front
    of the per-tile grid it returns, read as it is (kernels/microscaled_ops.py `swizzled_block_scales`), else the
    grid expanded to one scale per row and swizzled (a copy)."""
    blocks = -(-k // block)
    written = swizzled_block_scales(scales, rows, blocks) if scales.dim() == 2 else None
    if written is not None:
        return written.view(scales.dtype)
    return swizzle_32_4_4(_row_scales(scales, tile, rows, k, block), rows=padded_rows)


def _transposed(tile: Sequence[int]) -> Tuple[int, int]:
    return int(tile[1]), int(tile[0])


def _row_scales(scales: Tensor, tile: Sequence[int], rows: int, k: int, block: int) -> Tensor:
    """An operand's block scales as one per (row, K block): (rows, ceil(K / block)). A tile of several rows (NVFP4's
    16 x 16 weight blocks) is repeated over its rows, as the hardware reads one scale per row and block."""
    tile_rows = int(tile[0]) if tile[0] else rows
    if tile_rows > 1:
        scales = scales.view(torch.uint8).repeat_interleave(tile_rows, dim=0)[:rows].view(scales.dtype)
    return scales[:rows, : -(-k // block)]


def swizzle_32_4_4(scales: Tensor, rows: Optional[int] = None) -> Tensor:
    """cuBLASLt's block-scale layout (torch's SWIZZLE_32_4_4): the (R, C) scales zero-padded to (round_up(R, 128),
    round_up(C, 4)) (or `rows` rows) and laid out as 128 x 4 tiles, row-major over the tiles, each tile stored as
    32 x 16 with element (r, c) at (r % 32) * 16 + (r // 32) * 4 + c: a flat contiguous tensor of the scales' dtype
    (cuBLAS documentation, "1D block scaling factors layout"; torch's `to_blocked` in its test utilities)."""
    r, c = scales.shape
    padded_rows = _round_up(max(rows or r, r), 128)
    padded_cols = _round_up(c, 4)
    raw = scales.contiguous().view(torch.uint8)
    if (padded_rows, padded_cols) != (r, c):
        raw = F.pad(raw, (0, padded_cols - c, 0, padded_rows - r))
    tiles = raw.view(padded_rows // 128, 4, 32, padded_cols // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).contiguous().view(scales.dtype)


def _padded_bytes(t: Tensor, rows: int, cols: int) -> Tensor:
    """A 2-D packed FP4 tensor zero-padded to (rows, cols) bytes (byte 0 is two +0.0), row-major."""
    pad_r, pad_c = rows - t.shape[0], cols - t.shape[1]
    if not (pad_r or pad_c):
        return t
    return F.pad(t.contiguous().view(torch.uint8), (0, pad_c, 0, pad_r)).view(t.dtype)


def _blockwise_shape_problem(kind: str, m: int, k: int, n: int) -> Optional[str]:
    """What about (M, K, N) the blockwise GEMM cannot take (module docstring), or None."""
    if k % 128:
        return "K (the contraction) must be a multiple of 128"
    if kind == BLOCK_1x128_128x128 and n % 128:
        return "N must be a multiple of 128 (the 128x128 blocks of the second operand)"
    if m % 4:
        return ("the first operand's rows must be a multiple of 4 (cuBLASLt reads 1x128 scales with a leading "
                "dimension rounded up to 4; torch requires it to equal the rows)")
    if kind == BLOCK_1x128_1x128 and n % 16:
        return "the second operand's columns must be a multiple of 16 (torch's scaled GEMM takes mat_b's dimensions " \
               "in multiples of 16)"
    return None


def _l4_padded_view(scale: Tensor, kb: int, nb: int) -> Optional[Tensor]:
    """`scale` ((K/128, N/128), float32) as the (L4, N/128) tensor with strides (1, L4) that cuBLASLt reads, without
    a copy, where it already lies in such a buffer (the fused weight cast stores it so, padding included); None
    otherwise."""
    l4 = _round_up(kb, 4)
    if (scale.dtype != torch.float32 or tuple(scale.shape) != (kb, nb) or scale.stride(0) != 1
            or (nb > 1 and scale.stride(1) != l4)):
        return None
    needed = scale.storage_offset() + (nb - 1) * l4 + l4
    if needed * scale.element_size() > scale.untyped_storage().nbytes():
        return None
    return scale.as_strided((l4, nb), (1, l4))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _padded(t: Tensor, rows: int, cols: int) -> Tensor:
    """A 2-D FP8 tensor zero-padded to (rows, cols) (byte 0 is +0.0 in both formats), row-major; `t` itself when
    nothing is padded."""
    pad_r, pad_c = rows - t.shape[0], cols - t.shape[1]
    if not (pad_r or pad_c):
        return t
    return F.pad(t.contiguous().view(torch.uint8), (0, pad_c, 0, pad_r)).view(t.dtype)


def _packed(t: Tensor) -> Tensor:
    """`t` if exactly packed row-major (strides (cols, 1)) and 16-byte aligned, else a packed copy (a fresh
    allocation, aligned): what every scaled-GEMM kernel reads (sm89's rowwise kernel reads operands as packed
    whatever their strides; torch checks no alignment)."""
    if t.stride() == (t.shape[1], 1) and _aligned(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _aligned(t: Tensor) -> bool:
    return (t.storage_offset() * t.element_size()) % 16 == 0


def _padded_vector(v: Tensor, length: int) -> Tensor:
    return F.pad(v, (0, length - v.shape[0])) if length != v.shape[0] else v.contiguous()


# -- what meta tensors cannot show ----------------------------------------------------------------------------------
def check_call(call: ScaledMMCall) -> List[str]:
    """The rules of the module docstring that torch's own (meta) checks do not enforce, applied to a planned call:
    the violations, empty when the call is valid on its target."""
    problems: List[str] = []
    target, rules = call.target, call.target.rules
    if call.kind in GROUPED:
        return _check_grouped(call)
    if rules is None or call.kind not in rules.kinds:
        problems.append(f"{call.kind} scaling does not run on {target.name}")
        return problems
    a, b = call.mat_a, call.mat_b
    m, k = a.shape
    n = b.shape[1]
    if a.stride() != (k, 1) or b.stride() != (1, k):
        problems.append(f"operands not exactly packed: mat_a strides {a.stride()}, mat_b strides {b.stride()}")
    if not (_aligned(a) and _aligned(b)):
        problems.append("an operand's data is not 16-byte aligned")
    if a.dtype == E5M2 and b.dtype == E5M2:
        problems.append("e5m2 x e5m2")
    if call.bias is not None and (call.out_dtype == torch.float32 or call.bias.dtype != call.out_dtype):
        problems.append(f"bias of dtype {call.bias.dtype} with a {call.out_dtype} output")
    if call.kind == ROWWISE and target.rowwise_backend == "cutlass":
        if b.dtype != E4M3:
            problems.append("CUTLASS rowwise with an e5m2 second operand")
        if call.out_dtype not in target.cutlass_rowwise_out_dtypes:
            problems.append(f"CUTLASS rowwise writing {call.out_dtype} in {target.torch_name}")
        if call.out_dtype == torch.float16 and call.bias is None and target.cutlass_rowwise_fp16_needs_bias:
            problems.append(f"CUTLASS rowwise writing fp16 without a bias in {target.torch_name} (its no-bias kernel "
                            "writes bf16 bits)")
    if call.kind in MICROSCALED:
        problems.extend(_check_microscaled(call))
    if call.kind in BLOCKWISE:
        if call.api != V2:
            problems.append("blockwise through torch._scaled_mm (v1 mis-reads 128x128 scales)")
        if a.dtype != E4M3 or b.dtype != E4M3:
            problems.append("blockwise with an e5m2 operand")
        if call.use_fast_accum:
            problems.append("blockwise with fast accumulation")
        problem = _blockwise_shape_problem(call.kind, m, k, n)
        if problem:
            problems.append(f"blockwise on {m} x {k} x {n}: {problem}")
        if call.kind == BLOCK_1x128_128x128 and (tuple(call.scale_b.shape) != (_round_up(k // 128, 4), n // 128)
                                                 or (call.scale_b.stride()[0] != 1 and n // 128 > 1)):
            problems.append(f"128x128 scales of shape {tuple(call.scale_b.shape)}, strides {call.scale_b.stride()}: "
                            "cuBLASLt reads (L4, N/128) with strides (1, L4)")
    return problems


def _check_grouped(call: ScaledMMCall) -> List[str]:
    """What torch's CUDA grouped kernel checks beyond its meta checks (GroupedBlas.cpp: dimensions in multiples of
    16, the architecture), and the group alignment a contraction needs."""
    problems: List[str] = []
    target, a, b = call.target, call.mat_a, call.mat_b
    if target.capability[0] not in target.torch_rules.grouped:
        problems.append(f"a grouped scaled GEMM on {target.name} in {target.torch_name}")
    if a.dtype != E4M3 or b.dtype != E4M3:
        problems.append(f"a grouped scaled GEMM with {a.dtype} x {b.dtype} operands (needs e4m3)")
    if a.shape[-1] % 16 or b.shape[-2] % 16 or b.shape[-1] % 16:
        problems.append(f"a grouped scaled GEMM on {tuple(a.shape)} x {tuple(b.shape)} (dimensions must be multiples "
                        "of 16)")
    if call.offs is None or call.offs.dtype != torch.int32:
        problems.append("a grouped scaled GEMM without int32 offsets")
    if call.kind == GROUPED_CONTRACTION and a.shape[1] % GROUP_ALIGNMENT:
        problems.append(f"a grouped contraction over {a.shape[1]} tokens (the re-laid groups are multiples of "
                        f"{GROUP_ALIGNMENT})")
    if call.out_dtype != torch.bfloat16:
        problems.append(f"a grouped scaled GEMM writing {call.out_dtype} (bf16 only)")
    return problems


def _check_microscaled(call: ScaledMMCall) -> List[str]:
    problems: List[str] = []
    a, b = call.mat_a, call.mat_b
    k = a.shape[1] * (2 if a.dtype == FP4 else 1)
    m, n = a.shape[0], b.shape[1]
    blocks = -(-k // (32 if call.kind == MXFP8 else 16))
    if call.api != V2:
        problems.append(f"{call.kind} through torch._scaled_mm (v1) instead of torch.nn.functional.scaled_mm")
    if call.use_fast_accum:
        problems.append(f"{call.kind} with fast accumulation")
    if k % 32 or n % 16:
        problems.append(f"{call.kind} on K = {k}, N = {n} (K must be a multiple of 32, N of 16)")
    want = E4M3 if call.kind == MXFP8 else FP4
    scale_dtype = E8M0 if call.kind == MXFP8 else E4M3
    if a.dtype != want or b.dtype != want:
        problems.append(f"{call.kind} with {a.dtype} x {b.dtype} operands (needs {want})")
    for name, scale, rows in (("scale_a", call.scale_a, m), ("scale_b", call.scale_b, n)):
        expected = _round_up(rows, 128) * _round_up(blocks, 4)
        if scale.dtype != scale_dtype or scale.numel() != expected or not scale.is_contiguous():
            problems.append(f"{call.kind} {name}: {scale.dtype}, {scale.numel()} elements (needs {scale_dtype}, "
                            f"{expected}, contiguous, swizzled)")
    if call.kind == NVFP4:
        for name, scale in (("a", call.tensor_scale_a), ("b", call.tensor_scale_b)):
            if scale is None or scale.dtype != torch.float32 or scale.numel() != 1:
                problems.append(f"nvfp4 tensor scale {name}: needs one float32 value")
    if call.bias is not None:
        problems.append(f"{call.kind} with a bias in the call (it is added after, in float32)")
    return problems


def target_for(capability: Sequence[int], torch_version: Optional[Tuple[int, int]] = None) -> ScaledMMTarget:
    """The target of a GPU of `capability` with the running torch (or the given torch version): for tests and the
    contract suite."""
    target = ScaledMMTarget.of(DeviceProfile("cuda", (int(capability[0]), int(capability[1]))))
    return replace(target, torch_version=torch_version) if torch_version is not None else target
