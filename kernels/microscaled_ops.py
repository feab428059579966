"""The custom op of the microscaling casts (MXFP8, NVFP4), `lightning_fp8::microscaled_cast`.

  lightning_fp8::microscaled_cast(x, history!, role, scaling, fmt, tile, tile_t, hadamard_t, noise?, noise_t?, record,
                                  rng_state!?)
      -> (data of x_q, scales of x_q, tensor scale of x_q, data of x^T_q, scales of x^T_q, tensor scale of x^T_q)

One op per tensor, as `tiled_cast` (kernels/tiled_ops.py): both layouts a tensor's two GEMMs read, and the record of
its amax into history[role, 0] (NaN / inf kept raw: the engine's overflow detection reads it). A layout not asked for
(an empty tile) comes back as empty tensors. What it computes is `numerics.microscaling` (the definition;
`kernel_reference.microscaled_cast_reference` composes it); on CUDA (and on CPU under the Triton interpreter) it is the fused
kernels of kernels/triton_microscaled.py, bit for bit.

- scaling "mxfp8": the data in `fmt` (E4M3 / E5M2), E8M0 block scales, no tensor scale (empty). CUDA: 1 launch
  (`mx_cast`: x read once, both layouts, both scale layouts, the amax record).
- scaling "nvfp4": packed FP4 data (two E2M1 per byte along the last dimension), E4M3 block scales, the float32 tensor
  scale (0-d); `hadamard_t`: x^T is the random Hadamard transform of x^T along its last dimension (the tokens,
  zero-padded to a multiple of 16: x^T_q has ceil16(M) columns) before it is quantized, as the NVFP4 weight-gradient
  GEMM reads it. Stochastic rounding: from the Philox stream of `rng_state` (int64 [seed, offset], advanced in place by
  the number of draws: `numerics.microscaling.philox_uniform`), or from given `noise` / `noise_t` tensors (uniform
  [0, 1) in each layout's unpacked shape; the reference runs then). CUDA: 2 launches (`nvfp4_amax`: the tensor's amax,
  and the amax of the Hadamard-transformed x^T, in one read, plus the stream's advance; `nvfp4_cast`: both layouts).

What each layout returns (`Layout`: rows x cols of the layout, in elements), the same on every path (the fake
implementation describes them):
- data: a contiguous (round_up(rows, 16), round_up(cols, 32)) tensor (FP4: half the columns, bytes) whose padding is
  zeros: the multiples the scaled GEMM takes (K of 32, N of 16), so it reads the cast's output without a padding copy.
  `microscaled_cast` returns the logical (rows, cols) view of it; `gemm_operand_storage` gives the GEMM the padded
  storage back from that view.
- scales: one contiguous uint8 buffer: first the block scales of every row in cuBLASLt's swizzled layout (SWIZZLE_32_4_4:
  `swizzle_block_scales`, (round_up(rows, 128), round_up(blocks, 4)) in 128 x 4 tiles, zeros in the padding; a
  16 x 16 block's scale repeated over its 16 rows), then the per-tile grid (`numerics.tiles.grid_shape`, row-major).
  `microscaled_cast` returns the grid, a view at the end of the buffer; `swizzled_block_scales` gives the GEMM the
  swizzled part from that view.
The op returns E8M0 scales and packed FP4 data as bytes (uint8), viewed as `torch.float8_e8m0fnu` /
`torch.float4_e2m1fn_x2` outside: inductor refuses to functionalize a mutating op with outputs of those dtypes
("auto_functionalized_v2 was not removed"), and a dtype view is free.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from lightning_fp8.kernels import kernel_reference, triton_enabled_for, use_soft_cast
from lightning_fp8.kernels.device import autocast_off
from lightning_fp8.numerics import microscaling
from lightning_fp8.numerics.formats import E4M3, get_format
from lightning_fp8.numerics.tiles import grid_shape

Tensor = torch.Tensor
SCALINGS = ("mxfp8", "nvfp4")
#: packed FP4 and E8M0, where this torch has them (torch >= 2.8); the op itself returns bytes
_FP4 = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
#: the multiples the scaled GEMM takes: K (the columns of every layout) of 32, N (the rows) of 16
K_MULTIPLE, N_MULTIPLE = 32, 16
#: the swizzled scale layout's tile: 128 rows x 4 blocks
SWIZZLE_ROWS, SWIZZLE_BLOCKS = 128, 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# -- what each layout holds ---------------------------------------------------------------------------------------
class Layout(NamedTuple):
    """One layout of a microscaled cast: `rows` x `cols` elements, one scale per `tile`, `block` elements per scale along
    the columns (the GEMM's K), FP4 data packed two per byte (`packed`). The storage of its outputs: module docstring."""

    rows: int
    cols: int
    tile: Tuple[int, int]
    block: int
    packed: bool

    @staticmethod
    def of(scaling: str, tile: Sequence[int], rows: int, cols: int) -> "Layout":
        return Layout(int(rows), int(cols), (int(tile[0]), int(tile[1])), 32 if scaling == "mxfp8" else 16,
                      scaling == "nvfp4")

    @property
    def data_cols(self) -> int:
        """Columns of the logical data (bytes for FP4: two elements each, an odd count padded with a zero code)."""
        return -(-self.cols // 2) if self.packed else self.cols

    @property
    def storage_shape(self) -> Tuple[int, int]:
        cols = _round_up(self.cols, K_MULTIPLE)
        return _round_up(self.rows, N_MULTIPLE), cols // 2 if self.packed else cols

    @property
    def blocks(self) -> int:
        """Scales per row along the columns (a 16 x 16 tile counts as 16 rows of one scale per block)."""
        return -(-self.cols // self.block)

    @property
    def swizzled_numel(self) -> int:
        return _round_up(self.rows, SWIZZLE_ROWS) * _round_up(self.blocks, SWIZZLE_BLOCKS)

    @property
    def grid(self) -> Tuple[int, int]:
        return grid_shape(self.tile, (self.rows, self.cols))

    @property
    def scale_numel(self) -> int:
        gr, gc = self.grid
        return self.swizzled_numel + gr * gc


def layouts_of(scaling: str, shape: Sequence[int], tile: Sequence[int], tile_t: Sequence[int],
               hadamard_t: bool) -> Tuple[Optional[Layout], Optional[Layout]]:
    """The layouts a cast of a (M, N) tensor writes: x (M, N) where `tile` is set, x^T (N, M) where `tile_t` is (N,
    ceil16(M) after NVFP4's Hadamard transform)."""
    m, n = int(shape[0]), int(shape[1])
    m_t = _round_up(m, microscaling.HADAMARD_SIZE) if (hadamard_t and scaling == "nvfp4") else m
    row = Layout.of(scaling, tile, m, n) if len(tile) else None
    col = Layout.of(scaling, tile_t, n, m_t) if len(tile_t) else None
    return row, col


def swizzle_block_scales(per_row: Tensor) -> Tensor:
    """cuBLASLt's block-scale layout (SWIZZLE_32_4_4, torch's `to_blocked`) of (R, C) scales, one per row and block: zero-
    padded to (round_up(R, 128), round_up(C, 4)) and laid out as 128 x 4 tiles, row-major over the tiles, each tile
    stored as 32 x 16 with element (r, c) at (r % 32) * 16 + (r // 32) * 4 + c: flat, contiguous, uint8."""
    r, c = per_row.shape
    rows, blocks = _round_up(r, SWIZZLE_ROWS), _round_up(c, SWIZZLE_BLOCKS)
    raw = per_row.contiguous().view(torch.uint8)
    if (rows, blocks) != (r, c):
        raw = F.pad(raw, (0, blocks - c, 0, rows - r))
    tiles = raw.view(rows // 128, 4, 32, blocks // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).contiguous()


def swizzled_offset(row: int, block: int, blocks: int) -> int:
    """Where scale (row, block) of a layout with `blocks` scales per row sits in its swizzled buffer."""
    tiles_per_row = _round_up(blocks, SWIZZLE_BLOCKS) // SWIZZLE_BLOCKS
    r = row % SWIZZLE_ROWS
    return (((row // SWIZZLE_ROWS) * tiles_per_row + block // SWIZZLE_BLOCKS) * 512 + (r % 32) * 16 + (r // 32) * 4
            + block % SWIZZLE_BLOCKS)


# -- what the GEMM reads without a copy ---------------------------------------------------------------------------
def gemm_operand_storage(data: Tensor, rows: int, cols: int) -> Optional[Tensor]:
    """The (rows, cols) row-major matrix a scaled GEMM reads (K padded to 32, N to 16), taken from the padded storage
    that `data` is the logical view of, without a copy: `data` as a microscaled cast returns it (module docstring), and
    rows x cols within that storage (its padding is zeros). None for any other tensor: the caller pads a copy.
    `cols` counts `data`'s elements (bytes for packed FP4)."""
    if data.dim() != 2 or data.storage_offset() != 0 or (data.shape[1] > 1 and data.stride(1) != 1):
        return None
    stored_rows = _round_up(data.shape[0], N_MULTIPLE)
    if data.stride(0) != cols or data.shape[1] > cols or rows > stored_rows or rows < data.shape[0]:
        return None
    if data.untyped_storage().nbytes() != stored_rows * cols * data.element_size():
        return None
    return data.as_strided((rows, cols), (cols, 1), 0)


def swizzled_block_scales(grid: Tensor, rows: int, blocks: int) -> Optional[Tensor]:
    """The block scales of a layout of `rows` rows and `blocks` scales per row in cuBLASLt's swizzled layout (flat,
    contiguous, numel round_up(rows, 128) * round_up(blocks, 4)), taken without a copy from the buffer that `grid` (the
    per-tile scales a microscaled cast returns) is the tail of. None for any other tensor: the caller swizzles."""
    swizzled = _round_up(rows, SWIZZLE_ROWS) * _round_up(blocks, SWIZZLE_BLOCKS)
    if grid.dim() != 2 or grid.element_size() != 1 or not grid.is_contiguous() or grid.storage_offset() != swizzled:
        return None
    if grid.untyped_storage().nbytes() != swizzled + grid.numel():
        return None
    return grid.as_strided((swizzled,), (1,), 0)


# -- the op -----------------------------------------------------------------------------------------------------------
def _empty(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=x.device)


def _data_dtype(scaling: str, fmt: str) -> torch.dtype:
    """The dtype the op returns the data in: the FP8 format, or bytes for packed FP4."""
    return get_format(fmt).dtype if scaling == "mxfp8" else torch.uint8


def kernel_takes(scaling: str, tile: Sequence[int], tile_t: Sequence[int]) -> bool:
    """Whether the fused kernels take this pair of tiles (an empty tile: that layout is not cast): MX 1 x 32 along each
    layout's columns; NVFP4 1 x 16, or 16 x 16 for both layouts (weights)."""
    tiles = {tuple(int(v) for v in t) for t in (tile, tile_t) if len(t)}
    if scaling == "mxfp8":
        return tiles <= {(1, 32)}
    return tiles in ({(1, 16)}, {(16, 16)}, set())


@torch.library.custom_op("lightning_fp8::microscaled_cast", mutates_args=("history", "rng_state"))
def microscaled_cast_op(
    x: Tensor,
    history: Tensor,
    role: int,
    scaling: str,
    fmt: str,
    tile: List[int],
    tile_t: List[int],
    hadamard_t: bool,
    noise: Optional[Tensor],
    noise_t: Optional[Tensor],
    record: bool,
    # no default: torch before the fix of custom ops' ADInplaceOrView kernel (2.7, 2.8 at least) drops a trailing
    # argument equal to its default from the call and then fails on the missing mutated argument ("tuple index out of
    # range": every mxfp8 / nvfp4 cast raised on those torches)
    rng_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # (builtin generic: torch 2.6 evaluates it)
    if scaling not in SCALINGS:
        raise ValueError(f"microscaled_cast: unknown scaling {scaling!r}; valid: {list(SCALINGS)}")
    row, col = layouts_of(scaling, x.shape, tile, tile_t, hadamard_t)
    if scaling == "mxfp8":
        noise = noise_t = rng_state = None  # MX rounds to nearest even (module docstring of numerics.microscaling)
    stochastic = rng_state is not None or noise is not None or noise_t is not None
    if noise is None and noise_t is None and triton_enabled_for(x) and kernel_takes(scaling, tile, tile_t):
        from lightning_fp8.kernels import triton_microscaled

        slot = history[role, 0:1] if record else None
        if scaling == "mxfp8":
            outputs = triton_microscaled.launch_mx_cast(x, slot, get_format(fmt), row, col, hw_cast=not use_soft_cast(x))
        else:
            outputs = triton_microscaled.launch_nvfp4_cast(x, slot, rng_state, row, col, hadamard_t,
                                                           hw_cast=not use_soft_cast(x))
        return _outputs(x, scaling, fmt, outputs)
    with autocast_off(x.device):  # the reference's float32 arithmetic stays float32
        casts = kernel_reference.microscaled_cast_reference(
            x, history, role, scaling, get_format(fmt), tile if row else (), tile_t if col else (), hadamard_t,
            noise=noise, noise_t=noise_t, rng_state=rng_state if stochastic else None, record=record)
        outputs = []
        for layout, cast in zip((row, col), casts):
            outputs.append(_stored(layout, *cast) if layout is not None else (None, None, None))
    return _outputs(x, scaling, fmt, outputs)


def _stored(layout: Layout, q: Tensor, grid: Tensor, tensor_scale: Optional[Tensor]):
    """A layout's (data, scales, tensor scale) as the reference gives them, in the op's storage (module docstring)."""
    rows, cols = layout.storage_shape
    data = q.contiguous().view(torch.uint8)
    if tuple(data.shape) != (rows, cols):
        data = F.pad(data, (0, cols - data.shape[1], 0, rows - data.shape[0]))
    codes = grid.contiguous().view(torch.uint8)
    per_row = codes.repeat_interleave(layout.tile[0], dim=0)[: layout.rows] if layout.tile[0] > 1 else codes
    scales = torch.cat([swizzle_block_scales(per_row), codes.reshape(-1)])
    return data.view(q.dtype) if not layout.packed else data, scales, tensor_scale


def _outputs(x: Tensor, scaling: str, fmt: str, outputs) -> Tuple[Tensor, ...]:
    data_dtype = _data_dtype(scaling, fmt)
    result = []
    for q, s, g in outputs:
        result += [q if q is not None else _empty(x, data_dtype), s if s is not None else _empty(x, torch.uint8),
                   g if g is not None else _empty(x, torch.float32)]
    return tuple(result)


@microscaled_cast_op.register_fake
def _microscaled_cast_fake(x, history, role, scaling, fmt, tile, tile_t, hadamard_t, noise, noise_t, record,
                           rng_state=None):
    torch._check(x.dim() == 2, lambda: "microscaled_cast expects a 2-D tensor")
    data_dtype = _data_dtype(scaling, fmt)
    result = []
    for layout in layouts_of(scaling, x.shape, tile, tile_t, hadamard_t):
        if layout is None:
            result += [x.new_empty((0,), dtype=data_dtype), x.new_empty((0,), dtype=torch.uint8),
                       x.new_empty((0,), dtype=torch.float32)]
            continue
        result += [x.new_empty(layout.storage_shape, dtype=data_dtype),
                   x.new_empty((layout.scale_numel,), dtype=torch.uint8),
                   x.new_empty((), dtype=torch.float32) if scaling == "nvfp4" else x.new_empty((0,), dtype=torch.float32)]
    return tuple(result)


# -- the Python face ------------------------------------------------------------------------------------------------
def _dtypes(scaling: str, fmt: str) -> Tuple[torch.dtype, torch.dtype]:
    """(data dtype, block-scale dtype) of a microscaled cast's views."""
    if scaling == "mxfp8":
        return get_format(fmt).dtype, _E8M0
    return _FP4, E4M3.dtype


#: one cast layout: (data, block scales, tensor scale or None); (None, None, None) for a layout not asked for
Cast = Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]


def microscaled_cast(
    x: Tensor,
    history: Tensor,
    role: int,
    scaling: str,
    fmt,
    tile: Sequence[int],
    tile_t: Sequence[int],
    *,
    hadamard_t: bool = False,
    noise: Optional[Tensor] = None,
    noise_t: Optional[Tensor] = None,
    record: bool = True,
    rng_state: Optional[Tensor] = None,
) -> Tuple[Cast, Cast]:
    """Python face of `lightning_fp8::microscaled_cast` for a 2-D `x`: ((x_q, scales, tensor scale), (x^T_q, scales^T,
    tensor scale^T)): the logical data (a view of its padded storage), the per-tile grid of scales (a view of the tail
    of the scale buffer), NVFP4's tensor scale (None for MXFP8); a layout not asked for (an empty tile) is (None, None,
    None). `rng_state`: NVFP4's stochastic rounding from that stream (int64 [seed, offset], advanced in place)."""
    if x.dim() != 2:
        raise ValueError(f"microscaled_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    name = fmt if isinstance(fmt, str) else fmt.name
    tile, tile_t = [int(v) for v in tile], [int(v) for v in tile_t]
    outputs = torch.ops.lightning_fp8.microscaled_cast(
        x.detach(), history, role, scaling, name, tile, tile_t, hadamard_t, noise, noise_t, record, rng_state,
    )
    data_dtype, scale_dtype = _dtypes(scaling, name)
    casts = []
    for layout, (q, s, g) in zip(layouts_of(scaling, x.shape, tile, tile_t, hadamard_t),
                                 (outputs[:3], outputs[3:])):
        if layout is None:
            casts.append((None, None, None))
            continue
        data = q[: layout.rows, : layout.data_cols]
        grid = s[layout.swizzled_numel:].view(layout.grid)
        casts.append((data.view(data_dtype), grid.view(scale_dtype), g if g.numel() else None))
    return casts[0], casts[1]


def stochastic_rounding_offsets(layouts: Sequence[Optional[Layout]]) -> List[int]:
    """Where each layout's draws start, relative to the stream's offset, and the total: consecutive, row layout first
    (module docstring of numerics.microscaling)."""
    starts, total = [], 0
    for layout in layouts:
        starts.append(total)
        if layout is not None:
            total += layout.rows * layout.cols
    return starts + [total]
