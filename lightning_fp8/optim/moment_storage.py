"""How FP8AdamW stores Adam's two moments, and conversion from any stored layout to any other.

Two layouts, chosen per parameter when its state is created (`uses_compressed_state`):

fp32 (small tensors: fewer than `min_numel_fp8` elements, or 1-D such as biases and norm weights)
    step, exp_avg, exp_avg_sq: exactly torch.optim.AdamW's state (float32, the parameter's shape). These tensors
    are a rounding error of a model's size, they are the ones most sensitive to precision (norm gains), and
    keeping torch's layout makes them bit-compatible with torch's AdamW.

compressed (everything else), flattened, in blocks of `block_size` elements (see blockwise.py):
    step                  float32 scalar on the CPU (as torch keeps it: no device sync to read it)
    exp_avg               float8_e4m3fn [numel], per-block scaled       1 byte
    exp_avg_scale_inv     float32 [n_blocks]                             4 / block_size bytes
    exp_avg_sq, by exp_avg_sq_dtype:
      "fp16"  float16 [numel] of v, per-block scaled + exp_avg_sq_scale_inv    2 + 4 / block_size bytes
      "bf16"  bfloat16 [numel] of v, no scale (bf16 has float32's range), stochastic rounding   2 bytes
      "fp8"   float8_e4m3fn [numel] of sqrt(v), per-block scaled, stochastic rounding
              + exp_avg_sq_scale_inv                                          1 + 4 / block_size

Why these formats:
- First moment in E4M3 (FP8-LM): m changes by ~10% of itself per step (beta1 = 0.9), more than E4M3's relative
  spacing (6-12%), so round-to-nearest follows it; per-block scales keep each block's largest value at 448.
- Second moment in FP16 with a per-block scale (FP8-LM uses FP16 with a scale): v moves by ~0.1% per step
  (beta2 = 0.999). FP16's relative spacing (0.05-0.1%) can follow that; E4M3 and BF16 cannot with nearest
  rounding (the change is below half a spacing, so v would freeze). The scale is needed for range (see
  blockwise.py).
- "bf16" second moment: BF16's 8 bits of precision freeze v under nearest rounding, so it is stored with
  stochastic rounding (unbiased; the noise it adds is averaged by the EMA itself).
- "fp8" second moment in the sqrt domain: sqrt(v) has the dynamic range of the gradient itself; v has its
  square, twice as many binades, more than E4M3's 18 (with subnormals) inside one block. Storing v directly,
  an element whose sqrt(v) is below 1/500 of its block's largest would read back as v = 0 while its m is not
  zero, and its update would become m / eps. In the sqrt domain the element has to be 2**17 times smaller than
  the block's largest before that happens, below where its m (same range, E4M3 too) already reads as zero.
  E4M3 cannot follow v's 0.1% per step with nearest rounding (each element's ratio to its block's largest
  freezes, biased high), so sqrt(v) is rounded stochastically, like the bf16 option.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from lightning_fp8.numerics.formats import E4M3
from lightning_fp8.optim.blockwise import FP16_STORAGE, dequantize_blockwise, quantize_blockwise
from lightning_fp8.optim.rounding import stochastic_round

EXP_AVG_SQ_DTYPES = ("fp16", "bf16", "fp8")

#: rounding of sqrt(v) into E4M3 for exp_avg_sq_dtype="fp8": "stochastic" (what FP8AdamW does) or "nearest".
#: Not an option of FP8AdamW: a module switch for ablations that run round-to-nearest (which biases the update's
#: denominator high, see the module docstring).
FP8_SQRT_V_ROUNDING = "stochastic"

State = Dict[str, Any]


def uses_compressed_state(param: torch.Tensor, min_numel_fp8: int) -> bool:
    """True where the moments are stored in 8/16 bits: tensors with 2+ dims and at least `min_numel_fp8`
    elements."""
    return param.dim() >= 2 and param.numel() >= min_numel_fp8


def is_compressed(state: State) -> bool:
    return "exp_avg_scale_inv" in state


def new_step_counter() -> torch.Tensor:
    return torch.tensor(0.0, dtype=torch.float32)


def init_state(param: torch.Tensor, group: Dict[str, Any]) -> State:
    """Zero state for `param` in the layout its group asks for."""
    zeros = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    state: State = {"step": new_step_counter()}
    if uses_compressed_state(param, group["min_numel_fp8"]):
        write_moments(state, zeros, zeros, group["block_size"], group["exp_avg_sq_dtype"], generator=None)
    else:
        state["exp_avg"] = zeros
        state["exp_avg_sq"] = zeros.clone()
    return state


def read_moments(state: State, shape: torch.Size, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) as float32 tensors of `shape`. For the fp32 layout these are the stored tensors
    themselves (updated in place, like torch's AdamW); for the compressed layout they are fresh tensors."""
    if not is_compressed(state):
        return state["exp_avg"], state["exp_avg_sq"]
    m = dequantize_blockwise(state["exp_avg"], state["exp_avg_scale_inv"], block_size, shape)
    sq = state["exp_avg_sq"]
    if sq.dtype == torch.bfloat16:
        v = sq.to(torch.float32).reshape(shape)
    elif sq.dtype == torch.float16:
        v = dequantize_blockwise(sq, state["exp_avg_sq_scale_inv"], block_size, shape)
    elif sq.dtype == E4M3.dtype:
        root = dequantize_blockwise(sq, state["exp_avg_sq_scale_inv"], block_size, shape)
        v = root * root
    else:
        raise ValueError(f"unrecognised exp_avg_sq storage dtype {sq.dtype}")
    return m, v


