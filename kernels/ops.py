"""`torch.library` custom ops around the device kernels, so `torch.compile` traces each as one opaque node and a
count of dispatched ops on CPU is a count of kernel launches on a GPU (each op's launches are stated below).

  lightning_fp8::fp8_cast(x, scale, fmt, noise?, seed?, skip_if?, write_row, write_t, compute_amax)
      -> (x_fp8 [M,N] or empty, x_fp8^T [N,M] or empty, amax float32 0-d, or 0 elements where not asked for)
      a cast with a known scale (1 launch).
  lightning_fp8::scaled_cast(x, history!, role, fmt, scaling, algo_max, margin, power_of_2, noise?, seed?, write_t,
                             record, pad_to=1)
      -> (x_fp8 [M,N], x_fp8^T [N,M'] or empty, scale 0-d, scale_inv 0-d); M' = M rounded up to pad_to (zeros)
      the state-driven cast of FP8Layer: the scale derived from the role's amax history (delayed) or this tensor's
      amax (current), and this tensor's amax max-accumulated into history[role, 0] (mutated) when `record`.
      CUDA: 2 launches (delayed: a pre-pass that reads nothing once the history sizes the scale; current: amax,
      then cast), 1 without scaling; no fill or allocation kernel besides (triton_cast.py). x_fp8^T is materialised
      only where the kernel writes it in the same pass (CUDA); elsewhere it is empty and callers use x_fp8.t() (the
      emulated GEMM reads any layout).
  lightning_fp8::tiled_cast(x, history!, role, fmt, tile, tile_t, margin, power_of_2, noise?, record, pad_to=1)
      -> (x_fp8 [M,N] or empty, scale_inv per tile of x, x^T_fp8 [N,M'] or empty, scale_inv per tile of x^T)
      the stateless cast of a fine-grained (rowwise / blockwise) layer: one scale per tile (numerics/tiles.py), for
      x and, in the same op, for x^T (the layout the other GEMM contracts; M' = M rounded up to `pad_to`, zeros);
      x's amax max-accumulated into history[role, 0] when `record` (overflow detection and monitoring read it; no
      scale is derived from it). The scales are stored in the layouts the scaled GEMM reads. CUDA: 1 launch (1x128 /
      128x128 tiles; rowwise with one layout), 2 (rowwise, both layouts), kernels/triton_tiled.py. Defined in
      kernels/tiled_ops.py.
  lightning_fp8::close_scaling_step(history!, overflow_count!, clip_count!, constants..., taken)
      closing the step in progress of one layer's three roles (numerics.scaling.close_step), in place.
      CUDA: 1 launch (kernels/triton_scaling.py).

Each op runs the Triton kernel where it can (CUDA tensor, triton importable, not disabled; or a CPU tensor under
TRITON_INTERPRET=1) and the torch reference (`kernel_reference.py`) everywhere else, so the op is valid on every device
and its fake implementation only has to describe shapes.
"""
from __future__ import annotations

from typing import Optional

import torch

from lightning_fp8.kernels import (
    cpu_kernels,
    cpu_twins_enabled_for,
    kernel_reference,
    triton_available,
    triton_enabled_for,
    use_soft_cast,
)
from lightning_fp8.kernels.device import autocast_off
from lightning_fp8.numerics.formats import get_format

SCALINGS = ("delayed", "current", "none")

Tensor = torch.Tensor


def _empty(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=x.device)


