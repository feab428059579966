"""FP8AdamW: AdamW whose moments live in FP8 / FP16 (FP8-LM's precision-decoupled optimizer).

Memory per parameter, optimizer state only (the fp32 parameter is the master weight and is not state):
torch.optim.AdamW keeps 8 bytes; FP8AdamW keeps 1 + 2 bytes (+ 8 / block_size for the two block scales) with the
default FP16 second moment, 1 + 1 (+ 8 / block_size) with exp_avg_sq_dtype="fp8". See moment_storage.py for the layout
and why each format was chosen, adamw_reference.py for the step.

master_weights="bf16" / "fp16" keeps no fp32 copy at all: the parameters themselves are stored in that dtype
(cast in place when the optimizer takes them) and each update is written with stochastic rounding, so updates
far below the format's spacing still move the weights on average (rounding.py).
"""
from __future__ import annotations

import importlib.util
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.optim import Optimizer

from lightning_fp8.kernels import triton_enabled_for
from lightning_fp8.kernels.device import runs_cuda_paths
from lightning_fp8.optim import moment_storage as _state
from lightning_fp8.optim.adamw_reference import adamw_step_
from lightning_fp8.optim.rounding import noise_seed, seeded_generator
from lightning_fp8.optim.sharded import adopt_sharded_state, init_sharded_state, is_sharded, sharded_step_
from lightning_fp8.optim.moment_storage import EXP_AVG_SQ_DTYPES, adopt_state, init_state, is_compressed
from lightning_fp8.state_format import format_version, stamped

MASTER_WEIGHTS = ("fp32", "bf16", "fp16")
BACKENDS = ("torch", "triton")
_MASTER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: param-group keys that describe how FP8AdamW stores state (beyond AdamW's hyperparameters)
FP8_GROUP_KEYS = ("exp_avg_sq_dtype", "master_weights", "block_size", "min_numel_fp8", "seed")
#: keys of torch.optim.Adam/AdamW groups that select a torch implementation; they have no meaning here
TORCH_IMPL_KEYS = ("amsgrad", "foreach", "fused", "capturable", "differentiable")

ParamsT = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]


#: the format version of `FP8AdamW.state_dict` (lightning_fp8/state_format.py)
FP8_ADAMW_STATE_VERSION = 1


