"""FP8AdamW on sharded parameters (FSDP2's DTensors): the step on local shards, and state DCP can save and load.

The step: each rank updates its own shard with its own gradient shard (AdamW is elementwise), on the local tensors
(`to_local()`): no communication, and no DTensor dispatch for the many small ops of the compressed step.

The state of a sharded parameter is sharded the same way, as DTensors on the parameter's mesh with its placements,
so torch.distributed.checkpoint writes each rank's part once and loads it back into the same layout (plain tensors
would be taken as replicated: DCP would keep one rank's copy). Hence the layouts:

- fp32 layout (small or 1-D parameters, as unsharded): exp_avg / exp_avg_sq are DTensors shaped like the parameter,
  exactly torch.optim.AdamW's state under FSDP2.
- compressed layout: blocks must not straddle two ranks' shards, so they are laid along rows: the shard viewed as
  [rows, cols] (cols: the product of the other dimensions) is padded to `padded_cols`, a multiple of block_size, and
  quantized in blocks of block_size consecutive elements of a row (the flat blockwise code of blockwise.py applied to
  the padded tensor). Stored: exp_avg [R, padded_cols] in E4M3, exp_avg_scale_inv [R, padded_cols / block_size],
  and exp_avg_sq (+ its scale_inv) likewise: each a DTensor sharded on dim 0 like the parameter (R: its global rows).
  Row-aligned blocks group elements differently from the unsharded layout, so a sharded run's state is not
  bit-identical to an unsharded one's (its resume is bit-identical to itself).
- step: a plain CPU scalar, identical on every rank (replicated).

Only dim-0 sharding is supported for the compressed layout (FSDP2's default placement); other placements raise.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from lightning_fp8.optim.adamw_reference import adamw_step_
from lightning_fp8.optim.moment_storage import (
    State,
    is_compressed,
    new_step_counter,
    read_moments,
    uses_compressed_state,
    write_moments,
)

try:
    from torch.distributed.tensor import DTensor, Shard
except Exception:  # pragma: no cover - builds without torch.distributed
    DTensor = ()  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment]

#: state entries of the compressed layout (step aside)
_COMPRESSED_KEYS = ("exp_avg", "exp_avg_scale_inv", "exp_avg_sq", "exp_avg_sq_scale_inv")


def is_sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor)


class RowPaddedMoments:
    """The compressed moments of one shard in the row-padded layout (see the module docstring)."""

    def __init__(self, cols: int, padded_cols: int) -> None:
        self.cols, self.padded_cols = cols, padded_cols

    def read(self, state: State, shape: torch.Size, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = shape[0] if len(shape) else 1
        m, v = read_moments(_flat(state), torch.Size((rows, self.padded_cols)), block_size)
        return m[:, : self.cols].reshape(shape), v[:, : self.cols].reshape(shape)

    def write(self, state: State, m: torch.Tensor, v: torch.Tensor, block_size: int, exp_avg_sq_dtype: str,
              generator: Optional[torch.Generator]) -> None:
        flat = _flat(state)
        write_moments(flat, self._pad(m), self._pad(v), block_size, exp_avg_sq_dtype, generator)
        for key in _COMPRESSED_KEYS:  # new entries (a first write) get the 2-D shape; existing ones were written in place
            if key in flat and flat[key] is not state.get(key):
                rows = m.shape[0] if m.dim() else 1
                state[key] = flat[key].reshape(rows, -1)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(x.shape[0] if x.dim() else 1, -1).to(torch.float32)
        return torch.nn.functional.pad(x2d, (0, self.padded_cols - self.cols))


def _flat(state: State) -> State:
    """The state with its compressed tensors as flat views (what moment_storage.py's flat code reads and writes in place)."""
    return {k: (v.reshape(-1) if k in _COMPRESSED_KEYS and torch.is_tensor(v) else v) for k, v in state.items()}


def _geometry(param: torch.Tensor, block_size: int) -> Tuple[int, int]:
    cols = math.prod(param.shape[1:]) if param.dim() > 1 else 1
    return cols, math.ceil(cols / block_size) * block_size


def _check_placements(param: torch.Tensor) -> None:
    if param.device_mesh.ndim != 1 or not all(isinstance(pl, Shard) and pl.dim == 0 for pl in param.placements):
        raise NotImplementedError(
            f"FP8AdamW's compressed state supports parameters sharded on dim 0 of a 1-D mesh (FSDP2's default), not "
            f"{param.placements} on a {param.device_mesh.ndim}-D mesh; raise min_numel_fp8 to keep such parameters "
            "in the float32 layout, or use torch.optim.AdamW."
        )


def _as_dtensor(local: torch.Tensor, param: torch.Tensor, cols: int) -> torch.Tensor:
    """`local` ([local rows, cols]) as a DTensor sharded like `param` on dim 0, global shape [param rows, cols]."""
    global_shape = torch.Size((param.shape[0], cols))
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=global_shape,
                              stride=(cols, 1))


