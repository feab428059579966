"""How each tensor role of an FP8 layer is cast: one caster per scaling family, chosen from the recipe
(`caster_for`), each turning the recipe into the arguments of one cast op (lightning_fp8/kernels) and the op's output
into an `FP8Operand`. The ops read the role's amax history, derive the scale on the device, cast, and record the
tensor's amax into the history's open slot. Also here: the scale a cast uses, for observers (`observed_cast_scale`), and a
cast with a known scale and no state (`cast_to_fp8`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from lightning_fp8 import kernels
from lightning_fp8.kernels.device import profile_of
from lightning_fp8.modules.layer_state import ROLE_INDEX, RoleState, stochastic_rounding_state
from lightning_fp8.modules.operand import FP8Matrix, FP8Operand
from lightning_fp8.numerics import microscaling
from lightning_fp8.numerics.formats import FP8Format
from lightning_fp8.numerics.scaling import cast_scale as _cast_scale
from lightning_fp8.numerics.tiles import expand_tiles, operand_tiles, tile_amax, tile_scales
from lightning_fp8.recipe import FP8Recipe

Tensor = torch.Tensor


def scaling_mode(recipe: FP8Recipe, role: str, record: bool) -> str:
    """The per-tensor scaling of a cast: "none" for an unscaled role, current scaling outside training (evaluation
    never uses or changes the training state), else the recipe's. (Tiled recipes have no per-tensor scaling.)"""
    if not recipe.uses_scaling_for(role):
        return "none"
    return recipe.scaling if record else "current"


class Caster:
    """Casts the tensor roles of a layer for one scaling family (Transformer Engine's Quantizer; torchao's
    Float8TrainingTensor constructors). `caster_for(recipe)` picks the family once from the recipe.

    Every method takes 2-D tensors; `history` is the layer's [3, L+1] amax history (FP8LayerState.amax_history)."""

    def __init__(self, recipe: FP8Recipe) -> None:
        self.recipe = recipe

    def cast(self, x: Tensor, history: Tensor, role: str, record: bool, layouts: Tuple[bool, bool] = (True, False),
             pad_to: int = 1, history_sized: bool = False, generator: Optional[torch.Generator] = None) -> FP8Operand:
        """Cast `x` as `role` (one op): FP8Operand with the layouts asked for, layouts = (x, x^T); x^T's columns
        (the tokens, for an activation or a gradient) zero-padded to a multiple of `pad_to`.

        record: training (the role's amax goes into the history's open slot, the recipe's scaling applies);
        evaluation (False) leaves the state alone. history_sized: the engine knows the role's history sizes a delayed
        scale (a per-tensor delayed cast then skips its amax pre-pass). generator: the noise of stochastic rounding."""
        raise NotImplementedError

    def weight_for_dgrad(self, weight: Tensor, history: Tensor, scale: Optional[Tensor],
                         scale_inv: Optional[Tensor]) -> FP8Matrix:
        """W (out, in) as the input-gradient GEMM's second operand, cast again in backward as the forward cast it:
        with the forward's `scale` (per-tensor) or statelessly (tiled scales depend on the weight only)."""
        raise NotImplementedError

    def token_padding(self, x: Tensor, transposed: bool) -> int:
        """The multiple x^T's token columns are padded to in the cast that writes them, so the weight-gradient GEMM,
        which contracts the tokens, needs no padding copy: 1 where nothing is padded."""
        return 1

    def _noise(self, role: str, shape, device, generator) -> Optional[Tensor]:
        if self.recipe.rounding_for(role) != "stochastic":
            return None
        return torch.rand(tuple(shape), generator=generator, device=device, dtype=torch.float32)


