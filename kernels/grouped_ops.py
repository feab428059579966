"""The custom op of a grouped (mixture-of-experts) layer's per-group cast, `lightning_fp8::grouped_cast`.

The weight-gradient GEMM of an experts layer contracts each expert's tokens, so its two operands, dy^T and x^T, are
scaled per (expert, column) over that expert's rows (numerics/groups.py `quantize_groups`): what this op casts, in
the transposed layout that GEMM reads (x^T (C, M) row-major: dy^T as mat_a, x^T as the storage of a column-major
mat_b), with the scales (E, C) and the amax record. The other casts of an experts layer are rowwise tiles
(`lightning_fp8::tiled_cast` on a 2-D view). On CUDA it is the Triton kernel of kernels/triton_grouped.py (one
launch); elsewhere, and with stochastic rounding, the torch definition (kernels/kernel_reference.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lightning_fp8.kernels import kernel_reference, triton_enabled_for, use_soft_cast
from lightning_fp8.kernels.device import autocast_off
from lightning_fp8.numerics.formats import get_format

Tensor = torch.Tensor


@torch.library.custom_op("lightning_fp8::grouped_cast", mutates_args=("history",))
def grouped_cast_op(
    x: Tensor,
    history: Tensor,
    role: int,
    fmt: str,
    offsets: Tensor,
    margin: int,
    power_of_2: bool,
    noise: Optional[Tensor],
    record: bool,
) -> tuple[Tensor, Tensor]:
    f = get_format(fmt)
    if noise is None and triton_enabled_for(x):
        from lightning_fp8.kernels.triton_grouped import launch_grouped_cast

        q_t, s = launch_grouped_cast(x, history[role, 0:1] if record else None, f, offsets, margin, power_of_2,
                                     hw_cast=not use_soft_cast(x))
        return q_t.view(f.dtype), s
    with autocast_off(x.device):
        q_t, s = kernel_reference.grouped_cast_reference(x, history, role, f, offsets, margin, power_of_2, noise=noise,
                                                  record=record)
    return q_t, s


@grouped_cast_op.register_fake
def _grouped_cast_fake(x, history, role, fmt, offsets, margin, power_of_2, noise, record):
    torch._check(x.dim() == 2, lambda: "grouped_cast expects a 2-D tensor")
    torch._check(offsets.dim() == 1, lambda: "grouped_cast expects 1-D offsets")
    rows, cols = x.shape
    return (x.new_empty((cols, rows), dtype=get_format(fmt).dtype),
            x.new_empty((offsets.shape[0], cols), dtype=torch.float32))


def grouped_cast(x: Tensor, history: Tensor, role: int, fmt, offsets: Tensor, margin: int, power_of_2: bool, *,
                 record: bool = True, noise: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Python face of `lightning_fp8::grouped_cast` for a 2-D `x` whose rows are sorted by group (`offsets`: int32
    end rows): (x^T_fp8 (C, M) contiguous, scale_inv (E, C)), x's amax max-accumulated into history[role, 0] when
    `record`. noise: stochastic rounding's uniform numbers, x's shape."""
    if x.dim() != 2:
        raise ValueError(f"grouped_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    name = fmt if isinstance(fmt, str) else fmt.name
    return torch.ops.lightning_fp8.grouped_cast(x.detach(), history, role, name, offsets, margin, power_of_2, noise,
                                                record)