@torch.library.custom_op("lightning_fp8::fp8_cast", mutates_args=())
def fp8_cast_op(
    x: Tensor,
    scale: Tensor,
    fmt: str,
    noise: Optional[Tensor],
    seed: Optional[Tensor],
    skip_if: Optional[Tensor],
    write_row: bool,
    write_t: bool,
    compute_amax: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    with autocast_off(x.device):  # the reference's float32 arithmetic stays float32
        return _fp8_cast_impl(x, scale, fmt, noise, seed, skip_if, write_row, write_t, compute_amax)


def _fp8_cast_impl(x, scale, fmt, noise, seed, skip_if, write_row, write_t, compute_amax):
    f = get_format(fmt)
    if triton_enabled_for(x):
        from lightning_fp8.kernels.triton_cast import launch_cast

        out, out_t, amax = launch_cast(
            x,
            scale.reshape(()).to(torch.float32),
            f,
            write_row=write_row,
            write_t=write_t,
            compute_amax=compute_amax,
            noise=noise.reshape(x.shape) if noise is not None else None,
            seed=seed,
            skip_if=skip_if,
            hw_cast=not use_soft_cast(x),
        )
        out = out.view(f.dtype) if out is not None else None
        out_t = out_t.view(f.dtype) if out_t is not None else None
    else:
        if skip_if is not None and not (write_row or write_t):
            out, out_t = None, None
            amax = kernel_reference.amax_reference(x, skip_if) if compute_amax else None
        else:
            fast = None
            if cpu_twins_enabled_for(x) and noise is None and seed is None and x.is_floating_point():
                fast = cpu_kernels.cast_cpu(x, scale, f, write_row=write_row, write_t=write_t, compute_amax=compute_amax)
            out, out_t, amax = fast if fast is not None else kernel_reference.cast_reference(
                x,
                scale,
                f,
                write_row=write_row,
                write_t=write_t,
                compute_amax=compute_amax,
                noise=noise.reshape(x.shape) if noise is not None else None,
                stochastic=seed is not None,
                generator=_generator_from_seed(seed),
            )
    return (
        out if out is not None else _empty(x, f.dtype),
        out_t if out_t is not None else _empty(x, f.dtype),
        amax if compute_amax else _empty(x, torch.float32),  # no amax asked: a 0-element placeholder, no fill kernel
    )


def _generator_from_seed(seed: Optional[Tensor]) -> Optional[torch.Generator]:
    if seed is None:
        return None
    gen = torch.Generator(device=seed.device)
    gen.manual_seed(int(seed.reshape(-1)[0].item()))
    return gen


@fp8_cast_op.register_fake
def _fp8_cast_fake(x, scale, fmt, noise, seed, skip_if, write_row, write_t, compute_amax):
    torch._check(x.dim() == 2, lambda: "fp8_cast expects a 2-D tensor")
    dtype = get_format(fmt).dtype
    m, n = x.shape
    out = x.new_empty((m, n), dtype=dtype) if write_row else x.new_empty((0,), dtype=dtype)
    out_t = x.new_empty((n, m), dtype=dtype) if write_t else x.new_empty((0,), dtype=dtype)
    return out, out_t, x.new_empty(() if compute_amax else (0,), dtype=torch.float32)


def fp8_cast(
    x: Tensor,
    scale: Optional[Tensor],
    fmt,
    *,
    write_row: bool = True,
    write_t: bool = False,
    compute_amax: bool = True,
    noise: Optional[Tensor] = None,
    seed: Optional[Tensor] = None,
    skip_if: Optional[Tensor] = None,
):
    """Python face of the op for a 2-D `x`: returns (x_fp8 or None, x_fp8^T or None, amax or None).

    `fmt` is an FP8Format or its name. With `noise` (uniform [0,1), x's shape) the cast rounds stochastically and
    is bit-exact with `quantize(x, scale, fmt, "stochastic", noise=noise)`; with `seed` (int64 tensor of one
    element) the noise is drawn inside the kernel (philox), reproducible for a seed but a different stream from
    torch.rand. `skip_if` (a bool device flag) turns an amax-only call into a no-op returning 0 where set."""
    name = fmt if isinstance(fmt, str) else fmt.name
    if skip_if is not None and (write_row or write_t):
        raise ValueError("fp8_cast: skip_if is only for amax-only calls (write_row=write_t=False)")
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    # a cast is not differentiable (FP8Linear's autograd.Function owns the gradients): keep the op off the tape
    out, out_t, amax = torch.ops.lightning_fp8.fp8_cast(
        x.detach(), scale.detach(), name, noise, seed, skip_if, write_row, write_t, compute_amax
    )
    return (out if write_row else None, out_t if write_t else None, amax if compute_amax else None)


def fp8_amax(x: Tensor, skip_if: Optional[Tensor] = None) -> Tensor:
    """max|x| (float32, 0-d, NaN/inf propagate) of a 2-D tensor in one read; 0 where `skip_if` is set."""
    return fp8_cast(x, None, "e4m3", write_row=False, write_t=False, compute_amax=True, skip_if=skip_if)[2]


@torch.library.custom_op("lightning_fp8::scaled_cast", mutates_args=("history",))
def scaled_cast_op(
    x: Tensor,
    history: Tensor,
    role: int,
    fmt: str,
    scaling: str,
    algo_max: bool,
    margin: int,
    power_of_2: bool,
    noise: Optional[Tensor],
    seed: Optional[Tensor],
    write_t: bool,
    record: bool,
    pad_to: int = 1,
    history_sized: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with autocast_off(x.device):  # the reference's float32 arithmetic stays float32
        return _scaled_cast_impl(x, history, role, fmt, scaling, algo_max, margin, power_of_2, noise, seed, write_t,
                                 record, pad_to, history_sized)


def _scaled_cast_impl(x, history, role, fmt, scaling, algo_max, margin, power_of_2, noise, seed, write_t, record,
                      pad_to, history_sized):
    f = get_format(fmt)
    if triton_enabled_for(x):
        from lightning_fp8.kernels.triton_cast import launch_scaled_cast

        out, out_t, scale, scale_inv = launch_scaled_cast(
            x,
            history[role],
            f,
            scaling,
            algo_max,
            margin,
            power_of_2,
            write_t=write_t,
            record=record,
            noise=noise.reshape(x.shape) if noise is not None else None,
            seed=seed,
            hw_cast=not use_soft_cast(x),
            pad_to=pad_to,
            history_sized=history_sized,
        )
        out = out.view(f.dtype)
        out_t = out_t.view(f.dtype) if out_t is not None else _empty(x, f.dtype)
        return out, out_t, scale, scale_inv
    args = (x, history, role, f, scaling, algo_max, margin, power_of_2)
    kwargs = dict(
        noise=noise.reshape(x.shape) if noise is not None else None,
        generator=_generator_from_seed(seed),
        stochastic=seed is not None,
        record=record,
    )
    if cpu_twins_enabled_for(x) and history.device.type == "cpu":
        q, scale, scale_inv = cpu_kernels.scaled_cast_cpu(*args, **kwargs)
        return q, _empty(x, f.dtype), scale, scale_inv
    q, scale = kernel_reference.scaled_cast_reference(*args, **kwargs)
    return q.contiguous(), _empty(x, f.dtype), scale, scale.reciprocal()


@scaled_cast_op.register_fake
def _scaled_cast_fake(x, history, role, fmt, scaling, algo_max, margin, power_of_2, noise, seed, write_t, record,
                      pad_to=1, history_sized=False):
    torch._check(x.dim() == 2, lambda: "scaled_cast expects a 2-D tensor")
    dtype = get_format(fmt).dtype
    m, n = x.shape
    m_out = (m + pad_to - 1) // pad_to * pad_to if n else m
    out_t = (x.new_empty((n, m_out), dtype=dtype) if (write_t and triton_enabled_for(x))
             else x.new_empty((0,), dtype=dtype))
    scalar = x.new_empty((), dtype=torch.float32)
    return x.new_empty((m, n), dtype=dtype), out_t, scalar, x.new_empty((), dtype=torch.float32)


#: materializes_transpose(x): whether `scaled_cast(..., write_t=True)` writes x_fp8^T for `x`: the fused kernel does,
#: in the same pass, exactly where it runs (the name says what the casters ask; the answer is where Triton runs)
materializes_transpose = triton_enabled_for


def scaled_cast(
    x: Tensor,
    history: Tensor,
    role: int,
    fmt,
    scaling: str,
    algo_max: bool,
    margin: int,
    power_of_2: bool,
    *,
    write_t: bool = False,
    record: bool = True,
    noise: Optional[Tensor] = None,
    seed: Optional[Tensor] = None,
    pad_to: int = 1,
    history_sized: bool = False,
):
    """Python face of `lightning_fp8::scaled_cast` for a 2-D `x`: (x_fp8, x_fp8^T or None, scale, scale_inv).
    `pad_to` (1, 2, 4, 8 or 16): where x^T is written, its token columns are zero-padded to a multiple of it.
    `history_sized`: the caller knows the role's history sizes a delayed scale (a completed step with a non-zero
    amax: the engine reads that with its once-per-iteration flags), so the delayed cast skips its amax pre-pass,
    one launch less; the result is the same either way (the pre-pass then measures nothing the scale uses). Wrong
    only if the history was emptied behind the caller's back: that cast's scale is then 1 instead of current."""
    if pad_to not in (1, 2, 4, 8, 16):
        raise ValueError(f"scaled_cast: pad_to must be one of [1, 2, 4, 8, 16], got {pad_to!r}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaled_cast: unknown scaling {scaling!r}; valid: {list(SCALINGS)}")
    if x.dim() != 2:
        raise ValueError(f"scaled_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    name = fmt if isinstance(fmt, str) else fmt.name
    out, out_t, scale, scale_inv = torch.ops.lightning_fp8.scaled_cast(
        x.detach(), history, role, name, scaling, algo_max, margin, power_of_2, noise, seed, write_t, record, pad_to,
        history_sized,
    )
    return out, (out_t if out_t.numel() or x.numel() == 0 else None) if write_t else None, scale, scale_inv


@torch.library.custom_op(
    "lightning_fp8::close_scaling_step", mutates_args=("history", "overflow_count", "clip_count")
)
def close_scaling_step_op(
    history: Tensor,
    overflow_count: Tensor,
    clip_count: Tensor,
    fp8_max: Tensor,
    scaled: Tensor,
    delayed: Tensor,
    algo_max: Tensor,
    margin: Tensor,
    power_of_2: Tensor,
    taken: bool,
) -> None:
    # one Triton launch where the kernels run; the plugins' engine closes the steps of every layer at once instead
    # (lightning_fp8/engine/step_closer.py): this op serves a layer trained without an engine
    if triton_enabled_for(history) and history.is_contiguous():
        from lightning_fp8.kernels.triton_scaling import launch_close_step

        launch_close_step(history, overflow_count, clip_count, fp8_max, scaled, delayed, algo_max, margin,
                          power_of_2, taken)
        return
    with autocast_off(history.device):
        kernel_reference.close_step_reference(
            history, overflow_count, clip_count, (fp8_max, scaled, delayed, algo_max, margin, power_of_2), taken
        )


@close_scaling_step_op.register_fake
def _close_scaling_step_fake(history, overflow_count, clip_count, fp8_max, scaled, delayed, algo_max, margin,
                             power_of_2, taken):
    return None