class PerTensorCaster(Caster):
    """One scale per tensor (scaling "delayed" / "current"): `lightning_fp8::scaled_cast`, whose scale comes from the
    role's amax history (delayed) or the tensor's own amax (current). The cast always writes x; x^T only where the
    device writes it in the same pass (CUDA), else `FP8Operand.matrix_t` is a view of x."""

    def cast(self, x, history, role, record, layouts=(True, False), pad_to=1, history_sized=False, generator=None):
        recipe = self.recipe
        write_t = layouts[1] and kernels.materializes_transpose(x)
        data, data_t, scale, scale_inv = kernels.scaled_cast(
            x, history, ROLE_INDEX[role], recipe.format_for(role), scaling_mode(recipe, role, record),
            recipe.amax_compute_algo == "max", recipe.margin, recipe.power_of_2_scales, write_t=write_t,
            record=record, noise=self._noise(role, x.shape, x.device, generator), pad_to=pad_to if write_t else 1,
            history_sized=record and history_sized,
        )
        transposed = FP8Matrix(data_t, scale_inv) if data_t is not None else None
        return FP8Operand(FP8Matrix(data, scale_inv), transposed, scale)

    def weight_for_dgrad(self, weight, history, scale, scale_inv):
        fmt = self.recipe.format_for("weight")
        if kernels.materializes_transpose(weight):  # the layout the scaled GEMM reads: W^T row-major
            return FP8Matrix(cast_to_fp8(weight, scale, fmt, layout="t"), scale_inv).t()
        return FP8Matrix(cast_to_fp8(weight, scale, fmt), scale_inv)

    def token_padding(self, x, transposed):
        # torch's scaled GEMM takes its contraction in multiples of 16
        return 16 if transposed and kernels.materializes_transpose(x) and x.shape[0] % 16 else 1


class TiledCaster(Caster):
    """One scale per tile, stateless (scaling "rowwise" / "blockwise"): `lightning_fp8::tiled_cast`, both layouts in
    one op; the history only records the tensor's amax (overflow detection, monitoring)."""

    def cast(self, x, history, role, record, layouts=(True, False), pad_to=1, history_sized=False, generator=None):
        recipe = self.recipe
        tile, tile_t = operand_tiles(recipe.scaling, recipe.block_size, role)
        tile, tile_t = (tile if layouts[0] else ()), (tile_t if layouts[1] else ())
        (q, s), (q_t, s_t) = kernels.tiled_cast(
            x, history, ROLE_INDEX[role], recipe.format_for(role), tile, tile_t, recipe.margin,
            recipe.power_of_2_scales, record=record, noise=self._noise(role, x.shape, x.device, generator),
            pad_to=pad_to,
        )
        return FP8Operand(FP8Matrix(q, s, tile) if q is not None else None,
                          FP8Matrix(q_t, s_t, tile_t) if q_t is not None else None)

    def weight_for_dgrad(self, weight, history, scale, scale_inv):
        return self.cast(weight, history, "weight", False, layouts=(False, True)).transposed.t()

    def token_padding(self, x, transposed):
        if not profile_of(x.device).is_cuda:
            return 1  # the emulation takes any shape
        return int(self.recipe.block_size) if self.recipe.scaling == "blockwise" else 16


