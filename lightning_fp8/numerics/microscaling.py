"""Microscaling: MXFP8 and NVFP4, the block-scaled formats of Blackwell tensor cores. Their definition.

Both scale small blocks along the contraction dimension of each GEMM operand (the tile (1, b) of the row-major
operand; weights in NVFP4: b x b blocks), so every GEMM reads one scale per block of each operand, which the tensor
cores apply to the block's partial product. The cast of every operand of every GEMM of a layer is defined here; the
tiles each operand uses are `tiles.operand_tiles`, the GEMM they feed `gemm_reference`.

MXFP8 (OCP Microscaling v1.0 with NVIDIA's "RCEIL" scale rule, what Transformer Engine's MXFP8BlockScaling and
torchao's MXFP8_RCEIL compute):

- blocks of 32 consecutive elements along the contraction dimension; a ragged last block has the elements it has;
- one E8M0 scale per block, 2^e with e in [-127, 127] (the byte e + 127; 0xFF is NaN);
- e is the smallest integer with amax(block) <= fmt.max * 2^e, clamped to [-127, 127] (an all-zero block: -127).
  So no element of a block ever saturates. Computed exactly from amax's binary exponent (`torch.frexp`), not from a
  float32 division and log2, which round near a binade: torchao's reference (torch's `to_mxfp`) gives a block whose
  amax is a few ulps above 448 * 2^k the scale 2^k where k > ~16, and that block then clips;
- elements: x * 2^-e (exact: a power of two) rounded to nearest even in the element format (E4M3 by default);
- a block holding inf or NaN gets the scale NaN (E8M0 0xFF) and decodes to NaN as a whole: E8M0 cannot scale an
  infinite block, and a NaN must never turn into a number. The tensor's amax (recorded by the layer) shows it.

NVFP4 (NVIDIA's two-level FP4: Transformer Engine's NVFP4BlockScaling, torchao's NVFP4Tensor):

- elements FP4 E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), packed two per byte (`torch.float4_e2m1fn_x2`, the first
  element of a pair in the low nibble) along the contraction dimension, zero-padded to an even length;
- a float32 decode scale per tensor, g = amax(tensor) / (6 * 448) (1 for an all-zero tensor; NaN for a tensor holding
  inf or NaN, so that every block of it decodes to NaN);
- blocks of 16 along the contraction dimension (activations, gradients), or 16 x 16 (weights: W and W^T then quantize
  to the same values, so the forward and the dgrad GEMM use one weight), with an E4M3 decode scale per block:
  s = e4m3(clamp(amax(block) / 6 / g, 2^-9, 448)), rounded to nearest even (float32 divisions). The lower clamp keeps
  a block far below the tensor's amax from a zero scale (its values then underflow instead of dividing by zero);
- elements: clamp(x / (s * g), -6, 6) (one float32 product, one float32 division) rounded to E2M1, to nearest even
  or stochastically (gradients);
- the value an element stands for: e2m1 * s * g; the GEMM: per 16-block the dot product of the E2M1 values times
  s_a * s_b, summed, times g_a * g_b.
- random Hadamard transform (RHT) of the weight-gradient GEMM's inputs: dW = dY^T X = (dY^T H)(X^T H)^T for any
  orthogonal H on the token dimension. H is block diagonal with 16 x 16 blocks D * Had16 / 4 (Had16 the Sylvester
  Hadamard matrix, D a diagonal of signs drawn from a fixed seed: reproducible, the same in every process). It spreads
  one large token over its 16-token block before the blocks are quantized, so fewer of the others underflow. Tokens
  are zero-padded to a multiple of 16 (zero tokens add nothing to dW). Its float32 arithmetic is fixed, so that every
  implementation gives the same bits: each token times its sign (exact), the Walsh-Hadamard butterflies on pairs of
  tokens 1, 2, 4 then 8 apart ((a, b) -> (a + b, a - b), one IEEE addition each), then times 1/4 (`hadamard_transform`).
- stochastic rounding's uniform numbers come from a Philox4x32-10 counter stream (`philox_uniform`): the stream of
  Triton's `tl.rand(seed, offset)` with a 64-bit seed and 64-bit offsets, computed here with torch integer ops, so the
  fused kernel and this definition draw the same number for the same (seed, offset). A cast draws one number per
  element of each layout it writes, at consecutive offsets (row layout first, row-major; then the transposed layout),
  from the offset its caller's stream state holds (kernels/microscaled_ops.py).
- a NaN element rounds to the FP4 code 0 (its block's scale carries the NaN: FP4 has no NaN, and the sign of a NaN is
  not the same on every device).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import torch

from lightning_fp8.numerics.formats import E2M1, E4M3, FP8Format
from lightning_fp8.numerics.tiles import Tile, amax_of_tiles, expand_tiles, tile_amax, tile_extent, tiled_gemm_reference

Tensor = torch.Tensor

MX_BLOCK = 32
NVFP4_BLOCK = 16
#: None on a torch without it (before 2.7): the MX casts are then unavailable, the rest of the module imports
E8M0 = getattr(torch, "float8_e8m0fnu", None)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
#: NVFP4's second level: the per-tensor scale spreads the tensor's amax over the E4M3 block scales' range
NVFP4_TENSOR_DIVISOR = E2M1.max * E4M3.max  # 6 * 448 = 2688, exact
#: the smallest block scale (the smallest E4M3 subnormal)
NVFP4_MIN_BLOCK_SCALE = E4M3.smallest_subnormal
#: the seed of the random Hadamard transform's signs (fixed: every process, every run, the same transform)
HADAMARD_SEED = 0
HADAMARD_SIZE = 16

#: magnitude of each E2M1 code 0..7
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: round to nearest even: code = how many of these a magnitude passes (">" where the tie goes down to an even code,
#: ">=" where it goes up to one)
_FP4_TIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# -- MXFP8 ---------------------------------------------------------------------------------------------------------
def mx_scales(amax: Tensor, fmt: FP8Format) -> Tensor:
    """The E8M0 scale of each block from its amax (module docstring): a `torch.float8_e8m0fnu` tensor of amax's
    shape; 0xFF (NaN) where the amax is inf or NaN."""
    fmt_mantissa, fmt_exponent = math.frexp(fmt.max)  # 448 = 0.875 * 2^9
    mantissa, exponent = torch.frexp(amax.to(torch.float32))
    e = exponent - fmt_exponent + (mantissa > fmt_mantissa).to(torch.int32)
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = torch.where(torch.isfinite(amax), e + E8M0_BIAS, torch.full_like(e, E8M0_NAN))
    return codes.to(torch.uint8).view(E8M0)


def e8m0_reciprocal(scale: Tensor) -> Tensor:
    """2^-e of each E8M0 scale 2^e, in float32 (exact: -e is in [-127, 127] too); NaN for NaN."""
    codes = scale.view(torch.uint8).to(torch.int32)
    flipped = torch.where(codes == E8M0_NAN, codes, 2 * E8M0_BIAS - codes)
    return flipped.to(torch.uint8).view(E8M0).to(torch.float32)


def quantize_mx(x: Tensor, tile: Sequence[int], fmt: FP8Format = E4M3) -> Tuple[Tensor, Tensor, Tensor]:
    """Cast a 2-D `x` to MXFP8 with one E8M0 scale per `tile` (module docstring): (x in fmt, scales E8M0 in the
    grid layout of `tiles.grid_shape`, the tensor's amax; NaN / inf propagate)."""
    amax = tile_amax(x, tile)
    scales = mx_scales(amax, fmt)
    scaled = per_tile(x.to(torch.float32), e8m0_reciprocal(scales), tile, torch.mul)
    return torch.clamp(scaled, -fmt.max, fmt.max).to(fmt.dtype), scales, amax_of_tiles(amax)


def dequantize_mx(q: Tensor, scales: Tensor, tile: Sequence[int]) -> Tensor:
    """float32 values of an MXFP8 tensor: each element times its block's scale (exact)."""
    return per_tile(q.to(torch.float32), scales.to(torch.float32), tile, torch.mul)


# -- FP4 E2M1 ------------------------------------------------------------------------------------------------------
def fp4_codes(v: Tensor, noise: Optional[Tensor] = None) -> Tensor:
    """E2M1 codes (uint8 0..15, sign in bit 3) of float32 values already in [-6, 6]: round to nearest even, or with
    `noise` (uniform [0, 1), v's shape) stochastically to one of the two neighbours, unbiased (up where noise < the
    distance to the lower one over the gap). A NaN rounds to the code 0 (module docstring)."""
    magnitude = v.abs().to(torch.float32)
    if noise is None:
        # the number of thresholds passed, in one pass: bucketize counts boundaries strictly below each value, so a
        # ">=" threshold (tie up) becomes "> the float32 just below it" (exact for float32 values)
        code = torch.bucketize(magnitude, _fp4_table("boundaries", v.device)).to(torch.uint8)
    else:
        table = _fp4_table("magnitudes", v.device)
        lower = torch.bucketize(magnitude, table[1:], right=True)  # the number of grid values <= magnitude
        upper = (lower + 1).clamp(max=len(FP4_MAGNITUDES) - 1)
        lo, hi = table[lower], table[upper]
        gap = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
        up = noise < (magnitude - lo) / gap
        code = torch.where(up & (hi > lo), upper, lower).to(torch.uint8)
    code = code | (torch.signbit(v).to(torch.uint8) << 3)
    return torch.where(torch.isnan(v), torch.zeros_like(code), code)


_FP4_TABLES: dict = {}


def _fp4_table(name: str, device) -> Tensor:
    """The constant tables of the FP4 casts, built once per device (nothing is rebuilt per cast): "boundaries" (the
    round-to-nearest-even thresholds as bucketize boundaries), "magnitudes" (the 8 magnitudes), "values" (the 16
    codes' values)."""
    key = (name, str(device))
    if key not in _FP4_TABLES:
        if name == "boundaries":
            edges = torch.tensor([t for t, _ in _FP4_TIES], dtype=torch.float32)
            tie_up = torch.tensor([up for _, up in _FP4_TIES])
            table = torch.where(tie_up, torch.nextafter(edges, torch.zeros_like(edges)), edges)
        elif name == "magnitudes":
            table = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
        else:
            table = torch.tensor(FP4_MAGNITUDES + tuple(-m for m in FP4_MAGNITUDES), dtype=torch.float32)
        _FP4_TABLES[key] = table.to(device)
    return _FP4_TABLES[key]


def fp4_values(codes: Tensor) -> Tensor:
    """float32 value of each E2M1 code (uint8 0..15)."""
    return _fp4_table("values", codes.device)[codes.to(torch.int64)]


def pack_fp4(codes: Tensor) -> Tensor:
    """Codes (..., n) two per byte along the last dimension (zero-padded to an even n), first in the low nibble:
    a `torch.float4_e2m1fn_x2` tensor (..., ceil(n / 2))."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous().view(E2M1.dtype)


def unpack_fp4(packed: Tensor, dim: int = -1) -> Tensor:
    """The codes (uint8) of a packed FP4 tensor, unpacked along `dim` (the dimension it was packed along: a transposed
    view of a packed tensor unpacks along its other dimension)."""
    if dim in (0, -2) and packed.dim() == 2:
        return unpack_fp4(packed.t(), -1).t()
    raw = packed.view(torch.uint8)
    pairs = torch.stack([raw & 0x0F, raw >> 4], dim=-1)
    return pairs.reshape(*raw.shape[:-1], 2 * raw.shape[-1])


# -- NVFP4 ---------------------------------------------------------------------------------------------------------
def nvfp4_tensor_scale(amax: Tensor) -> Tensor:
    """The per-tensor decode scale g = amax / (6 * 448), float32 (module docstring)."""
    amax = amax.to(torch.float32)
    g = torch.div(amax, torch.full_like(amax, NVFP4_TENSOR_DIVISOR))  # IEEE division (not reciprocal-multiply)
    g = torch.where(amax > 0, g, torch.ones_like(g))
    return torch.where(torch.isfinite(amax), g, torch.full_like(g, math.nan))


def nvfp4_block_scales(block_amax: Tensor, tensor_scale: Tensor) -> Tensor:
    """The E4M3 decode scale of each block (module docstring)."""
    six = torch.full_like(block_amax, E2M1.max)
    s = torch.div(torch.div(block_amax.to(torch.float32), six), tensor_scale)
    return torch.clamp(s, NVFP4_MIN_BLOCK_SCALE, E4M3.max).to(E4M3.dtype)


def quantize_nvfp4(
    x: Tensor, tile: Sequence[int], noise: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cast a 2-D `x` to NVFP4 with one E4M3 scale per `tile` (module docstring): (packed E2M1 (rows, ceil(cols/2)),
    block scales E4M3 in grid layout, the float32 tensor decode scale (0-d), the tensor's amax). `noise` (x's shape,
    uniform [0, 1)): stochastic rounding."""
    amax = tile_amax(x, tile)
    total_amax = amax_of_tiles(amax)
    g = nvfp4_tensor_scale(total_amax)
    s = nvfp4_block_scales(amax, g)
    decode = s.to(torch.float32) * g
    v = torch.clamp(per_tile(x.to(torch.float32), decode, tile, torch.div), -E2M1.max, E2M1.max)
    return pack_fp4(fp4_codes(v, noise)), s, g, total_amax


def dequantize_nvfp4(packed: Tensor, scales: Tensor, tensor_scale: Tensor, tile: Sequence[int], cols: int) -> Tensor:
    """float32 values of an NVFP4 tensor of `cols` columns: e2m1 * s * g (the product s * g first, as the GEMM
    applies g to its accumulator: exact for values that are not subnormal in float32)."""
    values = fp4_values(unpack_fp4(packed))[:, :cols]
    return per_tile(values, scales.to(torch.float32), tile, torch.mul) * tensor_scale


# -- the random Hadamard transform -------------------------------------------------------------------------------
#: the signs of the transform's diagonal D: the draw of `hadamard_signs` from HADAMARD_SEED, written out so that no
#: cast ever draws them (tests/test_microscaling.py checks the two agree)
HADAMARD_SIGNS = (-1, 1, 1, -1, 1, 1, 1, 1, 1, 1, 1, -1, -1, 1, -1, -1)


@functools.lru_cache(maxsize=None)
def hadamard_signs(size: int = HADAMARD_SIZE, seed: int = HADAMARD_SEED) -> Tuple[int, ...]:
    """The diagonal D of the transform: `size` signs (+1 / -1) drawn from a fixed seed (module docstring); the default
    transform's are `HADAMARD_SIGNS`."""
    if (size, seed) == (HADAMARD_SIZE, HADAMARD_SEED):
        return HADAMARD_SIGNS
    draws = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed))
    return tuple(int(v) * 2 - 1 for v in draws.tolist())


