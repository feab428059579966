"""The AdamW step of FP8AdamW for one parameter, in plain torch: the definition a fused kernel must match.

Order of operations is torch.optim.AdamW's single-tensor path (weight decay, lerp of m, v update, bias
corrections, addcdiv), so that a parameter whose state is in the fp32 layout is updated bit-identically to
torch's AdamW (foreach=False), and the very first step of a compressed parameter is too (zero state decodes to
exact zeros). What differs for compressed state is only where the moments live between steps:

    decode (m, v) to float32  ->  AdamW math in float32  ->  update the parameter  ->  encode (m, v) again

The parameter update uses the float32 moments of this step, before they are re-quantized; the quantization
error enters through the stored moments of the next step only.

Non-finite gradients: this function does not look for them (that would cost a device-to-host sync per step, or
extra passes). A NaN/inf gradient poisons the parameter and, for compressed state, the moments of its block.
The training engine checks gradients (it does so anyway for loss scaling) and does not call `step()` when they
are not finite; an optimizer step that is not called changes nothing.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple

import torch

from lightning_fp8.optim.rounding import stochastic_round
from lightning_fp8.optim.moment_storage import State, is_compressed, read_moments, write_moments


class MomentCodec(Protocol):
    """Where the compressed moments of a state are read from and written to (the default: moment_storage.py's flat layout;
    sharded parameters use sharded.py's row-padded one)."""

    def read(self, state: State, shape: torch.Size, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def write(self, state: State, m: torch.Tensor, v: torch.Tensor, block_size: int, exp_avg_sq_dtype: str,
              generator: Optional[torch.Generator]) -> None: ...


class FlatMoments:
    """moment_storage.py's layout: the moments flattened, in blocks of block_size consecutive elements."""

    read = staticmethod(read_moments)
    write = staticmethod(write_moments)


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: State,
    group: Dict[str, Any],
    generator: Optional[torch.Generator] = None,
    codec: MomentCodec = FlatMoments(),
) -> None:
    """One AdamW step of `param` (in place) and its `state` (in place).

    `generator` draws the stochastic rounding noise (bf16/fp16 master weights, bf16 and fp8 second moments); it must be
    given whenever one of those is in use. `codec`: the layout of compressed moments (see MomentCodec).
    """
    lr = _as_float(group["lr"])
    beta1, beta2 = (_as_float(b) for b in group["betas"])
    eps = group["eps"]
    weight_decay = group["weight_decay"]
    low_precision_master = group["master_weights"] != "fp32"

    state["step"] += 1
    step = float(state["step"])  # a CPU tensor, as in torch: no device sync

    grad = -grad if group["maximize"] else grad
    grad = grad.to(torch.float32)  # no copy for fp32 grads; never modified in place below
    # the float32 working copy of the parameter; for an fp32 parameter, the parameter itself (torch's behaviour)
    master = param if param.dtype == torch.float32 else param.to(torch.float32)

    if weight_decay != 0:
        if group["decoupled_weight_decay"]:
            master.mul_(1 - lr * weight_decay)
        else:  # torch.optim.Adam's L2 penalty, folded into the gradient
            grad = grad.add(master, alpha=weight_decay)

    compressed = is_compressed(state)
    exp_avg, exp_avg_sq = codec.read(state, param.shape, group["block_size"])
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)

    if master is not param:
        if low_precision_master:
            param.copy_(stochastic_round(master, param.dtype, generator=generator))
        else:
            param.copy_(master)
    if compressed:
        codec.write(state, exp_avg, exp_avg_sq, group["block_size"], group["exp_avg_sq_dtype"], generator)


def _as_float(x: Any) -> float:
    return float(x.item()) if torch.is_tensor(x) else float(x)