class MicroscaledCaster(Caster):
    """Blackwell's block-scaled formats (scaling "mxfp8" / "nvfp4"): `lightning_fp8::microscaled_cast`, both layouts
    in one op, with NVFP4's float32 tensor scale and, on the weight-gradient GEMM's operands (x^T, dY^T), its random
    Hadamard transform. The cast writes each layout padded to the scaled GEMM's multiples and its scales swizzled
    (kernels/microscaled_ops.py). NVFP4's stochastic rounding draws from the layer's own Philox stream
    (`fp8_meta.stochastic_rounding_state`: seed and offset kept with the layer's FP8 state), never from torch's global
    generator; MXFP8 rounds to nearest even."""

    def cast(self, x, history, role, record, layouts=(True, False), pad_to=1, history_sized=False, generator=None):
        recipe = self.recipe
        tile, tile_t = operand_tiles(recipe.scaling, recipe.block_size, role)
        tile, tile_t = (tile if layouts[0] else ()), (tile_t if layouts[1] else ())
        hadamard = recipe.random_hadamard and role != "weight"
        rng_state = None
        if recipe.scaling == "nvfp4" and recipe.rounding_for(role) == "stochastic":
            rng_state = stochastic_rounding_state(history, x.device, generator)
        (q, s, g), (q_t, s_t, g_t) = kernels.microscaled_cast(
            x, history, ROLE_INDEX[role], recipe.scaling, recipe.format_for(role), tile, tile_t, hadamard_t=hadamard,
            record=record, rng_state=rng_state,
        )
        return FP8Operand(FP8Matrix(q, s, tile, g) if q is not None else None,
                          FP8Matrix(q_t, s_t, tile_t, g_t) if q_t is not None else None)

    def weight_for_dgrad(self, weight, history, scale, scale_inv):
        # where the forward did not keep W^T (FSDP2: keep_weight_transpose False): cast it again, the same bytes
        return self.cast(weight, history, "weight", False, layouts=(False, True)).transposed.t()


class GroupedCaster(Caster):
    """The casts of an experts layer's grouped GEMMs (numerics/groups.py), rowwise: x and dy in row tiles (a scale per
    token), the 3-D weight (E, N, K) per expert output row (the forward) and, cast again, per expert input column (its
    per-expert transpose, what the input-gradient GEMM reads), and x^T / dy^T with a scale per (expert, column) over
    that expert's tokens (`lightning_fp8::grouped_cast`: the weight-gradient GEMM contracts each expert's tokens).
    `offsets`: the int32 end rows of each expert's tokens (sorted by expert)."""

    def __init__(self, recipe: FP8Recipe, offsets: Tensor) -> None:
        super().__init__(recipe)
        if recipe.scaling != "rowwise":
            raise ValueError(f"grouped FP8 GEMMs cast rowwise; got FP8Recipe(scaling={recipe.scaling!r}) "
                             "(lightning_fp8/modules/grouped_linear.py `grouped_recipe` derives an experts layer's recipe)")
        self.offsets = offsets

    def cast(self, x, history, role, record, layouts=(True, False), pad_to=1, history_sized=False, generator=None):
        recipe, index = self.recipe, ROLE_INDEX[role]
        fmt, margin, power_of_2 = recipe.format_for(role), recipe.margin, recipe.power_of_2_scales
        noise = self._noise(role, x.shape, x.device, generator)
        matrix = transposed = None
        if x.dim() == 3:  # the weight, one (N, K) matrix per expert
            experts, n, k = x.shape
            if layouts[0]:
                (q, s), _ = kernels.tiled_cast(x.reshape(experts * n, k), history, index, fmt, (1, 0), (), margin,
                                               power_of_2, record=record)
                matrix = FP8Matrix(q.view(experts, n, k), s.view(experts, n, 1), (1, 0))
            if layouts[1]:
                # each expert's W^T: the (E * N, K) rows grouped by expert, cast per (expert, column) and written
                # transposed, (K, E * N), one launch; viewed as the experts' (K, N) matrices
                ends = torch.arange(1, experts + 1, device=x.device, dtype=torch.int32) * n
                q_t, s_t = kernels.grouped_cast(x.reshape(experts * n, k), history, index, fmt, ends, margin,
                                                power_of_2, record=record and not layouts[0])
                transposed = FP8Matrix(q_t.view(k, experts, n).permute(1, 0, 2), s_t.unsqueeze(-1), (1, 0))
            return FP8Operand(matrix, transposed)
        if layouts[0]:
            (q, s), _ = kernels.tiled_cast(x, history, index, fmt, (1, 0), (), margin, power_of_2, record=record,
                                           noise=noise)
            matrix = FP8Matrix(q, s, (1, 0))
        if layouts[1]:
            q_t, s_t = kernels.grouped_cast(x, history, index, fmt, self.offsets, margin, power_of_2,
                                            record=record and not layouts[0], noise=noise)
            transposed = FP8Matrix(q_t, s_t.unsqueeze(-1), (1, 0))
        return FP8Operand(matrix, transposed)

    def weight_for_dgrad(self, weight, history, scale, scale_inv):
        return self.cast(weight, history, "weight", False, layouts=(False, True)).transposed.t()