def hadamard_sign_mask(size: int = HADAMARD_SIZE, seed: int = HADAMARD_SEED) -> int:
    """The signs as a bit mask (bit t set where token t of a block is negated): how the fused kernel holds them."""
    return sum(1 << t for t, sign in enumerate(hadamard_signs(size, seed)) if sign < 0)


def hadamard_matrix(size: int = HADAMARD_SIZE, seed: int = HADAMARD_SEED) -> Tensor:
    """D * Had / sqrt(size), float32 (size x size, orthogonal): Sylvester's Hadamard matrix with its rows' signs
    flipped by a fixed random draw (module docstring). `hadamard_transform` applies it without forming it."""
    had = torch.ones(1, 1)
    while had.shape[0] < size:
        had = torch.cat([torch.cat([had, had], 1), torch.cat([had, -had], 1)], 0)
    if had.shape[0] != size:
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {size}")
    signs = torch.tensor(hadamard_signs(size, seed), dtype=torch.float32)
    return signs.unsqueeze(1) * had / math.sqrt(size)


_SIGNS: dict = {}


def _signs_on(device) -> Tensor:
    """The signs as a float32 tensor on `device`, built once per device."""
    key = str(device)
    if key not in _SIGNS:
        _SIGNS[key] = torch.tensor(hadamard_signs(), dtype=torch.float32).to(device)
    return _SIGNS[key]