def init_sharded_state(param: torch.Tensor, group: Dict[str, Any]) -> State:
    """Zero state for a sharded `param` in the layout its group asks for (the decision uses the global shape, so every
    rank, an empty shard's included, builds the same layout)."""
    if not uses_compressed_state(param, group["min_numel_fp8"]):
        zeros = torch.zeros_like(param, dtype=torch.float32)
        return {"step": new_step_counter(), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
    _check_placements(param)
    local = param.to_local()
    cols, padded_cols = _geometry(param, group["block_size"])
    rows = local.shape[0]
    zeros = torch.zeros((rows, padded_cols), dtype=torch.float32, device=local.device)
    flat: State = {}
    write_moments(flat, zeros, zeros, group["block_size"], group["exp_avg_sq_dtype"], generator=None)
    state: State = {"step": new_step_counter()}
    for key, value in flat.items():
        width = padded_cols // group["block_size"] if key.endswith("scale_inv") else padded_cols
        state[key] = _as_dtensor(value.reshape(rows, width), param, width)
    return state


def sharded_step_(param: torch.Tensor, state: State, group: Dict[str, Any], generator: Optional[torch.Generator]) -> None:
    """One FP8AdamW step of a sharded parameter: the reference step on the local shard and the local state."""
    local_state = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}
    local_param = param.to_local()
    local_grad = param.grad.to_local()
    codec = None
    if is_compressed(local_state):
        codec = RowPaddedMoments(*_geometry(param, group["block_size"]))
    if local_param.numel() == 0:
        state["step"] += 1  # an empty shard: keep the replicated step counter in agreement with the other ranks
        return
    if codec is None:
        adamw_step_(local_param, local_grad, local_state, group, generator)
    else:
        adamw_step_(local_param, local_grad, local_state, group, generator, codec=codec)
    state["step"] = local_state["step"]


def adopt_sharded_state(param: torch.Tensor, group: Dict[str, Any], saved: State, saved_block_size: int) -> State:
    """A saved state for a sharded `param` (this layout, bit for bit; or torch AdamW's DTensor state, re-encoded)."""
    step = saved["step"]
    step = step.detach().to(device="cpu", dtype=torch.float32).clone() if torch.is_tensor(step) else torch.tensor(float(step))
    fresh = init_sharded_state(param, group)
    same_layout = (
        set(k for k in saved if k != "step") == set(k for k in fresh if k != "step")
        and all(isinstance(saved[k], DTensor) and saved[k].shape == fresh[k].shape and saved[k].dtype == fresh[k].dtype
                for k in fresh if k != "step")
        and saved_block_size == group["block_size"]
    )
    if same_layout:
        return {"step": step, **{k: saved[k].detach().clone() for k in fresh if k != "step"}}
    if not all(isinstance(v, DTensor) for k, v in saved.items() if k != "step" and torch.is_tensor(v)):
        raise ValueError(
            "FP8AdamW: this parameter is sharded (FSDP2) but its saved optimizer state is not: load sharded "
            "checkpoints into sharded models (torch.distributed.checkpoint), or convert the checkpoint first."
        )
    local_saved = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in saved.items()}
    local_param = param.to_local()
    if is_compressed(local_saved):
        codec = RowPaddedMoments(*_geometry(param, saved_block_size))
        m, v = codec.read(local_saved, local_param.shape, saved_block_size)
    else:
        m, v = local_saved["exp_avg"].to(torch.float32), local_saved["exp_avg_sq"].to(torch.float32)
    out = {"step": step, **{k: val for k, val in fresh.items() if k != "step"}}
    local_out = {k: (val.to_local() if isinstance(val, DTensor) else val) for k, val in out.items()}
    if is_compressed(local_out):
        RowPaddedMoments(*_geometry(param, group["block_size"])).write(
            local_out, m.reshape(local_param.shape), v.reshape(local_param.shape), group["block_size"],
            group["exp_avg_sq_dtype"], None,
        )
    else:
        local_out["exp_avg"].copy_(m.reshape(local_param.shape))
        local_out["exp_avg_sq"].copy_(v.reshape(local_param.shape))
    return out