def caster_for(recipe: FP8Recipe, offsets: Optional[Tensor] = None) -> Caster:
    """The caster of `recipe`'s scaling family; with `offsets`, the grouped GEMMs' of an experts layer."""
    if offsets is not None:
        return GroupedCaster(recipe, offsets)
    if recipe.microscaled:
        return MicroscaledCaster(recipe)
    if recipe.fine_grained:
        return TiledCaster(recipe)
    return PerTensorCaster(recipe)


def observed_cast_scale(
    x: Tensor, amax: Tensor, state: RoleState, recipe: FP8Recipe, role: str, record: bool, fmt: FP8Format
) -> Tensor:
    """The scale the cast of `x` (amax `amax`) uses under the recipe: observers call it to see what the cast saw.

    Fine-grained recipes: one scale per element of x (its tile's, for the layout of the first GEMM the role feeds:
    x and dy in row tiles, W in its blocks / rows), x's shape (a leading batch shape is flattened into rows). For the
    microscaling recipes, the multiplier each element is cast with: 2^-e of its MX block, 1 / (s * g) of its NVFP4
    block."""
    if recipe.fine_grained:
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        tile, _ = operand_tiles(recipe.scaling, recipe.block_size, role)
        amax_tiles = tile_amax(x2d, tile)
        if recipe.scaling == "mxfp8":
            scales = microscaling.e8m0_reciprocal(microscaling.mx_scales(amax_tiles, fmt))
        elif recipe.scaling == "nvfp4":
            g = microscaling.nvfp4_tensor_scale(amax_tiles.amax() if amax_tiles.numel() else amax)
            scales = (microscaling.nvfp4_block_scales(amax_tiles, g).to(torch.float32) * g).reciprocal()
        else:
            scales = tile_scales(amax_tiles, fmt, recipe.margin, recipe.power_of_2_scales)
        return expand_tiles(scales, tile, x2d.shape).reshape(x.shape)
    return _cast_scale(
        state.amax_history.to(amax.device),
        amax,
        fmt.max,
        scaling_mode(recipe, role, record),
        recipe.amax_compute_algo == "max",
        recipe.margin,
        recipe.power_of_2_scales,
    )


def cast_to_fp8(
    x: Tensor,
    scale: Tensor,
    fmt: FP8Format,
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
    layout: str = "row",
):
    """`quantize` with a known scale and no state (backward's re-cast of the weight with the forward's scale), on
    the fused kernel where available. layout: "row" -> x_fp8; "t" -> x_fp8^T contiguous (2-D x);
    "both" -> (x_fp8, x_fp8^T)."""
    if layout not in ("row", "t", "both"):
        raise ValueError(f"unknown layout {layout!r}; valid: ['row', 't', 'both']")
    if layout != "row" and x.dim() != 2:
        raise ValueError(f"layout={layout!r} needs a 2-D tensor, got shape {tuple(x.shape)}")
    x2d = x if x.dim() == 2 else (x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1))
    noise = torch.rand(x2d.shape, generator=generator, device=x.device) if rounding == "stochastic" else None
    # one `lightning_fp8::fp8_cast` op: the reference on CPU, the Triton kernel on CUDA
    out, out_t, _ = kernels.fp8_cast(
        x2d, scale, fmt, write_row=layout != "t", write_t=layout != "row", compute_amax=False, noise=noise
    )
    if layout == "row":
        return out.reshape(x.shape)
    return out_t if layout == "t" else (out, out_t)