class FP8AdamW(Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) with compressed moments.

    Args:
        params, lr, betas, eps, weight_decay, maximize: as torch.optim.AdamW; per-group values are honoured.
        amsgrad: must be False (no compressed max-of-v state is implemented); True raises ValueError.
        exp_avg_sq_dtype: "fp16" (default; per-block scaled float16), "bf16" (stochastic rounding, no scale) or
            "fp8" (sqrt(v) in E4M3 with per-block scales, stochastic rounding).
        master_weights: "fp32" (default: the parameter is the master and stays as it is), "bf16" or "fp16":
            parameters are cast to that dtype in place and updated with stochastic rounding.
        block_size: elements per quantization block of the flattened moments (default 128).
        min_numel_fp8: parameters with fewer elements, and all 1-D parameters, keep float32 state laid out
            exactly like torch.optim.AdamW's (default 4096).
        decoupled_weight_decay: True (AdamW). False folds weight decay into the gradient as torch.optim.Adam
            does; `to_fp8_optimizer` sets it when converting an Adam, so Adam's L2 penalty is emulated exactly.
        seed: base seed of the stochastic rounding noise. The noise of step t of parameter i is a function of
            (seed, t, i), so a checkpoint resumes bit-identically without saving generator state.
        backend: "torch" (default: the plain-torch reference, any device) or "triton" (opt-in fused kernel for
            CUDA float32 parameters with an fp16/fp8 second moment; other parameters use the reference).

    Non-finite gradients are not checked (no host sync per step): the training engine does not call `step()`
    on a step whose gradients are not finite. See adamw_reference.py. Sharded parameters (FSDP2's DTensors) are stepped
    on their local shards with sharded state that distributed checkpoints save and load (sharded.py).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        exp_avg_sq_dtype: str = "fp16",
        master_weights: str = "fp32",
        block_size: int = 128,
        min_numel_fp8: int = 4096,
        decoupled_weight_decay: bool = True,
        seed: int = 0,
        backend: str = "torch",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not valid; valid choices: {list(BACKENDS)}")
        if backend == "triton" and importlib.util.find_spec("triton") is None:
            raise ValueError("backend='triton' needs the triton package; use backend='torch'")
        #: "torch" (the reference, default) or "triton" (the fused CUDA kernel of triton_adamw.py where it applies).
        #: Not part of the state dict: a choice of this process.
        self.backend = backend
        if amsgrad:
            raise ValueError("FP8AdamW does not support amsgrad=True; use amsgrad=False or torch.optim.AdamW")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            exp_avg_sq_dtype=exp_avg_sq_dtype,
            master_weights=master_weights,
            block_size=block_size,
            min_numel_fp8=min_numel_fp8,
            seed=seed,
        )
        _validate_group(defaults)
        super().__init__(params, defaults)

    # -- groups ---------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if param_group.get("amsgrad"):
            raise ValueError("FP8AdamW does not support amsgrad=True; use amsgrad=False or torch.optim.AdamW")
        param_group = {k: v for k, v in param_group.items() if k not in TORCH_IMPL_KEYS}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_group(group)
        for p in group["params"]:
            if torch.is_complex(p):
                raise ValueError("FP8AdamW does not support complex parameters")
        _apply_master_dtype(group)

    # -- step -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One AdamW step for every parameter that has a gradient; returns `closure()`'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            fused: Dict[torch.device, List[torch.Tensor]] = {}  # the Triton kernel's parameters, one launch per device
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FP8AdamW does not support sparse gradients")
                state = self.state[p]
                if is_sharded(p):  # FSDP2: this rank's shard, sharded state (sharded.py)
                    if len(state) == 0:
                        state.update(init_sharded_state(p, group))
                    sharded_step_(p, state, group, self._generator(p, group, state, index))
                    continue
                if len(state) == 0:
                    state.update(init_state(p, group))
                if self.backend == "triton" and _triton_supports(p, state, group):
                    fused.setdefault(p.device, []).append(p)
                else:
                    adamw_step_(p, p.grad, state, group, self._generator(p, group, state, index))
            if fused:
                from lightning_fp8.optim.triton_adamw import adamw_multi_step_triton_

                for params in fused.values():
                    adamw_multi_step_triton_(params, [p.grad for p in params], [self.state[p] for p in params], group)
        return loss

    @staticmethod
    def _generator(p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], index: int) -> Optional[torch.Generator]:
        needs_noise = group["master_weights"] != "fp32" or (
            is_compressed(state)
            and (
                group["exp_avg_sq_dtype"] == "bf16"
                or (group["exp_avg_sq_dtype"] == "fp8" and _state.FP8_SQRT_V_ROUNDING == "stochastic")
            )
        )
        if not needs_noise:
            return None
        step_about_to_run = int(state["step"]) + 1
        return seeded_generator(p.device, noise_seed(group["seed"], step_about_to_run, index))

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict, with its format version (lightning_fp8/state_format.py)."""
        return stamped(super().state_dict(), FP8_ADAMW_STATE_VERSION)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load this optimizer's state dict (bit-exact resume) or a torch.optim.Adam / AdamW one (its float32
        moments are compressed into this optimizer's layout).

        Saved group keys win, as in torch; keys a torch state dict lacks (the FP8 storage settings, and
        decoupled_weight_decay for dicts from torch < 2.6) keep this optimizer's values.
        """
        format_version(state_dict, "FP8AdamW state", FP8_ADAMW_STATE_VERSION)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        groups = []
        for current, saved in zip(self.param_groups, saved_groups):
            if saved.get("amsgrad"):
                raise ValueError("the state dict comes from an optimizer with amsgrad=True, which FP8AdamW does not support")
            group = {k: v for k, v in saved.items() if k not in TORCH_IMPL_KEYS}
            for key in FP8_GROUP_KEYS + ("decoupled_weight_decay", "maximize"):
                group.setdefault(key, current[key])
            _validate_group(group)
            groups.append(group)
        # torch's load casts every floating state tensor to the parameter's dtype, which would undo the
        # compression: let it load the groups only, and adopt the state ourselves.
        super().load_state_dict({"state": {}, "param_groups": groups})
        id_map = dict(zip(chain.from_iterable(g["params"] for g in groups), chain.from_iterable(g["params"] for g in self.param_groups)))
        group_of = {id(p): (g, saved_g) for g, saved_g in zip(self.param_groups, groups) for p in g["params"]}
        for group in self.param_groups:
            _apply_master_dtype(group)
        for key, saved_state in state_dict["state"].items():
            if key not in id_map:
                continue
            p = id_map[key]
            group, saved_group = group_of[id(p)]
            if saved_state:
                adopt = adopt_sharded_state if is_sharded(p) else adopt_state
                self.state[p] = adopt(p, group, saved_state, saved_group["block_size"])

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", True)
            group.setdefault("maximize", False)