def write_moments(
    state: State,
    m: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    exp_avg_sq_dtype: str,
    generator: Optional[torch.Generator],
) -> None:
    """Store float32 moments in the compressed layout (in place when the tensors already exist).

    `generator` draws the stochastic rounding of a bf16 second moment; None rounds to nearest (zero
    initialisation and one-time conversions)."""
    m_data, m_scale_inv = quantize_blockwise(m, block_size, E4M3)
    v_scale_inv = None
    if exp_avg_sq_dtype == "fp16":
        v_data, v_scale_inv = quantize_blockwise(v, block_size, FP16_STORAGE)
    elif exp_avg_sq_dtype == "bf16":
        # stochastic rounding in the step; round-to-nearest for one-time conversions (generator None)
        flat = v.reshape(-1)
        v_data = flat.to(torch.bfloat16) if generator is None else stochastic_round(flat, torch.bfloat16, generator)
    elif exp_avg_sq_dtype == "fp8":
        stochastic = FP8_SQRT_V_ROUNDING == "stochastic" and generator is not None
        v_data, v_scale_inv = quantize_blockwise(
            v.sqrt(), block_size, E4M3, rounding="stochastic" if stochastic else "nearest", generator=generator
        )
    else:
        raise ValueError(f"exp_avg_sq_dtype={exp_avg_sq_dtype!r} is not valid; valid choices: {list(EXP_AVG_SQ_DTYPES)}")
    _store(state, "exp_avg", m_data)
    _store(state, "exp_avg_scale_inv", m_scale_inv)
    _store(state, "exp_avg_sq", v_data)
    if v_scale_inv is not None:
        _store(state, "exp_avg_sq_scale_inv", v_scale_inv)
    else:
        state.pop("exp_avg_sq_scale_inv", None)


def _store(state: State, key: str, value: torch.Tensor) -> None:
    old = state.get(key)
    if old is not None and old.dtype == value.dtype and old.shape == value.shape:
        old.copy_(value)
    else:
        state[key] = value


def adopt_state(param: torch.Tensor, group: Dict[str, Any], saved: State, saved_block_size: int) -> State:
    """Convert a saved state (this optimizer's, or torch.optim.Adam/AdamW's float32 one) into the layout `group`
    asks for `param`. A state already in that layout is copied bit for bit (exact resume); otherwise the moments
    are decoded to float32 and encoded again (with round-to-nearest).
    """
    if "max_exp_avg_sq" in saved:
        raise ValueError("the saved optimizer state uses amsgrad (max_exp_avg_sq); FP8AdamW does not support amsgrad")
    missing = {"step", "exp_avg", "exp_avg_sq"} - set(saved)
    if missing:
        raise ValueError(f"saved optimizer state lacks {sorted(missing)}; expected an Adam/AdamW state")
    step = saved["step"]
    step = step.detach().to(device="cpu", dtype=torch.float32).clone() if torch.is_tensor(step) else torch.tensor(float(step))
    want_compressed = uses_compressed_state(param, group["min_numel_fp8"])
    moved = {k: (v.detach().to(param.device) if torch.is_tensor(v) else v) for k, v in saved.items() if k != "step"}
    if want_compressed and is_compressed(moved) and _storage_matches(moved, group["exp_avg_sq_dtype"]) \
            and saved_block_size == group["block_size"]:
        return {"step": step, **{k: v.clone() for k, v in moved.items()}}
    m, v = read_moments(moved, param.shape, saved_block_size)
    m = m.to(torch.float32).reshape(param.shape)
    v = v.to(torch.float32).reshape(param.shape)
    out: State = {"step": step}
    if want_compressed:
        write_moments(out, m, v, group["block_size"], group["exp_avg_sq_dtype"], generator=None)
    else:
        out["exp_avg"] = m.clone()
        out["exp_avg_sq"] = v.clone()
    return out


def _storage_matches(state: State, exp_avg_sq_dtype: str) -> bool:
    want = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": E4M3.dtype}[exp_avg_sq_dtype]
    return state["exp_avg_sq"].dtype == want
