"""The FP8 GEMM as a specific GPU returns it, on any device: `FP8Recipe(backend="h100")` / `backend="rtx4060"`.

Where the default emulation (modules/emulation.py) multiplies the exact FP8 values with float32 accumulation in its own
summation order, these backends return the bits an NVIDIA GPU's `torch._scaled_mm` returns for the same call, as
modelled by `mmaemu` (an optional dependency: `pip install lightning-fp8[h100]`; imported on first use only):

  "h100"     an H100 PCIe (sm90, 114 SMs, cuBLASLt 12.8.3.14): mmaemu's profile "hopper"
  "rtx4060"  an RTX 4060 (sm89, 24 SMs, cuBLASLt 12.8.3.14): mmaemu's profile "ada"

What is computed is the call the GPU path would launch: `plan_scaled_mm` (modules/scaled_mm.py) plans the GEMM for that
GPU's architecture with the running torch's rules (operands padded and packed, scales, fast accumulation in the
forward GEMM only), mmaemu computes that `torch._scaled_mm` call, and the call's own finish (padded columns dropped, a
float32 output's bias added in float32) makes the result. So every per-tensor GEMM of a training step (forward, input
gradient, weight gradient) is checked against the GPU's numerics in exactly the form it would run there.

What is modelled (everything else raises `UnmodelledGemmError`, naming this): per-tensor scales (FP8Recipe scaling
"delayed" or "current"), E4M3 / E5M2 operands, bf16 / fp16 / float32 outputs, no bias inside the scaled GEMM (a layer
with a bias under BF16 / FP16 autocast passes its bias to cuBLASLt's epilogue, which mmaemu does not model; a float32
output gets its bias added after the GEMM, which is modelled). Rowwise, blockwise, MXFP8, NVFP4 and grouped
(mixture-of-experts) GEMMs are refused. mmaemu's records are of torch 2.7.1's `torch._scaled_mm` on cuBLASLt
12.8.3.14; a per-tensor call is planned alike for every torch the planner knows (its rules differ in rowwise and
block-scaled calls only), so the call computed is the call the running torch would launch.

Split-K: which split cuBLASLt picks for a call is a heuristic of the GPU, its library and its workspace, recorded by
mmaemu for many shapes; where the profile cannot decide, the GEMM raises `SplitKUnknownError` with mmaemu's
explanation, unless the caller says what it knows with `known_splits` (per call shape, or "this GPU ran with no
cuBLASLt workspace", which never splits). Nothing is guessed.

The model computes in float64 on the tensors' device: an exact result, many times slower than the default emulation
(meant for checking numerics on small models, tests and CI, not for training at scale).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch

from lightning_fp8.modules.operand import GemmRequest
from lightning_fp8.modules.scaled_mm import TENSORWISE, Refusal, ScaledMMCall, plan_scaled_mm, target_for

Tensor = torch.Tensor


class ModelledGPU(NamedTuple):
    """One GPU whose FP8 GEMM results a backend reproduces: its name, compute capability and mmaemu's profiles of it
    (torch's default 1 MiB cuBLASLt workspace, and no workspace)."""

    name: str
    capability: Tuple[int, int]
    profile: str
    profile_no_workspace: str


#: FP8Recipe.backend value -> the GPU it reproduces
MODELLED_GPUS: Dict[str, ModelledGPU] = {
    "h100": ModelledGPU("H100 PCIe (sm90, cuBLASLt 12.8.3.14)", (9, 0), "hopper", "hopper-ws0"),
    "rtx4060": ModelledGPU("RTX 4060 (sm89, cuBLASLt 12.8.3.14)", (8, 9), "ada", "ada-ws0"),
}

#: what the backends model, named in every refusal
MODELLED = ("per-tensor FP8 GEMMs (FP8Recipe scaling 'delayed' or 'current'): tensorwise scales, E4M3 / E5M2 operands, "
            "bf16 / fp16 / float32 outputs, no bias inside the scaled GEMM (a float32 output's bias is added after it; "
            "layers with a bias under BF16 / FP16 autocast are not modelled: use bias=False or float32 compute)")


class UnmodelledGemmError(NotImplementedError):
    """A GEMM the GPU-model backend does not model (another scaling, a bias in the scaled GEMM), or a call the
    modelled GPU's torch / cuBLASLt rejected: the message names what is modelled."""


class SplitKUnknownError(LookupError):
    """The modelled GPU's split-K decision for a call is not known; the message carries mmaemu's explanation and how
    to pass what is known (`known_splits`)."""


#: a split: 1 (unsplit) or (S, scheme) with mmaemu's scheme of the GPU ("contiguous" on the H100, "serial" or
#: "pairwise" on the RTX 4060)
Split = Union[int, Tuple[int, str]]


@dataclass(frozen=True)
class _Knowledge:
    splits: Tuple[Tuple[Tuple[int, int, int], Split], ...] = ()
    no_workspace: bool = False


_knowledge: List[_Knowledge] = []


@contextlib.contextmanager
def known_splits(splits: Optional[Mapping[Tuple[int, int, int], Split]] = None, *,
                 no_workspace: bool = False) -> Iterator[None]:
    """Inside the block, GEMMs of the GPU-model backends use what the caller knows about cuBLASLt's split-K choices.

    splits: per scaled-GEMM call, keyed (M, K, N) as `SplitKUnknownError` names it (the planned call's shape, K and N
        padded to 16): 1 where the GPU ran the call unsplit, (S, scheme) where it split it S ways (e.g. from
        CUBLASLT_LOG_LEVEL=5 on that GPU). Used where the profile cannot decide; a call the profile decides keeps the
        recorded decision unless it is listed here.
    no_workspace: the GPU ran with CUBLASLT_WORKSPACE_SIZE=0, where cuBLASLt never splits K (mmaemu's workspace-0
        profiles: no split among the hundreds of thousands of shapes recorded on each GPU); every call is decided.
    Blocks nest; the innermost that lists a call wins. Process-wide (not per thread)."""
    entries = tuple((tuple(int(v) for v in key), _checked_split(split)) for key, split in (splits or {}).items())
    _knowledge.append(_Knowledge(entries, bool(no_workspace)))
    try:
        yield
    finally:
        _knowledge.pop()


def _checked_split(split: Split) -> Split:
    if isinstance(split, int) and not isinstance(split, bool) and split == 1:
        return 1
    if isinstance(split, tuple) and len(split) == 2 and isinstance(split[0], int) and isinstance(split[1], str):
        return (int(split[0]), split[1])
    raise ValueError(f"known_splits: a split is 1 (unsplit) or (S, scheme), e.g. (2, 'contiguous'); got {split!r}")


def _known_split(key: Tuple[int, int, int]) -> Optional[Split]:
    for knowledge in reversed(_knowledge):
        for known_key, split in knowledge.splits:
            if known_key == key:
                return split
    return None


def _no_workspace() -> bool:
    return any(knowledge.no_workspace for knowledge in _knowledge)


def modelled_call(operands: GemmRequest, backend: str) -> ScaledMMCall:
    """The scaled-GEMM call the GPU of `backend` would be issued for `operands` (the planner's, for its architecture
    with the running torch's rules), or UnmodelledGemmError naming what is modelled."""
    gpu = MODELLED_GPUS[backend]
    what = f"FP8Recipe(backend={backend!r}) computes {MODELLED} as an {gpu.name} returns them"
    if getattr(operands, "offsets", None) is not None:
        raise UnmodelledGemmError(f"lightning_fp8: {what}; this is a grouped GEMM (mixture of experts), which is not "
                                  "modelled (use backend='auto' or 'emulated' for it)")
    plan = plan_scaled_mm(operands, target_for(gpu.capability))
    if isinstance(plan, Refusal):
        raise UnmodelledGemmError(f"lightning_fp8: {what}; this GEMM {tuple(operands.shape)} has no scaled-GEMM call "
                                  f"on that GPU: {plan.reason}")
    if plan.kind != TENSORWISE:
        raise UnmodelledGemmError(f"lightning_fp8: {what}; this GEMM is {plan.kind} scaling, which is not modelled "
                                  "(use backend='auto' or 'emulated' for it)")
    if plan.bias is not None:
        raise UnmodelledGemmError(f"lightning_fp8: {what}; this GEMM passes a {plan.bias.dtype} bias to the scaled "
                                  f"GEMM (a {plan.out_dtype} output), whose epilogue is not modelled")
    return plan


def run_on_gpu_model(operands: GemmRequest, backend: str) -> Tensor:
    """out = A @ B (+ bias) of `operands` with the bits the GPU of `backend` returns (module docstring)."""
    call = modelled_call(operands, backend)
    if call.mat_a.device.type == "meta":  # shapes only (a launch trace): nothing to compute
        return torch.empty((call.mat_a.shape[0], call.finish.n), dtype=call.finish.out_dtype, device="meta")
    mmaemu = _mmaemu(backend)
    gpu = MODELLED_GPUS[backend]
    profile = gpu.profile_no_workspace if _no_workspace() else gpu.profile
    m, k = call.mat_a.shape
    n = call.mat_b.shape[1]
    known = _known_split((m, k, n))
    try:
        with torch.no_grad():
            out = mmaemu.scaled_mm(call.mat_a, call.mat_b, call.scale_a, call.scale_b, out_dtype=call.out_dtype,
                                   use_fast_accum=call.use_fast_accum, profile=profile,
                                   splitk=known if known is not None else "auto")
    except mmaemu.SplitKUnknownError as error:
        raise SplitKUnknownError(
            f"lightning_fp8: FP8Recipe(backend={backend!r}) cannot compute the {call.describe()} as an {gpu.name} "
            f"does: {error}. If you know how that GPU ran it, say so: "
            f"`with lightning_fp8.modules.gpu_model.known_splits({{({m}, {k}, {n}): 1}}):` (unsplit; or (S, scheme)), "
            f"or `known_splits(no_workspace=True)` for a GPU run with CUBLASLT_WORKSPACE_SIZE=0."
        ) from error
    except (mmaemu.ReferenceRejectsError, mmaemu.UnsupportedFeatureError) as error:
        raise UnmodelledGemmError(
            f"lightning_fp8: FP8Recipe(backend={backend!r}) computes {MODELLED}; mmaemu refused the {call.describe()}: "
            f"{error}"
        ) from error
    return call.finished(out)


def _mmaemu(backend: str):
    try:
        import mmaemu
    except ImportError as error:
        raise ImportError(f"lightning_fp8: FP8Recipe(backend={backend!r}) needs mmaemu (the model of the GPU's FP8 "
                          "GEMMs): pip install 'lightning-fp8[h100]' (or pip install mmaemu)") from error
    return mmaemu