def hadamard_transform(x: Tensor) -> Tensor:
    """x (rows, n) times the block-diagonal transform along its last dimension, float32 (rows, ceil16(n)): each run of
    16 columns (n zero-padded to a multiple of 16 first) times H = D * Had16 / 4, in the fixed order of the module
    docstring: signs, butterflies on pairs 1, 2, 4, 8 apart, times 1/4. Equals `x @ hadamard_matrix()` per block up to
    float32 rounding."""
    size = HADAMARD_SIZE
    rows, n = x.shape
    padded = -(-n // size) * size
    x32 = x.to(torch.float32).contiguous()
    if padded != n:
        x32 = torch.nn.functional.pad(x32, (0, padded - n))
    y = x32.view(-1, size) * _signs_on(x.device)  # exact
    h = 1
    while h < size:
        y = y.view(-1, size // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return y.reshape(rows, padded) * 0.25


# -- the random stream of stochastic rounding ---------------------------------------------------------------------
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_ROUNDS = 10
_U32 = 0xFFFFFFFF
#: numbers drawn per pass of `philox_uniform` (its int64 temporaries are ~100 bytes per number)
_PHILOX_CHUNK = 1 << 22
#: Triton's uint_to_uniform_float scale for 32-bit draws: the largest float32 with (2^31 - 1) * scale < 1
_UNIFORM_SCALE = 4.6566127342e-10


def _mulhilo(constant: int, c: Tensor) -> Tuple[Tensor, Tensor]:
    """(high, low) 32 bits of constant * c for a 32-bit constant and int64 tensors holding 32-bit values, without an
    int64 overflow (the constant split into 16-bit halves)."""
    p1 = c * (constant >> 16)  # < 2^48
    p0 = c * (constant & 0xFFFF)  # < 2^48
    high = (p1 + (p0 >> 16)) >> 16
    low = (((p1 & 0xFFFF) << 16) + p0) & _U32
    return high, low


def philox4x32(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor,
               rounds: int = PHILOX_ROUNDS) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011; Random123's philox4x32_10 and
    Triton's `philox_impl`): the four 32-bit output words of counter (c0, c1, c2, c3) under key (k0, k1), every word an
    int64 tensor holding a 32-bit value."""
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _U32, (k1 + _PHILOX_KEY_B) & _U32
    return c0, c1, c2, c3


def philox_uniform(seed, offsets: Tensor) -> Tensor:
    """Uniform float32 numbers in [0, 1), one per int64 offset: Triton's `tl.rand(seed, offset)` (Philox4x32-10 with
    key (seed low 32 bits, seed high 32 bits) and counter (offset low 32 bits, offset high 32 bits, 0, 0); the first
    word, read as an int32 x, mapped to (x < 0 ? ~x : x) * 4.6566127342e-10 in float32), in torch integer ops. `seed`:
    an int or an int64 0-d tensor (on offsets' device)."""
    offsets = offsets.to(torch.int64)
    seed = torch.as_tensor(seed, dtype=torch.int64, device=offsets.device)
    if offsets.numel() > _PHILOX_CHUNK:  # bounded temporaries (a dozen int64 words per element while it runs)
        flat = offsets.reshape(-1)
        out = torch.empty(flat.shape, dtype=torch.float32, device=offsets.device)
        for start in range(0, flat.numel(), _PHILOX_CHUNK):
            out[start:start + _PHILOX_CHUNK] = philox_uniform(seed, flat[start:start + _PHILOX_CHUNK])
        return out.view(offsets.shape)
    zero = torch.zeros_like(offsets)
    word, _, _, _ = philox4x32(offsets & _U32, (offsets >> 32) & _U32, zero, zero, seed & _U32, (seed >> 32) & _U32)
    signed = torch.where(word >= 2**31, word - 2**32, word)
    magnitude = torch.where(signed < 0, ~signed, signed)
    return magnitude.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=offsets.device)


# -- helpers and the GEMM ----------------------------------------------------------------------------------------
def per_tile(x: Tensor, values: Tensor, tile: Sequence[int], op: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """op(x, the value of each element's tile) for a 2-D float32 x: broadcast over a blocked view where the tiles
    divide x, else over the values expanded to x's shape (ragged tiles cut)."""
    (m, n), (tr, tc) = x.shape, tile_extent(tile, x.shape)
    if m % tr == 0 and n % tc == 0 and x.is_contiguous():
        gr, gc = m // tr, n // tc
        return op(x.view(gr, tr, gc, tc), values.reshape(gr, 1, gc, 1)).view(m, n)
    return op(x, expand_tiles(values, tile, x.shape))


def operand_values(x: Tensor, contraction_dim: int) -> Tensor:
    """The float32 element values of a GEMM operand: FP8 exactly; FP4 unpacked along its contraction dimension (the
    one it is packed along: 1 for the first operand, 0 for the second), through a table of the value pair of every
    byte (one gather instead of unpacking codes)."""
    if x.dtype != E2M1.dtype:
        return x.to(torch.float32)
    if contraction_dim == 0 and x.dim() == 2:
        return operand_values(x.t(), 1).t()
    # the bytes made contiguous, not the FP4 tensor: torch 2.8 has no copy kernel for float4_e2m1fn_x2
    pairs = _fp4_pair_table(x.device).index_select(0, x.view(torch.uint8).contiguous().reshape(-1).to(torch.int32))
    return pairs.view(*x.shape[:-1], 2 * x.shape[-1])


_FP4_PAIRS: dict = {}


def _fp4_pair_table(device) -> Tensor:
    """(256, 2) float32: the two E2M1 values of each byte (low nibble first)."""
    key = str(device)
    if key not in _FP4_PAIRS:
        codes = torch.arange(256, dtype=torch.int32)
        _FP4_PAIRS[key] = torch.stack([fp4_values(codes & 0x0F), fp4_values(codes >> 4)], dim=-1).to(device)
    return _FP4_PAIRS[key]


def gemm_reference(
    a: Tensor,
    a_scale: Tensor,
    a_tile: Tile,
    b: Tensor,
    b_scale: Tensor,
    b_tile: Tile,
    out_dtype: torch.dtype,
    bias: Optional[Tensor] = None,
    a_tensor_scale: Optional[Tensor] = None,
    b_tensor_scale: Optional[Tensor] = None,
) -> Tensor:
    """The GEMM of two block-scaled operands (MXFP8, NVFP4) as the tensor cores define it: per K block, the partial
    product of the exact element values in float32, times the two blocks' scales, summed in float32; times the
    product of the tensor scales (NVFP4); plus bias; rounded once to out_dtype. FP4 operands are packed along K."""
    a32, b32 = operand_values(a, 1), operand_values(b, 0)
    k = min(a32.shape[1], b32.shape[0])  # an odd K: both operands carry the same zero padding, dropped here
    a32, b32 = a32[:, :k], b32[:k, :]
    acc = tiled_gemm_reference(a32, a_scale.to(torch.float32), a_tile, b32, b_scale.to(torch.float32), b_tile,
                               torch.float32)
    if a_tensor_scale is not None or b_tensor_scale is not None:
        acc = acc * _tensor_scale_product(a_tensor_scale, b_tensor_scale, acc)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def _tensor_scale_product(a_scale: Optional[Tensor], b_scale: Optional[Tensor], like: Tensor) -> Tensor:
    one = torch.ones((), dtype=torch.float32, device=like.device)
    ga = a_scale.to(torch.float32).reshape(()) if a_scale is not None else one
    gb = b_scale.to(torch.float32).reshape(()) if b_scale is not None else one
    return ga * gb