def _triton_supports(p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> bool:
    """CUDA parameters the kernel covers; under `simulate_cuda` also meta parameters (a launch trace, shapes only) and
    CPU ones under the Triton interpreter, as the casts decide (`kernels.triton_enabled_for`)."""
    if not (p.is_cuda or (runs_cuda_paths(p) and triton_enabled_for(p))):
        return False
    from lightning_fp8.optim.triton_adamw import supports

    return supports(p, state, group)


def _validate_group(group: Dict[str, Any]) -> None:
    """ValueErrors that name the valid choices, for the constructor and for every added or loaded group."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"Invalid epsilon value: {group['eps']} (must be >= 0)")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas} (two values in [0, 1))")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']} (must be >= 0)")
    if group["exp_avg_sq_dtype"] not in EXP_AVG_SQ_DTYPES:
        raise ValueError(f"exp_avg_sq_dtype={group['exp_avg_sq_dtype']!r} is not valid; valid choices: {list(EXP_AVG_SQ_DTYPES)}")
    if group["master_weights"] not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights={group['master_weights']!r} is not valid; valid choices: {list(MASTER_WEIGHTS)}")
    for key in ("block_size", "min_numel_fp8"):
        value = group[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    if not isinstance(group["seed"], int):
        raise ValueError(f"seed must be an int, got {group['seed']!r}")


def _apply_master_dtype(group: Dict[str, Any]) -> None:
    """Low-precision master weights: the parameter *is* the master, so it is stored in that dtype."""
    dtype = _MASTER_DTYPES.get(group["master_weights"])
    if dtype is None:
        return
    for p in group["params"]:
        if is_sharded(p):
            raise NotImplementedError(
                f"FP8AdamW(master_weights={group['master_weights']!r}) changes the parameters' dtype, which FSDP2 "
                "fixes when it shards: use master_weights='fp32' with sharded parameters (or shard bf16 parameters)."
            )
        if p.is_floating_point() and p.dtype != dtype:
            with torch.no_grad():
                p.data = p.data.to(dtype)
                if p.grad is not None:
                    p.grad = p.grad.to(dtype)


def state_bytes_per_param(optimizer: Optimizer) -> float:
    """Bytes of every tensor in the optimizer's state (moments, block scales, step counters), divided by the
    number of parameters (elements) the optimizer updates. Parameters themselves are not counted: with fp32
    master weights the parameter is the master copy. Parameters without state yet count as parameters."""
    n_params = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    seen = set()
    total = 0
    for st in optimizer.state.values():
        for value in st.values():
            if torch.is_tensor(value) and id(value) not in seen:
                seen.add(id(value))
                total += value.numel() * value.element_size()
    return total / max(n_params, 1)
